"""The int8 decode's CPU kernels (`models.cpu_kernels.cpu_kernels`) against independent oracles.

Oracles: int64 numpy for the int8 x int8 product (exact, so equality), float64
numpy for the float32 x int8 product (within float32 summation's bound) and for
the segment attention (within a bound derived from float32's roundoff), XLA's
ops for W8A8's one-call product (`quant.w8a8_expression`: the same steps, so bit
for bit without kept channels) alone and on its inputs inside a model, the one-row
product for a batch (the kernel's sums do not depend on M), and fresh processes
for the build, the cache and the fallback.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import int8_lm
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import ROOT
from xla_flags import xla_flags

from jaxsample.models.cpu_kernels import cpu_kernels
from jaxsample.models.families import families, llama
from jaxsample.models.quantization import quant

CAN_BUILD = (platform.system() == "Linux" and platform.machine() == "x86_64"
             and shutil.which("c++") is not None
             and "avx2" in open("/proc/cpuinfo").read() and "fma" in open("/proc/cpuinfo").read())
needs_kernels = pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 Linux, AVX2+FMA, c++")

pytestmark = pytest.mark.kernels


@pytest.mark.slow
@needs_kernels
def test_the_kernels_build_here():
    """On a machine that can build them (CI's) the kernels must be on: a silent
    fallback would leave every other test here checking XLA against itself."""
    assert cpu_kernels.enabled(), cpu_kernels._STATE


def test_the_kernel_sources_ship_with_the_package():
    """Every source the build compiles is package data of the package that holds the
    driver: an installed (not editable) jaxsample must find them beside
    models/cpu_kernels/cpu_kernels.py."""
    import tomllib

    root = ROOT
    data = tomllib.loads((root / "pyproject.toml").read_text())
    shipped = set(data["tool"]["setuptools"]["package-data"][cpu_kernels.__package__])
    files = (*cpu_kernels.SOURCES, cpu_kernels.HEADER)
    assert {p.name for p in files} <= shipped
    assert all(p.is_file() and p.parent == pathlib.Path(cpu_kernels.__file__).parent
               for p in files)


shapes = st.tuples(st.integers(1, 20), st.integers(1, 700), st.integers(1, 150))
rows_either_side = st.tuples(st.sampled_from([1, 2, 63, 64, 65, 80]), st.integers(1, 300),
                             st.integers(1, 70))  # MAX_ROWS = 64: the kernel, then XLA (AVX2)


U = 2.0**-24  # float32's unit roundoff


def isas_here() -> list[str]:
    """The int8 product's instruction sets this CPU runs (AVX2; AVX-512 VNNI where it has it)."""
    if not cpu_kernels.enabled():
        return []
    with cpu_kernels.use_isa(cpu_kernels.ISAS[-1]):
        best = cpu_kernels.isa()
    return list(cpu_kernels.ISAS[:cpu_kernels.ISAS.index(best) + 1])


@pytest.mark.slow
@needs_kernels
@settings(deadline=None)  # each new shape compiles
@given(st.one_of(shapes, rows_either_side), st.integers(0, 2**31 - 1))
def test_int8_product_is_exact(mkn, seed):
    """Values at the ends of [-127, 127] (and -128 in w) included: the int32 sums equal
    int64 numpy's, on every instruction set this CPU runs (`cpu_kernels.use_isa`)."""
    M, K, N = mkn
    rng = np.random.default_rng(seed)
    x = rng.choice(np.array([-127, -1, 0, 1, 127], np.int8), (M, K))
    x[:, ::3] = rng.integers(-127, 128, x[:, ::3].shape)
    w = rng.integers(-128, 128, (N, K), dtype=np.int8)
    want = x.astype(np.int64) @ w.T.astype(np.int64)
    f = jax.jit(cpu_kernels.int8_dot)
    for isa in isas_here():
        with cpu_kernels.use_isa(isa):
            got = np.asarray(f(x, w))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want, err_msg=isa)


def _w8a8_case(rng, M, K, N, J):
    """x with channels of very different sizes (some rows zero, one a single channel),
    a quantised `[N, K]` weight, J channels kept apart (`quant.quantize`'s form)."""
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 30.0, K)).astype(np.float32)
    if M > 2:
        x[1] = 0.0  # an all-zero row: its scale is 1
        x[2, :] = 0.0
        x[2, K // 2] = -3.0
    w = quant.quantize(rng.standard_normal((N, K)), rows=True,
                       outliers=rng.choice(K, J, replace=False) if J else None)
    return x, w


@pytest.mark.slow
@needs_kernels
@settings(deadline=None, max_examples=40)  # each new shape compiles
@given(st.one_of(shapes, rows_either_side), st.sampled_from([0, 1, 5, 16]),
       st.integers(0, 2**31 - 1))
def test_w8a8_product_in_one_call_against_the_xla_expression(mkn, J, seed):
    """`cpu_kernels.w8a8_dot` (quantise x per row, the int8 product, rescale, add the
    kept channels' product) against `quant.w8a8_expression`, XLA's ops for the same
    steps, on every instruction set: equal bit for bit without kept channels; with J of
    them within float32 rounding of their J-term sum (the kernel adds the terms to y one
    by one), |diff| <= (J + 2) u (|y| + sum_j |x_j w_j|)."""
    M, K, N = mkn
    J = min(J, K)
    x, w = _w8a8_case(np.random.default_rng(seed), M, K, N, J)
    kept = tuple(w.outliers) if J else None
    want = np.asarray(jax.jit(lambda x: quant.w8a8_expression(
        x, w.q, w.scale, *(kept or ()), transposed=True))(x))
    f = jax.jit(lambda x: cpu_kernels.w8a8_dot(x, w.q, w.scale, kept))
    for isa in isas_here():
        with cpu_kernels.use_isa(isa):
            got = np.asarray(f(x))
        assert got.dtype == np.float32 and got.shape == (M, N)
        if not J:
            np.testing.assert_array_equal(got, want, err_msg=isa)
            continue
        idx, _, w_out = w.outliers
        terms = np.abs(x[:, idx]).astype(np.float64) @ np.abs(w_out).astype(np.float64)
        tol = (J + 2) * U * (np.abs(want) + terms)
        assert np.all(np.abs(got - want) <= tol), (isa, np.max(np.abs(got - want) - tol))


@needs_kernels
@pytest.mark.parametrize("M,K", [(6, 64), (8, 576), (70, 130)])  # XLA's max once lost NaN
def test_w8a8_product_rows_with_nan_or_inf_are_nan_on_both_paths(M, K):
    """A NaN or an infinity anywhere in a row (a kept channel or not) makes that row's
    outputs NaN, in the kernel and in XLA's expression alike; the other rows are
    untouched. (XLA's expression once replaced a NaN scale by 1, and XLA CPU's max
    drops a NaN from rows of this size: finite, wrong outputs.)"""
    assert cpu_kernels.enabled(), cpu_kernels._STATE  # built and registered (this test alone)
    rng = np.random.default_rng(3)
    x, w = _w8a8_case(rng, M, K, 37, 2)
    idx = int(w.outliers[0][0])
    other = next(c for c in range(K) if c != idx)
    x[0, other], x[3, K - 1 - other], x[4, idx], x[5, other] = np.nan, np.inf, np.nan, -np.inf
    clean = x.copy()
    clean[[0, 3, 4, 5]] = 1.0
    for f in (lambda x: cpu_kernels.w8a8_dot(x, w.q, w.scale, tuple(w.outliers)),
              lambda x: quant.w8a8_expression(x, w.q, w.scale, *w.outliers, transposed=True)):
        got, ref = np.asarray(jax.jit(f)(x)), np.asarray(jax.jit(f)(clean))
        assert np.isnan(got[[0, 3, 4, 5]]).all()
        keep = [m for m in range(M) if m not in (0, 3, 4, 5)]
        assert np.isfinite(got[keep]).all()
        np.testing.assert_array_equal(got[keep], ref[keep])


@needs_kernels
def test_w8a8_product_refuses_bad_shapes_and_dtypes_when_traced():
    """Shapes and dtypes are checked at trace time with the arguments named, never a
    silently wrong product (an `[N, J]` w_out has J x N elements too)."""
    rng = np.random.default_rng(4)
    x, w = _w8a8_case(rng, 3, 40, 24, 2)
    idx, keep, w_out = w.outliers
    bad = [(x.astype(np.float16), w.q, w.scale, None), (x, w.q.astype(np.int32), w.scale, None),
           (x[:, :39], w.q, w.scale, None), (x, w.q, w.scale[:5], None),
           (x, w.q, w.scale, (idx, keep, np.ascontiguousarray(w_out.T))),
           (x, w.q, w.scale, (idx, keep[:0], w_out))]
    for args in bad:
        with pytest.raises(ValueError, match="w8a8_dot: needs"):
            jax.jit(cpu_kernels.w8a8_dot).lower(*args)


@needs_kernels
def test_int8_products_of_no_columns():
    """K = 0: empty sums are 0, on every ISA and at any M (VNNI's 4-row tile once
    divided by the row length)."""
    x, w = np.zeros((5, 0), np.int8), np.zeros((9, 0), np.int8)
    for isa in isas_here():
        with cpu_kernels.use_isa(isa):
            np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.int8_dot)(x, w)), 0)
            y = np.asarray(jax.jit(lambda x: cpu_kernels.w8a8_dot(
                x, w, np.ones(9, np.float32)))(np.zeros((5, 0), np.float32)))
            np.testing.assert_array_equal(y, np.zeros((5, 9), np.float32))


@needs_kernels
def test_int8_product_at_the_int32_limits_on_every_isa():
    """Sums that reach int32's range (K near 2^17, the largest magnitudes; VNNI's offset
    sums wrap on the way), K tails on both sides of a 64-byte step, and M and N on both
    sides of VNNI's 4 x 4 tile (rows of M past it, rows of N past it) are exact, and
    `use_isa` restores the instruction set it found and refuses an unknown name."""
    before = cpu_kernels.isa()
    for M, K, N, xv, wv in ((2, 2**17 - 1, 3, -127, -128), (5, 2**17 - 1, 2, 127, 127),
                            (9, 63, 6, 127, -128), (4, 65, 5, -127, 127), (3, 1, 1, 1, -1),
                            (8, 2**17 - 1, 4, -127, -128), (6, 2**17 - 1, 9, 127, 127)):
        x = np.full((M, K), xv, np.int8)
        x[1::2] = -x[1::2]
        w = np.full((N, K), wv, np.int8)
        want = x.astype(np.int64) @ w.T.astype(np.int64)
        assert np.abs(want).max() < 2**31
        for isa in isas_here():
            with cpu_kernels.use_isa(isa):
                np.testing.assert_array_equal(np.asarray(cpu_kernels._int8_kernel(x, w)), want,
                                              err_msg=f"{isa} {M}x{K}x{N}")
    assert cpu_kernels.isa() == before
    with pytest.raises(ValueError, match="isa must be one of avx2, avx512-vnni"):
        with cpu_kernels.use_isa("sse2"):
            pass


@needs_kernels
def test_int8_product_over_blocks_of_rows_on_every_isa():
    """Prefill-sized M (VNNI's tile takes x in blocks of 256 rows; a last block of
    1 to 3 rows runs apart) with K and N tails is exact; the routing sends such M to
    the kernel on AVX-512 VNNI only (on AVX2, XLA's GEMM from MAX_ROWS on)."""
    rng = np.random.default_rng(7)
    for M, K, N in ((257, 65, 9), (259, 577, 6), (515, 64, 4), (1027, 63, 7), (256, 1, 5)):
        x = rng.integers(-127, 128, (M, K), dtype=np.int8)
        w = rng.integers(-128, 128, (N, K), dtype=np.int8)
        want = x.astype(np.int64) @ w.T.astype(np.int64)
        for isa in isas_here():
            with cpu_kernels.use_isa(isa):
                got = np.asarray(cpu_kernels._int8_kernel(x, w))
            np.testing.assert_array_equal(got, want, err_msg=f"{isa} {M}x{K}x{N}")
    for isa in isas_here():
        with cpu_kernels.use_isa(isa):
            assert cpu_kernels.uses_int8_kernel(cpu_kernels.MAX_ROWS, 576)
            assert cpu_kernels.uses_int8_kernel(1024, 576) == (isa == "avx512-vnni")
            assert not cpu_kernels.uses_int8_kernel(4, 2**17)
            assert cpu_kernels.fingerprint().endswith(":" + isa)


@pytest.mark.slow
@needs_kernels
@settings(deadline=None)
@given(shapes, st.integers(0, 2**31 - 1))
def test_float_product_within_float32_summation_and_batch_invariant(mkn, seed):
    """Against float64 numpy within K * 2^-24 * sum |x w| (recursive float32
    summation's bound), and each row equal bit for bit to the same row alone."""
    M, K, N = mkn
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((M, K)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    w = rng.integers(-127, 128, (N, K), dtype=np.int8)
    f = jax.jit(cpu_kernels.f32_int8_dot)
    got = np.asarray(f(x, w), np.float64)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = K * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))
    assert np.all(np.abs(got - exact) <= bound)
    for i in {0, M - 1}:
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], got[i].astype(np.float32))


@pytest.mark.multidevice
@needs_kernels
def test_under_vmap_and_a_mesh():
    """A vmapped call (the engine's branch axis; one weight, or a weight per element)
    and a 2-device shard_map give the unbatched results."""
    rng = np.random.default_rng(1)
    x = rng.integers(-127, 128, (3, 2, 64), dtype=np.int8)
    w = rng.integers(-127, 128, (40, 64), dtype=np.int8)
    want = np.einsum("bmk,nk->bmn", x.astype(np.int64), w.astype(np.int64))
    got = jax.jit(jax.vmap(cpu_kernels.int8_dot, in_axes=(0, None)))(x, w)
    np.testing.assert_array_equal(np.asarray(got), want)
    ws = rng.integers(-128, 128, (3, 40, 64), dtype=np.int8)  # a weight per element
    got = jax.jit(jax.vmap(cpu_kernels.int8_dot))(x, ws)
    np.testing.assert_array_equal(
        np.asarray(got), np.einsum("bmk,bnk->bmn", x.astype(np.int64), ws.astype(np.int64)))
    if jax.device_count() >= 2:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as Ps
        mesh = jax.make_mesh((2,), ("d",))
        g = jax.jit(jax.shard_map(cpu_kernels.int8_dot, mesh=mesh, in_specs=(Ps("d"), Ps()),
                                  out_specs=Ps("d")))
        x2 = x.reshape(6, 64)
        got = g(jax.device_put(x2, NamedSharding(mesh, Ps("d"))), w)
        np.testing.assert_array_equal(np.asarray(got), want.reshape(6, 40))


@pytest.mark.multidevice
@needs_kernels
def test_gradients_inside_shard_map():
    """The float kernels' gradients under a 2-device `shard_map` (its varying-axes check
    on): equal to those of XLA's expressions, which the jvp rules use."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps
    mesh = jax.make_mesh((2,), ("d",))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 40)).astype(np.float32)
    w = rng.integers(-127, 128, (7, 40), dtype=np.int8)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((4, 6, 16), (4, 30, 16), (4, 30, 16)))
    mask = np.arange(30) < 25

    def grads(dot, attend):
        g1 = jax.shard_map(jax.grad(lambda a: dot(a, w).sum()), mesh=mesh,
                           in_specs=Ps("d"), out_specs=Ps("d"))
        g2 = jax.shard_map(jax.grad(lambda a, b, c: attend(a, b, c, mask)[0].sum(), (0, 1, 2)),
                           mesh=mesh, in_specs=(Ps("d"),) * 3, out_specs=(Ps("d"),) * 3)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, Ps("d")))  # noqa: E731
        return jax.jit(g1)(put(x)), jax.jit(g2)(*map(put, (q, k, v)))

    got = grads(cpu_kernels.f32_int8_dot, cpu_kernels.segment_attention)
    want = grads(lambda a, b: cpu_kernels._xla(a, b, jnp.float32), cpu_kernels._attention_xla)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_kernels
def test_weight_only_product_vmaps_as_one_call_and_differentiates():
    """Vmapped (a batch of x, one weight; and a weight per element) it equals the
    products one by one; its jvp and grad in x equal those of XLA's expression."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 40)).astype(np.float32)
    w = rng.integers(-128, 128, (4, 7, 40), dtype=np.int8)  # -128 included
    f = jax.jit(jax.vmap(cpu_kernels.f32_int8_dot, in_axes=(0, None)))
    one = np.stack([np.asarray(cpu_kernels.f32_int8_dot(x[i], w[0])) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(f(x, w[0])), one)
    both = jax.jit(jax.vmap(cpu_kernels.f32_int8_dot))(x, w[:3])
    one = np.stack([np.asarray(cpu_kernels.f32_int8_dot(x[i], w[i])) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(both), one)
    c = rng.standard_normal((2, 7)).astype(np.float32)  # a linear loss: exact oracles
    loss = lambda a: jnp.sum(c * cpu_kernels.f32_int8_dot(a, w[0]))  # noqa: E731
    wf = w[0].astype(np.float64)
    bound = 7 * 2.0**-24 * (np.abs(c) @ np.abs(wf))  # float32 summation of 7 terms
    assert np.all(np.abs(np.asarray(jax.grad(loss)(x[0]), np.float64) - c @ wf) <= bound)
    t = rng.standard_normal(x[0].shape).astype(np.float32)
    tangent = float(jax.jvp(loss, (x[0],), (t,))[1])
    exact = float(np.sum(c * (t.astype(np.float64) @ wf.T)))
    assert abs(tangent - exact) <= 54 * 2.0**-24 * float(np.sum(np.abs(c) * (np.abs(t) @ np.abs(wf.T))))


@needs_kernels
def test_int8_weights_of_minus_128_and_long_rows():
    """-128 in a weight (a hand-built QuantizedWeight may hold it) is multiplied right,
    and K >= 2^17 (int32 sums could overflow in the kernel) is left to XLA."""
    x = np.full((2, 64), -127, np.int8)
    w = np.full((3, 64), -128, np.int8)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_kernels.int8_dot)(x, w)),
                                  np.full((2, 3), 64 * 127 * 128))
    x = np.ones((1, 2**17), np.int8)
    np.testing.assert_array_equal(np.asarray(cpu_kernels.int8_dot(x, x)), [[2**17]])


@needs_kernels
def test_w8a8_model_products_equal_the_xla_expression_on_their_inputs(tiny_lm, monkeypatch):
    """Inside the tiny W8A8 model (no kept channels), each one-call product equals
    `quant.w8a8_expression` (XLA's ops around the exact int8 custom call) on the same
    inputs bit for bit: the kernel is wired in right (the rows folded, the weights as
    stored). The logits themselves are compared within rounding only: XLA may fuse
    the expression's rescale with the next add (a last-bit change that W8A8 can
    amplify, docs/benchmarks.md)."""
    lm = dataclasses.replace(tiny_lm, params=jax.tree_util.tree_map(
        jnp.asarray, quant.quantize_params(llama.unstack_layers(tiny_lm.params), mode="w8a8")))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, lm.vocab_limit, (2, 9)), jnp.int32)
    module = families.module_for(lm.config)
    fused, seen = cpu_kernels.w8a8_dot, []

    def both(x, q, scale, kept=None):
        y = fused(x, q, scale, kept)
        want = quant.w8a8_expression(x, q, scale, *(kept or ()), transposed=True,
                                     int8_dot=cpu_kernels.int8_dot)
        jax.debug.callback(lambda a, b: seen.append(np.array_equal(a, b)), y, want)
        return y

    assert cpu_kernels.enabled()
    monkeypatch.setattr(cpu_kernels, "w8a8_dot", both)
    quant._w8a8_fn.cache_clear()
    on = np.asarray(jax.jit(lambda p: module.forward(lm.config, p, ids))(lm.params))
    quant._w8a8_fn.cache_clear()
    assert seen == [True] * (4 * lm.config.n_layers + 1)  # q/k/v, o, gate/up, down; the head
    monkeypatch.setitem(cpu_kernels._STATE, "status", "off for this test")
    off = np.asarray(jax.jit(lambda p: module.forward(lm.config, p, ids))(lm.params))
    quant._w8a8_fn.cache_clear()
    np.testing.assert_allclose(on, off, rtol=1e-4, atol=1e-4 * np.abs(off).max())


@needs_kernels
def test_weight_only_model_with_kernels_against_xla(tiny_lm, monkeypatch):
    """The tiny weight-only model's logits over two prompts' rows (calibrated channels
    kept): within float32 rounding of XLA's `dot_general` path."""
    lm = int8_lm(tiny_lm, "weight_only")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, lm.vocab_limit, (2, 9)), jnp.int32)
    module = families.module_for(lm.config)

    def run():  # a new function each time: traced again, never a cached program
        quant._w8a8_fn.cache_clear()
        return np.asarray(jax.jit(lambda p: module.forward(lm.config, p, ids))(lm.params))

    assert cpu_kernels.enabled()
    on = run()
    monkeypatch.setitem(cpu_kernels._STATE, "status", "off for this test")
    off = run()
    quant._w8a8_fn.cache_clear()
    np.testing.assert_allclose(on, off, rtol=1e-4, atol=1e-4 * np.abs(off).max())


def _attention_oracle(q, k, v, mask):
    """float64 softmax attention, and the kernel's error bounds per output and lse.

    With E_r = D u max_j sum_d |q_rd k_jd| (float32 scores' error), each softmax
    weight moves by a relative 2 E_r at most; the exp (a few ulp), the M-term sums
    and the merge of chunks add (2 M + 32) u. So |out - exact| <= (2 E_r + (2M + 32) u)
    sum_j p_j |v_jd| / sum_j p_j, and |lse - exact| <= E_r + (M + 16) u + 2 u (|lse| + 1).
    """
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s = np.where(mask, np.einsum("hqd,hmd->hqm", q, k), -np.inf)
    top = s.max(-1, keepdims=True)
    ok = np.isfinite(top)
    p = np.exp(s - np.where(ok, top, 0.0))
    denom = p.sum(-1, keepdims=True)
    safe = np.where(ok, denom, 1.0)
    out = np.einsum("hqm,hmd->hqd", p, v) / safe
    lse = np.where(ok[..., 0], np.log(safe[..., 0]) + np.where(ok, top, 0.0)[..., 0], -np.inf)
    D, M = q.shape[-1], k.shape[1]
    E = D * U * np.where(mask, np.einsum("hqd,hmd->hqm", np.abs(q), np.abs(k)), 0).max(-1)
    out_tol = (2 * E + (2 * M + 32) * U)[..., None] * np.einsum("hqm,hmd->hqd", p, np.abs(v)) / safe
    lse_tol = E + (M + 16) * U + 2 * U * (np.where(ok[..., 0], np.abs(lse), 0) + 1)
    return out, lse, out_tol, lse_tol


@needs_kernels
@pytest.mark.parametrize("H,Q,M,D,visible,q_scale", [
    (3, 48, 1024, 64, "prefix", 0.3),   # the SmolLM2 step at N = 16: a bucket's padding
    (3, 3, 300, 64, "random", 1.0),     # N = 1, a key-chunk tail, holes in the mask
    (1, 5, 17, 256, "all", 0.2),        # Gemma's D, fewer keys than a block of 8
    (2, 9, 600, 16, "last", 3.0),       # only the last chunk visible; scores up to ~50
    (2, 9, 40, 8, "none", 1.0),         # nothing visible: out 0, lse -inf
    (1, 6, 64, 8, "mixed", 1.0),        # rows 0, 2, 4 x 100: their softmax underflows
])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_segment_attention_against_float64(H, Q, M, D, visible, q_scale, kv_dtype):
    """The attention kernel against float64 numpy, within the bound derived in
    `_attention_oracle`, over query-block and key-chunk tails, masks with holes,
    no visible key, and large scores (the exp's range); with float16 keys and values
    (a quantised model's prefix) the oracle takes the same float16 values, which the
    kernel widens exactly, so the bound is float32's."""
    rng = np.random.default_rng(H * Q + M)
    q = (rng.standard_normal((H, Q, D)) * q_scale).astype(np.float32)
    k, v = (rng.standard_normal((H, M, D)).astype(kv_dtype) for _ in range(2))
    mask = {"prefix": np.arange(M) < M - 24, "random": rng.random(M) < 0.7,
            "all": np.ones(M, bool), "last": np.arange(M) >= M - 5,
            "none": np.zeros(M, bool), "mixed": np.ones(M, bool)}[visible]
    if visible == "mixed":  # most of these rows' keys get p = 0 where the others' do not
        q[:, ::2] *= 100
    assert cpu_kernels.uses_attention_kernel(q, k, v), cpu_kernels._STATE  # not XLA's fallback
    out, lse = (np.asarray(a, np.float64)
                for a in jax.jit(cpu_kernels.segment_attention)(q, k, v, mask))
    want, want_lse, out_tol, lse_tol = _attention_oracle(q, k, v, mask)
    assert np.all(np.abs(out - want) <= out_tol), np.max(np.abs(out - want) - out_tol)
    assert np.array_equal(np.isfinite(lse), np.isfinite(want_lse))
    fin = np.isfinite(want_lse)
    assert np.all(np.abs(lse[fin] - want_lse[fin]) <= lse_tol[fin])
    if visible == "none":
        assert not np.any(out) and np.all(lse == -np.inf)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_segment_attention_passes_nan_on(kv_dtype):
    """A NaN in a query, key or value reaches the outputs it touches, as in XLA's
    softmax (never a silently finite row); float16 keys and values alike."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 3, 8)).astype(np.float32)
    k, v = (rng.standard_normal(s).astype(kv_dtype) for s in ((1, 300, 8), (1, 300, 8)))
    mask = np.ones(300, bool)
    q[0, 0, 3] = np.nan  # row 0's scores
    k[0, 280, 1] = np.nan  # every row's score at key 280 (the second chunk)
    out, lse = (np.asarray(a) for a in jax.jit(cpu_kernels.segment_attention)(q, k, v, mask))
    assert np.all(np.isnan(out)) and np.all(np.isnan(lse))
    k[0, 280, 1] = 0.0
    v[0, 7, 2] = np.nan  # one value column
    out, lse = (np.asarray(a) for a in jax.jit(cpu_kernels.segment_attention)(q, k, v, mask))
    assert np.all(np.isnan(out[0, 0])) and np.all(np.isnan(out[0, 1:, 2]))
    assert np.all(np.isfinite(np.delete(out[0, 1:], 2, axis=-1)))
    assert np.all(np.isfinite(lse[0, 1:]))
    # a NaN score as the only visible one of its chunk, in a lane other than the first,
    # with masked padding after it (a prefix padded to its bucket)
    q, k = np.ones((1, 1, 8), np.float32), np.ones((1, 300, 8), kv_dtype)
    k[0, 3, 0] = np.nan
    for visible in (np.arange(300) == 3, (np.arange(300) == 3) | (np.arange(300) >= 256)):
        out, _ = jax.jit(cpu_kernels.segment_attention)(q, k, k, visible)
        assert np.all(np.isnan(np.asarray(out)))


@pytest.mark.slow
@needs_kernels
def test_segment_attention_vmaps_differentiates_and_serves_the_prefix():
    """Vmapped (the engine's row axis) it equals the calls one by one; its jvp is XLA
    expression's; and `prefix_attention(kernel=True)`, vmapped over branches as in
    the decode step, agrees with the XLA path within the kernel's bound."""
    from jaxsample.engine.prefix_attention import prefix_attention
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((2, 2, 6, 16), (2, 2, 70, 16), (2, 2, 70, 16)))
    mask = rng.random((2, 70)) < 0.8
    assert cpu_kernels.uses_attention_kernel(q, k, v), cpu_kernels._STATE
    both = jax.jit(jax.vmap(cpu_kernels.segment_attention))(q, k, v, mask)
    for i in range(2):
        one = cpu_kernels.segment_attention(q[i], k[i], v[i], mask[i])
        for a, b in zip(both, one):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
    t = rng.standard_normal(q[0].shape).astype(np.float32)
    got = jax.jvp(lambda a: cpu_kernels.segment_attention(a, k[0], v[0], mask[0]), (q[0],), (t,))
    want = jax.jvp(lambda a: cpu_kernels._attention_xla(a, k[0], v[0], mask[0]), (q[0],), (t,))
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.isfinite(np.asarray(jax.grad(
        lambda a: cpu_kernels.segment_attention(a, k[0], v[0], mask[0])[0].sum())(q[0]))))
    # the decode step's use: 5 branches of one query [1, H=4, D] over a [K=2, P, D] prefix
    qb = rng.standard_normal((5, 1, 4, 16)).astype(np.float32)
    run = lambda kernel: jax.jit(jax.vmap(  # noqa: E731
        lambda a: prefix_attention(a, k[0], v[0], mask[0], 0.25, kernel)))(qb)
    (o1, l1), (o0, l0) = run(True), run(False)
    qg = (qb * 0.25).reshape(5, 2, 2, 16).transpose(1, 2, 0, 3).reshape(2, 10, 16)
    _, _, out_tol, lse_tol = _attention_oracle(qg, k[0], v[0], mask[0])
    out_tol = out_tol.reshape(2, 2, 5, 16).transpose(2, 0, 1, 3).reshape(5, 1, 4, 16)
    lse_tol = lse_tol.reshape(2, 2, 5).transpose(2, 0, 1).reshape(5, 1, 4)
    assert np.all(np.abs(np.asarray(o1) - np.asarray(o0)) <= 2 * out_tol)
    assert np.all(np.abs(np.asarray(l1) - np.asarray(l0)) <= 2 * lse_tol)


def _fresh(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


PROBE = ("import logging; logging.basicConfig(format='%(message)s')\n"
         "from jaxsample.models.cpu_kernels import cpu_kernels as k\n"
         "print('on' if k.enabled() else 'off', k._STATE.get('status'))\n")


@pytest.mark.slow
@pytest.mark.subprocess
@needs_kernels
def test_built_once_then_loaded_and_a_corrupt_library_rebuilt(tmp_path):
    env = dict(JAXSAMPLE_CACHE_DIR=str(tmp_path))
    first = _fresh(PROBE, **env)
    assert first.stdout.startswith("on"), first.stderr
    [so] = (tmp_path / "kernels").glob("cpu_kernels-*.so")
    stamp = so.stat().st_mtime_ns
    again = _fresh(PROBE, **env)
    assert again.stdout.startswith("on") and so.stat().st_mtime_ns == stamp  # read, not built
    so.write_bytes(so.read_bytes()[:1000])  # truncated: its checksum fails
    third = _fresh(PROBE, **env)
    assert third.stdout.startswith("on"), third.stderr
    assert so.stat().st_size > 1000 and so.stat().st_mtime_ns != stamp


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_bad_cxx_or_a_mesh_at_the_first_call_never_raises(tmp_path):
    """A `$CXX` a shell cannot split: one warning line, XLA's product. The first
    product inside `jax.set_mesh` over 2 devices: the kernels build and work."""
    code = PROBE + "print(k.int8_dot(*[__import__('numpy').ones((1, 4), 'int8')] * 2))\n"
    r = _fresh(code, JAXSAMPLE_CACHE_DIR=str(tmp_path), CXX="g++ '-O0")
    assert r.returncode == 0 and r.stdout.startswith("off CXX="), r.stderr
    assert "[[4]]" in r.stdout
    if not CAN_BUILD:
        return
    code = ("import jax, numpy as np\n"
            "from jaxsample.models.cpu_kernels import cpu_kernels as k\n"
            "with jax.set_mesh(jax.make_mesh((2,), ('d',))):\n"
            "    y = jax.jit(k.int8_dot)(np.ones((1, 4), np.int8), np.ones((3, 4), np.int8))\n"
            "print(k._STATE['status'], np.asarray(y).tolist())\n")
    r = _fresh(code, JAXSAMPLE_CACHE_DIR=str(tmp_path),
               XLA_FLAGS=xla_flags(2))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "on" and "[[4, 4, 4]]" in r.stdout


@pytest.mark.slow
@pytest.mark.subprocess
def test_without_a_compiler_the_products_stay_xla(tmp_path):
    """No compiler: one warning line, and the int8 product still right (dot_general)."""
    code = PROBE + ("import numpy as np\n"
                    "x = np.arange(-6, 6, dtype=np.int8).reshape(2, 6); w = x[::-1].copy()\n"
                    "print(np.asarray(k.int8_dot(x, w)).tolist() == (x.astype(int) @ w.T).tolist())\n")
    r = _fresh(code, JAXSAMPLE_CACHE_DIR=str(tmp_path), CXX=str(tmp_path / "no-such-c++"))
    assert r.returncode == 0, r.stderr
    cxx = str(tmp_path / "no-such-c++")
    assert r.stdout.split("\n")[:2] == [f"off no C++ compiler at CXX={cxx!r}", "True"]
    warnings = [ln for ln in r.stderr.splitlines() if "CPU kernels off" in ln]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    off = _fresh(PROBE, JAXSAMPLE_CPU_KERNELS="0")
    assert off.stdout.startswith("off") and "CPU kernels off" not in off.stderr


@pytest.mark.slow
@pytest.mark.subprocess
@needs_kernels
def test_the_environment_caps_the_int8_product_at_avx2(tmp_path):
    """`JAXSAMPLE_CPU_KERNELS=avx2`: the kernels on, the int8 product on AVX2 (whatever
    the CPU has), still exact; unset: the best this CPU runs."""
    code = PROBE + ("import numpy as np\n"
                    "x = np.arange(-60, 60, dtype=np.int8).reshape(2, 60); w = x[::-1].copy()\n"
                    "with k.use_isa(k.ISAS[-1]):\n"  # a block asks for more: the cap holds
                    "    y = np.asarray(k.int8_dot(x, w)); inside = k.isa()\n"
                    "print(k.isa(), inside, y.tolist() == (x.astype(int) @ w.T).tolist())\n")
    capped = _fresh(code, JAXSAMPLE_CACHE_DIR=str(tmp_path), JAXSAMPLE_CPU_KERNELS=" AVX2 ")
    assert capped.stdout.split("\n")[:2] == ["on on", "avx2 avx2 True"], capped.stderr
    best = _fresh(code, JAXSAMPLE_CACHE_DIR=str(tmp_path))
    assert best.stdout.split("\n")[1] == f"{isas_here()[-1]} {isas_here()[-1]} True", best.stderr
    odd = _fresh(PROBE, JAXSAMPLE_CACHE_DIR=str(tmp_path), JAXSAMPLE_CPU_KERNELS="avx-2")
    assert odd.stdout.startswith("on on"), odd.stderr
    assert "JAXSAMPLE_CPU_KERNELS=avx-2 is not one of" in odd.stderr


@needs_kernels
def test_use_isa_blocks_from_threads_restore_the_isa():
    """Blocks in several threads at once (the level is the process's) end where they began."""
    import concurrent.futures

    before = cpu_kernels.isa()

    def toggle(_):
        for _ in range(200):
            with cpu_kernels.use_isa("avx2"):
                assert cpu_kernels.isa() == "avx2"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(toggle, range(4)))
    assert cpu_kernels.isa() == before
