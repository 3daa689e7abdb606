"""What the vocabulary-wide passes of the sampler cost per decode step, before/after.

Times `sampling.choose_token` vmapped over N rows of V synthetic logits
(`normal * 4`, jitted) for each filter setting and each implementation:
`bisection` (candidates=0: the exact 32-pass bisection over V for top-k /
top-p and V Gumbel draws per row, the code before the top-k pre-selection)
and `K0=...` (`lax.top_k` pre-selection of K0 candidates, in stages joined
by `+`: 256+1024 is the default from V = 16,384, 256 alone from 4,096, none below
(`select.VOCAB_PER_CANDIDATE`); the bisection only as the last fallback,
Gumbel noise only at the candidates when the kept set fits in them). A measured,
not adopted, alternative is timed beside them: `inverse CDF`, one uniform
per row inverted through block sums of exp(z) over the kept set (a two-level
search, no sort). The machine is shared: every repeat runs every
(setting, implementation) once, interleaved, and medians are reported.

With `--step`, one whole decode step of the engine (`generate` decode time /
steps, top-p 0.95) is measured for the embedded SmolLM2 (V = 49,152) and
Gemma 3 270M (V = 262,144, when installed), to give each figure's share.

    python -m benchmarks.sampler_cost [--n 16] [--repeats 15] [--vocab 49152,262144]
        [--candidates 256+1024,1024] [--step]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

SETTINGS = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
            "temperature only": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
            "top-p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
            "top-k 50 + top-p 0.95 + min-p 0.05": dict(temperature=0.8, top_k=50, top_p=0.95,
                                                      min_p=0.05),
            "top-p 0.999 (fallback)": dict(temperature=0.8, top_k=0, top_p=0.999, min_p=0.0)}


def _icdf_choose(logits, key, temperature, vocab_limit, block=512):
    """Inverse-CDF sampling over all valid tokens (temperature only): the
    measured alternative to the Gumbel draw, not the library's method."""
    import jax
    import jax.numpy as jnp

    from jaxsample.engine import sampling

    _, z, _ = sampling.prepare(logits, temperature, vocab_limit)
    block = math.gcd(z.shape[0], block)  # blocks that tile V
    e = jnp.exp(z).reshape(-1, block)
    c = jnp.cumsum(jnp.sum(e, axis=1))
    u = jax.random.uniform(key) * c[-1]
    b = jnp.minimum(jnp.sum(c <= u), c.shape[0] - 1)
    inner = jnp.cumsum(jax.lax.dynamic_index_in_dim(e, b, keepdims=False))
    base = jnp.where(b > 0, c[jnp.maximum(b - 1, 0)], 0.0)
    return b * block + jnp.minimum(jnp.sum(base + inner <= u), block - 1)


def nucleus_sizes(logits, temperature: float, top_p: float) -> list[int]:
    """Rows' top-p set sizes (float64, for the report)."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max(1, keepdims=True))
    p = -np.sort(-p / p.sum(1, keepdims=True), axis=1)
    return [int(np.sum(np.concatenate([[0.0], np.cumsum(r)[:-1]]) < top_p)) for r in p]


def sampler_ms(V: int, vocab_limit: int, n: int, repeats: int, k0s: list[int]):
    """{(setting, implementation): median ms} for N rows of V synthetic logits."""
    import jax
    import jax.numpy as jnp

    from jaxsample.engine import sampling

    logits = jax.random.normal(jax.random.key(0), (n, V), jnp.float32) * 4.0
    keys = jax.random.split(jax.random.key(1), n)
    impls = [("bisection", 0)] + [("K0=" + "+".join(map(str, k)), k) for k in k0s]
    fns = {}
    for name, kw in SETTINGS.items():
        args = (jnp.float32(kw["temperature"]), jnp.int32(kw["top_k"]),
                jnp.float32(kw["top_p"]), jnp.float32(kw["min_p"]))
        for impl, k0 in impls:
            f = jax.jit(jax.vmap(lambda l, k, t, tk, tp, mp, k0=k0: sampling.choose_token(
                l, k, t, tk, tp, mp, vocab_limit, candidates=k0),
                in_axes=(0, 0, None, None, None, None)))
            fns[name, impl] = (f, (logits, keys) + args)
    icdf = jax.jit(jax.vmap(lambda l, k: _icdf_choose(l, k, 0.8, vocab_limit)))
    fns["temperature only", "inverse CDF"] = (icdf, (logits, keys))
    results = {}
    for key, (f, a) in fns.items():  # compile, and check the implementations agree
        results[key] = np.asarray(jax.block_until_ready(f(*a))[0] if key[1] != "inverse CDF"
                                  else f(*a))
    for name in SETTINGS:
        ref = results[name, "bisection"]
        for impl, _ in impls[1:]:
            same = int(np.sum(results[name, impl] == ref))
            if same != n:
                print(f"  note: V={V} {name} {impl}: {n - same} of {n} tokens differ from bisection")
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (f, a) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append(time.perf_counter() - t0)
    sizes = {p: nucleus_sizes(logits, 0.8, p) for p in (0.95, 0.999)}
    return {k: 1000 * statistics.median(v) for k, v in times.items()}, impls, sizes


def step_ms(lm, n: int, steps: int = 16) -> float:
    from jaxsample import SamplingParams, generate

    params = SamplingParams(n=n, temperature=0.8, top_p=0.95, max_new_tokens=steps, seed=0,
                            stop_token_ids=[])
    ids = list(range(100, 164))  # a 64-token prompt
    generate(lm, [ids], params)  # compile
    g = generate(lm, [ids], params)
    return 1000 * g.timings["decode"] / max(g.bill.decode_steps, 1)


def engine_steps(n: int) -> dict[int, float]:
    import jaxsample

    models = ["smollm2-135m-instruct"]
    try:
        from jaxsample.models.checkpoints import registry

        registry.embedded_path(registry.GEMMA3_270M)
        models.append(registry.GEMMA3_270M)
    except Exception as e:  # noqa: BLE001 - optional model
        print(f"gemma3-270m not available: {e}")
    out = {}
    for name in models:
        lm = jaxsample.load(name)
        out[lm.config.vocab_size] = step_ms(lm, n)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--vocab", default="49152,262144")
    ap.add_argument("--candidates", default="256+1024,1024",
                    help="pre-selection variants: stages joined by +, variants by commas")
    ap.add_argument("--step", action="store_true", help="also time a decode step per model")
    args = ap.parse_args(argv)
    k0s = [tuple(int(x) for x in k.split("+")) for k in args.candidates.split(",") if k]
    steps = engine_steps(args.n) if args.step else {}
    for V in (int(v) for v in args.vocab.split(",")):
        ms, impls, sizes = sampler_ms(V, V, args.n, args.repeats, k0s)
        print(f"\nV = {V}, N = {args.n}, medians of {args.repeats} interleaved calls (ms)"
              + (f"; decode step {steps[V]:.0f} ms" if V in steps else ""))
        for p, s in sizes.items():
            print(f"  top-p {p} set sizes (float64): min {min(s)}, median "
                  f"{int(np.median(s))}, max {max(s)}")
        names = [i for i, _ in impls]
        print("| setting | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for name in SETTINGS:
            cells = []
            for impl in names:
                v = ms[name, impl]
                share = f" ({100 * v / steps[V]:.0f}%)" if V in steps else ""
                cells.append(f"{v:.1f}{share}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print(f"| temperature only, inverse CDF (not adopted) | {ms['temperature only', 'inverse CDF']:.1f} |")


if __name__ == "__main__":
    main()
