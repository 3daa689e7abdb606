"""Outlier channels kept in float beside the int8 product (`models.quantization.outliers`,
`QuantizedWeight.outliers`) against independent oracles.

Oracles: float64 numpy on the weights the quantised ones stand for (`q *
scale`, the outlier rows from their float32 copy), with the bounds the
arithmetic guarantees; for calibration, the layer-0 projection input
recomputed in numpy (RMSNorm of the embedding rows times the gain).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample.models.families import llama
from jaxsample.models.quantization import outliers, quant

EPS32 = float(np.finfo(np.float32).eps)
IDX = [3, 17, 40]


def planted(rows, n=96, seed=1):
    """x `[rows, n]` whose channels IDX are ~100x the others (float32-exact values)."""
    x = np.random.default_rng(seed).standard_normal((rows, n))
    x[:, IDX] *= 300.0
    return x.astype(np.float32).astype(np.float64)


def deq64(qw):
    """The matrix a projection's QuantizedWeight stands for, in float64."""
    w = np.asarray(qw.q, np.float64) * np.asarray(qw.scale, np.float64)[None, :]
    idx, _, w_out = qw.outliers
    w[np.asarray(idx)] = np.asarray(w_out, np.float64)
    return w


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("mode", quant.MODES)
def test_product_with_outliers_within_the_bounds(mode, rows):
    """Per output o, with W' the matrix stood for and r the channels outside IDX:
      float32 arithmetic: |y - x W'| <= 2 n eps32 (|x| |W'|)_o;
      W8A8 also rounds x_r per row with s_x = max_r |x_j| / 127 (not the outliers'
        max): + s_x / 2 * sum_r |W'_jo|;
      to the original weights: sum_r |x_j| scale_o / 2 (int8 rows) + sum_IDX |x_j w_jo|
        eps32 / 2 (their float32 copy).
    And the same product without outlier channels is over 10x further from x W
    (the planted channels set its activation scale)."""
    n, m = 96, 40
    rng = np.random.default_rng(2)
    w = rng.standard_normal((n, m)) * np.linspace(0.1, 3, m)
    x = planted(rows)
    qw = jax.tree_util.tree_map(jnp.asarray, quant.quantize(w, mode=mode, outliers=IDX))
    assert not np.asarray(qw.q)[IDX].any()  # those rows leave the int8 columns' scales
    y = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x, jnp.float32), qw), np.float64)
    W = deq64(qw)
    np.testing.assert_array_equal(np.asarray(qw.dequantize(), np.float64), W.astype(np.float32))
    bound = 2 * n * EPS32 * (np.abs(x) @ np.abs(W))
    r = np.setdiff1d(np.arange(n), IDX)
    if mode == "w8a8":
        sx = np.abs(x[:, r]).max(axis=1, keepdims=True) / 127
        bound = bound + sx / 2 * np.abs(W[r]).sum(axis=0)
    assert np.all(np.abs(y - x @ W) <= bound)
    to_w = (np.abs(x[:, r]).sum(1, keepdims=True) * np.asarray(qw.scale, np.float64) / 2
            + np.abs(x[:, IDX]) @ np.abs(w[IDX]) * EPS32 / 2)
    err = np.abs(y - x @ w)
    assert np.all(err <= to_w + bound)
    plain = jax.tree_util.tree_map(jnp.asarray, quant.quantize(w, mode=mode))
    err_plain = np.abs(np.asarray(quant.matmul(jnp.asarray(x, jnp.float32), plain)) - x @ w)
    if mode == "w8a8":
        assert err_plain.max() > 10 * err.max()


def test_vmap_folds_rows_and_grad_uses_the_float_rows():
    """vmap over branches gives the flat product bit for bit (the rule folds them into
    rows); the gradient of x is through the matrix stood for, outlier rows included."""
    w = np.random.default_rng(3).standard_normal((96, 24))
    qw = jax.tree_util.tree_map(jnp.asarray, quant.quantize(w, outliers=IDX))
    x = jnp.asarray(planted(6), jnp.float32)
    flat = np.asarray(quant.matmul(x, qw))
    per = np.asarray(jax.vmap(lambda r: quant.matmul(r[None], qw)[0])(x))
    np.testing.assert_array_equal(per, flat)
    g = np.asarray(jax.grad(lambda a: quant.matmul(a, qw).sum())(x))
    np.testing.assert_allclose(g, np.broadcast_to(deq64(qw).sum(1), g.shape), rtol=1e-5)


@pytest.mark.slow
def test_tied_head_outliers_leave_the_embedding_gather_alone():
    """An embedding [V, E] with outlier columns: the gather and the head `.T` read the
    same matrix (int8 rows with those columns from their float32 copy), the head
    within the bound above."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((30, 96))
    qt = jax.tree_util.tree_map(jnp.asarray, quant.quantize(table, rows=True, outliers=IDX))
    assert not np.asarray(qt.q)[:, IDX].any()
    W = np.asarray(qt.q, np.float64).T * np.asarray(qt.scale, np.float64)[None, :]
    W[IDX] = table.T[IDX].astype(np.float32)  # [E, V], the head
    np.testing.assert_array_equal(np.asarray(qt.T.dequantize(), np.float64), W.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(qt.dequantize()), W.T.astype(np.float32))
    tokens = np.asarray([[3, 0, 29], [7, 7, 1]])
    np.testing.assert_array_equal(np.asarray(quant.take_rows(qt, jnp.asarray(tokens))),
                                  W.T[tokens].astype(np.float32))
    h = planted(4)
    y = np.asarray(quant.matmul(jnp.asarray(h, jnp.float32), qt.T, jnp.float32), np.float64)
    r = np.setdiff1d(np.arange(96), IDX)
    sx = np.abs(h[:, r]).max(axis=1, keepdims=True) / 127
    bound = 2 * 96 * EPS32 * (np.abs(h) @ np.abs(W)) + sx / 2 * np.abs(W[r]).sum(axis=0)
    assert np.all(np.abs(y - h @ W) <= bound)


@pytest.mark.parametrize("bad", [[96], [-1], [[1, 2]], []])
def test_bad_outlier_channels_refused(bad):
    with pytest.raises(ValueError, match="outliers must be input channels in \\[0, 96\\)"):
        quant.quantize(np.ones((96, 8)), outliers=bad)


def test_outlier_channels_picks_the_largest():
    m = {(0, "wq"): np.arange(64.0)[::-1].copy(), "head": np.r_[np.zeros(60), 5, 9, 7, 8]}
    got = outliers.outlier_channels(m, k=3)
    assert got[(0, "wq")].tolist() == [0, 1, 2] and got["head"].tolist() == [61, 62, 63]
    assert outliers.outlier_channels(m, k=100)[(0, "wq")].size == 8  # an eighth of 64
    for k in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="k must be a positive int"):
            outliers.outlier_channels(m, k=k)


def test_channel_maxima_against_numpy(tiny_lm):
    """Layer 0's q/k/v input is RMSNorm(embedding rows) * gain: recomputed in numpy."""
    params = llama.unstack_layers(tiny_lm.params)
    tokens = outliers.calibration_tokens(tiny_lm.tokenizer)
    assert tokens.ndim == 1 and tokens.size > 50
    got = outliers.channel_maxima(tiny_lm.config, params, tokens)
    L = tiny_lm.config.n_layers
    assert set(got) == {(i, k) for i in range(L) for k in quant.PROJECTIONS} | {"head"}
    e = np.asarray(params["embed"], np.float64)[tokens]
    h = e / np.sqrt((e ** 2).mean(-1, keepdims=True) + tiny_lm.config.norm_eps)
    ref = np.abs(h * np.asarray(params["layers"][0]["attn_norm"], np.float64)).max(0)
    for k in ("wq", "wk", "wv"):
        np.testing.assert_allclose(got[(0, k)], ref, rtol=1e-5)
    with pytest.raises(ValueError, match="list layout"):
        outliers.channel_maxima(tiny_lm.config, llama.stack_layers(params), tokens)


@pytest.mark.slow
def test_planted_massive_channel_is_found_and_kept(tiny_lm):
    """Layer 0's attention-norm gain made 50x larger on one channel (a massive q/k/v
    input channel, the weights untouched): calibration picks it for layer 0's q/k/v,
    and W8A8's activation rounding (its logits against the float32 forward of the
    same dequantised weights) shrinks by over half with the outlier channels kept
    (measured 0.09 against 0.48)."""
    params = llama.unstack_layers(tiny_lm.params)
    layer0 = dict(params["layers"][0])
    gain = np.array(layer0["attn_norm"])
    gain[5] *= 50.0
    layer0["attn_norm"] = gain
    params = dict(params, layers=[layer0] + list(params["layers"][1:]))
    lm = dataclasses.replace(tiny_lm, params=params)
    kept = outliers.calibrate(lm.config, params, lm.tokenizer)
    assert all(5 in kept[(0, k)].tolist() for k in ("wq", "wk", "wv"))
    tokens = np.arange(40, dtype=np.int32)[None] * 7 % 250
    is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731
    err = {}
    for name, o in (("with", kept), ("without", None)):
        qp = jax.tree_util.tree_map(jnp.asarray, quant.quantize_params(params, outliers=o))
        deq = jax.tree_util.tree_map(lambda a: a.dequantize() if is_q(a) else a, qp, is_leaf=is_q)
        ref = np.asarray(dataclasses.replace(lm, params=deq).forward(tokens))
        got = np.asarray(dataclasses.replace(lm, params=qp).forward(tokens))
        err[name] = np.abs(got - ref).max()
    assert err["with"] < 0.5 * err["without"], err
