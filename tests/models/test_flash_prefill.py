"""Blockwise causal attention (`families.flash`) against the dense kernel and a float64 oracle.

Tolerances (float32): an attention output is a convex combination of value
rows, so its rounding error is a few float32 ulps of max|v| per accumulation:
the dense kernel sums M terms once, the blockwise kernel also rescales its
accumulator once per key block (at most S / block times). `RTOL = ATOL = 1e-5`
(about 80 ulps at |v| = 1) bounds both with a wide margin for S <= a few
hundred; the observed differences are near 1e-7. Logits of a model are
compared at the same relative bound scaled by max|logits|.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsample.engine.prefill import prefill as engine_prefill
from jaxsample.models.families import common, flash, gemma3, llama

RTOL = 1e-5
ATOL = 1e-5

# One compiled program per case (eager dispatch of the kernel's ops is slower).
blockwise = jax.jit(flash.blockwise_attention, static_argnames=(
    "window", "scale", "q_offset", "block_q", "block_k", "return_lse"))


def _qkv(Sq, Sk, H, K, D, seed=0, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(Sq, H, D)), dtype)
    k = jnp.asarray(r.normal(size=(K, Sk, D)), dtype)
    v = jnp.asarray(r.normal(size=(K, Sk, D)), dtype)
    return q, k, v


def _mask(Sq, Sk, q_offset=0, window=None, valid_len=None):
    """[Sq, Sk] bool in numpy: the rule of the docstring, written independently."""
    p = q_offset + np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    m = j <= p
    if window is not None:
        m &= j > p - window
    if valid_len is not None:
        m &= j < valid_len
    return m


def _oracle(q, k, v, mask, scale):
    """float64 softmax attention (numpy): out [Sq, H, D], lse [Sq, H]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    Sq, H, D = q.shape
    K = k.shape[0]
    kh = np.repeat(k, H // K, axis=0)  # [H, Sk, D], query head h uses kv head h // G
    vh = np.repeat(v, H // K, axis=0)
    s = np.einsum("shd,hmd->hsm", q * scale, kh)
    s = np.where(mask[None], s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    den = p.sum(-1, keepdims=True)
    out = np.einsum("hsm,hmd->shd", p / np.where(den > 0, den, 1.0), vh)
    lse = np.where(den > 0, np.log(np.where(den > 0, den, 1.0)) + mx, -np.inf)[..., 0].T
    return out, lse


def _check(got, want, vmax):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL * vmax)


CASES = [
    # (Sq, Sk, H, K, block_q, block_k, window, valid_len, q_offset); valid_len: right
    # padding, masked by the dense kernel and the oracle only (causality hides it).
    (64, 64, 4, 2, 16, 16, None, None, 0),  # S a multiple of the block
    (37, 37, 4, 2, 16, 16, None, None, 0),  # S not a multiple
    (5, 5, 4, 4, 16, 16, None, None, 0),  # S smaller than a block (MHA)
    (50, 50, 6, 1, 16, 16, None, 23, 0),  # ragged valid_len, MQA
    (50, 50, 4, 2, 16, 16, None, 1, 0),  # valid_len 1
    (70, 70, 4, 2, 16, 16, 5, None, 0),  # window smaller than a block
    (70, 70, 4, 2, 16, 16, 40, 61, 0),  # window larger than a block, ragged
    (70, 70, 4, 2, 16, 16, 16, None, 0),  # window equal to the block
    (70, 70, 4, 2, 16, 32, 20, None, 0),  # unequal blocks
    (48, 48, 4, 2, 32, 8, None, 30, 0),  # unequal blocks, other way
    (24, 64, 4, 2, 16, 16, None, None, 40),  # suffix over a context (q_offset)
    (24, 64, 4, 2, 16, 16, 12, None, 40),  # ... on a local layer
    (1, 33, 4, 2, 16, 16, None, None, 32),  # one query at the end
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_matches_dense_and_float64(case):
    Sq, Sk, H, K, bq, bk, window, valid_len, q_offset = case
    q, k, v = _qkv(Sq, Sk, H, K, 8)
    scale = 0.3
    out, lse = blockwise(q, k, v, window=window, scale=scale, q_offset=q_offset, block_q=bq,
                         block_k=bk, return_lse=True)
    mask = _mask(Sq, Sk, q_offset, window, valid_len)
    d_out, d_lse = common.partial_attention(q, k, v, jnp.asarray(mask), scale)
    o_out, o_lse = _oracle(q, k, v, mask, scale)
    # Queries below valid_len (all of them without padding) are the contract.
    real = slice(None) if valid_len is None else slice(0, valid_len - q_offset)
    out, lse, d_out, d_lse = (np.asarray(a)[real] for a in (out, lse, d_out, d_lse))
    vmax = float(np.abs(np.asarray(v)).max())
    _check(out, d_out, vmax)
    _check(out, o_out[real], vmax)
    assert np.isfinite(lse).all() and np.isfinite(o_lse[real]).all()
    np.testing.assert_allclose(lse, o_lse[real], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, d_lse, rtol=RTOL, atol=ATOL)


def test_no_key_visible_gives_zero_and_minus_inf():
    """Queries at 20..27 over keys 0..7 with a window of 4 see no key (only with a
    q_offset past the keys: a query always sees itself otherwise)."""
    q, k, v = _qkv(8, 8, 4, 2, 8)
    out, lse = blockwise(q, k, v, window=4, q_offset=20, block_q=4, block_k=4, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    out, lse = blockwise(q, k, v, window=15, q_offset=20, block_q=4, block_k=4, return_lse=True)
    assert np.isneginf(np.asarray(lse)[2:]).all() and np.isfinite(np.asarray(lse)[:2]).all()


def test_skipped_blocks_are_never_read():
    """Poison key/value blocks the kernel must skip with NaN: a computed block,
    even fully masked, would give 0 * NaN = NaN in the accumulator."""
    S, b, w = 64, 16, 10
    q, k, v = _qkv(S, S, 4, 2, 8)
    # Key block 0 (positions 0..15): above no query's diagonal, but outside the
    # window of query block 2 onward (first visible key of block 2 = 32 - 10 + 1).
    k = k.at[:, :16].set(jnp.nan)
    v = v.at[:, :16].set(jnp.nan)
    out = np.asarray(blockwise(q, k, v, window=w, block_q=b, block_k=b))
    assert np.isnan(out[:16]).all() and np.isfinite(out[32:]).all()
    pairs = flash.block_pairs(S, S, b, b, window=w)
    assert not pairs[2:, 0].any() and pairs[np.arange(4), np.arange(4)].all()


def test_skipping_survives_vmap():
    """Under vmap over prompts (batched q, k, v) the block switch stays a `cond` (a
    batched index would turn it into a select that runs every side), also with a
    traced window (the stacked layout's per-layer scan input)."""
    q, k, v = _qkv(40, 40, 4, 2, 8)
    qs, ks, vs = (jnp.stack([a, 2 * a]) for a in (q, k, v))
    for window in (None, 8, jnp.int32(8)):
        f = jax.vmap(lambda q_, k_, v_, window=window: flash.blockwise_attention(
            q_, k_, v_, window=window, block_q=16, block_k=16))
        jaxpr = str(jax.make_jaxpr(f)(qs, ks, vs))
        assert "cond[" in jaxpr, window


def test_block_pairs_halve_the_work():
    """The triangle: 36 of 64 block pairs at S = 4096 / 512; with Gemma 3's window 512,
    only the diagonal and the block below it (15)."""
    assert flash.block_pairs(4096, 4096, 512, 512).sum() == 36
    assert flash.block_pairs(4096, 4096, 512, 512, window=512).sum() == 15


@pytest.mark.slow
def test_gradients_match_dense():
    """Bridge training differentiates the base model's attention: reverse mode works
    (scan + cond only) and equals the dense kernel's gradient."""
    q, k, v = _qkv(40, 40, 4, 2, 8)
    # Only the 33 real positions carry a cotangent (outputs past valid_len are padding).
    ct = np.random.default_rng(1).normal(size=q.shape)
    ct[33:] = 0
    ct = jnp.asarray(ct, jnp.float32)

    def loss(impl):
        attend = common.causal_attend(jnp.int32(33), window=12, scale=0.4, impl=impl)
        return lambda q_, k_, v_: jnp.sum(attend(q_, k_.swapaxes(0, 1), v_.swapaxes(0, 1)) * ct)

    old = flash.BLOCK
    try:
        flash.BLOCK = 16
        gb = jax.jit(jax.grad(loss("blockwise"), argnums=(0, 1, 2)))(q, k, v)
    finally:
        flash.BLOCK = old
    gd = jax.jit(jax.grad(loss("dense"), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(gb, gd):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL,
                                   atol=ATOL * float(np.abs(np.asarray(b)).max()))


def test_bfloat16_within_bfloat16_rounding():
    """bfloat16 q/k/v: both kernels round the probabilities to bfloat16 before the
    second product (relative 2^-8 each); against the float64 oracle of the same
    bfloat16 inputs, 4 * 2^-8 of max|v| bounds both."""
    q, k, v = _qkv(45, 45, 4, 2, 8, dtype=jnp.bfloat16)
    mask = _mask(45, 45, window=20, valid_len=41)
    got = blockwise(q, k, v, window=20, block_q=16, block_k=16)
    dense = common.partial_attention(q, k, v, jnp.asarray(mask))[0]
    want, _ = _oracle(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                      mask, 1.0 / math.sqrt(8))
    # q is scaled in bfloat16 by both kernels: compare with the oracle of that q.
    vmax = float(np.abs(np.asarray(v, np.float32)).max())
    tol = 4 * 2.0 ** -8 * vmax
    np.testing.assert_allclose(np.asarray(got)[:41], want[:41], atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(dense)[:41], want[:41], atol=tol, rtol=0)


def test_bad_arguments():
    q, k, v = _qkv(8, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="block_q"):
        flash.blockwise_attention(q, k, v, block_q=0)
    with pytest.raises(ValueError, match="q_offset"):
        flash.blockwise_attention(q, k, v, q_offset=-1)
    with pytest.raises(ValueError, match="k"):
        flash.blockwise_attention(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(ValueError, match="impl"):
        common.causal_attend(impl="flash")


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(S=st.integers(1, 70), block=st.sampled_from([4, 8, 16, 32]),
       window=st.one_of(st.none(), st.integers(1, 80)), frac=st.floats(0.01, 1.0))
def test_property_matches_float64(S, block, window, frac):
    valid_len = max(1, int(round(frac * S)))
    q, k, v = _qkv(S, S, 4, 2, 8, seed=S)
    out = blockwise(q, k, v, window=window, block_q=block, block_k=block)
    want, _ = _oracle(q, k, v, _mask(S, S, 0, window, valid_len), 1.0 / math.sqrt(8))
    _check(np.asarray(out)[:valid_len], want[:valid_len], float(np.abs(np.asarray(v)).max()))


# ---------------------------------------------------------------------------
# Through the model families and the engine's prefill


def _gemma_cfg():
    # Local windows 6 (< block) and 24 (> block 16), a global layer.
    return gemma3.Gemma3Config(vocab_size=264, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                               head_dim=8, ffn_dim=64, layer_windows=(6, 24, None),
                               query_pre_attn_scalar=12.0, final_logit_softcapping=30.0,
                               max_seq_len=256)


FAMILIES = {"llama": (llama, lambda: TINY), "gemma3": (gemma3, _gemma_cfg)}


def _with_kernel(use_blockwise: bool, fn, *args):
    """Run fn(*args) (jitted, traced afresh) with causal_attend's auto choice forced
    to one kernel (blocks of 16 positions)."""
    old = flash.BLOCKWISE_FROM, flash.BLOCK
    floor = 1 if use_blockwise else 10**9
    flash.BLOCKWISE_FROM, flash.BLOCK = tuple((b, floor) for b, _ in old[0]), 16
    try:
        return jax.tree_util.tree_map(np.asarray, jax.jit(lambda *a: fn(*a))(*args))
    finally:
        flash.BLOCKWISE_FROM, flash.BLOCK = old


def test_kernel_choice_by_backend(monkeypatch):
    """Blockwise from the default backend's `BLOCKWISE_FROM` entry on (the dense
    kernel measured 3x faster on a GPU); a backend without one takes the CPU's."""
    table = dict(flash.BLOCKWISE_FROM)
    cpu, gpu, tpu = table["cpu"], table["gpu"], table["tpu"]
    assert cpu < tpu < gpu
    assert not flash.use_blockwise(cpu - 1) and flash.use_blockwise(cpu)
    for backend, floor in (("gpu", gpu), ("tpu", tpu), ("cpu", cpu), ("metal", cpu)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert flash.blockwise_from() == floor == flash.blockwise_from(backend)
        assert not flash.use_blockwise(floor - 1) and flash.use_blockwise(floor)
    assert flash.use_blockwise(cpu, "cpu") and not flash.use_blockwise(cpu, "gpu")
    # The engine's prefill takes the choice when it is traced.
    monkeypatch.setattr(flash, "BLOCKWISE_FROM", (("cpu", 10**9), ("gpu", 1)))
    calls = []
    monkeypatch.setattr(flash, "blockwise_attention",
                        lambda *a, **k: calls.append(1) or a[0].astype(jnp.float32))
    q = jnp.ones((8, 4, 8))
    kv = jnp.ones((8, 2, 8))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    common.causal_attend()(q, kv, kv)
    assert calls  # blockwise from 1 position on the GPU
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    calls.clear()
    common.causal_attend()(q, kv, kv)
    assert not calls


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL * max(1.0, np.abs(y).max()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "list"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_both_kernels(family, layout):
    """The no-cache forward (logits [B, S, V]) with either kernel, both layouts."""
    fam, make_cfg = FAMILIES[family]
    cfg = make_cfg()
    params = fam.init_params(cfg, jax.random.key(1), 0.3)
    if layout == "list":
        params = common.unstack_layers(params)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, size=(2, 45)), jnp.int32)
    run = lambda p, t: fam.forward(cfg, p, t)
    dense = _with_kernel(False, run, params, tokens)
    blk = _with_kernel(True, run, params, tokens)
    _close(blk, dense)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_prefill_both_kernels(family):
    """engine.prefill (vmapped over ragged prompts): KV caches (local layers keep their
    last window positions) and last logits equal with either kernel."""
    fam, make_cfg = FAMILIES[family]
    cfg = make_cfg()
    params = common.unstack_layers(fam.init_params(cfg, jax.random.key(3), 0.3))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, size=(3, 48)), jnp.int32)
    lengths = jnp.array([48, 17, 1], jnp.int32)
    run = lambda p, t, n: engine_prefill(cfg, p, t, n)
    (pd, ld), (pb, lb) = (_with_kernel(b, run, params, tokens, lengths) for b in (False, True))
    _close(lb, ld)
    for r, n in enumerate(np.asarray(lengths)):
        # Only positions below the prompt's length are ever read (padding keys are masked).
        for a, b, w in zip(pb.k + pb.v, pd.k + pd.v, cfg.layer_windows * 2):
            upto = n if w is None else min(n, a.shape[2])
            _close(a[r, :, :upto], b[r, :, :upto])


@pytest.mark.slow
def test_engine_prefill_with_bridge_both_kernels(tiny_lm):
    """The Bridge's prefill hook (`post_layer` after every block, no branch axes) with
    either kernel: a Bridge with a non-zero output projection, so the hook acts."""
    from jaxsample import bridge as bridge_lib

    b = bridge_lib.init(tiny_lm, bridge_lib.BridgeConfig(dim=16, n_heads=2))
    bp = dict(b.params, wo=0.3 * jax.random.normal(jax.random.key(5), b.params["wo"].shape))
    post = lambda x, p_l: bridge_lib.apply_block(b.config, p_l, x, True, ())
    cfg, params = tiny_lm.config, common.unstack_layers(tiny_lm.params)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 256, size=(2, 40)), jnp.int32)
    lengths = jnp.array([40, 29], jnp.int32)
    run = lambda p, t, n, q: engine_prefill(cfg, p, t, n, post, q)
    (pd, ld), (pb, lb) = (_with_kernel(k, run, params, tokens, lengths, bp) for k in (False, True))
    base = _with_kernel(False, lambda p, t, n: engine_prefill(cfg, p, t, n)[1], params, tokens,
                        lengths)
    assert np.abs(ld - base).max() > 1e-3  # the Bridge changed the logits
    _close(lb, ld)
    for r, n in enumerate(np.asarray(lengths)):
        for a, c in zip(pb.k + pb.v, pd.k + pd.v):
            _close(a[r, :, :n], c[r, :, :n])


@pytest.mark.slow
def test_suffix_over_context_by_merge():
    """The three-level recipe: a suffix attending to a computed context (all of it
    visible) plus itself causally = `partial_attention` over the context merged by
    log-sum-exp with the blockwise kernel over the suffix; equals one call over
    `[context; suffix]` keys with `q_offset = C`, and the float64 oracle."""
    C, S = 21, 37
    q, k, v = _qkv(S, C + S, 4, 2, 8, seed=7)
    ctx = common.partial_attention(q, k[:, :C], v[:, :C], jnp.ones((S, C), bool), 0.3)
    own = blockwise(q, k[:, C:], v[:, C:], scale=0.3, block_q=16, block_k=16, return_lse=True)
    merged = common.merge_attention([ctx, own])
    one_call = blockwise(q, k, v, scale=0.3, q_offset=C, block_q=16, block_k=16)
    want, _ = _oracle(q, k, v, _mask(S, C + S, q_offset=C), 0.3)
    vmax = float(np.abs(np.asarray(v)).max())
    _check(merged, want, vmax)
    _check(one_call, want, vmax)
