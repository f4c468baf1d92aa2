#!/usr/bin/env bash
# One cell of the data-scaling table (docs/data-scaling.md): bash launch/recipe_scale.sh DRAFTER SIZE
#   DRAFTER: medusa (Medusa-1 heads), hydra (Hydra heads) or eagle3 (an EAGLE-3 drafter);
#   SIZE: 1 to 22, the multiple of the quickstart's data (SIZE x 700 ShareGPT conversations read, their
#   first turns of at most 128 tokens answered again by SmolLM2-135M-Instruct itself through vLLM's engine).
# The quickstart's recipe (launch/recipe_settings.sh, shared) trains into $SCALE_OUT/DRAFTER-SIZE/ (default
# runs/scale), and medusa-tune-tree tunes the tree of its export, $SCALE_OUT/DRAFTER-SIZE/export, on this CPU.
# The regenerated replies of a size, $SCALE_OUT/replies-SIZE/, are written by the first drafter trained at that size
# and read by the others. Every step resumes after a kill (medusa-train resume=true, sealed reply blocks); run one
# cell at a time per SCALE_OUT (the replies folder is shared). benchmarks/data_scaling.py runs the cells and
# evaluates them into the table.
# Knobs (environment variables): SCALE_OUT (runs/scale), SCALE_EPOCHS (5 at SIZE < 4, 3 at SIZE < 16, 2 from 16: the
# field trains 2-3 epochs on 500k samples), SCALE_HEAD_VOCAB (4096: the head / draft vocabulary), SCALE_TTT_STEPS
# (EAGLE-3's training-time-test steps; empty: the preset's), SCALE_PRECISION (trainer.precision; auto: bf16 where the
# CPU has bf16 instructions), SCALE_DTYPE (auto: the dtype the tree is tuned in), SCALE_DISTILL_ENGINE (vllm; hf
# generates with the fp32 training model, much slower), SCALE_TAG (appended to the run folder's name: a cell with other
# settings), MEDUSA_VLLM_VENV (.venv-vllm); for another target (benchmarks/coder_table.py: Qwen2.5-Coder-1.5B),
# SCALE_MODEL (its model/ preset; smollm2_135m), SCALE_MODEL_DTYPE (the frozen target's dtype in training and in the
# hidden-state cache; float32), SCALE_CODE_SHARE (data.code_share: the share of code conversations; empty: file order)
# and SCALE_EXCLUDE (data.exclude_prompts, e.g. humaneval: its problems never trained on). Give each target its own
# SCALE_OUT: the replies of a size are the target's.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
usage="usage: bash launch/recipe_scale.sh DRAFTER SIZE (DRAFTER: medusa, hydra or eagle3; SIZE: 1, 4, 16, ...)"
[[ $# -eq 2 ]] || { echo "$usage" >&2; exit 2; }
drafter="$1" size="$2"
case "$drafter" in
  medusa) heads=() ;;
  hydra) heads=(heads=hydra) ;;
  eagle3) heads=(heads=eagle3) ;;
  *) echo "DRAFTER=$drafter: choose medusa, hydra or eagle3. $usage" >&2; exit 2 ;;
esac
[[ "$size" =~ ^[1-9][0-9]*$ ]] || { echo "SIZE=$size: give a positive integer (the multiple of the quickstart's 700 conversations). $usage" >&2; exit 2; }
# SIZE x 700 ShareGPT conversations must stay below the held-out prompts the tuner and medusa-eval read (they start at
# conversation 16,000: SHAREGPT_HELDOUT_OFFSET in medusa_train/chat/prompts.py), so SIZE <= 16000 / 700 = 22 (MAX_SIZE in
# benchmarks/data_scaling.py); compared as text first, so no size overflows bash's 64-bit arithmetic
max_size=22
if ! { [[ ${#size} -le ${#max_size} ]] && (( size <= max_size )); }; then
  echo "SIZE=$size: give at most $max_size ($max_size x 700 = $(( max_size * 700 )) ShareGPT conversations; the" \
       "held-out prompts start at 16,000). $usage" >&2
  exit 2
fi
out="${SCALE_OUT:-runs/scale}"
epochs="${SCALE_EPOCHS:-$(( size < 4 ? 5 : size < 16 ? 3 : 2 ))}"
[[ "$epochs" =~ ^[1-9][0-9]*$ ]] || { echo "SCALE_EPOCHS=$epochs: give a positive integer" >&2; exit 2; }
ttt="${SCALE_TTT_STEPS:-}"
if [[ -n "$ttt" ]]; then
  [[ "$drafter" == eagle3 ]] || { echo "SCALE_TTT_STEPS=$ttt: only EAGLE-3 has training-time-test steps (DRAFTER=eagle3)" >&2; exit 2; }
  heads+=(heads.num_heads="$ttt")
fi
conversations=$(( 700 * size ))
model_preset="${SCALE_MODEL:-smollm2_135m}" model_dtype="${SCALE_MODEL_DTYPE:-float32}"
data_extra=()
[[ -n "${SCALE_CODE_SHARE:-}" ]] && data_extra+=(data.code_share="$SCALE_CODE_SHARE")
[[ -n "${SCALE_EXCLUDE:-}" ]] && data_extra+=("data.exclude_prompts=[$SCALE_EXCLUDE]")
head_vocab="${SCALE_HEAD_VOCAB:-4096}"
precision="${SCALE_PRECISION:-auto}"
dtype="${SCALE_DTYPE:-auto}"
tune_prompts=64 eval_tokens=64
distill_choice="${SCALE_DISTILL_ENGINE:-vllm}" distill_dtype=auto
source "$root/launch/recipe_settings.sh"  # vllm_ready, train, tune: the settings shared with the quickstart
if [[ "$distill_choice" == vllm && "$vllm_ready" != true ]]; then
  echo "SCALE_DISTILL_ENGINE=vllm: vLLM's environment $vllm_venv is not installed: run bash launch/install_vllm.sh" \
       "(or SCALE_DISTILL_ENGINE=hf, much slower)" >&2
  exit 2
fi
bash launch/install.sh
venv="${MEDUSA_VENV:-$root/.venv}"
export PATH="$venv/bin:$PATH" WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
run="$out/$drafter-$size${SCALE_TAG:+-$SCALE_TAG}"  # SCALE_TAG: a cell with other settings, in its own folder
echo "== $drafter x$size 1/2 medusa-train: $conversations ShareGPT conversations read, replies in $out/replies-$size, $epochs epochs -> $run/export"
if [[ -f "$run/trained.stamp" && -f "$run/export/config.json" ]]; then  # a finished run is not trained again
  echo "   done ($run/export)"
else
  medusa-train "${train[@]}" "${heads[@]}" data.self_distill_dir="$out/replies-$size" output_dir="$run" \
    resume="$(resumes "$run")"
  touch "$run/trained.stamp"
fi
tune_more=()
[[ "$drafter" == eagle3 ]] && tune_more=("${tune_eagle3[@]}")
stamp="$run/tuned.stamp"  # written once the tuner finished on this export (a retrained export is newer: tuned again)
if [[ -f "$stamp" && ! "$run/export/config.json" -nt "$stamp" ]]; then
  echo "== $drafter x$size 2/2 medusa-tune-tree: done (its files in $run/export)"
else
  echo "== $drafter x$size 2/2 medusa-tune-tree: the tree for this CPU (dtype=$dtype)"
  medusa-tune-tree export_dir="$run/export" "${tune[@]}" "${tune_more[@]}"
  touch "$stamp"
fi
echo "$run/export"
