"""Prefill speed and memory: the dense causal kernel against the blockwise one.

Usage (CPU, the embedded SmolLM2-135M-Instruct in float32):

    python -m benchmarks.prefill                     # P = 1024, 4096, 8192
    python -m benchmarks.prefill --prompt-lengths 256 --repeats 3 --out /tmp/p.json

What it measures (letters as in models/families/llama.py: P prompt tokens, L layers):

* Every (kernel, P) cell runs in a fresh subprocess (the worker protocol of
  benchmarks/common.py), so its peak resident set size is its own (polled
  every 5 ms during the timed calls, `common.PeakRSS`; on an accelerator
  `peak_bytes_in_use`). The
  kernel is forced through `models.families.flash.BLOCKWISE_FROM` (dense: never
  blockwise) before anything is traced.
* The program is the engine's prefill (`jaxsample.engine.prefill.prefill`,
  one right-padded prompt, last-position logits and the L-layer KV cache),
  compiled ahead of time (`jit(...).lower(...).compile()`, `compile_s`
  reported apart), then called `--repeats` times: `prefill_s` is the median,
  `prefill_runs_s` all of them.
* Where the time goes: the `noattn` cells run the same program with the
  attention replaced by the identity on q (projections, MLP, norms, RoPE,
  embedding, last logits and the KV cache layout, nothing else), so
  `prefill_s(kernel) - prefill_s(noattn)` is the attention's share.
  `analytic` holds the FLOPs of the projections/MLP and of the attention
  (dense: the full `[P, P]` square for both products; blockwise: the block
  pairs it computes, `flash.block_pairs`). XLA's `cost_analysis()` of the
  compiled program is kept (`xla_cost`): it counts a loop body once, not per
  trip, so it under-counts the blockwise kernel.
* The 8k checks: each worker saves the last logits and the last layer's K/V;
  for every P run with both kernels the parent reports the largest
  difference relative to the dense path's max |value| (`checks`; flagged
  `within_rtol` against `--check-rtol`, default 1e-4 of max |x| after L = 30
  layers). `--layer-check S` (default 8192) runs one attention layer at
  SmolLM2's H, K, D with random q, k, v through both kernels against a
  float64 numpy oracle: errors relative to max |v|, flagged against the
  tests' bound 1e-5 (tests/models/test_flash_prefill.py).

Writes one JSON file (`--out`, default benchmarks/results/prefill.json) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import (
    PeakRSS,
    cpu_model,
    device_mem,
    load_jax_model,
    md_table,
    now,
    prompt_ids,
    ru_maxrss_bytes,
    spawn,
    versions,
)

HERE = os.path.dirname(os.path.abspath(__file__))

KERNELS = ("dense", "blockwise", "noattn")


def _analytic(cfg, P, kernel, block):
    from jaxsample.models.families import flash

    E, F, L = cfg.dim, cfg.ffn_dim, cfg.n_layers
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    proj = 2 * P * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F) * L
    if kernel == "noattn":
        keys_per_query = 0
    elif kernel == "dense":
        keys_per_query = P
    else:
        b = min(block, P)
        keys_per_query = int(flash.block_pairs(P, P, b, b).sum()) * b * b / P
    attn = 2 * 2 * P * keys_per_query * H * D * L  # q k^T and p v
    return {"projection_mlp_flops": proj, "attention_flops": attn,
            "logits_flops": 2 * E * cfg.vocab_size}


def worker(spec):
    import jax
    import jax.numpy as jnp

    from jaxsample.models.families import flash

    if spec["kernel"] == "dense":
        flash.BLOCKWISE_FROM = tuple((b, 2**31) for b, _ in flash.BLOCKWISE_FROM)
    elif spec["kernel"] == "blockwise":
        flash.BLOCKWISE_FROM = tuple((b, 1) for b, _ in flash.BLOCKWISE_FROM)
        flash.BLOCK = spec["block"] or flash.BLOCK
    elif spec["kernel"] == "noattn":  # the identity on q: everything but the attention
        from jaxsample.models.families import gemma3, llama

        for fam in (llama, gemma3):
            fam.causal_attend = lambda *a, **k: (lambda q, k_, v: q)
    spec = dict(spec, block=flash.BLOCK)
    from jaxsample.engine.prefill import prefill

    lm, load_s = load_jax_model(spec["model"], spec["dtype"])
    cfg, params = lm.config, lm.params
    P = spec["P"]
    ids = np.asarray(prompt_ids(0, P, cfg.vocab_size), np.int32)
    tokens, lengths = jnp.asarray(ids[None]), jnp.asarray([P], jnp.int32)
    fn = jax.jit(lambda p, t, n: prefill(cfg, p, t, n))
    t0 = time.perf_counter()
    prog = fn.lower(params, tokens, lengths).compile()
    compile_s = time.perf_counter() - t0
    try:
        cost = prog.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        cost = {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
    except Exception as e:  # noqa: BLE001
        cost = {"error": repr(e)}
    plat = jax.devices()[0].platform
    runs = []
    with PeakRSS() as rss:
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            out = jax.block_until_ready(prog(params, tokens, lengths))
            runs.append(time.perf_counter() - t0)
    prefix, last = out[:2]
    res = dict(spec, load_s=load_s, compile_s=compile_s, prefill_s=statistics.median(runs),
               prefill_runs_s=runs, tokens_per_s=P / statistics.median(runs), platform=plat,
               peak_rss_bytes=rss.peak, run_rss_delta_bytes=rss.peak - rss.start,
               ru_maxrss_bytes=ru_maxrss_bytes(), xla_cost=cost,
               analytic=_analytic(cfg, P, spec["kernel"], spec["block"]))
    if plat != "cpu":
        res["device_peak_bytes"] = device_mem().get("peak_bytes_in_use")
    if spec.get("save"):
        np.savez(spec["save"], logits=np.asarray(last, np.float32),
                 k=np.asarray(prefix.k[-1], np.float32), v=np.asarray(prefix.v[-1], np.float32))
    return res


def layer_check(spec):
    """One attention layer at the model's H, K, D and S = P (random q, k, v):
    both kernels against a float64 numpy oracle, errors relative to max |v|."""
    import jax

    from jaxsample.models.families import common

    H, K, D, S = spec["H"], spec["K"], spec["D"], spec["P"]
    r = np.random.default_rng(2)
    q = r.normal(size=(S, H, D)).astype(np.float32)
    k = r.normal(size=(S, K, D)).astype(np.float32)
    v = r.normal(size=(S, K, D)).astype(np.float32)
    res = dict(spec)
    outs = {}
    for impl in ("dense", "blockwise"):
        f = jax.jit(common.causal_attend(scale=1 / np.sqrt(D), impl=impl))
        t0 = time.perf_counter()
        outs[impl] = np.asarray(jax.block_until_ready(f(q, k, v)), np.float64)
        res[impl + "_s_incl_compile"] = time.perf_counter() - t0
    G = H // K
    want = np.empty((S, H, D))
    tri = np.tril(np.ones((S, S), bool))
    for h in range(H):  # [S, S] float64 per head
        s_ = (q[:, h].astype(np.float64) / np.sqrt(D)) @ k[:, h // G].astype(np.float64).T
        s_ = np.where(tri, s_, -np.inf)
        p_ = np.exp(s_ - s_.max(-1, keepdims=True))
        want[:, h] = (p_ @ v[:, h // G].astype(np.float64)) / p_.sum(-1, keepdims=True)
        del s_, p_
    vmax = float(np.abs(v).max())
    for impl, o in outs.items():
        res[impl + "_max_err_rel_vmax"] = float(np.abs(o - want).max() / vmax)
    res["blockwise_vs_dense_rel_vmax"] = float(np.abs(outs["blockwise"] - outs["dense"]).max()
                                               / vmax)
    res["within_rtol"] = res["blockwise_max_err_rel_vmax"] <= 1e-5
    return res


def cell(spec):
    """The worker target (benchmarks.common.spawn): a kernel cell or the one-layer check."""
    return layer_check(spec) if spec.get("layer_check") else worker(spec)


def _spawn(spec, timeout):
    ran = spawn("benchmarks.prefill:cell", spec, timeout)
    if ran.rows:
        return ran.rows[-1]
    if ran.returncode == "timeout":
        return dict(spec, error=f"timeout after {timeout} s")
    return dict(spec, error=(ran.stderr or ran.stdout)[-2000:], returncode=ran.returncode)


def _check(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    out = {}
    for name in ("logits", "k", "v"):
        ref = a[name]
        out[name + "_max_abs_diff"] = float(np.abs(b[name] - ref).max())
        out[name + "_rel_to_max"] = float(np.abs(b[name] - ref).max() / np.abs(ref).max())
    out["same_argmax"] = bool(np.argmax(a["logits"]) == np.argmax(b["logits"]))
    return out


def _table(cells):
    rows = md_table(("P", "kernel", "prefill s (median)", "tok/s", "runs s", "peak RSS GB",
                     "RSS delta GB", "compile s"), [])
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['P']} | {c['kernel']} | error: {c['error'][-120:]!r} |||||")
            continue
        rows.append(f"| {c['P']} | {c['kernel']} | {c['prefill_s']:.2f} | {c['tokens_per_s']:.0f} "
                    f"| {' '.join(f'{t:.1f}' for t in c['prefill_runs_s'])} "
                    f"| {c['peak_rss_bytes'] / 1e9:.2f} "
                    f"| {c['run_rss_delta_bytes'] / 1e9:.2f} | {c['compile_s']:.1f} |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "llama-1b"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-lengths", default="1024,4096,8192")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--block", type=int, default=None, help="blockwise block size "
                    "(default models.families.flash.BLOCK)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cell-timeout", type=float, default=1200)
    ap.add_argument("--check-rtol", type=float, default=1e-4)
    ap.add_argument("--layer-check", type=int, default=8192, help="S of the one-layer float64 "
                    "check at SmolLM2's H=9, K=3, D=64 (0: off)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefill.json"))
    args = ap.parse_args(argv)
    kernels = args.kernels.split(",")
    tmp = tempfile.mkdtemp(prefix="prefill_bench_")
    cells, checks = [], []
    t_start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def write():  # after every cell: a run killed from outside keeps what it measured
        result = {"benchmark": "prefill", "date": now(), "cpu": cpu_model(),
                  "versions": versions(), "model": args.model, "dtype": args.dtype,
                  "block": args.block, "repeats": args.repeats, "check_rtol": args.check_rtol,
                  "wall_s": time.time() - t_start, "cells": cells, "checks": checks}
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    for P in (int(p) for p in args.prompt_lengths.split(",")):
        saved = {}
        for kernel in kernels:
            save = os.path.join(tmp, f"{kernel}_{P}.npz")
            spec = dict(model=args.model, dtype=args.dtype, P=P, kernel=kernel,
                        block=args.block, repeats=args.repeats, save=save)
            c = _spawn(spec, args.cell_timeout)
            c.pop("save", None)
            cells.append(c)
            print(json.dumps({k: c.get(k) for k in ("P", "kernel", "prefill_s", "prefill_runs_s",
                                                    "peak_rss_bytes", "error")}), flush=True)
            if "error" not in c:
                saved[kernel] = save
            write()
        if "dense" in saved and "blockwise" in saved:
            chk = dict(P=P, **_check(saved["dense"], saved["blockwise"]))
            chk["within_rtol"] = all(chk[n + "_rel_to_max"] <= args.check_rtol
                                     for n in ("logits", "k", "v"))
            checks.append(chk)
            print(json.dumps(chk), flush=True)
            write()
    layer = None
    if args.layer_check:
        layer = _spawn(dict(layer_check=True, P=args.layer_check, H=9, K=3, D=64),
                       args.cell_timeout)
        print(json.dumps(layer), flush=True)
        checks.append(layer)
        write()
    print(_table(cells))
    print(f"wrote {args.out}")
    ok = all("error" not in c for c in cells) and all(c.get("within_rtol") for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
