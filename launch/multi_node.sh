#!/usr/bin/env bash
# Train Medusa heads on several machines. output_dir must be on a file system every node sees (checkpoints and the
# hidden-state cache are read by all ranks).
#
# torchrun rendezvous (run the same command on every node):
#   NNODES=2 NPROC=8 RDZV_ENDPOINT=node0:29500 launch/multi_node.sh torchrun trainer=deepspeed_zero3 \
#       model=vicuna_7b data=sharegpt output_dir=/shared/runs/vicuna
#
# DeepSpeed launcher (run once, on the first node; it reaches the others over ssh). HOSTFILE lists
# "hostname slots=N" per node:
#   HOSTFILE=hostfile launch/multi_node.sh deepspeed trainer=deepspeed_zero3 model=vicuna_7b output_dir=/shared/run
#
# Arguments after the mode are Hydra overrides of conf/train.yaml; trainer=deepspeed_zero2 is the default.
set -euo pipefail

MODE="${1:?usage: launch/multi_node.sh torchrun|deepspeed [hydra overrides...]}"
shift

case "${MODE}" in
  torchrun)
    : "${NNODES:?set NNODES, the number of machines}"
    : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first node}"
    NPROC="${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)}"
    exec torchrun --nnodes="${NNODES}" --nproc_per_node="${NPROC}" \
      --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT}" --rdzv_id="${RDZV_ID:-medusa-train}" \
      -m medusa_train.cli.train trainer=deepspeed_zero2 "$@"
    ;;
  deepspeed)
    : "${HOSTFILE:?set HOSTFILE, an MPI-style hostfile (hostname slots=N per line)}"
    # --no_local_rank: the rank comes from the environment (LOCAL_RANK), not a --local_rank argument.
    exec deepspeed --hostfile="${HOSTFILE}" --master_port="${MASTER_PORT:-29500}" --no_local_rank \
      --module medusa_train.cli.train trainer=deepspeed_zero2 "$@"
    ;;
  *)
    echo "unknown mode ${MODE}: use torchrun or deepspeed" >&2
    exit 2
    ;;
esac
