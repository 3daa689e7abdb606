"""The shared-prefix engine against independent oracles.

Oracles: `LanguageModel.forward` (a plain causal forward without cache) for
logprobs and greedy tokens; the naive engine (N materialised prefix copies)
for sampled tokens; `sampling.keep_mask` on the forward's logits for the
filters; the same prompt run alone for batching.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import DATA
from ties import assert_same_tokens_up_to_ties, rows

from jaxsample import SamplingParams, engine
from jaxsample.engine import sampling
from jaxsample.engine.naive import naive_generate
from jaxsample.errors import InputError

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]


WIDTH = 64  # oracle sequences are right-padded to one width: one compilation


def forward_logits(lm, seq):
    """Causal forward of one sequence padded to WIDTH: logits [len(seq), V].

    Padding at the end cannot change earlier positions of a causal model.
    """
    assert len(seq) <= WIDTH
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :len(seq)] = seq
    return np.asarray(lm.forward(row))[0, :len(seq)]


def raw_logprobs(lm, prompt_ids, gen_ids):
    """log_softmax over the real vocabulary of forward(prompt + generated): [T, V']."""
    seq = list(prompt_ids) + list(gen_ids)
    logits = forward_logits(lm, seq)[len(prompt_ids) - 1: len(seq) - 1]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, :lm.vocab_limit]), axis=-1))


def branches(gen):
    B, N, _ = gen.tokens.shape
    for b in range(B):
        for n in range(N):
            L = int(gen.lengths[b, n])
            yield b, n, gen.prompt_tokens[b], gen.tokens[b, n, :L]


@pytest.fixture(scope="module")
def sampled(tiny_lm):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    return engine.generate(tiny_lm, PROMPTS, params)


@pytest.mark.slow
def test_shapes_and_fields(sampled):
    g = sampled
    assert g.tokens.shape == (3, 4, 12) and g.tokens.dtype == np.int32
    assert g.logprobs.shape == (3, 4, 12) and g.logprobs.dtype == np.float32
    assert g.lengths.shape == (3, 4) and g.lengths.dtype == np.int32
    assert len(g.texts) == 3 and all(len(r) == 4 for r in g.texts)
    assert all(r in ("stop", "length") for row in g.finish_reason for r in row)
    assert g.params.seed == 7
    assert g.bill.kept_tokens_per_branch == g.lengths.tolist()
    assert g.bill.decoded_tokens_per_branch == g.lengths.tolist()  # no stop strings
    assert g.bill.devices == 1 and g.bill.kv_bytes_allocated == g.bill.kv_bytes_held


def test_logprobs_equal_forward_pass(tiny_lm, sampled):
    """Cached shared-prefix decode against a full forward pass, every branch, every token."""
    checked = 0
    for b, n, prompt, gen in branches(sampled):
        ref = raw_logprobs(tiny_lm, prompt, gen)
        np.testing.assert_allclose(sampled.logprobs[b, n, :len(gen)],
                                   ref[np.arange(len(gen)), gen], atol=1e-4, rtol=0)
        assert np.all(sampled.logprobs[b, n, len(gen):] == 0)
        checked += len(gen)
    assert checked > 30


def test_shared_prefix_equals_naive_copies(tiny_lm, sampled):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)
    naive = naive_generate(tiny_lm, PROMPTS, params)
    assert_same_tokens_up_to_ties(tiny_lm, sampled, naive)
    # Naive holds N prefix copies, the shared engine one.
    assert naive.bill.kv_bytes_shared_prefix == 4 * sampled.bill.kv_bytes_shared_prefix


def test_tie_oracle_rejects_a_real_difference(tiny_lm, sampled):
    """The tolerant comparison still fails on a token that is not a float tie."""
    import dataclasses

    assert assert_same_tokens_up_to_ties(tiny_lm, sampled, sampled) == 0
    tokens, logprobs = sampled.tokens.copy(), sampled.logprobs.copy()
    tokens[0, 1, 2] = (tokens[0, 1, 2] + 1) % 256
    logprobs[0, 1, 2] -= 1.0
    bad = dataclasses.replace(sampled, tokens=tokens, logprobs=logprobs)
    with pytest.raises(AssertionError, match="not a float tie"):
        assert_same_tokens_up_to_ties(tiny_lm, sampled, bad)


@pytest.mark.slow
def test_branches_differ_and_identical_prompts_differ(tiny_lm, sampled):
    assert len({tuple(t) for t in sampled.tokens[0]}) > 1
    g = engine.generate(tiny_lm, ["same", "same"], SamplingParams(n=2, max_new_tokens=10, seed=1))
    assert not np.array_equal(g.tokens[0], g.tokens[1])


def test_same_seed_same_output_other_seed_differs(tiny_lm, sampled):
    again = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=7))
    np.testing.assert_array_equal(again.tokens, sampled.tokens)
    other = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=4, max_new_tokens=12, seed=8))
    assert not np.array_equal(other.tokens, sampled.tokens)


@pytest.mark.slow
def test_batch_rows_do_not_depend_on_each_other(tiny_lm, sampled):
    """Row 0 alone equals row 0 in a batch of prompts of different lengths."""
    alone = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=4, max_new_tokens=12, seed=7))
    assert_same_tokens_up_to_ties(tiny_lm, rows(sampled, 0, 1), alone)
    # Swapping another row keeps row 1 (same prompt index) unchanged too.
    swapped = engine.generate(tiny_lm, ["x" * 40, PROMPTS[1]],
                              SamplingParams(n=4, max_new_tokens=12, seed=7))
    assert_same_tokens_up_to_ties(tiny_lm, rows(sampled, 1, 2), rows(swapped, 1, 2),
                                  prompt_index_offset=1)
    assert np.all(np.isfinite(sampled.logprobs))


@pytest.mark.slow
def test_prompt_index_offset_continues_the_batch(tiny_lm, sampled):
    """Row b of one call equals the same prompt sent alone with prompt_index_offset=b."""
    params = SamplingParams(n=4, max_new_tokens=12, seed=7)
    second = engine.generate(tiny_lm, PROMPTS[1:], params, prompt_index_offset=1)
    assert_same_tokens_up_to_ties(tiny_lm, rows(sampled, 1), second, prompt_index_offset=1)
    with pytest.raises(InputError, match="prompt_index_offset"):
        engine.generate(tiny_lm, PROMPTS, params, prompt_index_offset=-1)


@pytest.mark.slow
def test_greedy_matches_forward_and_copies(tiny_lm):
    one = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=1, temperature=0.0,
                                                           max_new_tokens=10, seed=0))
    four = engine.generate(tiny_lm, PROMPTS, SamplingParams(n=4, temperature=0.0,
                                                            max_new_tokens=10, seed=3))
    for n in range(1, 4):
        assert_same_tokens_up_to_ties(tiny_lm, rows(four, branches=slice(0, 1)),
                                      rows(four, branches=slice(n, n + 1)),
                                      branch_index_offset=n)
    assert_same_tokens_up_to_ties(tiny_lm, one, rows(four, branches=slice(0, 1)))
    for b, _, prompt, gen in branches(one):  # greedy by repeated full forward passes
        seq = list(prompt)
        for t in range(len(gen)):
            logits = forward_logits(tiny_lm, seq)[-1][:tiny_lm.vocab_limit]
            best = int(np.argmax(logits))
            if best != int(gen[t]):  # only a float tie may differ; the paths part there
                assert logits[best] - logits[int(gen[t])] <= 1e-4, (b, t)
                break
            seq.append(best)


_keep_rows = jax.jit(jax.vmap(sampling.keep_mask, in_axes=(0, None, None, None, None, None)),
                     static_argnums=5)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2),
                                   dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)])
def test_sampled_tokens_stay_in_filter_set(tiny_lm, knobs):
    params = SamplingParams(n=4, max_new_tokens=10, seed=11, **knobs)
    g = engine.generate(tiny_lm, PROMPTS[:2], params)
    for b, n, prompt, gen in branches(g):
        seq = list(prompt) + list(gen)
        logits = forward_logits(tiny_lm, seq)[len(prompt) - 1: len(seq) - 1]
        keep = np.asarray(_keep_rows(
            jnp.asarray(logits), jnp.float32(params.temperature), jnp.int32(params.top_k),
            jnp.float32(params.top_p), jnp.float32(params.min_p), tiny_lm.vocab_limit))
        assert keep[np.arange(len(gen)), gen].all(), (b, n, knobs)
        assert keep.sum(axis=1).max() < tiny_lm.vocab_limit  # the filter did filter


@pytest.mark.slow
def test_stop_token_ends_branch_and_pads(tiny_lm):
    free = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=4, max_new_tokens=12, seed=5))
    stop = int(free.tokens[0, 0, 3])  # a token that branch 0 samples at t = 3
    g = engine.generate(tiny_lm, PROMPTS[:1],
                        SamplingParams(n=4, max_new_tokens=12, seed=5, stop_token_ids=[stop]))
    for n in range(4):
        row = list(free.tokens[0, n])
        first = row.index(stop) if stop in row else None
        if first is None:
            assert g.finish_reason[0][n] == "length" and g.lengths[0, n] == 12
            np.testing.assert_array_equal(g.tokens[0, n], free.tokens[0, n])
        else:
            assert g.finish_reason[0][n] == "stop" and g.lengths[0, n] == first + 1
            np.testing.assert_array_equal(g.tokens[0, n, :first + 1], row[:first + 1])
            assert np.all(g.tokens[0, n, first + 1:] == g.pad_id)
            assert np.all(g.logprobs[0, n, first + 1:] == 0)
    assert g.finish_reason[0][0] == "stop" and g.lengths[0, 0] <= 4
    assert g.bill.decoded_tokens_total == int(g.lengths.sum())


@pytest.mark.slow
def test_stop_string_truncates_text(tiny_lm):
    free = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=2, max_new_tokens=12, seed=5))
    text = free.texts[0][0]
    needle = text[4:6]
    assert len(needle) == 2
    g = engine.generate(tiny_lm, PROMPTS[:1],
                        SamplingParams(n=2, max_new_tokens=12, seed=5, stop=[needle]))
    assert g.texts[0][0] == text[:text.find(needle)]
    assert g.finish_reason[0][0] == "stop"
    assert g.lengths[0, 0] < free.lengths[0, 0]
    kept = g.tokens[0, 0, :g.lengths[0, 0]]
    assert needle in tiny_lm.tokenizer.decode(kept)  # tokens and text agree
    assert needle not in tiny_lm.tokenizer.decode(kept[:-1])
    assert np.all(g.tokens[0, 0, g.lengths[0, 0]:] == g.pad_id)
    # The bill and the lengths state the same thing: kept = Generation.lengths, and
    # decoded = kept + the tokens decoded after the stop string and dropped.
    assert g.bill.kept_tokens_per_branch == g.lengths.tolist()
    assert g.bill.kept_tokens_total == int(g.lengths.sum())
    assert g.bill.decoded_tokens_total == g.bill.kept_tokens_total + g.bill.tokens_discarded
    assert g.bill.tokens_discarded > 0 and "after a stop string" in g.bill.summary()
    assert g.bill.to_dict()["tokens_discarded"] == g.bill.tokens_discarded
    for n in range(2):
        assert g.lengths[0, n] <= g.bill.decoded_tokens_per_branch[0][n] <= free.lengths[0, n]


@pytest.mark.slow
def test_knobs_do_not_recompile(tiny_lm):
    base = SamplingParams(n=2, max_new_tokens=9, seed=0)
    engine.generate(tiny_lm, PROMPTS, base)
    before = engine.PROGRAMS.compilations
    for change in [dict(temperature=0.3), dict(top_k=3), dict(top_p=0.5), dict(min_p=0.1),
                   dict(seed=99), dict(max_new_tokens=13), dict(temperature=0.0)]:
        engine.generate(tiny_lm, PROMPTS, base.replace(**change))
    assert engine.PROGRAMS.compilations == before


@pytest.mark.slow
def test_max_new_tokens_respected(tiny_lm):
    g = engine.generate(tiny_lm, PROMPTS[:1], SamplingParams(n=3, max_new_tokens=5, seed=2,
                                                             stop_token_ids=[]))
    assert g.tokens.shape[-1] == 5 and np.all(g.lengths <= 5)


def test_limits_raise_before_compute(tiny_lm):
    ctx = tiny_lm.config.max_seq_len
    with pytest.raises(InputError, match="context"):
        engine.generate(tiny_lm, ["x" * (ctx - 4)], SamplingParams(max_new_tokens=8))
    with pytest.raises(InputError, match="empty"):
        engine.generate(tiny_lm, [""], SamplingParams())
    with pytest.raises(InputError, match="empty"):
        engine.generate(tiny_lm, [[]], SamplingParams())
    with pytest.raises(InputError, match="outside"):
        engine.generate(tiny_lm, [[1, 2, 10_000]], SamplingParams())
    with pytest.raises(InputError):
        engine.generate(tiny_lm, [], SamplingParams())
    for bad in ([[1.7, 2.9]], [[True, False]], [["5", "6"]], [[[1, 2]]],
                [[1, tiny_lm.vocab_limit]]):  # a padding row of the embedding is not a token
        with pytest.raises(InputError, match="prompt 0"):
            engine.generate(tiny_lm, bad, SamplingParams())
    with pytest.raises(InputError, match="mesh"):
        engine.generate(tiny_lm, ["ab"], SamplingParams(), mesh="x")


def test_token_id_prompts_equal_text_prompts(tiny_lm, sampled):
    ids = [tiny_lm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(n=4, max_new_tokens=12, seed=7)
    g = engine.generate(tiny_lm, ids, params)
    np.testing.assert_array_equal(g.tokens, sampled.tokens)
    as_arrays = engine.generate(tiny_lm, [np.array(i, np.int64) for i in ids], params)
    np.testing.assert_array_equal(as_arrays.tokens, sampled.tokens)
    one = engine.generate(tiny_lm, np.array(ids[0]), params)  # [S] array: one prompt
    np.testing.assert_array_equal(one.tokens[0], sampled.tokens[0])


def test_bucket():
    assert [engine.bucket(x) for x in (1, 16, 17, 25, 1024, 1030, 1537)] == \
        [16, 16, 24, 32, 1024, 1536, 2048]
    for x in range(1, 5000, 37):
        assert x <= engine.bucket(x) < 2 * max(x, 16)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 4), (2, 4), (1, 8), (2, 2)])
def test_sharded_equals_unsharded(tiny_lm, shape):
    """Same seed, same tokens on a ("data", "branch") mesh of CPU devices."""
    if jax.device_count() < shape[0] * shape[1]:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh(shape, ("data", "branch"))
    params = SamplingParams(n=8, max_new_tokens=10, seed=3, top_p=0.9)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    got = engine.generate(tiny_lm, PROMPTS, params, mesh=mesh)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


# ---------------------------------------------------------------------------
# The real embedded model (SmolLM2-135M-Instruct): engine against transformers' greedy
# continuations (tests/data, made by scripts/make_reference.py) and against a full
# forward pass, on prompts of up to 800 tokens (short prompts miss RoPE offset bugs).


@pytest.mark.slow
def test_smollm2_engine_greedy_equals_transformers(lm):
    import json

    ref = json.loads((DATA / "smollm2_reference.json").read_text())
    names = [n for n, p in ref["prompts"].items() if "greedy" in p]
    prompts = [ref["prompts"][n]["ids"] for n in names]
    steps = len(ref["prompts"][names[0]]["greedy"]["ids"])
    g = engine.generate(lm, prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=steps,
                                                    seed=0))
    for b, n in enumerate(names):
        want = ref["prompts"][n]["greedy"]["ids"]
        for branch in range(2):
            L = int(g.lengths[b, branch])
            assert list(g.tokens[b, branch, :L]) == want[:L], n
            assert L == len(want) or want[L - 1] in lm.tokenizer.eos_token_ids


@pytest.mark.slow
def test_smollm2_sampled_logprobs_equal_forward_on_a_long_prompt(lm):
    import json

    ref = json.loads((DATA / "smollm2_reference.json").read_text())
    long_ids = max((p["ids"] for p in ref["prompts"].values()), key=len)
    assert len(long_ids) >= 500
    g = engine.generate(lm, [long_ids], SamplingParams(n=3, temperature=1.0, top_p=0.95,
                                                       max_new_tokens=8, seed=4))
    width = len(long_ids) + 8
    rows = np.zeros((3, width), np.int32)
    for n in range(3):
        L = int(g.lengths[0, n])
        rows[n, :len(long_ids) + L] = list(long_ids) + list(g.tokens[0, n, :L])
    logits = np.asarray(lm.forward(rows))
    for n in range(3):
        L = int(g.lengths[0, n])
        lp = np.asarray(jax.nn.log_softmax(
            jnp.asarray(logits[n, len(long_ids) - 1: len(long_ids) - 1 + L, :lm.vocab_limit]), -1))
        np.testing.assert_allclose(g.logprobs[0, n, :L], lp[np.arange(L), g.tokens[0, n, :L]],
                                   atol=1e-4, rtol=0)


def _needs_devices(k):
    if jax.device_count() < k:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")


@pytest.mark.slow
@pytest.mark.multidevice
def test_padding_rows_of_a_data_axis_start_done_and_are_not_billed(tiny_lm):
    """3 prompts on a data axis of 2: the 4th (padding) row must not keep decoding."""
    _needs_devices(4)
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, seed=0, stop_token_ids=[])
    free = engine.generate(tiny_lm, PROMPTS, greedy)
    # Stop every real branch within 3 tokens: stop ids = their greedy tokens 0-2.
    stops = sorted({int(x) for x in free.tokens[:, 0, :3].ravel()})
    params = greedy.replace(stop_token_ids=stops)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    assert ref.bill.decode_steps <= 3
    got = engine.generate(tiny_lm, PROMPTS, params, mesh=jax.make_mesh((2, 2), ("data", "branch")))
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    assert got.bill.decode_steps == ref.bill.decode_steps
    assert got.bill.kv_bytes_shared_prefix == ref.bill.kv_bytes_shared_prefix
    assert got.bill.kv_bytes_tails == ref.bill.kv_bytes_tails
    assert got.bill.decoded_tokens_total == ref.bill.decoded_tokens_total


@pytest.mark.slow
@pytest.mark.multidevice
def test_mesh_bill_reports_per_device_and_total(tiny_lm):
    """The prefix is replicated on every device of the branch axis: the bill says so."""
    _needs_devices(4)
    params = SamplingParams(n=8, max_new_tokens=10, seed=3)
    ref = engine.generate(tiny_lm, PROMPTS[:2], params)
    got = engine.generate(tiny_lm, PROMPTS[:2], params, mesh=jax.make_mesh((1, 4), ("data", "branch")))
    prefix, tails = ref.bill.kv_bytes_shared_prefix, ref.bill.kv_bytes_tails
    b = got.bill
    assert (b.kv_bytes_shared_prefix, b.kv_bytes_tails) == (prefix, tails)  # one logical copy
    assert b.devices == 4
    assert b.kv_bytes_per_device == prefix + tails // 4  # whole prefix, a quarter of the tails
    assert b.kv_bytes_allocated == 4 * prefix + tails
    assert "on 4 devices" in b.summary()


# ---------------------------------------------------------------------------
# include_stop_str_in_output, skip_special_tokens and CompletionOutput.stop_reason
# with vLLM's semantics. The model has zero weights (every logit
# exactly 0), so greedy decoding follows the logit bias and the frequency
# penalty alone, on any machine: "a", "b", ".", then the end id 256 (margins
# >= 0.4 between the two largest logits at every step).

_ABC = dict(temperature=0.0, max_new_tokens=8, frequency_penalty=2.0,
            logit_bias={97: 100.0, 98: 99.5, 46: 99.0, 256: 98.4})


class _SpecialBytes:
    """The tests' byte tokenizer, but ids >= 256 decode to "<id>" unless skipped
    (what a checkpoint tokenizer does with its special tokens)."""

    def __init__(self, inner):
        self.inner = inner
        for k in ("vocab_size", "eos_token_ids", "pad_token_id", "bos_token_id"):
            if hasattr(inner, k):
                setattr(self, k, getattr(inner, k))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens=True):
        out, run = [], []
        for i in (int(x) for x in ids):
            if i < 256:
                run.append(i)
                continue
            out.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            if not skip_special_tokens:
                out.append(f"<{i}>")
        out.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(out)


@pytest.fixture(scope="module")
def flat_lm():
    import dataclasses

    from conftest import make_tiny_lm

    lm = make_tiny_lm(scale=0.0)
    return dataclasses.replace(lm, tokenizer=_SpecialBytes(lm.tokenizer))


def _outputs(gen):
    return [o for r in gen.outputs() for o in r.outputs]


@pytest.mark.slow
def test_flat_model_writes_ab_then_the_end_id(flat_lm):
    g = engine.generate(flat_lm, ["x"], SamplingParams(n=2, **_ABC))
    assert g.tokens[0, 0, :4].tolist() == [97, 98, 46, 256] and g.texts == [["ab."] * 2]
    assert [(o.finish_reason, o.stop_reason) for o in _outputs(g)] == [("stop", None)] * 2


@pytest.mark.slow
@pytest.mark.parametrize("kw,text,finish,reason", [
    (dict(), "ab.", "stop", None),                                   # the model's end id
    (dict(max_new_tokens=2), "ab", "length", None),
    (dict(stop=["."]), "ab", "stop", "."),
    (dict(stop=["."], include_stop_str_in_output=True), "ab.", "stop", "."),
    (dict(stop=["x", "b."], include_stop_str_in_output=True), "ab.", "stop", "b."),
    (dict(stop=["b."]), "a", "stop", "b."),
    (dict(stop_token_ids=[46]), "ab", "stop", 46),                   # a stop token id
    (dict(stop_token_ids=[46], include_stop_str_in_output=True), "ab", "stop", 46),
    (dict(stop_token_ids=[256]), "ab.", "stop", None),               # the end id comes first
    (dict(stop_token_ids=[256], ignore_eos=True), "ab.", "stop", 256),
    (dict(ignore_eos=True, max_new_tokens=5), "ab.a", "length", None),  # a, b, ., 256, a
    (dict(ignore_eos=True, max_new_tokens=5, skip_special_tokens=False), "ab.<256>a", "length",
     None),
    (dict(skip_special_tokens=False), "ab.", "stop", None),          # the stop token's text: never
    (dict(ignore_eos=True, max_new_tokens=6, skip_special_tokens=False, stop=["56>a"]),
     "ab.<2", "stop", "56>a"),
])
def test_stop_reason_include_stop_str_and_special_tokens(flat_lm, kw, text, finish, reason):
    import jaxsample

    params = SamplingParams(n=2, **{**_ABC, **kw})
    for chunk in (1, 8):
        g = engine.generate(flat_lm, ["x"], params, chunk_size=chunk)
        assert g.texts == [[text] * 2], (chunk, g.texts)
        outs = _outputs(g)
        assert [(o.text, o.finish_reason, o.stop_reason) for o in outs] == [
            (text, finish, reason)] * 2
        assert all(type(o.stop_reason) is type(reason) for o in outs)  # int ids, str strings
        assert g.stop_reason == [[reason] * 2]
        streamed = {}
        for ev in jaxsample.stream(flat_lm, ["x"], params, chunk_size=chunk):
            for d in ev.deltas:
                streamed[d.branch] = streamed.get(d.branch, "") + d.text
        assert streamed == {0: text, 1: text}, chunk
    if "stop" in kw:  # include_stop_str_in_output changes the text, never the tokens
        other = engine.generate(flat_lm, ["x"], params.replace(
            include_stop_str_in_output=not params.include_stop_str_in_output))
        np.testing.assert_array_equal(other.tokens, g.tokens)
        np.testing.assert_array_equal(other.lengths, g.lengths)


def test_new_fields_are_validated():
    from jaxsample.errors import ConfigError

    p = SamplingParams()
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        with pytest.raises(ConfigError, match=f"{name} must be a bool"):
            SamplingParams(**{name: 1})
        assert getattr(SamplingParams(**{name: np.bool_(True)}), name) is True


@pytest.mark.slow
def test_skip_special_tokens_on_the_real_tokenizer(lm):
    """SmolLM2's end-of-turn token: dropped from the text by default, kept with
    skip_special_tokens=False (the branch is forced onto it with ignore_eos)."""
    eos = lm.tokenizer.eos_token_ids[0]
    piece = lm.tokenizer.decode([eos], skip_special_tokens=False)
    assert piece and lm.tokenizer.decode([eos]) == ""
    base = SamplingParams(n=1, temperature=0.0, max_new_tokens=3, ignore_eos=True,
                          logit_bias={eos: 100.0})
    assert engine.generate(lm, ["Hi"], base).texts == [[""]]
    assert engine.generate(lm, ["Hi"], base.replace(skip_special_tokens=False)).texts == [
        [piece * 3]]
