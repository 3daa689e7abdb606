"""The accelerator run: the decode step against the memory roofline, its fixed cost,
the prefill kernels, int8 weights, the Hugging Face peer and the attention kernels,
for random-weight Llama shapes of 1B and 8B (bfloat16), within one time budget.

benchmarks/gpu_run.sh runs it (its header is the plan of the one GPU call);
`--smoke` runs every part at tiny shapes on the CPU (tests/kernels/test_gpu_run.py), with
the CPU kernels off (`JAXSAMPLE_CPU_KERNELS=0`: int8 through XLA's products, the
path off the CPU).
Letters as in docs/ARCHITECTURE.md (P prompt tokens, N branches, T new tokens).

Parts, in order, each one worker process (`common.spawn`): its rows stream back
and the JSON (`--out`) is rewritten after every row; a cell that fails, is
skipped for time or is lost with its worker is a row with its error.

  fixed  the copy bandwidth (the roofline's denominator, measured in this call);
         the decode step of 2-layer models: a narrow one (E = 256, V = 1024; its
         step reads next to nothing, so its time is the fixed cost per step) with
         XLA's default command buffers, with the engine's `loop.GPU_COMPILER_OPTIONS`
         and with those plus `xla_gpu_command_buffer_unroll_loops`, each with the
         control flow XLA compiled (`step_cost.program_control`: the step loop's
         trip count, loops and conditionals inside command buffers); the 1B widths
         with 2 layers (with the 1B grid: the cost per layer).
  1b     the 1B shapes: random weights made on the device (`common.random_params`,
         `setup_s`), the decode grid P x N (warmed up in `--compile-threads`
         threads, then measured one by one: step, tokens/s, prefill, the bytes a
         step must read), `attention="xla"` against `"pallas"`, weight-only int8
         against bfloat16 (and how many dequantised weight copies XLA's step
         writes), dense against blockwise prefill.
  hf     Hugging Face `generate(num_return_sequences=N)` on the 1B shapes where its
         N prefix copies fit (`HF_MEMORY_FRACTION` of the device).
  8b     the 8B shapes (untied head): as 1b, without int8.

Each part has a budget in seconds (its worker is killed past it); the last part
listed takes what is left of `--budget`. Inside a model part, the grid stops
starting cells at `GRID_SHARE` of the part's budget, so the comparisons after it
get the rest. The summary (`summary` in the JSON, printed at the end) holds the
issue's figures: the fraction of the roofline per (model, P, N), the fixed cost,
the cost per layer, tokens/s at N = 64 over P, the speedup over HF, pallas / xla,
int8 / bfloat16 and the prefill table's entry the measurements imply.

    python -m benchmarks.accel --out benchmarks/results/gpu_run.json
    python -m benchmarks.accel --smoke --out /tmp/smoke.json     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import traceback

from benchmarks import common

LONG = dict(max_seq_len=32768)  # room for P = 16K + T (Llama 3.1's context is 128K)
NARROW = dict(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
              ffn_dim=512, rope_theta=500000.0, tie_embeddings=True)

FULL = dict(
    budget=420.0, new_tokens=64, compile_threads=3, bandwidth_gib=2.0,
    fixed=dict(budget=60.0, P=1024, Ns=[1, 64], narrow=dict(NARROW, **LONG),
               wide=dict(common.LLAMA_1B, n_layers=2, **LONG)),
    models={
        "1b": dict(budget=150.0, shapes=dict(common.LLAMA_1B, **LONG), Ps=[1024, 4096, 16384],
                   Ns=[1, 16, 64, 256], attention=[(4096, 64), (16384, 64)],
                   int8=(1024, [1, 16, 64]), prefill=[4096, 16384, 1024]),
        "8b": dict(budget=None, shapes=dict(common.LLAMA_8B, **LONG), Ps=[1024, 4096, 16384],
                   Ns=[1, 16, 64, 256], attention=[(4096, 64)], int8=None,
                   prefill=[4096, 16384]),
    },
    hf=dict(budget=40.0, model="1b", Ps=[1024, 4096], Ns=[1, 16, 64]),
)

# The smoke run's shapes: one layer (compile time grows with the layers; the code
# paths do not), and its "wide" model the narrow one (the same programs, reused).
TINY = dict(vocab_size=512, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
            ffn_dim=128, rope_theta=10000.0, max_seq_len=1024, tie_embeddings=True)
SMOKE = dict(  # budgets far above its time (about 1.5 minutes): every cell runs
    budget=400.0, new_tokens=8, compile_threads=2, bandwidth_gib=0.05,
    fixed=dict(budget=100.0, P=64, Ns=[1], narrow=TINY, wide=TINY),
    models={
        "1b": dict(budget=150.0, shapes=TINY, Ps=[64], Ns=[1, 4], attention=[(64, 4)],
                   int8=(64, [1]), prefill=[64]),
        "8b": dict(budget=None, shapes=dict(TINY, tie_embeddings=False), Ps=[64], Ns=[1],
                   attention=[], int8=None, prefill=[]),
    },
    hf=dict(budget=30.0, model="1b", Ps=[64], Ns=[1]),
)

PARTS = ("fixed", "1b", "hf", "8b")
GRACE = 10.0  # seconds between a worker's last start of a cell and its kill
GRID_SHARE = 0.7  # of a model part's budget: after it, the grid starts no more cells
HF_MEMORY_FRACTION = 0.6  # of the device's memory that HF's weights and N prefix copies may take
COMMAND_BUFFER_VARIANTS = ("xla_default", "engine", "engine_unroll")


# ---------------------------------------------------------------------------
# Worker side (targets of common.spawn: these import jax or torch)


CACHE_ENV = "JAXSAMPLE_BENCH_XLA_CACHE"  # a directory: the workers' persistent compilation cache


def _compilation_cache():
    """JAX's persistent compilation cache in `$JAXSAMPLE_BENCH_XLA_CACHE` when set (gpu_run.sh
    sets it outside the smoke run): a second call on the same machine fetches the
    programs the first compiled. Global JAX state, in this worker process only."""
    if os.environ.get(CACHE_ENV):
        from jaxsample import disk_cache

        disk_cache.enable_compilation_cache(os.environ[CACHE_ENV], min_compile_time_s=1.0,
                                            exported=False)


def _lm(shapes, dtype, weights=None, seed=0):
    """(LanguageModel of random weights made on the device, seconds to make them)."""
    import jax

    from jaxsample.lm import LanguageModel
    from jaxsample.models.checkpoints.tokenizer import ByteTokenizer
    from jaxsample.models.cpu_kernels import cpu_kernels
    from jaxsample.models.families import llama

    cfg = llama.LlamaConfig(**shapes, dtype=dtype)
    t0 = time.perf_counter()
    params = jax.block_until_ready(common.random_params(cfg, seed=seed, weights=weights))
    if weights:
        cpu_kernels.active()  # the CPU kernels built before a program traces them (CPU only)
    lm = LanguageModel(config=cfg, params=params,
                       tokenizer=common.NoEosTokenizer(ByteTokenizer(cfg.vocab_size)),
                       name=f"random-{weights or dtype}", source="random")
    return lm, time.perf_counter() - t0


def _args(seed=0, warmup="none"):
    return argparse.Namespace(seed=seed, warmup=warmup, naive_prefill="run")


class Clock:
    """Seconds since the worker started, against its budget."""

    def __init__(self, budget):
        self.t0, self.budget = time.perf_counter(), budget

    def elapsed(self):
        return time.perf_counter() - self.t0

    def past(self, share=1.0):
        return self.elapsed() > share * self.budget


def _cell(part, name, **kw):
    return dict(kind="cell", part=part, cell=name, **kw)


def _error(row, e):
    row.update(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-2500:])
    return row


def _measure(lm, engine, P, N, T, plat, generate_kw=None):
    """One measured request (compiled and warmed up before): the decode.py row."""
    from benchmarks.peers import jaxsample_engines

    return jaxsample_engines.run_cell(lm, engine, P, N, T, _args(), plat, generate_kw)


def _warm(lm, P, N, T, generate_kw=None):
    """One request at the cell's shapes (compiles its programs): (compile s, wall s)."""
    from jaxsample import SamplingParams
    from jaxsample.engine import generate

    t0 = time.perf_counter()
    g = generate(lm, [common.prompt_ids(1, P, lm.vocab_limit)],
                 SamplingParams(n=N, temperature=1.0, max_new_tokens=T, seed=1),
                 **(generate_kw or {}))
    return g.timings["compile"], time.perf_counter() - t0


def _control(cfg, P, N, T, weights=None, mode=None):
    """The compiled decode chunk's control flow and what it holds (for the rows), with
    the decode attention a request gets by default here (`attention="auto"`)."""
    import re

    from jaxsample.engine import step_cost

    kw = dict(weights="int8", mode=mode) if weights else {}
    t0 = time.perf_counter()
    text = step_cost.compile_decode_step(cfg, P, N, T, chunk=True, attention="auto",
                                         **kw).as_text()
    pc = step_cost.program_control(text)
    out = dict(compile_s=time.perf_counter() - t0,
               step_loop_trip_counts=[lp.trip_count for lp in pc.step_loops()],
               step_loops_captured=[lp.captured for lp in pc.step_loops()],
               loops=len(pc.loops), loops_captured=sum(lp.captured for lp in pc.loops),
               loops_unknown_trip_count=sum(lp.trip_count is None for lp in pc.loops),
               conditionals=pc.conditionals, conditionals_captured=pc.conditionals_captured,
               command_buffers=len(re.findall(r"^%command_buffer\S* ", text, re.M)))
    if weights:  # dequantised copies: a float array of a stored int8 matrix's shape, written
        qs = set(re.findall(r"= s8\[([\d,]+)\]\{[^}]*\} parameter\(", text))
        out["dequantised_weight_writes"] = sum(
            len(re.findall(r"= (?:bf16|f16|f32)\[%s\]\{[^}]*\} (?:fusion|convert)\(" % q, text))
            for q in qs)
    return out


def fixed(spec):
    """The `fixed` part: bandwidth, then the 2-layer models' steps (module docstring)."""
    import jax

    from jaxsample import engine
    from jaxsample.engine import loop

    cfg, clock = spec["cfg"], Clock(spec["budget"])
    P, Ns, T = cfg["P"], cfg["Ns"], spec["new_tokens"]
    _compilation_cache()
    plat = jax.devices()[0].platform
    variants = {"xla_default": {}, "engine": dict(loop.GPU_COMPILER_OPTIONS),
                "engine_unroll": dict(loop.GPU_COMPILER_OPTIONS,
                                      xla_gpu_command_buffer_unroll_loops=True)}
    # The engine's options before the most experimental ones (a crash there loses the
    # cells after it): XLA's defaults, the engine's, the 1B widths, then unrolled loops.
    cells = ([("narrow", v, N) for v in COMMAND_BUFFER_VARIANTS[:2] for N in Ns]
             + [("wide", "engine", N) for N in Ns]
             + [("narrow", v, N) for v in COMMAND_BUFFER_VARIANTS[2:] for N in Ns])
    yield dict(kind="plan", part="fixed",
               cells=["bandwidth"] + [f"{m}/{v}/N={N}" for m, v, N in cells]
               + [f"{m}/{v}/control" for m, v in
                  [("narrow", v) for v in COMMAND_BUFFER_VARIANTS]])
    bw = common.bandwidth(spec["bandwidth_gib"], 10)
    yield dict(bw, part="fixed", cell="bandwidth",
               steps_per_check=loop.STEPS_PER_CHECK,
               gpu_compiler_options=loop.GPU_COMPILER_OPTIONS)
    models = {}
    for name in ("narrow", "wide"):
        models[name] = _lm(cfg[name], spec["dtype"])
    for m in ("narrow", "wide"):
        yield dict(kind="setup", part="fixed", cell=f"{m}/setup", model=m, shapes=cfg[m],
                   setup_s=models[m][1], platform=plat)
    engine_options, control = loop.GPU_COMPILER_OPTIONS, {}
    for m, v, N in cells:
        if N == Ns[0]:  # a new variant: its programs compiled afresh where its options differ
            before = loop.compiler_options(plat)
            loop.GPU_COMPILER_OPTIONS = variants[v]
            if loop.compiler_options(plat) != before:
                engine.PROGRAMS.clear()
        if m == "narrow" and N == Ns[0]:  # (the wide model's: the engine's, as narrow's)
            row = _cell("fixed", f"{m}/{v}/control", model=m, variant=v, P=P, N=1, T=T,
                        compiler_options=loop.compiler_options(plat))
            try:
                if clock.past():
                    raise TimeoutError("skipped: past the part's budget")
                key = json.dumps(row["compiler_options"], sort_keys=True)
                if key not in control:  # the same options compile the same program
                    control[key] = _control(models[m][0].config, P, 1, T)
                row.update(control[key])
            except Exception as e:  # noqa: BLE001
                _error(row, e)
            yield row
        row = _cell("fixed", f"{m}/{v}/N={N}", model=m, variant=v, P=P, N=N, T=T,
                    compiler_options=loop.compiler_options(plat))
        try:
            if clock.past():
                raise TimeoutError("skipped: past the part's budget")
            row["compile_s_warm"], row["warm_s"] = _warm(models[m][0], P, N, T)
            row.update(_measure(models[m][0], "jaxsample", P, N, T, plat))
        except Exception as e:  # noqa: BLE001
            _error(row, e)
        yield row
    loop.GPU_COMPILER_OPTIONS = engine_options


def model(spec):
    """A model part (`1b`, `8b`): setup, the decode grid, then the comparisons. With
    `spec["xla_default"]` (the fixed part saw the engine's GPU options fail), every
    program is compiled with XLA's default options instead."""
    import jax

    from jaxsample import engine
    from jaxsample.engine import loop

    if spec.get("xla_default"):
        loop.GPU_COMPILER_OPTIONS = {}
    _compilation_cache()

    name, cfg, T = spec["model"], spec["cfg"], spec["new_tokens"]
    clock = Clock(spec["budget"])
    plat = jax.devices()[0].platform
    Ps, Ns = cfg["Ps"], cfg["Ns"]
    grid = [(P, N) for P in Ps for N in Ns]
    att = [(P, N, impl) for P, N in cfg["attention"] for impl in ("xla", "pallas")]
    int8 = [(cfg["int8"][0], N) for N in cfg["int8"][1]] if cfg["int8"] else []
    pre = [(P, k) for P in cfg["prefill"] for k in ("dense", "blockwise")]
    yield dict(kind="plan", part=name,
               cells=[f"grid/P={P}/N={N}" for P, N in grid]
               + [f"attention={i}/P={P}/N={N}" for P, N, i in att]
               + ([f"int8-wo/P={P}/N={N}" for P, N in int8] + ["int8-wo/control"] if int8
                  else []) + [f"prefill={k}/P={P}" for P, k in pre])
    lm, setup_s = _lm(cfg["shapes"], spec["dtype"])
    yield dict(kind="setup", part=name, cell="setup", model=name, shapes=cfg["shapes"],
               dtype=spec["dtype"], setup_s=setup_s, platform=plat,
               device_kind=jax.devices()[0].device_kind,
               param_bytes=int(sum(a.nbytes for a in jax.tree_util.tree_leaves(lm.params))))

    def skipped(row, share=1.0):
        if clock.past(share):
            raise TimeoutError(f"skipped: past {share:.0%} of the part's {clock.budget:.0f} s")
        return row

    # The grid, P by P: the first N compiles the prompt's prefill alone, the others
    # compile their decode programs concurrently (XLA compiles without the GIL), then
    # every cell is measured alone.
    pool = concurrent.futures.ThreadPoolExecutor(max(spec["compile_threads"], 1))
    for P in Ps:
        warm = {}
        if not clock.past(GRID_SHARE):
            try:
                warm[Ns[0]] = _warm(lm, P, Ns[0], T)
            except Exception as e:  # noqa: BLE001
                warm[Ns[0]] = e
            futures = {N: pool.submit(_warm, lm, P, N, T) for N in Ns[1:]}
            for N, f in futures.items():
                try:
                    warm[N] = f.result()
                except Exception as e:  # noqa: BLE001
                    warm[N] = e
        for N in Ns:
            row = _cell(name, f"grid/P={P}/N={N}", model=name, engine="jaxsample", P=P, N=N, T=T)
            try:
                w = warm.get(N)
                skipped(row, 1.0 if isinstance(w, tuple) else GRID_SHARE)  # warmed: measure it
                if isinstance(w, tuple):
                    row.update(compile_s_warm=w[0], warm_s=w[1])
                elif w is not None:
                    row["warm_error"] = f"{type(w).__name__}: {w}"[:500]
                row.update(_measure(lm, "jaxsample", P, N, T, plat))
            except Exception as e:  # noqa: BLE001
                _error(row, e)
            yield row
    pool.shutdown()

    for P, N, impl in att:
        row = _cell(name, f"attention={impl}/P={P}/N={N}", model=name, engine="jaxsample",
                    attention=impl, P=P, N=N, T=T)
        try:
            skipped(row)
            row["compile_s_warm"], row["warm_s"] = _warm(lm, P, N, T, {"attention": impl})
            row.update(_measure(lm, "jaxsample", P, N, T, plat, {"attention": impl}))
        except Exception as e:  # noqa: BLE001
            _error(row, e)
        yield row

    if int8:
        engine.PROGRAMS.clear()
        try:
            qlm, q_setup = _lm(cfg["shapes"], spec["dtype"], weights="int8-weight-only")
            yield dict(kind="setup", part=name, cell="int8-wo/setup", model=name,
                       weights="int8-weight-only", setup_s=q_setup,
                       param_bytes=int(sum(a.nbytes for a in jax.tree_util.tree_leaves(
                           qlm.params))))
        except Exception as e:  # noqa: BLE001
            qlm = e
        for P, N in int8:
            row = _cell(name, f"int8-wo/P={P}/N={N}", model=name, engine="jaxsample-int8-wo",
                        weights="int8-weight-only", P=P, N=N, T=T)
            try:
                skipped(row)
                if isinstance(qlm, Exception):
                    raise qlm
                row["compile_s_warm"], row["warm_s"] = _warm(qlm, P, N, T)
                row.update(_measure(qlm, "jaxsample-int8-wo", P, N, T, plat))
            except Exception as e:  # noqa: BLE001
                _error(row, e)
            yield row
        row = _cell(name, "int8-wo/control", model=name, weights="int8-weight-only",
                    P=int8[0][0], N=1, T=T)
        try:
            skipped(row)
            row.update(_control(lm.config, int8[0][0], 1, T, weights="int8", mode="weight_only"))
        except Exception as e:  # noqa: BLE001
            _error(row, e)
        yield row
        del qlm

    for P, kernel in pre:
        row = _cell(name, f"prefill={kernel}/P={P}", model=name, kernel=kernel, P=P)
        try:
            skipped(row)
            row.update(_prefill(lm, P, kernel))
        except Exception as e:  # noqa: BLE001
            _error(row, e)
        yield row


def _prefill(lm, P, kernel, repeats=3):
    """The engine's prefill of one P-token prompt with one kernel forced (through
    `flash.BLOCKWISE_FROM`): compile seconds, the median of `repeats` runs, peak."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxsample.engine.prefill import prefill
    from jaxsample.models.families import flash

    table = flash.BLOCKWISE_FROM
    flash.BLOCKWISE_FROM = tuple((b, 1 if kernel == "blockwise" else 2**31) for b, _ in table)
    try:
        cfg, params = lm.config, lm.params
        tokens = jnp.asarray(np.asarray(common.prompt_ids(0, P, lm.vocab_limit), np.int32)[None])
        lengths = jnp.asarray([P], jnp.int32)
        t0 = time.perf_counter()
        prog = jax.jit(lambda p, t, n: prefill(cfg, p, t, n)).lower(params, tokens,
                                                                      lengths).compile()
        compile_s = time.perf_counter() - t0
    finally:
        flash.BLOCKWISE_FROM = table
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(params, tokens, lengths))
        runs.append(time.perf_counter() - t0)
    return dict(compile_s=compile_s, prefill_s=statistics.median(runs), prefill_runs_s=runs,
                tokens_per_s=P / statistics.median(runs),
                device_peak_bytes=common.device_mem().get("peak_bytes_in_use"))


def hf(spec):
    """The `hf` part: the peer's cells on the model's shapes where they fit."""
    cfg, T, clock = spec["cfg"], spec["new_tokens"], Clock(spec["budget"])
    cells = [(P, N) for P in cfg["Ps"] for N in cfg["Ns"]]
    yield dict(kind="plan", part="hf", cells=[f"hf/P={P}/N={N}" for P, N in cells])
    common.LLAMA_1B.clear()
    common.LLAMA_1B.update(spec["shapes"])  # hf.load("llama-1b") builds these shapes
    try:
        from benchmarks.peers import hf as peer

        plat = peer.platform()
        handle, load_s, extra = peer.load("llama-1b", spec["dtype"])
        import torch

        total = (torch.cuda.get_device_properties(0).total_memory if plat == "gpu"
                 else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        weights = sum(p.numel() * p.element_size() for p in handle[0].parameters())
    except Exception as e:  # noqa: BLE001
        for P, N in cells:
            yield _error(_cell("hf", f"hf/P={P}/N={N}", engine="hf", P=P, N=N, T=T), e)
        return
    yield dict(kind="setup", part="hf", cell="hf/setup", setup_s=load_s, platform=plat, **extra)
    s = spec["shapes"]
    kv_token = 2 * s["n_layers"] * s["n_kv_heads"] * s["head_dim"] * 2  # bfloat16 K and V
    for P, N in cells:
        row = _cell("hf", f"hf/P={P}/N={N}", engine="hf", model=spec["model"], P=P, N=N, T=T)
        try:
            if clock.past():
                raise TimeoutError("skipped: past the part's budget")
            need = weights + N * (P + T) * kv_token
            if need > HF_MEMORY_FRACTION * total:
                raise MemoryError(f"skipped: N prefix copies need {need / 2**30:.1f} GiB, over "
                                  f"{HF_MEMORY_FRACTION:.0%} of {total / 2**30:.0f} GiB")
            row.update(peer.run_cell(handle, "hf", P, N, T, _args(warmup="full"), plat))
        except Exception as e:  # noqa: BLE001
            _error(row, e)
        yield row


# ---------------------------------------------------------------------------
# Parent side: the parts, the JSON, the summary (no jax, no torch in this process)


def summarize(rows):
    """The issue's figures from the rows (see the module docstring)."""
    cells = {(r.get("part"), r.get("cell")): r for r in rows
             if r.get("kind") == "cell" and "error" not in r}
    bw = next((r.get("bandwidth_bytes_per_s") for r in rows if r.get("cell") == "bandwidth"),
              None)
    out = dict(bandwidth_bytes_per_s=bw, engine_options_failed=engine_options_failed(rows),
               setup_s={
        f"{r['part']}/{r['cell']}": r.get("setup_s") for r in rows if r.get("kind") == "setup"})
    fixed = {}
    for v in COMMAND_BUFFER_VARIANTS:
        r = next((c for (p, name), c in cells.items()
                  if p == "fixed" and name.startswith(f"narrow/{v}/N=")), None)
        if r:
            fixed[v] = dict(step_us=r["decode_step_s"] * 1e6, N=r["N"])
    out["fixed_cost"] = fixed
    for m in ("1b", "8b"):
        grid = {(c["P"], c["N"]): c for (p, name), c in cells.items()
                if p == m and name.startswith("grid/")}
        if not grid:
            continue
        s = out.setdefault(m, {})
        s["roofline_fraction"] = {f"P={P}/N={N}": c.get("roofline_fraction")
                                  for (P, N), c in sorted(grid.items())}
        s["step_ms"] = {f"P={P}/N={N}": c["decode_step_s"] * 1e3
                        for (P, N), c in sorted(grid.items())}
        s["prefill_s"] = {f"P={P}": c["prefill_s"] for (P, N), c in sorted(grid.items())
                          if N == min(n for (q, n) in grid if q == P)}
        tps = {P: c["decode_tokens_per_s"] for (P, N), c in grid.items() if N == 64}
        if tps:
            s["tokens_per_s_n64"] = {f"P={P}": v for P, v in sorted(tps.items())}
            lo, hi = min(tps), max(tps)
            if hi > lo:
                s["tokens_per_s_n64_long_over_short"] = tps[hi] / tps[lo]
        wide = cells.get(("fixed", "wide/engine/N=1"))
        if m == "1b" and wide and (wide["P"], 1) in grid:
            L = [r for r in rows if r.get("cell") == "setup" and r.get("part") == m]
            layers = L[0]["shapes"]["n_layers"] if L else None
            if layers and layers > 2:  # (the 1B step - its 2-layer twin's) / the layers between
                s["per_layer_ms_n1"] = ((grid[wide["P"], 1]["decode_step_s"]
                                         - wide["decode_step_s"]) * 1e3 / (layers - 2))
        att = {}
        for (p, name), c in cells.items():
            if p == m and name.startswith("attention="):
                att.setdefault(f"P={c['P']}/N={c['N']}", {})[c["attention"]] = c["decode_step_s"]
        s["pallas_over_xla_step"] = {k: v["pallas"] / v["xla"] for k, v in att.items()
                                     if "pallas" in v and "xla" in v}
        s["int8_wo_over_bf16_step"] = {
            f"P={c['P']}/N={c['N']}": c["decode_step_s"] / grid[c["P"], c["N"]]["decode_step_s"]
            for (p, name), c in cells.items()
            if p == m and name.startswith("int8-wo/P=") and (c["P"], c["N"]) in grid}
        pre = {}
        for (p, name), c in cells.items():
            if p == m and name.startswith("prefill="):
                pre.setdefault(c["P"], {})[c["kernel"]] = c["prefill_s"]
        s["prefill_kernels_s"] = {f"P={P}": v for P, v in sorted(pre.items())}
        both = sorted(P for P, v in pre.items() if len(v) == 2)
        if both:
            faster = [P for P in both if pre[P]["blockwise"] < pre[P]["dense"]]
            s["blockwise_from_measured"] = min(faster) if faster else max(both) + 1
    hfc = {(c["P"], c["N"]): c for (p, name), c in cells.items() if p == "hf"}
    grid1 = {(c["P"], c["N"]): c for (p, name), c in cells.items()
             if p == "1b" and name.startswith("grid/")}
    out["over_hf_tokens_per_s"] = {
        f"P={P}/N={N}": grid1[P, N]["decode_tokens_per_s"] / c["decode_tokens_per_s"]
        for (P, N), c in sorted(hfc.items()) if (P, N) in grid1}
    return out


def tables(rows) -> str:
    """Markdown tables of the measured cells (every row also in the JSON)."""
    fmt = common.fmt
    out = []
    fixed = [r for r in rows if r.get("part") == "fixed" and r.get("decode_step_s")]
    if fixed:
        out += common.md_table(("model", "variant", "N", "step us", "compile s"), [
            [r["model"], r["variant"], r["N"], fmt(r["decode_step_s"] * 1e6),
             fmt(r.get("compile_s_warm"))] for r in fixed]) + [""]
    for part in ("1b", "8b", "hf"):
        cells = [r for r in rows if r.get("part") == part and r.get("kind") == "cell"
                 and r.get("decode_step_s")]
        if cells:
            out += [f"{part}:"] + common.md_table(
                ("cell", "step ms", "roofline ms", "of roofline", "tok/s", "prefill s",
                 "compile s"),
                [[r["cell"], fmt(r["decode_step_s"] * 1e3),
                  fmt((r.get("roofline_step_s") or 0) * 1e3), fmt(r.get("roofline_fraction")),
                  fmt(r.get("decode_tokens_per_s")), fmt(r.get("prefill_s")),
                  fmt(r.get("compile_s_warm"))] for r in cells]) + [""]
        pre = [r for r in rows if r.get("part") == part and r.get("cell", "").startswith(
            "prefill=") and r.get("prefill_s")]
        if pre:
            out += common.md_table(("cell", "prefill s", "compile s", "device peak MiB"), [
                [r["cell"], fmt(r["prefill_s"]), fmt(r["compile_s"]),
                 fmt(r.get("device_peak_bytes"), "MiB")] for r in pre]) + [""]
    errors = [r for r in rows if r.get("error")]
    if errors:
        out += [f"{len(errors)} rows with an error:"] + [
            f"  {r.get('part')} {r.get('cell')}: {r['error'][:120]}" for r in errors]
    return "\n".join(out)


def engine_options_failed(rows) -> bool:
    """Whether the fixed part's narrow model ran with XLA's default options but not with
    the engine's (`loop.GPU_COMPILER_OPTIONS`): the parts after it then compile with
    XLA's defaults (the summary says so), so one failing option does not lose the call."""
    by = {r.get("cell"): r for r in rows if r.get("part") == "fixed"}
    ok = lambda name: name in by and "error" not in by[name]  # noqa: E731
    engine_cells = [c for c in by if c.startswith("narrow/engine/N=")]
    return ok("narrow/xla_default/N=1") and (
        not engine_cells or not all(ok(c) for c in engine_cells))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (tests)")
    ap.add_argument("--out", default=None, help="the JSON (rewritten after every row)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all parts (default 420; --smoke 400)")
    ap.add_argument("--platform", default=None, choices=["cpu", "gpu", "tpu"],
                    help="JAX_PLATFORMS of the workers (default: JAX's choice)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--compile-threads", type=int, default=None)
    a = ap.parse_args(argv)
    plan = SMOKE if a.smoke else FULL
    parts = [p for p in a.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}; choose from {PARTS}")
    budget = a.budget or plan["budget"]
    out = a.out or os.path.join(common.ROOT, "benchmarks", "results",
                                "accel_smoke.json" if a.smoke else "accel.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    env = dict(os.environ)
    if a.platform:
        env["JAX_PLATFORMS"] = a.platform
    if a.smoke:  # int8 through XLA's products, as off the CPU (and no kernel build)
        env.setdefault("JAXSAMPLE_CPU_KERNELS", "0")
    doc = dict(environment=common.environment(), argv=sys.argv, budget_s=budget, parts=parts,
               smoke=a.smoke, rows=[], summary={})
    t_begin = time.perf_counter()

    def write():
        doc["summary"] = summarize(doc["rows"])
        doc["elapsed_s"] = time.perf_counter() - t_begin
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        os.replace(tmp, out)

    def on_row(row):
        if row.get("kind") == "cell" and row.get("decode_step_s") and bw[0]:
            from benchmarks.decode import add_roofline

            add_roofline(row, bw[0])
        if row.get("cell") == "bandwidth":
            bw[0] = row.get("bandwidth_bytes_per_s")
        doc["rows"].append(row)
        write()
        msg = row.get("error", "")[:100] or ", ".join(
            f"{k} {common.fmt(row[k])}" for k in (
                "setup_s", "decode_step_s", "roofline_fraction", "prefill_s",
                "bandwidth_bytes_per_s", "step_loop_trip_counts", "conditionals",
                "conditionals_captured", "dequantised_weight_writes")
            if row.get(k) is not None)
        print(f"[{time.perf_counter() - t_begin:5.0f} s] {row.get('part')} {row.get('cell')}: "
              f"{msg}", flush=True)

    bw = [None]
    write()
    common_spec = dict(new_tokens=plan["new_tokens"], dtype=a.dtype,
                       compile_threads=a.compile_threads or plan["compile_threads"],
                       bandwidth_gib=plan["bandwidth_gib"])
    for i, part in enumerate(parts):
        left = budget - (time.perf_counter() - t_begin)
        if part == "fixed":
            spec, target, part_budget = dict(cfg=plan["fixed"]), "fixed", plan["fixed"]["budget"]
        elif part == "hf":
            h = plan["hf"]
            spec = dict(cfg=h, model=h["model"], shapes=plan["models"][h["model"]]["shapes"])
            target, part_budget = "hf", h["budget"]
        else:
            spec, target = dict(model=part, cfg=plan["models"][part]), "model"
            part_budget = plan["models"][part]["budget"]
        last = i == len(parts) - 1
        part_budget = left if (last or part_budget is None) else min(part_budget, left)
        if part_budget <= 5:
            on_row(dict(kind="cell", part=part, cell="*",
                        error=f"skipped: {left:.0f} s of the budget left"))
            continue
        seen, planned = set(), []

        def collect(row, seen=seen, planned=planned):
            if row.get("kind") == "plan":
                planned.extend(row["cells"])
                return
            seen.add(row.get("cell"))
            on_row(row)

        # The worker stops starting cells GRACE before its kill (start-up, the last cell).
        spec.update(common_spec, budget=part_budget - min(GRACE, part_budget / 5),
                    xla_default=engine_options_failed(doc["rows"]))
        ran = common.spawn(f"benchmarks.accel:{target}", spec, part_budget, env=env,
                           on_row=collect)
        if ran.returncode != 0:
            why = f"worker {ran.returncode}: {ran.stderr.strip()[-1500:]}"
            for cell in [c for c in planned if c not in seen] or ["*"]:
                on_row(dict(kind="cell", part=part, cell=cell, error=f"not run: {why}"))
    write()
    print(tables(doc["rows"]))
    print(json.dumps(doc["summary"], indent=1, default=str))
    print(f"wrote {out} ({time.perf_counter() - t_begin:.0f} s)")


if __name__ == "__main__":
    main()
