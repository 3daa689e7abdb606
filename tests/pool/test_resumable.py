"""The resumable decode: chunks, stop strings on the way, compaction, rounds, top-k logprobs.

Oracles: the single-call run (chunked runs use the same compiled program, so
they must agree bit for bit); the uncompacted run (compaction changes shapes,
so it may differ only at float ties: tests/ties.py); a full forward pass for
the top-k logprobs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import finish_in_rounds
from ties import assert_same_tokens_up_to_ties, rows

from jaxsample import SamplingParams, engine
from jaxsample.errors import InputError

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]


def _same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason and a.texts == b.texts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_equals_one_call(tiny_lm, temperature, chunk):
    params = SamplingParams(n=4, max_new_tokens=12, seed=7, temperature=temperature, top_p=0.9)
    one = engine.generate(tiny_lm, PROMPTS, params)
    chunked = engine.generate(tiny_lm, PROMPTS, params, chunk_size=chunk)
    _same(one, chunked)
    assert chunked.bill.decode_steps == one.bill.decode_steps
    assert chunked.bill.branch_steps == one.bill.branch_steps


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_chunked_equals_one_call_on_a_mesh(tiny_lm, shape):
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh(shape, ("data", "branch"))
    params = SamplingParams(n=8, max_new_tokens=10, seed=3, top_p=0.9)
    one = engine.generate(tiny_lm, PROMPTS, params, mesh=mesh)
    _same(one, engine.generate(tiny_lm, PROMPTS, params, mesh=mesh, chunk_size=3))
    # Compaction on a mesh keeps the buckets multiples of the mesh axes.
    stop = int(one.tokens[0, 0, 1])
    p2 = params.replace(stop_token_ids=[stop])
    ref = engine.generate(tiny_lm, PROMPTS, p2, mesh=mesh)
    got = engine.generate(tiny_lm, PROMPTS, p2, mesh=mesh, chunk_size=2, compact=True)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


def _stopping_params(tiny_lm, n=8, T=24):
    """Stop ids that end most branches early, so compaction has work to do."""
    free = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=n, max_new_tokens=T, seed=5))
    stops = sorted({int(x) for x in free.tokens[:, :, 2].ravel()} - {256})[:15]  # + eos
    return SamplingParams(n=n, max_new_tokens=T, seed=5, stop_token_ids=stops)


@pytest.mark.slow
def test_compaction_never_changes_a_branchs_tokens(tiny_lm):
    params = _stopping_params(tiny_lm)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    assert (ref.lengths < params.max_new_tokens).mean() > 0.5  # most branches stop early
    got = engine.generate(tiny_lm, PROMPTS, params, chunk_size=2, compact=True)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    # Fewer slots computed: the bill counts slots x steps after compaction.
    assert got.bill.branch_steps < ref.bill.branch_steps
    assert got.bill.decoded_tokens_total == int(got.lengths.sum())


@pytest.mark.slow
def test_compaction_of_rows_whose_branches_are_done(tiny_lm):
    """The host ends rows 0 and 2 after 3 tokens: the state shrinks to row 1 alone."""
    params = SamplingParams(n=4, max_new_tokens=12, seed=5, stop_token_ids=[])
    ref = engine.generate(tiny_lm, PROMPTS, params)
    s = engine.Session(tiny_lm, PROMPTS, params)
    rnd = s.round(range(3), np.broadcast_to(np.arange(4, dtype=np.int32), (3, 4)))
    rnd.run(3)
    end = np.zeros((3, 4), bool)
    end[[0, 2]] = True
    end[1, 1:] = True  # and three branches of row 1: 1 row x 1 slot remain
    rnd.finish_slots(end)
    assert rnd.compact() and rnd.col_of.shape == (1, 1)
    while rnd.run(2):
        assert not rnd.compact()  # nothing left to gain
    got = engine.finish(s, [rnd])
    np.testing.assert_array_equal(got.lengths[[0, 2]], 3)
    np.testing.assert_array_equal(got.lengths[1, 1:], 3)
    np.testing.assert_array_equal(got.tokens[:, :, :3], ref.tokens[:, :, :3])
    one = slice(0, 1)  # the surviving branch, decoded on alone after compaction
    assert_same_tokens_up_to_ties(tiny_lm, rows(ref, 1, 2, one), rows(got, 1, 2, one),
                                  prompt_index_offset=1)
    assert got.bill.branch_steps == 3 * 3 * 4 + 9 * 1


@pytest.mark.slow
def test_a_stop_string_stops_the_decode(tiny_lm):
    """A stop string at token ~3 of a 64-token budget: decode steps far below 64."""
    free = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=1, max_new_tokens=64, seed=5,
                                                                stop_token_ids=[]))
    needle = free.texts[0][0][2:4]
    assert len(needle) == 2
    g = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=1, max_new_tokens=64, seed=5,
                                                             stop_token_ids=[], stop=[needle]))
    assert g.finish_reason[0][0] == "stop" and g.texts[0][0] == free.texts[0][0][:2]
    assert g.bill.decode_steps <= 8 + 4  # seen at the first chunk boundary (8 steps)
    assert g.bill.decoded_tokens_total == g.bill.decode_steps  # one branch
    assert g.bill.kept_tokens_per_branch == g.lengths.tolist()
    assert g.lengths[0, 0] <= g.bill.decoded_tokens_per_branch[0][0]
    np.testing.assert_array_equal(g.tokens[0, 0, :g.lengths[0, 0]],
                                  free.tokens[0, 0, :g.lengths[0, 0]])
    # Chunk size 1: seen at once, or up to 3 tokens later while a byte sequence may
    # still complete a UTF-8 character (this random model emits invalid UTF-8).
    g1 = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=1, max_new_tokens=64, seed=5,
                                                              stop_token_ids=[], stop=[needle]),
                         chunk_size=1)
    assert g1.bill.tokens_discarded <= 3 and g1.texts == g.texts


def test_incremental_text_equals_decoding_everything():
    from jaxsample.engine.stops import IncrementalText
    from jaxsample.models.checkpoints.tokenizer import ByteTokenizer

    tok = ByteTokenizer(vocab_size=258, eos_token_ids=(256,), pad_token_id=257)
    ids = list("naïve 日本 🙂 ok".encode())
    for step in (1, 2, 3, 5):
        inc = IncrementalText()
        out = "".join(inc.extend(tok, ids[i:i + step]) for i in range(0, len(ids), step))
        assert out == tok.decode(ids) == inc.text


@pytest.mark.slow
def test_rounds_over_one_prefill_equal_one_wide_call(tiny_lm):
    """Branches 0-3 then 4-7 over the same prefix cache equal generate(n=8)."""
    params = SamplingParams(n=8, max_new_tokens=10, seed=2)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    s = engine.Session(tiny_lm, PROMPTS, params.replace(n=4))
    got = finish_in_rounds(s, rows=3, width=4, firsts=(0, 4), chunk=4)
    assert got.tokens.shape == ref.tokens.shape
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    assert got.bill.prompt_tokens_prefilled == ref.bill.prompt_tokens_prefilled  # prefilled once


@pytest.mark.slow
def test_top_logprobs_equal_the_forward_pass(tiny_lm):
    k = 5
    g = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=1,
                                                         logprobs=k))
    assert g.top_logprobs.shape == (3, 2, 8, k) and g.top_token_ids.shape == (3, 2, 8, k)
    width = 64
    for b in range(3):
        for n in range(2):
            L = int(g.lengths[b, n])
            seq = list(g.prompt_tokens[b]) + list(g.tokens[b, n, :L])
            row = np.zeros((1, width), np.int32)
            row[0, :len(seq)] = seq
            logits = np.asarray(tiny_lm.forward(row))[0, len(g.prompt_tokens[b]) - 1:len(seq) - 1]
            lsm = np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, :tiny_lm.vocab_limit]), -1))
            ref = -np.sort(-lsm, axis=-1)[:, :k]
            np.testing.assert_allclose(g.top_logprobs[b, n, :L], ref, atol=1e-4, rtol=0)
            # Ids: the values they point to are the top-k values (ties may swap ids).
            picked = np.take_along_axis(lsm, g.top_token_ids[b, n, :L], axis=-1)
            np.testing.assert_allclose(picked, ref, atol=1e-4, rtol=0)
            # The sampled token's logprob is the top-k entry of its id when listed.
            for t in range(L):
                ids = list(g.top_token_ids[b, n, t])
                if g.tokens[b, n, t] in ids:
                    assert g.top_logprobs[b, n, t, ids.index(g.tokens[b, n, t])] == \
                        pytest.approx(g.logprobs[b, n, t], abs=1e-5)
            assert np.all(g.top_logprobs[b, n, L:] == 0)
    plain = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=1))
    np.testing.assert_array_equal(plain.tokens, g.tokens)  # recording them changes nothing
    assert plain.top_logprobs is None


def test_resumable_input_errors(tiny_lm):
    with pytest.raises(InputError, match="chunk_size"):
        engine.generate(tiny_lm, PROMPTS, SamplingParams(), chunk_size=0)
    from jaxsample.errors import ConfigError

    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ConfigError, match="logprobs"):
            SamplingParams(logprobs=bad)
