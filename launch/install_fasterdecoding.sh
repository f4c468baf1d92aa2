#!/usr/bin/env bash
# Creates (or reuses) FasterDecoding's own environment, beside the project's, in which the tests open our exports
# with FasterDecoding's loader (PyPI medusa-llm 0.1 = FasterDecoding/Medusa v0.1): its patched Llama is transformers
# 4.31's and does not run under the project's transformers 5, so it gets a venv of its own, pinned. torch is
# installed FIRST and pinned (the CPU build where no GPU), then transformers 4.31 and its pinned dependencies, then
# medusa-llm without its dependencies (fschat, accelerate, sentencepiece: its loader does not import them).
# Usage: bash launch/install_fasterdecoding.sh; prints the venv path. MEDUSA_FASTERDECODING_VENV overrides the
# location (default: .venv-fasterdecoding in the checkout, where the tests look too).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/launch/venv.sh"
venv="${MEDUSA_FASTERDECODING_VENV:-$root/.venv-fasterdecoding}"
want="$(venv_stamp "$root/launch/install_fasterdecoding.sh")"
if venv_current "$venv" .medusa-installed "$want"; then
  echo "$venv"
  exit 0
fi
venv_with_torch "$venv" install_fasterdecoding
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
echo "[install_fasterdecoding] transformers 4.31 (what FasterDecoding v0.1's modeling_llama_kv was written for)" >&2
"${pip[@]}" "transformers==4.31.0" "tokenizers==0.13.3" "huggingface-hub==0.36.2" "safetensors==0.8.0" \
  "numpy==2.4.6"
echo "[install_fasterdecoding] medusa-llm==0.1 without its unused dependencies" >&2
"${pip[@]}" --no-deps "medusa-llm==0.1"
"$venv/bin/python" -c "import medusa.model.medusa_model" >/dev/null
echo "$want" > "$venv/.medusa-installed"
echo "$venv"
