"""Int8 weights: symmetric per-output-channel quantisation and the matmul that reads them.

A projection `W [in, out]` is stored as `q [in, out]` int8 and `scale [out]`
float32 with `W ~ q * scale` (`scale = max_i |W[i, o]| / 127`, `q = round(W /
scale)`: off by at most `scale / 2` per element). The embedding `[V, E]` gets one
scale per row, so the tied head (its transpose) has per-output-channel scales.

`QuantizedWeight` is a registered pytree (leaves q, scale and the outlier
channels', the rest static): it flows through the loaders, `place`, jit and vmap
unchanged, and the families' `h @ lp["wo"]` reaches `__rmatmul__`. Projections
of one input (q/k/v, gate/up) are stored as one matrix when their outlier
channels agree (`common.project` reads them). `matmul` and `take_rows` replace
`einsum` / `take` at the head and the embedding; for plain arrays they are
exactly those `jnp.einsum` / `jnp.take` calls, so float32 and bfloat16
programs hold nothing of int8.

Two modes (`MODES`, static, per model): "weight_only", `(x @ float(q)) * scale`;
"w8a8" (`DEFAULT_MODE`, the faster on XLA CPU), x quantised per row on the fly
(`s_x = max|x| / 127`), an int8 x int8 -> int32 product, then `* s_x * scale`.
On x86-64 with AVX2 both run as `models.cpu_kernels.cpu_kernels`' custom calls for a weight
stored `[out, in]` (W8A8's whole product one call, bit for bit XLA's steps
without outlier channels; weight-only's sums in a batch-independent order);
elsewhere as `lax.dot_general`. W8A8's per-row rounding is its accuracy price
(docs/benchmarks.md, "Int8 weights"): `with_mode(params, "weight_only")` trades
speed back for it.

Outlier channels (`QuantizedWeight.outliers`, calibrated by `models.quantization.outliers`,
on by default in `load(weights="int8")`): a projection's few input channels that
dwarf the rest, kept as a float32 `[K, out]` slice, multiplied apart and masked
out of the int8 product and its activation scale (docs/benchmarks.md, "Int8
weights").

Reference: Jacob et al. 2018, "Quantization and Training of Neural Networks
for Efficient Integer-Arithmetic-Only Inference" (symmetric per-channel
scales); MaxText / JetStream's int8 weights (AQT); LLM.int8() and QUIK (the
outlier channels kept in float).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching

from jaxsample.models.cpu_kernels import cpu_kernels
from jaxsample.models.families import common

MODES = ("weight_only", "w8a8")
DEFAULT_MODE = "w8a8"
QMAX = 127


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """An int8 matrix with float32 scales along its output channels.

    Attributes:
      q: int8 `[..., r, c]` (leading axes: stacked layers).
      scale: float32 `[..., c]` (per column) or `[..., r]` (`rows=True`, the embedding).
      rows: the scale runs along q's rows (the embedding `[V, E]`: one per token).
      transposed: the matrix this stands for is `q.T` (the tied head, `embed.T`).
      compute: the dtype name of the activations it is used with ("float32" or
        "bfloat16"); `.dtype` answers it, so code that casts to the weight's
        dtype keeps the model dtype.
      mode: one of `MODES`.
      kernels: whether its product may run as the CPU kernels' custom calls
        (`cpu_kernels.active()` decides where they can); False keeps XLA's
        `dot_general` on every backend. Set per model from
        `LanguageModel.cpu_kernels` (`with_cpu_kernels`): it is static, part of the
        pytree's structure, so programs traced with either value never share a
        compiled or exported entry.
      outliers: None, or `(idx, keep, w)`: the input channels kept in float
        (`idx` int32 `[K]`; `keep` float32 `[in]`, 0 on those channels and 1
        elsewhere; `w` float32 `[K, out]`, their rows of the matrix this stands
        for). The product is then `x @ (q * scale) + x[..., idx] @ w`: their
        rows of q are zero, and W8A8 quantises `x * keep`, so one large
        channel no longer sets a row's activation scale. Only for 2-D
        matrices (the serving layout).
    """

    def __init__(self, q, scale, outliers=None, *, rows: bool = False,
                 transposed: bool = False, compute: str = "float32", mode: str = DEFAULT_MODE,
                 kernels: bool = True):
        self.q, self.scale, self.outliers = q, scale, outliers
        self.rows, self.transposed, self.compute, self.mode = rows, transposed, compute, mode
        self.kernels = kernels

    def tree_flatten(self):
        return ((self.q, self.scale, self.outliers),
                (self.rows, self.transposed, self.compute, self.mode, self.kernels))

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        rows, transposed, compute, mode, kernels = aux
        return cls(*leaves, rows=rows, transposed=transposed, compute=compute, mode=mode,
                   kernels=kernels)

    def _replace(self, **changes) -> "QuantizedWeight":
        kw = dict(rows=self.rows, transposed=self.transposed, compute=self.compute,
                  mode=self.mode, kernels=self.kernels)
        kw.update(changes)
        return QuantizedWeight(self.q, self.scale, self.outliers, **kw)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[::-1]) if self.transposed else tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return common.DTYPES[self.compute]

    @property
    def T(self) -> "QuantizedWeight":
        if self.ndim != 2:
            raise ValueError(f"QuantizedWeight.T: only a 2-D matrix, got shape {self.shape}")
        return self._replace(transposed=not self.transposed)

    def __rmatmul__(self, x):
        return matmul(x, self)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float matrix it stands for, `q * scale` (transposed if it is), with
        the outlier channels' rows (if any) from their float copy."""
        s = self.scale[..., :, None] if self.rows else self.scale[..., None, :]
        w = self.q.astype(jnp.float32) * s
        if self.outliers is not None:  # rows of the projection [in, out] (an embedding's columns)
            idx, _, w_out = self.outliers
            proj = w.T if self.rows else w
            proj = proj.at[idx].set(jnp.asarray(w_out, jnp.float32))
            w = proj.T if self.rows else proj
        return (w.T if self.transposed else w).astype(dtype)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={self.shape}, rows={self.rows}, "
                f"transposed={self.transposed}, compute={self.compute!r}, mode={self.mode!r}, "
                f"kernels={self.kernels})")


def quantize(w, *, rows: bool = False, compute: str = "float32",
             mode: str = DEFAULT_MODE, outliers=None) -> QuantizedWeight:
    """Symmetric per-channel int8 quantisation of a float matrix (host numpy).

    Args:
      w: `[..., r, c]` float (numpy or jax; computed in float64 on the host).
      rows: one scale per row (the embedding) instead of per column (a
        projection `[in, out]`: per output channel).
      compute, mode: as `QuantizedWeight`.
      outliers: None, or int input channels to keep in float (a projection's
        rows, an embedding's columns; `models.quantization.outliers.outlier_channels`):
        their float32 copy goes to `QuantizedWeight.outliers` and they are
        zeroed before the scales are taken.
    Returns:
      A `QuantizedWeight` with numpy leaves: `scale = max|w| / 127` over the
      reduced axis, as float32 (1 for an all-zero channel), `q = round(w /
      scale)` in [-127, 127], so `|w - q * scale| <= scale / 2` per element
      (outside the outlier channels, which are exact to float32).
    Raises:
      ValueError: w has fewer than 2 axes or a non-finite value; mode unknown;
        outliers not a non-empty 1-D list of input channels of a 2-D w.
    """
    if mode not in MODES:
        raise ValueError(f"quantize: mode must be one of {MODES}, got {mode!r}")
    w = np.asarray(w, dtype=np.float64)
    if w.ndim < 2 or not np.all(np.isfinite(w)):
        raise ValueError(f"quantize: needs a finite matrix, got shape {w.shape}")
    kept = None
    if outliers is not None:
        n_in = w.shape[-1] if rows else w.shape[-2]
        idx = np.asarray(outliers, np.int64)
        idx = np.unique(idx) if idx.ndim == 1 else idx
        if w.ndim != 2 or idx.ndim != 1 or not idx.size or idx[0] < 0 or idx[-1] >= n_in:
            raise ValueError(f"quantize: outliers must be input channels in [0, {n_in}) of a "
                             f"2-D matrix, got {np.asarray(outliers)!r} for shape {w.shape}")
        keep = np.ones(n_in, np.float32)
        keep[idx] = 0.0
        kept = (idx.astype(np.int32), keep,
                np.ascontiguousarray(w[:, idx].T if rows else w[idx]).astype(np.float32))
        w = w.copy()  # the channels kept in float leave the int8 scales
        if rows:
            w[:, idx] = 0.0
        else:
            w[idx] = 0.0
    axis = -1 if rows else -2
    amax = np.max(np.abs(w), axis=axis)
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    s = scale[..., :, None] if rows else scale[..., None, :]
    q = np.clip(np.rint(w / s.astype(np.float64)), -QMAX, QMAX).astype(np.int8)
    return QuantizedWeight(q, scale, kept, rows=rows, compute=compute, mode=mode)


def matmul(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """`x [..., in] @ w [in, out] -> [..., out]` for a float array or a `QuantizedWeight`.

    A float `w` is exactly `jnp.einsum("...e,ev->...v", x, w,
    preferred_element_type=...)`. A quantised one runs in its `mode`, through the
    CPU kernels where `w.kernels` and `cpu_kernels.active()`; the result has dtype
    `preferred_element_type`, else x's.
    """
    if not isinstance(w, QuantizedWeight):
        if hasattr(w, "calibration_product"):  # models.quantization.outliers' probe
            return w.calibration_product(x, preferred_element_type)
        return jnp.einsum("...e,ev->...v", x, w, preferred_element_type=preferred_element_type)
    if w.ndim != 2 or w.rows != w.transposed:
        raise ValueError(f"matmul: {w!r} has no per-output-channel scales")
    out = preferred_element_type or x.dtype
    dims = (((x.ndim - 1,), (1 if w.transposed else 0,)), ((), ()))
    extra = w.outliers or ()
    if w.mode == "w8a8":
        return _w8a8_fn(bool(w.transposed), bool(w.kernels))(x, w.q, w.scale,
                                                              *extra).astype(out)
    if w.transposed and w.kernels and x.dtype == jnp.float32 and cpu_kernels.active():
        y = cpu_kernels.f32_int8_dot(x.reshape(-1, x.shape[-1]), w.q)  # vmaps as one call
        y = y.reshape(x.shape[:-1] + y.shape[-1:])
    else:
        y = jax.lax.dot_general(x, w.q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    y = y * w.scale
    if extra:
        y = y + _outlier_part(x, extra[0], extra[2])
    return y.astype(out)


def _outlier_part(x, idx, w_out):
    """The float32 product of x's outlier channels, `x[..., idx] @ w_out` (a thin dot:
    K multiply-adds unrolled into the int8 product's epilogue measure a little faster
    per decode step but compile much slower)."""
    xo = jnp.take(x, idx, axis=-1).astype(jnp.float32)
    return jnp.einsum("...k,ko->...o", xo, w_out.astype(jnp.float32))


def _w8a8_rows(x, q, scale, idx=None, keep=None, w_out=None, *, transposed: bool,
               kernels: bool):
    """x `[M, in]` -> float32 `[M, out]`: x quantised per row, int8 x int8 -> int32 dot.

    A row's scale is `max |x| / 127` over its channels (outside the outlier
    channels), 1 for an all-zero row; a row holding a NaN or an infinity gives NaN
    outputs (its scale is NaN or inf, never replaced).

    For a weight stored `[out, in]` with the CPU kernels on (and `kernels`, the
    weight's `QuantizedWeight.kernels`), the whole of it is
    one custom call, `cpu_kernels.w8a8_dot` (the same steps: bit for bit without
    outlier channels, their float32 sum's rounding apart with them). Else XLA's
    expression (`w8a8_expression`), a single row padded with a zero row: XLA CPU
    (jaxlib 0.10.2) lowers a one-row int8 dot to a matrix-vector loop over an
    int32 copy of the whole weight (such copies are what benchmarks/quantized.py's
    hlo part counts), and two rows to its int8 GEMM, which runs several times
    faster (and faster than the float32 dot).
    """
    xf = x.astype(jnp.float32)
    if transposed and kernels and cpu_kernels.uses_int8_kernel(*x.shape):
        return cpu_kernels.w8a8_dot(xf, q, scale, None if idx is None else (idx, keep, w_out))
    one = x.shape[0] == 1
    if one:
        xf = jnp.concatenate([xf, jnp.zeros_like(xf)])
    y = w8a8_expression(xf, q, scale, idx, keep, w_out, transposed=transposed)
    return y[:1] if one else y


def w8a8_expression(xf, q, scale, idx=None, keep=None, w_out=None, *, transposed: bool,
                    int8_dot=None):
    """W8A8's product as XLA ops: float32 `xf [M, in]` -> float32 `[M, out]`
    (`_w8a8_rows` without its kernel and padding; the kernel's oracle). `int8_dot(xq,
    q)`: the int8 x int8 -> int32 product of a weight stored `[out, in]`, default
    `lax.dot_general` (`cpu_kernels.int8_dot` recreates the step before the one-call
    kernel, benchmarks/step_ablation.py)."""
    if idx is not None:  # the outlier channels: a float product, and out of the row scale
        yo = _outlier_part(xf, idx, w_out)
        xf = xf * keep
    # Both divisions as the products XLA CPU rewrites them to (max |x| times float32's
    # 1/127; x times 1/sx), written out so that cpu_w8a8.cc can do the same.
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) * np.float32(1 / QMAX)
    sx = jnp.where(sx == 0, 1.0, sx)  # NaN and inf stay: the row's outputs are NaN
    # XLA CPU's max drops a NaN in larger rows (jaxlib 0.10.2, from about M x K = 4096):
    # a NaN row is made NaN here, as the kernel makes it.
    sx = jnp.where(jnp.isnan(xf).any(axis=-1, keepdims=True), jnp.nan, sx)
    xq = jnp.clip(jnp.round(xf * (1.0 / sx)), -QMAX, QMAX).astype(jnp.int8)
    if int8_dot is not None:
        y = int8_dot(xq, q)
    else:
        dims = (((1,), (1 if transposed else 0,)), ((), ()))
        y = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.int32)
    y = y.astype(jnp.float32) * sx * scale
    if idx is not None:
        y = y + yo
    return y


@functools.lru_cache(maxsize=None)
def _w8a8_fn(transposed: bool, kernels: bool):
    """The W8A8 product `f(x [..., in], q, scale[, idx, keep, w_out]) -> [..., out]`
    float32 (the outlier channels' leaves, if any), with a `custom_vmap` rule that folds
    vmapped axes of x into its rows (so the product sees the true row count of the
    decode step, B x N, not one row per branch) and a `custom_vjp` (the gradient of
    x through the dequantised weights, as the float model's; none for the weights)."""

    def flat(x, *w):
        y = _w8a8_rows(x.reshape(-1, x.shape[-1]), *w, transposed=transposed, kernels=kernels)
        return y.reshape(x.shape[:-1] + y.shape[-1:])

    f = custom_batching.custom_vmap(flat)

    @f.def_vmap
    def rule(axis_size, in_batched, x, *w):
        if in_batched[0] and not any(in_batched[1:]):
            return g(x, *w), True  # the batch axis leads x: flat folds it
        axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(flat, in_axes=axes, axis_size=axis_size)(x, *w), True

    @jax.custom_vjp
    def g(x, *w):
        return f(x, *w)

    def fwd(x, *w):
        return f(x, *w), (x, w)

    def bwd(res, ct):
        x, w = res
        dense = QuantizedWeight(w[0], w[1], tuple(w[2:]) or None, rows=transposed,
                                transposed=transposed).dequantize()
        dx = jnp.einsum("...o,io->...i", ct.astype(jnp.float32), dense).astype(x.dtype)
        zero = lambda a: (np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
                          if jnp.issubdtype(a.dtype, jnp.integer) else jnp.zeros_like(a))
        return (dx, *map(zero, w))

    g.defvjp(fwd, bwd)
    return g


def take_rows(table, tokens: jax.Array) -> jax.Array:
    """`table[tokens]`: the embedding gather, `[...]` int -> `[..., E]` (model dtype).

    A float table is exactly `jnp.take(table, tokens, axis=0)`; a quantised
    one (per-row scales) gathers the int8 rows and their scales, and its outlier
    columns (if any) from their float copy.
    """
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0)
    if not table.rows or table.transposed or table.ndim != 2:
        raise ValueError(f"take_rows: {table!r} has no per-row scales")
    q = jnp.take(table.q, tokens, axis=0).astype(jnp.float32)
    rows = q * jnp.take(table.scale, tokens, axis=0)[..., None]
    if table.outliers is not None:
        idx, _, w_out = table.outliers
        kept = jnp.moveaxis(jnp.take(w_out, tokens, axis=1), 0, -1)  # [..., K]
        rows = rows.at[..., idx].set(kept.astype(rows.dtype))
    return rows.astype(table.dtype)


# Per-layer keys that are projections [in, out]; everything else (norms, biases,
# the MoE router and experts) stays float.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_params(params, *, compute: str = "float32", mode: str = DEFAULT_MODE,
                    abstract: bool = False, outliers: dict | None = None, fuse: bool = True):
    """A parameter pytree (either layout, host or device arrays) with int8 projections.

    Quantised: every layer's `wq wk wv wo w_gate w_up w_down` (2-D, or 3-D in
    the stacked layout: scales per layer and output channel), the embedding
    (per-row scales: the tied head's output channels) and an untied
    `lm_head [E, V]` (per column). Left float, cast to `compute`: norms,
    biases, the MoE router and the experts' `[X, E, F]` stacks (a sparse FFN
    keeps its float path), and any other tensor. In the list layout a
    projection is stored as the embedding is, `q [out, in]` with one scale
    per row, and stands for its transpose (`rows=transposed=True`): XLA
    CPU's int8 dot streams that layout faster (measured per decode step).

    With `abstract=True`, `params` holds `jax.ShapeDtypeStruct`s and so does
    the result (for lowering a program without weights).

    `outliers` (`models.quantization.outliers.outlier_channels`: {(layer, key): idx,
    "head": idx}) keeps those input channels of each named projection in
    float (`QuantizedWeight.outliers`); "head" goes to the embedding (the tied
    head's input channels are its columns) or to an untied `lm_head`. Only in
    the list layout; a projection it does not name is quantised whole.

    With `fuse` (the default; list layout), the projections of one input
    (`common.FUSED`: q/k/v, gate/up) whose outlier channels agree (as
    calibration makes them: one input, one set of maxima) are stored as one
    matrix under the joined key, e.g. `"wq+wk+wv"`, which the families read
    through `common.project`: one activation quantisation, one gather and
    one thin dot instead of three. The product is the same numbers (the int8
    dot is exact in int32; per output column the same terms).

    Returns:
      The same structure, `QuantizedWeight` where quantised, numpy arrays elsewhere.
    """
    dtype = common.DTYPES[compute]
    flt = lambda a: np.asarray(jnp.asarray(a, dtype=dtype))  # noqa: E731
    if abstract:
        flt = lambda a: jax.ShapeDtypeStruct(a.shape, dtype)  # noqa: E731
    layers = params["layers"]
    listed = isinstance(layers, (list, tuple))
    outliers = outliers or {}
    if outliers and not listed:
        raise ValueError("quantize_params: outliers need the list layout (unstack_layers)")

    def qz(a, name, rows=False):
        if abstract:
            return _abstract_quantize(a, rows=rows, compute=compute, mode=mode,
                                      n_outliers=len(outliers.get(name, ())))
        return quantize(a, rows=rows, compute=compute, mode=mode, outliers=outliers.get(name))

    def projection(a, name):
        if not listed:
            return qz(a, name)
        # Stored as the embedding is, [out, in] with a scale per row, and used
        # transposed: XLA CPU's int8 dot reads that layout faster.
        t = jax.ShapeDtypeStruct(a.shape[::-1], a.dtype) if abstract else np.asarray(a).T
        w = qz(t, name, rows=True)
        return w._replace(transposed=True) if abstract else \
            QuantizedWeight(np.ascontiguousarray(w.q), w.scale, w.outliers, rows=True,
                            transposed=True, compute=compute, mode=mode)

    def one_layer(i, lp):
        out = {k: projection(a, (i, k)) if k in PROJECTIONS and
               len(np.shape(a)) == (2 if listed else 3) else flt(a) for k, a in lp.items()}
        return _fuse(out) if listed and fuse else out

    out = {k: flt(a) for k, a in params.items() if k != "layers"}
    head = "lm_head" in params
    out["embed"] = qz(params["embed"], None if head else "head", rows=True)
    if head:
        out["lm_head"] = qz(params["lm_head"], "head")
    out["layers"] = ([one_layer(i, lp) for i, lp in enumerate(layers)] if listed
                     else one_layer(None, layers))
    return out


def _fuse(layer: dict) -> dict:
    """`common.FUSED` groups of one quantised layer (list layout) as one weight each."""
    for name, members in common.FUSED.items():
        ws = [layer.get(k) for k in members]
        if not all(isinstance(w, QuantizedWeight) and w.rows and w.transposed and w.ndim == 2
                   for w in ws):
            continue
        kept = [w.outliers for w in ws]
        if any(k is None for k in kept) and not all(k is None for k in kept):
            continue
        if kept[0] is not None and not all(_same_channels(kept[0][0], k[0]) for k in kept):
            continue
        layer = {k: v for k, v in layer.items() if k not in members}
        layer[name] = _stack_rows(ws)
    return layer


def _same_channels(a, b) -> bool:
    if isinstance(a, jax.ShapeDtypeStruct) or isinstance(b, jax.ShapeDtypeStruct):
        return a.shape == b.shape
    return np.array_equal(np.asarray(a), np.asarray(b))


def _stack_rows(ws: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights stored `[out, in]` (rows=transposed=True) with the same input and
    channels, as one whose outputs are theirs in order."""
    w0 = ws[0]

    def cat(parts, axis):
        if isinstance(parts[0], jax.ShapeDtypeStruct):
            shape = list(parts[0].shape)
            shape[axis] = sum(p.shape[axis] for p in parts)
            return jax.ShapeDtypeStruct(tuple(shape), parts[0].dtype)
        return np.concatenate(parts, axis=axis)

    kept = None
    if w0.outliers is not None:
        idx, keep, _ = w0.outliers
        kept = (idx, keep, cat([w.outliers[2] for w in ws], 1))
    return QuantizedWeight(cat([w.q for w in ws], 0), cat([w.scale for w in ws], 0), kept,
                           rows=True, transposed=True, compute=w0.compute, mode=w0.mode)


def _abstract_quantize(a, *, rows=False, compute="float32", mode=DEFAULT_MODE, n_outliers=0):
    scale = a.shape[:-1] if rows else a.shape[:-2] + a.shape[-1:]
    kept = None
    if n_outliers:
        n_in, n_out = (a.shape[1], a.shape[0]) if rows else a.shape
        kept = (jax.ShapeDtypeStruct((n_outliers,), jnp.int32),
                jax.ShapeDtypeStruct((n_in,), jnp.float32),
                jax.ShapeDtypeStruct((n_outliers, n_out), jnp.float32))
    return QuantizedWeight(jax.ShapeDtypeStruct(a.shape, jnp.int8),
                           jax.ShapeDtypeStruct(scale, jnp.float32), kept, rows=rows,
                           compute=compute, mode=mode)


def check_quantized(w: QuantizedWeight, name: str = "weight") -> None:
    """Raises ValueError naming `name` unless w's parts agree: a 2-D int8 q, float32
    scales along its output channels, and outlier channels (if any) that are
    distinct sorted int32 input channels with their `keep` mask and `[K, out]` rows."""
    q, scale = w.q, w.scale
    if q.dtype != np.int8 or q.ndim != 2 or scale.dtype != np.float32 or \
            scale.shape != (q.shape[0] if w.rows else q.shape[1],):
        raise ValueError(f"{name}: q {q.dtype}{list(q.shape)} and scale "
                         f"{scale.dtype}{list(scale.shape)} do not agree")
    if w.outliers is not None:
        idx, keep, w_out = w.outliers
        n_in, n_out = (q.shape[1], q.shape[0]) if w.rows else q.shape
        want_keep = np.ones(n_in, np.float32)
        ok = (idx.dtype == np.int32 and idx.ndim == 1 and 0 < idx.size <= n_in
              and np.all(np.diff(idx) > 0) and 0 <= idx[0] and idx[-1] < n_in
              and w_out.dtype == np.float32 and w_out.shape == (idx.size, n_out))
        if ok:
            want_keep[idx] = 0.0
        if not ok or keep.dtype != np.float32 or not np.array_equal(keep, want_keep):
            raise ValueError(f"{name}: outlier channels do not agree with q "
                             f"{list(q.shape)} (idx {idx.dtype}{list(idx.shape)}, keep "
                             f"{list(keep.shape)}, w {list(w_out.shape)})")


def _is_q(a) -> bool:
    return isinstance(a, QuantizedWeight)


def quantized_weights(params) -> list[QuantizedWeight]:
    """The `QuantizedWeight` leaves of `params`, in tree order (empty for float params)."""
    return [a for a in jax.tree_util.tree_leaves(params, is_leaf=_is_q) if _is_q(a)]


def _map_quantized(f, params, other=lambda a: a):
    """`params` with `f` applied to each `QuantizedWeight` and `other` to every other leaf."""
    return jax.tree_util.tree_map(lambda a: f(a) if _is_q(a) else other(a), params,
                                  is_leaf=_is_q)


def with_compute(params, compute: str):
    """The same parameters for activations of dtype `compute` ("float32" or
    "bfloat16"): each `QuantizedWeight` says so (its q and scale unchanged), the
    other (float) leaves are cast to it. Host numpy in, host numpy out."""
    dtype = common.DTYPES[compute]
    return _map_quantized(lambda a: a._replace(compute=compute), params,
                          lambda a: np.asarray(jnp.asarray(a, dtype=dtype)))


def with_mode(params, mode: str):
    """The same parameters with every `QuantizedWeight` switched to `mode` (no copy)."""
    if mode not in MODES:
        raise ValueError(f"with_mode: mode must be one of {MODES}, got {mode!r}")
    return _map_quantized(lambda a: a._replace(mode=mode), params)


def with_cpu_kernels(params, on: bool):
    """The same parameters with every `QuantizedWeight`'s `kernels` set to `on` (no
    copy of any array); `params` itself when every one already says so (float
    parameters included)."""
    if all(a.kernels == on for a in quantized_weights(params)):
        return params
    return _map_quantized(lambda a: a._replace(kernels=on), params)


def uses_cpu_kernels(params) -> bool:
    """Whether a program traced now over `params` may call the CPU kernels: a
    `QuantizedWeight` leaf with `kernels` True and `cpu_kernels.active()` (the decode
    step's prefix attention goes to the kernel then, `engine.step`)."""
    return any(a.kernels for a in quantized_weights(params)) and cpu_kernels.active()


def modes(params) -> set[str]:
    """The `mode`s of the `QuantizedWeight` leaves of `params` (empty for float params)."""
    return {a.mode for a in quantized_weights(params)}


def is_quantized(params) -> bool:
    """Whether any leaf of `params` is a `QuantizedWeight`."""
    return bool(quantized_weights(params))
