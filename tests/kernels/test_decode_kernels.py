"""The Pallas decode attention kernels (jaxsample/kernels) against the XLA path, in interpret mode.

* `kernel.segments`, both drivers (Triton's loop over visible blocks, Mosaic's
  grid with clamped block indices), against `reference.segments` (the engine's
  `common.partial_attention`): ragged valid lengths (0, partial, full), window
  lower bounds, padded query blocks, several position blocks, soft-capping,
  float32 within 1e-5 and bfloat16 within the rounding of its probabilities;
* `segment_attention` under the decode step's two vmaps (rows, then branches
  with the prefix unbatched) against `common.partial_attention` over the same
  masks, GQA ratios 1, 4 and 8, a sliding window on the prefix and a ring tail;
  the kernel reads each row's prefix once with the queries of all its branches;
* the same on a (1, 4) mesh ("data", "branch") against the unsharded XLA path;
* the engine option: `generate(..., attention="pallas")` gives the default's
  tokens on the tiny Llama and the tiny Gemma 3 (sliding windows, rings),
  unknown values are an InputError;
* both drivers lower for their platform (`jax.export`, no device needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from ties import assert_same_tokens_up_to_ties

from jaxsample import SamplingParams, engine, kernels
from jaxsample.errors import InputError
from jaxsample.kernels.decode_attention import kernel, reference, segment_attention
from jaxsample.models.families import common

pytestmark = pytest.mark.kernels

from paths import DATA

BF16_U = 2.0 ** -8  # bfloat16's unit roundoff (8 significant bits)


def _rand(rng, shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _assert_close(got, ref, v, dtype):
    """out within 1e-5 (float32), or 2u max|v| (bfloat16: each implementation rounds
    every probability to bfloat16 before the product with V, relative error <= u,
    so their weighted sums of V differ by at most 2u max|v|); lse within 1e-5
    relative (float32 in both), -inf in the same places."""
    (out, lse), (rout, rlse) = got, ref
    tol = 1e-5 if dtype == jnp.float32 else 2 * BF16_U * float(jnp.max(jnp.abs(v))) + 1e-5
    np.testing.assert_allclose(np.asarray(out), np.asarray(rout), rtol=0, atol=tol)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# The kernel against its reference


KERNEL_CASES = [  # driver, dtype, softcap, blocks (bm, bl): several position blocks of 8,
    ("triton", jnp.float32, None, (16, 8), 3),  # split into c parts (Triton's split-K)
    ("triton", jnp.bfloat16, 5.0, (16, 8), 2),
    ("mosaic", jnp.float32, 5.0, (8, 8), None),
    ("mosaic", jnp.bfloat16, None, (16, 8), None),
]


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype,softcap,blocks,splits", KERNEL_CASES,
                         ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-{'cap' if c[2] else 'nocap'}"
                              for c in KERNEL_CASES])
def test_kernel_equals_reference(backend, dtype, softcap, blocks, splits):
    rng = np.random.default_rng(0)
    B, K, M, L, D = 5, 2, 11, 40, 16  # M: a padded last query block; L: 5 blocks of 8
    q, k, v = _rand(rng, (B, K, M, D), dtype), _rand(rng, (B, K, L, D), dtype), _rand(
        rng, (B, K, L, D), dtype)
    # Rows: nothing, all of L, ragged lengths; window lower bounds past whole blocks,
    # one row with lo >= hi (nothing visible).
    hi = np.array([0, L, 13, 27, 1])[:, None].repeat(M, 1)
    lo = rng.integers(0, 20, size=(B, M))
    lo[1, :3] = 0
    lo[3] = rng.integers(16, 27, size=M)  # the first two blocks of 8 skipped
    lo[3, 0] = 30
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    ref = reference.segments(q, k, v, lo, hi, softcap=softcap)
    # Mosaic in the TPU interpreter: SMEM scalars, VMEM scratch (NaN until written) and
    # out-of-bounds reads (an error) as on a TPU.
    interpret = pltpu.InterpretParams() if backend == "mosaic" else True
    got = kernel.segments(q, k, v, lo, hi, softcap=softcap, backend=backend, interpret=interpret,
                          blocks=blocks, splits=splits)
    _assert_close(got, ref, v, dtype)
    assert np.isneginf(np.asarray(got[1])[0]).all() and np.isneginf(np.asarray(got[1])[3, :, 0]).all()
    # The default block shapes (one position block here on Mosaic, a masked last one on Triton).
    _assert_close(kernel.segments(q, k, v, lo, hi, softcap=softcap, backend=backend,
                                  interpret=interpret), ref, v, dtype)


def test_block_shapes_are_legal_on_their_backend():
    """Triton: powers of two, >= 16 (its dots); Mosaic: bm a multiple of the sublane
    tiling (8, 16 for 16-bit), bl dividing L or all of L."""
    for M in (1, 4, 16, 33, 64, 256, 1000):
        for L in (16, 24, 511, 768, 1536, 4096, 1023):
            for D in (64, 128, 256):
                bm, bl = kernel.block_shapes("triton", M, L, D, jnp.bfloat16)
                assert bm >= 16 and bl >= 16 and not bm & (bm - 1) and not bl & (bl - 1)
                for dtype, sub in ((jnp.float32, 8), (jnp.bfloat16, 16)):
                    bm, bl = kernel.block_shapes("mosaic", M, L, D, dtype)
                    assert bm % sub == 0 and bm <= kernel.MOSAIC_MAX_ROWS and bm >= min(M, 1)
                    assert L % bl == 0 and (bl == L or bl % 16 == 0)
    # Split-K fills the GPU for one row's long prefix, never for a batch of tails.
    assert kernel.triton_splits(8, 16384, 64) > 1 and kernel.triton_splits(1024, 16384, 64) == 1
    assert kernel.triton_splits(1, 100, 64) == 1  # too few blocks to split
    with pytest.raises(ValueError, match="power of two"):
        kernel.check_shapes("triton", 96)
    kernel.check_shapes("mosaic", 96)


# ---------------------------------------------------------------------------
# The one-branch op under the decode step's vmaps


def _step_like(attend, window):
    """vmap over rows (everything batched) of vmap over branches (prefix unbatched),
    as `engine.step`: the prefix (slot j at position j) seen through its valid length
    and the window's lower bound, the tail (a ring of T <= window - 1 slots when the
    window is set) through its first min(t, T) slots."""

    def one(q, pk, pv, plen, tk, tv, t, position):
        lo = 0 if window is None else jnp.maximum(position - window + 1, 0)
        return attend(q, pk, pv, lo, plen, tk, tv, jnp.minimum(t, tk.shape[1]))

    branches = jax.vmap(one, in_axes=(0, None, None, None, 0, 0, 0, 0))
    return jax.jit(jax.vmap(branches))


def _xla(scale):
    def attend(q, pk, pv, lo, hi, tk, tv, t_hi):
        jp, jt = jnp.arange(pk.shape[1]), jnp.arange(tk.shape[1])
        a = common.partial_attention(q, pk, pv, ((jp >= lo) & (jp < hi))[None], scale)
        b = common.partial_attention(q, tk, tv, (jt < t_hi)[None], scale)
        return a, b
    return attend


def _pallas(scale):
    def attend(q, pk, pv, lo, hi, tk, tv, t_hi):
        seg = functools.partial(segment_attention, scale=scale, interpret=True)
        return seg(q, pk, pv, lo, hi), seg(q, tk, tv, 0, t_hi)
    return attend


def _inputs(rng, R, N, K, G, D, P, T, dtype):
    H = K * G
    q = _rand(rng, (R, N, 1, H, D), dtype)
    pk, pv = _rand(rng, (R, K, P, D), dtype), _rand(rng, (R, K, P, D), dtype)
    tk, tv = _rand(rng, (R, N, K, T, D), dtype), _rand(rng, (R, N, K, T, D), dtype)
    plen = jnp.asarray([P, 9][:R], jnp.int32)  # a full and a ragged prefix
    # Tail lengths 0, partial, full (T) and past T (a ring's every slot).
    t = jnp.asarray(np.array([[0, 1, 3, T, T + 5, 2, 6, 4],
                              [T, 0, 2, T + 3, 6, 1, 4, 5]])[:R, :N], jnp.int32)
    position = plen[:, None] + t  # the token's position: prefix, then its tail
    return (q, pk, pv, plen, tk, tv, t, position), (pv, tv)


VMAP_CASES = [  # G, dtype, window, soft-cap
    (1, jnp.float32, None, None),
    (4, jnp.float32, 6, 3.0),
    (8, jnp.float32, 6, None),
    (4, jnp.bfloat16, 6, 3.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("G,dtype,window,softcap", VMAP_CASES,
                         ids=[f"G{c[0]}-{jnp.dtype(c[1]).name}-w{c[2]}-cap{c[3]}"
                              for c in VMAP_CASES])
def test_segment_attention_under_the_step_vmaps(G, dtype, window, softcap):
    """Rows of a shared prefix (full and ragged length, a window's lower bound per
    branch) and per-slot tails (lengths 0, partial, full, and past the ring's size)."""
    rng = np.random.default_rng(G)
    R, N, K, D, P = 2, 6, 2, 16, 24
    T = 8 if window is None else window - 1
    scale = 0.25 if softcap is None else common.SoftCappedScale(0.25, softcap)
    args, (pv, tv) = _inputs(rng, R, N, K, G, D, P, T, dtype)
    ref = _step_like(_xla(scale), window)(*args)
    got = _step_like(_pallas(scale), window)(*args)
    _assert_close(got[0], ref[0], pv, dtype)
    _assert_close(got[1], ref[1], tv, dtype)


def _kernel_operands(fn, *args):
    """The shapes of every pallas_call's operands in fn's jaxpr (sub-jaxprs included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append([tuple(x.aval.shape) for x in eqn.invars])
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_the_prefix_is_one_query_block_per_row():
    """The prefix kernel gets each row's prefix once ([R, K, P, D]) with the N
    branches' G query heads as the rows of one block ([R, K, N*G, D]); the tail
    kernel one segment per slot ([R*N, K, T, D])."""
    rng = np.random.default_rng(1)
    R, N, K, G, D, P, T = 2, 6, 2, 4, 16, 24, 5
    args, _ = _inputs(rng, R, N, K, G, D, P, T, jnp.float32)
    ops = _kernel_operands(_step_like(_pallas(0.25), 6), *args)
    assert len(ops) == 2, ops
    prefix, tail = sorted((o[-5:] for o in ops), key=lambda o: -o[1][2])  # P > T
    assert prefix[1] == prefix[2] == (R, K, P, D)
    assert prefix[0][:2] == (R, K) and prefix[0][2] >= N * G and prefix[0][3] == D
    assert tail[1] == tail[2] == (R * N, K, T, D)


@pytest.mark.slow
@pytest.mark.multidevice
def test_segment_attention_on_a_mesh():
    """shard_map over a (1, 4) ("data", "branch") mesh, 2 branches per device, the
    prefix replicated: the unsharded XLA path's results."""
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh((1, 4), ("data", "branch"))
    P_ = jax.sharding.PartitionSpec
    rng = np.random.default_rng(2)
    R, N, K, G, D, P, T = 1, 8, 2, 4, 16, 24, 5
    args, (pv, tv) = _inputs(rng, R, N, K, G, D, P, T, jnp.float32)
    scale = common.SoftCappedScale(0.25, 3.0)
    ref = _step_like(_xla(scale), 6)(*args)
    branch = P_("data", "branch")
    specs = (branch, P_("data"), P_("data"), P_("data"), branch, branch, branch, branch)
    inner = _step_like(_pallas(scale), 6)
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, p)) for a, p in zip(args, specs)]
    got = jax.jit(jax.shard_map(inner, mesh=mesh, in_specs=specs, check_vma=False,
                                out_specs=((branch, branch), (branch, branch))))(*args)
    _assert_close(got[0], ref[0], pv, jnp.float32)
    _assert_close(got[1], ref[1], tv, jnp.float32)


# ---------------------------------------------------------------------------
# Lowering for the accelerators (no device needed)


@pytest.mark.parametrize("backend,platform", [("triton", "cuda"), ("mosaic", "tpu")])
def test_the_kernel_lowers_for_its_platform(backend, platform):
    """Decode-sized shapes (GQA 4 x 16 branches over a 1536-position prefix, D = 128;
    a Gemma-like 511-slot window, D = 256) in bfloat16 and float32, soft-capped."""
    checks = ([jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
              if backend == "triton" else [])
    target = {"triton": "__gpu$xla.gpu.triton", "mosaic": "tpu_custom_call"}[backend]
    for dtype in (jnp.bfloat16, jnp.float32):
        for B, K, M, L, D in ((1, 8, 64, 1536, 128), (16, 1, 4, 511, 256)):
            s = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
            f = functools.partial(kernel.segments, softcap=30.0, backend=backend)
            exp = jax.export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(
                s(B, K, M, D), s(B, K, L, D), s(B, K, L, D), s(B, M, dt=jnp.int32),
                s(B, M, dt=jnp.int32))
            assert target in exp.mlir_module()


# ---------------------------------------------------------------------------
# The engine option


def test_attention_option_is_checked_and_resolved(tiny_lm):
    cfg = tiny_lm.config
    with pytest.raises(InputError, match="attention must be one of 'auto', 'xla', 'pallas'"):
        engine.generate(tiny_lm, ["ab"], SamplingParams(max_new_tokens=2), attention="triton")
    with pytest.raises(InputError, match="attention"):
        engine.generate(tiny_lm, ["ab"], SamplingParams(max_new_tokens=2), attention=None)
    assert kernels.resolve_attention("auto", cfg, "cpu") == "xla"
    assert kernels.resolve_attention("pallas", cfg, "cpu") == "pallas"
    assert kernels.resolve_attention("xla", cfg, "tpu") == "xla"
    assert kernels.resolve_attention("auto", cfg, "tpu") == "pallas"
    # Triton tiles power-of-two head dims >= 16: the tiny model's 8 is not one.
    assert kernels.resolve_attention("auto", cfg, "gpu") == "xla"
    assert kernels.resolve_attention("auto", cfg.replace(head_dim=64), "gpu") == "pallas"
    with pytest.raises(InputError, match="attention='pallas'.*head dim"):
        kernels.resolve_attention("pallas", cfg, "gpu")
    assert kernels.kernel_backend("cpu") == ("triton", True)
    assert kernels.kernel_backend("gpu") == ("triton", False)
    assert kernels.kernel_backend("tpu") == ("mosaic", False)


@pytest.mark.slow
def test_generate_with_pallas_attention_tiny_llama(tiny_lm):
    params = SamplingParams(n=4, max_new_tokens=12, seed=5, top_p=0.9, stop_token_ids=[])
    prompts = ["hello", "a longer prompt than the other one"]
    ref = engine.generate(tiny_lm, prompts, params)
    got = engine.generate(tiny_lm, prompts, params, attention="pallas")
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


@pytest.mark.slow
@pytest.mark.multidevice
def test_generate_with_pallas_attention_tiny_gemma3_on_a_mesh():
    """Local layers of window 8 (the prefix's last 7 positions, a ring of 7 tail
    slots) on prompts and tails longer than the window, branches on a (1, 4) mesh."""
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    from checkpoint_files import load_uncached

    lm = load_uncached(DATA / "tiny_gemma3")
    assert 8 in lm.config.layer_windows and None in lm.config.layer_windows
    params = SamplingParams(n=8, max_new_tokens=20, seed=1, stop_token_ids=[], ignore_eos=True)
    prompts = ["a prompt longer than the window of eight", "hi"]
    ref = engine.generate(lm, prompts, params)
    got = engine.generate(lm, prompts, params, attention="pallas",
                          mesh=jax.make_mesh((1, 4), ("data", "branch")))
    assert_same_tokens_up_to_ties(lm, ref, got)
