"""Majority vote and its weighted variants (jitted over `[B, N]`).

`majority_vote` maps each branch to an answer id and returns the most
frequent (optionally weighted) one (Wang et al. 2022, "Self-Consistency
Improves Chain of Thought Reasoning in Language Models", arXiv 2203.11171);
`confidence_vote` is DeepConf's weighted vote, optionally filtered to the top
eta% (arXiv 2508.15260); `borda_vote` gives rank votes (m - r + 1)^p. Both
reuse `majority_vote`'s kernel. Conventions: `jaxsample.reduce`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.reduce.arrays import (
    check_2d,
    check_like,
    check_real,
    check_valid,
    exact_ranks,
    fits_32,
)


class Vote(NamedTuple):
    """Outcome of a (weighted) majority vote over N branches per prompt; a pytree.

    Attributes:
      winner: `[B]` int32 winning answer id; -1 when the row has no valid answer.
      support: `[B]` float32 votes for the winner: a count for plain voting,
        the summed weight for weighted voting; 0 when there is no winner.
      share: `[B]` float32 winner's fraction of the valid total
        (support / total count or weight), in [0, 1]; 0 when there is no
        winner or the valid total is 0.
      first_branch: `[B]` int32 lowest branch index that gave the winner; -1 if none.
    """

    winner: jax.Array
    support: jax.Array
    share: jax.Array
    first_branch: jax.Array


_F32_MANT = 0x7FFFFF


_F32_HIDDEN = 0x800000


_F32_INF_BITS = 0x7F800000


def _row_scaled_weights(w: jax.Array, keep: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scale each row of float32 weights by 2**-T so its largest kept weight is in [0.5, 1).

    Done on the bits (integer ops only), so it is exact and immune to
    flush-to-zero: XLA on CPU treats float32 subnormals as 0 in float
    arithmetic (frexp, ldexp, max, compare), which would zero tiny weights.
    A kept weight is `M * 2**E` with M < 2**24 an integer; its scaled value
    keeps M's bits with a new exponent. Weights below 2**-126 of the row's
    largest (which cannot change a float32 sum that holds the largest) become
    0. Negative weights (and -0.0) count as 0; so do weights not `keep`.

    Returns:
      `[B, N]` float32 scaled weights (normal numbers or 0) and `[B]` int32
      T, with weight = scaled * 2**T exactly for every weight that stays.
    """
    bits = jax.lax.bitcast_convert_type(w, jnp.int32)
    mag = jnp.where(keep & (bits > 0), bits, 0)  # bits > 0: positive, sign bit clear
    field = mag >> 23
    m = jnp.where(field > 0, (mag & _F32_MANT) | _F32_HIDDEN, mag & _F32_MANT)
    blen = 32 - jax.lax.clz(m)  # bit length of M (0 for M = 0)
    top = jnp.maximum(field, 1) - 150 + blen  # weight in [2**(top-1), 2**top)
    pos = m > 0
    t = jnp.max(jnp.where(pos, top, jnp.int32(-(2**30))), axis=-1)
    t = jnp.where(jnp.any(pos, axis=-1), t, 0)
    biased = top - t[:, None] + 126  # float32 exponent field of the scaled weight
    mant = (m << jnp.maximum(24 - blen, 0)) & _F32_MANT
    sbits = jnp.where(pos & (biased >= 1), (biased << 23) | mant, 0)
    return jax.lax.bitcast_convert_type(sbits, jnp.float32), t


def _ldexp_f32(x: jax.Array, k: jax.Array) -> jax.Array:
    """x * 2**k for finite x >= 0 (normal or 0) as float32, rounded to nearest even, on the bits.

    Unlike `jnp.ldexp` this gives subnormal results (and +inf past the
    float32 range) instead of flushing them to zero."""
    xb = jax.lax.bitcast_convert_type(x, jnp.int32)
    field, mant = (xb >> 23) & 0xFF, xb & _F32_MANT
    e = field + k
    normal = (e << 23) | mant
    s = jnp.clip(1 - e, 1, 25)  # right shift of the full significand for a subnormal result
    full = mant | _F32_HIDDEN
    q = full >> s
    rem = full & ((1 << s) - 1)
    half = 1 << (s - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    out = jnp.where(e >= 255, _F32_INF_BITS, jnp.where(e >= 1, normal, sub))
    out = jnp.where(field == 0, 0, out)  # x == 0
    return jax.lax.bitcast_convert_type(out, jnp.float32)


@jax.jit
def _majority_vote(answer_ids: jax.Array, valid: jax.Array, weights: jax.Array, shift: jax.Array) -> Vote:
    n = answer_ids.shape[-1]
    # Non-finite weights can only reach here traced (concrete ones are checked):
    # they exclude the branch like NaN; traced negative weights count as 0.
    finite = ((jax.lax.bitcast_convert_type(weights, jnp.int32) >> 23) & 0xFF) != 0xFF
    ok = valid & (answer_ids >= 0) & finite
    # Scale each row by a power of two so its largest weight is in [0.5, 1):
    # sums of up to N such weights cannot overflow, tiny (even subnormal)
    # weights become normal numbers, and scaling by 2**-T is exact, so ties
    # and the order of supports are those of the raw weights.
    ws, t = _row_scaled_weights(weights, ok)
    # same[b, i, j]: branches i and j are valid and gave the same answer.
    same = ok[:, :, None] & ok[:, None, :] & (answer_ids[:, :, None] == answer_ids[:, None, :])
    # Every branch of one answer sums the same weights in the same order, so
    # equal answers get bit-identical support.
    support = jnp.einsum("bij,bj->bi", same.astype(ws.dtype), ws)
    branch = jnp.arange(n, dtype=jnp.int32)
    first = jnp.min(jnp.where(same, branch[None, None, :], n), axis=-1)  # [B, N] first occurrence
    any_ok = jnp.any(ok, axis=-1)
    top = jnp.max(jnp.where(ok, support, -jnp.inf), axis=-1, keepdims=True)
    tied = ok & (support == top)
    first_branch = jnp.min(jnp.where(tied, first, n), axis=-1)
    first_branch = jnp.where(any_ok & (first_branch < n), first_branch, -1).astype(jnp.int32)
    has = first_branch >= 0
    safe = jnp.maximum(first_branch, 0)[:, None]
    winner = jnp.where(has, jnp.take_along_axis(answer_ids, safe, axis=-1)[:, 0], -1).astype(jnp.int32)
    win_scaled = jnp.where(has, jnp.take_along_axis(support, safe, axis=-1)[:, 0], 0.0)
    total = jnp.sum(ws, axis=-1)
    share = jnp.where(total > 0, win_scaled / jnp.where(total > 0, total, 1.0), 0.0)
    share = jnp.clip(share, 0.0, 1.0)
    # The reported support is in the weights' units (host scaling by 2**shift
    # undone too): subnormal when the weights are that small, +inf only when
    # the winner's summed weight itself exceeds the float32 range.
    win_support = _ldexp_f32(win_scaled, t - shift)
    return Vote(winner=winner, support=win_support, share=share, first_branch=first_branch)


def _host_scaled_weights(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concrete weights as float32 with each row scaled by 2**shift (exact, in float64 first).

    The row's largest finite positive weight goes to [0.5, 1), so weights
    too small for float32 (1e-50, or 3e-45 vs 2e-45, which float32 would
    round to equal subnormals) keep their ratios through the cast. Returns
    the float32 weights and the `[B]` int32 shifts."""
    w = raw.astype(np.float64)
    with np.errstate(invalid="ignore"):
        pos = np.isfinite(w) & (w > 0)
    big = np.max(np.where(pos, w, 0.0), axis=-1)
    _, e = np.frexp(big)  # big = f * 2**e, f in [0.5, 1); 0 for an empty row
    shift = np.where(big > 0, -e, 0).astype(np.int32)
    return np.ldexp(w, shift[:, None].astype(np.int64)).astype(np.float32), shift


def majority_vote(answer_ids: Any, valid: Any = None, weights: Any = None) -> Vote:
    """Majority vote (self-consistency) over N branches per prompt (jitted).

    Self-consistency (Wang et al. 2022, arXiv 2203.11171) samples N reasoning
    paths and returns the most frequent final answer. With `weights` it is the
    paper's weighted variant: each answer's support is the sum of its
    branches' weights, and `share` normalises it by the total valid weight.
    The paper's best weighting is the length-normalised sequence probability,
    `weights = exp(mean logprob)` (`weights_from_mean_logprob`); reward or
    verifier scores can be turned into weights with `weights_from_scores`.

    The vote runs on static shapes with an `[N, N]` answer-equality matrix per
    row (no sort, no host round trip): O(B N^2) work and memory.

    Args:
      answer_ids: `[B, N]` int answer id per branch (answers already mapped
        to integers per prompt, e.g. by `self_consistency`). Negative ids
        mean "no answer" and are treated as invalid.
      valid: `[B, N]` bool, or None (all branches valid). Invalid branches are
        excluded: never counted, never winners.
      weights: `[B, N]` float non-negative weight per branch, or None (each
        valid branch counts 1). Branches with NaN weight are excluded.
        Concrete weights are checked as float32 (values that overflow the
        cast are refused) and as given (negative ones are refused). Each
        row is scaled by a power of two so its largest weight is in
        [0.5, 1) (exact): on the host in float64 for concrete weights, then
        on the float32 bits inside the kernel (no float arithmetic, so the
        flush-to-zero of subnormals on XLA CPU cannot touch it). So both
        ends rank: large weights (sums beyond float32's range) and tiny
        ones (1e-50, float32 subnormals such as 3e-45 vs 2e-45 + 2e-45)
        give the right winner and a `share` in [0, 1]; within a row,
        weights are compared to float32 precision relative to its largest
        (below 2**-126 of it they count 0). The reported `support` is in the
        weights' units: subnormal (or 0) for tiny weights, +inf when the
        winner's sum exceeds float32.
        Traced weights (under an outer `jit`) cannot be checked: there,
        infinite weights exclude the branch like NaN and negative ones count 0.

    Returns:
      A `Vote` of `[B]` arrays (`winner`, `support`, `share`,
      `first_branch`). Ties in support go to the answer whose first
      occurrence has the lowest branch index (`Counter.most_common`). With
      weights that are all 0 the first valid answer wins with support 0 and
      share 0.

    Raises:
      ValueError: `answer_ids` is not an int `[B, N]` array with N >= 1 or
        has ids outside int32, or `valid` / `weights` do not have its shape
        (or the right dtype), or concrete `weights` contain negative values
        or values infinite in float32 (e.g. 1e300).
    """
    answer_ids = check_2d("answer_ids", answer_ids)
    if not jnp.issubdtype(answer_ids.dtype, jnp.integer):
        raise ValueError(f"answer_ids must be an int array (answers mapped to ids); got dtype {answer_ids.dtype}")
    if isinstance(answer_ids, np.ndarray) and not fits_32(answer_ids):
        raise ValueError("answer_ids must fit int32 (in [-2**31, 2**31 - 1]); got values in "
                         f"[{int(answer_ids.min())}, {int(answer_ids.max())}]")
    answer_ids = jnp.asarray(answer_ids).astype(jnp.int32)
    valid = check_valid(valid, answer_ids.shape, "answer_ids")
    shift = jnp.zeros(answer_ids.shape[:1], dtype=jnp.int32)
    if weights is None:
        weights = jnp.ones(answer_ids.shape, dtype=jnp.float32)
    else:
        weights = check_like("weights", weights, answer_ids.shape, "answer_ids")
        if not jnp.issubdtype(weights.dtype, jnp.floating):
            if not jnp.issubdtype(weights.dtype, jnp.integer) and weights.dtype != jnp.bool_:
                raise ValueError(f"weights must be a float array; got dtype {weights.dtype}")
        if isinstance(weights, jax.core.Tracer):
            weights = weights.astype(jnp.float32)
        else:
            raw = np.asarray(weights)
            # Check what the kernel would see: the float32 cast (1e300 -> inf);
            # and the raw sign (-1e-50 is negative even if float32 says -0.0).
            with np.errstate(over="ignore", invalid="ignore"):
                c = raw.astype(np.float32)
                negative = np.any(raw < 0)
            if negative or np.any(np.isinf(c)):
                raise ValueError("weights must be finite in float32 (|w| <= 3.4e38) and non-negative "
                                 "(NaN excludes a branch)")
            c, host_shift = _host_scaled_weights(raw)
            weights, shift = jnp.asarray(c), jnp.asarray(host_shift)
    return _majority_vote(answer_ids, valid, weights, shift)


def weights_from_mean_logprob(gen: Any) -> np.ndarray:
    """Vote weights `exp(mean token logprob)` per branch.

    This is the "normalized weighted sum" of Wang et al. 2022 (arXiv
    2203.11171, Table 1): each branch weighs its length-normalised
    probability, the geometric mean of its tokens' probabilities.

    Args:
      gen: a `jaxsample.generation.Generation`.

    Returns:
      `[B, N]` float32 weights in [0, 1]: a mean logprob below about -103
      gives a subnormal and below about -104 gives 0 in float32
      (`self_consistency(weights="mean_logprob")` computes the weights in
      float64 instead, so such branches still rank).
    """
    return np.exp(np.asarray(gen.mean_logprob(), dtype=np.float64)).astype(np.float32)


def weights_from_scores(scores: Any, valid: Any = None, temperature: float | None = None) -> jax.Array:
    """Vote weights from reward-model / verifier scores `[B, N]`.

    Args:
      scores: `[B, N]` float score per branch (higher is better).
      valid: `[B, N]` bool or None; invalid branches get weight 0.
      temperature: None to use the scores themselves as weights (they must
        then be non-negative, e.g. a verifier's probability of "correct");
        a positive float to use a softmax over the row's valid branches,
        `softmax(scores / temperature)` (small temperatures approach
        best-of-N, large ones plain counting).

    Returns:
      `[B, N]` float32 weights for `majority_vote(..., weights=...)`.

    Raises:
      ValueError: wrong shapes, or a temperature that is not positive.
    """
    scores = check_2d("scores", scores)
    check_real("scores", scores)
    valid = check_valid(valid, scores.shape, "scores")
    scores = scores.astype(jnp.float32)
    if temperature is None:
        return jnp.where(valid, scores, 0.0)
    if not temperature > 0:
        raise ValueError(f"temperature must be positive or None; got {temperature}")
    mask = valid & ~jnp.isnan(scores)
    logits = jnp.where(mask, scores / temperature, -jnp.inf)
    any_ok = jnp.any(mask, axis=-1, keepdims=True)
    probs = jax.nn.softmax(jnp.where(any_ok, logits, 0.0), axis=-1)
    return jnp.where(mask, probs, 0.0)


def _keep_index_table(n: int, top_percent: float) -> np.ndarray:
    """`[n + 1]` int32: for m valid branches, the ascending rank from which a
    branch is kept, ceil((m - 1) (1 - top_percent / 100)), in exact arithmetic."""
    from fractions import Fraction

    q = 1 - Fraction(top_percent) / 100
    return np.array([0] + [math.ceil((m - 1) * q) for m in range(1, n + 1)], np.int32)


@jax.jit
def _confidence_vote(answer_ids, confidence, valid, keep_from):
    n = answer_ids.shape[-1]
    ok = valid & (answer_ids >= 0) & ~jnp.isnan(confidence)
    m = jnp.sum(ok, axis=-1)
    # ascending order of the pool's confidences (others at +inf, after them)
    srt = jnp.sort(jnp.where(ok, confidence, jnp.inf), axis=-1)
    idx = jnp.clip(keep_from[m], 0, n - 1)
    thr = jnp.take_along_axis(srt, idx[:, None], axis=-1)
    keep = ok & (confidence >= thr)
    w = jnp.where(keep, jnp.maximum(confidence, 0.0), 0.0).astype(jnp.float32)
    return _majority_vote(answer_ids, keep, w, jnp.zeros(answer_ids.shape[:1], jnp.int32))


def _check_confidence_vote(answer_ids, confidence, valid):
    """The checked (answer_ids, confidence, valid) of a confidence-weighted vote."""
    answer_ids = check_2d("answer_ids", answer_ids)
    if not jnp.issubdtype(answer_ids.dtype, jnp.integer):
        raise ValueError(f"answer_ids must be an int array; got dtype {answer_ids.dtype}")
    confidence = check_like("confidence", confidence, answer_ids.shape, "answer_ids")
    check_real("confidence", confidence)
    valid = check_valid(valid, answer_ids.shape, "answer_ids")
    return answer_ids, confidence, valid


def confidence_vote(answer_ids: Any, confidence: Any, valid: Any = None, *,
                    top_percent: float | None = None) -> Vote:
    """DeepConf's offline votes: confidence-weighted majority, optionally after
    keeping only the top `top_percent`% of branches by confidence (jitted).

    Fu et al. 2025 (arXiv 2508.15260, "offline"; facebookresearch/deepconf
    `analysis_offline.py`): each branch votes for its answer with weight its
    trace confidence (`confidence_scores` / `branch_scores`). With
    `top_percent = eta` (the paper's eta = 10 "DeepConf-low" and 90
    "DeepConf-high"), only branches whose confidence is at least the
    (100 - eta)th percentile (numpy's linear interpolation, as their
    `filter_top_confidence`) of the pool's vote, then weighted. The pool is
    the valid branches with an answer and a non-NaN confidence; ties at the
    threshold are all kept. The percentile's keep set is computed exactly
    (a branch is kept iff its confidence is >= the pool's
    ceil((m - 1)(1 - eta/100))-th smallest, which is what the interpolated
    threshold keeps), so no float rounding moves a branch across it.

    Args:
      answer_ids: `[B, N]` int answer ids (< 0: no answer).
      confidence: `[B, N]` float per-branch confidence, higher = more
        confident, compared and summed in float32; negative values weigh 0,
        NaN excludes the branch, +inf excludes it from the vote (as
        `majority_vote`'s non-finite weights).
      valid: `[B, N]` bool or None.
      top_percent: None (no filter) or eta in (0, 100].

    Returns:
      A `Vote` (ties as `majority_vote`: the answer seen first; with all
      weights 0 the first kept answer wins with support 0).

    Raises:
      ValueError: shapes or dtypes as `majority_vote`, or a top_percent
        outside (0, 100].
    """
    answer_ids, confidence, valid = _check_confidence_vote(answer_ids, confidence, valid)
    n = answer_ids.shape[1]
    if top_percent is None:
        table = np.zeros((n + 1,), np.int32)
    else:
        if isinstance(top_percent, bool) or not isinstance(top_percent, (int, float)) or not (
                0 < float(top_percent) <= 100):
            raise ValueError(f"top_percent must be None or in (0, 100], got {top_percent!r}")
        table = _keep_index_table(n, float(top_percent))
    return _confidence_vote(jnp.asarray(answer_ids).astype(jnp.int32),
                            jnp.asarray(confidence, jnp.float32), jnp.asarray(valid),
                            jnp.asarray(table))


@jax.jit
def _borda_vote(answer_ids, confidence, valid, power):
    pool = valid & ~jnp.isnan(confidence)
    c = confidence
    i = jnp.arange(c.shape[-1])
    better = (c[:, None, :] > c[:, :, None]) | (
        (c[:, None, :] == c[:, :, None]) & (i[None, None, :] < i[None, :, None]))
    rank = jnp.sum(better & pool[:, None, :], axis=-1)  # [B, N]: 0 = most confident
    m = jnp.sum(pool, axis=-1, keepdims=True)
    w = jnp.where(pool, (m - rank).astype(jnp.float32) ** power, 0.0)
    votes = pool & (answer_ids >= 0)
    return _majority_vote(answer_ids, votes, w, jnp.zeros(answer_ids.shape[:1], jnp.int32))


def borda_vote(answer_ids: Any, confidence: Any, valid: Any = None, *,
               power: float = 0.5) -> Vote:
    """Borda voting by confidence rank (Kang et al. 2025, arXiv 2502.18581, sec. 3.3; jitted).

    The valid, non-NaN branches of a row are ranked by confidence (the
    branch self-certainty in the paper), most confident first, equal
    confidences in branch order (their code's stable sort); the branch of
    rank r (r = 1 .. m) gives its answer (m - r + 1)^power votes. power = 0
    is the plain majority vote, a large power best-of-N; the paper's code
    defaults to 0.5 (backprop07/Self-Certainty `voting_from_list.py`).
    Branches without an answer (id < 0) keep their rank but vote for
    nothing, as in that code. The answer with the most votes wins; ties go to
    the answer seen first (`majority_vote`).

    Args:
      answer_ids: `[B, N]` int answer ids (< 0: no answer).
      confidence: `[B, N]` float branch confidence (e.g.
        `branch_scores(gen, "self_certainty")`); NaN excludes a branch.
      valid: `[B, N]` bool or None.
      power: finite float >= 0.

    Returns:
      A `Vote`; `support` is the winner's summed (m - r + 1)^power.

    Raises:
      ValueError: shapes or dtypes as `majority_vote`, or a bad power.
    """
    answer_ids, confidence, valid = _check_confidence_vote(answer_ids, confidence, valid)
    if isinstance(power, bool) or not isinstance(power, (int, float)) or not (
            math.isfinite(power) and power >= 0):
        raise ValueError(f"power must be a finite float >= 0, got {power!r}")
    conf = np.asarray(confidence) if not isinstance(confidence, jax.Array) else confidence
    if isinstance(conf, np.ndarray) and not fits_32(conf):
        conf = exact_ranks(conf)  # float64: rank exactly on the host (ties kept)
    return _borda_vote(jnp.asarray(answer_ids).astype(jnp.int32), jnp.asarray(conf, jnp.float32),
                       jnp.asarray(valid), jnp.float32(power))
