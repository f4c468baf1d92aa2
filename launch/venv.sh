# Sourced by the install scripts (not run): each engine gets a virtual environment of its own, torch installed first
# and pinned into it (an unpinned torch pulls a multi-GB CUDA build on a CPU machine; where no GPU the index serves
# the CPU build), and a stamp, the hash of the scripts that built it, that makes a second run a no-op.
TORCH_VERSION="2.13.0"

# venv_stamp SCRIPT...: the stamp of an environment built by these files (and this one)
venv_stamp() { cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16; }

# venv_current VENV STAMP_FILE STAMP: true when VENV holds STAMP_FILE with STAMP in it (already built by these scripts)
venv_current() { [[ -f "$1/$2" && "$(cat "$1/$2")" == "$3" ]]; }

# venv_with_torch VENV TAG: make VENV with $PYTHON (default python3) unless it exists, then pip install the pinned torch
venv_with_torch() {
  [[ -x "$1/bin/python" ]] || "${PYTHON:-python3}" -m venv "$1"
  echo "[$2] torch==$TORCH_VERSION (CPU build where no GPU) into $1" >&2
  "$1/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
}
