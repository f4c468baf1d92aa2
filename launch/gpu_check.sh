#!/usr/bin/env bash
# One prepared check for the GPU machine, offline, meant to finish in under 9 minutes, printing one table at the end.
# That machine has no network, takes at most 64 MiB of the tree, and its image has torch, transformers, peft,
# accelerate, pyarrow and pandas but not hydra-core, omegaconf, datasets or deepspeed: those come as wheels that
# launch/gpu_wheels.sh fetched into the ignored .gpu_wheels/ on a CPU machine (carry that folder), installed here with
# `pip install --no-index --no-deps --target`. Every input is built here from a config (no Hub, no SmolLM2).
#   1. wheels: .gpu_wheels/*.whl into $GPU_CHECK_OUT/site (on PYTHONPATH after this checkout);
#   2. env: versions of torch, transformers, peft, accelerate, hydra, omegaconf, datasets, deepspeed, and the device;
#   3. inputs: the test suite's tiny Llama (2 layers, hidden 32) with its character tokenizer, and 40 conversations;
#   4. train_medusa1 / train_eagle3: a few Medusa-1 and EAGLE-3 training steps on the device (one process);
#   5. train_2groups: Medusa-1 as two torchrun groups of one process each (--nnodes=2 on one machine: both ranks on
#      the one GPU), nccl first, gloo when nccl refuses two ranks on one device (its "Duplicate GPU" check);
#   6. exact: greedy tree decoding = plain greedy decoding for Medusa, Hydra and EAGLE-3 random heads, fp32 and bf16;
#   7. memory: the memory plan (medusa_train.planning) against torch.cuda.max_memory_allocated for one real step;
#   8. speed: plain vs tree decoding tokens/s on a model built from a config with random weights (GPU_CHECK_CONFIG,
#      default .gpu_wheels/llama-3.1-8b.json, else ../shared/assets/configs/llama-3.1-8b.json, else the tiny model).
# Each step's output goes to $GPU_CHECK_OUT/logs/<step>.log; a failed step is reported and the steps that need it are
# skipped. Options:
#   --dry-run   the same steps at toy size on a CPU (fp32, gloo): checks the script where no GPU is at hand
# Environment: GPU_CHECK_OUT (default runs/gpu_check/<date-time>: a new folder each time), GPU_CHECK_PYTHON (default
# python3: the image's), GPU_CHECK_CONFIG (the speed step's config.json).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=false
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=true ;;
    *) echo "usage: launch/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done
out="${GPU_CHECK_OUT:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}"
py="${GPU_CHECK_PYTHON:-python3}"
if [[ "$dry" != true ]] && ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU run launch/gpu_check.sh --dry-run" >&2
  exit 2
fi
if [[ -e "$out/steps.tsv" ]]; then
  echo "gpu_check: $out holds an earlier check; choose another GPU_CHECK_OUT" >&2
  exit 2
fi
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
: > "$out/steps.tsv"
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$root:$out/site${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, then the carried wheels

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log it, record it; returns its status
  local name="$1" limit="$2"; shift 2
  local log="$out/logs/$name.log" start=$SECONDS status
  echo "== $name: $*"
  if timeout "$limit" "$@" > "$log" 2>&1; then status=ok; else status="FAILED (exit $?)"; fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "logs/$name.log" >> "$out/steps.tsv"
  echo "   $status after $((SECONDS - start)) s"
  [[ "$status" == ok ]]
}
skip() {  # skip NAME REASON
  printf '%s\t%s\t0\t\n' "$1" "skipped: $2" >> "$out/steps.tsv"
  echo "== $1: skipped ($2)"
}
port() { "$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# --- 1-3. wheels, environment, inputs --------------------------------------------------------------------------------
wheels=("$root"/.gpu_wheels/*.whl)
if [[ ! -e "${wheels[0]}" ]]; then skip wheels "no .gpu_wheels/ (bash launch/gpu_wheels.sh fetches them)"
elif ! "$py" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
  skip wheels "$("$py" -V) here; the wheels are for the image's Python 3.12"
else
  step wheels 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$out/site" \
    "${wheels[@]}"
fi
if [[ "$dry" == true ]]; then device=cpu; else device=cuda; fi
step env 120 "$py" -c "import importlib, torch; \
print({m: importlib.import_module(m).__version__ for m in ('torch', 'transformers', 'peft', 'accelerate', 'hydra', \
'omegaconf', 'datasets', 'deepspeed')}); \
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU', 'x', torch.cuda.device_count()); \
assert '$device' == 'cpu' or torch.cuda.is_available(), 'torch sees no CUDA device'" \
  || { "$py" benchmarks/gpu_check.py report "$out"; exit 1; }
step inputs 120 "$py" benchmarks/gpu_check.py inputs "$out/inputs" || { "$py" benchmarks/gpu_check.py report "$out"; exit 1; }

# --- 4-5. training steps on the device -------------------------------------------------------------------------------
train=(model.name_or_path="$out/inputs/tiny_llama" model.format=hf model.tokenizer_path=null model.dtype=float32
       data=json data.path="$out/inputs/conversations.jsonl" data.eval_fraction=0.1 max_length=64 export_vllm=false
       heads.num_heads=2 heads.target=labels trainer=ddp trainer.max_steps=4 trainer.warmup_ratio=0.0
       trainer.per_device_train_batch_size=4 trainer.logging_steps=1 trainer.save_steps=4 trainer.disable_tqdm=true
       trainer.learning_rate=1e-2)
eagle3=(heads=eagle3 'heads.feature_layers=[0,1,2]' heads.head_vocab_size=64)
if [[ "$dry" == true ]]; then
  train+=(trainer.use_cpu=true trainer.precision=fp32)
  backends=(gloo)
  launch=(env OMP_NUM_THREADS=1 "$py" -m torch.distributed.run)
else
  train+=(trainer.precision=bf16)
  backends=(nccl gloo)
  launch=("$py" -m torch.distributed.run)
fi
run_train() {  # run_train NAME OUTPUT_DIR OVERRIDES...: one process under torchrun
  local name="$1" dir="$2"; shift 2
  step "$name" 300 "${launch[@]}" --standalone --nproc_per_node=1 -m medusa_train.cli.train "${train[@]}" "$@" \
    trainer.ddp_backend="${backends[0]}" output_dir="$dir" hydra.run.dir="$dir/hydra"
}
run_train train_medusa1 "$out/medusa1"
run_train train_eagle3 "$out/eagle3" "${eagle3[@]}"
two_groups() {  # two_groups BACKEND: writes a script that runs two torchrun groups (two "nodes") of one rank each,
  # rendezvous on this host, and prints its path (step runs commands under timeout, which cannot call a function)
  local backend="$1" script="$out/two_groups_$1.sh" p node; p=$(port)
  {
    for node in 0 1; do
      printf '%q ' "${launch[@]}" --nnodes=2 --node_rank="$node" --nproc_per_node=1 --rdzv_backend=c10d \
        --rdzv_endpoint="127.0.0.1:$p" --rdzv_id="gpu-check-$backend" -m medusa_train.cli.train "${train[@]}" \
        trainer.ddp_backend="$backend" output_dir="$out/groups_$backend" hydra.run.dir="$out/groups_$backend/hydra"
      echo "& pid$node=\$!"
    done
    echo 'wait "$pid0"; a=$?; wait "$pid1"; b=$?; exit $((a | b))'
  } > "$script"
  echo "$script"
}
two_ok=false
for backend in "${backends[@]}"; do
  if step "train_2groups_$backend" 300 bash "$(two_groups "$backend")"; then two_ok=true; break; fi
done
if [[ "$two_ok" == true && "${backends[0]}" == nccl ]] && grep -q "^train_2groups_nccl	FAILED" "$out/steps.tsv"; then
  # nccl refused two ranks on one device and gloo trained: a finding of the check, not a failure of it
  sed -i 's/^\(train_2groups_nccl\)\tFAILED \([^\t]*\)/\1\trefused \2, gloo used/' "$out/steps.tsv"
fi

# --- 6-8. greedy exactness, the memory plan, speed -------------------------------------------------------------------
if [[ "$dry" == true ]]; then
  step exact 300 "$py" benchmarks/gpu_check.py exact --device cpu --dtypes float32 --out "$out/exact.json"
else
  step exact 300 "$py" benchmarks/gpu_check.py exact --device cuda --dtypes float32,bfloat16 --out "$out/exact.json"
fi
step memory 300 "$py" benchmarks/gpu_check.py memory --device "$device" --inputs "$out/inputs" --out "$out/memory.json"
config="${GPU_CHECK_CONFIG:-}"
for candidate in "$root/.gpu_wheels/llama-3.1-8b.json" "$root/../shared/assets/configs/llama-3.1-8b.json"; do
  [[ -z "$config" && -f "$candidate" ]] && config="$candidate"
done
if [[ "$dry" == true ]]; then
  step speed 300 "$py" benchmarks/gpu_check.py speed --config "$out/inputs/tiny_llama/config.json" --device cpu \
    --dtype float32 --new-tokens 8 --prompts 2 --out "$out/speed.json"
elif [[ -n "$config" ]]; then
  step speed 300 "$py" benchmarks/gpu_check.py speed --config "$config" --device cuda --dtype bfloat16 \
    --new-tokens 64 --prompts 4 --out "$out/speed.json"
else
  step speed 300 "$py" benchmarks/gpu_check.py speed --config "$out/inputs/tiny_llama/config.json" --device cuda \
    --dtype bfloat16 --new-tokens 64 --prompts 4 --out "$out/speed.json"
fi

echo
"$py" benchmarks/gpu_check.py report "$out" | tee "$out/report.md"
! grep -q FAILED "$out/steps.tsv"
