"""The decode step against this machine's compute roofline, measured in the same run.

Issue 22 part 3. One process, everything interleaved repeat by repeat (a noisy
neighbour on a shared machine hits every figure alike), medians reported:

1. **Peak**: an XLA float32 matmul `[M, M] x [M, M]` (`--big`, default 2048),
   jitted, its GFLOP/s = 2 M^3 / seconds: what XLA's CPU dot reaches here.
2. **The step's matmuls**: every weight matmul of one decode step at its own
   shape `[N, in] x [in, out]` (q, k, v, o, gate, up, down, each over L
   distinct weights in one program; the output projection `[N, E] x [E, V]`);
   their summed time is what the step's linear algebra costs run as XLA's own dots,
   the "shape roofline" (at N = 16 these dots are thin: they read each weight
   once for 16 rows, so they sit below the peak).
3. **The step**: the engine's decode step (`Session` over one P-token prompt,
   N branches, T new tokens, `ignore_eos`: seconds per forward step, as
   `benchmarks/step_ablation.py`), with its FLOPs from the cost model
   (`cost.model`: N x (linear + logits) + attention over P + t keys).
4. **The bandwidth roofline**: `benchmarks.common.bandwidth` (a 1 GiB copy, best
   of 5); the step's bound is the larger of its FLOPs at the peak and the bytes
   it must read (the weights once, the prefix KV once, N tails) at that bandwidth.
5. **The sampler**: `sampling.choose_token` vmapped over the step's `[N, V]`
   logits (temperature 1, no filter: the setting of the step above), alone.

Reported per (P, N): step ms, step GFLOP/s, that / peak ("fraction of the
roofline"), that / the shape roofline, and the sampler's ms and share of the
step. Rows go to `--out` as JSON.

    python -m benchmarks.roofline --prompt-lengths 1024,4096 --branches 1,16 \
        --out benchmarks/results/roofline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _timed(fn, *args) -> float:
    import jax

    t0 = time.perf_counter()
    out = fn(*args)
    for leaf in jax.tree_util.tree_leaves(out):
        leaf.block_until_ready()
    return time.perf_counter() - t0


def matmul_fn(m: int, k: int, n: int, times: int = 1, dtype="float32"):
    """(jitted fn, a, w) computing `a @ w[l]` for each of `times` distinct `[k, n]` weights
    (one program, the dots unrolled: each reads its own weight, as the step's layers do,
    and one dispatch is paid for all), compiled and warmed up."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), dtype)
    # Separate arrays, as the engine's per-layer dicts: slicing one stacked [L, k, n]
    # array copied each weight (the dots ran slower than the whole step).
    w = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for _ in range(times)]
    f = jax.jit(lambda x, ws: [x @ wi for wi in ws])
    _timed(f, a, w)
    return f, a, w


def step_shapes(cfg, n: int) -> list[tuple[str, int, int, int, int]]:
    """The weight matmuls of one decode step: (name, M, K, N, times per step)."""
    E, H, K, D = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    F = cfg.ffn_dim
    L = cfg.n_layers
    return [("q", n, E, H * D, L), ("k", n, E, K * D, L), ("v", n, E, K * D, L),
            ("o", n, H * D, E, L), ("gate", n, E, F, L), ("up", n, E, F, L),
            ("down", n, F, E, L), ("logits", n, E, cfg.vocab_size, 1)]


def step_flops(cfg, P: int, n: int, T: int) -> float:
    """FLOPs of one decode step of n branches, averaged over T steps after P tokens."""
    from jaxsample.cost import model as cm

    return n * cm.decode_flops(cfg, P, T) / T


def sampler_fn(V: int, vocab_limit: int, n: int):
    """(jitted choose_token over [n, V] logits, args), compiled and warmed up."""
    import jax
    import jax.numpy as jnp

    from jaxsample.engine import sampling

    logits = jnp.asarray(np.random.default_rng(1).standard_normal((n, V)) * 4, jnp.float32)
    keys = jax.random.split(jax.random.key(0), n)

    def f(lg, ks):
        return jax.vmap(lambda x, k: sampling.choose_token(
            x, k, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0),
            vocab_limit))(lg, ks)

    f = jax.jit(f)
    _timed(f, logits, keys)
    return f, logits, keys


def run(Ps, Ns, T, reps, big, model=None):
    import dataclasses

    from benchmarks.common import NoEosTokenizer, prompt_ids
    from benchmarks.step_ablation import _decode
    from jaxsample import SamplingParams
    from jaxsample.engine import session
    from jaxsample.loading import load

    lm = load(model, dtype="float32")
    lm = dataclasses.replace(lm, tokenizer=NoEosTokenizer(lm.tokenizer))
    cfg = lm.config
    peak = matmul_fn(big, big, big)
    shapes = {N: [(name, times, matmul_fn(m, k, n_, times), 2 * m * k * n_)
                  for name, m, k, n_, times in step_shapes(cfg, N)] for N in Ns}
    samplers = {N: sampler_fn(cfg.vocab_size, lm.vocab_limit, N) for N in Ns}
    sessions = {}
    for P in Ps:
        ids = prompt_ids(0, P, lm.vocab_limit)
        for N in Ns:
            sp = SamplingParams(n=N, temperature=1.0, max_new_tokens=T, seed=0)
            sessions[P, N] = s = session.Session(lm, [ids], sp)
            _decode(s, N, T)  # compile and warm up
    times: dict = {}
    for _ in range(reps):
        times.setdefault("peak", []).append(_timed(*peak))
        for N in Ns:
            for name, _, fn, _ in shapes[N]:
                times.setdefault(("dot", N, name), []).append(_timed(*fn))
            times.setdefault(("sampler", N), []).append(_timed(*samplers[N]))
        for (P, N), s in sessions.items():
            times.setdefault(("step", P, N), []).append(_decode(s, N, T))
    med = {k: statistics.median(v) for k, v in times.items()}
    peak_gflops = 2 * big ** 3 / med["peak"] / 1e9
    from benchmarks.common import bandwidth

    bw = bandwidth(1.0, 5)["bandwidth_bytes_per_s"]  # copy bandwidth, best of 5
    from jaxsample.cost import model as cm
    rows = []
    for (P, N) in sessions:
        shape_s = sum(med[("dot", N, name)] for name, _, _, _ in shapes[N])
        shape_flops = sum(times_ * fl for _, times_, _, fl in shapes[N])
        step_s = med[("step", P, N)]
        flops = step_flops(cfg, P, N, T)
        # What a step must read at least: the weights once, the prefix KV once, N tails.
        step_bytes = cm.weight_bytes(cfg) + cm.kv_bytes(cfg, P) + N * cm.kv_bytes(cfg, T // 2)
        bound_s = max(flops / (peak_gflops * 1e9), step_bytes / bw)
        rows.append(dict(
            bandwidth_gbs=bw / 1e9, step_bytes=step_bytes,
            roofline_ms=bound_s * 1e3, fraction_of_roofline=bound_s / step_s,
            P=P, N=N, T=T, reps=reps, step_ms=step_s * 1e3, step_gflop=flops / 1e9,
            step_gflops=flops / step_s / 1e9, peak_gflops=peak_gflops,
            fraction_of_peak=flops / step_s / 1e9 / peak_gflops,
            shape_roofline_ms=shape_s * 1e3, shape_gflops=shape_flops / shape_s / 1e9,
            fraction_of_shape_roofline=shape_s / step_s,
            sampler_ms=med[("sampler", N)] * 1e3,
            sampler_share=med[("sampler", N)] / step_s,
            dots_ms={name: med[("dot", N, name)] * 1e3 for name, _, _, _ in shapes[N]},
            dots_gflops={name: times_ * fl / med[("dot", N, name)] / 1e9
                         for name, times_, _, fl in shapes[N]},
            step_ms_all=[x * 1e3 for x in times[("step", P, N)]]))
    return rows


def main(argv=None):
    from benchmarks.common import environment, md_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lengths", default="1024,4096")
    ap.add_argument("--branches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--big", type=int, default=2048, help="the peak matmul's size M")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = run([int(x) for x in a.prompt_lengths.split(",")],
               [int(x) for x in a.branches.split(",")], a.new_tokens, a.reps, a.big, a.model)
    print("\n".join(md_table(["P", "N", "step ms", "GFLOP/step", "GFLOP/s", "peak GFLOP/s",
                    "of peak", "roofline ms (max of compute, bytes / copy GB/s)", "of roofline",
                    "shape roofline ms", "of shape roofline", "sampler ms", "sampler share"],
                   [[r["P"], r["N"], f"{r['step_ms']:.1f}", f"{r['step_gflop']:.2f}",
                     f"{r['step_gflops']:.1f}", f"{r['peak_gflops']:.1f}",
                     f"{r['fraction_of_peak']:.0%}",
                     f"{r['roofline_ms']:.1f} ({r['bandwidth_gbs']:.1f} GB/s)",
                     f"{r['fraction_of_roofline']:.0%}", f"{r['shape_roofline_ms']:.1f}",
                     f"{r['fraction_of_shape_roofline']:.0%}", f"{r['sampler_ms']:.2f}",
                     f"{r['sampler_share']:.0%}"] for r in rows])))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
