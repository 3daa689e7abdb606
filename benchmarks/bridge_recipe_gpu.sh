#!/usr/bin/env bash
# The Bridge recipe (SFT warm-up + GRPO) against its controls on one GPU (e.g. an H200),
# sized for under 10 minutes per task (--preset gpu: 512 training problems, 60 warm-up
# + 60 RL steps of 16 problems x 4 branches per condition, 200 held-out problems).
# Usage: benchmarks/bridge_recipe_gpu.sh [coord|accuracy] [extra flags...]
# Writes benchmarks/results/bridge_coordination_gpu.json (+ .png) or
# benchmarks/results/bridge_accuracy_recipe_gpu.json. Check on CPU that it starts:
#   JAX_PLATFORMS=cpu benchmarks/bridge_recipe_gpu.sh coord --tiny --preset smoke
set -euo pipefail
cd "$(dirname "$0")/.."
task="${1:-coord}"
shift || true
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && py="${PYTHON:-.venv/bin/python}"
if [ "$task" = coord ]; then out=benchmarks/results/bridge_coordination_gpu.json
else out=benchmarks/results/bridge_accuracy_recipe_gpu.json; fi
exec "$py" -m benchmarks.bridge_recipe --task "$task" --preset gpu --out "$out" "$@"
