"""Best-of-N: the branch with the highest score, and the scores by name.

`best_of_n` takes a score `[B, N]` (any external reward or verifier score)
or a score's name on a `Generation` (`branch_scores`: sum or mean logprob,
mean self-certainty, DeepConf's tail, lowest-group and bottom-10% group
confidence, arXiv 2508.15260). Conventions: `jaxsample.reduce`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.reduce.arrays import check_2d, check_real, check_valid, exact_ranks, fits_32


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
    scores = check_2d("scores", scores)
    check_real("scores", scores)
    valid = check_valid(valid, scores.shape, "scores")
    if isinstance(scores, np.ndarray):
        if not fits_32(scores):
            scores = exact_ranks(scores)
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
      or not (`score_mean_logprob`, `score_sum_logprob`; float32).
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
