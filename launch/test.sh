#!/usr/bin/env bash
# Runs the test suite on CPU (installs first when needed). Extra arguments go to pytest, e.g. -m "not slow".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/install.sh"
venv="${MEDUSA_VENV:-$root/.venv}"
cd "$root"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/medusa-train/torch_extensions}"
exec "$venv/bin/python" -m pytest "$@"
