"""The token: a Gumbel-max draw over the kept set, or the greedy token at temperature 0.

When every kept set lies within the pre-selected candidates (`select.py`),
the Gumbel noise is computed at the candidates' indices only, the same values
as the full draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.sampling.processors import first_argmax, prepare
from jaxsample.engine.sampling.select import (
    batch_rows,
    check_candidates,
    keep_set,
    one_row,
)


def _gumbel_at(data: jax.Array, idx: jax.Array) -> jax.Array:
    """`jax.random.gumbel(key, (V,), float32)[idx]`, computed at `idx` only.

    With `jax_threefry_partitionable` (the default) element i of a 1-D draw is
    `threefry2x32(key, (0, i))`, its two words xor-ed, made a uniform in
    [tiny, 1) as `jax.random.uniform` does and transformed by -log(-log(u))
    (the "low" Gumbel mode); tests pin the equality. data: uint32[2] key data;
    idx: [K] int32 in [0, V), V < 2**32.
    """
    from jax.extend.random import threefry_2x32

    k = idx.shape[0]
    out = threefry_2x32((data[0], data[1]),
                        jnp.concatenate([jnp.zeros((k,), jnp.uint32), idx.astype(jnp.uint32)]))
    bits = out[:k] ^ out[k:]
    one = np.array(1.0, np.float32)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one.view(np.uint32),
                                          jnp.float32) - one
    tiny = np.float32(np.finfo(np.float32).tiny)
    u = jnp.maximum(tiny, floats * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def _candidate_noise_ok(key) -> bool:
    """Whether `_gumbel_at` reproduces `jax.random.gumbel` for this key (static)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    impl = str(jax.random.key_impl(key)) if typed else jax.config.jax_default_prng_impl
    return (impl == "threefry2x32" and jax.config.jax_threefry_partitionable
            and not jax.config.jax_high_dynamic_range_gumbel)


def _draw_rows(z, keep, data, *cands, impl, use_candidates: bool):
    """[M] Gumbel-max tokens. The noise is drawn at the candidates of the first
    stage whose candidates hold every row's keep set (the same noise values),
    over V otherwise. cands: idx_1, ok_1, idx_2, ok_2, ... (`_rank_filter_rows`)."""
    def full(_):
        def one(z, keep, d):
            g = jax.random.gumbel(jax.random.wrap_key_data(d, impl=impl), z.shape, jnp.float32)
            return first_argmax(jnp.where(keep, z + g, -jnp.inf))
        return jax.vmap(one)(z, keep, data)

    def at(idx):
        def draw(_):
            def one(z, keep, idx, d):
                s = jnp.where(keep[idx], z[idx] + _gumbel_at(d, idx), -jnp.inf)
                # the lowest token index among the maxima, as first_argmax over V
                return jnp.min(jnp.where(s == jnp.max(s), idx, z.shape[0])).astype(jnp.int32)
            return jax.vmap(one)(z, keep, idx, data)
        return draw

    if not use_candidates:
        return full(None)
    pairs = list(zip(cands[0::2], cands[1::2]))

    def first_fitting(s):
        if s == len(pairs):
            return full
        idx, ok = pairs[s]
        return lambda _: jax.lax.cond(jnp.all(ok), at(idx), first_fitting(s + 1), None)

    return first_fitting(0)(None)


def choose_token(logits: jax.Array, key: jax.Array, temperature: jax.Array,
                 top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 vocab_limit: int, processed: jax.Array | None = None,
                 candidates: int | tuple[int, ...] | None = None, *,
                 any_sampling: jax.Array | None = None,
                 any_filter: jax.Array | None = None,
                 with_processed: bool = False) -> tuple[jax.Array, ...]:
    """Sample one token from one distribution (see the table of `jaxsample.engine.sampling`).

    Works under `jit`, `vmap` and inside `lax.while_loop`; the filter
    parameters are traced, so new values never recompile. Keep them
    unbatched under `vmap` (in_axes=None) so that inactive filters are
    skipped by a real `lax.cond`.

    The Gumbel noise is drawn per token index from `key` whatever the
    filters, so filters that keep every token (e.g. top_k = V) sample the
    same token as no filter, and tightening a filter only changes the draw
    when it removes the token that was drawn. (When the kept set lies within
    the K0 candidates the noise is computed at those indices only: the same
    values, see `_gumbel_at`.)

    Args:
      logits: [V] float32 raw logits (other float dtypes are cast).
      key: a PRNG key (typed `jax.random.key` or legacy uint32[2]).
      temperature: float32 scalar >= 0; 0 is greedy (argmax, first on ties).
      top_k: int32 scalar >= 0; 0 or >= V is off.
      top_p: float32 scalar in (0, 1]; 1 is off.
      min_p: float32 scalar in [0, 1]; 0 is off.
      vocab_limit: static int in [1, V]; rows >= vocab_limit are never sampled.
      processed: optional `[V]` float32, the output of `process_logits` (logit
        bias, min-tokens, penalties) for these logits: the token is then
        chosen from `processed` (greedy: its argmax; else tempered and
        filtered) while the logprob stays that of the raw `logits`. None
        (the default) chooses from `logits` itself, with exactly the
        arithmetic of a run without processors.
      candidates: static, the top-k pre-selection stages of top-k and top-p:
        an int K0 > 0 or a tuple of them (`select.py`, "Cost"; default
        (256, 1024)); 0 or () runs the bisection and the full Gumbel draw
        alone (the reference path).
      any_sampling, any_filter: optional bool scalars for parameters that
        differ per row of a `vmap` (the engine's per-request settings): whether
        any row samples (temperature > 0) and whether any sampling row has
        top-k or top-p on. Pass them unbatched; the draw and the filters then
        sit behind real conds on these batch-wide predicates instead of
        selects that run both sides. Each row's token is the same as without
        them (None: each row's own predicate).
      with_processed: static; also return the token's processed logprob.

    NaN logits count as -inf and +inf logits as the largest finite float32
    (the table of `jaxsample.engine.sampling`'s "NaN, inf" row).

    Returns:
      token: int32 scalar in [0, vocab_limit).
      logprob: float32 scalar, log_softmax of the raw logits (temperature 1,
        no filters, padding and NaN excluded) at `token`. NaN exactly when the
        row has no distribution (every valid logit NaN or -inf, in `logits`
        or in `processed`); the token is then 0 and must not be used:
        `check_logprobs` turns it into an error.
      processed_logprob (with `with_processed`): float32 scalar, the token's
        log-probability under the distribution it was drawn from (vLLM's
        `logprobs_mode="processed_logprobs"`): the processed logits tempered,
        renormalised over the kept set (top-k, top-p, min-p); 0 at
        temperature 0 (the greedy choice is certain); NaN as `logprob`.

    Raises:
      ValueError: logits is not 1-D, vocab_limit or candidates is out of range.
    """
    if processed is not None:
        raw, _, raw_top = prepare(logits, 1.0, vocab_limit)
        _, z, greedy_tok = prepare(processed, temperature, vocab_limit)
        m = raw[raw_top]
        has_dist = (m > -jnp.inf) & (z[greedy_tok] > -jnp.inf)
    else:
        raw, z, greedy_tok = prepare(logits, temperature, vocab_limit)
        m = raw[greedy_tok]
        has_dist = m > -jnp.inf
    candidates = check_candidates(candidates, z.shape[0])
    keep, cand = keep_set(z, greedy_tok, temperature, top_k, top_p, min_p, vocab_limit, candidates,
                          any_filter)
    token = _draw(z, keep, greedy_tok, key, temperature, cand, any_sampling)
    # log_softmax(raw)[token]; m is the max of raw. Subtract the max before
    # adding the log-sum, so a max near the float32 limit loses no precision.
    shifted = jnp.where(m > -jnp.inf, raw - m, -jnp.inf)
    logprob = shifted[token] - jnp.log(jnp.sum(jnp.exp(shifted)))
    logprob = jnp.where(has_dist, logprob, jnp.nan).astype(jnp.float32)  # NaN: no distribution
    if not with_processed:
        return token, logprob
    kept = jnp.where(keep, z, -jnp.inf)  # max z is 0 and the top token is kept: no overflow
    lq = z[token] - jnp.log(jnp.sum(jnp.exp(kept)))
    lq = jnp.where(jnp.asarray(temperature) > 0, lq, 0.0)
    return token, logprob, jnp.where(has_dist, lq, jnp.nan).astype(jnp.float32)


def _draw(z, keep, greedy_tok, key, temperature, cand=None, any_sampling=None):
    """The chosen token: Gumbel-max over the kept tokens, or `greedy_tok` at
    temperature 0, where no noise is drawn at all (a `lax.cond` on the scalar
    temperature, or on `any_sampling` for per-row temperatures: V Gumbel draws
    per slot are a large part of a step at V = 262k). With candidates, the
    noise is drawn at the K0 candidates only when every sampling row's kept
    set lies within them (a cond reduced over the vmapped rows)."""
    sampling = jnp.asarray(temperature) > 0
    if cand is not None and any_sampling is not None:
        # A greedy row's noise is never used: it does not force the full draw.
        cand = tuple((idx, ok | ~sampling) for idx, ok in cand)

    def sample(_):
        if cand is None:
            g = jax.random.gumbel(key, z.shape, jnp.float32)
            return first_argmax(jnp.where(keep, z + g, -jnp.inf))
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        impl = str(jax.random.key_impl(key)) if typed else jax.config.jax_default_prng_impl
        data = jax.random.key_data(key) if typed else jnp.asarray(key, jnp.uint32)
        use = _candidate_noise_ok(key)
        rows = batch_rows(lambda *a: _draw_rows(*a, impl=impl, use_candidates=use))
        return one_row(rows, z, keep, data, *(x for pair in cand for x in pair))

    if any_sampling is None:
        return jax.lax.cond(sampling, sample, lambda _: greedy_tok, None)
    return jax.lax.cond(jnp.asarray(any_sampling, bool),
                        lambda _: jnp.where(sampling, sample(None), greedy_tok),
                        lambda _: greedy_tok, None)
