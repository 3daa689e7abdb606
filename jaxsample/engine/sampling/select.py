"""The kept set of one distribution: temperature, top-k, top-p, min-p.

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
p - 1e-6; tests/sampling/test_sampling.py compares the paths off those tokens). When
every kept set lies within the candidates, the Gumbel noise is computed at
the candidates' indices only (the same values `jax.random.gumbel(key, (V,))`
has there: element i of a threefry-partitionable draw depends on i alone),
so the token is the same as with the full draw. Each later stage, the
bisection and the full draw sit behind a `lax.cond` on a predicate reduced
over all rows of the `vmap` (a `jax.custom_batching.custom_vmap` rule
gathers the vmapped rows into one batch): under the engine's
`vmap(vmap(choose_token))` a step whose rows all fit never runs the later
stages, and a row's result never depends on the other rows (it comes from
the first stage it fits). At a large V the pre-selection is faster than the
bisection over V whenever the kept sets fit in the candidates; a step with a
row that needs the bisection costs more than the bisection alone (both stages
and the full draw run too). On a small vocabulary `lax.top_k` of K0 costs as
much as the bisection's passes over V, so a default stage of K0 runs only
where V >= 16 K0 (`VOCAB_PER_CANDIDATE`; below V = 4,096 there is none): the
stages are most of the sampler's code, and code the step does not need still
costs compile time (docs/benchmarks.md, "The sampler at V = 262,144, and
Gemma 3 parity"; benchmarks/sampler_cost.py). `candidates=0` selects the
bisection and the full draw alone (the reference path). Min-p is a single
O(V) comparison. Top-k and top-p sit behind a `lax.cond` on the scalar
parameters (also skipped when temperature == 0), so inactive filters cost
nothing. Under `vmap` a `cond` whose predicate is batched becomes a
`select` that runs both sides, so the engine should keep temperature,
top_k, top_p and min_p *unbatched*
(`vmap(..., in_axes=(0, 0, None, None, None, None))`): they come from one
`SamplingParams` and are shared by all branches. Per-branch values still give
correct results, only without the skipping.

The filter parameters are traced scalars: changing them never recompiles.
Only `vocab_limit` (and the shape of `logits`) is static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsample.engine.sampling.processors import prepare
from jaxsample.sampling_params import is_int

# Tolerance on the top-p cumulative mass (absolute) and on the min-p
# probability ratio (relative); see the table of `jaxsample.engine.sampling`.
TOP_P_TOL = 1e-6
MIN_P_TOL = 1e-6


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
# K0 of each stage: `lax.top_k` costs more the larger K0, so the first stage is the
# smaller one (benchmarks/sampler_cost.py --candidates).
TOP_CANDIDATES = (256, 1024)

VOCAB_PER_CANDIDATE = 16
"""A default stage of K0 candidates runs only where V >= VOCAB_PER_CANDIDATE * K0.
Below that ratio the bisection over V costs no more per step than `lax.top_k`
(K0 = 256: slower at V = 264 and 2,048, faster from 8,192 on; docs/benchmarks.md,
"The sampler at V = 262,144, and Gemma 3 parity"), so the stage would only add
code to compile."""


def batch_rows(rows_fn):
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


def one_row(f, *args):
    """Call a `batch_rows` function on a single row (a leading axis of 1 added and removed)."""
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
    Returns: keep [M, V] bool (the table of `jaxsample.engine.sampling`'s top-k / top-p set where the
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


def keep_set(z: jax.Array, greedy_tok: jax.Array, temperature, top_k, top_p,
             min_p, vocab_limit: int, candidates: tuple[int, ...], any_filter=None):
    """[V] bool keep set of the sampling (temperature > 0) path, and the
    candidates `(idx [K0] int32, ok bool)` per stage (None on the bisection
    path). candidates: the stages, as `check_candidates` returns them.

    Top-k and top-p together run behind one `lax.cond` on the scalar
    parameters, so inactive filters cost nothing. `any_filter` (a bool
    scalar, unbatched under `vmap`) replaces that predicate when the
    parameters are per row: the cond is then on "some row filters", which
    stays a real cond, and a row whose own filters are off keeps every token
    on either side.
    """
    v = z.shape[0]
    sampling = jnp.asarray(temperature, jnp.float32) > 0
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    min_p = jnp.asarray(min_p, jnp.float32)
    k_on = sampling & (top_k > 0) & (top_k < vocab_limit)
    p_on = sampling & (top_p < 1.0)
    k0s = candidates
    if not k0s:
        # The bisection path: top-k and top-p each behind a cond of its own
        # (selects under a vmap with per-row knobs, inside the batch-wide cond).
        # The order keys are computed inside each filter's branch.
        def on(z, k, p, k_on, p_on):
            keep = jax.lax.cond(k_on, lambda z, k: _top_k_mask(z, _order_keys(z), k),
                                lambda z, k: jnp.ones((v,), bool), z, k)
            keep = jax.lax.cond(p_on, lambda z, kk, p: _top_p_mask(z, _order_keys(z), kk, p),
                                lambda z, kk, p: kk, z, keep, p)
            return keep, None
    else:
        rows = batch_rows(lambda *a: _rank_filter_rows(*a, k0s=k0s))

        def on(z, k, p, k_on, p_on):
            return one_row(rows, z, k, p, k_on, p_on)

    def off(z, k, p, k_on, p_on):
        none_fit = tuple((jnp.zeros((k,), jnp.int32), jnp.bool_(False)) for k in k0s)
        return jnp.ones((v,), bool), (none_fit if k0s else None)

    pred = k_on | p_on if any_filter is None else jnp.asarray(any_filter, bool)
    keep, cand = jax.lax.cond(pred, on, off, z, top_k, top_p, k_on, p_on)
    # min-p: prob_i / prob_max = exp(z_i - max z) = exp(z_i), the max token is
    # never filtered; log(0) = -inf keeps everything.
    keep &= z >= jnp.log(min_p) + jnp.log1p(-MIN_P_TOL)
    keep &= z > -jnp.inf
    return keep | (jnp.arange(v) == greedy_tok), cand


def check_candidates(candidates, v: int) -> tuple[int, ...]:
    """The pre-selection stages for V logits: K0 values in (0, V], increasing.

    None gives the stages of `TOP_CANDIDATES` that V allows (K0 <=
    V / `VOCAB_PER_CANDIDATE`; none below V = 4,096); an int or a tuple of
    them is taken as given, each clamped to V; 0 or () gives () (the bisection).

    Raises:
      ValueError: candidates is not None, an int >= 0 or a tuple of them.
    """
    if candidates is None:
        return tuple(k for k in TOP_CANDIDATES if k * VOCAB_PER_CANDIDATE <= v)
    ks = (candidates,) if is_int(candidates) else candidates
    if not isinstance(ks, (tuple, list)) or not all(is_int(k) and k >= 0 for k in ks):
        raise ValueError("candidates must be None, a static int >= 0 or a tuple of them "
                         f"(0 or (): the bisection path), got {candidates!r}")
    return tuple(sorted({min(int(k), v) for k in ks if k > 0}))


def keep_mask(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
              top_p: jax.Array, min_p: jax.Array, vocab_limit: int,
              candidates: int | tuple[int, ...] | None = None) -> jax.Array:
    """The set of tokens `choose_token` may sample (see the table of `jaxsample.engine.sampling`).

    Args:
      logits: [V] float32 raw logits of one distribution.
      temperature: float32 scalar >= 0 (traced); 0 is greedy.
      top_k: int32 scalar >= 0 (traced); 0 or >= V is off.
      top_p: float32 scalar in (0, 1] (traced); 1 is off.
      min_p: float32 scalar in [0, 1] (traced); 0 is off.
      vocab_limit: static int in [1, V]; rows >= vocab_limit are padding.
      candidates: static, the top-k pre-selection stages: an int K0 > 0 or
        a tuple of them (`select.py`, "Cost"); None (the default) takes the
        stages of `TOP_CANDIDATES` that V allows (`check_candidates`); 0
        or () runs the bisection alone. The set is the same for every choice
        (up to float32 rounding of the top-p mass).

    Returns:
      [V] bool; never empty; for temperature 0 exactly the greedy token.

    Raises:
      ValueError: logits is not 1-D, vocab_limit or candidates is out of range.
    """
    _, z, greedy_tok = prepare(logits, temperature, vocab_limit)
    candidates = check_candidates(candidates, z.shape[0])
    keep, _ = keep_set(z, greedy_tok, temperature, top_k, top_p, min_p, vocab_limit, candidates)
    greedy = jnp.arange(z.shape[0]) == greedy_tok
    return jnp.where(jnp.asarray(temperature) == 0, greedy, keep)
