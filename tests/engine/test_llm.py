"""The engine object `jaxsample.LLM`: one pool for mixed requests, vLLM's seed rule,
nothing recompiled for new values or new weights, vLLM's constructor keywords.

Oracle: each request run alone through `jaxsample.generate` with the same key
(its own seed and key index 0, or the engine's seed and its position), compared
branch by branch up to float ties (tests/ties.py: the pool's programs have other
shapes than the oracle's).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from ties import assert_same_tokens_up_to_ties

import jaxsample
from jaxsample import LLM, SamplingParams, engine
from jaxsample.errors import InputError, ModelLoadError
from jaxsample.tiny import make_tiny_lm

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?", "xyz",
           "q", "0123456789"]
STOPS = tuple(range(0, 256, 23))  # frequent stop ids: branches end at different lengths
SEED = 5


def mixed_params(even: bool = False):
    """Greedy and sampled, n from 1 to 16, different max_tokens, stop strings,
    penalties and logprobs on some requests only, own seeds on some. `even`: every n
    a multiple of 2 (a mesh's branch axis of 2)."""
    n = (lambda k: k + k % 2) if even else (lambda k: k)
    return [
        SamplingParams(n=n(1), temperature=0.0, max_tokens=9),
        SamplingParams(n=16, top_p=0.9, max_tokens=12, seed=3, stop_token_ids=STOPS),
        SamplingParams(n=4, temperature=0.7, top_k=20, max_tokens=7, stop=["e", "o"],
                       logprobs=3),
        SamplingParams(n=2, temperature=1.2, min_p=0.05, max_tokens=14, repetition_penalty=1.3,
                       presence_penalty=0.5, seed=9),
        SamplingParams(n=8, temperature=0.9, max_tokens=5, frequency_penalty=0.4, logprobs=0,
                       stop_token_ids=STOPS),
        SamplingParams(n=n(3), temperature=0.0, max_tokens=11, logit_bias={65: 3.0},
                       min_tokens=2),
    ]


def alone(lm, i, prompt, p, **kw):
    """Request i run alone with its key: (own seed, index 0) or (SEED, position i)."""
    key = (p.seed, 0) if p.seed is not None else (SEED, i)
    gen = jaxsample.generate(lm, [prompt], p.replace(seed=key[0]), prompt_index_offset=key[1],
                             **kw)
    return gen, key[1]


def compiles():
    """A counter of XLA backend compiles (`jax.monitoring`'s compile-duration event)."""
    seen = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return seen


COMPILES = compiles()


@pytest.fixture(scope="module")
def llm(tiny_lm):
    return LLM(tiny_lm, seed=SEED, compilation_cache=False)


def check_against_alone(lm, outs, results, params, prompts):
    ties = 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        ref, key = alone(lm, i, prompt, p)
        got = results[i]
        assert got.tokens.shape == ref.tokens.shape == (1, p.n, p.max_tokens)
        t = assert_same_tokens_up_to_ties(lm, ref, got, prompt_index_offset=key)
        ties += t
        if t == 0:
            assert got.texts == ref.texts and got.finish_reason == ref.finish_reason
            assert [o.text for o in outs[i].outputs] == ref.texts[0]
            if p.logprobs is not None:
                assert outs[i].outputs[0].logprobs is not None
                assert all(len(d) <= 1 + p.logprobs for d in outs[i].outputs[0].logprobs)
            else:
                assert outs[i].outputs[0].logprobs is None
    assert ties <= 1


def run_pool(llm, prompts, params):
    """LLM.run's plain pool: (outputs, generations) in input order."""
    reqs = [engine.Request(id=str(i), prompt=x, params=p)
            for i, (x, p) in enumerate(zip(prompts, params))]
    res = sorted(llm._pool(reqs, False), key=lambda r: r.index)
    return [r.output for r in res], [r.generation for r in res]


@pytest.mark.slow
def test_mixed_requests_run_in_one_pool_and_equal_each_alone(tiny_lm, llm):
    params = mixed_params()
    engine.PROGRAMS.clear()
    outs, gens = run_pool(llm, PROMPTS, params)
    decode_programs = [k for k in engine.PROGRAMS._cache if k[0][0] == "decode"]
    assert len(decode_programs) == 1  # one decode program for every setting
    check_against_alone(tiny_lm, outs, gens, params, PROMPTS)
    # LLM.generate is the same pool: vLLM's RequestOutputs in input order.
    got = llm.generate(PROMPTS, params)
    assert [o.request_id for o in got] == [str(i) for i in range(len(PROMPTS))]
    assert [[c.text for c in o.outputs] for o in got] == [[c.text for c in o.outputs]
                                                          for o in outs]


@pytest.mark.slow
@pytest.mark.multidevice
def test_mixed_requests_on_a_2x2_mesh_equal_each_alone(tiny_lm):
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "branch"))
    llm = LLM(tiny_lm, seed=SEED, mesh=mesh, compilation_cache=False)
    params = mixed_params(even=True)
    outs, gens = run_pool(llm, PROMPTS, params)
    check_against_alone(tiny_lm, outs, gens, params, PROMPTS)


@pytest.mark.slow
def test_changing_sampling_values_compiles_nothing(tiny_lm, llm):
    params = mixed_params()
    llm.generate(PROMPTS, params)  # warm (compiled in the test above, or here)
    changed = [
        SamplingParams(n=1, temperature=0.5, max_tokens=10, top_k=7),
        SamplingParams(n=16, top_p=0.5, max_tokens=11, seed=4, stop_token_ids=STOPS[:3]),
        SamplingParams(n=4, temperature=1.3, top_k=3, max_tokens=8, stop=["a"], logprobs=3),
        SamplingParams(n=2, temperature=0.8, min_p=0.2, max_tokens=13, repetition_penalty=1.1,
                       presence_penalty=-0.5, seed=10),
        SamplingParams(n=8, temperature=0.0, max_tokens=6, frequency_penalty=1.0, logprobs=0,
                       stop_token_ids=STOPS),
        SamplingParams(n=3, temperature=0.3, max_tokens=12, logit_bias={66: -2.0}, min_tokens=1),
    ]
    before = len(COMPILES)
    llm.generate(PROMPTS, changed)
    assert len(COMPILES) == before


@pytest.mark.slow
def test_a_request_with_its_own_seed_draws_the_same_wherever_it_stands(tiny_lm, llm):
    own = SamplingParams(n=4, max_tokens=10, seed=123)
    other = SamplingParams(n=4, max_tokens=10)
    first = llm.generate(["abc"] + ["zz"] * 5, [own] + [other] * 5)
    fifth = llm.generate(["zz"] * 5 + ["abc"], [other] * 5 + [own])
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in fifth[5].outputs]
    # Without a seed, request i draws from (the engine's seed, i): generate at offset i.
    ref = jaxsample.generate(tiny_lm, ["zz"], other.replace(seed=SEED), prompt_index_offset=3)
    assert [c.token_ids for c in first[3].outputs] == [
        tuple(int(t) for t in ref.tokens[0, n, :ref.lengths[0, n]]) for n in range(4)]
    # ... so the same prompt at two positions draws differently (with certainty here:
    # 4 branches of 10 tokens at temperature 1 over ~260 tokens).
    assert [c.token_ids for c in first[1].outputs] != [c.token_ids for c in first[2].outputs]


@pytest.mark.slow
def test_update_weights_equals_a_new_engine_without_compiling(tiny_lm):
    # The weights in the layout `jaxsample.load` gives (one dict per layer): the layout
    # the engine serves, so new weights need no conversion at all.
    from jaxsample.engine.placement import serving_params

    serve = lambda lm: dataclasses.replace(lm, params=serving_params(lm))
    base, other = serve(tiny_lm), serve(make_tiny_lm(seed=7))
    llm = LLM(base, seed=SEED, compilation_cache=False)
    params = SamplingParams(n=4, max_tokens=8, temperature=0.9)
    llm.generate(PROMPTS[:2], params)  # compiled with the old weights
    before = len(COMPILES)
    llm.update_weights(other.params)
    assert llm.params is other.params
    got = llm.generate(PROMPTS[:2], params)
    assert len(COMPILES) == before
    ref = LLM(other, seed=SEED, compilation_cache=False).generate(PROMPTS[:2], params)
    # The same programs on the same inputs: identical, not merely close.
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in ref]


def test_update_weights_refuses_a_tree_that_does_not_match(tiny_lm):
    llm = LLM(tiny_lm, compilation_cache=False)
    old = llm.params
    leaf = "wq"
    wrong_shape = jax.tree_util.tree_map(lambda a: a, old)
    wrong_shape["layers"][leaf] = np.zeros((3,), np.float32)
    with pytest.raises(InputError, match=rf"\['layers'\]\['{leaf}'\].*float32 \[3\]"):
        llm.update_weights(wrong_shape)
    wrong_dtype = jax.tree_util.tree_map(lambda a: a, old)
    wrong_dtype["layers"][leaf] = np.asarray(old["layers"][leaf], np.float16)
    with pytest.raises(InputError, match=r"float16 .* expected float32"):
        llm.update_weights(wrong_dtype)
    missing = {k: v for k, v in old.items() if k != "final_norm"}
    with pytest.raises(InputError, match="differs from llm.params"):
        llm.update_weights(missing)
    with pytest.raises(InputError, match="not a pytree|differs"):
        llm.update_weights(object())
    assert llm.params is old  # unchanged after every refusal


@pytest.mark.slow
def test_processed_logprobs_are_the_sampling_distributions(tiny_lm, llm):
    """Against a full forward pass: log softmax over the kept top-k of logits / T."""
    T, k = 0.7, 5
    p = SamplingParams(n=3, max_tokens=6, temperature=T, top_k=k, seed=1, logprobs=0,
                       logprobs_mode="processed_logprobs")
    greedy = SamplingParams(n=1, max_tokens=6, temperature=0.0, logprobs=0,
                            logprobs_mode="processed_logprobs")
    raw = p.replace(logprobs_mode="raw_logprobs")
    out, g0, r = llm.generate(["Hello"] * 3, [p, greedy, raw])
    prompt = list(out.prompt_token_ids)
    V = tiny_lm.vocab_limit
    for c_p, c_r in zip(out.outputs, r.outputs):
        assert c_p.token_ids == c_r.token_ids  # the mode changes what is reported only
        toks = list(c_p.token_ids)
        logits = np.asarray(tiny_lm.forward([prompt + toks])[0], np.float64)[:, :V]
        for t, tok in enumerate(toks):
            row = logits[len(prompt) - 1 + t]
            z = row / T
            kept = np.sort(z)[-k:]
            want = z[tok] - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
            raw_want = row[tok] - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert abs(c_p.logprobs[t][tok].logprob - want) < 1e-4
            assert abs(c_r.logprobs[t][tok].logprob - raw_want) < 1e-4
    assert all(d[t].logprob == 0.0 for d, t in zip(g0.outputs[0].logprobs,
                                                  g0.outputs[0].token_ids))  # greedy: certain
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs=2, logprobs_mode="processed_logprobs")
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="processed")


@pytest.mark.multidevice
def test_vllm_keywords_are_honoured_or_answered(tiny_lm, tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="trust_remote_code=True ignored"):
        LLM(tiny_lm, trust_remote_code=True, compilation_cache=False)
    with pytest.warns(UserWarning, match="enforce_eager"):
        LLM(tiny_lm, enforce_eager=True, compilation_cache=False)
    with pytest.raises(InputError, match=r"quantization=.*weights='int8'"):
        LLM(tiny_lm, quantization="awq")
    with pytest.raises(InputError, match="max_num_seqs=.*max_kv_bytes"):
        LLM(tiny_lm, max_num_seqs=8)
    with pytest.raises(InputError, match="unknown keyword 'no_such_option'"):
        LLM(tiny_lm, no_such_option=1)
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        LLM(tiny_lm, gpu_memory_utilization=1.5)
    with pytest.raises(InputError, match="tensor_parallel_size"):
        LLM(tiny_lm, tensor_parallel_size=0)
    llm = LLM(tiny_lm, gpu_memory_utilization=0.25, compilation_cache=False)
    from jaxsample.engine import budget

    weights = sum(a.nbytes for a in jax.tree_util.tree_leaves(tiny_lm.params))
    assert llm.max_kv_bytes == int(0.25 * budget.device_memory_bytes()) - weights
    capped = LLM(tiny_lm, max_model_len=30, compilation_cache=False)
    with pytest.raises(InputError, match="max_model_len of 30"):
        capped.generate(["x" * 20], SamplingParams(max_tokens=16))
    tp = LLM(tiny_lm, tensor_parallel_size=2, compilation_cache=False)
    assert dict(tp.mesh.shape) == {"branch": 2}
    # A hub id whose files are not on disk: refused, nothing downloaded.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="downloads nothing.*--local-dir"):
        LLM("meta-llama/Llama-3.2-1B", compilation_cache=False)


@pytest.mark.slow
def test_default_max_tokens_is_vllms_and_progress_is_quiet_off_a_terminal(llm, capfd):
    out = llm.generate("abc", SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 16  # vLLM's default max_tokens
    assert capfd.readouterr().err == ""  # stderr is not a terminal here: no progress


@pytest.mark.slow
def test_stream_yields_the_texts_generate_returns(tiny_lm, llm):
    """LLM.stream: each branch's deltas concatenate to the text LLM.generate returns
    for the same requests (the same keys: own seed, or the engine's and the position)."""
    params = [SamplingParams(n=2, max_tokens=10, seed=4, stop=["e"]),
              SamplingParams(n=3, max_tokens=7, temperature=0.0)]
    texts = {}
    events = list(llm.stream(["Hello", "ab"], params, chunk_size=3))
    assert events[-1].final and all(not e.final for e in events[:-1])
    for e in events:
        for d in e.deltas:
            texts[d.prompt, d.branch] = texts.get((d.prompt, d.branch), "") + d.text
    outs = llm.generate(["Hello", "ab"], params)
    assert texts == {(b, c.index): c.text for b, o in enumerate(outs) for c in o.outputs}
