"""`jaxsample.token_logprobs`: the sampler's per-token log-probabilities as a pure,
differentiable function of the weights, computed a chunk of positions at a time.

Oracles: numpy's float64 log-softmax of the plain forward's logits; central
finite differences in float64 (a subprocess where the families' float32
become float64); the sampler's own logprobs (`Generation.logprobs`, from the
prefill and the decode step) on every family, in float32 and bfloat16 and on a
mesh; XLA's count of temporary bytes for the memory claim.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import next_token_logprobs as reference
from paths import DATA

import jaxsample
from jaxsample import SamplingParams, loading
from jaxsample.errors import InputError
from jaxsample.lm import LanguageModel
from jaxsample.models.families import common, llama
from jaxsample.tiny import byte_tokenizer
from jaxsample.training import rollout as ro
from jaxsample.training.logprobs import group_token_logprobs

FAMILIES = ["tiny_llama", "tiny_llama3_untied", "tiny_qwen2", "tiny_qwen3", "tiny_phi3",
            "tiny_mixtral", "tiny_qwen3_moe", "tiny_gemma2", "tiny_gemma3", "tiny_gemma3_local"]
# float32 on CPU: the prefill and decode reduce in another order than one causal forward
# (measured up to 5.7e-6 over the tiny families: benchmarks/token_logprobs_agreement.py).
F32_BOUND = 2e-5
# bfloat16 activations: the prefill and decode round hidden states and the KV cache at other
# points than one forward; 4 bfloat16 roundings (2**-8 each) of logits up to 8 (measured
# <= 0.07 on the dense tiny families: docs/benchmarks.md, "token_logprobs against the
# sampler").
BF16_BOUND = 4 * 2.0**-8 * 8


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, 258, (3, 40)).astype(np.int32)


@pytest.mark.parametrize("layout", ["stacked", "list"])
@pytest.mark.parametrize("temperature, chunk", [(1.0, None), (0.7, 1), (1.3, 7)])
def test_equals_log_softmax_of_the_forward(tiny_lm, tokens, layout, temperature, chunk):
    lm = tiny_lm if layout == "stacked" else dataclasses.replace(
        tiny_lm, params=common.unstack_layers(tiny_lm.params))
    got = jaxsample.token_logprobs(lm, lm.params, tokens, temperature=temperature,
                                   chunk_size=chunk)
    assert got.shape == tokens.shape and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got)[:, 0], 0.0)
    np.testing.assert_allclose(got, reference(lm, tokens, temperature), atol=1e-5, rtol=0)


def test_one_position_and_jit(tiny_lm, tokens):
    np.testing.assert_array_equal(jaxsample.token_logprobs(tiny_lm, tiny_lm.params,
                                                           tokens[:, :1]), np.zeros((3, 1)))
    jitted = jax.jit(lambda p, t: jaxsample.token_logprobs(tiny_lm, p, t, temperature=0.5))
    np.testing.assert_allclose(jitted(tiny_lm.params, tokens),
                               reference(tiny_lm, tokens, 0.5), atol=1e-5, rtol=0)


def test_an_engine_holding_the_model_in_lm(tiny_lm, tokens):
    class Engine:
        lm = tiny_lm

    np.testing.assert_array_equal(jaxsample.token_logprobs(Engine(), tiny_lm.params, tokens),
                                  jaxsample.token_logprobs(tiny_lm, tiny_lm.params, tokens))


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0), "temperature must be a finite number > 0"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(tokens=np.zeros(5, np.int32)), r"tokens must have shape \[B, S\]"),
    (dict(tokens=np.zeros((2, 3, 4), np.int32)), r"tokens must have shape \[B, S\]"),
    (dict(tokens=np.zeros((0, 4), np.int32)), "B, S >= 1"),
    (dict(tokens=np.zeros((2, 4), np.float32)), "integer array"),
    (dict(tokens=np.full((2, 4), 258)), r"\[0, 258\)"),
    (dict(tokens=np.full((2, 4), -1)), r"\[0, 258\)"),
    (dict(tokens=np.zeros((1, 513), np.int32)), "context"),
    (dict(tokens=[[1, 2], [3]]), "tokens must be"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.0), "chunk_size"),
    (dict(model=object()), "jaxsample.LanguageModel"),
])
def test_bad_input_is_an_input_error(tiny_lm, kwargs, match):
    args = dict(model=tiny_lm, tokens=np.zeros((2, 4), np.int32))
    args.update(kwargs)
    model, toks = args.pop("model"), args.pop("tokens")
    with pytest.raises(InputError, match=match):
        jaxsample.token_logprobs(model, tiny_lm.params, toks, **args)


@pytest.mark.slow
def test_logits_exist_one_chunk_at_a_time():
    """XLA's temporary bytes of the forward and of the gradient, against one `[B, S, V]`
    float32: a wide vocabulary so the logits dominate everything else."""
    cfg = llama.LlamaConfig(vocab_size=8192, dim=16, n_layers=1, n_heads=2, n_kv_heads=1,
                            head_dim=8, ffn_dim=32, max_seq_len=256)
    lm = LanguageModel(cfg, llama.init_params(cfg, jax.random.key(0), 0.3), byte_tokenizer())
    B, S = 2, 128
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 258, (B, S)), jnp.int32)
    full = 4 * B * S * cfg.vocab_size

    def temp_bytes(chunk, grad):
        f = lambda p: jaxsample.token_logprobs(lm, p, toks, chunk_size=chunk)  # noqa: E731
        if grad:
            f = jax.grad(lambda p, f=f: f(p).sum())
        return jax.jit(f).lower(lm.params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(S - 1, grad=False) >= full  # one chunk of all positions: [B, S, V] exists
    chunk = 4 * B * 4 * cfg.vocab_size
    assert temp_bytes(4, grad=False) <= 3 * chunk < full / 8
    params_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(lm.params))
    assert temp_bytes(4, grad=True) <= 3 * chunk + 2 * params_bytes < full / 3


@pytest.mark.slow
@pytest.mark.subprocess
def test_gradient_matches_finite_differences_in_float64():
    """A subprocess with 64-bit floats, where the families' float32 (norms, RoPE,
    attention, logits) are float64 too: jax.grad of token_logprobs, and of the LoRA
    forward, against central differences along random directions."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_enable_x64", True)
        jnp.float32 = jnp.float64  # this process only: every float32 the models ask for
        import jaxsample
        from jaxsample.tiny import make_tiny_lm
        from jaxsample.training import lora
        lm = make_tiny_lm()
        p = jax.tree.map(lambda a: a.astype(jnp.float64), lm.params)
        toks = np.random.RandomState(0).randint(0, 258, (2, 12))
        w = np.random.RandomState(1).normal(size=(2, 12))
        cfg = lora.LoraConfig(rank=2, targets=("wq", "wo", "w_down"))
        ad = jax.tree.map(lambda a: a + 0.1, lora.init(p, cfg, jax.random.key(0)))
        fns = {"params": (lambda q: jnp.sum(w * jaxsample.token_logprobs(
                   lm, q, toks, temperature=0.7, chunk_size=4)), p),
               "lora": (lambda a: jnp.sum(w * jaxsample.token_logprobs(
                   lm, lora.apply(p, a, cfg), toks)), ad)}
        rng = np.random.RandomState(2)
        for name, (f, x) in fns.items():
            assert f(x).dtype == jnp.float64
            g = jax.grad(f)(x)
            for _ in range(3):
                v = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), x)
                h = 1e-5
                step = lambda s: jax.tree.map(lambda a, b: a + s * h * b, x, v)
                fd = (f(step(1)) - f(step(-1))) / (2 * h)
                an = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v)))
                rel = abs(float(fd - an)) / abs(float(an))
                print(name, float(fd), float(an), rel)
                assert rel < 1e-5, (name, float(fd), float(an))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


# ---------------------------------------------------------------------------
# Agreement with the sampler


@functools.cache
def _family(name: str, dtype: str = "float32") -> LanguageModel:
    return loading._load_uncached(str(DATA / name), 0, dtype, None, None)


def sampler_gap(lm, mesh=None, n=3, max_tokens=10):
    """Largest |token_logprobs - sampler logprob| over the sampled tokens of two prompts
    (prompt + completion scored in one sequence), and the number of tokens compared."""
    prompts = [[t % lm.vocab_limit for t in p] for p in ([1, 5, 9, 33, 70, 12, 15], [3, 4, 100])]
    gen = jaxsample.generate(lm, prompts, SamplingParams(n=n, max_tokens=max_tokens, seed=1),
                             mesh=mesh)
    prompt, plen = ro.pad_prompts(gen.prompt_tokens)
    seq = np.asarray(ro.pack(jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(gen.tokens),
                             jnp.asarray(gen.lengths))).reshape(len(prompts) * n, -1)
    params = lm.params
    if mesh is not None:  # rows over the data axis, weights replicated
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps

        seq = jax.device_put(seq, NamedSharding(mesh, Ps("data")))
        params = jax.device_put(params, NamedSharding(mesh, Ps()))
    lp = np.asarray(jaxsample.token_logprobs(lm, params, seq)).reshape(len(prompts), n, -1)
    T = gen.tokens.shape[-1]
    idx = plen[:, None, None] + np.arange(T)
    got = np.take_along_axis(lp, np.broadcast_to(idx, (len(prompts), n, T)), -1)
    mask = np.arange(T) < gen.lengths[..., None]
    assert mask.sum() >= len(prompts) * n
    return float(np.abs(got - gen.logprobs)[mask].max()), int(mask.sum())


@pytest.mark.slow
def test_agrees_with_the_sampler_tiny(tiny_lm):
    gap, _ = sampler_gap(tiny_lm)
    assert gap <= F32_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_agrees_with_the_sampler_on_every_family(name):
    gap, _ = sampler_gap(_family(name))
    assert gap <= F32_BOUND, (name, gap)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma3"])
def test_agrees_with_the_sampler_in_bfloat16(name):
    gap, _ = sampler_gap(_family(name, "bfloat16"))
    assert gap <= BF16_BOUND, (name, gap)


@pytest.mark.slow
@pytest.mark.multidevice
def test_agrees_with_the_sampler_on_a_mesh(tiny_lm):
    from jaxsample.sharding import make_mesh

    gap, _ = sampler_gap(tiny_lm, mesh=make_mesh(branch=2, data=2), n=4)
    assert gap <= F32_BOUND


# ---------------------------------------------------------------------------
# Each prompt once for its N completions


def _grouped_case(lm, seed=0, B=2, N=3, P=12, T=9):
    rng = np.random.RandomState(seed)
    prompt = rng.randint(0, lm.vocab_limit, (B, P)).astype(np.int32)
    plen = np.asarray([P - 4, 3][:B], np.int32)
    prompt[1, 3:] = 0  # right padding
    comp = rng.randint(0, lm.vocab_limit, (B, N, T)).astype(np.int32)
    packed = ro.pack(jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(comp),
                     jnp.full((B, N), T, jnp.int32)).reshape(B * N, -1)
    idx = np.broadcast_to(plen[:, None, None] + np.arange(T), (B, N, T))
    return prompt, plen, comp, packed, idx


def _grouped_vs_packed(lm, params, temperature):
    prompt, plen, comp, packed, idx = _grouped_case(lm)
    got = group_token_logprobs(
        lm, params, prompt, plen, comp, temperature=temperature, chunk_size=4)
    lp = jaxsample.token_logprobs(lm, params, packed, temperature=temperature)
    want = np.take_along_axis(np.asarray(lp).reshape(comp.shape[:2] + (-1,)), idx, -1)
    return np.asarray(got), want


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "list"])
def test_grouped_equals_packed_sequences(tiny_lm, layout):
    lm = tiny_lm if layout == "stacked" else dataclasses.replace(
        tiny_lm, params=common.unstack_layers(tiny_lm.params))
    got, want = _grouped_vs_packed(lm, lm.params, 0.8)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_grouped_gradient_equals_packed_sequences(tiny_lm):
    lm = tiny_lm
    prompt, plen, comp, packed, idx = _grouped_case(lm)
    w = np.random.RandomState(5).normal(size=comp.shape)
    g1 = jax.grad(lambda p: jnp.sum(w * group_token_logprobs(
        lm, p, prompt, plen, comp)))(lm.params)
    g2 = jax.grad(lambda p: jnp.sum(w * jnp.take_along_axis(jaxsample.token_logprobs(
        lm, p, packed).reshape(comp.shape[:2] + (-1,)), idx, -1)))(lm.params)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(np.abs(b).max()) + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_gemma3_local", "tiny_gemma2", "tiny_qwen3_moe",
                                  "tiny_phi3"])
def test_grouped_equals_packed_sequences_on_families(name):
    """Sliding windows (5 and 8 positions), Gemma 2's soft-capped scores, experts."""
    lm = _family(name)
    got, want = _grouped_vs_packed(lm, lm.params, 1.0)
    np.testing.assert_allclose(got, want, atol=F32_BOUND, rtol=0)


def test_grouped_input_errors(tiny_lm):
    prompt, plen, comp, _, _ = _grouped_case(tiny_lm)
    with pytest.raises(InputError, match="completions must have shape"):
        group_token_logprobs(tiny_lm, tiny_lm.params, prompt, plen, comp[0])
    with pytest.raises(InputError, match="prompt_len"):
        group_token_logprobs(tiny_lm, tiny_lm.params, prompt, np.asarray([0, 3]), comp)
    with pytest.raises(InputError, match=r"completions must be token ids"):
        group_token_logprobs(tiny_lm, tiny_lm.params, prompt, plen, comp + 300)
