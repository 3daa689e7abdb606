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

from jaxsample import engine, reducers, sampling
from jaxsample.errors import ConfigError
from jaxsample.lm import LanguageModel
from jaxsample.models import gemma3
from jaxsample.sampling import SamplingParams
from ties import assert_same_tokens_up_to_ties, first_difference

from conftest import byte_tokenizer

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


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, max_new_tokens=24, seed=3, temperature=0.0, signals=True),
    SamplingParams(n=3, max_new_tokens=24, seed=3, temperature=0.9, signals=True),
], ids=["greedy", "sampled"])
def test_signals_equal_the_forward(fam_lm, params):
    g = engine.generate(fam_lm, PROMPTS, params)
    assert g.self_certainty.shape == g.tokens.shape and g.self_certainty.dtype == np.float32
    check_against_forward(fam_lm, g, min_tokens=9 * 10)


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


def test_shared_equals_naive(fam_lm):
    params = SamplingParams(n=3, max_new_tokens=16, seed=9, temperature=0.9, signals=True)
    a = engine.generate(fam_lm, PROMPTS, params)
    b = engine.generate(fam_lm, PROMPTS, params, naive=True)
    assert_same_tokens_up_to_ties(fam_lm, a, b)
    _close_where_tokens_agree(a, b)


def _close_where_tokens_agree(a, b, atol=1e-5):
    for r in range(a.tokens.shape[0]):
        for n in range(a.tokens.shape[1]):
            t = first_difference(a.tokens[r, n], b.tokens[r, n])
            upto = a.tokens.shape[2] if t is None else t + 1  # token t's distribution too
            np.testing.assert_allclose(gen_signals(a)[r, n, :upto], gen_signals(b)[r, n, :upto],
                                       atol=atol, rtol=0, err_msg=f"row {r} branch {n}")


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


def test_off_changes_nothing(tiny_lm):
    """Off: no signals, and the step carries no extra leaf (the program is the
    one from before the option; benchmarks/selection.py --hlo-check compares
    its HLO with main's). On: the step does more work, the tokens stay."""
    from jaxsample.engine.loop import init_state
    from jaxsample.engine.state import Static
    from jaxsample.step_cost import decode_step_cost

    params = SamplingParams(n=3, max_new_tokens=16, seed=7, temperature=0.9)
    off = engine.generate(tiny_lm, PROMPTS, params)
    on = engine.generate(tiny_lm, PROMPTS, params.replace(signals=True))
    assert off.token_entropy is None and off.self_certainty is None and off.top2_margin is None
    assert_same_tokens_up_to_ties(tiny_lm, off, on, max_ties=0)
    st = Static(cfg=tiny_lm.config, n=2, t_cap=8, vocab_limit=258, pad_id=257)
    s_off = jax.eval_shape(lambda: init_state(st, np.zeros((1, 264), np.float32),
                                              np.zeros((1,), np.int32), np.zeros((1, 2), np.int32),
                                              np.ones((1, 2), bool)))
    assert s_off.signals is None
    assert len(jax.tree_util.tree_leaves(s_off)) == len(s_off) - 1 + 2 * (len(s_off.tail_k) - 1)
    c_off = decode_step_cost(tiny_lm.config, 32, 4, 16)
    c_on = decode_step_cost(tiny_lm.config, 32, 4, 16, signals=True)
    assert c_on.flops > c_off.flops
