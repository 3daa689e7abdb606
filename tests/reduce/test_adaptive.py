"""Adaptive self-consistency: the stopping rules on hand-made counts, and online == offline.

Oracles: exact integrals / binomial sums and Monte Carlo for the posterior
probabilities; `stopping.replay` (the offline rule) applied in branch order to
a fixed pool `generate(n=max_n)` with the same seed for the online run.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import replay_offline

import jaxsample
from jaxsample import SamplingParams, engine
from jaxsample.errors import InputError
from jaxsample.reduce import adaptive_rules as stopping

# ---------------------------------------------------------------------------
# Posterior probabilities against independent oracles


def _beta_tail_numeric(a: int, b: int, points: int = 200_001) -> float:
    """P(X > 1/2), X ~ Beta(a, b), by the trapezoid rule on the density."""
    x = np.linspace(0.5, 1.0, points)
    logpdf = ((a - 1) * np.log(np.clip(x, 1e-300, None)) + (b - 1) * np.log(np.clip(1 - x, 1e-300, None))
              + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b))
    return float(np.trapezoid(np.exp(logpdf), x))


@pytest.mark.parametrize("v1,v2", [(0, 0), (1, 0), (3, 0), (4, 0), (5, 2), (9, 3), (2, 2), (12, 11)])
def test_beta_leader_probability_matches_the_integral(v1, v2):
    assert stopping.beta_leader_probability(v1, v2) == pytest.approx(
        _beta_tail_numeric(v1 + 1, v2 + 1), abs=1e-6)


def test_beta_leader_probability_by_hand():
    assert stopping.beta_leader_probability(0, 0) == 0.5
    assert stopping.beta_leader_probability(1, 0) == 0.75  # P(Bin(2, .5) <= 1)
    assert stopping.beta_leader_probability(3, 0) == 15 / 16
    assert stopping.beta_leader_probability(4, 0) == 31 / 32
    assert stopping.beta_leader_probability(5, 5) == 0.5  # a tie is a coin flip


@pytest.mark.parametrize("counts", [[3, 1], [7, 7], [10, 2], [0, 0]])
def test_dirichlet_with_two_answers_is_the_beta_criterion(counts):
    assert stopping.dirichlet_leader_probability(counts) == pytest.approx(
        stopping.beta_leader_probability(*counts), abs=1e-5)


@pytest.mark.parametrize("counts", [[5, 2, 1], [4, 4, 1], [8, 3, 3, 1], [2, 1, 1, 1, 1]])
def test_dirichlet_matches_monte_carlo(counts):
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.asarray(counts) + 1.0, size=400_000)
    mc = float(np.mean(np.argmax(p, axis=1) == 0))
    se = math.sqrt(mc * (1 - mc) / len(p))
    assert abs(stopping.dirichlet_leader_probability(counts) - mc) < 5 * se + 1e-4
    assert stopping.dirichlet_leader_probability([counts[0]]) == 1.0


# ---------------------------------------------------------------------------
# Stopping decisions on hand-made answer sequences


def test_esc_stops_on_a_unanimous_window_only():
    assert stopping.should_stop("esc", [1, 1, 1, 1], window=4)
    assert stopping.should_stop("esc", [2, 3, 1, 1, 1, 1], window=4)  # only the last window
    assert stopping.should_stop("esc", [1, None, 1, None], window=4)  # invalid answers ignored
    assert not stopping.should_stop("esc", [1, 1, 2, 1], window=4)
    assert not stopping.should_stop("esc", [None] * 4, window=4)  # an all-invalid window
    assert not stopping.should_stop("esc", [1, 1, 1, 1, 1, 2, None, None], window=4)


def test_beta_and_dirichlet_decisions():
    # (4, 0): 31/32 >= 0.95 stops; (3, 0): 15/16 < 0.95 does not.
    assert stopping.should_stop("beta", ["a"] * 4, window=4)
    assert not stopping.should_stop("beta", ["a"] * 3 + [None], window=4)
    assert not stopping.should_stop("beta", ["a", "b"] * 4, window=4)  # a tie never stops
    assert not stopping.should_stop("beta", [None] * 8, window=4)
    assert stopping.should_stop("beta", ["a"] * 6 + ["b"], window=4)  # P(Bin(8,.5)<=6) = .965
    assert not stopping.should_stop("beta", ["a"] * 5 + ["b"], window=4)  # .9375
    assert stopping.should_stop("dirichlet", ["a"] * 6, window=4)
    assert not stopping.should_stop("dirichlet", ["a", "b", "c", "a"], window=4)
    assert not stopping.should_stop("none", ["a"] * 64, window=8)
    with pytest.raises(ValueError, match="rule"):
        stopping.should_stop("majority", ["a"], window=1)


def test_replay_rounds_max_n_ties_and_all_invalid():
    # ESC fires on the second window.
    r = stopping.replay([1, 2, 3, 4, 5, 5, 5, 5, 6, 6, 6, 6], max_n=12, window=4, rule="esc")
    assert (r.n_used, r.winner) == (8, 5) and r.share == pytest.approx(4 / 8)
    # max_n reached without a decision; the vote ties go to the answer seen first.
    r = stopping.replay(["x", "y", "y", "x", "z", "z"], max_n=6, window=2, rule="esc")
    assert r.n_used == 6 and r.winner == "x"
    # A window that is not a divisor of max_n: the last round is narrower.
    r = stopping.replay([1, 2, 3, 4, 5], max_n=5, window=2, rule="none")
    assert r.n_used == 5
    # Nothing valid: no stop, no winner.
    r = stopping.replay([None] * 8, max_n=8, window=4, rule="beta")
    assert (r.n_used, r.winner, r.share) == (8, None, 0.0)
    # Terminated branches do not vote; weights weight the vote.
    r = stopping.replay(["a", "b", "b", "a"], max_n=4, window=4, rule="none",
                        weights=[5.0, 1.0, 1.0, 1.0], terminated=[False, False, False, True])
    assert r.winner == "a" and r.counted == [True, True, True, False]
    assert r.share == pytest.approx(5 / 7)
    # Warm-up: no stop check before `warmup` branches.
    r = stopping.replay(["a"] * 8, max_n=8, window=2, rule="esc", warmup=4)
    assert r.n_used == 4


def test_vote_matches_majority_vote_tie_rule():
    answers = ["7", "5", "5", "7", None, "3"]
    ids = {a: i for i, a in enumerate(dict.fromkeys(a for a in answers if a is not None))}
    v = jaxsample.majority_vote([[ids.get(a, 0) for a in answers]], [[a is not None for a in answers]])
    winner, share = stopping.vote(answers)
    assert ids[winner] == int(v.winner[0]) and share == pytest.approx(float(v.share[0]))


def test_deepconf_pieces():
    lp = np.log(np.array([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]))
    np.testing.assert_allclose(stopping.token_confidence(lp), -lp.mean(axis=-1))
    conf = np.array([1.0, 2.0, 3.0, 4.0, 0.5])
    np.testing.assert_allclose(stopping.group_confidences(conf, 2), [1.5, 2.5, 3.5, 2.25])
    np.testing.assert_allclose(stopping.group_confidences(conf, 9), [2.1])  # shorter than g
    assert stopping.lowest_group_confidence(conf, 2) == 1.5
    assert math.isnan(stopping.lowest_group_confidence(np.zeros(0), 2))
    assert stopping.first_low_group(conf, 2, 1.6) == 2  # the group ending at token 2
    assert stopping.first_low_group(conf, 2, 2.4) == 2
    assert stopping.first_low_group(conf, 2, 1.0) is None
    assert stopping.first_low_group(conf[:1], 2, 100.0) is None  # no complete group
    low = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert stopping.threshold_from_warmup(low, "deepconf-low") == pytest.approx(10.0)
    assert stopping.threshold_from_warmup(low, "deepconf-high") == pytest.approx(2.0)
    assert stopping.threshold_from_warmup([math.nan], "deepconf-low") == -math.inf


# ---------------------------------------------------------------------------
# Online == offline on the tiny model and on SmolLM2

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]


def first_char(text):
    return text[:1] or None


def _offline(pool, b, extract, **kw):
    """stopping.replay on row b of a fixed pool, DeepConf quantities from its top logprobs."""
    return replay_offline(pool, b, extract, source="top_logprobs", **kw)


def _assert_online_equals_offline(res, pool, extract, **kw):
    differences = 0
    for b in range(len(res.winner)):
        rep = _offline(pool, b, extract, **kw)
        same = (rep.n_used == res.n_used[b] and rep.winner == res.winner[b]
                and sum(rep.terminated) == res.terminated[b])
        if not same:  # only a float tie may part the two runs: find it in the tokens
            differences += 1
        assert same or differences <= 1, (b, rep, res.n_used[b], res.winner[b])
        assert res.share[b] == pytest.approx(rep.share, abs=1e-5) or not same
    return differences


@pytest.mark.slow
@pytest.mark.parametrize("rule,confidence", [("esc", None), ("beta", None), ("none", None),
                                             ("beta", "deepconf-low"),
                                             ("none", "deepconf-high")])
def test_adaptive_equals_offline_rule_on_a_fixed_pool_tiny(tiny_lm, rule, confidence):
    params = SamplingParams(max_new_tokens=12, seed=7, temperature=0.8)
    kw = dict(max_n=16, window=4, rule=rule, threshold=0.6, confidence=confidence,
              warmup=8, group_size=4)
    res = jaxsample.adaptive_self_consistency(tiny_lm, PROMPTS, params, extract=first_char, **kw)
    pool = engine.generate(tiny_lm, PROMPTS, params.replace(n=16, logprobs=20))
    assert _assert_online_equals_offline(res, pool, first_char, **kw) == 0
    # The drawn branches are the pool's branches, token for token.
    g = res.generation
    for b in range(3):
        for n in range(res.n_used[b]):
            L = int(g.lengths[b, n])
            np.testing.assert_array_equal(g.tokens[b, n, :L], pool.tokens[b, n, :L])
        assert all(r == "not_drawn" for r in g.finish_reason[b][res.n_used[b]:])
    bill = g.bill
    assert bill.prompt_tokens_prefilled == sum(len(p) for p in pool.prompt_tokens)  # once
    assert bill.adaptive.branches_drawn == int(res.n_used.sum())
    assert bill.adaptive.max_n == 16 and bill.pool is None
    # What was decoded is the drawn branches' tokens (branches not drawn decoded none).
    assert bill.decoded_tokens_total == sum(
        sum(row[:n]) for row, n in zip(bill.decoded_tokens_per_branch, res.n_used))
    assert all(not any(row[n:]) for row, n in zip(bill.decoded_tokens_per_branch, res.n_used))
    assert bill.adaptive.token_saving == pytest.approx(
        1 - bill.decoded_tokens_total / bill.adaptive.fixed_decoded_tokens)
    assert "at a fixed n=16" in bill.summary()
    if rule == "none" and confidence is None:
        assert bill.decoded_tokens_total == pool.bill.decoded_tokens_total
        assert bill.adaptive.token_saving == 0.0
    if confidence:
        assert np.all(np.isfinite(res.thresholds))
        assert any("terminated" in row for row in g.finish_reason) == bool(res.terminated.sum())


def test_adaptive_input_errors(tiny_lm):
    bad = [dict(max_n=0), dict(window=0), dict(window=9, max_n=8), dict(rule="vote"),
           dict(threshold=1.0), dict(threshold=0), dict(confidence="deepconf"),
           dict(warmup=6, confidence="deepconf-low", window=4), dict(group_size=0),
           dict(chunk_size=0), dict(extract="digits")]
    for kw in bad:
        with pytest.raises(InputError, match=next(iter(kw))):
            jaxsample.adaptive_self_consistency(tiny_lm, PROMPTS, SamplingParams(), **kw)


@pytest.mark.slow
def test_adaptive_equals_offline_rule_on_smollm2(lm):
    """On the real model: ESC, Beta and DeepConf-low against the fixed pool of 16."""
    prompts = ["What is 3 + 4? Answer with just the number.",
               "What is 8 + 9? Answer with just the number.",
               "What is 6 + 2? Answer with just the number."]
    params = SamplingParams(max_new_tokens=10, seed=0, temperature=0.8)
    pool = engine.generate(lm, prompts, params.replace(n=16, logprobs=20), chat=True)
    number = lambda t: jaxsample.reduce.answers.extract(t, "number")
    total = 0
    for rule, confidence in (("esc", None), ("beta", None), ("beta", "deepconf-low")):
        kw = dict(max_n=16, window=4, rule=rule, threshold=0.9, confidence=confidence,
                  warmup=8, group_size=4)
        res = jaxsample.adaptive_self_consistency(lm, prompts, params, chat=True,
                                                  extract=number, **kw)
        total += _assert_online_equals_offline(res, pool, number, **kw)
        assert res.generation.bill.prompt_tokens_prefilled == sum(
            len(p) for p in pool.prompt_tokens)
    assert total <= 1  # float ties between the two programs' roundings, at most one


# ---------------------------------------------------------------------------
# Regression tests: the answers voted on come from exactly
# Generation.texts (min_tokens was left out of adaptive's cut), and `support`
# is the winner's (weighted) votes, not the number of answering branches.


def _stop_inside_min_tokens(tiny_lm, params, m):
    """A one-character stop string found in the first m tokens' text of some branch of
    a plain run with these params (stop strings do not change the tokens sampled)."""
    from collections import Counter

    pool = engine.generate(tiny_lm, PROMPTS, params.replace(n=16))
    seen = Counter()
    for b in range(len(PROMPTS)):
        for n in range(16):
            head = tiny_lm.tokenizer.decode(pool.tokens[b, n, :m].tolist())
            seen.update(set(ch for ch in head if ch.isascii() and ch.isprintable()))
    assert seen, "no printable character in any branch's first tokens"
    return seen.most_common(1)[0][0]


@pytest.mark.slow
@pytest.mark.parametrize("confidence", [None, "deepconf-low"])
def test_adaptive_answers_come_from_generation_texts(tiny_lm, confidence):
    m = 10
    params = SamplingParams(max_new_tokens=24, seed=11, temperature=1.0, min_tokens=m)
    stop = _stop_inside_min_tokens(tiny_lm, params, m)
    params = params.replace(stop=[stop])
    whole = lambda t: t or None  # the answer is the whole text: any difference shows  # noqa: E731
    res = jaxsample.adaptive_self_consistency(
        tiny_lm, PROMPTS, params, max_n=16, window=4, rule="none", extract=whole,
        confidence=confidence, warmup=8, group_size=4)
    g = res.generation
    early = 0
    for b in range(len(PROMPTS)):
        assert res.answers[b] == [jaxsample.reduce.answers.normalize(t) or None
                                  for t in g.texts[b][:res.n_used[b]]], b
        for n in range(res.n_used[b]):
            early += stop in tiny_lm.tokenizer.decode(g.tokens[b, n, :m].tolist())
    assert early > 0  # a stop string inside the first min_tokens tokens: the case that differed


def _support_oracle(res, b, confidence):
    """The winner's votes counted by hand from the result's own answers."""
    total = 0.0
    for a, c, w in zip(res.answers[b], res.counted[b],
                       res.confidence[b] if confidence else [1.0] * len(res.answers[b])):
        if c and a == res.winner[b]:
            total += w
    return total


@pytest.mark.slow
@pytest.mark.parametrize("confidence", [None, "deepconf-high"])
def test_adaptive_support_is_the_winners_votes(tiny_lm, confidence):
    params = SamplingParams(max_new_tokens=6, seed=2, temperature=1.0)
    res = jaxsample.adaptive_self_consistency(
        tiny_lm, PROMPTS, params, max_n=16, window=4, rule="none", extract=first_char,
        confidence=confidence, warmup=8, group_size=4)
    split = 0
    for b in range(len(PROMPTS)):
        want = _support_oracle(res, b, confidence)
        assert float(res.support[b]) == pytest.approx(want, rel=1e-6), b
        weights = res.confidence[b] if confidence else [1.0] * len(res.answers[b])
        answering = sum(w for a, c, w in zip(res.answers[b], res.counted[b], weights)
                        if c and a is not None)
        assert float(res.share[b]) == pytest.approx(want / answering, rel=1e-5)
        split += want < answering
    assert res.support.dtype == np.float32 and res.support.shape == (len(PROMPTS),)
    assert split > 0  # some prompt's vote was split: support < answering weight


def test_tally_support_and_share():
    assert stopping.tally(["a", "b", "b", None, "a", "b"]) == ("b", 3.0, 0.6)
    assert stopping.tally(["a", "b"], [3.0, 1.0]) == ("a", 3.0, 0.75)
    assert stopping.tally([None, None]) == (None, 0.0, 0.0)
    assert stopping.vote(["a", "b", "b"]) == ("b", pytest.approx(2 / 3))
