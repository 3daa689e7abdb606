#!/usr/bin/env bash
# Prepared H200 run: the random-weight 1B Llama (bfloat16) at P=4096,
# N in {1, 16, 64}, T=128, for jaxsample, the Hugging Face peer and the naive
# engine, plus the bandwidth roofline. Budget: about five minutes including
# compile.
#
#   bash benchmarks/gpu_run.sh            # from the repository root
#
# Needs jax (with its CUDA plugin), torch and transformers on the machine; the
# repo is used through PYTHONPATH (no install needed). Every part records its
# error in the JSONL instead of stopping the run: a missing torch only loses
# the hf rows, a naive out-of-memory at N=64 is a row with the error.
#
# One worker process per engine (--isolate engine: one start-up and one model
# init each, N in increasing order; device peaks are running maxima, which
# grow with N anyway). Order: jaxsample, hf, then naive (the most likely to run
# out of memory or time at N=64: it prefills 64 copies of a 4096-token prompt
# with dense attention). --deadline stops starting new workers after 240 s;
# each worker is killed after 150 s (its finished cells are kept).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # jax and torch share the GPU, one after the other
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
python - <<'EOF' || true
import jax; print("jax", jax.__version__, jax.devices())
EOF
timeout 330 python benchmarks/decode.py --config llama-1b \
    --prompt-lengths 4096 --branches 1,16,64 --new-tokens 128 \
    --engines jaxsample,hf,naive --isolate engine --warmup full \
    --cell-timeout 150 --deadline 240 --hf-skip-above 0 \
    --out "$OUT/gpu_llama1b.jsonl" --plot "$OUT/gpu_llama1b.png" 2>&1 | tee "$OUT/gpu_llama1b.log"
echo "exit ${PIPESTATUS[0]}; results in $OUT/gpu_llama1b.jsonl"
