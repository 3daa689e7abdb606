#!/usr/bin/env bash
# Prepared H200 run: the random-weight 1B Llama (bfloat16) at P=4096,
# N in {1, 16, 64}, T=128, for jaxsample, the Hugging Face peer and the naive
# engine, plus the bandwidth roofline, then the int8 rows (jaxsample on
# bfloat16 against int8 weights, the same grid), then the prefill (dense vs
# blockwise attention, P=4096/16384). Budget: about ten minutes including
# compile without the int8 part, up to 5.5 minutes more with it. Seen on one
# H200 (2026-12-04, benchmarks/RESULTS.md "The first GPU run"): a jaxsample
# worker's load (the random init) 61-66 s, its compile 10-18 s per N; the int8
# worker's load 101 s; the HF worker's 10 s; prefill cells 4-30 s each. A
# device lent for 15 minutes does not fit every part: pick them with PARTS and
# DECODE_ENGINES.
#
#   bash benchmarks/gpu_run.sh            # from the repository root
#
# Needs jax (with its CUDA plugin), torch and transformers on the machine; the
# scripts run as `python -m benchmarks.<name>` from the repository root. The
# models/ folder installs as jaxsample.models (pyproject's package-dir), so a
# checkout that is not installed is installed first, editable and offline
# (--no-deps --no-index: no package is fetched; gguf, tokenizers and the rest
# are needed only for GGUF files, which this run does not load). Every part records its
# error in the JSONL instead of stopping the run: a missing torch only loses
# the hf rows, a naive out-of-memory at N=64 is a row with the error.
#
# One worker process per engine (--isolate engine: one start-up and one model
# init each, N in increasing order; device peaks are running maxima, which
# grow with N anyway). Order: jaxsample, hf, then naive (the most likely to run
# out of memory or time at N=64: it prefills 64 copies of a 4096-token prompt
# with dense attention). --deadline stops starting new workers after 240 s;
# each worker is killed after 150 s (its finished cells are kept).
#
# Parts, in order: decode, int8, prefill; PARTS=int8 (comma-separated) runs a
# subset, e.g. the int8 part alone at CPU smoke sizes:
#   OUT=/tmp/gpu_smoke PARTS=int8 INT8_LENGTHS=64 INT8_BRANCHES=1,2 INT8_NEW_TOKENS=4 \
#   INT8_OVERRIDE='{"n_layers": 2, "dim": 256, "ffn_dim": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 1024}' \
#   bash benchmarks/gpu_run.sh
#
# The decode part takes the same overrides (DECODE_LENGTHS, DECODE_BRANCHES,
# DECODE_NEW_TOKENS, DECODE_OVERRIDE) and DECODE_ENGINES (default
# jaxsample,hf,naive; add jaxsample-int8 and jaxsample-int8-wo for the int8
# rows in the same table); DECODE_DEADLINE (240 s) and DECODE_CELL_TIMEOUT
# (150 s) bound it, DECODE_TIMEOUT (330 s) the whole part.
set -u
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # jax and torch share the GPU, one after the other
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
# The checkout's own jaxsample.models, not another install's: from the root,
# `import jaxsample` finds ./jaxsample, but jaxsample.models comes from whichever
# editable install is on the path.
ours='import pathlib, sys, jaxsample.models as m
sys.exit(pathlib.Path(m.__file__).resolve().parent != pathlib.Path("models").resolve())'
# Where the offline install cannot build (a setuptools before 70.1 without the
# `wheel` package has no bdist_wheel), the link jaxsample/models -> ../models
# (git-ignored) serves the same layout with no install.
python -c "$ours" 2>/dev/null || {
    python -m pip install -q --no-deps --no-build-isolation --no-index -e . &&
    python -c "$ours"; } 2>/dev/null || {
    ln -sfn ../models jaxsample/models && python -c "$ours"; } ||
    { echo "could not install this checkout (pip install -e .), or it imports another"; exit 1; }
python - <<'EOF' || true
import jax; print("jax", jax.__version__, jax.devices())
EOF
PARTS=",${PARTS:-decode,int8,prefill},"
if [[ $PARTS == *,decode,* ]]; then
timeout "${DECODE_TIMEOUT:-330}" python -m benchmarks.decode --config llama-1b \
    --prompt-lengths "${DECODE_LENGTHS:-4096}" --branches "${DECODE_BRANCHES:-1,16,64}" \
    --new-tokens "${DECODE_NEW_TOKENS:-128}" --llama-override "${DECODE_OVERRIDE:-}" \
    --engines "${DECODE_ENGINES:-jaxsample,hf,naive}" --isolate engine --warmup full \
    --cell-timeout "${DECODE_CELL_TIMEOUT:-150}" --deadline "${DECODE_DEADLINE:-240}" \
    --hf-skip-above 0 \
    --out "$OUT/gpu_llama1b.jsonl" --plot "$OUT/gpu_llama1b.png" 2>&1 | tee "$OUT/gpu_llama1b.log"
echo "exit ${PIPESTATUS[0]}; results in $OUT/gpu_llama1b.jsonl"
fi
# Int8 weights (issue 22 part 5): the same random 1B Llama, bfloat16 weights
# against int8 (`jaxsample-int8`: as load(weights="int8") makes it, outlier
# channels calibrated over 256 random token ids, then the load's own quantiser
# `models.quant.quantize_params`, inside the worker's load_s; W8A8 with
# bfloat16 activations; both engines in the serving layout, one dict per layer), P=4096, N in {1, 16, 64}, one run,
# the two engines back to back (one process each, N increasing; the int8
# worker starts by 120 s and may take 200 s: quantising 1.2 B parameters on the
# host takes about a minute, measured 0.8 s per 2048 x 8192 on the 2-core CPU,
# and counts in its load_s, not in e2e). Shrink for a
# CPU smoke run with INT8_LENGTHS, INT8_BRANCHES, INT8_NEW_TOKENS and
# INT8_OVERRIDE (a JSON dict over the llama-1b shapes, --llama-override).
if [[ $PARTS == *,int8,* ]]; then
timeout 330 python -m benchmarks.decode --config llama-1b \
    --prompt-lengths "${INT8_LENGTHS:-4096}" --branches "${INT8_BRANCHES:-1,16,64}" \
    --new-tokens "${INT8_NEW_TOKENS:-128}" --llama-override "${INT8_OVERRIDE:-}" \
    --engines jaxsample,jaxsample-int8 --isolate engine --warmup full \
    --cell-timeout 200 --deadline 120 \
    --out "$OUT/gpu_llama1b_int8.jsonl" 2>&1 | tee "$OUT/gpu_llama1b_int8.log"
echo "int8 exit ${PIPESTATUS[0]}; results in $OUT/gpu_llama1b_int8.jsonl"
fi
# Prefill speed, dense vs blockwise causal attention (models/flash.py), the same
# random 1B Llama in bfloat16, one prompt of 4096 and 16384 tokens, one process
# per cell (a dense out-of-memory at 16384 is a row with its error). Runs after
# the decode rows, so a failure here loses only these rows. Sizes can be
# shrunk for a CPU smoke run: PREFILL_LENGTHS=64 PREFILL_MODEL=smollm2 bash ...;
# PREFILL_TIMEOUT (300 s) and PREFILL_CELL_TIMEOUT (120 s) bound it.
# The float32 exactness checks are the CPU run's (--layer-check 0 here); the
# bfloat16 logits/KV comparison is reported against a bfloat16-sized 5e-2.
if [[ $PARTS == *,prefill,* ]]; then
timeout "${PREFILL_TIMEOUT:-300}" python -m benchmarks.prefill --model "${PREFILL_MODEL:-llama-1b}" --dtype bfloat16 \
    --prompt-lengths "${PREFILL_LENGTHS:-4096,16384}" --kernels dense,blockwise --repeats 3 \
    --cell-timeout "${PREFILL_CELL_TIMEOUT:-120}" --layer-check 0 --check-rtol 5e-2 \
    --out "$OUT/gpu_prefill.json" 2>&1 | tee "$OUT/gpu_prefill.log"
echo "prefill exit ${PIPESTATUS[0]}; results in $OUT/gpu_prefill.json"
fi
