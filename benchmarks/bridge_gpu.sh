#!/usr/bin/env bash
# Longer Bridge run on one GPU (e.g. an H200): 400 RL steps of 16 problems x 8
# branches, 400 held-out problems, widths 1..16. Writes benchmarks/results/bridge_gpu.json
# (+ .png). Extra flags are passed through, e.g. --sft-steps 20 or --model <path>.
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python -m benchmarks.bridge --preset gpu \
  --out benchmarks/results/bridge_gpu.json "$@"
