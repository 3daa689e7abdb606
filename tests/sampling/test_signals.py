"""Selection signals on the device (`SamplingParams(signals=True)`) and the rules that use them.

The per-token entropy, self-certainty (KL(U || p), arXiv 2502.18581) and top-2
margin the step records are checked against a float64 numpy computation from
the plain causal forward of prompt + generated tokens (`lm.forward`), on the
tiny Llama and a tiny Gemma 3, greedy and sampled, with and without logits
processors; shared vs naive and chunked/compacted vs one call agree (tie
oracle for the tokens). The branch scores, the DeepConf votes and Borda
voting are checked against plain numpy/Python oracles written from the
papers' reference code on hand-made pools.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from conftest import byte_tokenizer
from helpers import replay_offline
from ties import assert_same_tokens_up_to_ties, first_difference

from jaxsample import SamplingParams, engine
from jaxsample import reduce as reducers
from jaxsample.engine import sampling
from jaxsample.engine.naive import naive_generate
from jaxsample.errors import ConfigError
from jaxsample.lm import LanguageModel
from jaxsample.models.families import gemma3

PROMPTS = ["signals of the raw distribution", "hi", "a third prompt, longer than that"]


def tiny_gemma() -> LanguageModel:
    """A tiny random Gemma 3 (sliding windows of 8 and 4, soft-capping, its own query scale)."""
    cfg = gemma3.Gemma3Config(vocab_size=264, dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                              head_dim=8, ffn_dim=64, layer_windows=(8, None, 4, None, 8, 3),
                              query_pre_attn_scalar=12.0, final_logit_softcapping=30.0,
                              max_seq_len=256)
    return LanguageModel(config=cfg, params=gemma3.init_params(cfg, jax.random.key(0), 0.3),
                         tokenizer=byte_tokenizer(), name="tiny-gemma")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def fam_lm(request, tiny_lm):
    return tiny_lm if request.param == "llama" else tiny_gemma()


# ---------------------------------------------------------------------------
# The float64 oracle


def oracle_signals(logits: np.ndarray) -> np.ndarray:
    """`[S, V]` raw logits (real vocabulary only) -> `[S, 3]` float64 (entropy,
    self-certainty, top-2 margin), written from the definitions."""
    x = np.asarray(logits, np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    V = x.shape[-1]
    entropy = -(p * logp).sum(-1)
    certainty = -(np.log(V) + logp).mean(-1)  # (1/V) sum_v -log(V p_v)
    top2 = np.sort(x, axis=-1)[:, -2:]
    return np.stack([entropy, certainty, top2[:, 1] - top2[:, 0]], -1)


def forward_signals(lm, prompt, toks) -> np.ndarray:
    seq = list(prompt) + [int(t) for t in toks]
    row = np.zeros((1, 96), np.int32)
    row[0, :len(seq)] = seq
    logits = np.asarray(lm.forward(row))[0, len(prompt) - 1:len(seq) - 1, :lm.vocab_limit]
    return oracle_signals(logits)


def gen_signals(g) -> np.ndarray:
    return np.stack([g.token_entropy, g.self_certainty, g.top2_margin], -1)


def check_against_forward(lm, g, min_tokens=20):
    sig = gen_signals(g)
    checked = 0
    for b in range(g.tokens.shape[0]):
        for n in range(g.tokens.shape[1]):
            L = int(g.lengths[b, n])
            ref = forward_signals(lm, g.prompt_tokens[b], g.tokens[b, n, :L])
            np.testing.assert_allclose(sig[b, n, :L], ref, atol=1e-4, rtol=0,
                                       err_msg=f"row {b} branch {n}")
            assert np.all(sig[b, n, L:] == 0.0), "padding must hold 0"
            checked += L
    assert checked >= min_tokens


# ---------------------------------------------------------------------------
# token_signals on hand-made distributions


@pytest.mark.slow
def test_token_signals_hand_made():
    V = 8
    x = np.array([2.0, 0.5, 2.0, -1.0, 0.0, 1.0, 9.0, np.nan], np.float32)  # 6, 7: padding
    got = np.asarray(sampling.token_signals(x, 6))
    np.testing.assert_allclose(got, oracle_signals(x[None, :6])[0], atol=1e-6)
    assert got[2] == 0.0  # a tie at the top: margin 0
    # uniform: entropy log V, self-certainty 0, margin 0
    np.testing.assert_allclose(np.asarray(sampling.token_signals(np.zeros(V, np.float32), V)),
                               [math.log(V), 0.0, 0.0], atol=1e-6)
    # one token alone: no uncertainty, KL 0 over a vocabulary of one, margin +inf
    one = np.asarray(sampling.token_signals(np.array([3.0, 1.0], np.float32), 1))
    assert one[0] == 0.0 and one[1] == 0.0 and one[2] == np.inf
    # a NaN logit inside the vocabulary: p = 0 there, so KL(U || p) is +inf
    nan_in = np.asarray(sampling.token_signals(np.array([1.0, np.nan, 0.0], np.float32), 3))
    np.testing.assert_allclose(nan_in[0], oracle_signals(np.array([[1.0, 0.0]]))[0, 0], atol=1e-6)
    assert nan_in[1] == np.inf
    # no distribution at all: NaN, the marker choose_token uses too
    assert np.all(np.isnan(np.asarray(sampling.token_signals(np.full(4, np.nan, np.float32), 4))))


def test_token_signals_large_vocabulary_float32():
    """At V = 262,144 (Gemma) the float32 reductions stay within 1e-4 of float64."""
    x = np.random.default_rng(0).normal(0, 4, size=(262_144,)).astype(np.float32)
    x[17] = 30.0
    got = np.asarray(sampling.token_signals(x, 262_000))
    np.testing.assert_allclose(got, oracle_signals(x[None, :262_000])[0], atol=1e-4, rtol=0)


def test_signals_param_validated():
    with pytest.raises(ConfigError, match="SamplingParams.signals must be a bool"):
        SamplingParams(signals="yes")
    assert SamplingParams().signals is False


# ---------------------------------------------------------------------------
# The engine: signals equal the forward oracle


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=24, seed=3, temperature=0.0, signals=True),
    SamplingParams(n=3, max_new_tokens=24, seed=3, temperature=0.9, signals=True),
], ids=["greedy", "sampled"])
def test_signals_equal_the_forward(fam_lm, params):
    g = engine.generate(fam_lm, PROMPTS, params)
    assert g.self_certainty.shape == g.tokens.shape and g.self_certainty.dtype == np.float32
    check_against_forward(fam_lm, g, min_tokens=9 * 10)


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=16, seed=5, temperature=1.7, top_k=5, top_p=0.8,
                   min_p=0.05, signals=True),
    SamplingParams(n=3, max_new_tokens=16, seed=5, temperature=0.7, repetition_penalty=1.8,
                   frequency_penalty=1.0, presence_penalty=0.5, signals=True),
    SamplingParams(n=2, max_new_tokens=16, seed=5, logit_bias={104: 10.0, 101: 9.0},
                   min_tokens=8, signals=True),
], ids=["temperature-filters", "penalties", "bias-min-tokens"])
def test_signals_are_those_of_the_raw_distribution(tiny_lm, params):
    """Processors and filters change the tokens, never the signals of the raw
    distribution the tokens were drawn from."""
    g = engine.generate(tiny_lm, PROMPTS[:2], params)
    check_against_forward(tiny_lm, g)
    if params.logit_bias:  # control: the bias did change the distribution sampled from
        assert np.isin(g.tokens, [101, 104]).mean() > 0.5


@pytest.mark.slow
def test_shared_equals_naive(fam_lm):
    params = SamplingParams(n=3, max_new_tokens=16, seed=9, temperature=0.9, signals=True)
    a = engine.generate(fam_lm, PROMPTS, params)
    b = naive_generate(fam_lm, PROMPTS, params)
    assert_same_tokens_up_to_ties(fam_lm, a, b)
    _close_where_tokens_agree(a, b)


def _close_where_tokens_agree(a, b, atol=1e-5):
    for r in range(a.tokens.shape[0]):
        for n in range(a.tokens.shape[1]):
            t = first_difference(a.tokens[r, n], b.tokens[r, n])
            upto = a.tokens.shape[2] if t is None else t + 1  # token t's distribution too
            np.testing.assert_allclose(gen_signals(a)[r, n, :upto], gen_signals(b)[r, n, :upto],
                                       atol=atol, rtol=0, err_msg=f"row {r} branch {n}")


@pytest.mark.slow
def test_chunked_and_compacted_equal_one_call(tiny_lm):
    params = SamplingParams(n=4, max_new_tokens=24, seed=2, temperature=0.9, signals=True,
                            stop_token_ids=[ord("e")])
    one = engine.generate(tiny_lm, PROMPTS, params)
    chunked = engine.generate(tiny_lm, PROMPTS, params, chunk_size=5)
    # one program whatever the chunk size: bit-identical
    np.testing.assert_array_equal(chunked.tokens, one.tokens)
    np.testing.assert_array_equal(gen_signals(chunked), gen_signals(one))
    compacted = engine.generate(tiny_lm, PROMPTS, params, chunk_size=3, compact=True)
    assert_same_tokens_up_to_ties(tiny_lm, one, compacted)
    _close_where_tokens_agree(one, compacted)
    assert (one.lengths < 24).any()  # some branches stopped: compaction had work to do


@pytest.mark.slow
@pytest.mark.multidevice
def test_sharded_equals_unsharded(tiny_lm):
    """On a (data 2, branch 2) mesh, with compaction: the signals travel with their branch."""
    params = SamplingParams(n=4, max_new_tokens=16, seed=6, temperature=0.9, signals=True,
                            stop_token_ids=[ord("e")])
    one = engine.generate(tiny_lm, PROMPTS[:2], params)
    mesh = jax.make_mesh((2, 2), ("data", "branch"))
    got = engine.generate(tiny_lm, PROMPTS[:2], params, mesh=mesh, chunk_size=4, compact=True)
    assert_same_tokens_up_to_ties(tiny_lm, one, got)
    _close_where_tokens_agree(one, got)


@pytest.mark.slow
def test_stream_and_stop_strings(tiny_lm):
    """The streamed Generation carries the signals; a stop string's cut zeroes them
    past the kept tokens."""
    params = SamplingParams(n=3, max_new_tokens=24, seed=4, temperature=0.9, signals=True)
    free = engine.generate(tiny_lm, PROMPTS, params)
    ascii_ = free.tokens[(free.tokens >= 33) & (free.tokens < 127)]
    params = params.replace(stop=[chr(int(np.bincount(ascii_).argmax()))])  # a common character
    g = engine.generate(tiny_lm, PROMPTS, params)
    events = list(engine.stream(tiny_lm, PROMPTS, params))
    s = events[-1].generation
    np.testing.assert_array_equal(s.tokens, g.tokens)
    np.testing.assert_array_equal(gen_signals(s), gen_signals(g))
    assert any(r == "stop" for row in g.finish_reason for r in row)
    check_against_forward(tiny_lm, g, min_tokens=9)


OFF = SamplingParams(n=3, max_new_tokens=16, seed=7, temperature=0.9)


@pytest.fixture(scope="module")
def off(tiny_lm):
    """A Generation without signals (and without top logprobs)."""
    return engine.generate(tiny_lm, PROMPTS, OFF)


@pytest.mark.slow
def test_off_changes_nothing(tiny_lm, off):
    """Off: no signals, and the step carries no extra leaf (the program is the
    one from before the option; benchmarks/selection.py --hlo-check compares
    its HLO with main's). On: the step does more work, the tokens stay."""
    from jaxsample.engine.loop import init_state
    from jaxsample.engine.state import Static
    from jaxsample.engine.step_cost import decode_step_cost

    on = engine.generate(tiny_lm, PROMPTS, OFF.replace(signals=True))
    assert off.token_entropy is None and off.self_certainty is None and off.top2_margin is None
    assert_same_tokens_up_to_ties(tiny_lm, off, on, max_ties=0)
    st = Static(cfg=tiny_lm.config, n=2, t_cap=8, vocab_limit=258, pad_id=257)
    s_off = jax.eval_shape(lambda: init_state(st, np.zeros((1, 264), np.float32),
                                              np.zeros((1,), np.int32), np.zeros((1, 2), np.int32),
                                              np.ones((1, 2), bool)))
    assert s_off.out.signals is None
    # one leaf per field, but the outputs (one per output but signals) and the tails
    # (one per layer each)
    assert len(jax.tree_util.tree_leaves(s_off)) == (
        (len(s_off) - 1) + (len(s_off.out) - 1) + 2 * (len(s_off.tail_k) - 1))
    c_off = decode_step_cost(tiny_lm.config, 32, 4, 16)
    c_on = decode_step_cost(tiny_lm.config, 32, 4, 16, signals=True)
    assert c_on.flops > c_off.flops


# ---------------------------------------------------------------------------
# Branch scores: DeepConf's trace confidences against their reference loops


def ref_tail(confs, tail):  # deepconf analysis_offline.calculate_tail_confidence
    t = confs[-tail:] if len(confs) > tail else confs
    return float(np.mean(t))


def ref_bottom(confs, window, bottom):  # calculate_bottom_window_confidence (-1: min)
    if len(confs) < window:
        return float(np.mean(confs))
    means = []
    cur = sum(confs[:window])
    means.append(cur / window)
    for i in range(1, len(confs) - window + 1):
        cur = cur - confs[i - 1] + confs[i + window - 1]
        means.append(cur / window)
    if bottom == -1:
        return float(min(means))
    k = max(1, int(len(means) * bottom))
    return float(min(means)) if k == 1 else float(np.mean(np.partition(means, k - 1)[:k]))


def test_confidence_scores_match_deepconf_reference():
    rng = np.random.default_rng(1)
    B, N, T = 2, 5, 40
    conf = rng.uniform(0, 5, size=(B, N, T))
    lengths = np.array([[40, 3, 17, 0, 25], [1, 39, 12, 40, 8]])
    conf[np.arange(T)[None, None] >= lengths[..., None]] = 0.0
    for window, tail in ((4, 6), (16, 3), (64, 64)):
        got = {k: reducers.confidence_scores(conf, lengths, k, window=window, tail=tail)
               for k in ("mean", "tail", "lowest_group", "bottom_group")}
        for b in range(B):
            for n in range(N):
                L = lengths[b, n]
                c = list(conf[b, n, :L])
                if L == 0:
                    assert all(np.isnan(got[k][b, n]) for k in got)
                    continue
                np.testing.assert_allclose(got["mean"][b, n], np.mean(c), rtol=1e-12)
                np.testing.assert_allclose(got["tail"][b, n], ref_tail(c, tail), rtol=1e-12)
                np.testing.assert_allclose(got["lowest_group"][b, n], ref_bottom(c, window, -1),
                                           rtol=1e-9)
                np.testing.assert_allclose(got["bottom_group"][b, n], ref_bottom(c, window, 0.1),
                                           rtol=1e-9)
    # the bottom-10% differs from the lowest once there are >= 20 windows
    g = reducers.confidence_scores(conf, lengths, "bottom_group", window=4)
    assert not np.allclose(g, reducers.confidence_scores(conf, lengths, "lowest_group", window=4),
                           equal_nan=True)


@pytest.fixture(scope="module")
def scored(tiny_lm):
    """4 branches of 2 prompts with the signals and the top-20 logprobs."""
    params = SamplingParams(n=4, max_new_tokens=12, seed=11, temperature=1.0, signals=True,
                            logprobs=20)
    return engine.generate(tiny_lm, PROMPTS[:2], params)


@pytest.mark.slow
def test_branch_scores_by_name(scored, off):
    g = scored
    L = g.lengths
    sc = reducers.branch_scores(g, "self-certainty")
    ref = np.array([[g.self_certainty[b, n, :L[b, n]].astype(np.float64).mean() for n in range(4)]
                    for b in range(2)])
    np.testing.assert_allclose(sc, ref, rtol=1e-12)
    top = -g.top_logprobs.astype(np.float64).mean(-1)
    for name, kind in (("tail_confidence", "tail"), ("lowest_group_confidence", "lowest_group"),
                       ("bottom-10-group-confidence", "bottom_group")):
        for source, c in (("signals", g.self_certainty), ("top_logprobs", top)):
            got = reducers.branch_scores(g, name, source=source, window=4, tail=5)
            np.testing.assert_array_equal(
                got, reducers.confidence_scores(c, L, kind, window=4, tail=5))
            idx = np.asarray(reducers.best_of_n(g, score=name, source=source, window=4, tail=5))
            np.testing.assert_array_equal(idx, np.nanargmax(got, axis=1))
    np.testing.assert_array_equal(np.asarray(reducers.best_of_n(g)),
                                  np.asarray(reducers.best_of_n(g.mean_logprob())))
    with pytest.raises(ValueError, match="score must be one of"):
        reducers.best_of_n(g, score="entropy")
    with pytest.raises(ValueError, match="need a Generation"):
        reducers.best_of_n(np.zeros((1, 2)), score="self_certainty")
    with pytest.raises(ValueError, match="SamplingParams\\(signals=True\\)"):
        reducers.branch_scores(off, "self_certainty")
    with pytest.raises(ValueError, match="logprobs=20"):
        reducers.branch_scores(off, "tail_confidence", source="top_logprobs")


# ---------------------------------------------------------------------------
# Votes: DeepConf's offline votes and Borda voting against numpy oracles


def ref_deepconf(answers, confs, valid, top_percent):
    """DeepConf's offline vote (analysis_offline: filter_top_confidence then
    weighted_majority_vote), on one row; None: no answer."""
    pool = [i for i in range(len(answers))
            if valid[i] and answers[i] >= 0 and not np.isnan(confs[i])]
    if not pool:
        return -1
    if top_percent is not None:
        thr = np.percentile([confs[i] for i in pool], (1 - top_percent / 100) * 100)
        pool = [i for i in pool if confs[i] >= thr]
    totals = {}
    for i in pool:  # insertion order = branch order: max() keeps the first on ties
        totals[answers[i]] = totals.get(answers[i], 0.0) + max(float(confs[i]), 0.0)
    return max(totals, key=lambda a: totals[a])


def ref_borda(answers, confs, valid, power):
    """Self-Certainty's Borda vote (voting_from_list.confidence_with_file), on one row."""
    pool = [i for i in range(len(answers)) if valid[i] and not np.isnan(confs[i])]
    if not any(answers[i] >= 0 for i in pool):
        return -1, None
    order = sorted(pool, key=lambda i: confs[i], reverse=True)  # stable: ties in branch order
    votes_map = {order[r]: float(len(pool) - r) ** power for r in range(len(order))}
    votes = {}
    first = {}
    for i in pool:
        if answers[i] < 0:
            continue
        first.setdefault(answers[i], i)
        votes[answers[i]] = votes.get(answers[i], 0.0) + votes_map[i]
    best = max(votes.values())
    winner = min((a for a in votes if votes[a] == best), key=lambda a: first[a])
    gap = best - max([v for a, v in votes.items() if a != winner], default=-np.inf)
    return winner, gap


HAND = [  # (answers, confidences, valid)
    ([1, 2, 2, 3, 1, 1], [0.9, 2.0, 1.8, 0.1, 0.5, 0.4], [1] * 6),  # confidence beats count
    ([5, 6, 5, 6, 7, 7], [1.0] * 6, [1] * 6),  # ties everywhere: the answer seen first
    ([1, 2, 3, 1, 2, 3], [2.0, 1.0, 3.0, 2.0, 1.0, 0.0], [0] * 6),  # all invalid
    ([4, 3, 3, 4, 2, 2], [0.0] * 6, [1] * 6),  # zero weights: the first kept answer, support 0
    ([-1, 2, -1, 2, 9, 9], [5.0, 1.0, 4.0, np.nan, 1.5, 0.2], [1] * 6),  # no answer, NaN
    ([8, 8, 8, 1, 1, 2], [3.0, 3.0, 3.0, 1.0, 1.0, 3.0], [1, 1, 0, 1, 1, 1]),  # ties at the cut
    ([-1, -1, -1, -1, -1, -1], [1.0] * 6, [1] * 6),  # nobody answered
    ([3, 1, 2, 2, 1, 3], [-0.5, 0.25, 0.75, 0.75, 0.5, 2.0], [1] * 6),  # a negative confidence
]


def _pool(rows):
    ids = np.array([r[0] for r in rows], np.int32)
    conf = np.array([r[1] for r in rows], np.float32)
    valid = np.array([r[2] for r in rows], bool)
    return ids, conf, valid


@pytest.mark.parametrize("top_percent", [None, 10, 90, 50, 33.3])
def test_confidence_vote_hand_made(top_percent):
    ids, conf, valid = _pool(HAND)
    v = reducers.confidence_vote(ids, conf, valid, top_percent=top_percent)
    want = [ref_deepconf(*r[:2], [bool(x) for x in r[2]], top_percent) for r in HAND]
    np.testing.assert_array_equal(np.asarray(v.winner), want)
    assert np.asarray(v.winner)[2] == -1 and np.asarray(v.first_branch)[2] == -1
    assert np.asarray(v.support)[3] == 0.0 and np.asarray(v.winner)[3] == 4


@pytest.mark.slow
def test_confidence_vote_random_pools():
    rng = np.random.default_rng(0)
    for trial in range(30):
        B, N = 6, (1, 7, 16, 33)[trial % 4]  # few shapes: few compiles
        ids = rng.integers(-1, 4, size=(B, N)).astype(np.int32)
        conf = rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 4.0, np.nan], size=(B, N)).astype(np.float32)
        valid = rng.random((B, N)) < 0.85
        for eta in (None, 10, 90):
            got = np.asarray(reducers.confidence_vote(ids, conf, valid, top_percent=eta).winner)
            want = [ref_deepconf(list(ids[b]), list(conf[b]), list(valid[b]), eta)
                    for b in range(B)]
            np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}, eta {eta}")


@pytest.mark.parametrize("power", [0.0, 0.5, 1.0, 2.0])
def test_borda_vote_hand_made(power):
    ids, conf, valid = _pool(HAND)
    v = reducers.borda_vote(ids, conf, valid, power=power)
    for b, r in enumerate(HAND):
        want, gap = ref_borda(r[0], r[1], [bool(x) for x in r[2]], power)
        assert gap is None or gap == 0 or gap > 1e-4  # exact ties or clear margins only
        assert int(v.winner[b]) == want, (b, power)
    # power 0 is the plain majority vote
    if power == 0.0:
        plain = reducers.majority_vote(ids, valid & ~np.isnan(conf))
        np.testing.assert_array_equal(np.asarray(v.winner), np.asarray(plain.winner))


def test_borda_vote_random_pools_and_float64():
    rng = np.random.default_rng(3)
    checked = 0
    for trial in range(30):
        B, N = 5, (2, 9, 24)[trial % 3]
        ids = rng.integers(-1, 4, size=(B, N)).astype(np.int32)
        conf = rng.normal(size=(B, N))
        conf[rng.random((B, N)) < 0.1] = np.nan
        conf[:, :2] = 1.0  # a tie in every row
        valid = rng.random((B, N)) < 0.9
        for power in (0.5, 1.0, 3.0):
            got = np.asarray(reducers.borda_vote(ids, conf, valid, power=power).winner)
            for b in range(B):
                want, gap = ref_borda(list(ids[b]), list(conf[b]), list(valid[b]), power)
                if gap is not None and 0 < gap <= 1e-4:
                    continue  # a float32 near-tie: either answer is right
                assert got[b] == want, (trial, power, b)
                checked += 1
    assert checked > 400
    # float64 confidences 1e-9 apart keep their order (ranked on the host)
    v = reducers.borda_vote(np.array([[1, 2]]), np.array([[1.0, 1.0 + 1e-9]]), power=5.0)
    assert int(v.winner[0]) == 2


def test_vote_arguments_checked():
    ids = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="top_percent"):
        reducers.confidence_vote(ids, np.ones((2, 3)), top_percent=0)
    with pytest.raises(ValueError, match="confidence must have the shape"):
        reducers.confidence_vote(ids, np.ones((2, 4)))
    with pytest.raises(ValueError, match="power"):
        reducers.borda_vote(ids, np.ones((2, 3)), power=-1.0)
    with pytest.raises(ValueError, match="int array"):
        reducers.borda_vote(np.zeros((2, 3)), np.ones((2, 3)))


def test_votes_jit_over_rows():
    """The votes are jitted programs over [B, N]: a row's outcome does not depend on the others."""
    ids, conf, valid = _pool(HAND)
    for fn in (lambda i, c, v: reducers.confidence_vote(i, c, v, top_percent=10),
               lambda i, c, v: reducers.borda_vote(i, c, v)):
        whole = np.asarray(fn(ids, conf, valid).winner)
        alone = [int(fn(ids[b:b + 1], conf[b:b + 1], valid[b:b + 1]).winner[0])
                 for b in range(len(HAND))]
        np.testing.assert_array_equal(whole, alone)


# ---------------------------------------------------------------------------
# The command line: --select NAME


@pytest.mark.slow
def test_cli_select(scored, capsys):
    from jaxsample import cli
    from jaxsample.cli import config as config_lib

    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--select", "self-certainty"])
    cfg = cli.resolve_run_config(args)
    assert cfg.reducer.kind == "best" and cfg.reducer.score == "self_certainty"
    assert cfg.sampling.signals is True
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--select",
                                          "bottom-10-group-confidence"])
    assert cli.resolve_run_config(args).reducer.score == "bottom_group_confidence"
    plain = cli.resolve_run_config(cli.build_parser().parse_args(["run", "--prompt", "x"]))
    assert plain.sampling.signals is False  # nothing changes without --select
    assert cli.main(["run", "--prompt", "x", "--select", "entropy"]) == 2
    assert "invalid choice: 'entropy'" in capsys.readouterr().err
    assert cli.main(["run", "--prompt", "x", "--select", "self-certainty", "--reduce",
                     "vote"]) == 2
    assert "--select picks the best branch" in capsys.readouterr().err
    # the reducer the command line runs: best-of-N by the named score
    g = scored
    red = config_lib.ReducerConfig(kind="best", score="self_certainty")
    best = np.asarray(reducers.best_of_n(g, score="self_certainty"))
    for row in range(2):
        result, _ = cli.batches.reduce_one(g, red, row)
        assert result["branch"] == int(best[row])
        np.testing.assert_allclose(result["score"],
                                   reducers.branch_scores(g, "self_certainty")[row, result["branch"]])


# ---------------------------------------------------------------------------
# DeepConf online on the signals


def _first_char(t):
    return t[:1] or None


@pytest.fixture(scope="module")
def pool16(tiny_lm):
    """The fixed pool of 16 branches with signals that adaptive rounds replay."""
    return engine.generate(tiny_lm, PROMPTS, SamplingParams(max_new_tokens=12, seed=7,
                                                            temperature=0.8, n=16, signals=True))


@pytest.mark.slow
@pytest.mark.parametrize("confidence", ["deepconf-low", "deepconf-high"])
def test_adaptive_deepconf_on_signals_equals_offline(tiny_lm, pool16, confidence):
    import jaxsample

    params = SamplingParams(max_new_tokens=12, seed=7, temperature=0.8)
    kw = dict(max_n=16, window=4, rule="beta", threshold=0.6, confidence=confidence, warmup=8,
              group_size=4)
    res = jaxsample.adaptive_self_consistency(tiny_lm, PROMPTS, params, extract=_first_char,
                                              confidence_source="signals", **kw)
    g = res.generation
    assert g.top_logprobs is None  # no top-k was computed or copied
    assert g.self_certainty is not None
    pool = pool16
    for b in range(len(PROMPTS)):
        rep = replay_offline(pool, b, _first_char, source="signals", **kw)
        assert (rep.n_used, rep.winner, sum(rep.terminated)) == (
            res.n_used[b], res.winner[b], res.terminated[b]), b
        assert res.share[b] == pytest.approx(rep.share, abs=1e-5)
        full = [n for n in range(res.n_used[b]) if g.finish_reason[b][n] != "terminated"]
        np.testing.assert_allclose(np.asarray(res.confidence[b])[full], [
            reducers.confidence_scores(pool.self_certainty[b:b + 1, n:n + 1],
                                       pool.lengths[b:b + 1, n:n + 1], "lowest_group",
                                       window=4)[0, 0] for n in full],
            atol=1e-5, rtol=0)  # rounds of 4 slots vs a pool of 16: other float32 programs
    assert np.all(np.isfinite(res.thresholds))
    if confidence == "deepconf-low":
        assert res.terminated.sum() > 0  # the rule had something to do
    with pytest.raises(jaxsample.errors.InputError, match="confidence_source"):
        jaxsample.adaptive_self_consistency(tiny_lm, PROMPTS, params, confidence="deepconf-low",
                                            confidence_source="entropy", **{
                                                k: v for k, v in kw.items() if k != "confidence"})
