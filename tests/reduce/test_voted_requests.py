"""`jaxsample.run_requests` (reduce/requests.py): many requests, each with its
vote, plain requests through the pool and adaptive ones through
`adaptive_self_consistency`.

Oracles: the same request run alone at its global index (`engine.run_pool`
for plain requests, `adaptive_self_consistency(prompt_index_offset=i)` for
adaptive ones: the same programs, so the same draws), and `self_consistency`
on the request's own Generation for the vote.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxsample
from jaxsample import SamplingParams, engine
from jaxsample.engine.requests import Request
from jaxsample.errors import InputError
from jaxsample.reduce import adaptive as adaptive_lib


def first_char(text):  # a coarse answer, so the tiny model's branches agree often
    return text[:1] or None


PARAMS = SamplingParams(n=4, max_new_tokens=6, seed=3, temperature=1.0)
ADAPTIVE = {"max_n": 8, "window": 2, "rule": "esc", "chunk_size": 2}


@pytest.mark.slow
def test_plain_requests_carry_the_vote_of_their_own_branches(tiny_lm):
    reqs = [Request(id=f"p{i}", prompt=p, params=PARAMS, extract=first_char)
            for i, p in enumerate(["one", "two two", "three"])]
    got = {r.id: r for r in jaxsample.run_requests(tiny_lm, reqs, index_offset=5)}
    assert sorted(got) == ["p0", "p1", "p2"]
    alone = {r.id: r for r in engine.run_pool(tiny_lm, reqs, index_offset=5)}
    for rid, res in got.items():
        assert res.index == alone[rid].index == 5 + int(rid[1])
        np.testing.assert_array_equal(res.generation.tokens, alone[rid].generation.tokens)
        sc = jaxsample.self_consistency(res.generation, extract=first_char)
        assert res.vote.answer == sc.winner[0]
        assert res.vote.answers == sc.answers[0] and res.vote.n == 4
        assert res.vote.share == pytest.approx(float(sc.share[0]))
        assert res.adaptive is None


@pytest.mark.slow
def test_an_adaptive_request_is_adaptive_self_consistency_at_its_index(tiny_lm):
    reqs = [Request(id="plain", prompt="hello", params=PARAMS),
            Request(id="a1", prompt="count: 1 2 3", params=PARAMS, adaptive=ADAPTIVE,
                    extract=first_char),
            Request(id="a2", prompt="letters: a b c", params=PARAMS, adaptive=ADAPTIVE,
                    extract=first_char)]
    got = {r.id: r for r in jaxsample.run_requests(tiny_lm, reqs)}
    assert sorted(got) == ["a1", "a2", "plain"]
    ref = jaxsample.adaptive_self_consistency(tiny_lm, ["count: 1 2 3", "letters: a b c"],
                                              PARAMS, extract=first_char,
                                              prompt_index_offset=1, **ADAPTIVE)
    for b, rid in enumerate(["a1", "a2"]):
        res = got[rid]
        assert res.index == b + 1
        assert res.vote.answer == ref.winner[b]
        assert res.vote.n == int(ref.n_used[b]) and res.vote.answers == ref.answers[b]
        assert len(res.output.outputs) == res.vote.n
        assert [o.text for o in res.output.outputs] == ref.generation.texts[b][:res.vote.n]
        assert res.adaptive.winner == ref.winner
    assert got["plain"].vote.n == 4


@pytest.mark.parametrize("bad,match", [
    ({"adaptive": {"max_n": 0}}, r"request 1 \('b'\): adaptive max_n"),
    ({"adaptive": {"rule": "magic"}}, r"request 1 \('b'\): adaptive rule must be"),
    ({"adaptive": {"windw": 2}}, r"request 1 \('b'\): adaptive has unknown options \['windw'\]"),
    ({"adaptive": [2]}, r"request 1 \('b'\): adaptive must be a dict"),
    ({"extract": "nonsense"}, r"request 1 \('b'\): extract must be one of"),
    ({"prompt": ""}, r"request 1 \('b'\): prompt 0 is empty"),
    ({"prompt": 123}, r"request 1 \('b'\): prompt must be a string or a list of token ids"),
    ({"params": SamplingParams(max_tokens=100000)},
     r"request 1 \('b'\): .* max_tokens=100000 .* > the model's context"),
    ({"params": SamplingParams(n=2147483647, max_tokens=2)}, r"request 1 \('b'\): n=2147483647"),
])
def test_bad_requests_are_refused_before_any_compute(tiny_lm, bad, match):
    reqs = [{"id": "a", "prompt": "fine", "params": PARAMS}, {"id": "b", "prompt": "x", **bad}]
    before = engine.PROGRAMS.compilations
    with pytest.raises(InputError, match=match) as e:
        jaxsample.run_requests(tiny_lm, reqs)
    assert "\n" not in str(e.value)
    assert engine.PROGRAMS.compilations == before


def test_the_engine_refuses_adaptive_requests(tiny_lm):
    with pytest.raises(InputError, match="jaxsample.run_requests"):
        engine.run_pool(tiny_lm, [Request(id="a", prompt="x", adaptive=ADAPTIVE)])


def test_options_are_the_adaptive_functions_keywords():
    import inspect

    kw = inspect.signature(jaxsample.adaptive_self_consistency).parameters
    assert set(adaptive_lib.OPTIONS) <= set(kw)


@pytest.mark.parametrize("bad", ["no", 0, 1.0])
def test_compact_is_a_bool_or_none(tiny_lm, bad):
    before = engine.PROGRAMS.compilations
    with pytest.raises(InputError, match="compact must be True, False or None"):
        engine.generate(tiny_lm, ["x"], PARAMS, compact=bad)
    with pytest.raises(InputError, match="compact must be True, False or None"):
        engine.stream(tiny_lm, ["x"], PARAMS, compact=bad)
    assert engine.PROGRAMS.compilations == before


@pytest.mark.slow
def test_an_extractor_that_raises_is_named_with_its_request(tiny_lm):
    """A caller's extract callable is user code: its error names the request, the
    callable and the text, keeps the callable's exception as its cause, and the
    requests yielded before it are kept."""
    def picky(text):
        raise KeyError("no digits")

    # Lengths fixed (ignore_eos): "fine" completes at step 3, "bad" at 6.
    short, long = (PARAMS.replace(ignore_eos=True, max_new_tokens=t) for t in (3, 6))
    reqs = [Request(id="fine", prompt="one", params=short, extract=first_char),
            Request(id="bad", prompt="two", params=long, extract=picky)]
    got = []
    with pytest.raises(jaxsample.errors.ExtractError) as e:
        for res in jaxsample.run_requests(tiny_lm, reqs):
            got.append(res.id)
    msg = str(e.value)
    assert msg.startswith("request 'bad' (index 1): the extract callable ") and "picky" in msg
    assert "KeyError" in msg and "no digits" in msg and "on the text" in msg, msg
    assert isinstance(e.value.__cause__.__cause__, KeyError)
    assert got == ["fine"]
    # The adaptive path names its call's requests.
    reqs = [Request(id="ad", prompt="two", params=PARAMS, adaptive=ADAPTIVE, extract=picky)]
    with pytest.raises(jaxsample.errors.ExtractError, match=r"requests \['ad'\] .*picky"):
        list(jaxsample.run_requests(tiny_lm, reqs))


@pytest.mark.slow
def test_a_pool_the_budget_cannot_hold_is_refused_before_anything_runs(tiny_lm):
    """Requests with different max_tokens share one pool, whose tails hold the longest:
    a budget that holds the short request's pool but not the mixed one refuses the
    run up front (nothing compiled); the short request alone runs in it. Through
    `jaxsample.run_requests`, a later stretch of plain requests (after an adaptive
    one) that cannot run is refused before the first stretch computes, naming it."""
    from jaxsample.engine import budget, inputs
    from jaxsample.engine.buckets import bucket

    long = PARAMS.replace(max_new_tokens=200)
    reqs = [Request(id="a", prompt="fine", params=PARAMS),
            Request(id="b", prompt="two", params=long)]
    ids, _ = inputs.encode_prompts(tiny_lm, ["fine", "two"], False)
    p_cap = bucket(max(map(len, ids)))
    cfg = tiny_lm.config
    kv = 2 * budget.row_bytes(cfg, p_cap) + budget.slot_bytes(cfg, bucket(6))
    assert budget.plan_params(cfg, PARAMS, B=1, p_cap=p_cap, budget=kv) == (1, 1)
    with pytest.raises(InputError, match="max_kv_bytes"):  # control: the long one cannot run
        budget.plan_params(cfg, long, B=1, p_cap=p_cap, budget=kv)
    before = engine.PROGRAMS.compilations
    with pytest.raises(InputError, match=r"^max_kv_bytes=.*max_new_tokens bucket 256"):
        engine.run_pool(tiny_lm, reqs, max_kv_bytes=kv)
    stretches = [reqs[0], Request(id="ad", prompt="x", params=PARAMS, adaptive=ADAPTIVE),
                 reqs[1]]
    with pytest.raises(InputError, match=r"^requests 2-2 \(from 'b', their pool\): max_kv_bytes="):
        jaxsample.run_requests(tiny_lm, stretches, max_kv_bytes=kv)
    assert engine.PROGRAMS.compilations == before
    # The first alone runs in that budget.
    assert [r.id for r in engine.run_pool(tiny_lm, reqs[:1], max_kv_bytes=kv)] == ["a"]


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [None, {"max_n": 7, "window": 7, "rule": "esc"}])
def test_vote_shares_are_the_float32_values_the_command_line_writes(tiny_lm, adaptive):
    """3 of 7 branches: the float32 share 3/7 is 0.42857143 (its shortest decimal, what
    `run --json` writes), never float64's 0.4285714328289032."""
    from jaxsample.cli.console import dumps

    calls = []

    def cycle(text):  # branch order: a, b, c, a, b, c, a
        calls.append(text)
        return "abc"[(len(calls) - 1) % 3]

    params = SamplingParams(n=7, max_new_tokens=3, seed=1, temperature=1.0)
    (res,) = jaxsample.run_requests(tiny_lm, [Request(id="v", prompt="x", params=params,
                                                      extract=cycle, adaptive=adaptive)])
    assert res.vote.answer == "a" and res.vote.support == 3.0
    assert repr(res.vote.share) == "0.42857143" and dumps(res.vote.share) == "0.42857143"
    assert np.float32(res.vote.share) == np.float32(3) / np.float32(7)
