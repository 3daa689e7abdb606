"""Three-level sharing, `generate(shared_prefix=...)`: a context common to all prompts.

Oracle: the same request without `shared_prefix`, the context's token ids
concatenated to every prompt (itself checked against a full forward pass in
tests/engine/test_generate.py and, for sliding windows, tests/models/test_gemma3_engine.py).
The two compile to different programs, so sampled tokens are compared with
`ties.assert_same_tokens_up_to_ties` and floats at float32 tolerance. Also:
sharded against unsharded, chunked against one call, compacted against not,
the stream against generate, the bill against its formulas, and bad input.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import byte_tokenizer
from helpers import finish_in_rounds
from ties import assert_same_tokens_up_to_ties

from jaxsample import SamplingParams, cost, engine
from jaxsample import bridge as bridge_lib
from jaxsample.engine import inputs
from jaxsample.errors import InputError

CONTEXT = "Few-shot context shared by all: 1+1=2. 2+3=5. 4+4=8. 7+1=8. Now: "
PROMPTS = ["3+3=", "a much longer question than the first one, 12+30=", "x"]
STOPS = tuple(range(0, 256, 20))  # frequent stop ids: some branches end early


def concat(lm, context, prompts):
    ids = lm.tokenizer.encode(context) if isinstance(context, str) else list(context)
    return [ids + (lm.tokenizer.encode(p) if isinstance(p, str) else list(p)) for p in prompts]


def assert_close_generations(lm, ref, got, atol=1e-5):
    """Same tokens up to float ties; same prompt tokens; the floats that exist equal.

    atol: 1e-5 on the tiny models; 1e-4 on SmolLM2 (30 layers: the project's
    tolerance between two float32 programs of it, see tests/ties.py). Plus the
    ties helper's relative 2e-6 (a logprob's float32 rounding grows with its
    magnitude): this check had atol alone, and on a 2-core AMD Zen 5 one
    logprob of -3.92 differed by 1.55e-5 (4e-6 relative) after 9 steps while
    the helper's own comparison of the same numbers passed."""
    assert got.prompt_tokens == ref.prompt_tokens
    assert_same_tokens_up_to_ties(lm, ref, got, logprob_atol=atol)
    same = np.all(ref.tokens == got.tokens, axis=-1)  # compare floats where no tie flipped
    np.testing.assert_allclose(got.logprobs[same], ref.logprobs[same], atol=atol, rtol=2e-6)
    for name in ("top_logprobs", "token_ranks"):
        a, b = getattr(ref, name), getattr(got, name)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(b[same], a[same], atol=atol)


def sp(**kw):
    base = dict(n=4, temperature=1.0, max_new_tokens=10, seed=5)
    return SamplingParams(**(base | kw))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    {},  # plain sampling
    {"logprobs": 3, "prompt_logprobs": 2, "top_p": 0.9},
    {"stop_token_ids": STOPS, "repetition_penalty": 1.3, "presence_penalty": 0.5},
    {"temperature": 0.0, "n": 2},
], ids=["sampled", "logprobs", "stops+penalties", "greedy"])
def test_equals_context_concatenated_to_every_prompt(tiny_lm, kw):
    params = sp(**kw)
    got = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    ref = engine.generate(tiny_lm, concat(tiny_lm, CONTEXT, PROMPTS), params)
    assert_close_generations(tiny_lm, ref, got)
    if params.prompt_logprobs is not None:
        for b in range(len(PROMPTS)):
            assert len(got.prompt_token_logprobs[b]) == len(got.prompt_tokens[b]) - 1
            for name in ("prompt_token_logprobs", "prompt_top_logprobs"):
                np.testing.assert_allclose(getattr(got, name)[b], getattr(ref, name)[b],
                                           atol=1e-5)
            for name in ("prompt_token_ranks", "prompt_top_token_ids"):
                np.testing.assert_array_equal(getattr(got, name)[b], getattr(ref, name)[b])
        assert got.outputs()[0].prompt_logprobs[1] is not None


@pytest.mark.slow
def test_one_prompt_token_ids_and_a_long_context(tiny_lm):
    """B = 1; the context given as ids, longer than the prompt's bucket (300 tokens)."""
    ctx = [int(x) for x in np.random.default_rng(0).integers(0, 256, 300)]
    params = sp(n=3, max_new_tokens=12)
    got = engine.generate(tiny_lm, [[65, 66, 67]], params, shared_prefix=ctx)
    ref = engine.generate(tiny_lm, [ctx + [65, 66, 67]], params)
    assert_close_generations(tiny_lm, ref, got)
    text = engine.generate(tiny_lm, ["ABC"], params, shared_prefix=np.asarray(ctx))
    np.testing.assert_array_equal(text.tokens, got.tokens)


@pytest.mark.slow
def test_stop_strings_and_text(tiny_lm):
    params = sp(n=4, max_new_tokens=16, stop=["e", "a"])
    got = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    ref = engine.generate(tiny_lm, concat(tiny_lm, CONTEXT, PROMPTS), params)
    assert_close_generations(tiny_lm, ref, got)
    assert got.texts == ref.texts and got.finish_reason == ref.finish_reason
    assert got.prompts == PROMPTS  # the prompts' own texts


@pytest.mark.slow
def test_chat_messages_share_their_first_turns(tiny_lm):
    common = [{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    own = ["3+3?", [{"role": "user", "content": "5+5?"}]]
    params = sp(n=2)
    got = engine.generate(tiny_lm, own, params, chat=True, shared_prefix=common)
    whole = [common + [{"role": "user", "content": "3+3?"}], common + own[1]]
    ref = engine.generate(tiny_lm, whole, params, chat=True)
    assert_close_generations(tiny_lm, ref, got)
    assert got.prompts == ref.prompts  # the whole rendered conversations
    # A string is one system turn.
    got = engine.generate(tiny_lm, own, params, chat=True, shared_prefix="Answer briefly.")
    ref = engine.generate(tiny_lm, [[common[0]] + w[3:] for w in whole], params, chat=True)
    assert_close_generations(tiny_lm, ref, got)


@pytest.mark.slow
def test_bridge(tiny_lm):
    """A nonzero Bridge: the context and suffix prefills see one copy, as the prefill does."""
    b = bridge_lib.init(tiny_lm, bridge_lib.BridgeConfig(dim=8, n_heads=2), jax.random.key(1))
    b = b.replace_params(dict(b.params, wo=0.5 * jax.random.normal(jax.random.key(101),
                                                                   b.params["wo"].shape)))
    params = sp(stop_token_ids=STOPS)
    got = engine.generate(tiny_lm, PROMPTS[:2], params, bridge=b, shared_prefix=CONTEXT)
    ref = engine.generate(tiny_lm, concat(tiny_lm, CONTEXT, PROMPTS[:2]), params, bridge=b)
    assert_close_generations(tiny_lm, ref, got)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_sharded_equals_unsharded(tiny_lm, shape):
    if jax.device_count() < shape[0] * shape[1]:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh(shape, ("data", "branch"))
    params = sp(n=8, top_p=0.9)
    ref = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    got = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT, mesh=mesh)
    assert_close_generations(tiny_lm, ref, got)
    C = len(tiny_lm.tokenizer.encode(CONTEXT))
    assert got.bill.shared_context_tokens == C
    # The context is replicated on every device: allocated once per device.
    assert got.bill.kv_bytes_allocated >= mesh.size * got.bill.kv_bytes_shared_context


@pytest.mark.slow
def test_chunks_compaction_stream_and_session(tiny_lm):
    params = sp(n=4, max_new_tokens=14, stop_token_ids=STOPS)
    one = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    chunked = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT, chunk_size=3)
    np.testing.assert_array_equal(chunked.tokens, one.tokens)  # one program: bit for bit
    np.testing.assert_array_equal(chunked.logprobs, one.logprobs)
    packed = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT, chunk_size=2,
                             compact=True)
    assert_close_generations(tiny_lm, one, packed)
    assert packed.bill.branch_steps < one.bill.branch_steps
    events = list(engine.stream(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT, chunk_size=4))
    gen = events[-1].generation
    np.testing.assert_array_equal(gen.tokens, one.tokens)
    for b in range(len(PROMPTS)):
        for n in range(params.n):
            text = "".join(d.text for ev in events for d in ev.deltas
                           if (d.prompt, d.branch) == (b, n))
            assert text == gen.texts[b][n]
    # The resumable API: two rounds of branches over one prefill.
    s = engine.Session(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    two = finish_in_rounds(s, rows=3, width=2, firsts=(0, 2), chunk=5)
    assert_close_generations(tiny_lm, one, two)
    assert two.bill.prompt_tokens_prefilled == one.bill.prompt_tokens_prefilled


# ---------------------------------------------------------------------------
# Sliding windows (Gemma 3): the window's lower bound crosses the context/suffix and
# suffix/tail boundaries


@pytest.fixture(scope="module")
def glm():
    from jaxsample.lm import LanguageModel
    from jaxsample.models.families import gemma3

    cfg = gemma3.Gemma3Config(vocab_size=264, dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                              head_dim=8, ffn_dim=64, layer_windows=(8, None, 4, None, 8, 3),
                              query_pre_attn_scalar=12.0, final_logit_softcapping=30.0,
                              max_seq_len=256)
    return LanguageModel(config=cfg, params=gemma3.init_params(cfg, jax.random.key(0), 0.3),
                         tokenizer=byte_tokenizer(), name="tiny-gemma")


# Both contexts fall in the same buckets (16; the concatenations in 48): one set of programs.
@pytest.mark.slow
@pytest.mark.parametrize("context", ["0123456789ab", "ab"], ids=["C>w", "C<w"])
def test_sliding_windows_across_the_boundaries(glm, context):
    prompts = ["q", "suffix", "a suffix longer than the window"]
    params = sp(n=3, max_new_tokens=12, logprobs=1, prompt_logprobs=1)
    got = engine.generate(glm, prompts, params, shared_prefix=context)
    ref = engine.generate(glm, concat(glm, context, prompts), params)
    assert_close_generations(glm, ref, got)
    for b in range(len(prompts)):
        np.testing.assert_allclose(got.prompt_token_logprobs[b], ref.prompt_token_logprobs[b],
                                   atol=1e-5)
    # Local layers store only their window of the context (w - 1 positions).
    assert got.bill.kv_bytes_shared_context == cost.kv_bytes(glm.config, engine.bucket(len(context)))
    assert got.bill.kv_bytes_shared_context < cost.kv_bytes_per_token(glm.config) * engine.bucket(
        len(context))


# ---------------------------------------------------------------------------
# The bill


def test_bill_prices_the_context_once(tiny_lm):
    params = sp(n=4)
    got = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=CONTEXT)
    ref = engine.generate(tiny_lm, concat(tiny_lm, CONTEXT, PROMPTS), params)
    cfg, B, N = tiny_lm.config, len(PROMPTS), params.n
    C = len(tiny_lm.tokenizer.encode(CONTEXT))
    own = [len(tiny_lm.tokenizer.encode(p)) for p in PROMPTS]
    bill = got.bill
    assert bill.shared_context_tokens == C
    assert bill.prompt_tokens_prefilled == C + sum(own)
    assert bill.prompt_tokens_if_context_per_prompt == ref.bill.prompt_tokens_prefilled
    assert bill.prompt_tokens_if_separate == N * sum(C + s for s in own)
    assert bill.prefill_flops_shared == cost.prefill_flops(cfg, C) + sum(
        cost.suffix_prefill_flops(cfg, C, s) for s in own)
    assert bill.prefill_flops_if_context_per_prompt == ref.bill.prefill_flops_shared
    assert bill.prefill_flops_if_separate == ref.bill.prefill_flops_if_separate
    assert bill.decode_flops_shared == ref.bill.decode_flops_shared  # decode is never saved
    # KV: the context once (no prompt or branch axis), the suffixes once each, the tails.
    per_pos = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    assert bill.kv_bytes_shared_context == per_pos * engine.bucket(C)
    assert bill.kv_bytes_shared_prefix == per_pos * B * engine.bucket(max(own))
    assert bill.kv_bytes_held == (bill.kv_bytes_shared_context + bill.kv_bytes_shared_prefix
                                  + bill.kv_bytes_tails)
    assert bill.kv_bytes_if_separate == (N * (B * bill.kv_bytes_shared_context
                                              + bill.kv_bytes_shared_prefix)
                                         + bill.kv_bytes_tails)
    assert bill.kv_bytes_held < ref.bill.kv_bytes_held
    assert "shared context: %d tokens" % C in bill.summary()
    # Suffix prefill after a cached context: the same FLOPs as one prefill, minus the
    # context's row of logits counted once per prompt in a prefill of the whole.
    assert (cost.prefill_flops(cfg, C) + cost.suffix_prefill_flops(cfg, C, 7)
            == cost.prefill_flops(cfg, C + 7) + cost.logits_flops_per_token(cfg))
    assert ref.bill.shared_context_tokens == 0


def test_estimate_knows_three_levels(tiny_lm):
    cfg = tiny_lm.config
    C, P, T, N, B = 2000, 40, 16, 8, 8
    e = cost.estimate(cfg, P, T, N, context_tokens=C, num_prompts=B)
    kv = cost.kv_bytes_per_token(cfg)
    assert e.prefill_flops_shared == cost.prefill_flops(cfg, C) + B * cost.suffix_prefill_flops(
        cfg, C, P)
    assert e.prefill_flops_two_level == B * cost.prefill_flops(cfg, C + P)
    assert e.prefill_flops_separate == B * N * cost.prefill_flops(cfg, C + P)
    assert e.kv_bytes_shared == (C + B * P + B * N * T) * kv
    assert e.kv_bytes_two_level == (B * (C + P) + B * N * T) * kv
    assert e.kv_bytes_separate == B * N * (C + P + T) * kv
    assert e.decode_flops_shared == B * N * cost.decode_flops(cfg, C + P, T)
    assert e.prefill_flops_two_level > 6 * e.prefill_flops_shared
    # The defaults are one prompt without a context, as before.
    one = cost.estimate(cfg, P, T, N)
    assert one.prefill_flops_shared == cost.prefill_flops(cfg, P) == one.prefill_flops_two_level
    assert cost.estimate(cfg, P, T, N, context_tokens=0, num_prompts=1) == one
    rows = cost.table(cfg, P, T, [1, 4], context_tokens=C, num_prompts=B)
    assert rows[1]["prefill_flops_two_level"] == e.prefill_flops_two_level
    with pytest.raises(ValueError, match="num_prompts"):
        cost.estimate(cfg, P, T, N, num_prompts=0)
    with pytest.raises(ValueError, match="context_tokens"):
        cost.estimate(cfg, P, T, N, context_tokens=-1)


# ---------------------------------------------------------------------------
# Bad input: clear errors naming the argument, before any compute


@pytest.mark.parametrize("bad, match", [
    ("", "shared_prefix is empty"),
    ("   ", "shared_prefix is empty"),
    ([], "shared_prefix is empty"),
    (5, "shared_prefix must be"),
    ({"role": "system"}, "shared_prefix must be"),
    ([1, "a"], "shared_prefix: token ids must be ints"),
    ([1, 999], "shared_prefix has token ids outside the vocabulary"),
    ([[1, 2]], "shared_prefix: token ids must be a flat sequence"),
    ([{"role": "user", "content": "x"}], "pass chat=True"),
])
def test_bad_shared_prefix(tiny_lm, bad, match):
    with pytest.raises(InputError, match=match):
        engine.generate(tiny_lm, PROMPTS, sp(), shared_prefix=bad)


def test_bad_requests_with_a_shared_prefix(tiny_lm):
    with pytest.raises(InputError, match="with chat=True, shared_prefix must be"):
        engine.generate(tiny_lm, PROMPTS, sp(), chat=True, shared_prefix=[1, 2, 3])
    with pytest.raises(InputError, match="shared_prefix, message 0: a chat message must be"):
        engine.generate(tiny_lm, PROMPTS, sp(), chat=True, shared_prefix=[{"role": "user"}])
    long = "y" * 500  # 500 + prompt + 10 > 512
    with pytest.raises(InputError, match=r"shared_prefix \(500 tokens\) \+ prompt 0"):
        engine.generate(tiny_lm, PROMPTS, sp(), shared_prefix=long)
    with pytest.raises(InputError, match="prompt 1 is empty"):
        engine.generate(tiny_lm, ["a", ""], sp(), shared_prefix=CONTEXT)


# ---------------------------------------------------------------------------
# The embedded model


@pytest.mark.slow
def test_smollm2_shared_context_equals_concatenation(lm):
    context = ("Question: 12 + 30? Answer: 42.\nQuestion: 7 + 8? Answer: 15.\n" * 12)
    prompts = ["Question: 3 + 4? Answer:", "Question: what is 10 + 20? Answer:"]
    params = SamplingParams(n=2, max_new_tokens=6, seed=0, logprobs=1)
    got = engine.generate(lm, prompts, params, shared_prefix=context)
    assert got.bill.shared_context_tokens > 200
    suffix = [inputs.without_bos(lm.tokenizer, lm.tokenizer.encode(p)) for p in prompts]
    ref = engine.generate(lm, concat(lm, context, suffix), params)
    assert_close_generations(lm, ref, got, atol=1e-4)


# ---------------------------------------------------------------------------
# The command line (no weights loaded)


def test_cli_price_knows_three_levels(capsys):
    import json

    from jaxsample import cli

    argv = ["price", "--model", "smollm2-135m", "--prompt-tokens", "40", "--new-tokens", "16",
            "--n", "1,8", "--context-tokens", "2000", "--prompts", "8"]
    assert cli.main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg, _ = cli.resolve_model_config("smollm2-135m")
    want = cost.table(cfg, 40, 16, [1, 8], context_tokens=2000, num_prompts=8)
    assert out["rows"] == json.loads(json.dumps(want))
    assert out["context_tokens"] == 2000 and out["num_prompts"] == 8
    assert cli.main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "two levels" in text and "8 prompts of P=40 own tokens" in text


@pytest.mark.parametrize("argv, needle", [
    (["run", "--prompt", "x", "--shared-prefix", "  "], "--shared-prefix: the shared prefix is empty"),
    (["run", "--prompt", "x", "--shared-prefix", "ctx", "--adaptive", "esc"],
     "--shared-prefix cannot be combined with --adaptive"),
    (["run", "--prompt", "x", "--shared-prefix-file", "/nonexistent/ctx.txt"],
     "--shared-prefix-file: /nonexistent/ctx.txt: no such file"),
    (["run", "--prompt-file", "-", "--shared-prefix-file", "-"],
     "--prompt-file and --shared-prefix-file cannot both read stdin"),
    (["price", "--prompts", "0"], "--prompts"),
])
def test_cli_bad_shared_prefix_is_one_line_and_exit_2(capsys, argv, needle):
    from jaxsample import cli

    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.slow
def test_cli_checks_the_shared_prefix_against_the_context(tiny_lm):
    """`check_requests` counts context + own tokens as generate splits them."""
    from jaxsample import cli

    r = cli.Request(0, None, "3+3=", None, SamplingParams(max_new_tokens=10), "--prompt")
    n = cli.requests._prompt_tokens(tiny_lm.tokenizer, r, False, CONTEXT)
    s = engine.Session(tiny_lm, ["3+3="], SamplingParams(max_new_tokens=10),
                       shared_prefix=CONTEXT)
    assert n == len(s.prompt_ids[0])
    n_chat = cli.requests._prompt_tokens(tiny_lm.tokenizer, r, True, "Be brief.")
    s = engine.Session(tiny_lm, ["3+3="], SamplingParams(max_new_tokens=10), chat=True,
                       shared_prefix="Be brief.")
    assert n_chat == len(s.prompt_ids[0])
    with pytest.raises(InputError, match="--shared-prefix and the prompt have"):
        cli.check_requests(tiny_lm.config, tiny_lm.tokenizer, [r], False, "y" * 500)
