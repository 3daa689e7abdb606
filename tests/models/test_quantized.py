"""Int8 weights (`quantization.quant`, `load(..., weights="int8")`) against independent oracles.

Oracles: float64 numpy on the dequantised weights (`q * scale`) for the
quantiser and the matmul, with the bounds the arithmetic guarantees; the
family's own float32 forward on the dequantised weights for the whole model;
the int8 model's own full forward pass for its cached decode (the project's
standard oracle); the unsharded / plain run for meshes, the shared prefix and
a zero Bridge. The default path (`weights=None`) is the code of before: its
bit-exact references are tests/models/test_model_parity.py and the others that
compare against stored tokens.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import int8_lm
from paths import DATA
from ties import assert_same_tokens_up_to_ties

from jaxsample import SamplingParams, engine
from jaxsample import bridge as bridge_lib
from jaxsample.engine import state
from jaxsample.engine.context import prefill_context, prefill_suffix
from jaxsample.engine.prefill import prefill as prefill_fn
from jaxsample.engine.prefill import stored_prefix
from jaxsample.engine.step import branch_step
from jaxsample.errors import ConfigError
from jaxsample.loading import load
from jaxsample.models.cpu_kernels import cpu_kernels
from jaxsample.models.families import common, llama
from jaxsample.models.quantization import outliers, quant

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]
EPS32 = float(np.finfo(np.float32).eps)
is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731


def dequantised(params):
    """The float32 weights the int8 ones stand for (`q * scale`, same structure)."""
    return jax.tree_util.tree_map(lambda a: a.dequantize() if is_q(a) else a, params, is_leaf=is_q)



@pytest.fixture(scope="module")
def qlm(tiny_lm):
    return int8_lm(tiny_lm)


# ---------------------------------------------------------------------------
# The quantiser and the matmul against float64 numpy


@pytest.mark.parametrize("rows", [False, True])
def test_round_trip_within_half_a_scale(rows):
    """|w - q * scale| <= scale / 2 per element; q in [-127, 127]; an all-zero channel is 0."""
    w = np.random.default_rng(0).standard_normal((48, 40)) * np.geomspace(1e-3, 10, 40)
    w[:, 3] = 0.0
    w[5, :] = 0.0
    qw = quant.quantize(w, rows=rows)
    assert qw.q.dtype == np.int8 and qw.scale.dtype == np.float32
    assert qw.scale.shape == ((48,) if rows else (40,)) and np.abs(qw.q).max() <= 127
    s = (qw.scale[:, None] if rows else qw.scale[None, :]).astype(np.float64)
    err = np.abs(w - qw.q.astype(np.float64) * s)
    assert np.all(err <= s / 2 * (1 + 1e-12))
    assert np.array_equal(np.asarray(qw.dequantize()), (qw.q * s).astype(np.float32))
    zero = qw.q[5, :] if rows else qw.q[:, 3]
    assert not zero.any()
    with pytest.raises(ValueError, match="finite"):
        quant.quantize(np.full((2, 2), np.nan))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("mode", quant.MODES)
def test_matmul_error_bounded_by_the_scale(mode, rows):
    """Against float64: the product with the dequantised weights at float32 rounding
    (weight-only), and with the original weights within |x|_1 * scale / 2 per output.

    Bounds per output o, W' = q * scale (the dequantised weights), n = in:
      weight-only: |y - x W'| <= 2 n eps32 (|x| |W'|)_o (float32 dot and scale product);
      W8A8: activations rounded per row to s_x * round(x / s_x), |error| <= s_x / 2 each,
        so |y - x W'| <= s_x / 2 * |W'|_1,o + the same float32 term;
      both: |x W' - x W| <= |x|_1 * scale_o / 2 (the round trip above).
    """
    rng = np.random.default_rng(1)
    n, m = 96, 40
    w = rng.standard_normal((n, m)) * np.linspace(0.1, 3, m)
    x = rng.standard_normal((rows, n)).astype(np.float32).astype(np.float64)  # 1: padded (W8A8)
    qw = jax.tree_util.tree_map(jnp.asarray, quant.quantize(w, mode=mode))
    y = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x, jnp.float32), qw), np.float64)
    deq = np.asarray(qw.q, np.float64) * np.asarray(qw.scale, np.float64)
    exact = x @ deq
    bound = 2 * n * EPS32 * (np.abs(x) @ np.abs(deq))
    if mode == "w8a8":
        sx = np.abs(x).max(axis=1, keepdims=True) / 127
        bound = bound + sx / 2 * np.abs(deq).sum(axis=0)
    assert np.all(np.abs(y - exact) <= bound)
    to_original = np.abs(x).sum(1, keepdims=True) * np.asarray(qw.scale, np.float64) / 2
    assert np.all(np.abs(y - x @ w) <= to_original + bound)
    # `x @ qw` is the same call (a jax array defers `@` to the weight).
    np.testing.assert_array_equal(np.asarray(jnp.asarray(x, jnp.float32) @ qw), y.astype(np.float32))


@pytest.mark.multidevice
@pytest.mark.parametrize("kept", [None, [3, 50]])
def test_w8a8_rows_are_independent_of_the_batch_and_the_mesh(kept):
    """W8A8 quantises each activation row by its own scale, so a row's product must not
    depend on the other rows: alone (one row, padded with a zero row), in a batch, and
    in a shard of a `shard_map` over 2 devices. The int8 x int8 -> int32 dot is exact
    and the scales are elementwise, so the rows agree bit for bit; the outlier
    channels' float32 dot may sum in another order per batch shape (float32 rounding).
    This is the invariant a mesh relies on; the whole model's W8A8 results still move
    between batch shapes and meshes (`test_mesh_equals_unsharded`)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((96, 40))
    x = jnp.asarray(rng.standard_normal((4, 3, 96)), jnp.float32)
    qw = jax.tree_util.tree_map(jnp.asarray, quant.quantize(w, mode="w8a8", outliers=kept))
    f = jax.jit(quant.matmul)
    batch = np.asarray(f(x, qw))
    alone = np.stack([np.asarray(f(x[i, j][None], qw))[0] for i in range(4) for j in range(3)])
    vmapped = np.asarray(jax.jit(jax.vmap(quant.matmul, in_axes=(0, None)))(x, qw))
    check = (np.testing.assert_array_equal if kept is None else
             lambda a, b: np.testing.assert_allclose(a, b, rtol=4 * EPS32, atol=1e-6))
    check(alone, batch.reshape(12, -1))
    check(vmapped, batch)
    if jax.device_count() >= 2:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps
        mesh = jax.make_mesh((2,), ("d",))
        placement = getattr(jax, "shard_map", None)
        if placement is None:  # jax < 0.7
            from jax.experimental.shard_map import shard_map as placement
        g = jax.jit(placement(quant.matmul, mesh=mesh, in_specs=(Ps("d"), Ps()),
                              out_specs=Ps("d")))
        sharded = g(jax.device_put(x, NamedSharding(mesh, Ps("d"))),
                    jax.device_put(qw, NamedSharding(mesh, Ps())))
        check(np.asarray(sharded), batch)


@pytest.mark.slow
def test_tied_head_and_gather_use_the_per_row_scales():
    """The embedding [V, E] has one scale per row: the gather reads q and scale rows,
    and `.T` is the head [E, V] with those numbers as its per-output-channel scales."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((30, 16))
    qt = jax.tree_util.tree_map(jnp.asarray, quant.quantize(table, rows=True,
                                                            mode="weight_only"))
    deq = np.asarray(qt.q, np.float64) * np.asarray(qt.scale, np.float64)[:, None]
    tokens = jnp.asarray([[3, 0, 29], [7, 7, 1]])
    np.testing.assert_array_equal(np.asarray(quant.take_rows(qt, tokens)),
                                  deq[np.asarray(tokens)].astype(np.float32))
    assert qt.T.shape == (16, 30) and qt.shape == (30, 16)
    h = rng.standard_normal((4, 16)).astype(np.float32)
    got = np.asarray(quant.matmul(jnp.asarray(h), qt.T, jnp.float32), np.float64)
    exact = h.astype(np.float64) @ deq.T
    bound = 2 * 16 * EPS32 * (np.abs(h) @ np.abs(deq.T))
    assert np.all(np.abs(got - exact) <= bound)
    got8 = np.asarray(quant.matmul(jnp.asarray(h), quant.with_mode(qt, "w8a8").T), np.float64)
    sx = np.abs(h).max(axis=1, keepdims=True) / 127  # the activations' rounding (W8A8)
    assert np.all(np.abs(got8 - exact) <= bound + sx / 2 * np.abs(deq).sum(axis=1))
    with pytest.raises(ValueError, match="per-output-channel"):
        quant.matmul(jnp.asarray(h[:, :30]), qt)  # per-row scales are not a projection's


# ---------------------------------------------------------------------------
# The whole model


def assert_close_to_dequantised(lm8, tokens):
    """Weight-only: logits within 1e-4 * (1 + |logit|) of the float32 forward on the
    dequantised weights q * scale (two float32 programs that differ in where the
    scale multiplies: float32 rounding, not quantisation). W8A8 also rounds every
    projection's input per row (|error| <= s_x / 2 per element, s_x = max|x| / 127):
    its logits are within 0.25 standard deviations of the float32 logits of the same
    dequantised weights (measured 0.11-0.16 on the tiny models)."""
    ref = np.asarray(dataclasses.replace(lm8, params=dequantised(lm8.params)).forward(tokens))
    wo = dataclasses.replace(lm8, params=quant.with_mode(lm8.params, "weight_only"))
    got = np.asarray(wo.forward(tokens))
    assert np.all(np.abs(got - ref) <= 1e-4 * (1 + np.abs(ref)))
    a8 = dataclasses.replace(lm8, params=quant.with_mode(lm8.params, "w8a8"))
    assert np.abs(np.asarray(a8.forward(tokens)) - ref).max() <= 0.25 * ref.std()
    return got


@pytest.mark.slow
def test_tiny_logits_equal_the_dequantised_float_model(tiny_lm, qlm):
    tokens = np.arange(40, dtype=np.int32)[None] * 7 % 250
    got = assert_close_to_dequantised(qlm, tokens)
    # and the float32 model itself is a different model (the quantisation is real)
    assert np.abs(np.asarray(tiny_lm.forward(tokens)) - got).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", quant.MODES)
def test_fused_projections_are_the_same_product(tiny_lm, mode):
    """q/k/v and gate/up, calibrated on one input each, are stored as one weight
    (`common.FUSED`): its dequantised matrix is the members' side by side, bit for
    bit, and the model's logits match the unfused model's (the int8 dot is exact in
    int32; the float parts add the same terms per output column)."""
    params = llama.unstack_layers(tiny_lm.params)
    kept = outliers.calibrate(tiny_lm.config, params, tiny_lm.tokenizer)
    dev = lambda t: jax.tree_util.tree_map(jnp.asarray, t)  # noqa: E731
    fused = dev(quant.quantize_params(params, mode=mode, outliers=kept))
    apart = dev(quant.quantize_params(params, mode=mode, outliers=kept, fuse=False))
    for f, a in zip(fused["layers"], apart["layers"]):
        assert {"wq+wk+wv", "w_gate+w_up"} <= set(f) and not {"wq", "w_up"} & set(f)
        for name, members in common.FUSED.items():
            want = np.concatenate([np.asarray(a[m].dequantize()) for m in members], axis=1)
            assert np.array_equal(np.asarray(f[name].dequantize()), want)
    toks = np.arange(24, dtype=np.int32)[None] * 7 % 250
    lf = np.asarray(dataclasses.replace(tiny_lm, params=fused).forward(toks))
    la = np.asarray(dataclasses.replace(tiny_lm, params=apart).forward(toks))
    np.testing.assert_allclose(lf, la, rtol=1e-5, atol=1e-5 * float(np.abs(la).max()))


def test_projections_with_other_channels_stay_apart(tiny_lm):
    params = llama.unstack_layers(tiny_lm.params)
    kept = outliers.calibrate(tiny_lm.config, params, tiny_lm.tokenizer)
    other = np.arange(kept[(0, "wq")].size, dtype=np.int32)  # layer 0's k: other channels
    kept[(0, "wk")] = other + 1 if np.array_equal(other, kept[(0, "wq")]) else other
    q = quant.quantize_params(params, outliers=kept)
    assert {"wq", "wk", "wv", "w_gate+w_up"} <= set(q["layers"][0])
    assert "wq+wk+wv" in q["layers"][1]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["tiny_llama.gguf", "tiny_gemma3", "tiny_mixtral.gguf"])
def test_load_int8_both_families_and_moe(path):
    """`load(weights="int8")`: projections int8 (MoE experts and norms stay float), logits
    within the bounds above of the same model with the dequantised weights."""
    qlm = load(DATA / path, weights="int8", cache=False)
    lp = qlm.params["layers"][0]
    assert is_q(qlm.params["embed"]) and is_q(lp["wq+wk+wv"]) and is_q(lp["wo"])
    head = qlm.params["lm_head" if "lm_head" in qlm.params else "embed"]
    assert lp["wq+wk+wv"].outliers is not None and head.outliers is not None  # calibrated
    assert not is_q(lp["attn_norm"]) and lp["attn_norm"].dtype == jnp.float32
    assert is_q(lp["w_down"]) == (lp["w_down"].ndim == 2)  # experts [X, F, E] stay float
    assert load(DATA / path, weights="int8", cache=False) is qlm  # the process cache
    assert_close_to_dequantised(qlm, np.arange(24, dtype=np.int32)[None] * 5 % 250)


def test_int8_through_the_weight_cache(tmp_path, monkeypatch):
    """The cache keeps the float32 weights; int8 is quantised after: the same numbers."""
    from jaxsample import loading, weight_cache

    monkeypatch.setattr(weight_cache, "WEIGHT_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(loading, "_LOADED", {})
    first = load(DATA / "tiny_llama.gguf", weights="int8", cache=tmp_path)
    loading._LOADED.clear()
    second = load(DATA / "tiny_llama.gguf", weights="int8", cache=tmp_path)
    assert loading.load_info(first)["weights"] == "checkpoint"
    assert loading.load_info(second)["weights"] == "cache"
    a, b = jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(second.params)
    assert len(a) == len(b) and all(np.array_equal(x, y) and x.dtype == y.dtype
                                    for x, y in zip(a, b))


@pytest.mark.slow
def test_bfloat16_activations_with_int8_weights():
    qlm = load(DATA / "tiny_llama.gguf", weights="int8", dtype="bfloat16", cache=False)
    assert qlm.params["final_norm"].dtype == jnp.bfloat16 and qlm.params["embed"].dtype == jnp.bfloat16
    got = engine.generate(qlm, PROMPTS[:1], SamplingParams(n=2, max_new_tokens=6, seed=0))
    assert np.all(np.isfinite(got.logprobs))


def test_bad_weights_refused_before_any_load():
    for bad in ("int4", "INT8", "q8_0", 8, True):
        with pytest.raises(ConfigError, match=r"weights must be one of \[None, 'int8', "
                                              r"'int8-weight-only'\]"):
            load("/no/such/model.gguf", weights=bad)


def test_bad_dtype_and_cache_refused_before_any_load():
    """np.dtype("float32") compares equal to "float32" but is not a name: refused;
    a cache that is not None, a bool or a path is refused naming `cache`, by
    `load` and by `read_config` (never blamed on the checkpoint)."""
    from jaxsample.loading import read_config

    with pytest.raises(ConfigError, match=r"dtype must be one of \['float32', 'bfloat16'\]"):
        load("/no/such/model.gguf", dtype=np.dtype("float32"), weights="int8")
    for bad in (0, 1, 3.5, ["/tmp"]):
        with pytest.raises(ConfigError, match="cache must be None, True, False or a directory"):
            load("/no/such/model.gguf", cache=bad)
        with pytest.raises(ConfigError, match="cache must be None, True, False or a directory"):
            read_config(DATA / "tiny_llama.gguf", cache=bad)


# ---------------------------------------------------------------------------
# The engine with int8 weights


@pytest.fixture(scope="module")
def sampled(qlm):
    return engine.generate(qlm, PROMPTS, SamplingParams(n=4, temperature=1.0,
                                                        max_new_tokens=12, seed=7))


def _decode_against_forward(lm, gen_out):
    """|logprob of the cached decode - log_softmax of `lm`'s own full forward| per
    generated token, over every prompt and branch."""
    errs = []
    for b in range(len(PROMPTS)):
        for n in range(gen_out.tokens.shape[1]):
            L = int(gen_out.lengths[b, n])
            prompt, gen = list(gen_out.prompt_tokens[b]), list(gen_out.tokens[b, n, :L])
            seq = np.zeros((1, 64), np.int32)
            seq[0, :len(prompt) + L] = prompt + gen
            logits = np.asarray(lm.forward(seq))[0, len(prompt) - 1:len(prompt) + L - 1]
            ref = jax.nn.log_softmax(jnp.asarray(logits[:, :lm.vocab_limit]), axis=-1)
            errs.extend(np.abs(gen_out.logprobs[b, n, :L] - np.asarray(ref)[np.arange(L), gen]))
    return np.asarray(errs)


@pytest.mark.slow
def test_cached_decode_equals_own_forward_weight_only(qlm):
    """The int8 weights through the KV-cached decode: every branch's logprobs equal
    log_softmax of the same model's full forward to float32 rounding (weight-only
    int8: the product is continuous in its input, so the two paths' rounding
    differences stay at float32's scale; its prefix stays float32)."""
    wo = dataclasses.replace(qlm, params=quant.with_mode(qlm.params, "weight_only"))
    out = engine.generate(wo, PROMPTS, SamplingParams(n=4, temperature=1.0,
                                                      max_new_tokens=12, seed=7))
    errs = _decode_against_forward(wo, out)
    assert errs.size > 30 and errs.max() <= 1e-4, errs.max()


@pytest.mark.slow
def test_cached_decode_near_own_forward_w8a8(qlm):
    """W8A8 (the default): the same comparison, bounded by the activation quantiser.
    W8A8 rounds each activation row to int8 (`round(x / a)`), a step function: the
    decode and the full forward compute x in a different order, so where x / a lies
    within float32 rounding of a half-integer the two round it to neighbouring int8
    values (one step, a / 127 of the row's largest |x|), and the difference then
    flows through the KV cache to later tokens. Which elements sit on a boundary
    depends on the CPU's float rounding (an AVX2 machine flipped some where AVX-512
    ones did not: up to 0.065 nats). So most tokens agree to float32 rounding and
    none is further than a few such steps; the exact check of the cached path is
    the weight-only test above. The prefix is kept float32, as there: a float16
    prefix moves every later activation by its rounding, and W8A8 turns that into
    whole steps at many more elements (a median of 8e-3 nats here); its storage is
    checked against this path in `test_float16_prefix_is_the_float32_prefix_rounded`."""
    lm = dataclasses.replace(qlm, prefix_kv_dtype="model")
    errs = _decode_against_forward(lm, engine.generate(
        lm, PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=7)))
    assert errs.size > 30
    assert np.median(errs) <= 1e-4, np.median(errs)
    assert errs.max() <= 0.25, errs.max()


@pytest.mark.slow
@pytest.mark.kernels
def test_float16_prefix_is_the_float32_prefix_rounded(tiny_lm, qlm):
    """Where the CPU kernel reads it, a W8A8 model's prefix KV is stored in float16
    (`state.prefix_kv_dtype`): exactly the float32 prefill's K and V rounded to
    float16, and a decode step of 3 branches over it (the kernel widens each element
    exactly) equals, bit for bit, the same step over a float32 prefix holding those
    rounded values (the same kernel code on the same numbers). Values beyond float16's
    range saturate. `prefix_kv_dtype="model"` stores float32; weight-only int8 and
    a float32 model never store float16."""
    if not cpu_kernels.active():
        pytest.skip(f"the CPU kernels are off here ({cpu_kernels._STATE.get('status')})")
    w8 = quant.with_mode(qlm.params, "w8a8")
    cfg = qlm.config
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, qlm.vocab_limit, (2, 16)), jnp.int32)
    lengths = jnp.asarray([16, 11], jnp.int32)

    def prefix(params, kvd="auto"):  # the model's prefix_kv_dtype: a static argument
        return jax.jit(lambda p: prefill_fn(cfg, p, ids, lengths, prefix_kv_dtype=kvd)[0])(params)

    ctx = jax.jit(lambda p: prefill_context(cfg, p, ids[0, :8], jnp.int32(8))[0])(w8)

    def suffixes(params, kvd="auto"):  # the prompts' own caches after a common context
        return jax.jit(lambda p: prefill_suffix(cfg, p, ctx, ids, lengths,
                                                prefix_kv_dtype=kvd)[0])(params)

    half, half_s = prefix(w8), suffixes(w8)
    assert {a.dtype for a in half.k + half.v + half_s.k + half_s.v} == {jnp.dtype(jnp.float16)}
    assert {a.dtype for a in ctx.k + ctx.v} == {jnp.dtype(jnp.float32)}  # the context stays
    full, full_s = prefix(w8, "model"), suffixes(w8, "model")
    assert {a.dtype for a in full.k + full.v} == {jnp.dtype(jnp.float32)}
    for a, b in zip(half.k + half.v + half_s.k + half_s.v,
                    full.k + full.v + full_s.k + full_s.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.float16)))
    assert state.prefix_kv_dtype(cfg, w8) == jnp.float16
    assert state.prefix_kv_dtype(cfg, w8, "model") is None
    assert state.prefix_kv_dtype(cfg, quant.with_cpu_kernels(w8, False)) is None
    assert state.prefix_kv_dtype(cfg, quant.with_mode(w8, "weight_only")) is None
    assert state.prefix_kv_dtype(tiny_lm.config, tiny_lm.params) is None

    big = jnp.asarray([1e5, -1e6, 65504.0, 70000.0, jnp.nan, 1.0], jnp.float32)
    k16, v16 = stored_prefix(cfg, w8, [big], [-big])  # beyond float16's range: saturated
    np.testing.assert_array_equal(np.asarray(k16[0], np.float32),
                                  [65504, -65504, 65504, 65504, np.nan, 1])
    np.testing.assert_array_equal(np.asarray(v16[0]), -np.asarray(k16[0]))

    K, D = cfg.n_kv_heads, cfg.head_dim
    tail = [jnp.zeros((K, 4, D), jnp.float32)] * cfg.n_layers

    def step(pk, pv):  # row 0 (16 tokens): 3 branches' first decode step
        one = lambda tok: branch_step(cfg, w8, tok, jnp.int32(16), jnp.int32(0),  # noqa: E731
                                      pk, pv, jnp.int32(16), tail, tail)[0]
        return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray([3, 5, 7], jnp.int32)))

    got = step([a[0] for a in half.k], [a[0] for a in half.v])
    want = step([a[0].astype(jnp.float32) for a in half.k],
                [a[0].astype(jnp.float32) for a in half.v])
    np.testing.assert_array_equal(got, want)
    assert np.all(np.isfinite(got))


@pytest.mark.slow
@pytest.mark.kernels
def test_the_compiled_w8a8_step_reads_the_float16_prefix(qlm):
    """`step_cost.compile_decode_step` compiles the step the engine runs: for W8A8 its
    prefix is float16 and read by the float16 attention target (what `benchmarks/
    quantized.py --parts hlo` counts); weight-only's stays float32."""
    if not cpu_kernels.active():
        pytest.skip(f"the CPU kernels are off here ({cpu_kernels._STATE.get('status')})")
    from jaxsample.engine import step_cost

    for mode, target in (("w8a8", "jaxsample_segment_attention_f16"),
                         ("weight_only", "jaxsample_segment_attention")):
        text = step_cost.compile_decode_step(qlm.config, 16, 1, 8, weights="int8",
                                             mode=mode).as_text()
        calls = {t: text.count(f'custom_call_target="{t}"') for t in cpu_kernels.TARGETS
                 if "attention" in t}
        assert calls[target] == qlm.config.n_layers and sum(calls.values()) == calls[target]


@pytest.mark.slow
@pytest.mark.parametrize("mode", quant.MODES)
def test_off_the_cpu_the_int8_step_is_xla_products_of_int8_weights(mode, monkeypatch):
    """Where the default backend is a GPU (or a TPU) the kernels are off
    (`cpu_kernels.active()`) and the bfloat16 decode step is XLA's own: no custom
    call, every quantised matrix read as an int8 parameter (half a bfloat16
    weight's bytes), the products `dot`s of it (weight-only: the int8 weight
    widened to the activations' dtype inside the product's operand; W8A8: an int8 x
    int8 -> int32 dot), the prefix KV in the model's dtype."""
    from jaxsample.engine import step_cost
    from jaxsample.tiny import TINY

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not cpu_kernels.active()
    cfg = TINY.replace(dtype="bfloat16")
    text = step_cost.compile_decode_step(cfg, 16, 2, 8, weights="int8", mode=mode,
                                         chunk=True).as_text()
    assert "custom_call_target=\"jaxsample_" not in text
    entry = text[text.index("ENTRY"):]
    int8_params = re.findall(r"= s8\[([\d,]+)\]\{[^}]*\} parameter\(", entry)
    params = jax.eval_shape(lambda: llama.unstack_layers(llama.init_params(cfg, jax.random.key(0))))
    abstract = quant.quantize_params(params, compute="bfloat16", abstract=True, mode=mode,
                                     outliers=outliers.abstract_channels(params))
    qs = [a.q.shape for a in jax.tree_util.tree_leaves(abstract, is_leaf=is_q) if is_q(a)]
    assert sorted(tuple(map(int, p.split(","))) for p in int8_params) == sorted(qs)
    assert state.prefix_kv_dtype(cfg, abstract) is None
    int32_dots = re.findall(r"= s32\[[\d,]*\]\{[^}]*\} dot\(", text)
    assert bool(int32_dots) == (mode == "w8a8")
    assert re.search(r"= (bf16|f32)\[[\d,]*\]\{[^}]*\} dot\(", text)


@pytest.mark.slow
def test_off_the_cpu_weight_only_decode_is_the_dequantised_model(qlm, monkeypatch):
    """The same XLA path run: the weight-only int8 model's cached decode scores its
    tokens as the float32 model on the dequantised weights does (its full forward),
    to float32 rounding."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    wo = dataclasses.replace(qlm, params=quant.with_mode(qlm.params, "weight_only"))
    engine.PROGRAMS.clear()  # the in-memory programs are keyed by shapes, not the kernels
    try:
        out = engine.generate(wo, PROMPTS, SamplingParams(n=4, temperature=1.0,
                                                          max_new_tokens=12, seed=7))
    finally:
        engine.PROGRAMS.clear()
    errs = _decode_against_forward(dataclasses.replace(qlm, params=dequantised(qlm.params)),
                                   out)
    assert errs.size > 30 and errs.max() <= 1e-4, errs.max()


@pytest.mark.slow
def test_the_bill_counts_the_weights_as_stored(tiny_lm, qlm, sampled):
    """An int8 model's bill reads its weights at their stored size (int8 + float32 scales,
    norms and biases in float32, and the outlier channels' float32 rows: an eighth of
    each projection's input channels at the tiny model's widths), not at 4 bytes per
    parameter: 1 + 4 / 8 + the scales and norms, under 2 bytes per parameter here; and
    its prefix KV at its stored float16 where `state.prefix_kv_dtype` says so."""
    from jaxsample import cost

    stored = sum(int(np.asarray(a).nbytes) for a in jax.tree_util.tree_leaves(qlm.params))
    params = sum(int(np.asarray(a).size) for a in jax.tree_util.tree_leaves(tiny_lm.params))
    assert sampled.bill.weight_bytes == stored < params * 2
    assert cost.weight_bytes(tiny_lm.config) == params * 4  # the float bill, unchanged
    b = sampled.bill  # every step reads the stored weights once, then the KV
    half = state.prefix_kv_dtype(qlm.config, qlm.params) is not None  # a float16 prefix
    assert b.decode_bytes_read_shared - b.decode_steps * stored == cost.make_bill(
        tiny_lm.config, prompt_lengths=[len(p) for p in sampled.prompt_tokens],
        branch_lengths=b.decoded_tokens_per_branch, n=4, prefix_cache_bytes=0,
        tail_cache_bytes=0, decode_steps=b.decode_steps,
        prefix_dtype_bytes=2 if half else None).decode_bytes_read_shared \
        - b.decode_steps * params * 4


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("mode,atol", [("weight_only", 1e-5), ("w8a8", 0.05)])
def test_mesh_equals_unsharded(qlm, mode, atol):
    """Same seed, same tokens on a (2, 2) mesh (q and scale replicated like float weights).

    Weight-only int8 at float32's tolerance. W8A8 rounds every activation to int8,
    a step function: the mesh's shards run other batch shapes, whose float32 sums
    (attention, norms, the outlier channels) differ in the last bits, and an element
    within rounding of a half-integer flips one int8 step, which later layers
    amplify. On the tiny model that stays within the shared-prefix test's 0.05; on
    SmolLM2 a one-ulp change of one layer-0 norm weight moves W8A8's logprobs by up
    to 1.9 nats, its own error against float32 (`benchmarks/quantized.py --parts
    invariance`, docs/benchmarks.md), so there only weight-only int8 reproduces across meshes."""
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    lm8 = dataclasses.replace(qlm, params=quant.with_mode(qlm.params, mode))
    params = SamplingParams(n=8, max_new_tokens=10, seed=3, top_p=0.9)
    ref = engine.generate(lm8, PROMPTS, params)
    got = engine.generate(lm8, PROMPTS, params, mesh=jax.make_mesh((2, 2), ("data", "branch")))
    assert_same_tokens_up_to_ties(lm8, ref, got, logprob_atol=atol)


@pytest.mark.slow
def test_shared_prefix_and_zero_bridge(qlm, sampled):
    """Shared prefix = the prompts with the context prepended. Weight-only at float32's
    tolerance; W8A8 rounds x / s_x to an integer, and the two programs' attention sums
    differ in the last float32 bits, so an activation on a rounding tie flips one int8
    step (seen here: 69.500015 against 69.49999 in one layer's input, for seed 5, which
    moved later logprobs by 0.017): tokens up to ties, logprobs within 0.05. With W8A8's
    prefix in float16 the two are not the same computation (the prepended prompt stores
    its context positions in float16, the shared context stays float32), so the prefix
    is kept float32 here; its float16 storage is checked in
    `test_float16_prefix_is_the_float32_prefix_rounded`."""
    context = "Few-shot context shared by all: 1+1=2. 2+3=5. Now: "
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=5)
    for mode, atol in (("weight_only", 1e-5), ("w8a8", 0.05)):
        lm8 = dataclasses.replace(qlm, params=quant.with_mode(qlm.params, mode),
                                  prefix_kv_dtype="model")
        got = engine.generate(lm8, PROMPTS, params, shared_prefix=context)
        ref = engine.generate(lm8, [context + p for p in PROMPTS], params)
        assert_same_tokens_up_to_ties(lm8, ref, got, logprob_atol=atol)
    cfg = bridge_lib.BridgeConfig(dim=8, n_heads=2)
    zero = engine.generate(qlm, PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=12,
                                                        seed=7), bridge=bridge_lib.init(qlm, cfg))
    # (float models: bit-identical, tests/bridge/test_bridge.py; W8A8's activation rounding
    # may flip one int8 step where XLA fuses x / s_x differently: float32 tolerance)
    assert_same_tokens_up_to_ties(qlm, sampled, zero)
    np.testing.assert_allclose(zero.logprobs, sampled.logprobs, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------
# The command line: `run --weights int8`, `model.weights` in a config file


@pytest.mark.slow
@pytest.mark.usefixtures("compilation_cache_calls")
def test_cli_weights_flag_and_config(tmp_path, monkeypatch):
    import json

    from helpers import main_captured

    from jaxsample import cli

    gguf = str(DATA / "tiny_llama.gguf")
    code, out, err = main_captured(["run", "--model", gguf, "--prompt", "x", "--weights", "int4"])
    assert code == 2 and "--weights" in err and "int8" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {weights: int4}\n")
    code, out, err = main_captured(["run", "--prompt", "x", "--config", str(bad)])
    assert code == 2 and "model.weights must be one of null, int8, int8-weight-only" in err
    seen = []
    real = cli.app._load_model
    monkeypatch.setattr(cli.app, "_load_model", lambda *a, **k: seen.append(k) or real(*a, **k))
    code, out, err = main_captured(["run", "--model", gguf, "--prompt", "hi", "--n", "2",
                                    "--max-new-tokens", "4", "--seed", "0", "--weights", "int8",
                                    "--json", "--quiet"])
    assert code == 0, err
    assert seen[-1]["weights"] == "int8" and json.loads(out)
    assert (seen[-1]["prefix_kv_dtype"], seen[-1]["cpu_kernels"]) == ("auto", "auto")
    code, out, err = main_captured(["run", "--model", gguf, "--prompt", "hi", "--n", "2",
                                    "--max-new-tokens", "4", "--seed", "0", "--weights",
                                    "int8-weight-only", "--cpu-kernels", "off", "--json",
                                    "--quiet"])
    assert code == 0, err
    assert seen[-1]["weights"] == "int8-weight-only" and seen[-1]["cpu_kernels"] == "off"
    assert json.loads(out)["weights"] == "int8-weight-only"
