"""Stopping rules of adaptive self-consistency and DeepConf's confidence, on the host.

Pure functions of the answers drawn so far (in branch order), so the online
run (`jaxsample.adaptive_self_consistency`) and the offline rule applied to a
fixed pool (`replay`) share one implementation: an adaptive run equals the
offline rule on `generate(n=max_n)` with the same seed, branch for branch.

Rules (checked after every window of branches):

* "esc" - Early-Stopping Self-Consistency (Li et al. 2024, arXiv 2401.10480):
  stop when the latest window's valid answers are unanimous (at least one
  valid answer; invalid answers, None, are ignored; a window without a valid
  answer never stops).
* "beta" - Adaptive-Consistency (Aggarwal et al. 2023, arXiv 2305.11860):
  with v1 >= v2 the counts of the two most frequent valid answers, stop when
  P(p1 > p2) >= threshold under p1 / (p1 + p2) ~ Beta(v1 + 1, v2 + 1) (their
  "Beta" criterion; exact for integer counts: P(Beta(a, b) > 1/2) =
  P(Binomial(a + b - 1, 1/2) <= a - 1)).
* "dirichlet" - Adaptive-Consistency's Dirichlet criterion: stop when the
  leading answer's probability is the largest with posterior probability >=
  threshold under Dirichlet(counts + 1) over the answers seen (computed by
  quadrature over the Gamma representation, no Monte Carlo).
* "none" - never stop early: all `max_n` branches.

Every rule also stops at `max_n`. Counts are plain counts of the valid,
non-terminated answers; the final vote may be weighted (DeepConf).

DeepConf (Fu et al. 2025, arXiv 2508.15260): token confidence C_t = minus the
mean of the k top logprobs at position t; group confidence = the mean of C
over a sliding window of `group_size` tokens; a trace's lowest group
confidence (the mean over all its tokens when it is shorter than the window)
weights its vote. The first `warmup` branches of a prompt set the threshold
at the 90th ("deepconf-low": keep the top 10%) or 10th ("deepconf-high": keep
the top 90%) percentile of their lowest group confidences; a later branch is
terminated when a complete group falls below it, and terminated branches do
not vote.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from fractions import Fraction
from typing import Hashable, Sequence

import numpy as np

RULES = ("esc", "beta", "dirichlet", "none")
CONFIDENCES = (None, "deepconf-low", "deepconf-high")
CONFIDENCE_SOURCES = ("top_logprobs", "signals")
_PERCENTILE = {"deepconf-low": 90.0, "deepconf-high": 10.0}


# ---------------------------------------------------------------------------
# Posterior probabilities


def beta_leader_probability(v1: int, v2: int) -> float:
    """P(p1 > p2) with p1 / (p1 + p2) ~ Beta(v1 + 1, v2 + 1), exactly.

    For integer a = v1 + 1, b = v2 + 1: P(X > 1/2) = P(Binomial(a + b - 1, 1/2) <= a - 1).
    """
    if v1 < 0 or v2 < 0:
        raise ValueError(f"counts must be >= 0, got {v1}, {v2}")
    n = v1 + v2 + 1
    total = sum(math.comb(n, j) for j in range(v1 + 1))
    return float(Fraction(total, 2**n))


def dirichlet_leader_probability(counts: Sequence[int], points: int = 8193) -> float:
    """P(p_0 = max_i p_i) under Dirichlet(counts + 1); counts[0] is the leader's.

    p ~ Dirichlet(alpha) is G / sum(G) with independent G_i ~ Gamma(alpha_i), so
    P(p_0 is the largest) = integral of f_0(x) * prod_{i>0} F_i(x) dx, where f
    and F are Gamma densities and CDFs; for integer shapes F_i(x) = 1 -
    e^-x sum_{j < alpha_i} x^j / j!. Integrated with the trapezoid rule over
    [0, mean + 12 sd + 20] of G_0 (within 1e-5 of the exact Beta value for two
    answers; see tests/reduce/test_adaptive.py).
    """
    counts = [int(c) for c in counts]
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"counts must be a non-empty sequence of ints >= 0, got {counts}")
    if len(counts) == 1:
        return 1.0
    a0 = counts[0] + 1
    hi = a0 + 12 * math.sqrt(a0) + 20
    x = np.linspace(0.0, hi, points)
    with np.errstate(divide="ignore"):
        logx = np.log(x)  # -inf at 0: x^(a-1) -> 0 there, or 1 when a = 1
    logf0 = (0.0 if a0 == 1 else (a0 - 1) * logx) - x - math.lgamma(a0)
    log_prod = np.zeros_like(x)
    for c in counts[1:]:
        a = c + 1
        # log of the upper tail e^-x sum_{j<a} x^j / j!, then F = 1 - tail.
        j = np.arange(a)[:, None]
        with np.errstate(invalid="ignore"):
            jlogx = np.where(j == 0, 0.0, j * logx[None])
        log_terms = jlogx - x[None] - np.array([math.lgamma(i + 1) for i in range(a)])[:, None]
        m = log_terms.max(axis=0)
        tail = np.exp(m) * np.exp(log_terms - m).sum(axis=0)
        log_prod += np.log(np.clip(1.0 - tail, 1e-300, 1.0))
    y = np.exp(logf0 + log_prod)
    return float(min(max(np.trapezoid(y, x), 0.0), 1.0))


# ---------------------------------------------------------------------------
# Rules


def _counts(answers: Sequence[Hashable | None]) -> list[tuple[Hashable, int]]:
    """(answer, count) of the valid answers, most frequent first, ties to the first seen."""
    c = collections.Counter(a for a in answers if a is not None)
    first = {}
    for i, a in enumerate(answers):
        if a is not None:
            first.setdefault(a, i)
    return sorted(c.items(), key=lambda kv: (-kv[1], first[kv[0]]))


def should_stop(rule: str, answers: Sequence[Hashable | None], window: int,
                threshold: float = 0.95) -> bool:
    """Whether `rule` stops after `answers` (all answers drawn so far, branch order).

    Args:
      rule: one of RULES.
      answers: the counted answers so far (None: invalid or terminated).
      window: the window size (ESC looks at the last `window` answers).
      threshold: the posterior probability to reach ("beta", "dirichlet").
    Raises:
      ValueError: an unknown rule.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "none":
        return False
    if rule == "esc":
        last = [a for a in answers[-window:] if a is not None]
        return bool(last) and len(set(last)) == 1
    counts = [c for _, c in _counts(answers)]
    if not counts:
        return False
    if rule == "beta":
        return beta_leader_probability(counts[0], counts[1] if len(counts) > 1 else 0) >= threshold
    return dirichlet_leader_probability(counts) >= threshold


def tally(answers: Sequence[Hashable | None], weights: Sequence[float] | None = None):
    """(winner or None, support, share) of a vote: ties to the answer seen first.

    `support` is the winner's vote weight (its branch count without
    `weights`, the sum of its branches' weights with them, as
    `jaxsample.majority_vote`'s `Vote.support`); `share` is support / the
    total weight of the answering branches (1 / number of answers when that
    total is 0); (None, 0.0, 0.0) when no branch answered. The same rule as
    `jaxsample.majority_vote` (Counter.most_common order).
    """
    w = [1.0] * len(answers) if weights is None else [float(x) for x in weights]
    total = collections.defaultdict(float)
    first = {}
    for i, (a, x) in enumerate(zip(answers, w)):
        if a is not None:
            total[a] += x
            first.setdefault(a, i)
    if not total:
        return None, 0.0, 0.0
    winner = min(total, key=lambda a: (-total[a], first[a]))
    s = sum(total.values())
    return winner, total[winner], (total[winner] / s if s > 0 else 1.0 / len(total))


def vote(answers: Sequence[Hashable | None], weights: Sequence[float] | None = None):
    """(winner or None, share of the valid weight): `tally` without the support."""
    winner, _, share = tally(answers, weights)
    return winner, share


# ---------------------------------------------------------------------------
# DeepConf


def token_confidence(top_logprobs: np.ndarray) -> np.ndarray:
    """`[..., T, k]` top-k logprobs -> `[..., T]` C_t = -mean_j logprob_j (>= 0)."""
    return -np.asarray(top_logprobs, np.float64).mean(axis=-1)


def token_confidence_from_signals(self_certainty: np.ndarray) -> np.ndarray:
    """`[..., T]` self-certainty (`SamplingParams(signals=True)`) -> `[..., T]` float64
    token confidence for DeepConf's rules, computed on the device without top-k.

    Self-certainty is KL(U || p_t) = -log V - mean_v log p_t(v) (arXiv
    2502.18581): DeepConf's C_t = -mean of the top-k logprobs with k = V (the
    whole real vocabulary), minus the constant log V. The constant changes
    no percentile threshold and no "group < threshold" test, so the
    terminations are exactly DeepConf's at k = V; the lowest group
    confidences used as vote weights are C_{k=V} - log V (>= 0). It is not
    C_{k=20}: k = V averages the logprobs of the whole tail, k = 20 of the
    head; both rise as the distribution concentrates, their rankings of
    traces differ (benchmarks/selection.py compares the two).
    """
    return np.asarray(self_certainty, np.float64)


def group_confidences(conf: np.ndarray, group_size: int) -> np.ndarray:
    """`[L]` token confidences -> `[max(L - g + 1, 1)]` sliding-window means
    (one mean over all tokens when L < g; empty for L = 0)."""
    conf = np.asarray(conf, np.float64)
    if conf.size == 0:
        return conf
    if conf.size < group_size:
        return conf.mean(keepdims=True)
    c = np.concatenate([[0.0], np.cumsum(conf)])
    return (c[group_size:] - c[:-group_size]) / group_size


def lowest_group_confidence(conf: np.ndarray, group_size: int) -> float:
    """A trace's lowest group confidence (its vote weight); nan for an empty trace."""
    g = group_confidences(conf, group_size)
    return float(g.min()) if g.size else math.nan


def threshold_from_warmup(lowest: Sequence[float], confidence: str) -> float:
    """DeepConf's threshold: the 90th (-low) or 10th (-high) percentile of the warm-up
    traces' lowest group confidences (numpy's linear interpolation)."""
    vals = [x for x in lowest if not math.isnan(x)]
    if not vals:
        return -math.inf  # nothing to calibrate on: terminate nothing
    return float(np.percentile(vals, _PERCENTILE[confidence]))


def first_low_group(conf: np.ndarray, group_size: int, threshold: float) -> int | None:
    """Number of tokens after which the first complete group falls below the
    threshold (a group ending at token i, 1-based), or None."""
    conf = np.asarray(conf, np.float64)
    if conf.size < group_size:
        return None
    g = group_confidences(conf, group_size)
    low = np.nonzero(g < threshold)[0]
    return int(low[0]) + group_size if low.size else None


# ---------------------------------------------------------------------------
# The offline rule on a fixed pool


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the adaptive rule decides for one prompt (see `replay`)."""

    n_used: int
    winner: Hashable | None
    share: float
    counted: list[bool]  # [n_used] branch votes (valid and not terminated)
    terminated: list[bool]  # [n_used]


def replay(answers: Sequence[Hashable | None], *, max_n: int, window: int, rule: str,
           threshold: float = 0.95, weights: Sequence[float] | None = None,
           terminated: Sequence[bool] | None = None, warmup: int = 0) -> Replay:
    """The adaptive rule applied in branch order to a fixed pool of one prompt.

    Args:
      answers: `[>= max_n]` each branch's answer (None: invalid).
      max_n, window, rule, threshold: as `adaptive_self_consistency`.
      weights: each branch's vote weight (DeepConf: its lowest group
        confidence), or None for counting.
      terminated: each branch's DeepConf termination (`first_low_group` is not
        None for branches >= warmup), or None.
      warmup: no stop check before this many branches (DeepConf's warm-up);
        rounds of `window` still apply.
    Returns:
      A `Replay`: branches used, winner, its share, which branches voted.
    """
    if len(answers) < max_n:
        raise ValueError(f"the pool has {len(answers)} answers, fewer than max_n={max_n}")
    term = [bool(terminated[i]) if terminated is not None else False for i in range(max_n)]
    n = 0
    while True:
        n = min(n + window, max_n)
        counted = [answers[i] is not None and not term[i] for i in range(n)]
        votes = [answers[i] if counted[i] else None for i in range(n)]
        if n >= max_n or (n >= warmup and should_stop(rule, votes, window, threshold)):
            break
    w = None if weights is None else [weights[i] if counted[i] else 0.0 for i in range(n)]
    winner, share = vote(votes, w)
    return Replay(n, winner, share, counted, term[:n])
