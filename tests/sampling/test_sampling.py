"""Tests of jaxsample.engine.sampling: SamplingParams, keep_mask, choose_token, is_stop.

The handed cases live in tests/data/cases/sampling.json. Property tests
compare `keep_mask` with a float64 numpy reference of the documented
semantics (HF order, exact-k top-k with lower index first on ties, minimal
top-p prefix, inclusive min-p).
"""

from __future__ import annotations

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import keep_reference, load_cases
from hypothesis import HealthCheck, assume, given, settings

from jaxsample import SamplingParams
from jaxsample.engine.sampling import check_logprobs, choose_token, is_stop, keep_mask, pad_stop_ids
from jaxsample.errors import ConfigError, JaxsampleError, NumericalError

# The hand-written cases, tests/data/cases/sampling.json ("cases" and "stops").
_CASES = load_cases("sampling")
CASES = _CASES["cases"]
STOPS = _CASES["stops"]

LOGPROB_TOL = 1e-4

# Jitted entry points shared by all tests (filters traced, vocab_limit static).
_keep_jit = jax.jit(keep_mask, static_argnames="vocab_limit")
_choose_jit = jax.jit(choose_token, static_argnames="vocab_limit")
# many draws from one distribution: vmap over keys only, parameters unbatched
_choose_keys = jax.jit(
    jax.vmap(choose_token, in_axes=(None, 0, None, None, None, None, None)),
    static_argnames="vocab_limit")


def _args(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return (np.float32(temperature), np.int32(top_k), np.float32(top_p), np.float32(min_p))


CASE_V = 8  # cases are padded with -inf logits to one shape: one compile


def _case_logits(case) -> np.ndarray:
    if "probs" in case:
        logits = np.log(np.asarray(case["probs"], np.float64)).astype(np.float32)
    else:
        logits = np.asarray(case["logits"], np.float32)
    return np.pad(logits, (0, CASE_V - logits.shape[0]), constant_values=-np.inf)


def _check_case(case):
    logits = _case_logits(case)
    v = logits.shape[0]
    args = _args(case.get("temperature", 1.0), case.get("top_k", 0),
                 case.get("top_p", 1.0), case.get("min_p", 0.0))
    keep = np.asarray(_keep_jit(logits, *args, vocab_limit=v))
    keys = jax.random.split(jax.random.key(0), 64)
    tokens, logprobs = _choose_keys(logits, keys, *args, v)
    tokens = np.asarray(tokens)
    assert keep.any(), case["name"]
    assert keep[tokens].all(), case["name"]
    if "keep" in case:
        assert np.flatnonzero(keep).tolist() == case["keep"], case["name"]
    if "token" in case:
        assert np.flatnonzero(keep).tolist() == [case["token"]], case["name"]
        assert (tokens == case["token"]).all(), case["name"]
    if "sampled" in case:
        # The case names the token; the logprob is reported for it whatever
        # the filters, so check it on draws that chose that token.
        assert case["sampled"] in np.flatnonzero(keep)
        hit = tokens == case["sampled"]
        assert hit.any(), case["name"]
        np.testing.assert_allclose(np.asarray(logprobs)[hit], case["logprob"],
                                   atol=LOGPROB_TOL)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_handed_cases_literal(case):
    _check_case(case)


def _length_by_is_stop(stop_token_ids, sampled, max_new_tokens):
    stop_ids = pad_stop_ids(stop_token_ids, size=4)
    hits = [bool(is_stop(jnp.int32(t), stop_ids)) for t in sampled[:max_new_tokens]]
    if any(hits):
        return hits.index(True) + 1, "stop"
    return min(len(sampled), max_new_tokens), "length"


@pytest.mark.parametrize("case", STOPS, ids=[c["name"] for c in STOPS])
def test_is_stop_on_stop_cases(case):
    length, reason = _length_by_is_stop(case["stop_token_ids"], case["sampled"],
                                        case.get("max_new_tokens", 64))
    assert (length, reason) == (case["length"], case["finish_reason"])


def test_is_stop_padding_and_jit():
    stop_ids = pad_stop_ids([7, 3, 7], size=5)
    assert stop_ids.dtype == np.int32
    assert stop_ids.tolist() == [7, 3, -1, -1, -1]
    f = jax.jit(jax.vmap(is_stop, in_axes=(0, None)))
    out = f(jnp.arange(9, dtype=jnp.int32), stop_ids)
    assert np.flatnonzero(np.asarray(out)).tolist() == [3, 7]
    assert not bool(is_stop(jnp.int32(0), pad_stop_ids([])))
    with pytest.raises(ValueError):
        pad_stop_ids([1, 2, 3], size=2)
    with pytest.raises(ValueError):
        pad_stop_ids([-1])


# --------------------------------------------------------------------------
# float64 reference of the documented semantics
# --------------------------------------------------------------------------



V_SMALL = 8
_values = st.sampled_from([-3.0, -1.5, -1.0, -0.5, 0.0, 0.0, 0.5, 1.0, 2.0])  # ties likely


@st.composite
def _problems(draw):
    logits = np.asarray(draw(st.lists(
        # No subnormals: XLA on CPU flushes them to zero (so -8e-45 ties with 0.0),
        # which the float64 numpy reference does not model; logits are never subnormal.
        st.one_of(_values, st.floats(-5, 5, width=32, allow_subnormal=False)), min_size=V_SMALL,
        max_size=V_SMALL)), np.float32)
    vocab_limit = draw(st.sampled_from([5, V_SMALL]))
    logits[vocab_limit:] = 50.0  # padding rows with huge logits
    temperature = draw(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.05, 3.0)))
    top_k = draw(st.integers(0, V_SMALL + 2))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0)))
    min_p = draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
    return logits, (temperature, top_k, top_p, min_p), vocab_limit


_PROP = settings(max_examples=60, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@_PROP
@given(_problems(), st.integers(0, 2**31 - 1))
def test_sampled_tokens_are_always_kept(problem, seed):
    logits, params, vocab_limit = problem
    args = _args(*params)
    keep = np.asarray(_keep_jit(logits, *args, vocab_limit=vocab_limit))
    assert keep.any()
    assert not keep[vocab_limit:].any()
    keys = jax.random.split(jax.random.key(seed), 128)
    tokens, logprobs = _choose_keys(logits, keys, *args, vocab_limit)
    tokens = np.asarray(tokens)
    assert tokens.dtype == np.int32
    assert keep[tokens].all()
    assert (tokens < vocab_limit).all()
    raw = logits[:vocab_limit].astype(np.float64)
    lsm = raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))
    np.testing.assert_allclose(np.asarray(logprobs), lsm[tokens], atol=1e-5)


def test_reference_marks_float32_ties_at_the_top_k_cut_off_as_ambiguous():
    """3 - 1.19e-7 rounds to 3 in float32: tokens 5 (0.0) and 7 (1.19e-7) tie on the device."""
    logits = np.array([-3.0] * 5 + [0.0, 3.0, 1.1920929e-07], np.float32)
    _, ambiguous = keep_reference(logits, 1.0, 2, 1.0, 0.0, 8)
    assert ambiguous[[5, 7]].all() and not ambiguous[6]


@_PROP
@given(_problems())
def test_keep_mask_matches_reference(problem):
    logits, params, vocab_limit = problem
    ref, ambiguous = keep_reference(logits, *params, vocab_limit)
    assume(not ambiguous.any())  # float32 vs float64 at a boundary: not this test's job
    keep = np.asarray(_keep_jit(logits, *_args(*params), vocab_limit=vocab_limit))
    np.testing.assert_array_equal(keep, ref)


@_PROP
@given(st.lists(st.floats(0.001, 1.0), min_size=2, max_size=V_SMALL),
       st.floats(0.01, 1.0))
def test_top_p_keeps_the_minimal_prefix_reaching_p(weights, top_p):
    probs = np.asarray(weights, np.float64) / np.sum(weights)
    logits = np.log(probs).astype(np.float32)
    padded = np.pad(logits, (0, V_SMALL - logits.shape[0]), constant_values=-np.inf)
    keep = np.asarray(_keep_jit(padded, *_args(top_p=top_p), vocab_limit=V_SMALL))
    assert not keep[logits.shape[0]:].any()
    keep = keep[:logits.shape[0]]
    p32 = np.exp(logits.astype(np.float64))
    p32 /= p32.sum()
    kept = np.sort(p32[keep])[::-1]
    dropped = p32[~keep]
    # every kept token is at least as likely as every dropped one
    assert dropped.size == 0 or kept.min() >= dropped.max()
    # the kept mass reaches p (up to the documented tolerance) ...
    assert kept.sum() >= top_p - 2e-6
    # ... and the set is minimal: without its least likely token it does not
    if kept.size > 1:
        assert kept[:-1].sum() < top_p + 2e-6


@_PROP
@given(st.lists(_values, min_size=V_SMALL, max_size=V_SMALL), st.integers(0, 2**31 - 1))
def test_greedy_is_first_argmax(values, seed):
    logits = np.asarray(values, np.float32)
    tok, lp = _choose_jit(logits, jax.random.key(seed), *_args(0.0, 2, 0.5, 0.3),
                          vocab_limit=V_SMALL)
    assert int(tok) == int(np.argmax(logits))
    assert np.isfinite(float(lp))


def test_keep_mask_at_vocabulary_scale_matches_reference():
    rng = np.random.default_rng(0)
    v = 4096
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    for params in [(1.0, 0, 0.9, 0.0), (0.7, 50, 0.95, 0.0), (1.3, 0, 0.5, 0.02),
                   (1.0, 1000, 0.99, 0.001), (0.5, 7, 1.0, 0.0)]:
        ref, ambiguous = keep_reference(logits, *params, v - 96, eps=1e-5)
        assert ambiguous.sum() <= 2
        keep = np.asarray(_keep_jit(logits, *_args(*params), vocab_limit=v - 96))
        np.testing.assert_array_equal(keep[~ambiguous], ref[~ambiguous], err_msg=str(params))
        assert 1 <= keep.sum() < v - 96


def test_padding_rows_never_chosen():
    logits = np.array([0.0, 1.0, 0.5, 1e30, 80.0, np.inf], np.float32)
    keys = jax.random.split(jax.random.key(1), 256)
    for params in [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (2.0, 2, 0.9, 0.1)]:
        tokens, logprobs = _choose_keys(logits, keys, *_args(*params), 3)
        assert (np.asarray(tokens) < 3).all()
        assert np.isfinite(np.asarray(logprobs)).all()
        keep = np.asarray(_keep_jit(logits, *_args(*params), vocab_limit=3))
        assert not keep[3:].any()


def test_minus_inf_logits_are_never_kept():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32)
    keep = np.asarray(_keep_jit(logits, *_args(), vocab_limit=4))
    assert np.flatnonzero(keep).tolist() == [1, 3]


FILTERS = [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.7, 2, 0.9, 0.1), (1.3, 0, 0.5, 0.0)]


def test_nan_logits_are_never_sampled_and_excluded_from_the_logprob():
    """A NaN logit counts as -inf: it used to make the whole row NaN (token 0, logprob NaN)."""
    logits = np.array([np.nan, 0.0, 1.0, np.nan, -1.0, np.nan], np.float32)
    keys = jax.random.split(jax.random.key(3), 256)
    finite = np.array([0.0, 1.0, -1.0])
    lse = np.log(np.exp(finite).sum())
    for params in FILTERS:
        tokens, logprobs = (np.asarray(a) for a in _choose_keys(logits, keys, *_args(*params), 6))
        assert set(tokens.tolist()) <= {1, 2, 4}, params
        np.testing.assert_allclose(logprobs, logits[tokens] - lse, atol=LOGPROB_TOL)
        keep = np.asarray(_keep_jit(logits, *_args(*params), vocab_limit=6))
        assert not keep[[0, 3, 5]].any()
    tok, _ = _choose_jit(logits, keys[0], *_args(0.0), vocab_limit=6)
    assert int(tok) == 2  # greedy ignores NaN


def test_plus_inf_logits_take_all_the_mass():
    """+inf counts as the largest float32: the +inf tokens share the mass (softmax limit)."""
    logits = np.array([0.0, np.inf, 5.0, np.inf], np.float32)
    keys = jax.random.split(jax.random.key(4), 256)
    for params in FILTERS:
        tokens, logprobs = (np.asarray(a) for a in _choose_keys(logits, keys, *_args(*params), 4))
        assert set(tokens.tolist()) <= {1, 3}, params
        np.testing.assert_allclose(logprobs, -np.log(2.0), atol=LOGPROB_TOL)
    tokens, _ = _choose_keys(logits, keys, *_args(1.0), 4)
    assert set(np.asarray(tokens).tolist()) == {1, 3}


@pytest.mark.parametrize("fill", [np.nan, -np.inf])
def test_row_without_a_distribution_is_marked_by_a_nan_logprob(fill):
    """Every valid logit NaN or -inf: token 0 and logprob NaN, the only NaN choose_token returns."""
    logits = np.array([fill, fill, fill, np.nan, 3.0], np.float32)  # row 4 is padding
    keys = jax.random.split(jax.random.key(5), 16)
    for params in FILTERS:
        tokens, logprobs = _choose_keys(logits, keys, *_args(*params), 4)
        assert (np.asarray(tokens) == 0).all() and np.isnan(np.asarray(logprobs)).all()
        keep = np.asarray(_keep_jit(logits, *_args(*params), vocab_limit=4))
        assert np.flatnonzero(keep).tolist() == [0]


def test_check_logprobs_names_the_first_bad_token():
    lp = np.zeros((2, 3, 4), np.float32)
    check_logprobs(lp)
    lp[1, 2, 3] = lp[1, 2, 1] = np.nan
    with pytest.raises(NumericalError, match=r"prompt 1, branch 2, new token 1 \(2 sampled"):
        check_logprobs(lp)
    assert issubclass(NumericalError, RuntimeError) and issubclass(NumericalError, JaxsampleError)


def _with_params(lm, **changes):
    import dataclasses

    return dataclasses.replace(lm, params={**lm.params, **changes})


@pytest.mark.slow
def test_generate_raises_on_all_nan_logits_and_ignores_one_nan_logit(tiny_lm):
    """generate never returns token 0 with logprob NaN: all-NaN logits are a NumericalError;
    a single NaN logit (a NaN row of the tied embedding) is only never sampled."""
    from jaxsample import engine

    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0)
    prompt = [[10, 20, 30]]
    final_norm = tiny_lm.params["final_norm"]
    broken = _with_params(tiny_lm, final_norm=jnp.full_like(final_norm, jnp.nan))
    with pytest.raises(NumericalError, match="prompt 0, branch 0, new token 0"):
        engine.generate(broken, prompt, params)
    embed = tiny_lm.params["embed"]
    gen = engine.generate(_with_params(tiny_lm, embed=embed.at[7].set(jnp.nan)), prompt,
                          params.replace(n=8))
    assert np.isfinite(gen.logprobs).all()
    assert (gen.tokens != 7).all()
    assert (gen.tokens[gen.logprobs < 0] != 0).any()  # real tokens, not the fallback 0


def test_tiny_and_huge_temperatures_have_no_nan():
    logits = np.array([0.0, 1.0, 0.999, -2.0], np.float32)
    keys = jax.random.split(jax.random.key(2), 64)
    for t in [1e-30, 1e-6, 1e6, 3e38]:
        for params in [(t, 0, 1.0, 0.0), (t, 2, 0.9, 0.1)]:
            tokens, logprobs = _choose_keys(logits, keys, *_args(*params), 4)
            assert np.isfinite(np.asarray(logprobs)).all()
            if t <= 1e-6:
                assert (np.asarray(tokens) == 1).all()


def _binomial_interval(n: int, p: float, alpha: float) -> tuple[int, int]:
    """Acceptance region [lo, hi] of a two-sided exact binomial test."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo, tail = 0, 0.0
    while tail + pmf[lo] <= alpha / 2:
        tail += pmf[lo]
        lo += 1
    hi, tail = n, 0.0
    while tail + pmf[hi] <= alpha / 2:
        tail += pmf[hi]
        hi -= 1
    return lo, hi


@pytest.mark.parametrize("params", [(1.0, 0, 1.0, 0.0), (1.0, 2, 0.99, 0.5)],
                         ids=["no filter", "filters on"])
def test_two_equally_likely_tokens_are_binomial(params):
    n = 1024
    logits = np.array([0.0, -30.0, 0.0, -30.0], np.float32)
    keys = jax.random.split(jax.random.key(1234), n)
    tokens = np.asarray(_choose_keys(logits, keys, *_args(*params), 4)[0])
    if params[1] == 2:
        assert set(tokens.tolist()) <= {0, 2}
    count = int(np.sum(tokens == 0))
    lo, hi = _binomial_interval(n, 0.5, 1e-6)
    assert lo <= count <= hi, (count, lo, hi)
    assert count + int(np.sum(tokens == 2)) >= n - 1


@pytest.mark.slow
def test_sampling_is_proportional_to_tempered_probs_after_top_k():
    n = 1024
    probs = np.array([0.5, 0.3, 0.2])
    logits = np.log(probs).astype(np.float32)
    keys = jax.random.split(jax.random.key(99), n)
    tokens = np.asarray(_choose_keys(logits, keys, *_args(0.5, 2, 1.0, 0.0), 3)[0])
    assert set(tokens.tolist()) <= {0, 1}
    p0 = 0.5**2 / (0.5**2 + 0.3**2)  # temperature 0.5 squares the probabilities
    lo, hi = _binomial_interval(n, p0, 1e-6)
    assert lo <= int(np.sum(tokens == 0)) <= hi


def test_filters_that_keep_everything_draw_like_no_filter():
    logits = (np.random.default_rng(3).standard_normal(32) * 2).astype(np.float32)
    keys = jax.random.split(jax.random.key(5), 64)
    off = np.asarray(_choose_keys(logits, keys, *_args(0.8, 0, 1.0, 0.0), 32)[0])
    on = np.asarray(_choose_keys(logits, keys, *_args(0.8, 32, 1.0, 1e-30), 32)[0])
    np.testing.assert_array_equal(on, off)


@pytest.mark.slow
def test_new_filter_values_do_not_recompile():
    traces = []

    @jax.jit
    def step(logits, key, temperature, top_k, top_p, min_p):
        traces.append(1)
        return jax.vmap(choose_token, in_axes=(0, 0, None, None, None, None, None))(
            logits, key, temperature, top_k, top_p, min_p, 10)

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 12)), jnp.float32)
    keys = jax.random.split(jax.random.key(0), 3)
    for params in [(1.0, 0, 1.0, 0.0), (0.0, 3, 0.5, 0.1), (0.7, 9, 0.95, 0.0),
                   (2.0, 1, 0.2, 0.9)]:
        sp = SamplingParams(temperature=params[0], top_k=params[1], top_p=params[2],
                            min_p=params[3])
        jax.block_until_ready(step(logits, keys, np.float32(sp.temperature), np.int32(sp.top_k),
                                   np.float32(sp.top_p), np.float32(sp.min_p)))
    assert len(traces) == 1


def test_unbatched_parameters_keep_a_real_cond_under_vmap():
    def branch_step(logits, key, t, k, p, m):
        return choose_token(logits, key, t, k, p, m, 16)

    args = (jnp.zeros((4, 16)), jax.random.split(jax.random.key(0), 4), *_args(1.0, 3, 0.9, 0.0))
    shared = jax.make_jaxpr(jax.vmap(branch_step, in_axes=(0, 0, None, None, None, None)))(*args)
    assert "cond[" in str(shared)


@pytest.mark.slow
def test_inside_jitted_while_loop_vmapped_over_branches():
    n_branches, steps, v, vocab_limit = 4, 6, 20, 17
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((steps, n_branches, v)),
                         jnp.float32)
    stop_ids = pad_stop_ids([16], size=2)

    @jax.jit
    def loop(key, temperature, top_k, top_p, min_p):
        choose = jax.vmap(choose_token, in_axes=(0, 0, None, None, None, None, None))

        def body(state):
            i, toks, done = state
            keys = jax.vmap(lambda b: jax.random.fold_in(jax.random.fold_in(key, b), i))(
                jnp.arange(n_branches))
            tok, _ = choose(logits[i], keys, temperature, top_k, top_p, min_p, vocab_limit)
            stop = jax.vmap(is_stop, in_axes=(0, None))(tok, stop_ids)
            return i + 1, toks.at[:, i].set(jnp.where(done, -1, tok)), done | stop

        init = (0, jnp.zeros((n_branches, steps), jnp.int32), jnp.zeros(n_branches, bool))
        return jax.lax.while_loop(lambda s: (s[0] < steps) & ~s[2].all(), body, init)[1]

    toks = np.asarray(loop(jax.random.key(7), *_args(0.9, 5, 0.9, 0.05)))
    keeps = jax.jit(jax.vmap(lambda x, *a: keep_mask(x, *a, vocab_limit),
                             in_axes=(0, None, None, None, None)))
    keep = np.asarray(keeps(logits.reshape(-1, v), *_args(0.9, 5, 0.9, 0.05)))
    keep = keep.reshape(steps, n_branches, v)
    assert toks[:, 0].min() >= 0
    for i in range(steps):
        for b in range(n_branches):
            if toks[b, i] >= 0:
                assert keep[i, b, toks[b, i]]


# --------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------


def test_sampling_params_defaults_and_conversions():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.max_new_tokens,
            sp.stop_token_ids, sp.stop, sp.seed) == (1, 1.0, 0, 1.0, 0.0, 16, (), (), None)
    sp = SamplingParams(n=np.int64(4), top_k=np.int32(5), temperature=1, seed=np.uint32(7),
                        stop_token_ids=[2, np.int64(3)], stop=["\n\n"])
    assert type(sp.n) is int and type(sp.top_k) is int and type(sp.seed) is int
    assert type(sp.temperature) is float
    assert sp.stop_token_ids == (2, 3) and sp.stop == ("\n\n",)
    assert SamplingParams(stop="###").stop == ("###",)
    hash(sp)
    assert sp.replace(n=8).n == 8 and sp.n == 4
    assert SamplingParams(temperature=0).greedy
    with pytest.raises(TypeError):
        SamplingParams(1)  # keyword-only
    with pytest.raises(dataclasses_frozen_error()):
        sp.n = 2


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 2.0), ("n", True),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", "1"), ("temperature", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", False),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.5),
    ("max_new_tokens", 0), ("max_new_tokens", 3.0),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3),
    ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop", ["ok", "\udc80"]),
    ("seed", -1), ("seed", 2**32), ("seed", 1.0), ("seed", True),
])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ConfigError)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", 2**63), ("n", 2**31), ("max_new_tokens", 2**40),
    ("stop_token_ids", [2**40]), ("stop_token_ids", [2**31 - 1]), ("stop_token_ids", [np.int64(2**31)]),
])
def test_sampling_params_rejects_values_that_overflow_int32(field, value):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}\b.*2\*\*31 - 1"):
        SamplingParams(**{field: value})


def test_sampling_params_int32_edges_are_accepted():
    sp = SamplingParams(top_k=2**31 - 1, stop_token_ids=[2**31 - 2], max_new_tokens=2**31 - 1)
    assert sp.top_k == 2**31 - 1 and sp.stop_token_ids == (2**31 - 2,)


def test_replace_validates():
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams().replace(top_p=0.0)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="vocab_limit"):
        keep_mask(jnp.zeros(4), *_args(), vocab_limit=5)
    with pytest.raises(ValueError, match=r"\[V\]"):
        choose_token(jnp.zeros((2, 4)), jax.random.key(0), *_args(), vocab_limit=4)


# --------------------------------------------------------------------------
# The top-k pre-selection (candidates=K0) against the bisection (candidates=0)
# --------------------------------------------------------------------------

_keep_k0 = jax.jit(keep_mask, static_argnames=("vocab_limit", "candidates"))
_choose_k0 = jax.jit(
    jax.vmap(choose_token, in_axes=(None, 0, None, None, None, None, None, None, None)),
    static_argnums=(6, 8))
# rows and parameters both batched: the engine's vmap(vmap(choose)) over [R, N]
_rows_k0 = jax.jit(jax.vmap(jax.vmap(
    lambda x, key, t, k, p, m, vl, k0: keep_mask(x, t, k, p, m, vl, k0),
    in_axes=(0, None, None, None, None, None, None, None)),
    in_axes=(0, None, None, None, None, None, None, None)), static_argnums=(6, 7))


def _assert_keep_equal_off_ambiguity(logits, params, vocab_limit, k0, eps=1e-4):
    """The pre-selection's keep set equals the bisection's, except at tokens whose
    top-p / min-p decision lies within eps of its boundary (float32 sums in a
    different order may round either way there: the reference says so)."""
    _, ambiguous = keep_reference(logits, *params, vocab_limit, eps=eps)
    new = np.asarray(_keep_k0(logits, *_args(*params), vocab_limit=vocab_limit, candidates=k0))
    old = np.asarray(_keep_k0(logits, *_args(*params), vocab_limit=vocab_limit, candidates=0))
    np.testing.assert_array_equal(new[~ambiguous], old[~ambiguous],
                                  err_msg=f"{params} K0={k0}")
    return new, old, ambiguous


@pytest.mark.slow
@_PROP
@given(_problems(), st.sampled_from([1, 2, 3, 5, V_SMALL]))
def test_pre_selection_keeps_the_bisection_set(problem, k0):
    """Any K0, including k > K0 and nuclei wider than K0 (the fallback), ties likely."""
    logits, params, vocab_limit = problem
    new, _, ambiguous = _assert_keep_equal_off_ambiguity(logits, params, vocab_limit, k0)
    ref, _ = keep_reference(logits, *params, vocab_limit)
    np.testing.assert_array_equal(new[~ambiguous], ref[~ambiguous])


@pytest.mark.parametrize("k0", [0, 1, 2, 3, (1, 2), (2, 8)])
def test_handed_keep_sets_on_every_path(k0):
    """The handed cases (the top-p boundary within rounding included) on the
    bisection (0), single stages and two-stage pre-selections."""
    for case in CASES:
        if "keep" in case:
            keep = _keep_k0(_case_logits(case), *_args(case.get("temperature", 1.0),
                                                        case.get("top_k", 0),
                                                        case.get("top_p", 1.0),
                                                        case.get("min_p", 0.0)),
                            vocab_limit=CASE_V, candidates=k0)
            assert np.flatnonzero(np.asarray(keep)).tolist() == case["keep"], case["name"]


@pytest.mark.parametrize("params", [
    (1.0, 0, 0.9, 0.0),     # nucleus of ~58 tokens, K0 = 4: fallback
    (1.0, 10, 0.95, 0.0),   # k > K0: fallback for top-k
    (1.0, 10, 1.0, 0.0),    # top-k alone, k > K0
    (0.5, 3, 0.99, 0.0),    # k <= K0: no fallback
    (1.0, 0, 0.3, 0.01),    # small nucleus: no fallback
])
def test_fallback_when_the_set_does_not_fit_in_k0(params):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(64) * 0.3).astype(np.float32)  # flat: wide nuclei
    new, old, _ = _assert_keep_equal_off_ambiguity(logits, params, 64, 4, eps=1e-5)
    assert new.sum() == old.sum()


def test_ties_at_the_cut_off_are_broken_by_index():
    """Seven equal logits straddle the k-th rank and the top-p boundary."""
    logits = np.array([0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, -1.0, 0.0, 1.0, -3.0],
                      np.float32)
    for k0 in (1, 3, 6, 12):
        for params in [(1.0, 4, 1.0, 0.0), (1.0, 6, 1.0, 0.0), (1.0, 0, 0.7, 0.0),
                       (1.0, 5, 0.9, 0.0), (2.0, 0, 0.8, 0.0)]:
            new, old, _ = _assert_keep_equal_off_ambiguity(logits, params, 12, k0)
            if params[1] and params[2] == 1.0:  # exactly k, the lower indices among ties
                assert new.sum() == params[1]
                assert np.flatnonzero(new).tolist() == np.flatnonzero(old).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("k0", [1, 2, 5])
def test_pre_selection_on_nan_inf_and_padding_rows(k0):
    rows = [np.array([np.nan, 0.0, 1.0, np.nan, -1.0, np.nan, 80.0, 1e30], np.float32),
            np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf, -np.inf, 0.0, 0.0], np.float32),
            np.array([0.0, np.inf, 5.0, np.inf, 1.0, 1.0, 9.0, 9.0], np.float32),
            np.array([-np.inf, np.nan, -np.inf, np.nan, -np.inf, -np.inf, 3.0, 3.0], np.float32)]
    keys = jax.random.split(jax.random.key(11), 32)
    for logits in rows:
        for params in FILTERS + [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.99, 0.0)]:
            a = _args(*params)
            new = np.asarray(_keep_k0(logits, *a, vocab_limit=6, candidates=k0))
            old = np.asarray(_keep_k0(logits, *a, vocab_limit=6, candidates=0))
            np.testing.assert_array_equal(new, old, err_msg=f"{logits} {params}")
            assert not new[6:].any() and new.any()
            tok, lp = (np.asarray(x) for x in _choose_k0(logits, keys, *a, 6, None, k0))
            tok0, lp0 = (np.asarray(x) for x in _choose_k0(logits, keys, *a, 6, None, 0))
            assert new[tok].all() and (tok < 6).all()
            np.testing.assert_array_equal(np.isnan(lp), np.isnan(lp0))
            if np.isnan(lp0).all():  # no distribution: token 0 on both paths
                assert (tok == 0).all() and (tok0 == 0).all()


def test_candidate_noise_is_the_full_draw_at_those_indices():
    """`_gumbel_at` reproduces jax.random.gumbel's value at each index (threefry
    partitionable): the pre-selection keeps the documented per-index noise."""
    from jaxsample.engine.sampling.draw import _gumbel_at

    for v, seed in [(1000, 0), (262144, 5)]:
        key = jax.random.fold_in(jax.random.key(seed), 3)
        idx = jnp.asarray([0, 1, 7, v // 2 - 1, v // 2, v - 1], jnp.int32)
        full = np.asarray(jax.random.gumbel(key, (v,), jnp.float32))[np.asarray(idx)]
        got = np.asarray(jax.jit(_gumbel_at)(jax.random.key_data(key), idx))
        np.testing.assert_allclose(got, full, rtol=1e-6, atol=1e-6)


def _assert_same_draws_up_to_ties(logits, keys, temperature, tok_a, tok_b, tol=1e-5):
    """Two programs' tokens agree except where both tokens' perturbed scores
    z + g (the documented noise of each key) tie within tol."""
    z = logits.astype(np.float64) / temperature
    for key, a, b in zip(keys, tok_a, tok_b):
        if a != b:
            g = np.asarray(jax.random.gumbel(key, logits.shape, jnp.float32), np.float64)
            assert abs(z[a] + g[a] - z[b] - g[b]) <= tol, (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("params", [(0.8, 0, 0.9, 0.0), (0.8, 5, 0.95, 0.05),
                                    (1.0, 0, 0.999, 0.0), (0.7, 20, 1.0, 0.0)])
def test_pre_selection_draws_the_bisection_tokens(params):
    """Same keep set and the same per-index noise: the same tokens (up to float
    ties between the two programs), whether the noise is drawn at the candidates
    (small sets) or over V (the fallback)."""
    logits = (np.random.default_rng(4).standard_normal(64) * 2).astype(np.float32)
    keys = jax.random.split(jax.random.key(21), 256)
    a = _args(*params)
    new = np.asarray(_choose_k0(logits, keys, *a, 64, None, 8)[0])
    old = np.asarray(_choose_k0(logits, keys, *a, 64, None, 0)[0])
    keep = np.asarray(_keep_k0(logits, *a, vocab_limit=64, candidates=8))
    assert keep[new].all()
    _assert_same_draws_up_to_ties(logits, keys, params[0], new, old)


def test_a_row_that_falls_back_does_not_change_the_others():
    """Under the engine's vmap(vmap(...)) the fallback cond is reduced over all
    rows: rows that fit keep the pre-selection's set, and every row equals the
    row computed alone."""
    rng = np.random.default_rng(9)
    sharp = (rng.standard_normal((2, 3, 64)) * 6).astype(np.float32)
    sharp[1, 2] = rng.standard_normal(64).astype(np.float32) * 0.1  # flat: falls back
    a = _args(1.0, 0, 0.9, 0.0)
    both = np.asarray(_rows_k0(sharp, None, *a, 64, 4))
    for r in range(2):
        for b in range(3):
            alone = np.asarray(_keep_k0(sharp[r, b], *a, vocab_limit=64, candidates=4))
            np.testing.assert_array_equal(both[r, b], alone)
    assert both[1, 2].sum() > 4 and both[0, 0].sum() <= 4


def _enclosing(jaxpr, names, chain=()):
    """For every equation whose primitive is in `names`, the primitives enclosing it."""
    from jax.extend import core as jcore

    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            out.append(chain)
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(sub, jcore.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jcore.Jaxpr):
                    out += _enclosing(sub, names, chain + (eqn.primitive.name,))
    return out


@pytest.mark.parametrize("flat", [False, True])
def test_per_row_knobs_draw_the_bisection_tokens(flat):
    """The engine's per-row settings (`any_sampling`, `any_filter` unbatched, the
    knobs batched over rows): greedy rows, top-k rows and nucleus rows draw the
    tokens of the bisection path, with the noise at the candidates (every set
    fits) or over V (one nearly flat slot's nucleus does not fit in 16)."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((3, 4, 64)) * 3).astype(np.float32)
    if flat:
        logits[2, 1] *= 0.02
    knobs = (np.float32([0.0, 0.8, 1.0]), np.int32([0, 5, 0]), np.float32([1.0, 1.0, 0.9]),
             np.float32([0.0, 0.0, 0.05]))
    keys = jax.random.split(jax.random.key(5), 12).reshape(3, 4)

    def draw(k0):
        one = functools.partial(choose_token, vocab_limit=64, candidates=k0,
                                any_sampling=jnp.bool_(True), any_filter=jnp.bool_(True))
        rows = jax.vmap(jax.vmap(one, in_axes=(0, 0, None, None, None, None)))
        return np.asarray(jax.jit(rows)(logits, keys, *knobs)[0])

    new, old = draw((4, 16)), draw(0)
    np.testing.assert_array_equal(new[0], logits[0].argmax(-1))  # greedy row
    for r in (1, 2):
        _assert_same_draws_up_to_ties(logits[r], keys[r], knobs[0][r], new[r], old[r])
    assert (new[1, :, None] == np.argsort(-logits[1], -1)[:, :5]).any(-1).all()  # top-5


def test_default_stages_follow_the_vocabulary():
    """A default stage of K0 runs only at V >= VOCAB_PER_CANDIDATE * K0; stages
    passed in are kept (clamped to V, sorted, 0 dropped)."""
    from jaxsample.engine.sampling.select import VOCAB_PER_CANDIDATE, check_candidates

    assert check_candidates(None, 264) == ()
    assert check_candidates(None, VOCAB_PER_CANDIDATE * 256) == (256,)
    assert check_candidates(None, 49152) == (256, 1024)
    assert check_candidates((16, 8, 0), 64) == (8, 16)
    assert check_candidates(1024, 64) == (64,)


def test_fallback_stays_behind_a_real_cond_under_the_engines_vmap():
    """The bisection's loops sit inside the reduced fallback cond (inside the
    filters' cond): a batched predicate would have turned that cond into a
    select running the bisection on every step."""
    one = functools.partial(choose_token, candidates=(8, 16))
    choose = jax.vmap(jax.vmap(one, in_axes=(0, 0, None, None, None, None, None)),
                      in_axes=(0, 0, None, None, None, None, None))
    keys = jax.random.split(jax.random.key(0), 6).reshape(2, 3)
    jaxpr = jax.make_jaxpr(lambda x, k, *a: choose(x, k, *a, 64))(
        jnp.zeros((2, 3, 64)), keys, *_args(1.0, 3, 0.9, 0.0)).jaxpr
    loops = _enclosing(jaxpr, ("while", "scan"))  # fori_loop with static bounds is a scan
    assert loops, "the bisection's fori_loops are in the program"
    for chain in loops:
        assert chain.count("cond") >= 2, chain
    assert all(c.count("cond") >= 1 for c in _enclosing(jaxpr, ("top_k",)))


def test_candidates_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="candidates"):
        keep_mask(jnp.zeros(4), *_args(), vocab_limit=4, candidates=-1)
    with pytest.raises(ValueError, match="candidates"):
        choose_token(jnp.zeros(4), jax.random.key(0), *_args(), vocab_limit=4, candidates=2.5)


# ---------------------------------------------------------------------------
# Regression tests: vLLM and Hugging Face keywords that jaxsample
# spells differently got a bare TypeError ("unexpected keyword argument").

_FOREIGN = [("num_return_sequences", 4, "num_return_sequences: use n"),
            ("do_sample", False, "do_sample: use temperature=0 for greedy"),
            ("max_length", 32, r"max_length: use max_new_tokens \(counts new tokens only"),
            ("best_of", 8, "best_of: .*use n .*best_of_n"),
            ("use_beam_search", True, "use_beam_search: beam search is not supported"),
            ("num_beams", 4, "num_beams: beam search is not supported")]


@pytest.mark.parametrize("name,value,message", _FOREIGN)
def test_foreign_keywords_name_the_jaxsample_equivalent(name, value, message):
    from jaxsample.errors import ConfigError, ForeignArgumentError

    for call in (lambda: SamplingParams(**{name: value}),
                 lambda: SamplingParams(n=2).replace(**{name: value})):
        with pytest.raises(ForeignArgumentError, match=message) as e:
            call()
        assert isinstance(e.value, TypeError) and isinstance(e.value, ConfigError)


@pytest.mark.parametrize("name,value,message", _FOREIGN)
def test_foreign_keywords_at_the_entry_points(name, value, message):
    """generate / stream / adaptive_self_consistency refuse them before any compute
    (no model is needed: the check runs before the arguments are read)."""
    import jaxsample
    from jaxsample.errors import ForeignArgumentError

    for fn in (jaxsample.generate, jaxsample.stream, jaxsample.adaptive_self_consistency):
        with pytest.raises(ForeignArgumentError, match=message):
            fn(None, ["x"], **{name: value})


def test_other_unknown_keywords_keep_pythons_error():
    import inspect

    import jaxsample
    from jaxsample.errors import ForeignArgumentError

    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'") as e:
        SamplingParams(frobnicate=1)
    assert not isinstance(e.value, ForeignArgumentError)
    with pytest.raises(TypeError, match="unexpected keyword argument 'frobnicate'"):
        jaxsample.generate(None, ["x"], frobnicate=1)
    # The signatures are kept (help(), IDEs).
    assert "n" in inspect.signature(SamplingParams).parameters
    assert "chat" in inspect.signature(jaxsample.generate).parameters
