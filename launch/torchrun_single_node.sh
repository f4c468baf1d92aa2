#!/usr/bin/env bash
# Train Medusa heads on every GPU of this machine (or N CPU processes) with torchrun.
#
#   launch/torchrun_single_node.sh model=vicuna_7b data=sharegpt output_dir=runs/vicuna
#   NPROC=2 launch/torchrun_single_node.sh trainer=deepspeed_zero2 model=smollm2_135m output_dir=runs/smol
#   NPROC=2 launch/torchrun_single_node.sh trainer.use_cpu=true trainer.precision=fp32 output_dir=runs/cpu2
#
# trainer=ddp is the default; a trainer=... argument replaces it (the last one wins in Hydra). Arguments are
# Hydra overrides of conf/train.yaml. NPROC defaults to the number of GPUs, else 2.
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "${NPROC}" -gt 0 ]] || NPROC=2
fi
# On the CPU each rank gets its share of the cores (torchrun's default is one thread per rank).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec torchrun --standalone --nproc_per_node="${NPROC}" -m medusa_train.cli.train trainer=ddp "$@"
