"""How far `token_logprobs` is from the sampler's own log-probabilities, per family, dtype, mesh.

For each model: `jaxsample.generate` samples N = 4 branches of 24 tokens from
two prompts (temperature 1, the raw logprobs the sampler reports); the
prompt + completion of every branch is scored by `token_logprobs` (one causal
forward, the public function) and by `completion_logprobs` (each prompt once
for its branches, `group_token_logprobs`), and the largest absolute
difference over the sampled tokens is reported, with the 99th percentile
and the prompt positions (the prefill's `prompt_logprobs` against
`token_logprobs`). The floor beside them: `token_logprobs` of the same
sequences against itself with the last 8 positions cut off, over their
prompt and completion tokens (the first S - 8 positions are the same numbers
mathematically; only the shapes, hence XLA's reduction orders, differ).
Models: the embedded SmolLM2-135M, the tiny random Llama and the tiny
checkpoints of every family in tests/data; float32 and bfloat16; one device
and a ("data", "branch") = (2, 2) mesh of CPU devices (float32).

    python -m benchmarks.token_logprobs_agreement     # results/token_logprobs_agreement.json
    JAXSAMPLE_CPU_KERNELS=0 python -m benchmarks.token_logprobs_agreement --out ...  # no kernels
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402

from benchmarks.common import environment, md_table  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"
FAMILIES = ["smollm2", "tiny", "tiny_llama", "tiny_llama3_untied", "tiny_qwen2", "tiny_qwen3",
            "tiny_phi3", "tiny_mixtral", "tiny_qwen3_moe", "tiny_gemma2", "tiny_gemma3",
            "tiny_gemma3_local"]


def load(name: str, dtype: str):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxsample import loading
    from jaxsample.tiny import make_tiny_lm

    if name == "smollm2":
        return loading.load(dtype=dtype)
    if name != "tiny":
        return loading._load_uncached(str(DATA / name), 0, dtype, None, None)
    lm = make_tiny_lm()
    if dtype == "float32":
        return lm
    return dataclasses.replace(lm, config=lm.config.replace(dtype=dtype),
                               params=jax.tree.map(lambda a: a.astype(jnp.bfloat16), lm.params))


def measure(lm, mesh=None) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxsample
    from jaxsample.training import rollout as ro

    prompts = [[t % lm.vocab_limit for t in p] for p in ([1, 5, 9, 33, 70, 12, 15, 8, 90],
                                                          [3, 4, 100, 7])]
    sp = jaxsample.SamplingParams(n=4, max_tokens=24, seed=1, prompt_logprobs=0)
    gen = jaxsample.generate(lm, prompts, sp, mesh=mesh)
    prompt, plen = ro.pad_prompts(gen.prompt_tokens)
    B, N, T = gen.tokens.shape
    mask = np.arange(T) < gen.lengths[..., None]
    comp = np.where(mask, gen.tokens, 0)
    seq = np.asarray(ro.pack(jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(comp),
                             jnp.asarray(gen.lengths))).reshape(B * N, -1)
    params = lm.params
    if mesh is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps

        seq = jax.device_put(seq, NamedSharding(mesh, Ps("data")))
        params = jax.device_put(params, NamedSharding(mesh, Ps()))
    full = np.asarray(jaxsample.token_logprobs(lm, params, seq)).reshape(B, N, -1)
    idx = np.broadcast_to(plen[:, None, None] + np.arange(T), (B, N, T))
    one = np.take_along_axis(full, idx, -1)
    batch = ro.Batch(prompt=jnp.asarray(prompt), prompt_len=jnp.asarray(plen),
                     completions=jnp.asarray(gen.tokens), lengths=jnp.asarray(gen.lengths),
                     advantages=jnp.zeros((B, N)), stop_ids=jnp.zeros((1,), jnp.int32))
    grouped = np.asarray(ro.completion_logprobs(lm, params, batch))
    d1 = np.abs(one - gen.logprobs)[mask]
    d2 = np.abs(grouped - gen.logprobs)[mask]
    dp = max(float(np.abs(np.asarray(jaxsample.token_logprobs(lm, lm.params, np.asarray(p)[None]))
                          [0, 1:] - q).max()) for p, q in zip(gen.prompt_tokens,
                                                             gen.prompt_token_logprobs))
    # The floor: the same tokens scored by two programs that differ only in S (causal, so the
    # first S - 8 positions are the same numbers mathematically).
    cut = seq.shape[1] - 8
    real = (np.arange(cut) < (plen[:, None] + gen.lengths).reshape(-1, 1))  # not the padding
    floor = float(np.abs(np.asarray(jaxsample.token_logprobs(lm, params, seq[:, :cut]))
                         - np.asarray(jaxsample.token_logprobs(lm, params, seq))[:, :cut])[real]
                  .max())
    return {"tokens": int(mask.sum()), "shape_floor": floor,
            "max_abs_logprob": float(np.abs(gen.logprobs[mask]).max()),
            "token_logprobs_max": float(d1.max()),
            "token_logprobs_p99": float(np.quantile(d1, .99)),
            "grouped_max": float(d2.max()), "grouped_p99": float(np.quantile(d2, .99)),
            "prompt_max": dp}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", default="benchmarks/results/token_logprobs_agreement.json")
    args = p.parse_args(argv)
    from jaxsample.models.cpu_kernels import cpu_kernels
    from jaxsample.sharding import make_mesh

    rows = []
    cells = [(f, d, None) for f in args.families.split(",") for d in args.dtypes.split(",")]
    cells += [(f, "float32", "2x2") for f in ("tiny", "tiny_gemma3")]
    for name, dtype, mesh in cells:
        t0 = time.perf_counter()
        r = measure(load(name, dtype), make_mesh(branch=2, data=2) if mesh else None)
        r.update(model=name, dtype=dtype, mesh=mesh or "-", seconds=time.perf_counter() - t0)
        rows.append(r)
        print(json.dumps(r), flush=True)
    report = {"env": environment(), "cpu_kernels": cpu_kernels.enabled(), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("\n".join(md_table(
        ["model", "dtype", "mesh", "tokens", "token_logprobs max", "p99", "grouped max",
         "prompt max", "shape floor"],
        [[r["model"], r["dtype"], r["mesh"], r["tokens"], f"{r['token_logprobs_max']:.2e}",
          f"{r['token_logprobs_p99']:.2e}", f"{r['grouped_max']:.2e}", f"{r['prompt_max']:.2e}",
          f"{r['shape_floor']:.2e}"]
         for r in rows])))
    for dtype in sorted({r["dtype"] for r in rows}):
        worst = max((r for r in rows if r["dtype"] == dtype), key=lambda r: r["token_logprobs_max"])
        print(f"largest {dtype}: {worst['token_logprobs_max']:.2e} ({worst['model']}, "
              f"mesh {worst['mesh']})")


if __name__ == "__main__":
    main()
