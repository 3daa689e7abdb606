"""jaxsample's engines in decode.py's row schema: `jaxsample` (the shared-prefix
engine, `generate`), `jaxsample-int8` (the same engine on `load(...,
weights="int8")`: int8 projections, embedding and head, W8A8 by default,
models/quantization/quant.py; activations in the row's dtype) and `naive`
(`engine.naive.naive_generate`: N materialised prefix copies), with the
`--naive-prefill tile` variant (one prefill copied N times, decode-only
numbers). Imported only in decode.py's workers.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks import common


def platform():
    """The platform of jax's first device ("cpu", "gpu", "tpu")."""
    import jax

    return jax.devices()[0].platform


WEIGHTS = {"jaxsample-int8": "int8",  # engine -> `load(weights=)`; the others: None
           "jaxsample-int8-wo": "int8-weight-only"}


def load(model, dtype, engine="jaxsample"):
    """Returns (LanguageModel with a no-eos tokenizer, load seconds, extra row fields):
    `common.load_jax_model` with the engine's weights (extra: `weights`, and for int8
    `quant_mode` and `weight_bytes_stored`, the bytes of all parameters as held)."""
    weights = WEIGHTS.get(engine)
    lm, load_s = common.load_jax_model(model, dtype, weights)
    extra = {}
    if weights:
        from jaxsample.models.quantization import quant

        modes = {a.mode for a in _leaves(lm.params) if isinstance(a, quant.QuantizedWeight)}
        extra = dict(weights=weights, quant_mode=",".join(sorted(modes)),
                     weight_bytes_stored=_nbytes(lm.params))
    return lm, load_s, extra


def _leaves(tree):
    import jax

    from jaxsample.models.quantization import quant

    is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731
    return jax.tree_util.tree_leaves(tree, is_leaf=is_q)


def _nbytes(tree):
    import jax

    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(tree)))


def _naive_tiled(lm, ids, params):
    """The naive engine's decode on N prefix copies made by copying one prefill.

    `naive_generate` with its N identical prefills replaced by one: a
    `Session` prefills the prompt once, then one `Round` over N rows that all
    take that row (the gather copies the prefix N times, as the naive engine
    holds it), one branch each, branch index = copy index.
    """
    from jaxsample import engine as E

    N, T = params.n, params.max_new_tokens
    t_start = time.perf_counter()
    s = E.Session(lm, [ids], params.replace(n=1))
    rnd = s.round([0] * N, np.arange(N, dtype=np.int32)[:, None])
    while rnd.run(T):
        pass
    timings = dict(s.timings, prefill=None, total=time.perf_counter() - t_start)
    out = dict(timings=timings, steps=s.decode_steps, lengths=rnd.lengths.reshape(1, N),
               kv_prefix=_nbytes((rnd.prefix.k, rnd.prefix.v)), kv_tails=rnd.tail_bytes[0])
    del rnd, s
    return out


def run_cell(lm, engine, P, N, T, args, plat, generate_kw=None):
    """One measured jaxsample/naive request (after warm-up). Returns a result dict.
    `generate_kw`: more keyword arguments of `generate` (e.g. `attention=`); an
    option this engine does not have raises its TypeError."""

    from jaxsample import SamplingParams, cost
    from jaxsample.engine import generate
    from jaxsample.engine.naive import naive_generate

    ids = common.prompt_ids(args.seed, P, lm.vocab_limit)
    params = SamplingParams(n=N, temperature=1.0, max_new_tokens=T, seed=args.seed)
    tile = engine == "naive" and args.naive_prefill == "tile"

    def call():
        if tile:
            return _naive_tiled(lm, ids, params)
        g = (naive_generate(lm, [ids], params) if engine == "naive"
             else generate(lm, [ids], params, **(generate_kw or {})))
        return dict(timings=dict(g.timings), steps=g.bill.decode_steps, lengths=g.lengths,
                    kv_prefix=g.bill.kv_bytes_shared_prefix, kv_tails=g.bill.kv_bytes_tails)

    compile_s = 0.0
    if args.warmup == "full":
        r = call()
        compile_s = r["timings"]["compile"]
    elif args.warmup == "small":
        small = SamplingParams(n=1, temperature=1.0, max_new_tokens=2, seed=0)
        generate(lm, [common.prompt_ids(args.seed, 16, lm.vocab_limit)], small)

    mem0 = common.device_mem() if plat != "cpu" else {}
    with common.PeakRSS() as rss:
        r = call()
    mem1 = common.device_mem() if plat != "cpu" else {}
    tm = r["timings"]
    compile_s += tm["compile"]
    lengths = np.asarray(r["lengths"])
    steps = int(r["steps"])
    forwards = max(steps - 1, 1)
    decoded = int(lengths.sum())
    est = cost.estimate(lm.config, P, T, N)
    e2e = None if tile else tm["total"] - tm["compile"]
    held = _nbytes(lm.params)  # int8: the weights' bytes as stored, in place of dtype's
    w_delta = held - est.weight_bytes if engine in WEIGHTS else 0
    out = dict(
        compile_s=compile_s, prefill_s=tm["prefill"], decode_s=tm["decode"], decode_steps=steps,
        decode_forwards=forwards, decode_step_s=tm["decode"] / forwards,
        decoded_tokens=decoded, all_branches_full=bool((lengths == T).all()),
        decode_tokens_per_s=decoded / tm["decode"],
        e2e_s=e2e, e2e_with_compile_s=None if e2e is None else e2e + compile_s,
        kv_bytes_shared_prefix=r["kv_prefix"], kv_bytes_tails=r["kv_tails"],
        kv_bytes_held=r["kv_prefix"] + r["kv_tails"],
        step_bytes=(est.decode_bytes_separate if engine == "naive" else est.decode_bytes_shared)
        / T + w_delta,
        step_bytes_shared=est.decode_bytes_shared / T + w_delta,
        weight_bytes=est.weight_bytes + w_delta,
        naive_prefill="tile" if tile else ("run" if engine == "naive" else None),
    )
    if plat == "cpu":
        out.update(peak_rss_bytes=rss.peak, run_rss_delta_bytes=rss.peak - rss.start,
                   ru_maxrss_bytes=common.ru_maxrss_bytes())
        out["peak_bytes"] = rss.peak - rss.start
    else:
        out.update(device_peak_bytes=mem1.get("peak_bytes_in_use"),
                   device_bytes_in_use_before=mem0.get("bytes_in_use"),
                   device_bytes_limit=mem1.get("bytes_limit"))
        out["peak_bytes"] = mem1.get("peak_bytes_in_use")
    return out
