"""Decode speed and memory: jaxsample's shared-prefix engine against the naive
engine (N materialised prefix copies), two peers (Hugging Face transformers
`generate(num_return_sequences=N)`, benchmarks/peers/hf.py; optionally
llama.cpp's `llama-batched-bench -pps -kvu`, engine `llamacpp`, see
benchmarks/peers/llamacpp.py:
`--llamacpp-bin DIR --llamacpp-model F32.gguf`, skipped with the reason in the
row when absent) and the hardware limit (a memory-bandwidth roofline measured
in the same run). Engine `jaxsample-int8`: the shared-prefix engine on
`load(..., weights="int8")` (W8A8, models/quantization/quant.py); `jaxsample-int8-wo` on
`weights="int8-weight-only"`.

The quantised side by side (issue 22 part 4: jaxsample float32 and int8
against llama.cpp F32, Q8_0 and the shipped Q4_1, one run, engines back to
back; several llama.cpp files become engines `llamacpp-f32`, `llamacpp-q8_0`,
`llamacpp-q4_1`, and `--llamacpp-no-repack` runs them with `-nr`):

    python -m benchmarks.decode --config smollm2 --prompt-lengths 1024 \
        --branches 1,16 --new-tokens 64 --engines jaxsample,jaxsample-int8,llamacpp \
        --llamacpp-bin $LLAMA/build/bin --llamacpp-no-repack \
        --llamacpp-model smollm2-f32.gguf,smollm2-q8_0.gguf,$SHIPPED_Q4_1_GGUF \
        --out benchmarks/results/cpu_smollm2_int8_llamacpp.jsonl

Usage (CPU, the embedded SmolLM2-135M-Instruct in float32):

    python -m benchmarks.decode --config smollm2 \
        --prompt-lengths 256,1024 --branches 1,4,16 --new-tokens 64 \
        --out benchmarks/results/cpu_smollm2.jsonl

Accelerators (the same script; bfloat16 there): see benchmarks/gpu_run.sh.

This module is the grid: it schedules one worker per cell (the worker
protocol of benchmarks/common.py), adds the roofline, pairs the engines and
prints the tables; the cells themselves live in benchmarks/peers/.

How it measures (letters as in models/families/llama.py: P prompt tokens, N branches,
T new tokens):

* Every (engine, P, N) cell runs in a fresh subprocess (`--isolate cell`), so
  its peak memory is its own: on CPU the resident set size is polled every
  5 ms during the measured call (`peak_rss_bytes`, and `run_rss_delta_bytes`
  above the RSS just before the call, i.e. what the call itself allocated); on
  GPU/TPU `device.memory_stats()["peak_bytes_in_use"]` (jax) or
  `torch.cuda.max_memory_allocated` (peer). `--isolate engine` runs all N of
  one (engine, P) in one process in increasing N (faster on accelerators: one
  start-up and one model init); peaks are then running maxima, flagged
  `peak_is_running_max`.
* Inside a worker: load (or random init) the model (`load_s`), warm up, then
  the measured call. jaxsample AOT-compiles its programs and reports compile
  seconds apart (`Generation.timings`), so `--warmup small` (a tiny request
  with other shapes: starts thread pools and allocators) is enough to exclude
  compile from every other number; `--warmup full` repeats the measured
  request once first (what accelerators use; costs one extra run).
* All engines decode exactly T tokens per branch: prompts are random token
  ids (the same ids for all engines, `--seed`), temperature 1, no filters;
  jaxsample runs with a tokenizer view whose eos list is empty (the engine
  always adds the model's eos ids to the stop ids), so no branch stops early,
  and `gen.lengths` is checked; the peer uses `min_new_tokens=T`.
* decode time per step = decode seconds / forward steps. jaxsample's loop
  samples T tokens with T - 1 forward passes (the first token comes from the
  prefill's logits); the peer's decode window (first logits processor call to
  the end) is the same T samples and T - 1 forwards. decode tokens/s = N*T /
  decode seconds (all branches). End to end = the whole call without compile
  (`e2e_s`), and with it (`e2e_with_compile_s`).
* Roofline: bandwidth = the best of several large array copies (numpy and
  jax, 2 x bytes moved per copy: read + write); the bytes a decode step must
  read come from `jaxsample.cost.estimate` (weights + prefix KV once + N tails
  for the shared engine, weights + N prefix copies + tails for the naive
  engine and the peer), averaged over the T steps; `roofline_step_s` = bytes /
  bandwidth is the step's lower bound and `roofline_fraction` = that bound /
  the measured step. `roofline_shared_fraction` uses the shared engine's
  bytes for every engine (the limit of the task, not of the algorithm).
* `--naive-prefill tile` (for long prompts on CPU) builds the naive engine's N
  prefix copies by prefilling once and copying the cache N times (the N
  prefills of identical prompts give identical caches), then runs the naive
  decode program unchanged; its prefill and end-to-end time are then not
  measured (null) and the row says `naive_prefill: tile`.

Output: one JSON line per cell (and one per environment/bandwidth record and
per pair of engines) in `--out`, and a markdown table on stdout. Each cell
row carries the machine's load average just before and after its worker
(`loadavg_before`, `loadavg_after`: 1, 5, 15 minutes; llama.cpp's OpenMP
threads slow down by orders of magnitude when the cores are oversubscribed). Ratios are
computed pair by pair from cells of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from benchmarks import common
from benchmarks.common import fmt

ENGINES = ("jaxsample", "jaxsample-int8", "jaxsample-int8-wo", "naive", "hf", "llamacpp")
SUBJECTS = ("jaxsample", "jaxsample-int8", "jaxsample-int8-wo")  # the engines pairs put first

# Named configurations (presets for --config).
CONFIGS = {
    "smollm2": dict(model="smollm2", prompt_lengths=[256, 1024, 4096], branches=[1, 4, 16, 64],
                    new_tokens=64),
    "llama-1b": dict(model="llama-1b", prompt_lengths=[4096], branches=[1, 16, 64],
                     new_tokens=128),
}


# ---------------------------------------------------------------------------
# Worker side (targets of common.spawn: these import jax or torch)


def _dtype_for(model, dtype, plat):
    if dtype != "auto":
        return dtype
    if model == "llama-1b":
        return "bfloat16"
    return "float32" if plat == "cpu" else "bfloat16"


def bandwidth(spec):
    """The roofline worker: `common.bandwidth` at --bandwidth-gib, --bandwidth-repeats."""
    args = spec["args"]
    return common.bandwidth(args["bandwidth_gib"], args["bandwidth_repeats"])


def cells(spec):
    """The cell worker: one engine, one P, the Ns of `spec` in order; yields one row per N."""
    args = argparse.Namespace(**spec["args"])
    if getattr(args, "llama_override", None):
        common.LLAMA_1B.update(json.loads(args.llama_override))
    engine, P = spec["engine"], spec["P"]
    base = dict(kind="cell", engine=engine, config=args.config, P=P, T=args.new_tokens,
                isolate=args.isolate, warmup=args.warmup, engine_sha=common.engine_sha())
    if engine.startswith("llamacpp"):  # an external process (llamacpp-<file type>: one file)
        from benchmarks.peers import llamacpp

        yield from llamacpp.cells(spec, args, base)
        return
    if engine == "hf":  # never start a jax backend in the peer's process
        from benchmarks.peers import hf as peer
    else:
        from benchmarks.peers import jaxsample_engines as peer
    try:
        plat = peer.platform()
        dtype = _dtype_for(args.model, args.dtype, plat)
        base.update(platform=plat, dtype=dtype)
        model, load_s, extra = (peer.load(args.model, dtype) if engine == "hf"
                                else peer.load(args.model, dtype, engine))
        base.update(extra)
    except Exception as e:  # noqa: BLE001
        for N in spec["Ns"]:
            yield dict(base, N=N, error=f"load: {e!r}", traceback=traceback.format_exc()[-2000:])
        return
    for i, N in enumerate(spec["Ns"]):
        row = dict(base, N=N, load_s=load_s, peak_is_running_max=i > 0)
        try:
            row.update(peer.run_cell(model, engine, P, N, args.new_tokens, args, plat))
        except Exception as e:  # noqa: BLE001
            row.update(error=repr(e)[:2000], traceback=traceback.format_exc()[-3000:])
        yield row
        if "error" in row and "RESOURCE_EXHAUSTED" in row["error"]:
            for N2 in spec["Ns"][i + 1:]:  # larger N would fail the same way
                yield dict(base, N=N2, error="skipped: smaller N ran out of memory")
            return


# ---------------------------------------------------------------------------
# Parent side: the grid (no jax, no torch in this process)


def _spawn(spec, timeout):
    """The rows of one worker; a worker that died leaves an error row for each missing N."""
    target = "benchmarks.decode:" + ("bandwidth" if spec["engine"] == "bandwidth" else "cells")
    ran = common.spawn(target, spec, timeout)
    rows = ran.rows
    for row in rows:
        row["worker_wall_s"] = ran.wall_s
    if ran.returncode != 0:  # died (OOM kill, timeout, crash): record what is missing
        done = {r.get("N") for r in rows}
        for N in spec.get("Ns", [None]):
            if N not in done:
                rows.append(dict(kind="cell" if spec["engine"] != "bandwidth" else "bandwidth",
                                 engine=spec["engine"], P=spec.get("P"), N=N,
                                 error=f"worker exit {ran.returncode}: {ran.stderr[-1500:]}"))
    return rows


def schedule(Ps, Ns, engines, isolate):
    """The worker specs: pair by pair (all engines of one (P, N) back to back) with
    `--isolate cell`; one worker per (engine, P), N increasing, with `--isolate engine`."""
    if isolate == "cell":
        return [dict(engine=e, P=P, Ns=[N]) for P in Ps for N in Ns for e in engines]
    return [dict(engine=e, P=P, Ns=sorted(Ns)) for P in Ps for e in engines]


def _predict_hf(done_hf, P, N):
    """Predicted seconds of an HF cell from the measured ones (scales ~ N * P)."""
    best = None
    for c in done_hf:
        if "error" in c or not c.get("e2e_s"):
            continue
        pred = c["e2e_s"] * (N * P) / (c["N"] * c["P"])
        best = pred if best is None else min(best, pred)
    return best


def _llamacpp_why(a, model=None):
    """Why the llama.cpp cells (of `model`, else --llamacpp-model) cannot run (one line), or None."""
    from benchmarks.peers import llamacpp

    why = llamacpp.locate(a.llamacpp_bin, model or a.llamacpp_model)[2]
    if a.model != "smollm2" and not why:
        why = "skipped: the llama.cpp peer runs the smollm2 config only"
    return why


def skip_reason(spec, a, cells_so_far, elapsed, llamacpp_why):
    """Why a spec is not run (one line), or None."""
    e, P = spec["engine"], spec["P"]
    if a.deadline and elapsed > a.deadline:
        return f"skipped: past --deadline {a.deadline:.0f} s"
    if e.startswith("llamacpp") and (llamacpp_why or {}).get(e):
        return llamacpp_why[e]
    if e == "hf" and a.hf_max_p and P > a.hf_max_p:
        return f"skipped: P > --hf-max-p {a.hf_max_p}"
    if e == "hf" and a.hf_skip_above and a.isolate == "cell":
        pred = _predict_hf([c for c in cells_so_far if c["engine"] == "hf"], P, spec["Ns"][0])
        if pred and pred > a.hf_skip_above:
            return f"skipped: predicted {pred:.0f} s > --hf-skip-above {a.hf_skip_above:.0f} s"
    return None


def add_roofline(row, bandwidth_bytes_per_s):
    """The roofline columns of a measured row: step bytes / bandwidth against the step."""
    bw = bandwidth_bytes_per_s
    if bw and row.get("step_bytes") and row.get("decode_step_s"):
        row["bandwidth_bytes_per_s"] = bw
        row["roofline_step_s"] = row["step_bytes"] / bw
        row["roofline_fraction"] = row["roofline_step_s"] / row["decode_step_s"]
        row["roofline_shared_fraction"] = row["step_bytes_shared"] / bw / row["decode_step_s"]


def _pairs(cells):
    """Ratios pair by pair at the same (P, N): each subject (jaxsample, jaxsample-int8)
    against naive, hf and each llamacpp, and jaxsample-int8 against jaxsample."""
    by = {(c["engine"], c["P"], c["N"]): c for c in cells if "error" not in c}
    names = sorted({e for e, _, _ in by if e not in SUBJECTS}, key=_engine_order)
    out = []
    for (eng, P, N), c in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                             _engine_order(kv[0][0]))):
        if eng not in SUBJECTS:
            continue
        for other in (["jaxsample"] if eng.startswith("jaxsample-int8") else []) + names:
            o = by.get((other, P, N))
            if o is None:
                continue
            r = dict(kind="pair", P=P, N=N, engines=f"{eng}/{other}")
            for key in ("decode_step_s", "e2e_s", "prefill_s", "peak_bytes"):
                a, b = c.get(key), o.get(key)
                if a and b:
                    r[f"{key}_ratio"] = a / b  # < 1: the subject is faster / smaller
            if c.get("decode_step_s") and o.get("decode_step_s"):
                r["decode_speedup"] = o["decode_step_s"] / c["decode_step_s"]
            if c.get("e2e_s") and o.get("e2e_s"):
                r["e2e_speedup"] = o["e2e_s"] / c["e2e_s"]
            out.append(r)
    return out


CELL_COLUMNS = ("engine", "P", "N", "load s", "compile s", "prefill s", "decode s/step",
                "decode tok/s", "e2e s", "e2e+compile s", "peak MiB", "KV prefix MiB",
                "KV tails MiB", "roofline s/step", "roofline frac", "note")
PAIR_COLUMNS = ("P", "N", "pair", "decode speedup", "e2e speedup", "peak memory ratio")


def _note(c):
    note = c.get("error", "")[:80]
    if not note and c.get("naive_prefill") == "tile":
        note = "prefill tiled (decode only)"
    if not note and c.get("all_branches_full") is False:
        note = f"early stop: {c.get('decoded_tokens')} tokens"
    return note


def _engine_order(e):
    """ENGINES' order; llamacpp-<type> labels after `llamacpp`, in the order given."""
    base = "llamacpp" if e.startswith("llamacpp") else e
    return (ENGINES.index(base) if base in ENGINES else 9, _LLAMACPP_ORDER.get(e, 0))


_LLAMACPP_ORDER = {}  # llamacpp engine label -> its place in --llamacpp-model (main sets it)


def _table(cells, pairs):
    order = sorted(cells, key=lambda c: (c.get("P") or 0, c.get("N") or 0,
                                         _engine_order(c["engine"])))
    rows = [[c["engine"], str(c.get("P")), str(c.get("N")), fmt(c.get("load_s")),
             fmt(c.get("compile_s")), fmt(c.get("prefill_s")), fmt(c.get("decode_step_s")),
             fmt(c.get("decode_tokens_per_s")), fmt(c.get("e2e_s")),
             fmt(c.get("e2e_with_compile_s")), fmt(c.get("peak_bytes"), "MiB"),
             fmt(c.get("kv_bytes_shared_prefix"), "MiB"), fmt(c.get("kv_bytes_tails"), "MiB"),
             fmt(c.get("roofline_step_s")), fmt(c.get("roofline_fraction")), _note(c)]
            for c in order]
    pair_rows = [[r["P"], r["N"], r["engines"], f"{fmt(r.get('decode_speedup'))}x",
                  f"{fmt(r.get('e2e_speedup'))}x", fmt(r.get("peak_bytes_ratio"))] for r in pairs]
    return "\n".join(common.md_table(CELL_COLUMNS, rows) + [""]
                     + common.md_table(PAIR_COLUMNS, pair_rows))


def _cost_analysis(a, Ps, Ns, out):
    """XLA's cost analysis of the compiled decode step, in a subprocess (no jax here)."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.cost_analysis", "--model", a.model,
                        "--prompt-lengths", ",".join(map(str, Ps)),
                        "--branches", ",".join(map(str, Ns)), "--new-tokens", str(a.new_tokens),
                        "--json", out], capture_output=True, text=True, cwd=common.ROOT)
    return p.stdout if p.returncode == 0 else f"failed: {p.stderr[-1500:]}"


# ---------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    """(namespace, Ps, Ns, engines); the config's preset fills what is not given."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("the grid")
    g.add_argument("--config", default="smollm2", choices=sorted(CONFIGS))
    g.add_argument("--prompt-lengths", help="comma-separated P (default: the config's)")
    g.add_argument("--branches", help="comma-separated N (default: the config's)")
    g.add_argument("--new-tokens", type=int, help="T (default: the config's)")
    g.add_argument("--engines", default="jaxsample,naive,hf")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: float32 on CPU, bfloat16 on accelerators (llama-1b: bfloat16)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--llama-override", default=None,
                   help='JSON dict overriding the llama-1b shapes, e.g. \'{"n_layers": 2}\' '
                        '(smoke tests)')

    g = ap.add_argument_group("how a cell is measured")
    g.add_argument("--warmup", default="small", choices=["small", "full", "none"])
    g.add_argument("--isolate", default="cell", choices=["cell", "engine"])
    g.add_argument("--naive-prefill", default="run", choices=["run", "tile"],
                   help="tile: prefill once and copy (decode-only naive numbers)")
    g.add_argument("--naive-tile-from", type=int, default=None,
                   help="use --naive-prefill tile for P >= this (default: never)")

    g = ap.add_argument_group("time limits")
    g.add_argument("--hf-skip-above", type=float, default=120.0,
                   help="skip HF cells predicted to take longer (seconds; 0 = never skip)")
    g.add_argument("--hf-max-p", type=int, default=None, help="skip HF cells with larger P")
    g.add_argument("--cell-timeout", type=float, default=1800.0)
    g.add_argument("--deadline", type=float, default=0.0,
                   help="stop starting workers after this many seconds (0 = none)")

    g = ap.add_argument_group("the roofline")
    g.add_argument("--bandwidth-gib", type=float, default=1.0)
    g.add_argument("--bandwidth-repeats", type=int, default=5)
    g.add_argument("--cost-analysis", action="store_true",
                   help="also print XLA's cost analysis of the compiled decode step (shared, "
                        "naive, ideal bytes) at each (P, N): benchmarks/cost_analysis.py")

    g = ap.add_argument_group("the llama.cpp peer (benchmarks/peers/llamacpp.py)")
    g.add_argument("--llamacpp-bin", default=None,
                   help="directory of llama-batched-bench (else $JAXSAMPLE_LLAMACPP_BIN)")
    g.add_argument("--llamacpp-model", default=None,
                   help="GGUF for llama.cpp, e.g. the F32 SmolLM2 (else $JAXSAMPLE_LLAMACPP_MODEL); "
                        "several, comma-separated (`path` or `label=path`): one engine each, "
                        "llamacpp-<file type> (llamacpp-f32, llamacpp-q8_0, ...)")
    g.add_argument("--llamacpp-threads", type=int, default=2)
    g.add_argument("--llamacpp-no-repack", action="store_true",
                   help="run llama.cpp with -nr (no weight repacking; this build segfaults on "
                        "quantised files without it); recorded in each row")

    g = ap.add_argument_group("output")
    g.add_argument("--out", default=None,
                   help="JSONL path (default benchmarks/results/<config>_<platform>.jsonl)")
    g.add_argument("--plot", default=None, help="PNG path for benchmarks/plot.py (optional)")
    a = ap.parse_args(argv)

    preset = CONFIGS[a.config]
    Ps = [int(x) for x in a.prompt_lengths.split(",")] if a.prompt_lengths else preset["prompt_lengths"]
    Ns = [int(x) for x in a.branches.split(",")] if a.branches else preset["branches"]
    a.new_tokens = a.new_tokens or preset["new_tokens"]
    a.model = preset["model"]
    engines = [e for e in a.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; choose from {ENGINES}")
    return a, Ps, Ns, engines


def main(argv=None):
    a, Ps, Ns, engines = parse_args(argv)
    t_begin = time.perf_counter()
    wargs = dict(vars(a))  # what every worker gets

    env = common.environment()
    bw = (_spawn(dict(engine="bandwidth", args=wargs), 600) or [{}])[0]
    env.update(platform=bw.get("platform"), device_kind=bw.get("device_kind"))
    bandwidth_bytes_per_s = bw.get("bandwidth_bytes_per_s")
    print(f"# {env['date']} {env['cpu']} x{env['cpu_count']} {env.get('device_kind')} "
          f"bandwidth {(bandwidth_bytes_per_s or 0) / 1e9:.1f} GB/s", flush=True)

    out = a.out or os.path.join(common.ROOT, "benchmarks", "results",
                                f"{a.config}_{bw.get('platform') or 'unknown'}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fh = open(out, "w")
    for rec in (env, bw):
        fh.write(json.dumps(rec) + "\n")
    fh.flush()

    llamacpp_models, llamacpp_why = {}, {}
    if "llamacpp" in engines:  # one engine per llama.cpp file
        from benchmarks.peers import llamacpp

        labels = llamacpp.engines(a.llamacpp_model)
        i = engines.index("llamacpp")
        engines[i:i + 1] = [label for label, _ in labels]
        for k, (label, path) in enumerate(labels):
            llamacpp_models[label] = path
            llamacpp_why[label] = _llamacpp_why(a, path)
            _LLAMACPP_ORDER[label] = k
    cells = []
    for spec in schedule(Ps, Ns, engines, a.isolate):
        e, P = spec["engine"], spec["P"]
        spec["args"] = dict(wargs)
        if e in llamacpp_models:
            spec["llamacpp_model"] = llamacpp_models[e]
        if e == "naive" and a.naive_tile_from is not None and P >= a.naive_tile_from:
            spec["args"]["naive_prefill"] = "tile"
        skip = skip_reason(spec, a, cells, time.perf_counter() - t_begin, llamacpp_why)
        load0 = os.getloadavg()  # the machine's load average (1, 5, 15 min) around the worker
        if skip:
            rows = [dict(kind="cell", engine=e, config=a.config, P=P, N=N, T=a.new_tokens,
                         error=skip) for N in spec["Ns"]]
        else:
            rows = _spawn(spec, a.cell_timeout)
        for row in rows:
            row.update(loadavg_before=load0, loadavg_after=os.getloadavg())
            add_roofline(row, bandwidth_bytes_per_s)
            cells.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            msg = row.get("error", "")[:120] or (
                f"prefill {fmt(row.get('prefill_s'))} s, step {fmt(row.get('decode_step_s'))} s, "
                f"e2e {fmt(row.get('e2e_s'))} s, peak {fmt(row.get('peak_bytes'), 'MiB')} MiB")
            print(f"  {e:14s} P={P:<5d} N={row.get('N')!s:<3s} {msg}", flush=True)

    pairs = _pairs(cells)
    for r in pairs:
        fh.write(json.dumps(r) + "\n")
    fh.close()
    print()
    print(_table(cells, pairs))
    if a.cost_analysis:
        print("\nXLA cost analysis of one compiled decode step (bytes accessed):\n"
              + _cost_analysis(a, Ps, Ns, out))
    print(f"\nwrote {out} ({time.perf_counter() - t_begin:.0f} s)")
    if a.plot:
        try:
            from benchmarks import plot

            plot.plot([out], a.plot)
            print(f"wrote {a.plot}")
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e!r}")


if __name__ == "__main__":
    main()
