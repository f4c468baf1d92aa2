#!/usr/bin/env bash
# The wheels launch/gpu_check.sh installs on the GPU machine, fetched here (a CPU machine with the package registries)
# into the ignored folder .gpu_wheels/: the GPU machine has no network and its image (Python 3.12, torch 2.11,
# transformers 5.17, peft, accelerate, pyarrow, pandas, xxhash, psutil, msgpack, ninja, einops) lacks these.
# All are pure Python but pydantic-core (a cp312 manylinux wheel); antlr4-python3-runtime and deepspeed (built with
# DS_BUILD_OPS=0: no compiled ops) come as source only and are built into wheels here. Together about 6 MiB.
#
#   bash launch/gpu_wheels.sh            # idempotent: a wheel already in .gpu_wheels/ is not fetched again
#
# Environment: GPU_WHEELS_DIR (default .gpu_wheels), GPU_WHEELS_PYTHON (a python with pip; default the project's
# .venv, else python3). The versions are the ones the project's CPU environment is tested with.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${GPU_WHEELS_DIR:-$root/.gpu_wheels}"
py="${GPU_WHEELS_PYTHON:-$([[ -x $root/.venv/bin/python ]] && echo "$root/.venv/bin/python" || echo python3)}"
mkdir -p "$dir"

# name==version for pip, and the file name prefix pip gives its wheel (to skip what is already there)
binary=(  # wheels from the registry, for CPython 3.12 on manylinux x86-64
  "hydra-core==1.3.8 hydra_core-1.3.8"
  "omegaconf==2.3.1 omegaconf-2.3.1"
  "datasets==5.2.0 datasets-5.2.0"
  "dill==0.4.1 dill-0.4.1"
  "multiprocess==0.70.19 multiprocess-0.70.19"
  "hjson==3.1.0 hjson-3.1.0"
  "pydantic==2.14.4 pydantic-2.14.4"
  "pydantic_core==2.50.5 pydantic_core-2.50.5"
  "annotated-types==0.8.0 annotated_types-0.8.0"
  "typing-inspection==0.4.5 typing_inspection-0.4.5"
)
source_only=(  # sdists built into pure-Python wheels here
  "antlr4-python3-runtime==4.9.3 antlr4_python3_runtime-4.9.3"
  "deepspeed==0.19.8 deepspeed-0.19.8"
)
have() { compgen -G "$dir/$1-*.whl" > /dev/null; }
for entry in "${binary[@]}"; do
  read -r spec prefix <<< "$entry"
  have "$prefix" && continue
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" "$spec"
done
for entry in "${source_only[@]}"; do
  read -r spec prefix <<< "$entry"
  have "$prefix" && continue
  DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$spec"
done
count=$(compgen -G "$dir/*.whl" | wc -l)
echo "gpu_wheels: $count wheels, $(du -sh "$dir" | cut -f1) in $dir"
