"""pass@k, best-of-k and maj@k against exact fractions and brute-force enumeration."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from helpers import load_cases
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsample import reduce as reducers
from jaxsample.reduce import estimators

# The hand-written cases, tests/data/cases/answers.json "pass_at_k".
PASS_AT_K_CASES = load_cases("answers")["pass_at_k"]


def _check_pass_case(case):
    if "error" in case:
        with pytest.raises(ValueError):
            estimators.pass_at_k(case["n"], case["c"], case["k"])
    else:
        assert estimators.pass_at_k(case["n"], case["c"], case["k"]) == pytest.approx(case["value"], abs=1e-12)


@pytest.mark.parametrize("case", PASS_AT_K_CASES)
def test_pass_at_k_handed_cases(case):
    _check_pass_case(case)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_exact_binomial(nck):
    n, c, k = nck
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert estimators.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-12)


def test_pass_at_k_broadcast_and_large_n():
    got = estimators.pass_at_k(np.array([[2000], [1500]]), np.array([1, 10, 1000]), 64)
    assert got.shape == (2, 3)
    exact = 1 - Fraction(math.comb(2000 - 10, 64), math.comb(2000, 64))
    assert got[0, 1] == pytest.approx(float(exact), rel=1e-12)
    assert got[0, 2] == pytest.approx(1 - float(Fraction(math.comb(1000, 64), math.comb(2000, 64))), rel=1e-12)
    assert np.all(np.isfinite(got)) and np.all((0 <= got) & (got <= 1))
    assert isinstance(estimators.pass_at_k(2000, 3, 1000), np.floating)


def test_pass_at_k_broadcast_rejects_c_above_n_anywhere():
    with pytest.raises(ValueError, match="c .* <= n"):
        estimators.pass_at_k(np.array([2000, 100]), 1000, 64)


@pytest.mark.parametrize("n,c,k,match", [
    (5, 2, 6, "k must be <= n"), (5, 6, 1, "c .* <= n"), (5, -1, 1, "non-negative"),
    (-5, 0, 1, "non-negative"), (5, 1, 0, "k must be >= 1"), (5.5, 1, 1, "integer"), (True, 0, 1, "integer"),
])
def test_pass_at_k_errors(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        estimators.pass_at_k(n, c, k)


# ----------------------------------------------------------------------------
# best-of-k
# ----------------------------------------------------------------------------


def brute_best_of_k(scores, correct, k, valid):
    n = len(scores)
    hits = 0
    for subset in itertools.combinations(range(n), k):
        s = np.array([[scores[i] for i in subset]], np.float32)
        v = np.array([[valid[i] for i in subset]])
        winner = int(reducers.best_of_n(s, v)[0]) if len(subset) else -1
        hits += winner >= 0 and bool(correct[subset[winner]])
    return Fraction(hits, math.comb(n, k))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0, 2.0, np.nan]), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n),
    st.integers(1, n))))
def test_best_of_k_matches_brute_force(args):
    scores, correct, valid, k = args
    got = estimators.best_of_k(np.array(scores), np.array(correct), k, valid=np.array(valid))
    assert got == pytest.approx(float(brute_best_of_k(scores, correct, k, valid)), abs=1e-12)


def test_best_of_k_edges_and_large_n():
    rng = np.random.default_rng(0)
    scores, correct = rng.normal(size=2000), rng.random(2000) < 0.3
    assert estimators.best_of_k(scores, correct, 1) == pytest.approx(correct.mean())
    assert estimators.best_of_k(scores, correct, 2000) == float(correct[np.argmax(scores)])
    v = estimators.best_of_k(scores, correct, 64)
    assert 0 <= v <= 1 and np.isfinite(v)
    # Exact reference for the best-ranked sample's weight, C(n-1, k-1)/C(n, k) = k/n.
    order = np.argsort(-scores, kind="stable")
    one = np.zeros(2000, bool)
    one[order[5]] = True
    assert estimators.best_of_k(scores, one, 64) == pytest.approx(
        float(Fraction(math.comb(2000 - 1 - 5, 63), math.comb(2000, 64))), rel=1e-10)
    with pytest.raises(ValueError, match="k must satisfy"):
        estimators.best_of_k(scores, correct, 2001)
    with pytest.raises(ValueError, match="correct must be"):
        estimators.best_of_k(scores, correct[:5], 3)


# ----------------------------------------------------------------------------
# maj@k
# ----------------------------------------------------------------------------


def brute_maj_at_k(pool, correct, k, tie):
    n = len(pool)
    total = Fraction(0)
    for subset in itertools.combinations(range(n), k):
        votes = [pool[i] for i in subset if pool[i] is not None]
        if not votes:
            continue
        counts = Counter(votes)
        top = max(counts.values())
        tied = [a for a in counts if counts[a] == top]
        if tie == "first":
            total += Counter(votes).most_common(1)[0][0] == correct
        else:
            total += Fraction(int(correct in tied), len(tied))
    return total / math.comb(n, k)


_pools = st.integers(1, 9).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from([None, "a", "b", "c", "d"]), min_size=n, max_size=n), st.integers(1, n)))


@settings(max_examples=120, deadline=None)
@given(_pools, st.sampled_from(["first", "random"]))
def test_maj_at_k_matches_brute_force(args, tie):
    pool, k = args
    assert estimators.maj_at_k(pool, "a", k, tie=tie, exact=True) == brute_maj_at_k(pool, "a", k, tie)


@settings(max_examples=30, deadline=None)
@given(_pools)
def test_maj_at_k_full_pool_is_the_vote(args):
    pool, _ = args
    seen: dict = {}
    ids = np.array([[-1 if a is None else seen.setdefault(a, len(seen)) for a in pool]], np.int32)
    winner = int(reducers.majority_vote(ids).winner[0])
    expected = float(winner >= 0 and seen.get("a") == winner)
    assert estimators.maj_at_k(pool, "a", len(pool)) == expected


def test_maj_at_k_simple_values_and_large_n():
    assert estimators.maj_at_k(["a", "b", "a", None], "a", 1) == pytest.approx(0.5)
    assert estimators.maj_at_k(["b", "b"], "a", 1) == 0.0
    # Tie rules differ on a tie that involves the correct answer.
    assert estimators.maj_at_k(["b", "a"], "a", 2, tie="first") == 0.0
    assert estimators.maj_at_k(["b", "a"], "a", 2, tie="random") == 0.5
    rng = np.random.default_rng(0)
    pool = [None if x == 5 else int(x) for x in rng.integers(0, 6, size=2000)]
    v = estimators.maj_at_k(pool, 0, 64, tie="random")
    assert 0 <= v <= 1
    small = pool[:200]
    assert estimators.maj_at_k(small, 0, 16, tie="first") == pytest.approx(
        estimators.maj_at_k(small, 0, 16, tie="random"), abs=0.02)


@pytest.mark.parametrize("pool,correct,k,tie,match", [
    ([], "a", 1, "first", "at least one"), (["a"], "a", 2, "first", "k must satisfy"),
    (["a"], None, 1, "first", "reference answer"), (["a"], "a", 1, "uniform", "tie must be"),
])
def test_maj_at_k_errors(pool, correct, k, tie, match):
    with pytest.raises(ValueError, match=match):
        estimators.maj_at_k(pool, correct, k, tie=tie)


# ----------------------------------------------------------------------------
# Regression tests: huge floats, non-numeric pools
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("n,c,k,name", [
    (1e20, 1, 1, "n"), (10, 1e300, 1, "c"), (10, 1, float("inf"), "k"), (float("nan"), 1, 1, "n"),
    (2.0**60, 1, 1, "n"), ("5", 1, 1, "n"), ([[1, 2], [3]], 1, 1, "n"),
])
def test_pass_at_k_bad_numbers_clear_error_no_warning(n, c, k, name):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail the test
        with pytest.raises(ValueError, match=rf"^{name} must be (an )?integer"):
            estimators.pass_at_k(n, c, k)


def test_pass_at_k_whole_floats_still_accepted():
    assert float(estimators.pass_at_k(10.0, 10.0, 1.0)) == 1.0
    assert float(estimators.pass_at_k(2.0**53, 0, 1)) == 0.0


@pytest.mark.parametrize("pool", [["a", "b"], [["x"], ["y", "z"]], None])
def test_best_of_k_non_numeric_pool_names_the_argument(pool):
    with pytest.raises(ValueError, match="scores_pool"):
        estimators.best_of_k(pool, np.array([True, False]), 1)


# ----------------------------------------------------------------------------
# Regression tests: pass@k in O(k) (no arange of length c), exact where the
# product form was exact, accurate for any n in the int64 range.
# ----------------------------------------------------------------------------


def _exact_pass(n, c, k):
    """1 - C(n-c, k)/C(n, k) = 1 - C(n-k, c)/C(n, c) exactly, with the shorter product."""
    a, m = max(c, k), min(c, k)
    return 1 - Fraction(math.perm(n - a, m), math.perm(n, m)) if n - c >= k else Fraction(1)


@pytest.mark.parametrize("n,c,k", [
    (2**60, 2**59, 3), (2**62, 2**61, 10), (2**62, 1, 1), (2**62, 3, 2**20), (2**63 - 1, 2**62, 1),
    (2**60, 2**59, 2**59), (10**18, 10**17, 100),
])
def test_pass_at_k_huge_n_uses_k_terms(n, c, k):
    import tracemalloc
    tracemalloc.start()
    try:
        got = estimators.pass_at_k(n, c, k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20  # bytes: no array of length c (2**59 float64s)
    if min(c, k) * n.bit_length() <= 2**18:
        assert float(got) == float(_exact_pass(n, c, k))  # the correctly rounded value
    assert 0.0 <= float(got) <= 1.0


def test_pass_at_k_huge_n_values():
    assert float(estimators.pass_at_k(2**62, 1, 1)) == 2.0**-62  # was 0.0 (1 - (1 - 2**-62))
    assert float(estimators.pass_at_k(2**60, 2**59, 3)) == float(_exact_pass(2**60, 2**59, 3))
    assert float(estimators.pass_at_k(2**60, 2**59, 2**59)) == 1.0
    # c = k = 2**30 of n = 2**62: 2**30 factors, summed in closed form;
    # log ratio ~ -c k / n (1 + (c + k) / (2 n)) = -0.25 (1 + 2**-32).
    got = float(estimators.pass_at_k(2**62, 2**30, 2**30))
    assert got == pytest.approx(-math.expm1(-0.25 * (1 + 2.0**-32)), rel=1e-12)


@pytest.mark.parametrize("n", range(1, 41))
def test_pass_at_k_is_correctly_rounded_for_small_n(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert float(estimators.pass_at_k(n, c, k)) == float(_exact_pass(n, c, k)), (n, c, k)
    assert float(estimators.pass_at_k(4, 1, 1)) == 0.25


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_log_space_path_matches_exact(nck):
    n, c, k = nck
    exact = float(_exact_pass(n, c, k))
    got = estimators._pass_at_k_one(n, c, k) if n - c < k or c == 0 else \
        -math.expm1(estimators._log_ratio_direct(n, max(c, k), min(c, k)))
    assert got == pytest.approx(exact, rel=1e-13, abs=1e-300)


@pytest.mark.parametrize("n,c,k", [(10**9, 2000, 2000), (10**10, 5000, 300), (10**8, 300, 1000),
                                   (2**40, 2**10, 2**12), (10**12, 3000, 3000)])
def test_pass_at_k_closed_form_matches_exact(n, c, k):
    a, m = max(c, k), min(c, k)
    exact = float(_exact_pass(n, c, k))
    got = -math.expm1(estimators._log_ratio_closed(n, a, m))
    assert got == pytest.approx(exact, rel=1e-13)


def test_pass_at_k_closed_form_matches_term_by_term_sum():
    for n, a, m in [(2**40, 2**17, 2**17), (10**12, 10**5, 2**17), (2**50, 2**20, 2**17)]:
        closed, direct = estimators._log_ratio_closed(n, a, m), estimators._log_ratio_direct(n, a, m)
        assert closed == pytest.approx(direct, rel=1e-13)


def test_pass_at_k_paths_agree_at_the_switches(monkeypatch):
    cases = [(2000, 10, 64), (2000, 1000, 5), (10**6, 500, 900), (2**40, 3000, 3000)]
    exact = [estimators.pass_at_k(*c) for c in cases]
    monkeypatch.setattr(estimators, "_EXACT_BITS", 0)  # log space, term by term
    for c, e in zip(cases, exact):
        assert estimators.pass_at_k(*c) == pytest.approx(e, rel=1e-13)
    monkeypatch.setattr(estimators, "_DIRECT_TERMS", 0)  # closed form where a/n, m/n are small
    for c, e in zip(cases[2:], exact[2:]):
        assert estimators.pass_at_k(*c) == pytest.approx(e, rel=1e-13)
