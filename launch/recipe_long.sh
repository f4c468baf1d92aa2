#!/usr/bin/env bash
# The longer Medusa-1 recipe for SmolLM2-135M-Instruct on this kind of machine (2 CPU cores, fp32): the quickstart's
# recipe with about 3.5x the self-distilled data (2,400 ShareGPT conversations read: 1,811 first turns of at most
# 128 tokens), a head vocabulary of 8,192 tokens (4,096 miss 7-14% of held-out targets) and 3 epochs, stopping after
# the tree (no evaluation). Measured figures: docs/results.md, "Longer recipe".
# The quickstart's knobs still apply (QUICKSTART_* in launch/quickstart.sh), and every step resumes after a kill.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export QUICKSTART_OUT="${QUICKSTART_OUT:-runs/long}" QUICKSTART_CONVERSATIONS="${QUICKSTART_CONVERSATIONS:-2400}" \
  QUICKSTART_EPOCHS="${QUICKSTART_EPOCHS:-3}" QUICKSTART_EVAL="${QUICKSTART_EVAL:-false}" \
  QUICKSTART_HEAD_VOCAB="${QUICKSTART_HEAD_VOCAB:-8192}"
exec bash "$root/launch/quickstart.sh"
