#!/usr/bin/env bash
# vLLM at both ends on a small SmolLM2-135M-Instruct export, from a clean clone:
#   1. both environments (launch/install.sh, launch/install_vllm.sh);
#   2. unless VLLM_DEMO_EXPORT names an export: small heads (120 ShareGPT conversations self-distilled through vLLM,
#      4,096-token head vocabulary, 5 epochs; about 15 minutes on a 2-core CPU) under $VLLM_DEMO_OUT/export;
#   3. medusa-eval with our decoders and vLLM's side by side on MT-Bench first turns, one per category, fp32,
#      32 new tokens -> $VLLM_DEMO_OUT/eval/summary.json (rows vanilla, medusa, vllm, vllm_medusa).
# Knobs: VLLM_DEMO_OUT (runs/vllm_demo), VLLM_DEMO_EXPORT (an existing export: skips step 2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/install.sh
bash launch/install_vllm.sh
venv="${MEDUSA_VENV:-$root/.venv}"
export PATH="$venv/bin:$PATH" WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${VLLM_DEMO_OUT:-runs/vllm_demo}"
export_dir="${VLLM_DEMO_EXPORT:-$out/export}"
if [[ -z "${VLLM_DEMO_EXPORT:-}" ]]; then
  resume=false
  [[ -d "$out/checkpoints" || -d "$out/export" || -d "$out/self_distill" ]] && resume=true
  echo "== small heads for SmolLM2-135M-Instruct -> $export_dir"
  medusa-train model=smollm2_135m model.dtype=float32 data=sharegpt data.self_distill=true \
    data.self_distill_engine=vllm data.max_conversations=120 data.max_prompt_tokens=128 data.max_new_tokens=128 \
    data.generation_batch_size=64 data.eval_fraction=0.03 max_length=256 hidden_cache=true \
    heads.head_vocab_size=4096 trainer=cpu trainer.precision=fp32 trainer.learning_rate=2e-3 \
    trainer.num_train_epochs=5 trainer.per_device_train_batch_size=8 trainer.save_steps=1000 \
    output_dir="$out" resume="$resume"
fi
echo "== medusa-eval: vanilla, medusa, vllm, vllm_medusa on MT-Bench first turns -> $out/eval"
medusa-eval export_dir="$export_dir" output_dir="$out/eval" prompts=mt_bench per_category=1 max_turns=1 \
  max_new_tokens=32 dtype=float32 'decoders=[vanilla,medusa,vllm,vllm_medusa]'
