#!/usr/bin/env bash
# The prepared accelerator run: one call, at most 8 minutes, inside the 15 minutes a
# GPU is lent (start-up included), leaving about 4 minutes for a second call.
#
#   bash benchmarks/gpu_run.sh                  # the GPU call, from the repository root
#   bash benchmarks/gpu_run.sh --smoke          # CPU, tiny shapes, every cell (~1.5 min)
#   PLATFORM=tpu bash benchmarks/gpu_run.sh     # the TPU command (the same plan; never run)
#
# The plan of the one GPU call (wall-clock bounds; each part is one process, killed
# at its bound; a cell that fails, is skipped for time or dies with its process is
# a row with its error; the JSON $OUT/gpu_run.json is rewritten after every row):
#
#   0. set-up, <= 25 s: nvidia-smi, the checkout's install (offline), jax's devices.
#   1. fixed, <= 60 s (benchmarks/accel.py `fixed`): the copy bandwidth (2 GiB, best
#      of 10: the roofline's denominator, this call's); the decode step (P = 1024,
#      N = 1 and 64, T = 64) of a narrow 2-layer model (E = 256, V = 1024: its step
#      is the fixed cost) with XLA's default command buffers, with the engine's
#      loop.GPU_COMPILER_OPTIONS (WHILE and CONDITIONAL in CUDA graphs), and with
#      those plus unrolled loops, each with its compiled control flow (the step
#      loop's trip count, loops and conditionals inside command buffers); the same
#      at the 1B widths with 2 layers (the cost per layer, with step 2).
#   2. 1b, <= 150 s: random bfloat16 weights made on the device (setup_s), the
#      decode grid P in {1K, 4K, 16K} x N in {1, 16, 64, 256} (T = 64; per P the
#      N = 1 cell compiles the prefill, the other three compile in 3 threads, then
#      each cell is measured alone: step, tokens/s, prefill, roofline fraction)
#      until 70 % of the part; then attention="xla" against "pallas" at (4K, 64)
#      and (16K, 64) (an engine without the option: error rows); weight-only int8
#      at P = 1K, N = 1, 16, 64 (setup on the device) and its compiled step's
#      dequantised weight copies; dense against blockwise prefill at 4K, 16K, 1K.
#   3. hf, <= 40 s: Hugging Face generate(num_return_sequences=N) on the 1B shapes,
#      P in {1K, 4K}, N in {1, 16, 64}, where its weights and N prefix copies fit
#      60 % of the device (no torch: error rows).
#   4. 8b, the rest (<= 170 s): as 1b for the 8B shapes (untied head), attention
#      at (4K, 64), prefill at 4K and 16K, no int8.
#
# The parts sum to 420 s (BUDGET); with set-up and the workers' start-up the call
# ends by 450 s, killed at 470 s (HARD). Cells a part could not reach are rows
# "skipped: past ..." or "not run: worker timeout"; the second call runs what is
# missing, e.g. PARTS=8b BUDGET=200 bash benchmarks/gpu_run.sh (OUT2 keeps the
# first call's JSON: OUT=benchmarks/results/second). The summary at the end of the
# JSON and of the log holds the issue's figures (benchmarks/accel.py).
#
# On a TPU (PLATFORM=tpu; not run yet): the same parts; loop.GPU_COMPILER_OPTIONS
# apply to GPUs only, so the three fixed-cost variants compile the same program;
# the hf part records its error (torch has no TPU device here); the prefill rows
# measure flash.BLOCKWISE_FROM's "tpu" entry.
#
# Needs jax with its CUDA plugin (or libtpu), and torch + transformers for the hf
# part; the scripts run as `python -m benchmarks.<name>` from the repository root.
# The models/ folder installs as jaxsample.models (pyproject's package-dir), so a
# checkout that is not installed is installed first, editable and offline
# (--no-deps --no-index), or, where that cannot build, served through the link
# jaxsample/models -> ../models (git-ignored).
set -u
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # jax and torch share the GPU, one after the other
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
SMOKE=""
if [[ "${1:-}" == "--smoke" ]]; then
    SMOKE="--smoke"
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
    # The workers' compilation cache: a second call on the same machine fetches the
    # programs the first one compiled (benchmarks/accel.py CACHE_ENV).
    export JAXSAMPLE_BENCH_XLA_CACHE=${XLA_CACHE:-/tmp/jaxsample-gpu-run-xla}
fi
# The checkout's own jaxsample.models, not another install's: from the root,
# `import jaxsample` finds ./jaxsample, but jaxsample.models comes from whichever
# editable install is on the path.
ours='import pathlib, sys, jaxsample.models as m
sys.exit(pathlib.Path(m.__file__).resolve().parent != pathlib.Path("models").resolve())'
python -c "$ours" 2>/dev/null || {
    python -m pip install -q --no-deps --no-build-isolation --no-index -e . &&
    python -c "$ours"; } 2>/dev/null || {
    ln -sfn ../models jaxsample/models && python -c "$ours"; } ||
    { echo "could not install this checkout (pip install -e .), or it imports another"; exit 1; }
[[ -n "$SMOKE" ]] || python - <<'EOF' || true
import jax; print("jax", jax.__version__, jax.devices())
EOF
ARGS=(--out "$OUT/gpu_run.json")
[[ -n "$SMOKE" ]] && ARGS+=(--smoke)
[[ -n "${PLATFORM:-}" ]] && ARGS+=(--platform "$PLATFORM")
[[ -n "${PARTS:-}" ]] && ARGS+=(--parts "$PARTS")
[[ -n "${BUDGET:-}" ]] && ARGS+=(--budget "$BUDGET")
timeout "${HARD:-470}" python -m benchmarks.accel "${ARGS[@]}" 2>&1 | tee "$OUT/gpu_run.log"
echo "exit ${PIPESTATUS[0]}; results in $OUT/gpu_run.json"
