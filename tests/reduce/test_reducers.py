"""Reducers: best-of-N and (weighted) majority vote against numpy references."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_cases
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxsample import reduce as reducers
from jaxsample.generation import Generation

# The hand-written cases, tests/data/cases/answers.json "votes".
VOTE_CASES = load_cases("answers")["votes"]


# ----------------------------------------------------------------------------
# numpy references
# ----------------------------------------------------------------------------


def ref_best_of_n(scores, valid):
    out = []
    for s, v in zip(scores, valid):
        ok = [i for i in range(len(s)) if v[i] and not np.isnan(s[i])]
        out.append(max(ok, key=lambda i: (s[i], -i)) if ok else -1)
    return np.array(out)


def ref_vote(ids, valid, weights=None):
    """(winner, support, share, first_branch) per row with Counter.most_common ties."""
    rows = []
    for b in range(len(ids)):
        tally: dict[int, float] = {}
        first: dict[int, int] = {}
        for i, (a, v) in enumerate(zip(ids[b], valid[b])):
            if v and a >= 0:
                tally[a] = tally.get(a, 0.0) + (1.0 if weights is None else float(weights[b][i]))
                first.setdefault(a, i)
        if not tally:
            rows.append((-1, 0.0, 0.0, -1))
            continue
        # dicts keep insertion (first-occurrence) order; max keeps the first of equals.
        win = max(tally, key=lambda a: tally[a])
        total = sum(tally.values())
        rows.append((win, tally[win], tally[win] / total if total > 0 else 0.0, first[win]))
    return rows


def _vote_rows(vote):
    return list(zip(np.asarray(vote.winner).tolist(), np.asarray(vote.support).tolist(),
                    np.asarray(vote.share).tolist(), np.asarray(vote.first_branch).tolist()))


def _assert_vote(vote, ref):
    for got, want in zip(_vote_rows(vote), ref):
        assert got[0] == want[0] and got[3] == want[3], (got, want)
        np.testing.assert_allclose(got[1:3], want[1:3], rtol=1e-5, atol=1e-6)


def make_generation(texts, logprobs=None, lengths=None):
    b, n = len(texts), len(texts[0])
    t = 4
    if logprobs is None:
        logprobs = np.full((b, n, t), -0.5, np.float32)
    if lengths is None:
        lengths = np.full((b, n), t, np.int32)
    return Generation(tokens=np.zeros((b, n, t), np.int32), logprobs=np.asarray(logprobs, np.float32),
                      lengths=np.asarray(lengths, np.int32), finish_reason=[["stop"] * n for _ in range(b)],
                      texts=texts, prompt_tokens=[[1]] * b, prompts=[None] * b, params=None, bill=None,
                      timings={}, pad_id=0)


# ----------------------------------------------------------------------------
# best-of-N
# ----------------------------------------------------------------------------


def test_best_of_n_basic_ties_invalid_nan():
    scores = np.array([[0.1, 0.9, 0.9, 0.2],     # tie -> lowest index 1
                       [5.0, 1.0, np.nan, 2.0],  # 0 invalid, NaN never wins -> 3
                       [np.nan, np.nan, 1.0, 1.0],  # all valid ones NaN or invalid -> -1
                       [-np.inf, -np.inf, 3.0, 1.0]], np.float32)  # -inf can win if alone
    valid = np.array([[True] * 4, [False, True, True, True], [True, True, False, False],
                      [True, True, False, False]])
    got = reducers.best_of_n(scores, valid)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, [1, 3, -1, 0])
    np.testing.assert_array_equal(reducers.best_of_n(scores[:1]), [1])


@pytest.mark.parametrize("scores,valid,match", [
    (np.zeros(4), None, "scores must have shape"),
    (np.zeros((2, 0)), None, "at least one branch"),
    (np.zeros((2, 3)), np.ones((2, 4), bool), "valid must have the shape"),
    (np.zeros((2, 3)), np.ones((2, 3), np.int32), "valid must be a bool"),
    (np.zeros((2, 3), bool), None, "scores must be a real"),
])
def test_best_of_n_errors(scores, valid, match):
    with pytest.raises(ValueError, match=match):
        reducers.best_of_n(scores, valid)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.data())
def test_best_of_n_matches_numpy(b, n, data):
    # Small integer scores make ties common; NaN and invalid branches mixed in.
    vals = data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, -1.0, np.nan, -np.inf]),
                              min_size=b * n, max_size=b * n))
    mask = data.draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))
    scores = np.array(vals, np.float32).reshape(b, n)
    valid = np.array(mask).reshape(b, n)
    np.testing.assert_array_equal(reducers.best_of_n(scores, valid), ref_best_of_n(scores, valid))


def test_best_of_n_under_jit_and_vmap():
    scores = jnp.array([[[0.0, 2.0, 1.0]], [[3.0, 3.0, 1.0]]])
    got = jax.jit(jax.vmap(reducers.best_of_n))(scores)
    np.testing.assert_array_equal(got, [[1], [0]])


def test_score_helpers_on_generation():
    lp = np.zeros((1, 2, 4), np.float32)
    lp[0, 0, :2] = -1.0          # 2 tokens, sum -2, mean -1
    lp[0, 1, :4] = -0.75         # 4 tokens, sum -3, mean -0.75
    gen = make_generation([["a", "b"]], logprobs=lp, lengths=[[2, 4]])
    np.testing.assert_allclose(reducers.score_sum_logprob(gen), [[-2.0, -3.0]])
    np.testing.assert_allclose(reducers.score_mean_logprob(gen), [[-1.0, -0.75]])
    assert int(reducers.best_of_n(reducers.score_sum_logprob(gen))[0]) == 0
    assert int(reducers.best_of_n(reducers.score_mean_logprob(gen))[0]) == 1
    np.testing.assert_allclose(reducers.weights_from_mean_logprob(gen), np.exp([[-1.0, -0.75]]), rtol=1e-6)


# ----------------------------------------------------------------------------
# majority vote
# ----------------------------------------------------------------------------


def _ids(answers, valid):
    seen: dict[str, int] = {}
    return np.array([[seen.setdefault(a, len(seen)) if v else -1 for a, v in zip(answers, valid)]], np.int32), seen


def _check_vote_case(case):
    ids, seen = _ids(case["answers"], case["valid"])
    weights = None if "weights" not in case else np.array([case["weights"]], np.float32)
    vote = reducers.majority_vote(ids, np.array([case["valid"]]), weights)
    names = {v: k for k, v in seen.items()}
    assert names[int(vote.winner[0])] == case["winner"], case
    if "share" in case:
        assert float(vote.share[0]) == pytest.approx(case["share"]), case


@pytest.mark.parametrize("case", VOTE_CASES)
def test_vote_handed_cases(case):
    _check_vote_case(case)


def test_vote_fields():
    ids = np.array([[3, 1, 1, 3, 1],     # 1 wins 3 votes of 5, first at branch 1
                    [4, 2, 2, 4, 9],     # tie 4 vs 2 -> 4 (seen first)
                    [7, 7, 7, 7, 7],     # all invalid
                    [-1, 5, -1, -1, -1]])  # negative ids are "no answer"
    valid = np.ones_like(ids, bool)
    valid[2] = False
    vote = reducers.majority_vote(ids, valid)
    assert isinstance(vote, reducers.Vote)
    np.testing.assert_array_equal(vote.winner, [1, 4, -1, 5])
    np.testing.assert_allclose(vote.support, [3, 2, 0, 1])
    np.testing.assert_allclose(vote.share, [0.6, 0.4, 0.0, 1.0])
    np.testing.assert_array_equal(vote.first_branch, [1, 0, -1, 1])
    assert vote.winner.dtype == jnp.int32 and vote.first_branch.dtype == jnp.int32


def test_vote_weighted_and_zero_weights():
    ids = np.array([[5, 7, 7], [5, 7, 7]])
    w = np.array([[0.9, 0.2, 0.3], [0.0, 0.0, 0.0]], np.float32)
    vote = reducers.majority_vote(ids, None, w)
    np.testing.assert_array_equal(vote.winner, [5, 5])  # all-zero weights: first valid answer
    np.testing.assert_allclose(vote.support, [0.9, 0.0], rtol=1e-6)
    np.testing.assert_allclose(vote.share, [0.9 / 1.4, 0.0], rtol=1e-6)
    # NaN weight excludes its branch.
    vote = reducers.majority_vote(np.array([[5, 7, 7]]), None, np.array([[1.0, np.nan, 0.5]]))
    np.testing.assert_array_equal(vote.winner, [5])
    np.testing.assert_allclose(vote.share, [1 / 1.5], rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    ({"answer_ids": np.zeros(3, np.int32)}, "answer_ids must have shape"),
    ({"answer_ids": np.zeros((1, 3), np.float32)}, "answer_ids must be an int"),
    ({"answer_ids": np.zeros((1, 3), np.int32), "valid": np.ones((1, 2), bool)}, "valid must have the shape"),
    ({"answer_ids": np.zeros((1, 3), np.int32), "weights": np.ones((3,))}, "weights must have the shape"),
    ({"answer_ids": np.zeros((1, 3), np.int32), "weights": -np.ones((1, 3))}, "non-negative"),
])
def test_vote_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reducers.majority_vote(**kwargs)


_vote_inputs = st.integers(1, 3).flatmap(lambda b: st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(-1, 3), min_size=n, max_size=n), min_size=b, max_size=b),
    st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=b, max_size=b),
    st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]), min_size=n, max_size=n),
             min_size=b, max_size=b))))


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(_vote_inputs, st.booleans())
def test_vote_matches_reference(inputs, weighted):
    ids, valid, weights = (np.array(x) for x in inputs)
    w = weights.astype(np.float32) if weighted else None
    _assert_vote(reducers.majority_vote(ids.astype(np.int32), valid, w), ref_vote(ids, valid, w))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(_vote_inputs)
def test_unit_weights_reproduce_counting(inputs):
    ids, valid, _ = (np.array(x, dtype=t) for x, t in zip(inputs, (np.int32, bool, np.float32)))
    plain = reducers.majority_vote(ids, valid)
    ones = reducers.majority_vote(ids, valid, np.ones(ids.shape, np.float32))
    for a, b in zip(plain, ones):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(_vote_inputs, st.randoms(use_true_random=False))
def test_vote_permutation_invariant_without_ties(inputs, rnd):
    ids, valid, _ = (np.array(x, dtype=t) for x, t in zip(inputs, (np.int32, bool, np.float32)))
    for b in range(ids.shape[0]):  # no ties for the top spot in any row
        counts = Counter(int(a) for a, v in zip(ids[b], valid[b]) if v and a >= 0).most_common(2)
        assume(len(counts) < 2 or counts[0][1] > counts[1][1])
    perm = list(range(ids.shape[1]))
    rnd.shuffle(perm)
    v1 = reducers.majority_vote(ids, valid)
    v2 = reducers.majority_vote(ids[:, perm], valid[:, perm])
    np.testing.assert_array_equal(v1.winner, v2.winner)
    np.testing.assert_allclose(v1.support, v2.support)
    np.testing.assert_allclose(v1.share, v2.share)


def test_vote_under_jit_and_vmap():
    ids = jnp.array([[[1, 2, 2]], [[3, 3, 1]]], jnp.int32)
    vote = jax.jit(jax.vmap(lambda x: reducers.majority_vote(x, weights=jnp.ones(x.shape))))(ids)
    np.testing.assert_array_equal(vote.winner, [[2], [3]])


def test_weights_from_scores():
    scores = np.array([[0.0, np.log(3.0), 5.0]], np.float32)
    valid = np.array([[True, True, False]])
    w = reducers.weights_from_scores(scores, valid, temperature=1.0)
    np.testing.assert_allclose(w, [[0.25, 0.75, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(reducers.weights_from_scores(scores, valid), [[0.0, np.log(3.0), 0.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        reducers.weights_from_scores(scores, temperature=0.0)


# ----------------------------------------------------------------------------
# self-consistency
# ----------------------------------------------------------------------------


def test_self_consistency_on_generation():
    texts = [["so \\boxed{1,000}", "#### 1000", "The answer is 7.", "hmm"],
             ["no idea", "nothing", "still nothing", "?"]]
    sc = reducers.self_consistency(make_generation(texts))
    assert sc.answers == [["1000", "1000", "7", None], [None, None, None, None]]
    np.testing.assert_array_equal(sc.answer_ids, [[0, 0, 1, -1], [-1, -1, -1, -1]])
    assert sc.winner == ["1000", None]
    np.testing.assert_allclose(sc.share, [2 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(sc.support, [2.0, 0.0])
    np.testing.assert_array_equal(sc.first_branch, [0, -1])
    np.testing.assert_array_equal(sc.vote.winner, [0, -1])


def test_self_consistency_tie_first_seen_and_texts_input():
    sc = reducers.self_consistency([["#### 5", "#### 7", "#### 7", "#### 5"]], extract="number")
    assert sc.winner == ["5"] and float(sc.share[0]) == pytest.approx(0.5)


def test_self_consistency_weights():
    texts = [["#### 5", "#### 7", "#### 7"]]
    lp = np.zeros((1, 3, 4), np.float32)
    lp[0, 0] = -0.01          # confident
    lp[0, 1:] = -3.0          # unsure
    gen = make_generation(texts, logprobs=lp)
    assert reducers.self_consistency(gen).winner == ["7"]
    assert reducers.self_consistency(gen, weights="mean_logprob").winner == ["5"]
    assert reducers.self_consistency(gen, weights=np.array([[0.9, 0.2, 0.3]])).winner == ["5"]
    with pytest.raises(ValueError, match="weights"):
        reducers.self_consistency(gen, weights="reward")
    with pytest.raises(ValueError, match="Generation"):
        reducers.self_consistency(texts, weights="mean_logprob")


def test_self_consistency_callable_valid_and_errors():
    texts = [["Paris", "paris", "London", "PARIS"]]
    sc = reducers.self_consistency(texts, extract=lambda t: t.lower() if t != "London" else None)
    assert sc.answers == [["paris", "paris", None, "paris"]] and sc.winner == ["paris"]
    sc = reducers.self_consistency(texts, extract="text", valid=np.array([[False, False, True, True]]))
    assert sc.answers == [[None, None, "London", "PARIS"]] and sc.winner == ["London"]
    with pytest.raises(ValueError, match="extract"):
        reducers.self_consistency(texts, extract="latex")
    with pytest.raises(ValueError, match="same number"):
        reducers.self_consistency([["a", "b"], ["c"]])


# ----------------------------------------------------------------------------
# Regression tests: flat string rows, 64-bit inputs, float32 overflow in votes
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("texts", [["42", "42", "17"], ("7", "7", "8"), [["1", "2"], "34"]])
def test_self_consistency_rejects_string_rows(texts):
    with pytest.raises(ValueError, match=r"row \d+ is a str.*not a list of strings.*\[texts\]"):
        reducers.self_consistency(texts)
    assert reducers.self_consistency([["42", "42", "17"]]).winner == ["42"]


@pytest.mark.parametrize("scores,expected", [
    (np.array([[1.0, 1.0 + 1e-9]]), [1]),
    (np.array([[1.0 + 1e-9, 1.0]]), [0]),
    (np.array([[1e300, 1e301]]), [1]),
    (np.array([[1e301, 1e300, 1e301]]), [0]),           # exact tie keeps the lowest index
    (np.array([[-1e-300, -1e-301, np.nan]]), [1]),
    (np.array([[np.nan, np.nan], [np.inf, 1e308]]), [-1, 0]),
    (np.array([[2**32, 1]], dtype=np.int64), [0]),
    (np.array([[2**40 + 1, 2**40]], dtype=np.int64), [0]),
    (np.array([[2**40, 2**40 + 1]], dtype=np.int64), [1]),
])
def test_best_of_n_exact_for_64_bit_scores(scores, expected):
    np.testing.assert_array_equal(reducers.best_of_n(scores), expected)


def test_best_of_n_64_bit_scores_respect_valid():
    scores = np.array([[1.0, 1.0 + 1e-9, 1.0 + 2e-9]])
    assert int(reducers.best_of_n(scores, np.array([[True, True, False]]))[0]) == 1


@pytest.mark.parametrize("scores", [[["a", "b"]], [["a"]], [[1.0, 2.0], [3.0]], None])
def test_best_of_n_non_numeric_scores_name_the_argument(scores):
    with pytest.raises(ValueError, match="scores"):
        reducers.best_of_n(scores)


@pytest.mark.parametrize("ids", [np.array([[2**32, 0, 2**32 + 1]], dtype=np.int64),
                                 np.array([[-(2**31) - 1, 1]], dtype=np.int64),
                                 np.array([[2**63, 1]], dtype=np.uint64)])
def test_majority_vote_answer_ids_must_fit_int32(ids):
    with pytest.raises(ValueError, match="answer_ids must fit int32"):
        reducers.majority_vote(ids)


def test_majority_vote_int64_ids_in_range_are_fine():
    vote = reducers.majority_vote(np.array([[2**31 - 1, 5, 2**31 - 1]], dtype=np.int64))
    assert int(vote.winner[0]) == 2**31 - 1 and int(vote.first_branch[0]) == 0


@pytest.mark.parametrize("weights", [np.array([[1e300, 1.0, 1.0]]), [[float("inf"), 1.0, 1.0]],
                                     np.array([[1e39, 1.0, 1.0]])])
def test_majority_vote_weights_checked_after_float32_cast(weights):
    with pytest.raises(ValueError, match="weights must be finite in float32"):
        reducers.majority_vote([[1, 2, 2]], weights=weights)


@pytest.mark.parametrize("weights", [[["a", "b", "c"]], [[1.0, 2.0], [3.0]]])
def test_majority_vote_non_numeric_weights_name_the_argument(weights):
    with pytest.raises(ValueError, match="weights"):
        reducers.majority_vote([[1, 2, 2]], weights=weights)


def _vote_is_sane(vote, n):
    w, s, sh, fb = (np.asarray(x) for x in vote)
    assert np.all((fb >= -1) & (fb < n)) and np.all((w == -1) == (fb == -1))
    assert np.all(np.isfinite(sh)) and np.all((sh >= 0) & (sh <= 1))
    assert not np.any(np.isnan(s))


def test_majority_vote_sums_beyond_float32_range():
    # Each weight fits float32, but their sums overflow it.
    vote = reducers.majority_vote([[1, 2, 2]], weights=[[3e38, 3e38, 3e38]])
    _vote_is_sane(vote, 3)
    assert int(vote.winner[0]) == 2 and int(vote.first_branch[0]) == 1
    np.testing.assert_allclose(vote.share, [2 / 3], rtol=1e-6)
    vote = reducers.majority_vote([[1, 2, 2]], weights=[[3e38, 1e38, 1e38]])
    assert int(vote.winner[0]) == 1
    np.testing.assert_allclose(vote.support, [3e38], rtol=1e-6)
    np.testing.assert_allclose(vote.share, [0.6], rtol=1e-6)
    # Exact ties stay ties at any scale: the first-seen answer wins.
    vote = reducers.majority_vote([[5, 7, 7, 5]], weights=[[3e38, 3e38, 3e38, 3e38]])
    assert int(vote.winner[0]) == 5 and float(vote.share[0]) == 0.5


def test_majority_vote_traced_non_finite_or_negative_weights_stay_sane():
    f = jax.jit(reducers.majority_vote)
    ids = jnp.array([[1, 2, 2], [3, 3, 4], [1, 2, 3]])
    inf, nan = float("inf"), float("nan")
    w = jnp.array([[inf, 1.0, 1.0], [3e38, 3e38, 3e38], [nan, -inf, inf]])
    vote = f(ids, None, w)
    _vote_is_sane(vote, 3)
    np.testing.assert_array_equal(vote.winner, [2, 3, -1])
    vote = f(jnp.array([[1, 2, 2]]), None, jnp.array([[1.0, -5.0, 1.0]]))
    _vote_is_sane(vote, 3)
    assert int(vote.winner[0]) == 1  # negative weight counts 0: 1 vs 1, first seen wins


def test_generation_logprob_summaries_are_float32():
    gen = make_generation([["a", "b"]], lengths=[[4, 2]])
    assert gen.sum_logprob().dtype == np.float32
    assert gen.mean_logprob().dtype == np.float32
    np.testing.assert_allclose(gen.mean_logprob(), [[-0.5, -1.0]])


# ----------------------------------------------------------------------------
# Regression tests: tiny (even subnormal) vote weights still rank; both ends
# of the float32 range are handled by the same exact per-row scaling.
# ----------------------------------------------------------------------------

_ULP = float(np.float32(2.0**-149))  # the smallest float32 subnormal


def test_majority_vote_tiny_float64_weights_rank():
    # 3e-45 vs 2e-45 + 2e-45: float32 rounds them to 2, 1, 1 ulps (a tie);
    # in float64 answer 1 has 4e-45 > 3e-45.
    vote = reducers.majority_vote([[0, 1, 1]], None, [[3e-45, 2e-45, 2e-45]])
    _vote_is_sane(vote, 3)
    assert int(vote.winner[0]) == 1 and int(vote.first_branch[0]) == 1
    np.testing.assert_allclose(vote.share, [4 / 7], rtol=1e-6)
    assert float(vote.support[0]) == float(np.float32(4e-45))  # subnormal, not flushed to 0


@pytest.mark.parametrize("scale", [1e-50, 1e-100, 1e-300, 1e-310, 2.0**-140, 1e-38, 1.0, 1e30])
def test_majority_vote_float64_weights_at_any_scale(scale):
    w = np.array([[1.0, 0.6, 0.6, 0.3]]) * scale
    vote = reducers.majority_vote([[0, 1, 1, 2]], None, w)
    _vote_is_sane(vote, 4)
    assert int(vote.winner[0]) == 1 and int(vote.first_branch[0]) == 1
    np.testing.assert_allclose(vote.share, [1.2 / 2.5], rtol=1e-6)
    assert float(vote.support[0]) == pytest.approx(float(np.float32(1.2 * scale)), rel=1e-6, abs=_ULP)


@pytest.mark.parametrize("jit", [False, True])
def test_majority_vote_float32_subnormal_weights(jit):
    # 4 ulps vs 3 + 3 ulps, all float32 subnormals: XLA CPU flushes them to 0
    # in float arithmetic, which made every weight 0 and answer 0 win.
    w = np.array([[4, 3, 3], [3, 2, 2], [1, 1, 0]], np.float32) * np.float32(_ULP)
    ids = np.array([[0, 1, 1], [0, 1, 1], [5, 6, 6]], np.int32)
    f = jax.jit(reducers.majority_vote) if jit else reducers.majority_vote
    vote = f(jnp.asarray(ids) if jit else ids, None, jnp.asarray(w) if jit else w)
    _vote_is_sane(vote, 3)
    np.testing.assert_array_equal(vote.winner, [1, 1, 5])
    np.testing.assert_array_equal(vote.first_branch, [1, 1, 0])
    np.testing.assert_allclose(vote.share, [0.6, 4 / 7, 0.5], rtol=1e-6)
    np.testing.assert_array_equal(vote.support, np.array([6, 4, 1], np.float32) * np.float32(_ULP))


def test_majority_vote_rows_at_both_ends_of_the_range():
    ids = np.array([[0, 1, 1]] * 4, np.int32)
    w = np.array([[3e-45, 2e-45, 2e-45], [3e38, 2e38, 2e38], [3.0, 2.0, 2.0], [3e-30, 2e-30, 2e-30]])
    vote = reducers.majority_vote(ids, None, w)
    _vote_is_sane(vote, 3)
    np.testing.assert_array_equal(vote.winner, [1, 1, 1, 1])
    np.testing.assert_allclose(vote.share, [4 / 7] * 4, rtol=1e-6)
    np.testing.assert_allclose(vote.support[1:], [np.inf, 4.0, 4e-30], rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(_vote_inputs, st.integers(-1000, 126), st.booleans())  # weights <= 2: 2 * 2**126 fits float32
def test_vote_is_invariant_to_scaling_a_row_by_a_power_of_two(inputs, p, jit):
    ids, valid, weights = (np.array(x) for x in inputs)
    w = weights.astype(np.float64)
    scaled = np.ldexp(w, p)  # exact in float64 unless it leaves float64's range
    ref = reducers.majority_vote(ids.astype(np.int32), valid, w.astype(np.float32))
    if jit and -120 <= p <= 120:  # traced: float32 weights, scaled on the bits in the kernel
        got = jax.jit(reducers.majority_vote)(jnp.asarray(ids, jnp.int32), jnp.asarray(valid),
                                               jnp.asarray(scaled.astype(np.float32)))
    else:
        got = reducers.majority_vote(ids.astype(np.int32), valid, scaled)
    np.testing.assert_array_equal(got.winner, ref.winner)
    np.testing.assert_array_equal(got.first_branch, ref.first_branch)
    np.testing.assert_array_equal(got.share, ref.share)
    _vote_is_sane(got, ids.shape[1])


def test_majority_vote_refuses_tiny_negative_weights():
    # -1e-50 is -0.0 in float32, but it is negative as given.
    with pytest.raises(ValueError, match="non-negative"):
        reducers.majority_vote([[1, 2, 2]], weights=[[-1e-50, 1.0, 1.0]])


def test_ldexp_f32_matches_numpy_including_subnormals():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(0.5, 64.0, 2000), [0.5, 1.0, 0.75, 0.0, 1.5, 63.99]]).astype(np.float32)
    for k in list(range(-160, -120)) + [-300, -151, -150, -149, -126, -1, 0, 1, 100, 121, 122, 300]:
        got = np.asarray(reducers.vote._ldexp_f32(jnp.asarray(x), jnp.full(x.shape, k, jnp.int32)))
        with np.errstate(over="ignore"):
            want = np.ldexp(x.astype(np.float64), k).astype(np.float32)  # one rounding, to nearest even
        np.testing.assert_array_equal(got, want, err_msg=f"k={k}")


def test_self_consistency_mean_logprob_weights_rank_when_tiny():
    # exp(-110) is 0 in float32: every weight used to be 0 and the first answer won.
    texts = [["#### 5", "#### 7", "#### 7"]]
    lp = np.zeros((1, 3, 4), np.float32)
    lp[0, 0] = -110.0
    lp[0, 1:] = -110.5
    sc = reducers.self_consistency(make_generation(texts, logprobs=lp), weights="mean_logprob")
    assert sc.winner == ["7"] and int(sc.first_branch[0]) == 1
    np.testing.assert_allclose(sc.share, [2 * np.exp(-110.5) / (np.exp(-110.0) + 2 * np.exp(-110.5))], rtol=1e-6)
    assert np.all(np.isfinite(sc.support)) and float(sc.support[0]) == 0.0  # 2e-48 is below float32's range


def test_majority_vote_single_positive_subnormal_weight():
    vote = reducers.majority_vote([[0, 1, 0]], None, [[0.0, 1e-45, 0.0]])
    assert int(vote.winner[0]) == 1 and float(vote.share[0]) == 1.0
    assert float(vote.support[0]) == float(np.float32(1e-45))
