"""The MoE expert compute, three ways, side by side in one process (CPU).

For T tokens (the N branches of a decode step, T = N), one Mixtral-like
layer (X experts, top k, model dim E, expert width F): `models.families.moe.expert_mix`
with impl "dense" (one-hot einsum over all experts), "gather" (each token's
k expert matrices gathered) and "sorted" (assignments sorted by expert,
`lax.ragged_dot`). Each jitted, warmed up, then timed interleaved (round
robin, median of `--reps`), so machine load hits all three alike.

    python -m benchmarks.moe_paths [--dim 512 --ffn 1792 --experts 8 --k 2 --reps 30]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxsample.models.families import moe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1792)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    E, F, X, k = a.dim, a.ffn, a.experts, a.k
    keys = jax.random.split(jax.random.key(0), 5)
    router = jax.random.normal(keys[0], (E, X)) / E ** 0.5
    wg = jax.random.normal(keys[1], (X, E, F)) * 0.02
    wu = jax.random.normal(keys[2], (X, E, F)) * 0.02
    wd = jax.random.normal(keys[3], (X, F, E)) * 0.02
    rows = []
    for T in a.tokens:
        h = jax.random.normal(jax.random.fold_in(keys[4], T), (T, E))
        w, idx = moe.route(h @ router, k, True)
        # Weights are arguments (as the engine passes params), never constants.
        fns = {impl: functools.partial(jax.jit(functools.partial(moe.expert_mix, impl=impl)),
                                       wg=wg, wu=wu, wd=wd)
               for impl in ("dense", "gather", "sorted", "loop")}
        outs = {impl: jax.block_until_ready(f(h, w, idx)) for impl, f in fns.items()}
        ref = outs["dense"]
        times = {impl: [] for impl in fns}
        for _ in range(a.reps):
            for impl, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(h, w, idx))
                times[impl].append(time.perf_counter() - t0)
        med = {impl: statistics.median(v) * 1e3 for impl, v in times.items()}
        touched = int(jnp.sum(jnp.bincount(idx.reshape(-1), length=X) > 0))
        row = dict(tokens=T, experts_touched=touched, ms=med,
                   max_abs_diff={i: float(jnp.max(jnp.abs(o - ref))) for i, o in outs.items()})
        rows.append(row)
        print(json.dumps(row))
    print(json.dumps(dict(config=dict(dim=E, ffn=F, experts=X, k=k), device=str(jax.devices()[0]))))


if __name__ == "__main__":
    main()
