"""vLLM's sampling fields: penalties, logit bias, min_tokens, ignore_eos, max_tokens,
prompt logprobs, `Generation.outputs()` and chat prompts.

Oracle: a float64 numpy reference of `sampling.process_logits` built from
`LanguageModel.forward` (a plain causal forward, no cache) on the prompt and the
engine's own generated tokens (teacher forcing: the reference at token t sees
the tokens the engine chose before t, so one float tie cannot cascade). At every
token the engine's choice must be the reference's: its argmax (greedy), or the
argmax of tempered logits + the branch's Gumbel noise over the reference keep
set (sampled; the noise is recomputed from the branch key as tests/ties.py
does), except at float ties (a score gap <= 1e-4).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import finish_in_rounds, keep_reference
from ties import _gumbel, assert_same_tokens_up_to_ties, branch_key

from jaxsample import SamplingParams, engine
from jaxsample.cli import config
from jaxsample.engine.naive import naive_generate
from jaxsample.errors import ConfigError, InputError
from jaxsample.generation import CompletionOutput, Logprob, RequestOutput

PROMPTS = ["abababab cdcdcd abab", "Hello there, branch!"]
T = 16
WIDTH = 64  # oracle sequences are right-padded to one width: one compilation
TOL = 1e-4  # allowed score gap at a float tie (raw-logit units), as tests/ties.py
EOS = 256  # the tiny model's end id (tests/conftest.py)


# --------------------------------------------------------------------------
# float64 reference
# --------------------------------------------------------------------------


def forward_rows(lm, prompt, gen) -> np.ndarray:
    """[len(gen), V] float64 raw logits of the distribution of each generated token."""
    seq = list(prompt) + list(gen)
    assert len(seq) <= WIDTH
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :len(seq)] = seq
    logits = np.asarray(lm.forward(row))[0].astype(np.float64)
    return logits[len(prompt) - 1:len(prompt) - 1 + len(gen)]


def reference_processed(lm, params: SamplingParams, prompt, gen, raw) -> np.ndarray:
    """[len(gen), V] float64: logit bias, min-tokens, repetition, frequency, presence
    (vLLM's order), padding rows at -inf."""
    V = raw.shape[1]
    bias = np.zeros(V)
    for i, b in params.logit_bias:
        bias[i] = b
    stop_all = sorted(set(lm.tokenizer.eos_token_ids) | set(params.stop_token_ids))
    prompt_mask = np.zeros(V, bool)
    prompt_mask[list(prompt)] = True
    rp = params.repetition_penalty
    out = []
    for t in range(len(gen)):
        x = raw[t] + bias
        x[lm.vocab_limit:] = -np.inf
        if t < params.min_tokens:
            x[stop_all] = -np.inf
        counts = np.bincount(np.asarray(gen[:t], np.int64), minlength=V).astype(np.float64)
        seen = counts > 0
        with np.errstate(invalid="ignore"):
            x = np.where(seen | prompt_mask, np.where(x > 0, x / rp, x * rp), x)
        x = x - params.frequency_penalty * counts - params.presence_penalty * seen
        out.append(x)
    return np.array(out).reshape(len(gen), V)


def check_against_reference(lm, g, *, prompt_index_offset: int = 0) -> dict:
    """Every generated token of `g` against the float64 reference (module docstring).

    Returns counts: steps checked, float ties, and steps where the processors
    changed the decision of the raw logits (so a test can show they did something).
    """
    p = g.params
    limit = lm.vocab_limit
    stats = dict(steps=0, ties=0, changed=0)
    B, N, _ = g.tokens.shape
    for b in range(B):
        for n in range(N):
            L = int(g.lengths[b, n])
            gen = [int(x) for x in g.tokens[b, n, :L]]
            prompt = g.prompt_tokens[b]
            raw = forward_rows(lm, prompt, gen)
            x = reference_processed(lm, p, prompt, gen, raw)
            # The reported logprobs are those of the raw distribution (vLLM's default).
            r = raw[:, :limit]
            lsm = r - r.max(1, keepdims=True)
            lsm -= np.log(np.exp(lsm).sum(1, keepdims=True))
            np.testing.assert_allclose(g.logprobs[b, n, :L], lsm[np.arange(L), gen],
                                       atol=1e-4, rtol=0, err_msg=f"row {b} branch {n}")
            for t, tok in enumerate(gen):
                assert x[t, tok] > -np.inf, f"row {b} branch {n} token {t}: masked token {tok}"
                if p.temperature == 0:
                    score, scale = x[t], 1.0
                    stats["changed"] += int(np.argmax(x[t]) != np.argmax(raw[t, :limit]))
                else:
                    keep, amb = keep_reference(x[t].astype(np.float64), p.temperature, p.top_k,
                                               p.top_p, p.min_p, limit)
                    assert keep[tok] or amb[tok], f"row {b} branch {n} token {t}: {tok} not kept"
                    z = (x[t] - x[t].max()) / p.temperature
                    noise = _gumbel(lm, branch_key(p.seed, prompt_index_offset + b, n, t))
                    score, scale = np.where(keep | amb, z + noise, -np.inf), p.temperature
                    zr = (raw[t, :limit] - raw[t, :limit].max()) / p.temperature
                    stats["changed"] += int(np.argmax(zr + noise[:limit]) != tok)
                best = int(np.argmax(score))
                stats["steps"] += 1
                if best != tok:
                    gap = score[best] - score[tok]
                    assert gap <= TOL / scale, (
                        f"row {b} branch {n} token {t}: engine chose {tok}, reference {best}, "
                        f"score gap {gap:.3g}: not a float tie")
                    stats["ties"] += 1
    assert stats["ties"] <= max(1, stats["steps"] // 50), stats
    return stats


def _same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason and a.texts == b.texts


# --------------------------------------------------------------------------
# SamplingParams: the new fields
# --------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,allowed", [
    ("max_tokens", 0, r"\[1, 2\*\*31 - 1\]"), ("max_tokens", 2**31, r"\[1, 2\*\*31 - 1\]"),
    ("max_tokens", 3.0, r"\[1, 2\*\*31 - 1\]"), ("max_tokens", True, r"\[1, 2\*\*31 - 1\]"),
    ("min_tokens", -1, r"\[0, max_new_tokens=16\]"), ("min_tokens", 17, r"\[0, max_new_tokens=16\]"),
    ("min_tokens", 1.0, r"\[0, max_new_tokens=16\]"),
    ("ignore_eos", 1, "a bool"), ("ignore_eos", "yes", "a bool"),
    ("presence_penalty", 2.01, r"\[-2, 2\]"), ("presence_penalty", -3, r"\[-2, 2\]"),
    ("presence_penalty", float("nan"), r"\[-2, 2\]"), ("presence_penalty", True, r"\[-2, 2\]"),
    ("frequency_penalty", 2.5, r"\[-2, 2\]"), ("frequency_penalty", float("inf"), r"\[-2, 2\]"),
    ("frequency_penalty", "0.1", r"\[-2, 2\]"),
    ("repetition_penalty", 0.0, "> 0"), ("repetition_penalty", -1.0, "> 0"),
    ("repetition_penalty", float("inf"), "> 0"), ("repetition_penalty", None, "> 0"),
    ("logit_bias", {-1: 1.0}, "ids in"), ("logit_bias", {1.5: 1.0}, "ids in"),
    ("logit_bias", {"x": 1.0}, "ids in"), ("logit_bias", {2**31: 1.0}, "ids in"),
    ("logit_bias", {1: float("nan")}, "finite biases"), ("logit_bias", {1: float("inf")}, "finite"),
    ("logit_bias", {1: "2"}, "finite"), ("logit_bias", "abc", "a dict"),
    ("logit_bias", [(1, 2.0, 3.0)], "pairs"), ("logit_bias", [(1, 2.0), (1, 3.0)], "repeated"),
    ("logit_bias", 5, "a dict"),
    ("prompt_logprobs", -1, r"\[0, 20\]"), ("prompt_logprobs", 21, r"\[0, 20\]"),
    ("prompt_logprobs", 1.0, r"\[0, 20\]"),
    ("top_k", -2, r"\[-1, 2\*\*31 - 1\]"),
])
def test_new_fields_are_validated_at_construction(field, value, allowed):
    with pytest.raises(ConfigError, match=rf"SamplingParams\.{field}\b") as info:
        SamplingParams(**{field: value})
    assert __import__("re").search(allowed, str(info.value)), str(info.value)


def test_max_tokens_is_max_new_tokens():
    assert SamplingParams().max_new_tokens == SamplingParams().max_tokens == 16
    p = SamplingParams(max_tokens=12)
    assert p.max_new_tokens == 12 and p.max_tokens == 12
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams(max_tokens=5, max_new_tokens=5).max_new_tokens == 5  # equal: fine
    with pytest.raises(ConfigError, match="max_tokens.*max_new_tokens.*same budget"):
        SamplingParams(max_tokens=5, max_new_tokens=6)
    # replace changes both; asdict round-trips; min_tokens is checked against the budget.
    assert p.replace(max_new_tokens=20).max_tokens == 20
    assert p.replace(max_tokens=3).max_new_tokens == 3
    assert SamplingParams(**dataclasses.asdict(p)) == p
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ConfigError, match="min_tokens"):
        SamplingParams(min_tokens=4).replace(max_tokens=3)


def test_top_k_minus_one_is_off_and_logit_bias_is_normalised():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams(top_k=0).top_k
    p = SamplingParams(logit_bias={"7": 250, 3: -0.5, np.int64(5): np.float32(-1000)})
    assert p.logit_bias == ((3, -0.5), (5, -100.0), (7, 100.0))  # sorted, clamped to [-100, 100]
    assert SamplingParams(logit_bias=[(7, 1), (3, 2)]).logit_bias == ((3, 2.0), (7, 1.0))
    assert SamplingParams(logit_bias=None).logit_bias == ()
    hash(p)
    assert not SamplingParams().logits_processors and not SamplingParams().penalties
    assert p.logits_processors and not p.penalties
    assert SamplingParams(min_tokens=1).logits_processors
    assert SamplingParams(repetition_penalty=1.1).penalties
    assert SamplingParams(presence_penalty=0.1).penalties
    np.testing.assert_array_equal(np.nonzero(p.bias_vector(10))[0], [3, 5, 7])


def test_config_files_take_the_new_fields():
    cfg = config.from_dict({"sampling": {"max_tokens": 32, "logit_bias": {5: -3.0},
                                         "repetition_penalty": 1.2, "min_tokens": 2,
                                         "ignore_eos": True, "prompt_logprobs": 1}})
    s = cfg.sampling
    assert s.max_new_tokens == 32 and s.logit_bias == ((5, -3.0),) and s.ignore_eos
    assert config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="same budget"):
        config.from_dict({"sampling": {"max_tokens": 32, "max_new_tokens": 16}})


# --------------------------------------------------------------------------
# Penalties and bias against the float64 reference
# --------------------------------------------------------------------------

SETTINGS = {
    "repetition": dict(repetition_penalty=2.0),
    "repetition<1": dict(repetition_penalty=0.5),
    "frequency": dict(frequency_penalty=2.0),
    "presence": dict(presence_penalty=-2.0),
    "bias": dict(logit_bias={97: 4.0, 98: -100.0, 32: 2.5}),
    "min_tokens": dict(min_tokens=6, logit_bias={EOS: 6.0}),
    "all": dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4,
                logit_bias={101: 2.0, EOS: 1.0}, min_tokens=3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_tokens_are_the_argmax_of_the_reference(tiny_lm, name):
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=T, seed=0, **SETTINGS[name])
    g = engine.generate(tiny_lm, PROMPTS, params)
    stats = check_against_reference(tiny_lm, g)
    assert stats["changed"] > 0, f"{name} never changed a greedy decision: the test shows nothing"


@pytest.mark.slow
@pytest.mark.parametrize("name,filters", [
    ("all", dict(temperature=0.9)),
    ("repetition", dict(temperature=0.7, top_k=20)),
    ("frequency", dict(temperature=1.0, top_p=0.9)),
    ("bias", dict(temperature=1.3, min_p=0.05)),
])
def test_sampled_tokens_are_the_reference_choice(tiny_lm, name, filters):
    params = SamplingParams(n=4, max_new_tokens=T, seed=3, **filters, **SETTINGS[name])
    g = engine.generate(tiny_lm, PROMPTS, params)
    stats = check_against_reference(tiny_lm, g)
    assert stats["changed"] > 0


@pytest.mark.slow
def test_neutral_settings_change_nothing(tiny_lm):
    base = SamplingParams(n=4, max_new_tokens=T, seed=9)
    ref = engine.generate(tiny_lm, PROMPTS, base)
    before = engine.PROGRAMS.compilations
    # Zero / one / empty: the same program (the static flag is off), bit-identical.
    neutral = base.replace(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                           logit_bias={}, min_tokens=0, max_tokens=T)
    assert not neutral.logits_processors
    _same(ref, engine.generate(tiny_lm, PROMPTS, neutral))
    assert engine.PROGRAMS.compilations == before
    # The processors on with values that change no logit (a zero bias; a frequency
    # penalty of 1e-30 keeps the counts on the device but subtracts nothing from
    # logits larger than 1e-22): another program, the same tokens up to float ties.
    for on in (dict(logit_bias={3: 0.0}), dict(frequency_penalty=1e-30, logit_bias={3: 0.0})):
        got = engine.generate(tiny_lm, PROMPTS, base.replace(**on))
        assert got.params.logits_processors
        assert_same_tokens_up_to_ties(tiny_lm, ref, got)


@pytest.mark.slow
def test_new_values_do_not_recompile(tiny_lm):
    base = SamplingParams(n=2, max_new_tokens=T, seed=1, repetition_penalty=1.2,
                          logit_bias={5: 1.0})
    engine.generate(tiny_lm, PROMPTS, base)
    before = engine.PROGRAMS.compilations
    for change in [dict(repetition_penalty=0.8), dict(frequency_penalty=1.0),
                   dict(presence_penalty=-0.5), dict(logit_bias={7: -3.0, 9: 2.0}),
                   dict(min_tokens=4), dict(ignore_eos=True), dict(temperature=0.0)]:
        engine.generate(tiny_lm, PROMPTS, base.replace(**change))
    assert engine.PROGRAMS.compilations == before


def test_chunked_equals_one_call_with_penalties(tiny_lm):
    params = SamplingParams(n=4, max_new_tokens=T, seed=7, top_p=0.9, **SETTINGS["all"])
    one = engine.generate(tiny_lm, PROMPTS, params)
    for chunk in (1, 3, 5):
        _same(one, engine.generate(tiny_lm, PROMPTS, params, chunk_size=chunk))


@pytest.mark.slow
def test_compaction_with_penalties(tiny_lm):
    """Branches stop early (stop ids); compaction gathers counts by slot and the
    prompt mask by row: tokens equal the uncompacted run up to ties and the reference."""
    base = SamplingParams(n=8, max_new_tokens=T, seed=5, repetition_penalty=1.4,
                          frequency_penalty=0.5, presence_penalty=0.3, logit_bias={100: 1.5})
    free = engine.generate(tiny_lm, PROMPTS, base)
    stops = sorted({int(x) for x in free.tokens[:, :, 6].ravel()} - {EOS})[:8]
    params = base.replace(stop_token_ids=stops)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    assert (ref.lengths < T).mean() > 0.5  # most branches stop early
    got = engine.generate(tiny_lm, PROMPTS, params, chunk_size=2, compact=True)
    assert got.bill.branch_steps < ref.bill.branch_steps  # compaction happened
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    check_against_reference(tiny_lm, got)


@pytest.mark.slow
def test_rounds_and_naive_with_penalties(tiny_lm):
    """Two rounds over one prefill and the naive engine (N prompt copies) decode with
    their own counts and prompt masks: the same tokens as one wide call."""
    params = SamplingParams(n=4, max_new_tokens=T, seed=2, repetition_penalty=1.6,
                            presence_penalty=0.5)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    s = engine.Session(tiny_lm, PROMPTS, params.replace(n=2))
    got = finish_in_rounds(s, rows=2, width=2, firsts=(0, 2), chunk=5)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    assert_same_tokens_up_to_ties(tiny_lm, ref, naive_generate(tiny_lm, PROMPTS, params))


@pytest.mark.slow
@pytest.mark.multidevice
def test_penalties_on_a_mesh(tiny_lm):
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh((2, 2), ("data", "branch"))
    params = SamplingParams(n=4, max_new_tokens=T, seed=4, logprobs=2, prompt_logprobs=1,
                            **SETTINGS["all"])
    ref = engine.generate(tiny_lm, PROMPTS, params)
    got = engine.generate(tiny_lm, PROMPTS, params, mesh=mesh)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    _same(got, engine.generate(tiny_lm, PROMPTS, params, mesh=mesh, chunk_size=3))
    for a, b in zip(ref.prompt_token_logprobs, got.prompt_token_logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


# --------------------------------------------------------------------------
# min_tokens, ignore_eos, bad ids
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_min_tokens_no_branch_ends_before(tiny_lm):
    base = SamplingParams(n=8, max_new_tokens=T, seed=5, logit_bias={EOS: 6.0})
    free = engine.generate(tiny_lm, PROMPTS, base)
    assert (free.lengths < 6).mean() > 0.5  # the boosted end id ends most branches early
    g = engine.generate(tiny_lm, PROMPTS, base.replace(min_tokens=6))
    assert np.all(g.lengths >= 6)
    assert not np.isin(g.tokens[:, :, :6], [EOS]).any()  # masked, not merely ignored
    assert "stop" in sum(g.finish_reason, [])  # and the end id stops them after that
    # Stop strings count only where they end after the first min_tokens tokens' text.
    needle = free.texts[0][0][:1] or "a"
    s = engine.generate(tiny_lm, PROMPTS, base.replace(min_tokens=6, stop=[needle],
                                                       logit_bias={}))
    assert np.all(s.lengths >= 6)
    for b in range(2):
        for n in range(8):
            if s.finish_reason[b][n] == "stop" and not s.tokens[b, n, s.lengths[b, n] - 1] == EOS:
                assert s.lengths[b, n] > 6


@pytest.mark.slow
def test_ignore_eos_runs_to_the_budget(tiny_lm):
    base = SamplingParams(n=2, max_new_tokens=T, seed=1, logit_bias={EOS: 100.0})
    g = engine.generate(tiny_lm, PROMPTS, base)
    assert np.all(g.lengths == 1) and g.tokens[0, 0, 0] == EOS  # the end id, then stop
    g = engine.generate(tiny_lm, PROMPTS, base.replace(ignore_eos=True))
    assert np.all(g.lengths == T) and np.all(g.tokens == EOS)
    assert all(r == "length" for r in sum(g.finish_reason, []))
    # stop_token_ids still stop a branch, and min_tokens still masks the end id.
    g = engine.generate(tiny_lm, PROMPTS, base.replace(ignore_eos=True, stop_token_ids=[EOS]))
    assert np.all(g.lengths == 1)
    g = engine.generate(tiny_lm, PROMPTS, base.replace(ignore_eos=True, min_tokens=3))
    assert np.all(g.lengths == T) and not np.isin(g.tokens[:, :, :3], [EOS]).any()
    assert np.all(g.tokens[:, :, 3:] == EOS)


def test_bad_logit_bias_ids_raise_before_compute(tiny_lm, monkeypatch):
    def no_compute(self):
        raise AssertionError("prefill ran before the check")

    monkeypatch.setattr(engine.Session, "_prefill", no_compute)
    for bad in ({tiny_lm.vocab_limit: 1.0}, {3: 1.0, 10_000: -2.0}):
        with pytest.raises(InputError, match=r"logit_bias.*outside the vocabulary \[0, 258\)"):
            engine.generate(tiny_lm, PROMPTS, SamplingParams(logit_bias=bad))


# --------------------------------------------------------------------------
# Prompt logprobs, ranks and outputs()
# --------------------------------------------------------------------------


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_log_softmax_of_the_forward_pass(tiny_lm, k):
    long = "The quick brown fox jumps over the lazy dog. " * 4  # 180 tokens: 3 blocks of 64
    prompts = PROMPTS + [long]
    g = engine.generate(tiny_lm, prompts, SamplingParams(n=2, max_new_tokens=4, seed=0,
                                                         prompt_logprobs=k))
    for b, ids in enumerate(g.prompt_tokens):
        lsm = _log_softmax(np.asarray(tiny_lm.forward(np.asarray([ids])))[0, :, :tiny_lm.vocab_limit]
                           .astype(np.float64))[:-1]  # [P - 1, V']: the distribution after j
        target = np.asarray(ids[1:])
        want = lsm[np.arange(len(target)), target]
        np.testing.assert_allclose(g.prompt_token_logprobs[b], want, atol=1e-4, rtol=0)
        lo = (lsm > want[:, None] + 1e-4).sum(1) + 1
        hi = (lsm >= want[:, None] - 1e-4).sum(1)
        assert np.all((lo <= g.prompt_token_ranks[b]) & (g.prompt_token_ranks[b] <= hi))
        assert g.prompt_top_logprobs[b].shape == (len(ids) - 1, k)
        np.testing.assert_allclose(g.prompt_top_logprobs[b], -np.sort(-lsm, 1)[:, :k], atol=1e-4)
        out = g.outputs()[b]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for j, d in enumerate(out.prompt_logprobs[1:]):
            first = next(iter(d))
            assert first == ids[j + 1] and len(d) <= k + 1
            assert d[first].logprob == pytest.approx(float(want[j]), abs=1e-4) or first in \
                g.prompt_top_token_ids[b][j]
    plain = engine.generate(tiny_lm, prompts, SamplingParams(n=2, max_new_tokens=4, seed=0))
    np.testing.assert_array_equal(plain.tokens, g.tokens)  # computing them changes nothing
    assert plain.prompt_token_logprobs is None and plain.outputs()[0].prompt_logprobs is None


@pytest.mark.slow
def test_outputs_are_vllm_request_outputs(tiny_lm):
    params = SamplingParams(n=3, max_new_tokens=8, seed=4, logprobs=2, stop_token_ids=[101])
    g = engine.generate(tiny_lm, PROMPTS, params)
    outs = g.outputs()
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    for b, o in enumerate(outs):
        assert o.request_id == str(b) and o.prompt == PROMPTS[b] and o.finished
        assert o.prompt_token_ids == tuple(g.prompt_tokens[b]) and o.prompt_logprobs is None
        assert [c.index for c in o.outputs] == [0, 1, 2]
        for n, c in enumerate(o.outputs):
            assert isinstance(c, CompletionOutput)
            L = int(g.lengths[b, n])
            assert c.token_ids == tuple(int(x) for x in g.tokens[b, n, :L])
            assert c.text == g.texts[b][n] and c.finish_reason == g.finish_reason[b][n]
            assert c.cumulative_logprob == pytest.approx(float(g.sum_logprob()[b, n]), abs=1e-4)
            assert len(c.logprobs) == L
            for t, d in enumerate(c.logprobs):
                tok = c.token_ids[t]
                assert next(iter(d)) == tok  # the sampled token first, as vLLM
                assert all(isinstance(v, Logprob) for v in d.values())
                assert d[tok].logprob == pytest.approx(float(g.logprobs[b, n, t]), abs=1e-5)
                top = list(g.top_token_ids[b, n, t])
                assert [d[i].rank for i in top] == [1, 2]
                assert d[tok].rank >= 1 and (tok not in top or d[tok].rank == top.index(tok) + 1)
                if tok not in top:
                    assert d[tok].rank == g.token_ranks[b, n, t] > 1
                assert d[tok].decoded_token == tiny_lm.tokenizer.decode([tok])
    # Ranks against the forward pass (within float ties).
    for b in range(2):
        for n in range(3):
            L = int(g.lengths[b, n])
            gen = g.tokens[b, n, :L]
            lsm = _log_softmax(forward_rows(tiny_lm, g.prompt_tokens[b], gen)[:, :tiny_lm.vocab_limit])
            mine = lsm[np.arange(L), gen][:, None]
            lo, hi = (lsm > mine + 1e-4).sum(1) + 1, (lsm >= mine - 1e-4).sum(1)
            assert np.all((lo <= g.token_ranks[b, n, :L]) & (g.token_ranks[b, n, :L] <= hi))
            assert np.all(g.token_ranks[b, n, L:] == 0)
    plain = engine.generate(tiny_lm, PROMPTS, params.replace(logprobs=None))
    assert plain.token_ranks is None and plain.outputs()[0].outputs[0].logprobs is None
    np.testing.assert_array_equal(plain.tokens, g.tokens)


# --------------------------------------------------------------------------
# Chat prompts
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_prompts_strings_and_message_lists(tiny_lm):
    tok = tiny_lm.tokenizer
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    params = SamplingParams(n=1, max_new_tokens=2, seed=0)
    g = engine.generate(tiny_lm, ["hello", convo], params, chat=True)
    assert g.prompts[0] == tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert g.prompts[1] == tok.apply_chat_template(convo)
    assert g.prompt_tokens[1] == list(tok.encode(g.prompts[1]))
    assert g.outputs()[1].prompt == g.prompts[1]
    one = engine.generate(tiny_lm, convo, params, chat=True,  # one conversation alone
                          prompt_index_offset=1)  # the same keys as prompt 1 above
    assert one.prompts == [g.prompts[1]]
    np.testing.assert_array_equal(one.tokens[0], g.tokens[1])


@pytest.mark.parametrize("prompts,match", [
    (["ok", "ok", 5], r"prompt 2: a chat prompt must be a string or a list of "
                      r"\{'role': \.\.\., 'content': \.\.\.\} dicts, got int 5"),
    (["ok", []], r"prompt 1: a chat prompt must be .* got an empty list"),
    ([["hi", "there"]], r"prompt 0: a chat prompt must be .* got list"),
    ([[{"role": "user"}]], r"prompt 0, message 0: .*'role' and a string 'content'"),
    ([[{"role": "", "content": "x"}]], r"prompt 0, message 0"),
    ([[{"role": "user", "content": 3}]], r"prompt 0, message 0"),
    ([[1, 2, 3]], r"prompt 0: a chat prompt must be"),
    (["  "], r"prompt 0 is empty"),
])
def test_bad_chat_prompts_say_what_was_expected(tiny_lm, prompts, match):
    with pytest.raises(InputError, match=match):
        engine.generate(tiny_lm, prompts, SamplingParams(max_new_tokens=2), chat=True)


def test_messages_without_chat_are_an_input_error(tiny_lm):
    with pytest.raises(InputError, match="prompt 1 is a list of chat messages: pass chat=True"):
        engine.generate(tiny_lm, ["ok", [{"role": "user", "content": "hi"}]],
                        SamplingParams(max_new_tokens=2))
