"""Building blocks shared by the model families (`models.families.llama`, `models.families.gemma3`).

Letters as in `models/families/llama.py` (B prompts, N branches, P prefix length, T new
tokens, S positions in one call, L layers, H query heads, K kv heads, G = H/K,
D head dim, E model dim, F MLP hidden dim, V vocabulary rows).

Everything here works on *one sequence* (`x [S, E]`); the engine vmaps it
over branches and prompts.

The attention convention every family follows: `attend(q [S, H, D], k [S, K, D],
v [S, K, D])` receives q and k already normalised (QK-norm, where the family
has it) and rotated (RoPE) but *not* scaled; the kernel multiplies q by the
config's `attention_scale` (`1/sqrt(D)` for Llama, `query_pre_attn_scalar**-0.5`
for Gemma 3) before the q k^T product (`partial_attention(..., scale=)`).
Gemma 2 also soft-caps the scaled scores, `s -> c * tanh(s / c)` before the
mask and the softmax (`attn_logit_softcapping`); its config's
`attention_scale` is then a `SoftCappedScale`, a float that carries `c`, so
every kernel that takes the scale applies the cap with no other argument.
A local (sliding-window) layer lets the query at position p see the keys at
positions `(p - window, p]` (Gemma 3, Mistral; Hugging Face's
`sliding_window_overlay`, llama.cpp's `is_masked_swa`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.models.cpu_kernels import cpu_kernels
from jaxsample.models.families import flash

Params = dict[str, Any]
# attend(q [S, H, D], k [S, K, D], v [S, K, D]) -> out [S, H, D]
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# The window written for a global layer where per-layer windows must be an array
# (the stacked layout's `lax.scan`): larger than any position, so nothing is masked.
NO_WINDOW = 2**30


class SoftCappedScale(float):
    """An attention score scale (the float itself) with a score soft-cap `softcap`.

    The kernels (`partial_attention`, `flash.blockwise_attention`) multiply q
    by the scale and then map each score s to `softcap * tanh(s / softcap)`
    (Gemma 2's `attn_logit_softcapping`; transformers `eager_attention_forward`
    with `softcap`, llama.cpp's `f_attn_logit_softcapping`).
    """

    softcap: float

    def __new__(cls, scale: float, softcap: float):
        obj = super().__new__(cls, scale)
        obj.softcap = float(softcap)
        return obj

    def __repr__(self) -> str:
        return f"SoftCappedScale({float(self)!r}, softcap={self.softcap!r})"

    def __eq__(self, other):
        return (isinstance(other, SoftCappedScale) and float(self) == float(other)
                and self.softcap == other.softcap)

    def __hash__(self):
        return hash((float(self), self.softcap))


# Projections of one layer that read the same input, which `quantization.quant.quantize_params`
# may store as one matrix under the joined key (outputs concatenated in this order).
FUSED = {"wq+wk+wv": ("wq", "wk", "wv"), "w_gate+w_up": ("w_gate", "w_up")}


def project(h: jax.Array, lp: Params, keys: tuple[str, ...], sizes: tuple[int, ...]):
    """`tuple(h @ lp[k] for k in keys)`: the families' projections of one input.

    From one product when the layer holds them fused (`lp["+".join(keys)]`, whose
    output columns are the members' `sizes` in order: `FUSED`), else one each.
    """
    fused = "+".join(keys)
    if fused not in lp:
        return tuple(h @ lp[k] for k in keys)
    return tuple(jnp.split(h @ lp[fused], np.cumsum(sizes)[:-1].tolist(), axis=-1))


def softcap_scores(scores: jax.Array, scale) -> jax.Array:
    """`c * tanh(scores / c)` when `scale` is a `SoftCappedScale` with cap c, else scores."""
    cap = getattr(scale, "softcap", None)
    if cap is None:
        return scores
    return jnp.tanh(scores / cap) * cap


def check_positive_ints(obj, names, cls_name: str) -> None:
    """ValueError unless every `obj.<name>` is an int >= 1 (a config's shape fields)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{cls_name}.{name} must be a positive integer, got {value!r}")


# ---------------------------------------------------------------------------
# Norms and rotary embeddings


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm computed in float32, cast back to x's dtype.

    Args:
      x: `[..., n]`; weight: `[n]`.
      unit_offset: scale by `1 + weight` (Gemma's convention, whose weights
        start at zero) instead of `weight` (Llama's).
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (xf * (1.0 + w if unit_offset else w)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """Plain RoPE inverse frequencies `theta ** (-2i / D)`, `[D/2]` float64."""
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, mscale: float = 1.0) -> jax.Array:
    """Rotate-half RoPE (Hugging Face convention), on all of D or its first R dims.

    Args:
      x: `[S, heads, D]`.
      positions: `[S]` int32 absolute positions.
      inv_freq: `[R/2]` float32 (numpy, or a traced array in a layer scan); R
        = D, or R < D for partial rotary (Phi-3's `partial_rotary_factor`: the
        last D - R dims pass unrotated, transformers' `apply_rotary_pos_emb`).
      mscale: cos and sin are multiplied by it (LongRoPE's attention factor;
        transformers' `attention_scaling`); 1.0 otherwise.
    Returns:
      `[S, heads, D]`, same dtype as x (rotation computed in float32).
    """
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [S, R/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    xf = x.astype(jnp.float32)
    R = 2 * angles.shape[-1]
    xr, rest = (xf, None) if R == xf.shape[-1] else (xf[..., :R], xf[..., R:])
    x1, x2 = jnp.split(xr, 2, axis=-1)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] + ([] if rest is None else [rest])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


# ---------------------------------------------------------------------------
# Attention kernels


def partial_attention(q, k, v, mask, scale: float | None = None, kernel: bool = False):
    """Un-normalised attention over one segment of keys (for log-sum-exp merges).

    Keys and values are in kv-head-major layout `[K, M, D]` (the KV caches'
    layout), so both products are canonical batched matmuls with K as the
    batch dimension and no transpose of the cache is ever needed.

    Args:
      q: `[S, H, D]` (roped, not scaled); k, v: `[K, M, D]`; mask: `[S, M]`
        bool (True = may attend; a sliding window is part of the mask).
      scale: the score scale, a Python float (the config's `attention_scale`;
        a `SoftCappedScale` also soft-caps the scores); None means `1/sqrt(D)`.
      kernel: with a one-row mask `[1, M]` (every query sees the same keys), use
        `cpu_kernels.segment_attention` where it runs (`uses_attention_kernel`):
        the same result to float32 rounding, not bit for bit.
    Returns:
      (out `[S, H, D]` float32 normalised within the segment,
       lse `[S, H]` float32 log-sum-exp of the segment's scores, -inf where
       the segment has no visible key).
    """
    S, H, D = q.shape
    K, M = k.shape[0], k.shape[1]
    G = H // K
    # [S, H, D] -> [K, G*S, D]: query heads sharing a kv head are one matmul's rows.
    qg = q.reshape(S, K, G, D).transpose(1, 2, 0, 3).reshape(K, G * S, D)
    qg = qg * jnp.asarray(1.0 / math.sqrt(D) if scale is None else float(scale), qg.dtype)
    if kernel and mask.shape[0] == 1 and cpu_kernels.uses_attention_kernel(qg, k, v, scale):
        out, lse = cpu_kernels.segment_attention(qg, k, v, mask[0])
        out, lse = out.reshape(K, G, S, D), lse.reshape(K, G, S)
        return out.transpose(2, 0, 1, 3).reshape(S, H, D), lse.transpose(2, 0, 1).reshape(S, H)
    scores = jnp.einsum("kqd,kmd->kqm", qg, k, preferred_element_type=jnp.float32)
    scores = softcap_scores(scores, scale)
    scores = jnp.where(mask[None, None], scores.reshape(K, G, S, M), -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m_safe)  # exactly 0 at masked keys
    denom = jnp.sum(p, axis=-1, keepdims=True)  # [K, G, S, 1]
    # p is cast to the cache dtype (not the cache to float32: no f32 copy of a
    # bf16 cache per step), unless the queries are wider (a float16 prefix of a
    # float32 model: v is widened); the product accumulates in float32.
    out = jnp.einsum("kqm,kmd->kqd", p.reshape(K, G * S, M).astype(jnp.promote_types(
        v.dtype, q.dtype)), v, preferred_element_type=jnp.float32)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = out.reshape(K, G, S, D) / safe
    lse = jnp.where(denom > 0, jnp.log(safe) + m_safe, -jnp.inf)[..., 0]  # [K, G, S]
    return out.transpose(2, 0, 1, 3).reshape(S, H, D), lse.transpose(2, 0, 1).reshape(S, H)


def merge_attention(parts):
    """Merge partial attentions `[(out [S, H, D], lse [S, H]), ...]` by log-sum-exp.

    The decomposition of Hydragen (Juravsky et al. 2024) and FlashInfer's
    cascade attention: softmax over the union of segments equals the
    lse-weighted average of the per-segment softmaxes.
    """
    lses = jnp.stack([lse for _, lse in parts])  # [n, S, H]
    total = jnp.max(lses, axis=0)
    total_safe = jnp.where(jnp.isfinite(total), total, 0.0)
    w = jnp.exp(lses - total_safe)  # [n, S, H]
    w = w / jnp.maximum(jnp.sum(w, axis=0), 1e-30)
    return sum(wi[..., None] * out for wi, (out, _) in zip(w, parts))


def window_mask(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """`[Sq, Sk]` bool: key position within `(q - window, q]`'s lower bound (True = visible).

    Only the window's lower bound; combine it with the causal mask. `window`
    is None (a global layer: all True), a Python int or a traced int32.
    """
    if window is None:
        return jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool)
    return k_pos[None, :] > q_pos[:, None] - window


def causal_attend(valid_len: jax.Array | None = None, window=None,
                  scale: float | None = None, impl: str = "auto") -> AttendFn:
    """Plain causal self-attention within the call, keys `< valid_len` only.

    Args:
      valid_len: `[]` int32 or None: positions `>= valid_len` are right
        padding. The dense kernel masks them as keys; causality already hides
        them from every query below valid_len, so the outputs there are the
        same either way, and the blockwise kernel does not mask (outputs at
        padded positions are unspecified).
      window: None (global attention) or the layer's sliding window (a Python
        int or a traced int32): the query at p sees keys in `(p - window, p]`.
      scale: the score scale (None: `1/sqrt(D)`).
      impl: "auto" (default: `flash.use_blockwise(S)` chooses by the call's
        length S), "dense" (one `[S, S]` masked `partial_attention`) or
        "blockwise" (`flash.blockwise_attention`: online softmax over key
        blocks, no square, blocks above the diagonal or outside the window
        skipped). Both agree to float32 rounding below valid_len.
    """
    if impl not in ("auto", "dense", "blockwise"):
        raise ValueError(f"causal_attend: impl must be 'auto', 'dense' or 'blockwise', "
                         f"got {impl!r}")

    def attend(q, k, v):
        S = q.shape[0]
        if impl == "blockwise" or (impl == "auto" and flash.use_blockwise(S)):
            # No valid_len mask needed: causality hides padding from real queries.
            out = flash.blockwise_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1),
                                            window=window, scale=scale)
            return out.astype(q.dtype)
        pos = jnp.arange(S)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask = mask & window_mask(pos, pos, window)
        if valid_len is not None:
            mask = mask & (pos[None, :] < valid_len)
        out, _ = partial_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), mask, scale)
        return out.astype(q.dtype)

    return attend


# ---------------------------------------------------------------------------
# Parameter pytrees and the layer loop


def init_from_shapes(shapes: Params, key: jax.Array, scale: float, dtype,
                     is_norm: Callable[[str, tuple], bool], norm_value: float) -> Params:
    """Random parameters (normal, std `scale`) with norm weights set to `norm_value`.

    Args:
      shapes: the pytree of shape tuples (a family's `param_shapes`).
      is_norm: `f(key path string, shape) -> bool` selects the norm weights.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, shape) in zip(keys, flat):
        if is_norm(jax.tree_util.keystr(path), shape):
            out.append(jnp.full(shape, norm_value, dtype))
        else:
            out.append((scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def check_params_against(shapes: Params, n_layers: int, params: Params,
                         source: str = "params") -> None:
    """Raises ValueError naming the first missing, unexpected or misshapen tensor.

    Args:
      shapes: the family's `param_shapes(cfg)` (layers stacked over L).
      params: the stacked or the list layout of `params["layers"]`.
    """
    shapes = dict(shapes)
    if isinstance(params.get("layers"), (list, tuple)):
        if len(params["layers"]) != n_layers:
            raise ValueError(f"{source}: {len(params['layers'])} layers, expected {n_layers}")
        shapes["layers"] = [{k: s[1:] for k, s in shapes["layers"].items()}
                            for _ in range(n_layers)]
    want = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))[0]
    want = {jax.tree_util.keystr(p): s for p, s in want}
    have = {jax.tree_util.keystr(p): tuple(a.shape)
            for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    for name, shape in want.items():
        if name not in have:
            raise ValueError(f"{source}: missing tensor {name} (expected shape {shape})")
        if have[name] != shape:
            raise ValueError(f"{source}: tensor {name} has shape {have[name]}, expected {shape}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"{source}: unexpected tensors {extra}")


def run_layer_stack(block, layers, x, attend_for_layer, layer_xs=None, post_layer=None,
                    post_xs=None, consts=None):
    """The decoder-block loop shared by the families.

    Args:
      block: `f(lp, x [S, E], attend, const_l) -> (x [S, E], (k [S, K, D], v [S, K, D]))`.
      layers: the list layout (L dicts: an unrolled Python loop) or the stacked
        layout (leaves `[L, ...]`: one `lax.scan`).
      attend_for_layer: `f(layer_xs_l) -> AttendFn`.
      layer_xs: a sequence of L items (list layout), a pytree with leading axis
        L (stacked layout), or None.
      post_layer: optional `f(x, post_xs_l) -> x` after each block (Bridge).
      post_xs: a pytree with leading axis L for `post_layer`, or None.
      consts: per-layer constants for `block`: a sequence of L items in the
        list layout, a pytree with leading axis L in the stacked layout, or None.
    Returns:
      (x `[S, E]`, (k, v)): lists of L arrays `[S, K, D]` (list layout) or
      arrays `[L, S, K, D]` (stacked layout).
    """
    if isinstance(layers, (list, tuple)):
        ks, vs = [], []
        for l, lp in enumerate(layers):
            lx = None if layer_xs is None else layer_xs[l]
            c = None if consts is None else consts[l]
            x, (k, v) = block(lp, x, attend_for_layer(lx), c)
            if post_layer is not None:
                x = post_layer(x, jax.tree_util.tree_map(lambda a: a[l], post_xs))
            ks.append(k)
            vs.append(v)
        return x, (ks, vs)

    def body(x, xs):
        lp, lx, px, c = xs
        x, kv = block(lp, x, attend_for_layer(lx), c)
        if post_layer is not None:
            x = post_layer(x, px)
        return x, kv

    return jax.lax.scan(body, x, (layers, layer_xs, post_xs, consts))


def forward_one(family, cfg, params: Params, tokens: jax.Array, valid_len=None):
    """Causal forward of one sequence through a family module (its `embed`,
    `run_causal`, `logits`): tokens `[S]` -> (logits `[S, V]` float32, kv).

    Either parameter layout (see `run_layer_stack`).
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = family.embed(params, tokens)
    x, kv = family.run_causal(cfg, params, x, positions, valid_len)
    return family.logits(cfg, params, x), kv


def forward(family, cfg, params: Params, tokens: jax.Array) -> jax.Array:
    """Plain causal forward of `[B, S]` int32 tokens without a cache -> logits
    `[B, S, V]` float32 (scoring, and the oracle of cached decode)."""
    return jax.vmap(lambda t: forward_one(family, cfg, params, t)[0])(tokens)


def unstack_layers(params: Params) -> Params:
    """Stacked layout (`layers` leaves `[L, ...]`) -> list layout (L dicts); idempotent."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = dict(params)
    out["layers"] = [jax.tree_util.tree_map(lambda a: a[l], layers) for l in range(n)]
    return out


def stack_layers(params: Params) -> Params:
    """List layout -> stacked layout (leaves `[L, ...]`); idempotent."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    out = dict(params)
    out["layers"] = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *layers)
    return out
