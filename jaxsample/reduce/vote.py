"""Reducers: turn N sampled branches per prompt into one answer (jitted).

Two families, both written for static shapes so they can run under `jit`,
`vmap` and inside the decode loop:

* **best-of-N** picks the branch with the highest score (sum or mean logprob,
  or any external reward/verifier score `[B, N]`): `best_of_n`.
* **majority vote / self-consistency** (Wang et al. 2022, "Self-Consistency
  Improves Chain of Thought Reasoning in Language Models", arXiv 2203.11171)
  maps each branch to an answer id and returns the most frequent (optionally
  weighted) answer: `majority_vote`, and on the host, from a `Generation`'s
  texts, `self_consistency`.

Letters (see `models/llama.py`): B prompts, N branches per prompt.

Conventions shared by every reducer here:

* A branch marked invalid (`valid=False`) never wins and is never counted.
* Ties go to the lowest branch index: for best-of-N, the lowest index among
  the tied top scores; for a vote, the answer whose *first occurrence* has the
  lowest branch index (the `collections.Counter.most_common` convention).
* A row with nothing valid gives `-1` (index, answer id, first branch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.reduce import answers as answers_lib

__all__ = [
    "Vote",
    "SelfConsistency",
    "best_of_n",
    "majority_vote",
    "self_consistency",
    "score_sum_logprob",
    "score_mean_logprob",
    "weights_from_mean_logprob",
    "weights_from_scores",
    "SCORE_NAMES",
    "branch_scores",
    "confidence_scores",
    "token_confidence",
    "confidence_vote",
    "borda_vote",
]


# ----------------------------------------------------------------------------
# Boundary checks (shapes are static, so these also run under jit/vmap).
# ----------------------------------------------------------------------------


def _host_array(name: str, x: Any) -> Any:
    """`x` as an array without any 64 -> 32-bit cast: numpy for concrete input
    (a jax array or tracer is returned as is). Strings, objects and ragged
    lists raise a ValueError naming `name`."""
    if isinstance(x, jax.Array):
        return x
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a [B, N] numeric array; got {type(x).__name__} ({e})") from None
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be a [B, N] numeric array; got dtype {arr.dtype}")
    return arr


def _check_2d(name: str, x: Any) -> jax.Array:
    x = _host_array(name, x)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape [B, N] (prompts, branches); got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one branch (N >= 1); got shape {tuple(x.shape)}")
    return x


def _check_like(name: str, x: Any, shape: tuple[int, ...], ref: str) -> jax.Array:
    x = _host_array(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {ref} {tuple(shape)}; got shape {tuple(x.shape)}")
    return x


def _check_valid(valid: Any, shape: tuple[int, ...], ref: str) -> jax.Array:
    if valid is None:
        return jnp.ones(shape, dtype=bool)
    valid = _check_like("valid", valid, shape, ref)
    if valid.dtype != jnp.bool_:
        raise ValueError(f"valid must be a bool array; got dtype {valid.dtype}")
    return valid


def _check_real(name: str, x: jax.Array) -> None:
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"{name} must be a real (float or int) array; got dtype {x.dtype}")


def _exact_ranks(scores: np.ndarray) -> np.ndarray:
    """Host-side dense ranks per row (int32; equal scores equal ranks, NaN stays NaN).

    Scores whose dtype does not fit the jitted kernel exactly (float64, 64-bit
    ints) become their ranks, so `[[1.0, 1.0 + 1e-9]]` or `[[1e300, 1e301]]`
    keep their order and ties instead of collapsing in a float32 cast."""
    x = scores.astype(np.float64) if np.issubdtype(scores.dtype, np.floating) else scores
    out = np.full(x.shape, np.nan, dtype=np.float32)
    for b in range(x.shape[0]):
        row = x[b]
        ok = ~np.isnan(row) if np.issubdtype(row.dtype, np.floating) else np.ones(row.shape, bool)
        if not ok.any():
            continue
        # np.unique on exact values: equal scores share a rank.
        _, inv = np.unique(row[ok], return_inverse=True)
        out[b, ok] = inv.astype(np.float32)
    return out


def _fits_32(x: np.ndarray) -> bool:
    """Whether the kernel's 32-bit dtype holds every value of `x` exactly."""
    if x.dtype.itemsize <= 4 or x.size == 0:
        return x.dtype != np.uint32 or x.size == 0 or int(x.max()) <= np.iinfo(np.int32).max
    if np.issubdtype(x.dtype, np.integer):
        return int(x.min()) >= np.iinfo(np.int32).min and int(x.max()) <= np.iinfo(np.int32).max
    return False  # float64: decided by ranking on the host


# ----------------------------------------------------------------------------
# best-of-N
# ----------------------------------------------------------------------------


@jax.jit
def _best_of_n(scores: jax.Array, valid: jax.Array) -> jax.Array:
    ok = valid & ~jnp.isnan(scores)
    low = jnp.array(-jnp.inf, dtype=scores.dtype) if jnp.issubdtype(scores.dtype, jnp.floating) else jnp.iinfo(scores.dtype).min
    top = jnp.max(jnp.where(ok, scores, low), axis=-1, keepdims=True)
    # `== top` keeps a row whose valid scores are all -inf selectable.
    winners = ok & (scores == top)
    first = jnp.argmax(winners, axis=-1).astype(jnp.int32)  # first True wins ties
    return jnp.where(jnp.any(ok, axis=-1), first, jnp.int32(-1))


def best_of_n(scores: Any, valid: Any = None, *, score: str | None = None,
              **options: Any) -> jax.Array:
    """Best-of-N: the branch with the highest score, per prompt (jitted).

    Scores can be anything per branch where higher is better: the sum or mean
    token logprob (`score_sum_logprob`, `score_mean_logprob`), the selection
    signals' scores (`branch_scores`: self-certainty, DeepConf's tail, lowest
    group and bottom-10% group confidence), or an external
    reward-model / verifier output (Cobbe et al. 2021, "Training Verifiers to
    Solve Math Word Problems", arXiv 2110.14168).

    `best_of_n(gen, score="self_certainty")` takes a `Generation` and a score
    name (`SCORE_NAMES`, hyphens allowed; default "mean_logprob"): the
    scores are `branch_scores(gen, score, **options)` and `valid` defaults
    to the non-empty branches.

    Args:
      scores: `[B, N]` float (or int) score per branch; NaN never wins. Or a
        `Generation`, with `score`.
      score: with a Generation, the score's name; must be None with an array.
      options: with a Generation, `branch_scores`'s keywords (source,
        window, tail, bottom_percent).
        Concrete scores that JAX would cast to 32 bits with loss (float64,
        or 64-bit ints outside the int32 range) are replaced on the host by
        their exact per-row ranks (equal scores, equal ranks) first, so the
        winner is that of the exact values, ties included.
      valid: `[B, N]` bool, or None (every branch valid). Invalid branches
        never win, whatever their score.

    Returns:
      `[B]` int32 index of the winning branch; ties go to the lowest branch
      index; -1 for a row with no valid (non-NaN) branch.

    Raises:
      ValueError: `scores` is not `[B, N]` with N >= 1 or not real-valued,
        or `valid` is not a bool array of the same shape; an unknown score
        name, or a name (or options) given with an array of scores.
    """
    if hasattr(scores, "tokens") and hasattr(scores, "lengths"):  # a Generation
        gen = scores
        scores = branch_scores(gen, "mean_logprob" if score is None else score, **options)
        if valid is None:
            valid = np.asarray(gen.lengths) > 0
    elif score is not None or options:
        raise ValueError("score= (a name) and its options need a Generation as the first "
                         "argument; with a [B, N] array of scores, pass the array alone")
    scores = _check_2d("scores", scores)
    _check_real("scores", scores)
    valid = _check_valid(valid, scores.shape, "scores")
    if isinstance(scores, np.ndarray):
        if not _fits_32(scores):
            scores = _exact_ranks(scores)
        elif scores.dtype == np.bool_:
            scores = scores.astype(np.int32)
    return _best_of_n(jnp.asarray(scores), valid)


def score_sum_logprob(gen: Any) -> np.ndarray:
    """Sum of the generated tokens' logprobs, a best-of-N score.

    Args:
      gen: a `jaxsample.generation.Generation`.

    Returns:
      `[B, N]` float32; favours short branches (every token costs logprob).
    """
    return np.asarray(gen.sum_logprob(), dtype=np.float32)


def score_mean_logprob(gen: Any) -> np.ndarray:
    """Length-normalised logprob (sum / generated tokens), a best-of-N score.

    Args:
      gen: a `jaxsample.generation.Generation`.

    Returns:
      `[B, N]` float32; 0 for empty branches (see `Generation.mean_logprob`).
    """
    return np.asarray(gen.mean_logprob(), dtype=np.float32)


# ----------------------------------------------------------------------------
# Majority vote
# ----------------------------------------------------------------------------


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
    arithmetic (frexp, ldexp, max, compare), which used to zero tiny weights.
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
    answer_ids = _check_2d("answer_ids", answer_ids)
    if not jnp.issubdtype(answer_ids.dtype, jnp.integer):
        raise ValueError(f"answer_ids must be an int array (answers mapped to ids); got dtype {answer_ids.dtype}")
    if isinstance(answer_ids, np.ndarray) and not _fits_32(answer_ids):
        raise ValueError("answer_ids must fit int32 (in [-2**31, 2**31 - 1]); got values in "
                         f"[{int(answer_ids.min())}, {int(answer_ids.max())}]")
    answer_ids = jnp.asarray(answer_ids).astype(jnp.int32)
    valid = _check_valid(valid, answer_ids.shape, "answer_ids")
    shift = jnp.zeros(answer_ids.shape[:1], dtype=jnp.int32)
    if weights is None:
        weights = jnp.ones(answer_ids.shape, dtype=jnp.float32)
    else:
        weights = _check_like("weights", weights, answer_ids.shape, "answer_ids")
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
    scores = _check_2d("scores", scores)
    _check_real("scores", scores)
    valid = _check_valid(valid, scores.shape, "scores")
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


# ----------------------------------------------------------------------------
# Self-consistency from texts (host side)
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class SelfConsistency:
    """Result of `self_consistency`.

    Attributes:
      answers: B lists of N normalised answers (`str`, or None where nothing
        was extracted or the branch was marked invalid).
      answer_ids: `[B, N]` int32 id per branch; equal answers share an id
        within a prompt, numbered in first-seen branch order; -1 for None.
      winner: B winning answers (`str`, or None when no branch gave one).
      share: `[B]` float32 winner's fraction of the valid votes (or weight).
      support: `[B]` float32 votes (or summed weight) for the winner.
      first_branch: `[B]` int32 lowest branch index that gave the winner; -1 if none.
      vote: the `Vote` (numpy arrays) returned by `majority_vote`.
    """

    answers: list[list[str | None]]
    answer_ids: np.ndarray
    winner: list[str | None]
    share: np.ndarray
    support: np.ndarray
    first_branch: np.ndarray
    vote: Vote


def self_consistency(
    generation: Any,
    extract: str | Callable[[str], str | None] = "auto",
    weights: Any = None,
    valid: Any = None,
) -> SelfConsistency:
    """Self-consistency: extract each branch's answer and take the majority vote.

    Wang et al. 2022 ("Self-Consistency Improves Chain of Thought Reasoning
    in Language Models", arXiv 2203.11171). Extraction and normalisation run
    on the host (`jaxsample.reduce.answers`); the vote is `majority_vote` (jitted).

    Args:
      generation: a `Generation` (its `texts`, B lists of N strings), or B
        lists of N strings directly (then `weights="mean_logprob"` is not
        available). A flat list of strings is rejected (a string is not a
        row): for one prompt's branches pass `[texts]`.
      extract: an `answers.extract` kind ("auto", "boxed", "number",
        "choice", "text"), or a callable `text -> str | None`. Whatever it
        returns is passed through `answers.normalize`, so "1,000" and
        "1000" are the same answer; empty answers count as None.
      weights: None (plain counting), "mean_logprob" (weights
        `exp(generation.mean_logprob())` in float64, the paper's normalised
        weighted sum; tiny ones, e^-110, still rank), or a `[B, N]` float
        array (e.g. `weights_from_scores`).
      valid: optional `[B, N]` bool; False excludes a branch (e.g. branches
        cut at `max_new_tokens`).

    Returns:
      A `SelfConsistency`.

    Raises:
      ValueError: unknown `extract` kind or `weights` string, texts that are
        not B lists of the same number N >= 1 of strings (a row that is a
        `str` included), or arrays whose shape is not `[B, N]`.
    """
    texts = generation.texts if hasattr(generation, "texts") else generation
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise ValueError("generation must be a Generation or B lists of N strings")
    for b, r in enumerate(texts):
        if isinstance(r, (str, bytes)) or not isinstance(r, (Sequence, np.ndarray)):
            raise ValueError(
                f"generation must be B lists of N strings, but row {b} is a {type(r).__name__} "
                f"({r!r:.40}), not a list of strings; for one prompt's N texts pass [texts]")
    rows = [list(r) for r in texts]
    if not rows:
        raise ValueError("generation has no prompts (B = 0)")
    n = len(rows[0])
    if n == 0 or any(len(r) != n for r in rows):
        raise ValueError(f"texts must be B lists of the same number N >= 1 of strings; got lengths {[len(r) for r in rows]}")
    if isinstance(extract, str):
        if extract not in answers_lib.KINDS:
            raise ValueError(f"extract must be one of {answers_lib.KINDS} or a callable; got {extract!r}")
        kind = extract
        extract_fn = lambda t: answers_lib.extract(t, kind)  # noqa: E731
    elif callable(extract):
        extract_fn = extract
    else:
        raise ValueError(f"extract must be a kind string or a callable; got {type(extract).__name__}")

    if valid is not None:
        valid_np = np.asarray(valid)
        if valid_np.shape != (len(rows), n) or valid_np.dtype != np.bool_:
            raise ValueError(f"valid must be a bool array of shape {(len(rows), n)}; got {valid_np.dtype} {valid_np.shape}")
    else:
        valid_np = np.ones((len(rows), n), dtype=bool)

    answers: list[list[str | None]] = []
    ids = np.full((len(rows), n), -1, dtype=np.int32)
    vocab: list[list[str]] = []
    for b, row in enumerate(rows):
        seen: dict[str, int] = {}
        row_answers: list[str | None] = []
        for i, text in enumerate(row):
            ans = extract_fn(text) if valid_np[b, i] else None
            if ans is not None:
                ans = answers_lib.normalize(ans) or None
            if ans is not None:
                ids[b, i] = seen.setdefault(ans, len(seen))
            row_answers.append(ans)
        answers.append(row_answers)
        vocab.append(list(seen))

    if isinstance(weights, str):
        if weights != "mean_logprob":
            raise ValueError(f"weights must be None, 'mean_logprob' or a [B, N] array; got {weights!r}")
        if not hasattr(generation, "mean_logprob"):
            raise ValueError("weights='mean_logprob' needs a Generation (with logprobs), not bare texts")
        # float64, not `weights_from_mean_logprob`'s float32: exp(-110) is 0 in
        # float32 but ranks in float64 (majority_vote scales each row exactly).
        weights = np.exp(np.asarray(generation.mean_logprob(), dtype=np.float64))

    vote = jax.device_get(majority_vote(ids, ids >= 0, weights))
    winner = [vocab[b][int(w)] if w >= 0 else None for b, w in enumerate(vote.winner)]
    return SelfConsistency(
        answers=answers,
        answer_ids=ids,
        winner=winner,
        share=np.asarray(vote.share),
        support=np.asarray(vote.support),
        first_branch=np.asarray(vote.first_branch),
        vote=Vote(*(np.asarray(x) for x in vote)),
    )


# ----------------------------------------------------------------------------
# Selection signals: branch scores and confidence votes
# ----------------------------------------------------------------------------
#
# Token confidence C_t, per generated token, higher = more confident:
#   "signals" (`SamplingParams(signals=True)`, computed in the decode step):
#     the self-certainty KL(U || p_t) = -log V - mean_v log p_t(v) (Kang et al.
#     2025, arXiv 2502.18581). This is DeepConf's formula with k = V (the whole
#     real vocabulary) minus the constant log V: rankings, percentiles and
#     threshold tests are those of DeepConf's C at k = V exactly; as vote
#     weights it differs from C_{k=V} by that constant.
#   "top_logprobs" (`SamplingParams(logprobs=k)`): DeepConf's own C_t = minus
#     the mean of the k largest logprobs at t (Fu et al. 2025, arXiv 2508.15260;
#     facebookresearch/deepconf `compute_confidence`, k = 20 there).
# The two are different numbers (k = V weighs the whole tail of the
# distribution, k = 20 its head); both are >= 0 and grow as p_t concentrates.

SCORE_NAMES = ("mean_logprob", "sum_logprob", "self_certainty", "tail_confidence",
               "lowest_group_confidence", "bottom_group_confidence")
CONFIDENCE_SOURCES = ("signals", "top_logprobs")
DEEPCONF_WINDOW = 2048  # DeepConf's group size and tail length in tokens (its README)


def _canonical_score(name: Any) -> str:
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key == "bottom_10_group_confidence":
        key = "bottom_group_confidence"
    if key not in SCORE_NAMES:
        raise ValueError(f"score must be one of {SCORE_NAMES} (hyphens allowed), got {name!r}")
    return key


def token_confidence(gen: Any, source: str = "signals") -> np.ndarray:
    """Per-token confidence `[B, N, T]` float64 of a Generation (0 at padding).

    Args:
      gen: a `Generation`.
      source: "signals" (its `self_certainty`, from `SamplingParams(signals=True)`)
        or "top_logprobs" (DeepConf's minus the mean of the top-k logprobs,
        from `SamplingParams(logprobs=k)`, k >= 1). See the comment above
        `SCORE_NAMES` for how the two relate.
    Raises:
      ValueError: an unknown source, or the Generation was made without what
        it needs.
    """
    if source == "signals":
        if getattr(gen, "self_certainty", None) is None:
            raise ValueError("this Generation has no signals: sample with "
                             "SamplingParams(signals=True), or pass source='top_logprobs'")
        return np.asarray(gen.self_certainty, np.float64)
    if source == "top_logprobs":
        top = getattr(gen, "top_logprobs", None)
        if top is None or top.shape[-1] == 0:
            raise ValueError("this Generation has no top logprobs: sample with "
                             "SamplingParams(logprobs=20), or pass source='signals'")
        return -np.asarray(top, np.float64).mean(axis=-1)
    raise ValueError(f"source must be one of {CONFIDENCE_SOURCES}, got {source!r}")


def _group_means(c: np.ndarray, window: int) -> np.ndarray:
    """DeepConf's sliding-window means of one trace's `[L]` confidences (its
    `compute_least_grouped`: the mean of all tokens when L < window)."""
    if c.size < window:
        return c.mean(keepdims=True)
    s = np.concatenate([[0.0], np.cumsum(c)])
    return (s[window:] - s[:-window]) / window


def confidence_scores(conf: Any, lengths: Any, kind: str, *, window: int = DEEPCONF_WINDOW,
                      tail: int = DEEPCONF_WINDOW, bottom_percent: float = 10.0) -> np.ndarray:
    """Branch scores from per-token confidences, DeepConf's trace confidences.

    Fu et al. 2025 (arXiv 2508.15260), as facebookresearch/deepconf's
    `analysis_offline.py` computes them:

    * "mean": the mean over the trace's tokens (with C = self-certainty this
      is Kang et al.'s branch self-certainty, arXiv 2502.18581).
    * "tail": the mean over its last `tail` tokens (all, if fewer).
    * "lowest_group": the lowest mean over a sliding window of `window`
      tokens (one window of all tokens when the trace is shorter).
    * "bottom_group": the mean of the lowest `max(1, int(G * bottom_percent /
      100))` of its G window means (DeepConf's "bottom-10%").

    Args:
      conf: `[B, N, T]` per-token confidence (`token_confidence`).
      lengths: `[B, N]` int tokens per branch; the first lengths[b, n] count.
      kind: "mean", "tail", "lowest_group" or "bottom_group".
      window, tail: >= 1 tokens (DeepConf: 2048); bottom_percent in (0, 100].
    Returns:
      `[B, N]` float64, higher = more confident; NaN for an empty branch (it
      never wins `best_of_n`).
    Raises:
      ValueError: bad shapes, kind or sizes.
    """
    conf = np.asarray(conf, np.float64)
    lengths = np.asarray(lengths)
    if conf.ndim != 3 or lengths.shape != conf.shape[:2]:
        raise ValueError(f"conf must be [B, N, T] and lengths [B, N]; got {conf.shape} and "
                         f"{lengths.shape}")
    if kind not in ("mean", "tail", "lowest_group", "bottom_group"):
        raise ValueError(f"kind must be mean, tail, lowest_group or bottom_group; got {kind!r}")
    for name, v in (("window", window), ("tail", tail)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not 0 < float(bottom_percent) <= 100:
        raise ValueError(f"bottom_percent must be in (0, 100], got {bottom_percent!r}")
    out = np.full(conf.shape[:2], np.nan)
    for b in range(conf.shape[0]):
        for n in range(conf.shape[1]):
            L = int(lengths[b, n])
            if L <= 0:
                continue
            c = conf[b, n, :L]
            if kind == "mean":
                out[b, n] = c.mean()
            elif kind == "tail":
                out[b, n] = c[-tail:].mean()
            else:
                g = _group_means(c, window)
                if kind == "lowest_group":
                    out[b, n] = g.min()
                else:
                    k = max(1, int(len(g) * float(bottom_percent) / 100))
                    out[b, n] = np.sort(g)[:k].mean()
    return out


def branch_scores(gen: Any, score: str = "mean_logprob", *, source: str = "signals",
                  window: int = DEEPCONF_WINDOW, tail: int = DEEPCONF_WINDOW,
                  bottom_percent: float = 10.0) -> np.ndarray:
    """A named best-of-N score `[B, N]` of every branch of a Generation.

    Names (hyphens or underscores):

    * "mean_logprob", "sum_logprob": the sequence logprob, length-normalised
      or not (`score_mean_logprob`, `score_sum_logprob`; float32 as before).
    * "self_certainty": the branch's mean token self-certainty, KL(U || p)
      averaged over its tokens (Kang et al. 2025, arXiv 2502.18581, eq. 4);
      always from the signals.
    * "tail_confidence": DeepConf's tail confidence, the mean token confidence
      over the last `tail` tokens (Fu et al. 2025, arXiv 2508.15260).
    * "lowest_group_confidence": DeepConf's lowest group confidence, the
      lowest sliding-window (`window` tokens) mean.
    * "bottom_group_confidence" (also "bottom-10-group-confidence"):
      DeepConf's bottom-10% group confidence (`bottom_percent`).

    The DeepConf scores read the token confidence of `source` (see
    `token_confidence`). Empty branches score NaN (0 for the logprob scores).

    Raises:
      ValueError: an unknown name, or the Generation lacks its signals /
        top logprobs.
    """
    score = _canonical_score(score)
    if score == "mean_logprob":
        return score_mean_logprob(gen)
    if score == "sum_logprob":
        return score_sum_logprob(gen)
    if score == "self_certainty":
        conf, kind = token_confidence(gen, "signals"), "mean"
    else:
        conf = token_confidence(gen, source)
        kind = {"tail_confidence": "tail", "lowest_group_confidence": "lowest_group",
                "bottom_group_confidence": "bottom_group"}[score]
    return confidence_scores(conf, gen.lengths, kind, window=window, tail=tail,
                             bottom_percent=bottom_percent)


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
    answer_ids = _check_2d("answer_ids", answer_ids)
    if not jnp.issubdtype(answer_ids.dtype, jnp.integer):
        raise ValueError(f"answer_ids must be an int array; got dtype {answer_ids.dtype}")
    confidence = _check_like("confidence", confidence, answer_ids.shape, "answer_ids")
    _check_real("confidence", confidence)
    valid = _check_valid(valid, answer_ids.shape, "answer_ids")
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
    if isinstance(conf, np.ndarray) and not _fits_32(conf):
        conf = _exact_ranks(conf)  # float64: rank exactly on the host (ties kept)
    return _borda_vote(jnp.asarray(answer_ids).astype(jnp.int32), jnp.asarray(conf, jnp.float32),
                       jnp.asarray(valid), jnp.float32(power))
