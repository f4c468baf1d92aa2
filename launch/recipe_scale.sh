#!/usr/bin/env bash
# One cell of the data-scaling table (docs/data-scaling.md): bash launch/recipe_scale.sh DRAFTER SIZE
# The recipe, its stages and its knobs (SCALE_* environment variables): launch/recipe_scale.py, which this runs with
# the machine's Python (standard library only: it installs the project's environment itself, after its checks).
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/recipe_scale.py" "$@"
