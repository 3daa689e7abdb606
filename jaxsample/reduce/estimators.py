"""Exact estimators of pass@k, maj@k and best-of-k from a pool of n samples.

Draw n >= k samples per problem once, then estimate the accuracy a method
would have with k samples as the *exact* expectation over all C(n, k)
k-subsets of the pool, drawn uniformly: combinatorics, no Monte Carlo.

* `pass_at_k`: Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", arXiv 2107.03374), the unbiased estimator 1 - C(n-c, k) / C(n, k).
* `best_of_k`: the chance that a random k-subset's best-scored sample (ties
  to the lowest pool index, as `jaxsample.reduce.best_of_n`) is correct.
* `maj_at_k`: the chance that a random k-subset's majority vote (as
  `jaxsample.reduce.majority_vote`) is correct; the self-consistency curve of Wang
  et al. 2022 (arXiv 2203.11171) without resampling noise.

All three work in Python integers, fractions or ratios in [0, 1], so nothing
overflows at n = 2000 (C(2000, 1000) has 600 digits). Host-side numpy; these
are evaluation tools, not part of the jitted sampler.
"""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from typing import Any, Hashable, Sequence

import numpy as np

__all__ = ["pass_at_k", "best_of_k", "maj_at_k"]


def _as_int_array(name: str, x: Any) -> np.ndarray:
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be an integer or integer array; got {type(x).__name__} ({e})") from None
    if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise ValueError(f"{name} must be integer-valued (ints in the int64 range); got dtype {a.dtype}")
    if np.issubdtype(a.dtype, np.floating):
        # Whole floats up to 2**53 are exact integers; beyond, or non-finite, they are refused
        # (checked before any cast, so no RuntimeWarning).
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(a) | (np.abs(a) > 2.0**53)
            bad |= np.where(bad, False, a != np.floor(np.where(bad, 0.0, a)))
        if np.any(bad):
            raise ValueError(f"{name} must be integer-valued: whole numbers with |x| <= 2**53 "
                             f"(pass Python ints for larger); got {x!r}")
        a = a.astype(np.int64)
    return a


def pass_at_k(n: Any, c: Any, k: Any) -> np.ndarray | np.float64:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021).

    pass@k = 1 - C(n-c, k) / C(n, k), the probability that a uniformly random
    k-subset of the n samples holds at least one correct one. The ratio is
    the paper's product form, taken in the shorter of its two equivalent
    orders: `C(n-c, k) / C(n, k) = prod_{j<m} (1 - a / (n - j))` with
    m = min(c, k), a = max(c, k) (the paper's reference code,
    `prod_{i=n-c+1}^{n} (1 - k / i)`, is the m = c order). So the cost is
    O(min(c, k)), never an array of length c or n: n = 2**60 with c = 2**59
    takes microseconds. How it is evaluated:

    * while the two products have at most 2**18 bits, exactly in Python
      integers, then rounded once: the correctly rounded float64 (this
      covers n <= 2000 with any c, k);
    * otherwise the factors' logs are summed (`-expm1` of the sum; relative
      error ~1e-15, also when pass@k is tiny), beyond 65536 factors by the
      Euler-Maclaurin closed form of the sum (O(1));
    * exactly 0.0 when c = 0, and 1.0 when n - c < k or when the ratio is
      below 2**-54 (a * m >= 40 n, where 1 - ratio rounds to 1.0).

    Inputs broadcast like numpy arrays.

    Args:
      n: int or int array, samples drawn per problem (n >= k).
      c: int or int array, correct samples among them (0 <= c <= n).
      k: int or int array, the budget being estimated (1 <= k <= n).

    Returns:
      float64 array of the broadcast shape (a numpy scalar for scalar inputs),
      in [0, 1]; exactly 1.0 when n - c < k, exactly 0.0 when c = 0.

    Raises:
      ValueError: non-integer or negative inputs, k < 1, c > n, k > n, or
        shapes that do not broadcast.
    """
    n_a, c_a, k_a = (_as_int_array(name, v) for name, v in (("n", n), ("c", c), ("k", k)))
    try:
        n_a, c_a, k_a = np.broadcast_arrays(n_a, c_a, k_a)
    except ValueError as e:
        raise ValueError(f"n, c and k must broadcast together: {e}") from None
    if np.any(n_a < 0) or np.any(c_a < 0):
        raise ValueError(f"n and c must be non-negative; got n={n!r}, c={c!r}")
    if np.any(k_a < 1):
        raise ValueError(f"k must be >= 1; got k={k!r}")
    if np.any(c_a > n_a):
        raise ValueError(f"c (correct samples) must be <= n (samples); got c={c!r}, n={n!r}")
    if np.any(k_a > n_a):
        raise ValueError(f"k must be <= n: pass@k needs at least k samples; got k={k!r}, n={n!r}")
    out = np.empty(n_a.shape, dtype=np.float64)
    for idx in np.ndindex(n_a.shape):
        out[idx] = _pass_at_k_one(int(n_a[idx]), int(c_a[idx]), int(k_a[idx]))
    return out[()] if out.ndim == 0 else out


# While the two products have at most this many bits, pass@k is computed
# exactly in integers and rounded once (correctly rounded, a few ms at most).
_EXACT_BITS = 1 << 18
# Up to this many factors the product is summed term by term (in log space);
# beyond, a closed form (Euler-Maclaurin) gives the same sum in O(1).
_DIRECT_TERMS = 1 << 16
# Once a * m >= _UNDERFLOW * n, C(n-a, m) / C(n, m) <= exp(-a m / n) < 2**-54
# and 1 - it rounds to exactly 1.0 in float64.
_UNDERFLOW = 40


def _pass_at_k_one(n: int, c: int, k: int) -> float:
    """pass@k = 1 - C(n-c, k) / C(n, k) for one problem (Python ints, validated).

    The ratio is symmetric, C(n-c, k) / C(n, k) = C(n-k, c) / C(n, c) =
    prod_{j<m} (n - a - j) / (n - j) with a = max(c, k) and m = min(c, k),
    so only m <= k factors are needed (never an array of length c or n).
    While the two products are small (`_EXACT_BITS`) they are formed exactly
    (`math.perm`) and 1 - ratio is rounded once: the correctly rounded
    float64. Otherwise the factors' logs are summed, log1p(-a/(n-j)) or
    log((n-a-j)/(n-j)), whichever is accurate, and pass@k = -expm1(sum)
    (relative error ~1e-15, no cancellation when pass@k is tiny); for
    m > `_DIRECT_TERMS` (then a/n and m/n are below 1e-3, or the result is
    1.0 outright) the sum is the Euler-Maclaurin closed form, O(1)."""
    if n - c < k:
        return 1.0
    if c == 0:
        return 0.0
    a, m = max(c, k), min(c, k)
    if a * m >= _UNDERFLOW * n:
        return 1.0
    if m * n.bit_length() <= _EXACT_BITS:
        den = math.perm(n, m)
        return (den - math.perm(n - a, m)) / den  # int / int: correctly rounded
    log_ratio = _log_ratio_direct(n, a, m) if m <= _DIRECT_TERMS else _log_ratio_closed(n, a, m)
    return float(min(1.0, max(0.0, -math.expm1(log_ratio))))


def _log_ratio_direct(n: int, a: int, m: int) -> float:
    """sum_{j<m} log(1 - a / (n - j)) term by term (float64, relative error ~1e-16 per term)."""
    j = np.arange(m, dtype=np.float64)
    den = float(n) - j
    x = a / den
    r = (float(n - a) - j) / den  # 1 - x, computed without cancellation
    return float(np.sum(np.where(x <= 0.5, np.log1p(-x), np.log(r))))


def _log_ratio_closed(n: int, a: int, m: int) -> float:
    """sum_{j<m} f(j), f(t) = log(1 - a/(n-t)), by Euler-Maclaurin, for a/n, m/n << 1.

    sum = I + (f(0) - f(m))/2 + (f'(m) - f'(0))/12 + O(a m / n^4), with
    I = integral_0^m f = a log(1 - m/n) - a sum_{q>=1} (a/n)^q
    expm1(-q log(1 - m/n)) / (q (q+1)), a series without cancellation
    that converges like (a/n)^q."""
    x, l1v = a / n, math.log1p(-m / n)
    integral = a * l1v
    q, xq = 1, x
    while q <= 200:
        term = a * xq * math.expm1(-q * l1v) / (q * (q + 1))
        integral -= term
        if abs(term) <= 1e-18 * abs(integral):
            break
        q, xq = q + 1, xq * x

    def d1(t: int) -> float:  # f'(t)
        return -a / ((n - t) * (n - t - a))

    edge = (math.log1p(-a / n) - math.log1p(-a / (n - m))) / 2
    return integral + edge + (d1(m) - d1(0)) / 12


def _check_k(k: Any, n: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an int; got {k!r}")
    k = int(k)
    if not 1 <= k <= n:
        raise ValueError(f"k must satisfy 1 <= k <= n (pool size {n}); got k={k}")
    return k


def best_of_k(scores_pool: Any, correct: Any, k: int, valid: Any = None) -> float:
    """Exact expected accuracy of best-of-k over random k-subsets of a pool.

    The pool is ranked by score, ties to the lower pool index (the subset is
    kept in pool order, so this is exactly `jaxsample.reduce.best_of_n` on the
    subset: ties to the lowest branch index). The sample ranked i-th (i = 0
    the best) is the subset's winner iff it is drawn and none of the i ranked
    above it are: probability C(n-1-i, k-1) / C(n, k). NaN-scored and
    invalid samples never win; a subset holding only such samples has no
    winner and counts as wrong. The probabilities are built as running
    ratios (p_0 = k/n, p_{i+1} = p_i (n-k-i) / (n-1-i)), so no binomial is
    formed and n = 2000 is fine.

    Args:
      scores_pool: `[n]` float scores of the pool's samples (higher is better).
      correct: `[n]` bool, whether each sample is correct.
      k: the budget, 1 <= k <= n.
      valid: `[n]` bool or None (all valid).

    Returns:
      The expected accuracy in [0, 1] (float).

    Raises:
      ValueError: shapes that are not `[n]` and equal, n = 0, or k outside [1, n].
    """
    try:
        scores = np.asarray(scores_pool, dtype=np.float64)
    except (ValueError, TypeError) as e:
        raise ValueError(f"scores_pool must be a numeric array of shape [n]; got {type(scores_pool).__name__} "
                         f"({e})") from None
    if scores.ndim != 1 or scores.shape[0] == 0:
        raise ValueError(f"scores_pool must have shape [n] with n >= 1; got shape {scores.shape}")
    n = scores.shape[0]
    corr = np.asarray(correct)
    if corr.shape != (n,) or corr.dtype != np.bool_:
        raise ValueError(f"correct must be a bool array of shape [{n}]; got {corr.dtype} {corr.shape}")
    ok = ~np.isnan(scores)
    if valid is not None:
        val = np.asarray(valid)
        if val.shape != (n,) or val.dtype != np.bool_:
            raise ValueError(f"valid must be a bool array of shape [{n}]; got {val.dtype} {val.shape}")
        ok &= val
    k = _check_k(k, n)
    idx = np.flatnonzero(ok)
    order = idx[np.lexsort((idx, -scores[idx]))]  # best first; equal scores: lower index first
    i = np.arange(len(order), dtype=np.float64)
    ratios = np.maximum(n - k - i[:-1], 0.0) / (n - 1 - i[:-1]) if len(order) > 1 else np.zeros(0)
    p = (k / n) * np.concatenate([[1.0], np.cumprod(ratios)])
    return float(np.sum(p[corr[order]]))


def _binom_row(m: int, upto: int) -> list[int]:
    """[C(m, 0), ..., C(m, upto)] as Python ints."""
    row = [1] * (upto + 1)
    for j in range(1, upto + 1):
        row[j] = row[j - 1] * (m - j + 1) // j if j <= m else 0
    return row


def _poly_mul(p: list[int], q: list[int], deg: int) -> list[int]:
    out = [0] * (deg + 1)
    for i, a in enumerate(p):
        if a:
            for j, b in enumerate(q[: deg + 1 - i]):
                if b:
                    out[i + j] += a * b
    return out


def _maj_random(sizes: list[int], r: int, free: int, k: int) -> Fraction:
    """Subsets (summed with weight 1/(tied answers)) where the correct answer wins a random tie-break.

    Condition on m, the correct answer's count in the subset. Every other
    answer of pool size s contributes `sum_{j<m} C(s, j) x^j + y C(s, m) x^m`
    (x counts drawn samples, y counts answers tied at m); an answer with
    s < m contributes `(1 + x)^s`, so all of those and the `free` no-answer
    samples collapse into one binomial. The coefficient of x^(k-m) y^t counts
    subsets where t others tie; the correct answer then wins with
    probability 1/(t+1).
    """
    total = Fraction(0)
    for m in range(1, min(k, r) + 1):
        rem = k - m
        big = [s for s in sizes if s >= m]
        small = free + sum(s for s in sizes if s < m)
        tmax = rem // m
        q = np.zeros((rem + 1, tmax + 1), dtype=object)
        q[0, 0] = 1
        for s in big:
            row = _binom_row(s, min(m, rem))
            new = q * 1
            for j in range(1, min(m - 1, rem) + 1):
                new[j:, :] += q[: rem + 1 - j, :] * row[j]
            if m <= rem and tmax >= 1:
                new[m:, 1:] += q[: rem + 1 - m, :-1] * row[m]
            q = new
        tail = _binom_row(small, rem)[::-1]  # tail[d] = C(small, rem - d)
        ways = Fraction(0)
        for t in range(tmax + 1):
            cnt = sum(int(q[d, t]) * tail[d] for d in range(rem + 1))
            if cnt:
                ways += Fraction(cnt, t + 1)
        total += math.comb(r, m) * ways
    return total


def _maj_first(labels: list[int], k: int) -> Fraction:
    """Subsets where the correct answer (label 0) wins the first-occurrence tie-break.

    Condition on the first drawn correct sample (pool position p, the t-th
    correct one) and the correct count m. Another answer with b samples
    before p and f after may be drawn j < m times freely, or exactly m times
    only from its f samples after p (it then ties but occurs later);
    answers with fewer than m samples and no-answer samples (label -1) are
    unconstrained and collapse into one binomial.
    """
    n = len(labels)
    r = labels.count(0)
    others = sorted({a for a in labels if a > 0})
    size = Counter(a for a in labels if a > 0)
    free = labels.count(-1)
    before = Counter()
    total = 0
    t = 0
    for p in range(n):
        a = labels[p]
        if a != 0:
            if a > 0:
                before[a] += 1
            continue
        after_correct = r - t - 1
        for m in range(1, min(k, r - t) + 1):
            rem = k - m
            poly = [1] + [0] * rem
            small = free
            for o in others:
                s = size[o]
                if s < m:
                    small += s
                    continue
                row = _binom_row(s, min(m - 1, rem))[: min(m - 1, rem) + 1]
                if m <= rem:
                    row = row + [0] * (m - len(row)) + [math.comb(s - before[o], m)]
                poly = _poly_mul(poly, row, rem)
            tail = _binom_row(small, rem)
            cnt = sum(poly[d] * tail[rem - d] for d in range(rem + 1))
            total += math.comb(after_correct, m - 1) * cnt
        t += 1
    return Fraction(total)


def maj_at_k(
    answers_pool: Sequence[Hashable | None],
    correct: Hashable,
    k: int,
    tie: str = "first",
    exact: bool = False,
) -> float | Fraction:
    """Exact expected accuracy of majority voting over random k-subsets of a pool.

    maj@k: draw k of the n pooled answers uniformly without replacement,
    take the majority vote (None answers are excluded, as invalid branches
    are by `jaxsample.reduce.majority_vote`), and score 1 if the winner equals
    `correct`. This returns the exact expectation over all C(n, k) subsets,
    by dynamic programming over per-answer counts in Python integers
    (no Monte Carlo, no overflow). A subset with no valid answer scores 0.

    Tie conventions (answers tied for the most votes):

    * "first" (default): the tied answer whose first occurrence has the
      lowest pool index wins; the subset is voted in pool order, so this is
      exactly `majority_vote` on the subset (`Counter.most_common`), and
      with k = n it reproduces the full-pool vote. Cost grows like
      r * k^2 * (answers with >= m samples) * k for r correct samples:
      seconds on CPU at k = 64 for n in the hundreds to thousands.
    * "random": a uniformly random tied answer wins. For exchangeable samples
      (i.i.d. draws from the model) this equals the first-occurrence rule in
      *generation* order, so it is the order-free estimator of the sampler's
      maj@k; it does not depend on how the pool happens to be ordered.
      About 0.05-0.5 s at n = 2000, k = 64; slow for k in the hundreds
      (45 s at n = 2000, k = 1000).

    Both agree whenever no tie involving the correct answer can occur.

    Args:
      answers_pool: n answers (hashable, e.g. normalised strings or ints),
        None for a sample without an answer.
      correct: the reference answer (compared with `==` to pool answers).
      k: the budget, 1 <= k <= n.
      tie: "first" or "random".
      exact: return the exact `fractions.Fraction` instead of a float.

    Returns:
      The expected accuracy in [0, 1] (float, or Fraction when `exact`).

    Raises:
      ValueError: an empty pool, k outside [1, n], `correct` is None, or an
        unknown `tie`.
    """
    pool = list(answers_pool)
    n = len(pool)
    if n == 0:
        raise ValueError("answers_pool must hold at least one answer (n >= 1)")
    k = _check_k(k, n)
    if correct is None:
        raise ValueError("correct must be the reference answer, not None")
    if tie not in ("first", "random"):
        raise ValueError(f"tie must be 'first' or 'random'; got {tie!r}")
    ids: dict[Hashable, int] = {correct: 0}
    labels = [-1 if a is None else ids.setdefault(a, len(ids)) for a in pool]
    r = labels.count(0)
    if r == 0:
        result = Fraction(0)
    elif tie == "random":
        sizes = list(Counter(a for a in labels if a > 0).values())
        result = _maj_random(sizes, r, labels.count(-1), k) / math.comb(n, k)
    else:
        result = _maj_first(labels, k) / math.comb(n, k)
    return result if exact else float(result)
