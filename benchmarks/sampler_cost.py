"""What the vocabulary-wide passes of the sampler cost per decode step, against the step.

Times `sampling.choose_token` vmapped over N rows of V logits (jitted, medians of
repeated calls) for each filter setting, and one whole decode step of the engine
(`generate` with max_new_tokens steps, decode time / steps) on the same N, for
the embedded SmolLM2 (V = 49,152) and Gemma 3 270M (V = 262,144) when installed.

    python benchmarks/sampler_cost.py [--n 16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

SETTINGS = {"greedy": dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),
            "temperature only": dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
            "top-p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
            "top-k 50 + top-p 0.95 + min-p 0.05": dict(temperature=0.8, top_k=50, top_p=0.95,
                                                      min_p=0.05)}


def sampler_ms(V: int, vocab_limit: int, n: int, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from jaxsample import sampling

    logits = jax.random.normal(jax.random.key(0), (n, V), jnp.float32) * 4.0
    keys = jax.random.split(jax.random.key(1), n)
    out = {}
    for name, kw in SETTINGS.items():
        f = jax.jit(jax.vmap(lambda l, k, t, tk, tp, mp: sampling.choose_token(
            l, k, t, tk, tp, mp, vocab_limit), in_axes=(0, 0, None, None, None, None)))
        args = (logits, keys, jnp.float32(kw["temperature"]), jnp.int32(kw["top_k"]),
                jnp.float32(kw["top_p"]), jnp.float32(kw["min_p"]))
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        out[name] = 1000 * statistics.median(times)
    return out


def step_ms(lm, n: int, steps: int = 16) -> float:
    from jaxsample import generate
    from jaxsample.sampling import SamplingParams

    params = SamplingParams(n=n, temperature=0.8, top_p=0.95, max_new_tokens=steps, seed=0,
                            stop_token_ids=[])
    ids = list(range(100, 164))  # a 64-token prompt
    generate(lm, [ids], params)  # compile
    g = generate(lm, [ids], params)
    return 1000 * g.timings["decode"] / max(g.bill.decode_steps, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    import jaxsample

    models = [("smollm2-135m-instruct", None)]
    try:
        from jaxsample.models import registry

        registry.embedded_path(registry.GEMMA3_270M)
        models.append((registry.GEMMA3_270M, None))
    except Exception as e:  # noqa: BLE001 - optional model
        print(f"gemma3-270m not available: {e}")
    rows = []
    for name, _ in models:
        lm = jaxsample.load(name)
        V = lm.config.vocab_size
        samp = sampler_ms(V, lm.vocab_limit, args.n, args.repeats)
        step = step_ms(lm, args.n)
        rows.append((name, V, step, samp))
    print(f"| model | V | decode step, N={args.n} (ms) | " + " | ".join(SETTINGS) + " |")
    print("|---|---|---|" + "---|" * len(SETTINGS))
    for name, V, step, samp in rows:
        cells = " | ".join(f"{samp[k]:.1f} ({100 * samp[k] / step:.0f}%)" for k in SETTINGS)
        print(f"| {name} | {V} | {step:.0f} | {cells} |")


if __name__ == "__main__":
    main()
