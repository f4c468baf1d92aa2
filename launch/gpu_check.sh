#!/usr/bin/env bash
# One prepared check for a machine with NVIDIA GPUs, meant to finish in under 15 minutes (pip caches warm), printing
# one table at the end:
#   1. install: the project's venv (launch/install.sh: torch==2.13.0 pinned, PyPI's Linux wheel is the CUDA build)
#      and checks that torch sees CUDA; vLLM's own venv with launch/install_vllm.sh when that script exists;
#   2. train: Medusa-1 heads on SmolLM2-135M-Instruct for a few steps, bf16, DDP over nccl under torchrun: one
#      rank, then two ranks when the machine has 2+ GPUs;
#   3. medusa-tune-tree on the GPU (dtype=auto: bf16 there), then medusa-eval: vanilla, Medusa, the draft model,
#      Lookahead and the Hugging Face peers on MT-Bench first turns (one per category);
#   4. vLLM: benchmarks/serve_vllm.py, plain decoding against vLLM's Medusa speculator on the same export;
#   5. EAGLE-3, the same path for its drafter (heads=eagle3 on SmolLM2): train a few steps with nccl (one rank, two
#      with 2+ GPUs) and export it with the speculators/ folder vLLM reads, medusa-tune-tree (static and dynamic
#      tree), medusa-eval of our tree decoder on it against vanilla, and vLLM serving the drafter (serve_vllm.py --k 3).
# Every step's output goes to $GPU_CHECK_OUT/logs/<step>.log; a failed step is reported and the steps that need it
# are skipped. Options:
#   --dry-run       the same steps at toy size on a CPU (gloo instead of nccl, fp32 training, two CPU ranks, no
#                   vLLM): checks the script itself where no GPU is at hand
#   --skip-install  use the venv as it is
#   --skip-vllm     no vLLM install or run
# Environment: GPU_CHECK_OUT (default runs/gpu_check/<date-time>: a new folder each time), MEDUSA_VENV (.venv),
# MEDUSA_VLLM_VENV (install_vllm.sh's).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=false skip_install=false skip_vllm=false
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=true ;;
    --skip-install) skip_install=true ;;
    --skip-vllm) skip_vllm=true ;;
    *) echo "usage: launch/gpu_check.sh [--dry-run] [--skip-install] [--skip-vllm]" >&2; exit 2 ;;
  esac
done
out="${GPU_CHECK_OUT:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}"
venv="${MEDUSA_VENV:-$root/.venv}"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ "$dry" != true && "$gpus" -eq 0 ]]; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU run launch/gpu_check.sh --dry-run" >&2
  exit 2
fi
if [[ -e "$out/steps.tsv" ]]; then
  echo "gpu_check: $out holds an earlier check; choose another GPU_CHECK_OUT" >&2
  exit 2
fi
mkdir -p "$out/logs"
: > "$out/steps.tsv"
export WANDB_MODE="${WANDB_MODE:-offline}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever the venv was installed from

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, record it; returns its status
  local name="$1" limit="$2"; shift 2
  local log="$out/logs/$name.log" start=$SECONDS status
  echo "== $name: $*"
  if timeout "$limit" "$@" > "$log" 2>&1; then status=ok; else status="FAILED (exit $?)"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$log" >> "$out/steps.tsv"
  echo "   $status after $((SECONDS - start)) s"
  [[ "$status" == ok ]]
}
skip() {  # skip NAME REASON
  printf '%s\t%s\t0\t\n' "$1" "skipped: $2" >> "$out/steps.tsv"
  echo "== $1: skipped ($2)"
}

# --- 1. install ---------------------------------------------------------------------------------------------------
if [[ "$skip_install" == true ]]; then skip install "--skip-install"
else step install 600 bash launch/install.sh; fi
py="$venv/bin/python"
export PATH="$venv/bin:$PATH"
if [[ "$dry" == true ]]; then
  device=cpu
  step torch 60 "$py" -c "import torch; print(torch.__version__, 'CPU:', torch.backends.cpu.get_cpu_capability())"
else
  device=cuda
  step torch 60 "$py" -c "import torch; assert torch.cuda.is_available() and torch.version.cuda, \
'torch has no CUDA: pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'; \
print(torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0), 'x', torch.cuda.device_count())" \
    || { python benchmarks/gpu_check.py report "$out" 2>/dev/null || cat "$out/steps.tsv"; exit 1; }
fi
vllm_ready=false
if [[ "$dry" == true ]]; then skip install_vllm "dry run"
elif [[ "$skip_vllm" == true ]]; then skip install_vllm "--skip-vllm"
elif [[ ! -f launch/install_vllm.sh ]]; then skip install_vllm "launch/install_vllm.sh is not in this checkout"
elif step install_vllm 600 bash launch/install_vllm.sh; then vllm_ready=true; fi

# --- 2. train: a few steps of Medusa-1 heads on SmolLM2, DDP under torchrun ----------------------------------------
if [[ "$dry" == true ]]; then
  # toy size on the CPU: fp32, gloo, one thread per rank
  train=(model=smollm2_135m model.dtype=float32 trainer=ddp trainer.use_cpu=true trainer.ddp_backend=gloo
         trainer.precision=fp32 trainer.max_steps=2 trainer.per_device_train_batch_size=2 trainer.logging_steps=1
         data=sharegpt data.max_conversations=24 data.eval_fraction=0.1 max_length=96 export_vllm=true)
  medusa_heads=(heads.head_vocab_size=2048)
  eagle3_heads=(heads=eagle3 heads.head_vocab_size=2048)
  launcher=(env OMP_NUM_THREADS=1 torchrun)  # two CPU ranks on a shared machine: one thread each
  tune=(device=cpu dtype=float32 prompts.num_prompts=2 max_new_tokens=8 'latency_sizes=[1,2,4]' context_length=32 repeats=1
        max_nodes=7 timed_prompts=1 timed_new_tokens=8)
  tune_dynamic=('dynamic_depths=[2]' 'dynamic_topks=[2]')  # EAGLE-3's dynamic tree: one shape per total
  eval_args=(device=cpu dtype=float32 num_prompts=1 max_new_tokens=8 warmup=0 decoder.draft.num_layers=4
             decoder.hf_assisted.num_layers=4)
  ranks2=true
else
  train=(model=smollm2_135m model.dtype=bfloat16 trainer=ddp trainer.ddp_backend=nccl trainer.precision=bf16
         trainer.max_steps=30 trainer.per_device_train_batch_size=8 trainer.logging_steps=5 trainer.learning_rate=1e-3
         data=sharegpt data.max_conversations=600 max_length=256 export_vllm=true)
  medusa_heads=()  # full-vocabulary heads: vLLM 0.32's Medusa loader needs per-head lm_heads of the whole vocabulary
  eagle3_heads=(heads=eagle3)  # vLLM's default taps (2, 15, 27) and a reduced draft vocabulary (d2t, t2d)
  tune=(device=cuda prompts.num_prompts=8 max_new_tokens=48 'latency_sizes=[1,2,4,8,16,32,64]' repeats=5
        max_nodes=63)
  tune_dynamic=('dynamic_depths=[3,5]' 'dynamic_topks=[8]')  # EAGLE-3's dynamic tree: a short shortlist
  eval_args=(device=cuda per_category=1 max_new_tokens=64)
  launcher=(torchrun)
  ranks2=$([[ "$gpus" -ge 2 ]] && echo true || echo false)
fi
export_dir="$out/single/export"
trained=false
step train_1rank 420 "${launcher[@]}" --standalone --nproc_per_node=1 -m medusa_train.cli.train "${train[@]}" \
  "${medusa_heads[@]}" output_dir="$out/single" hydra.run.dir="$out/single/hydra" && trained=true
if [[ "$ranks2" == true ]]; then
  step train_2ranks 420 "${launcher[@]}" --standalone --nproc_per_node=2 -m medusa_train.cli.train "${train[@]}" \
    "${medusa_heads[@]}" output_dir="$out/ddp2" hydra.run.dir="$out/ddp2/hydra"
else skip train_2ranks "one GPU"; fi

# --- 3. tune the tree, then every decoder side by side -------------------------------------------------------------
if [[ "$trained" == true ]]; then
  step tune_tree 300 medusa-tune-tree export_dir="$export_dir" "${tune[@]}" \
    && step eval 420 medusa-eval export_dir="$export_dir" output_dir="$out/eval" prompts=mt_bench max_turns=1 \
         progress=false plots=false "${eval_args[@]}"
else skip tune_tree "no export"; skip eval "no export"; fi

# --- 4. vLLM: plain decoding against its Medusa speculator -----------------------------------------------------------
# serve_vllm.py reads the export's base itself; batches of 1 and 8 prompts (its default)
serve=(--num-prompts 8 --max-new-tokens 64 --dtype bfloat16 --max-model-len 2048)
[[ "$vllm_ready" == true ]] && export MEDUSA_VLLM_VENV="${MEDUSA_VLLM_VENV:-$root/.venv-vllm}"
if [[ "$dry" == true ]]; then skip vllm "dry run (vLLM's Medusa speculator needs CUDA)"
elif [[ "$skip_vllm" == true ]]; then skip vllm "--skip-vllm"
elif [[ "$trained" != true ]]; then skip vllm "no export"
else
  step vllm 420 "$py" benchmarks/serve_vllm.py --export "$export_dir" "${serve[@]}" --output "$out/vllm.json"
fi

# --- 5. EAGLE-3: train with nccl, export (speculators/ included), tune, our tree decoder, vLLM serving the drafter ---
eagle3_export="$out/eagle3/export"
eagle3_trained=false
step train_eagle3_1rank 420 "${launcher[@]}" --standalone --nproc_per_node=1 -m medusa_train.cli.train \
  "${train[@]}" "${eagle3_heads[@]}" output_dir="$out/eagle3" hydra.run.dir="$out/eagle3/hydra" && eagle3_trained=true
speculators=false  # the folder vLLM serves, written by the export (export_vllm=true) after the exporter's checks
if [[ "$eagle3_trained" == true ]]; then
  step export_eagle3 60 "$py" -c "import json, sys; c = json.load(open(sys.argv[1])); \
assert c['speculators_model_type'] == 'eagle3', c; print({k: c.get(k) for k in ('speculators_model_type', \
'draft_vocab_size', 'eagle_aux_hidden_state_layer_ids', 'norm_before_residual')})" \
    "$eagle3_export/speculators/config.json" && speculators=true
else skip export_eagle3 "no EAGLE-3 export"; fi
if [[ "$ranks2" == true ]]; then
  step train_eagle3_2ranks 420 "${launcher[@]}" --standalone --nproc_per_node=2 -m medusa_train.cli.train \
    "${train[@]}" "${eagle3_heads[@]}" output_dir="$out/eagle3_ddp2" hydra.run.dir="$out/eagle3_ddp2/hydra"
else skip train_eagle3_2ranks "one GPU"; fi
if [[ "$eagle3_trained" == true ]]; then
  step tune_tree_eagle3 300 medusa-tune-tree export_dir="$eagle3_export" "${tune[@]}" "${tune_dynamic[@]}" \
    && step eval_eagle3 420 medusa-eval export_dir="$eagle3_export" output_dir="$out/eval_eagle3" prompts=mt_bench \
         max_turns=1 progress=false plots=false "${eval_args[@]}" 'decoders=[vanilla,medusa]'
else skip tune_tree_eagle3 "no EAGLE-3 export"; skip eval_eagle3 "no EAGLE-3 export"; fi
if [[ "$dry" == true ]]; then skip vllm_eagle3 "dry run"
elif [[ "$skip_vllm" == true ]]; then skip vllm_eagle3 "--skip-vllm"
elif [[ "$speculators" != true ]]; then skip vllm_eagle3 "no speculators/ in the EAGLE-3 export"
else
  step vllm_eagle3 420 "$py" benchmarks/serve_vllm.py --export "$eagle3_export" --k 3 "${serve[@]}" \
    --output "$out/vllm_eagle3.json"
fi

echo
"$py" benchmarks/gpu_check.py report "$out" | tee "$out/report.md"
! grep -q FAILED "$out/steps.tsv"
