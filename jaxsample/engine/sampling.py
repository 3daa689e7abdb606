"""Sampling parameters, logits processors and token choice.

`SamplingParams` is the per-request, host-side description of how to sample
(vLLM's `SamplingParams` field names). `process_logits` (logit bias,
min-tokens, repetition / frequency / presence penalties), `choose_token` and
`keep_mask` are the device-side processing and token choice for *one*
distribution `logits [V]`; the decode engine vmaps them over the branch axis
N (and the prompt axis B) inside its jitted `lax.while_loop`. `is_stop`
tests a token against the stop ids; `check_logprobs` is the host-side check
that no token came from a row without a distribution (all logits NaN or
-inf).

Letter table: see `models/llama.py` (V = vocabulary rows, N = branches).

Order of the steps: the processors that may change the argmax first, in
vLLM's v1 sampler order (vllm/v1/sample/sampler.py: logit bias and
min-tokens, then `apply_penalties`: repetition, frequency, presence), all in
`process_logits`; then Hugging Face's warper order (`TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, each applied to
the already tempered and filtered scores) in `choose_token`. (vLLM applies
min-p before top-k / top-p; we keep Hugging Face's order for the filters.)

    step         | rule
    -------------+---------------------------------------------------------------
    padding      | rows >= vocab_limit (vocabulary padding of the embedding) are
                 | never sampled and excluded from every step, including the
                 | reported logprob. Tokens whose logit is -inf are never kept
                 | (except as the single token of a row without a distribution).
    NaN, inf     | a NaN logit counts as -inf: never sampled, excluded from the
                 | logprob's normaliser, like padding. A +inf logit counts as
                 | the largest finite float32, so the +inf tokens share all the
                 | mass (the softmax limit). A row whose every valid logit is
                 | NaN or -inf has no distribution: the token is 0 and the
                 | logprob is NaN, the only NaN `choose_token` ever returns.
                 | `generate` checks for it on the host and raises
                 | `NumericalError` (see `check_logprobs`): it never returns
                 | such a token.
    logit bias   | x = logits + bias (`SamplingParams.logit_bias`, clamped to
                 | [-100, 100]; 0 elsewhere).
    min-tokens   | while the branch has generated < min_tokens tokens, every
                 | stop id (the model's end ids and stop_token_ids, even with
                 | ignore_eos) has x = -inf.
    repetition   | for tokens of the prompt or of the branch's generated tokens:
                 | x / p where x > 0, x * p elsewhere (p = repetition_penalty;
                 | 1 is off).
    frequency    | x -= frequency_penalty * count (count: how often the branch
                 | generated the token; the prompt does not count).
    presence     | x -= presence_penalty * (count > 0).
                 | The steps above are `process_logits`; without any of them
                 | (the engine's static flag off) x is the raw logits, with
                 | the same arithmetic as before they existed.
    temperature  | z = (x - max(x)) / temperature. temperature == 0
                 | means greedy: the argmax of x (first index on
                 | ties), whatever the filters say; there is no division by
                 | zero and no NaN.
    top-k        | keep the k highest tempered logits; k == 0 or k >= V is off.
                 | Ties at the k-th value: exactly k tokens are kept, by rank;
                 | among equal logits the lower token index ranks first
                 | (`lax.top_k`'s convention).
    top-p        | on softmax(z) renormalised over the top-k survivors, keep the
                 | smallest rank prefix whose mass reaches p (cumulative >= p);
                 | the top token is always kept; p >= 1 is off. A token is kept
                 | iff the mass ranked strictly above it is < p - 1e-6: the
                 | tolerance absorbs float32 rounding of the cumulative sum, so
                 | that e.g. probs [0.3, 0.1, 0.1, 0.5], p = 0.8 keeps {0, 3}
                 | (0.5 + 0.3 may round to 0.79999995). Mass within 1e-6 below
                 | p counts as reaching p. Ties rank as in top-k.
    min-p        | keep tokens with prob >= min_p * max prob on the distribution
                 | after top-k/top-p (the ratio is renormalisation-free:
                 | z_i - z_max >= log(min_p)); inclusive, with a relative
                 | tolerance of 1e-6 on the ratio for the same float32 reason;
                 | min_p == 0 is off.
    sample       | Gumbel-max over the kept tokens' tempered logits with `key`:
                 | each kept token is drawn with probability proportional to
                 | exp(z). The top-ranked token is always in the kept set, so
                 | it is never empty.
    logprob      | log_softmax of the *raw* logits (no bias, no penalties,
                 | temperature 1, no filters, padding rows excluded) at the
                 | chosen token, as vLLM reports by default
                 | (`logprobs_mode="raw_logprobs"`).

Cost: no sort of V. Top-k, top-p and min-p each keep a rank prefix (z
descending, the lower index first on ties), so top-k and top-p are first
decided on a pre-selection: `lax.top_k` of K0 = 256 candidates, where the
k-th token is read off and the nucleus is one cumsum over the K0 sorted
masses (the mass of the top-k survivors: the first k candidates, or one sum
over V). A row whose set does not fit in 256 candidates (k > 256, or a
nucleus wider than 256) goes to a second stage of 1024, then to the exact
bisection over the int32 order keys of the tempered logits (32 passes of
O(V) counting or summing, then ties at the cut-off broken by index with one
cumsum). The sets are the same on every path up to the float32 rounding of
the top-p sums (a boundary token whose mass above lies within rounding of
p - 1e-6; tests/test_sampling.py compares the paths off those tokens). When
every kept set lies within the candidates, the Gumbel noise is computed at
the candidates' indices only (the same values `jax.random.gumbel(key, (V,))`
has there: element i of a threefry-partitionable draw depends on i alone),
so the token is the same as with the full draw. Each later stage, the
bisection and the full draw sit behind a `lax.cond` on a predicate reduced
over all rows of the `vmap` (a `jax.custom_batching.custom_vmap` rule
gathers the vmapped rows into one batch): under the engine's
`vmap(vmap(choose_token))` a step whose rows all fit never runs the later
stages, and a row's result never depends on the other rows (it comes from
the first stage it fits). Measured at N = 16 on 2 shared cores
(benchmarks/notes_topp.md): at V = 262,144 top-k 50 + top-p 0.95 + min-p
0.05 went from ~334 to ~54 ms, top-p 0.95 (nuclei up to ~960 tokens) from
~212 to ~74 ms; a step with a row that needs the bisection costs ~1.6x the
bisection alone (both stages and the full draw run too). `candidates=0` selects the bisection and the full draw alone
(the reference path). Min-p is a single O(V) comparison. Top-k and top-p
sit behind a `lax.cond` on the scalar parameters (also skipped when
temperature == 0), so inactive filters cost nothing. Under `vmap` a
`cond` whose predicate is batched becomes a `select` that runs both sides,
so the engine should keep temperature, top_k, top_p and min_p *unbatched*
(`vmap(..., in_axes=(0, 0, None, None, None, None))`): they come from one
`SamplingParams` and are shared by all branches. Per-branch values still give
correct results, only without the skipping.

The filter parameters are traced scalars: changing them never recompiles.
Only `vocab_limit` (and the shape of `logits`) is static.

References: Hugging Face transformers `generation/logits_process.py`
(`RepetitionPenaltyLogitsProcessor`, `TopKLogitsWarper`, `TopPLogitsWarper`,
`MinPLogitsWarper`); vLLM `vllm/sampling_params.py` (fields, ranges, the
logit-bias clamp), `vllm/v1/sample/sampler.py` (processor order, raw logprobs
by default), `vllm/v1/sample/logits_processor/builtin.py` (logit bias,
min-tokens), `vllm/model_executor/layers/utils.py` (`apply_penalties`);
Keskar et al. 2019, "CTRL" (arXiv 1909.05858, the repetition penalty); Nguyen et al.
2024, "Min-p sampling" (arXiv 2407.01082); Holtzman et al. 2020, "The
curious case of neural text degeneration" (nucleus sampling).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.errors import NumericalError
# SamplingParams (host side) lives in jaxsample/sampling_params.py; its names
# are re-exported here, where the request's fields meet the token choice.
from jaxsample.sampling_params import (  # noqa: F401
    DEFAULT_MAX_NEW_TOKENS, MAX_BIAS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams, _is_int)

# Tolerance on the top-p cumulative mass (absolute) and on the min-p
# probability ratio (relative); see the module docstring.
TOP_P_TOL = 1e-6
MIN_P_TOL = 1e-6



# --------------------------------------------------------------------------
# Token choice (device side, pure JAX)
# --------------------------------------------------------------------------


def _first_argmax(x: jax.Array) -> jax.Array:
    """int32 index of the first maximum of x [V].

    Two plain reductions (max, then min index) instead of `jnp.argmax`'s
    variadic reduce: XLA CPU vectorises them, ~2x faster when fused with the
    Gumbel noise. An all-NaN row gives 0.
    """
    v = x.shape[0]
    idx = jnp.min(jnp.where(x == jnp.max(x), jnp.arange(v, dtype=jnp.int32), v))
    return (idx % v).astype(jnp.int32)


def _prepare(logits: jax.Array, temperature: jax.Array, vocab_limit: int):
    """Raw masked logits, tempered logits and the greedy token.

    Returns:
      raw: [V] float32, padding rows and NaN at -inf, +inf at the largest
        finite float32.
      z: [V] float32, (raw - max raw) / temperature (temperature 0 -> 1),
        so the max is 0 and nothing overflows; -inf where raw is -inf (all
        of z is -inf for a row without a distribution, never NaN).
      greedy_tok: int32 scalar, argmax of raw (first index on ties); 0 for a
        row without a distribution.
    """
    logits = jnp.asarray(logits, jnp.float32)
    if logits.ndim != 1:
        raise ValueError(f"logits must be [V], got shape {logits.shape}; vmap over "
                         "branches instead")
    v = logits.shape[0]
    if not 1 <= vocab_limit <= v:
        raise ValueError(f"vocab_limit must be in [1, V={v}], got {vocab_limit}")
    valid = (jnp.arange(v) < vocab_limit) & ~jnp.isnan(logits)
    raw = jnp.where(valid, jnp.minimum(logits, jnp.finfo(jnp.float32).max), -jnp.inf)
    greedy_tok = _first_argmax(raw)
    m = raw[greedy_tok]
    temperature = jnp.asarray(temperature, jnp.float32)
    t = jnp.where(temperature > 0, temperature, 1.0)
    z = jnp.where(raw > -jnp.inf, (raw - m) / t, -jnp.inf)
    return raw, z, greedy_tok


_KEY_NEG_INF = -0x7F800000  # _order_keys(-inf)
_BISECT_STEPS = 32  # the key range spans < 2**31 values


def _order_keys(z: jax.Array) -> jax.Array:
    """int32 keys in the order of z <= 0: z_i < z_j iff key_i < key_j.

    For x >= 0 the bits of a float32 read as an int32 grow with x, so
    -bits(|z|) grows with z; the sign bit is cleared, so -0.0 and 0.0 share
    the key 0.
    """
    return -(jax.lax.bitcast_convert_type(z, jnp.int32) & 0x7FFFFFFF)


def _largest_key(holds, lo: int, hi: int) -> jax.Array:
    """The largest int32 tau in [lo, hi] with holds(tau), for monotone `holds`.

    `holds` must be non-increasing in tau and true at `lo`. Exact bisection
    over the integers (a radix-free "select"), _BISECT_STEPS passes.
    """
    def body(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo + 1) // 2
        ok = holds(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, _BISECT_STEPS, body,
                              (jnp.int32(lo), jnp.int32(hi)))
    return lo


def _first_of_ties(ties: jax.Array, count: jax.Array) -> jax.Array:
    """[V] bool, the first `count` True entries of `ties` by index."""
    rank = jnp.cumsum(ties.astype(jnp.int32)) - 1
    return ties & (rank < count)


def _top_k_mask(z: jax.Array, kz: jax.Array, top_k: jax.Array) -> jax.Array:
    """Exactly k tokens by rank (z descending, lower index first on ties)."""
    tau = _largest_key(lambda t: jnp.sum(kz >= t) >= top_k, _KEY_NEG_INF, 0)
    above = kz > tau
    need = top_k - jnp.sum(above)
    return above | _first_of_ties(kz == tau, need)


def _top_p_mask(z: jax.Array, kz: jax.Array, keep_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
    """Smallest rank prefix of the top-k survivors with mass >= top_p - tol."""
    e = jnp.where(keep_k, jnp.exp(z), 0.0)  # max z is 0: no overflow
    total = jnp.sum(e)
    q = (top_p - TOP_P_TOL) * total  # the mass to reach, unnormalised
    # Mass of {key >= tau} is non-increasing in tau (also in float32: the
    # reduction order is fixed and rounding is monotone).
    tau = _largest_key(lambda t: jnp.sum(jnp.where(kz >= t, e, 0.0)) >= q,
                       _KEY_NEG_INF, 0)
    above = keep_k & (kz > tau)
    base = jnp.sum(jnp.where(above, e, 0.0))
    ties = keep_k & (kz == tau)
    e_tie = jnp.max(jnp.where(ties, e, 0.0))  # equal z, equal mass
    rank = jnp.cumsum(ties.astype(jnp.int32)) - 1
    # a tie is kept iff the mass ranked above it is < q
    return above | (ties & (base + rank.astype(jnp.float32) * e_tie < q))


# Top-k pre-selection (the default path). The rank filters keep a rank prefix
# (z descending, lower index first on ties), so when that prefix has at most
# K0 tokens it is found on the K0 best candidates of `lax.top_k` (one cumsum
# over K0 instead of 32 passes over V), and the Gumbel noise is needed only at
# those K0 indices. Rows whose prefix does not fit fall back to the bisection.
# K0 of each stage; 16 x 262144 top_k costs ~12 ms at 256, ~22 ms at 1024 (notes_topp.md).
TOP_CANDIDATES = (256, 1024)


def _rows(rows_fn):
    """Make `rows_fn(*args)`, defined on a leading axis of M rows, batch by flattening.

    Under `vmap` (any nesting, batched or unbatched arguments) the rule moves
    every vmapped axis into M and calls the function again, so `rows_fn` always
    sees all rows at once: a `lax.cond` on a predicate reduced over the rows
    (`jnp.any`) stays a real cond instead of becoming a select that runs both
    sides. Outputs are pytrees of arrays with the leading M axis.
    """

    @jax.custom_batching.custom_vmap
    def f(*args):
        return rows_fn(*args)

    @f.def_vmap
    def _rule(axis_size, in_batched, *args):
        def flat(a, b):
            a = a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            return a.reshape((axis_size * a.shape[1],) + a.shape[2:])

        outs = f(*(flat(a, b) for a, b in zip(args, in_batched)))
        outs = jax.tree.map(lambda o: o.reshape((axis_size, -1) + o.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return f


def _one_row(f, *args):
    """Call a `_rows` function on a single row (a leading axis of 1 added and removed)."""
    return jax.tree.map(lambda o: o[0], f(*(jnp.asarray(a)[None] for a in args)))


def _bisection_rows(z, top_k, top_p, k_on, p_on):
    """[M, V] keep set of top-k then top-p by the exact bisection, row by row."""
    def one(z, k, p, k_on, p_on):
        kz = _order_keys(z)
        keep = jnp.where(k_on, _top_k_mask(z, kz, k), True)
        return jnp.where(p_on, _top_p_mask(z, kz, keep, p), keep)

    return jax.vmap(one)(z, top_k, top_p, k_on, p_on)


def _stage(z, top_k, top_p, k_on, p_on, k0: int):
    """One pre-selection stage: top-k then top-p on the K0 best candidates.

    Args: z [M, V] tempered logits (max 0, -inf where invalid); top_k [M]
    int32; top_p [M] float32; k_on, p_on [M] bool (a filter is active).
    Returns: keep [M, V] bool (the module table's top-k / top-p set where the
    row fits), idx [M, K0] int32 (the candidates, by rank), fits [M] bool:
    the row's set is decided within its K0 candidates.
    """
    m, v = z.shape
    vals, idx = jax.lax.top_k(z, k0)  # ranks 0..K0-1: z descending, lower index on ties
    pos = jnp.arange(k0, dtype=jnp.int32)
    kk = jnp.where(k_on, top_k, v)
    k_fits = kk <= k0
    e_c = jnp.where(pos < kk[:, None], jnp.exp(vals), 0.0)  # max z is 0: no overflow
    # Mass of the top-k survivors: the first k candidates, or all of V without top-k.
    total = jnp.where(k_fits, jnp.sum(e_c, axis=1), jnp.sum(jnp.exp(z), axis=1))
    q = (top_p - TOP_P_TOL) * total
    incl = jnp.cumsum(e_c, axis=1)
    # Rank j is kept iff the mass ranked above it is < q: n_p = 1 + #{incl < q}.
    n_p = jnp.minimum(1 + jnp.sum(incl < q[:, None], axis=1), k0).astype(jnp.int32)
    p_fits = incl[:, -1] >= q
    fits = jnp.where(k_on, k_fits, ~p_on | p_fits)
    n = jnp.minimum(jnp.where(k_on, jnp.minimum(kk, k0), k0), jnp.where(p_on, n_p, k0))
    last_v = jnp.take_along_axis(vals, (n - 1)[:, None], axis=1)
    last_i = jnp.take_along_axis(idx, (n - 1)[:, None], axis=1)
    # The first n tokens by rank: strictly above the n-th, or tied with it at a lower index.
    keep = (z > last_v) | ((z == last_v) & (jnp.arange(v, dtype=jnp.int32) <= last_i))
    keep = keep | ~(k_on | p_on)[:, None]  # both off (only with per-row knobs): keep all
    return keep, idx.astype(jnp.int32), fits


def _rank_filter_rows(z, top_k, top_p, k_on, p_on, *, k0s: tuple[int, ...]):
    """Top-k then top-p by the pre-selection stages `k0s` (increasing), then
    the exact bisection for the rows that fit in none.

    Each stage after the first and the bisection run only when some row did
    not fit the stage before (a `lax.cond` on the predicate reduced over all
    rows); a row's set comes from the first stage it fits, whatever the other
    rows, so batching never changes it.

    Returns: keep [M, V] bool and, per stage, (idx [M, K0] int32, ok [M]
    bool): ok where the row's keep set lies within that stage's candidates.
    """
    m = z.shape[0]
    on = k_on | p_on
    keep, idx, fits = _stage(z, top_k, top_p, k_on, p_on, k0s[0])
    ok = fits & on

    def done(_):
        rest = tuple((jnp.zeros((m, k), jnp.int32), jnp.zeros((m,), bool)) for k in k0s[1:])
        return keep, ((idx, ok),) + rest

    def more(_):
        if len(k0s) > 1:
            keep2, cands = _rank_filter_rows(z, top_k, top_p, k_on, p_on, k0s=k0s[1:])
        else:
            keep2, cands = _bisection_rows(z, top_k, top_p, k_on, p_on), ()
        # a set within K0 candidates is within every larger stage's candidates
        cands = tuple((i, o | ok) for i, o in cands)
        return jnp.where(fits[:, None], keep, keep2), ((idx, ok),) + cands

    return jax.lax.cond(jnp.all(fits), done, more, None)


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
            return _first_argmax(jnp.where(keep, z + g, -jnp.inf))
        return jax.vmap(one)(z, keep, data)

    def at(idx):
        def draw(_):
            def one(z, keep, idx, d):
                s = jnp.where(keep[idx], z[idx] + _gumbel_at(d, idx), -jnp.inf)
                # the lowest token index among the maxima, as _first_argmax over V
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


def _keep(z: jax.Array, greedy_tok: jax.Array, temperature, top_k, top_p,
          min_p, vocab_limit: int, candidates: int):
    """[V] bool keep set of the sampling (temperature > 0) path, and the
    candidates `(idx [K0] int32, ok bool)` (None on the bisection path).

    Top-k and top-p together run behind one `lax.cond` on the scalar
    parameters, so inactive filters cost nothing.
    """
    v = z.shape[0]
    sampling = jnp.asarray(temperature, jnp.float32) > 0
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    min_p = jnp.asarray(min_p, jnp.float32)
    k_on = sampling & (top_k > 0) & (top_k < vocab_limit)
    p_on = sampling & (top_p < 1.0)
    k0s = tuple(sorted({min(k, v) for k in candidates}))
    if not k0s:
        # The bisection path (candidates=0): top-k and top-p each behind a cond.
        # The order keys are computed inside each filter's branch.
        keep = jax.lax.cond(k_on, lambda z, k: _top_k_mask(z, _order_keys(z), k),
                            lambda z, k: jnp.ones((v,), bool), z, top_k)
        keep = jax.lax.cond(p_on, lambda z, kk, p: _top_p_mask(z, _order_keys(z), kk, p),
                            lambda z, kk, p: kk, z, keep, top_p)
        cand = None
    else:
        rows = _rows(lambda *a: _rank_filter_rows(*a, k0s=k0s))

        def on(z, k, p, k_on, p_on):
            return _one_row(rows, z, k, p, k_on, p_on)

        def off(z, k, p, k_on, p_on):
            return jnp.ones((v,), bool), tuple(
                (jnp.zeros((k,), jnp.int32), jnp.bool_(False)) for k in k0s)

        keep, cand = jax.lax.cond(k_on | p_on, on, off, z, top_k, top_p, k_on, p_on)
    # min-p: prob_i / prob_max = exp(z_i - max z) = exp(z_i), the max token is
    # never filtered; log(0) = -inf keeps everything.
    keep &= z >= jnp.log(min_p) + jnp.log1p(-MIN_P_TOL)
    keep &= z > -jnp.inf
    return keep | (jnp.arange(v) == greedy_tok), cand


def _check_candidates(candidates) -> tuple[int, ...]:
    """The pre-selection stages as a tuple of ints > 0; () for the bisection."""
    ks = (candidates,) if _is_int(candidates) else candidates
    if not isinstance(ks, (tuple, list)) or not all(_is_int(k) and k >= 0 for k in ks):
        raise ValueError("candidates must be a static int >= 0 or a tuple of them (0 or (): "
                         f"the bisection path), got {candidates!r}")
    return tuple(int(k) for k in ks if k > 0)


def keep_mask(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
              top_p: jax.Array, min_p: jax.Array, vocab_limit: int,
              candidates: int | tuple[int, ...] = TOP_CANDIDATES) -> jax.Array:
    """The set of tokens `choose_token` may sample (see the module table).

    Args:
      logits: [V] float32 raw logits of one distribution.
      temperature: float32 scalar >= 0 (traced); 0 is greedy.
      top_k: int32 scalar >= 0 (traced); 0 or >= V is off.
      top_p: float32 scalar in (0, 1] (traced); 1 is off.
      min_p: float32 scalar in [0, 1] (traced); 0 is off.
      vocab_limit: static int in [1, V]; rows >= vocab_limit are padding.
      candidates: static, the top-k pre-selection stages: an int K0 > 0 or
        a tuple of them (module docstring, "Cost"; default (256, 1024)); 0
        or () runs the bisection alone. The set is the same for every choice
        (up to float32 rounding of the top-p mass).

    Returns:
      [V] bool; never empty; for temperature 0 exactly the greedy token.

    Raises:
      ValueError: logits is not 1-D, vocab_limit or candidates is out of range.
    """
    candidates = _check_candidates(candidates)
    _, z, greedy_tok = _prepare(logits, temperature, vocab_limit)
    keep, _ = _keep(z, greedy_tok, temperature, top_k, top_p, min_p, vocab_limit, candidates)
    greedy = jnp.arange(z.shape[0]) == greedy_tok
    return jnp.where(jnp.asarray(temperature) == 0, greedy, keep)


def choose_token(logits: jax.Array, key: jax.Array, temperature: jax.Array,
                 top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                 vocab_limit: int, processed: jax.Array | None = None,
                 candidates: int | tuple[int, ...] = TOP_CANDIDATES) -> tuple[jax.Array, jax.Array]:
    """Sample one token from one distribution (see the module table).

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
        an int K0 > 0 or a tuple of them (module docstring, "Cost"; default
        (256, 1024)); 0 or () runs the bisection and the full Gumbel draw
        alone (the reference path).

    NaN logits count as -inf and +inf logits as the largest finite float32
    (the module table's "NaN, inf" row).

    Returns:
      token: int32 scalar in [0, vocab_limit).
      logprob: float32 scalar, log_softmax of the raw logits (temperature 1,
        no filters, padding and NaN excluded) at `token`. NaN exactly when the
        row has no distribution (every valid logit NaN or -inf, in `logits`
        or in `processed`); the token is then 0 and must not be used:
        `check_logprobs` turns it into an error.

    Raises:
      ValueError: logits is not 1-D, vocab_limit or candidates is out of range.
    """
    candidates = _check_candidates(candidates)
    if processed is not None:
        return _choose_processed(logits, processed, key, temperature, top_k, top_p, min_p,
                                 vocab_limit, candidates)
    raw, z, greedy_tok = _prepare(logits, temperature, vocab_limit)
    keep, cand = _keep(z, greedy_tok, temperature, top_k, top_p, min_p, vocab_limit, candidates)
    token = _draw(z, keep, greedy_tok, key, temperature, cand)
    # log_softmax(raw)[token]; raw[greedy_tok] is the max. Subtract the max before
    # adding the log-sum, so a max near the float32 limit loses no precision.
    m = raw[greedy_tok]
    has_dist = m > -jnp.inf
    shifted = jnp.where(has_dist, raw - m, -jnp.inf)
    logprob = shifted[token] - jnp.log(jnp.sum(jnp.exp(shifted)))
    logprob = jnp.where(has_dist, logprob, jnp.nan)  # the marker of "no distribution"
    return token, logprob.astype(jnp.float32)


def _draw(z, keep, greedy_tok, key, temperature, cand=None):
    """The chosen token: Gumbel-max over the kept tokens, or `greedy_tok` at
    temperature 0, where no noise is drawn at all (a `lax.cond` on the scalar
    temperature: V Gumbel draws per slot are a large part of a step at V = 262k).
    With candidates, the noise is drawn at the K0 candidates only when every
    row's kept set lies within them (a cond reduced over the vmapped rows)."""

    def sample(_):
        if cand is None:
            g = jax.random.gumbel(key, z.shape, jnp.float32)
            return _first_argmax(jnp.where(keep, z + g, -jnp.inf))
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        impl = str(jax.random.key_impl(key)) if typed else jax.config.jax_default_prng_impl
        data = jax.random.key_data(key) if typed else jnp.asarray(key, jnp.uint32)
        use = _candidate_noise_ok(key)
        rows = _rows(lambda *a: _draw_rows(*a, impl=impl, use_candidates=use))
        return _one_row(rows, z, keep, data, *(x for pair in cand for x in pair))

    return jax.lax.cond(jnp.asarray(temperature) > 0, sample, lambda _: greedy_tok, None)


def _choose_processed(logits, processed, key, temperature, top_k, top_p, min_p, vocab_limit,
                      candidates):
    """`choose_token` with the token chosen from `processed`, the logprob from `logits`."""
    raw, _, raw_top = _prepare(logits, 1.0, vocab_limit)
    _, z, greedy_tok = _prepare(processed, temperature, vocab_limit)
    keep, cand = _keep(z, greedy_tok, temperature, top_k, top_p, min_p, vocab_limit, candidates)
    token = _draw(z, keep, greedy_tok, key, temperature, cand)
    m = raw[raw_top]
    has_dist = (m > -jnp.inf) & (z[greedy_tok] > -jnp.inf)
    shifted = jnp.where(m > -jnp.inf, raw - m, -jnp.inf)
    logprob = shifted[token] - jnp.log(jnp.sum(jnp.exp(shifted)))
    logprob = jnp.where(has_dist, logprob, jnp.nan)
    return token, logprob.astype(jnp.float32)


def process_logits(logits: jax.Array, *, t: jax.Array, bias: jax.Array, stop_mask: jax.Array,
                   min_tokens: jax.Array, counts: jax.Array | None = None,
                   prompt_mask: jax.Array | None = None,
                   repetition_penalty: jax.Array = 1.0, frequency_penalty: jax.Array = 0.0,
                   presence_penalty: jax.Array = 0.0) -> jax.Array:
    """The logits processors before temperature, in vLLM's order, for one distribution.

    The one place where they are applied (the module table's rows "logit
    bias" to "presence penalty"); `choose_token(..., processed=...)` then
    tempers, filters and samples the result. Every setting is traced.

    1. logit bias: `x = logits + bias` (vLLM's `LogitBiasLogitsProcessor`).
    2. min-tokens: `x[stop_mask] = -inf` while `t < min_tokens` (vLLM's
       `MinTokensLogitsProcessor`; it commutes with 1).
    3. repetition penalty, over the prompt and the generated tokens: where
       `prompt_mask | counts > 0`, `x / p` if `x > 0` else `x * p` (vLLM's
       `apply_penalties`, Hugging Face's `RepetitionPenaltyLogitsProcessor`).
    4. frequency penalty: `x -= frequency_penalty * counts`.
    5. presence penalty: `x -= presence_penalty * (counts > 0)`.

    Args:
      logits: `[V]` raw logits (any float dtype; computed in float32).
      t: `[]` int32, tokens this branch has generated so far.
      bias: `[V]` float32 logit bias (0 where none).
      stop_mask: `[V]` bool, the ids masked until `min_tokens` (every stop id).
      min_tokens: `[]` int32.
      counts: `[V]` int32, how often the branch generated each token (its
        generated tokens only); None skips steps 3-5.
      prompt_mask: `[V]` bool, tokens of the prompt (for step 3 only).
      repetition_penalty, frequency_penalty, presence_penalty: `[]` float32.

    Returns:
      `[V]` float32 processed logits. NaN stays NaN and -inf stays -inf
      (`choose_token` counts both as -inf).
    """
    x = jnp.asarray(logits, jnp.float32) + bias
    x = jnp.where(stop_mask & (t < min_tokens), -jnp.inf, x)
    if counts is not None:
        seen = counts > 0
        rp = jnp.asarray(repetition_penalty, jnp.float32)
        x = jnp.where(seen | prompt_mask, jnp.where(x > 0, x / rp, x * rp), x)
        x = x - jnp.asarray(frequency_penalty, jnp.float32) * counts.astype(jnp.float32)
        x = x - jnp.asarray(presence_penalty, jnp.float32) * seen.astype(jnp.float32)
    return x


def token_rank(logits: jax.Array, token: jax.Array, vocab_limit: int) -> jax.Array:
    """`[]` int32 rank of `token` under the raw distribution, vLLM's convention:
    the number of tokens at least as likely (1 for the most likely; ties share
    the larger rank). Padding and NaN rows never count."""
    raw, _, _ = _prepare(logits, 1.0, vocab_limit)
    return jnp.sum(raw >= raw[token]).astype(jnp.int32)


def position_logprobs(logits: jax.Array, targets: jax.Array, k: int, vocab_limit: int):
    """Log-probabilities of given tokens at S positions, with their ranks and the top k.

    For prompt logprobs: row i of `logits` is the distribution that follows
    prompt token i, `targets[i]` is prompt token i + 1.

    Args:
      logits: `[S, V]` raw logits.
      targets: `[S]` int32 token ids in [0, vocab_limit).
      k: static int in [0, 20]; 0 gives empty top-k arrays.
      vocab_limit: static; rows >= vocab_limit are padding.
    Returns:
      (logprob `[S]` float32, rank `[S]` int32 (as `token_rank`),
       top values `[S, k]` float32, top ids `[S, k]` int32), the arithmetic
      of `choose_token`'s logprob and `top_logprobs`.
    """
    def one(x, tok):
        raw, _, top = _prepare(x, 1.0, vocab_limit)
        shifted = raw - raw[top]
        lse = jnp.log(jnp.sum(jnp.exp(shifted)))
        lp = shifted[tok] - lse
        rank = jnp.sum(raw >= raw[tok]).astype(jnp.int32)
        if k:
            vals, ids = jax.lax.top_k(shifted, k)
        else:
            vals, ids = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
        return lp.astype(jnp.float32), rank, (vals - lse).astype(jnp.float32), ids.astype(jnp.int32)

    return jax.vmap(one)(logits, targets)


def top_logprobs(logits: jax.Array, k: int, vocab_limit: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of the raw distribution of one position.

    Args:
      logits: [V] raw logits (temperature 1, no filters).
      k: static int in [1, vocab_limit].
      vocab_limit: static int; rows >= vocab_limit are padding, never listed.
    Returns:
      (values [k] float32 log_softmax, decreasing; ids [k] int32), ties to the
      lower index (`lax.top_k`).
    """
    raw, _, greedy_tok = _prepare(logits, 1.0, vocab_limit)  # NaN and padding at -inf
    shifted = raw - raw[greedy_tok]  # the same arithmetic as choose_token's logprob
    vals, ids = jax.lax.top_k(shifted, k)
    return (vals - jnp.log(jnp.sum(jnp.exp(shifted)))).astype(jnp.float32), ids.astype(jnp.int32)


NUM_SIGNALS = 3  # token_signals' outputs: entropy, self-certainty, top-2 margin
SIGNAL_NAMES = ("token_entropy", "self_certainty", "top2_margin")


def token_signals(logits: jax.Array, vocab_limit: int) -> jax.Array:
    """Selection signals of one raw distribution: entropy, self-certainty, top-2 margin.

    On the raw distribution p = softmax(logits) over the real vocabulary
    (temperature 1, no processors or filters, rows >= `vocab_limit` excluded:
    the arithmetic of the recorded logprobs, `_prepare` then the max-shifted
    log-sum-exp), in nats:

    * entropy H(p) = -sum_v p_v log p_v, >= 0.
    * self-certainty KL(U || p) = (1/V) sum_v -log(V p_v) = -log V - mean_v
      log p_v, >= 0 (Kang et al. 2025, arXiv 2502.18581, eq. 3, "self-certainty";
      their code, `confidence_logits` in backprop07/Self-Certainty, computes
      `-1/V * sum(logprob + log V)`: the same sign, higher = more confident).
      V is `vocab_limit`, the tokens that can be sampled, not the logits rows:
      the padding rows beyond the tokenizer's vocabulary have p = 0 here (as
      for every logprob this library reports), so counting them would make
      the KL infinite. (The paper's V is the logits width of a Hugging Face
      model, whose padding rows carry finite untrained logits.) It is also
      DeepConf's token confidence -mean log p over the top k with k = V,
      minus the constant log V.
    * top-2 margin log p_(1) - log p_(2) = logit_(1) - logit_(2), >= 0: the
      log-ratio of the two most likely tokens (0 on a tie; +inf when a single
      token has all the mass, e.g. vocab_limit = 1).

    A NaN or -inf logit below `vocab_limit` counts as p = 0 (as in
    `choose_token`): the entropy ignores it, the self-certainty is then +inf.
    A row without a distribution gives NaN for all three.

    Args:
      logits: `[V]` raw logits (any float dtype; computed in float32).
      vocab_limit: static int in [1, V].
    Returns:
      `[3]` float32: (entropy, self-certainty, top-2 margin), `SIGNAL_NAMES`.
    """
    raw, _, top = _prepare(logits, 1.0, vocab_limit)  # NaN and padding at -inf
    v = raw.shape[0]
    m = raw[top]
    shifted = raw - m  # <= 0; -inf where p = 0 (the same arithmetic as the logprob)
    e = jnp.exp(shifted)
    z = jnp.sum(e)
    lse = jnp.log(z)
    # H = lse - sum_v p_v shifted_v, with 0 * -inf taken as 0.
    entropy = lse - jnp.sum(jnp.where(e > 0, e * shifted, 0.0)) / z
    real = jnp.arange(v) < vocab_limit
    mean_shifted = jnp.sum(jnp.where(real, shifted, 0.0)) / vocab_limit
    certainty = lse - mean_shifted - jnp.log(jnp.float32(vocab_limit))
    second = jnp.max(jnp.where(jnp.arange(v) == top, -jnp.inf, raw))
    margin = m - second
    out = jnp.stack([entropy, certainty, margin]).astype(jnp.float32)
    return jnp.where(m > -jnp.inf, out, jnp.nan)


def check_logprobs(logprobs: Any) -> None:
    """Raise if any sampled token came from a row without a distribution.

    `choose_token` marks such a token with a NaN logprob (its logits were all
    NaN or -inf: NaN weights, or an overflow in the forward pass). The decode
    loop runs on the device and cannot raise, so the host calls this on the
    finished logprobs before returning anything.

    Args:
      logprobs: [B, N, T] float32 (host array), 0 after a branch ends.

    Raises:
      NumericalError (a RuntimeError): naming the first prompt, branch and new
        token index concerned and the count of such tokens.
    """
    lp = np.asarray(logprobs)
    bad = np.argwhere(np.isnan(lp))
    if bad.size:
        where = ", ".join(f"{name} {int(i)}" for name, i in
                          zip(("prompt", "branch", "new token")[-lp.ndim:], bad[0]))
        raise NumericalError(
            f"the model gave no valid distribution (every logit NaN or -inf) at {where} "
            f"({len(bad)} sampled token(s) in all); the weights hold NaN or the forward pass "
            "overflowed (e.g. in bfloat16)")


# --------------------------------------------------------------------------
# Stops
# --------------------------------------------------------------------------


def pad_stop_ids(ids: Sequence[int], size: int | None = None) -> np.ndarray:
    """Stop ids as the fixed-size int32 array `is_stop` expects.

    Args:
      ids: token ids >= 0 (duplicates are removed, order kept).
      size: the array length (static across requests to avoid recompiling);
        default len(unique ids), at least 1.

    Returns:
      [size] int32, the ids followed by -1 padding.

    Raises:
      ValueError: an id is negative or there are more ids than `size`.
    """
    uniq = list(dict.fromkeys(int(i) for i in ids))
    if any(i < 0 for i in uniq):
        raise ValueError(f"stop ids must be >= 0, got {uniq}")
    size = max(len(uniq), 1) if size is None else size
    if len(uniq) > size:
        raise ValueError(f"{len(uniq)} stop ids do not fit in size {size}")
    out = np.full((size,), -1, np.int32)
    out[:len(uniq)] = uniq
    return out


def is_stop(token: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether `token` is one of `stop_ids`.

    Args:
      token: int32 scalar (>= 0).
      stop_ids: [S] int32 stop ids padded with -1 (see `pad_stop_ids`).

    Returns:
      bool scalar. Padding (-1) never matches a real token.
    """
    token = jnp.asarray(token, jnp.int32)
    stop_ids = jnp.asarray(stop_ids, jnp.int32)
    return jnp.any((stop_ids == token) & (stop_ids >= 0))
