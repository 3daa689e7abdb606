"""The shared-prefix engine on the Gemma 3 family: sliding windows across the prefix/tail boundary.

Tiny random Gemma 3 models (window 8, several local/global patterns, a query
scale that is not 1/sqrt(D), logit soft-capping) against the family's plain
causal forward with the sliding mask (`models.families.gemma3.forward`): prompts and
tails longer than the window, so the window's lower bound crosses from the
prefix into the tail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GEMMA_WINDOWS, tiny_gemma
from ties import assert_same_tokens_up_to_ties

from jaxsample import SamplingParams, engine
from jaxsample.engine.naive import naive_generate
from jaxsample.lm import LanguageModel

PROMPTS = ["a prompt longer than the window", "hi", "sliding windows, tails > 8"]



@pytest.fixture(scope="module", params=list(GEMMA_WINDOWS), ids=list(GEMMA_WINDOWS))
def glm(request):
    return tiny_gemma(GEMMA_WINDOWS[request.param])


@pytest.fixture(scope="module")
def glm1():
    """One pattern for the checks that compare engines (they cost most)."""
    return tiny_gemma(GEMMA_WINDOWS["mixed windows"])


def _forward_logprobs(lm, prompt, gen):
    width = 96
    seq = list(prompt) + list(gen)
    row = np.zeros((1, width), np.int32)
    row[0, :len(seq)] = seq
    logits = np.asarray(lm.forward(row))[0, len(prompt) - 1:len(seq) - 1, :lm.vocab_limit]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))


@pytest.mark.slow
def test_the_window_matters(glm1):
    glm = glm1
    """Control: the tiny model's windows change its logits (else the tests prove nothing)."""
    ids = np.array([glm.tokenizer.encode(PROMPTS[0])], np.int32)
    wide = LanguageModel(config=glm.config.replace(layer_windows=(None,) * 6), params=glm.params,
                         tokenizer=glm.tokenizer)
    assert np.abs(np.asarray(glm.forward(ids)) - np.asarray(wide.forward(ids)))[0, -1].max() > 1e-2


@pytest.mark.slow
def test_logprobs_equal_the_windowed_forward(glm):
    params = SamplingParams(n=3, max_new_tokens=24, seed=3, stop_token_ids=[])
    g = engine.generate(glm, PROMPTS, params)
    checked = 0
    for b in range(3):
        for n in range(3):
            L = int(g.lengths[b, n])
            ref = _forward_logprobs(glm, g.prompt_tokens[b], g.tokens[b, n, :L])
            np.testing.assert_allclose(g.logprobs[b, n, :L], ref[np.arange(L), g.tokens[b, n, :L]],
                                       atol=1e-4, rtol=0, err_msg=f"row {b} branch {n}")
            checked += L
    assert checked >= 9 * 20  # tails well past the window of 8


@pytest.mark.slow
def test_greedy_equals_repeated_forward(glm1):
    glm = glm1
    g = engine.generate(glm, PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=20,
                                                     seed=0, stop_token_ids=[]))
    for b in range(3):
        seq = list(g.prompt_tokens[b])
        for t in range(int(g.lengths[b, 0])):
            row = np.zeros((1, 96), np.int32)
            row[0, :len(seq)] = seq
            logits = np.asarray(glm.forward(row))[0, len(seq) - 1, :glm.vocab_limit]
            best = int(np.argmax(logits))
            if best != int(g.tokens[b, 0, t]):  # a float tie only; the paths part there
                assert logits[best] - logits[int(g.tokens[b, 0, t])] <= 1e-4, (b, t)
                break
            seq.append(best)


@pytest.mark.slow
def test_local_layers_store_only_their_window(glm):
    """Prefix and tails of a local layer hold min(size, w - 1) positions; the bill says so."""
    params = SamplingParams(n=2, max_new_tokens=24, seed=1)
    g = engine.generate(glm, PROMPTS, params)
    cfg = glm.config
    kv = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # k and v bytes per position and layer
    P, T = engine.bucket(max(len(p) for p in g.prompt_tokens)), engine.bucket(24)
    ext = lambda n, w: n if w is None else max(min(n, w - 1), 1)
    assert g.bill.kv_bytes_shared_prefix == 3 * kv * sum(ext(P, w) for w in cfg.layer_windows)
    assert g.bill.kv_bytes_tails == 3 * 2 * kv * sum(ext(T, w) for w in cfg.layer_windows)
    full = 3 * kv * cfg.n_layers * P
    assert g.bill.kv_bytes_shared_prefix < full


@pytest.mark.slow
@pytest.mark.multidevice
def test_shared_equals_naive_chunked_and_sharded(glm1):
    glm = glm1
    params = SamplingParams(n=4, max_new_tokens=16, seed=5, top_p=0.9)
    ref = engine.generate(glm, PROMPTS, params)
    assert_same_tokens_up_to_ties(glm, ref, naive_generate(glm, PROMPTS, params))
    chunked = engine.generate(glm, PROMPTS, params, chunk_size=3)
    np.testing.assert_array_equal(chunked.tokens, ref.tokens)  # one program: bit-identical
    np.testing.assert_array_equal(chunked.logprobs, ref.logprobs)
    if jax.device_count() >= 4:
        mesh = jax.make_mesh((1, 4), ("data", "branch"))
        assert_same_tokens_up_to_ties(glm, ref, engine.generate(glm, PROMPTS, params, mesh=mesh))
