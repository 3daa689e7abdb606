"""The Llama family (SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3) as pure JAX functions.

Letter table (used in every einsum and docstring of the project):

    B prompts (batch)      N branches per prompt   P prefix (prompt) length
    T new tokens           S positions in one call L layers
    H query heads          K kv heads              G = H / K query heads per kv head
    D head dim             E model dim             F MLP hidden dim
    V vocabulary rows

The model is written for *one sequence* of S positions (`x [S, E]`), so the
engine can vmap it over branches and prompts. Attention itself is passed in
as a function (`attend`), so the same layer serves the plain causal forward
(the test oracle), the shared-prefix prefill and the per-branch decode step;
the cached model is built from the uncached one and cannot drift from it.

Parameters are a plain pytree of arrays (dicts), stacked over layers so the
layer loop is one `jax.lax.scan`. Weights are stored as `x @ W`, i.e. `W` is
`[in, out]` (the transpose of a PyTorch `Linear.weight`).

Reference: Touvron et al. 2023 (Llama), Hugging Face `modeling_llama.py`
(rotate-half RoPE, RMSNorm, SwiGLU), `modeling_qwen2.py` (q/k/v bias) and
`modeling_qwen3.py` (QK-norm: an RMSNorm over D on every query and key head,
before RoPE; `qk_norm`) and `modeling_phi3.py` (partial rotary `rotary_dim`,
LongRoPE `long_rope`; its fused projections are split on load).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.models.families import common, moe

# The shared building blocks this module uses, and those every family module
# exposes (`models.families.families`: stack_layers, unstack_layers,
# partial_attention, ...).
from jaxsample.models.families.common import (  # noqa: F401
    AttendFn,
    Params,
    apply_rope,
    causal_attend,
    merge_attention,
    partial_attention,
    rms_norm,
    stack_layers,
    unstack_layers,
)
from jaxsample.models.quantization import quant

_DTYPES = common.DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`).

    Validated on construction (ValueError): factor finite >= 1,
    low_freq_factor finite > 0, high_freq_factor finite > low_freq_factor,
    original_max_position_embeddings a positive integer.

    Reference: Hugging Face `modeling_rope_utils._compute_llama3_parameters`.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        # transformers' `_validate_llama3_parameters` rules; the formula divides by
        # low_freq_factor and by high_freq_factor - low_freq_factor.
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"RopeScaling.{name} must be a finite number > 0, got {value!r}")
        if self.factor < 1:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor!r}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"RopeScaling.high_freq_factor ({self.high_freq_factor!r}) must be "
                             f"greater than low_freq_factor ({self.low_freq_factor!r})")
        orig = self.original_max_position_embeddings
        if isinstance(orig, bool) or not isinstance(orig, (int, np.integer)) or orig < 1:
            raise ValueError("RopeScaling.original_max_position_embeddings must be a positive "
                             f"integer, got {orig!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongRope:
    """LongRoPE scaling (Phi-3 128k, Phi-4-mini; `rope_type: longrope`).

    The inverse frequencies are divided by one factor per frequency:
    `long_factor` when the model runs at a context (`max_seq_len`) longer than
    `original_max_position_embeddings`, else `short_factor`; cos and sin are
    multiplied by `attention_factor`. transformers switches per call by the
    call's length (`_longrope_frequency_update`), llama.cpp by the context it
    was given; jaxsample, which compiles one program per run, follows
    llama.cpp, so it agrees with transformers on every call longer than the
    original context (and on all calls when max_seq_len is at most it).

    Attributes:
      short_factor, long_factor: R/2 finite numbers > 0 each (R the rotary dims).
      original_max_position_embeddings: the pre-training context, >= 1.
      attention_factor: finite > 0; transformers' default
        `sqrt(1 + ln(s) / ln(original))` with s = max_position_embeddings /
        original (1 when s <= 1) is computed by the loader.

    Reference: Ding et al. 2024, "LongRoPE", arXiv 2402.13753; transformers
    `modeling_rope_utils._compute_longrope_parameters`.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0

    def __post_init__(self):
        for name in ("short_factor", "long_factor"):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or not all(isinstance(f, (int, float, np.number)) and not isinstance(f, bool)
                                and math.isfinite(f) and f > 0 for f in v):
                raise ValueError(f"LongRope.{name} must be finite numbers > 0, got {v!r:.80}")
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError("LongRope.short_factor and long_factor differ in length")
        orig = self.original_max_position_embeddings
        if isinstance(orig, bool) or not isinstance(orig, (int, np.integer)) or orig < 1:
            raise ValueError("LongRope.original_max_position_embeddings must be a positive "
                             f"integer, got {orig!r}")
        f = self.attention_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f > 0):
            raise ValueError(f"LongRope.attention_factor must be a finite number > 0, got {f!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shapes and constants of a Llama-family decoder.

    Attributes:
      vocab_size: V, rows of the embedding (and of the logits).
      dim: E, the model (residual stream) width.
      n_layers: L.
      n_heads: H, query heads.
      n_kv_heads: K, key/value heads; H must be a multiple of K (GQA/MQA).
      head_dim: D, even (RoPE rotates pairs); usually E / H.
      ffn_dim: F, the SwiGLU hidden width.
      norm_eps: RMSNorm epsilon, a finite number > 0.
      rope_theta: RoPE base, a finite number > 0.
      rope_scaling: Llama-3 scaling, or None.
      max_seq_len: the context length in tokens (prompt + new tokens).
      tie_embeddings: the output projection is the embedding transposed.
      qkv_bias: q/k/v projections carry a bias (Qwen2).
      rotary_dim: R, the leading head dims RoPE rotates (even, <= D; None:
        all of D); Phi-3's `head_dim * partial_rotary_factor`.
      long_rope: LongRoPE scaling (`LongRope`), or None; not with rope_scaling.
      n_experts: X, experts per layer of a sparse mixture-of-experts FFN
        (Mixtral, Qwen3-MoE; `models.families.moe`), or 0 for the dense SwiGLU MLP.
        With experts, F (`ffn_dim`) is one expert's hidden width.
      n_experts_per_tok: k, experts each token is routed to (1 <= k <= X);
        0 without experts.
      norm_topk: the k routing weights are renormalised to sum to 1
        (Mixtral; Qwen3-MoE's `norm_topk_prob`).
      qk_norm: an RMSNorm over D (weights `q_norm [D]`, `k_norm [D]` per
        layer, eps `norm_eps`) on every query and key head after the
        projections and before RoPE (Qwen3, `Qwen3Attention`).
      dtype: "float32" (default) or "bfloat16" for weights and activations;
        softmax, norms and logits are always accumulated in float32.
      arch: the architecture name the checkpoint declared (informational).

    Class attribute `family = "llama"` names the module that runs this config
    (`models.families.families.module_for`); the properties `layer_windows` (all None:
    every layer is global) and `attention_scale` (`1/sqrt(D)`) are the
    engine-facing fields it shares with `models.families.gemma3.Gemma3Config`.

    Raises:
      ValueError: on construction, a field outside the rules above (naming
        the field and the value).
    """

    family: ClassVar[str] = "llama"

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    n_experts: int = 0
    n_experts_per_tok: int = 0
    norm_topk: bool = True
    qk_norm: bool = False
    rotary_dim: int | None = None
    long_rope: LongRope | None = None
    dtype: str = "float32"
    arch: str = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even (RoPE rotates pairs), "
                             f"got {self.head_dim}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"LlamaConfig.{name} must be a finite number > 0, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, "
                             f"got {self.rope_scaling!r}")
        if isinstance(self.long_rope, dict):  # the weight cache's JSON
            object.__setattr__(self, "long_rope", LongRope(**self.long_rope))
        if self.long_rope is not None and not isinstance(self.long_rope, LongRope):
            raise ValueError(f"LlamaConfig.long_rope must be a LongRope or None, "
                             f"got {self.long_rope!r}")
        if self.long_rope is not None and self.rope_scaling is not None:
            raise ValueError("LlamaConfig: rope_scaling and long_rope exclude each other")
        r = self.rotary_dim
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, np.integer))
                              or r < 2 or r % 2 or r > self.head_dim):
            raise ValueError(f"LlamaConfig.rotary_dim must be None or an even integer in "
                             f"[2, head_dim = {self.head_dim}], got {r!r}")
        if self.long_rope is not None and len(self.long_rope.short_factor) != self.rope_dims // 2:
            raise ValueError(f"LlamaConfig.long_rope has {len(self.long_rope.short_factor)} "
                             f"factors, expected rotary dims / 2 = {self.rope_dims // 2}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("n_experts", "n_experts_per_tok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"LlamaConfig.{name} must be an integer >= 0, got {value!r}")
        if self.n_experts and not 1 <= self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"LlamaConfig.n_experts_per_tok must be in [1, n_experts="
                             f"{self.n_experts}], got {self.n_experts_per_tok!r}")
        if not self.n_experts and self.n_experts_per_tok:
            raise ValueError(f"LlamaConfig.n_experts_per_tok ({self.n_experts_per_tok}) needs "
                             "n_experts >= 1")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def n_groups(self) -> int:
        """G = H / K, query heads sharing one kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def rope_dims(self) -> int:
        """R, the rotated head dims (`rotary_dim`, else D)."""
        return self.head_dim if self.rotary_dim is None else int(self.rotary_dim)

    @property
    def rope_mscale(self) -> float:
        """The factor on cos and sin: LongRoPE's attention factor, else 1."""
        return 1.0 if self.long_rope is None else float(self.long_rope.attention_factor)

    @property
    def layer_windows(self) -> tuple[None, ...]:
        """Per-layer sliding window: None for every layer (all global)."""
        return (None,) * self.n_layers

    @property
    def attention_scale(self) -> float:
        """The attention score scale, `1/sqrt(D)`."""
        return 1.0 / math.sqrt(self.head_dim)

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------
# Parameters


def init_params(cfg: LlamaConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random parameters (normal, std `scale`) for tests and benchmarks.

    Returns the same pytree the loaders produce: see `param_shapes`.
    """
    return common.init_from_shapes(
        param_shapes(cfg), key, scale, cfg.jnp_dtype,
        lambda path, shape: _is_norm_shape(shape, cfg) or "'q_norm'" in path or "'k_norm'" in path,
        1.0)


def _is_norm_shape(shape, cfg):
    return shape == (cfg.dim,) or shape == (cfg.n_layers, cfg.dim)


def param_shapes(cfg: LlamaConfig) -> Params:
    """The parameter pytree's structure with shapes as tuples.

    Keys: `embed [V, E]`, `final_norm [E]`, `lm_head [E, V]` (untied only),
    and `layers` with arrays stacked over L: `attn_norm [L, E]`,
    `wq [L, E, H*D]`, `wk [L, E, K*D]`, `wv [L, E, K*D]`, `wo [L, H*D, E]`,
    `bq [L, H*D]`, `bk [L, K*D]`, `bv [L, K*D]` (qkv_bias only),
    `q_norm [L, D]`, `k_norm [L, D]` (qk_norm only),
        `mlp_norm [L, E]`, `w_gate [L, E, F]`, `w_up [L, E, F]`, `w_down [L, F, E]`;
    with X = `n_experts` > 0 (a sparse MoE FFN, `models.families.moe`): `router [L, E, X]`,
    `w_gate [L, X, E, F]`, `w_up [L, X, E, F]`, `w_down [L, X, F, E]`.
    """
    L, E, F, V = cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.vocab_size
    HD, KD = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (L, E), "wq": (L, E, HD), "wk": (L, E, KD), "wv": (L, E, KD),
        "wo": (L, HD, E), "mlp_norm": (L, E), "w_gate": (L, E, F), "w_up": (L, E, F),
        "w_down": (L, F, E),
    }
    if cfg.qkv_bias:
        layers.update(bq=(L, HD), bk=(L, KD), bv=(L, KD))
    if cfg.n_experts:
        X = cfg.n_experts
        layers.update(router=(L, E, X), w_gate=(L, X, E, F), w_up=(L, X, E, F),
                      w_down=(L, X, F, E))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    shapes = {"embed": (V, E), "final_norm": (E,), "layers": layers}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def check_params(cfg: LlamaConfig, params: Params, source: str = "params") -> None:
    """Raises ValueError naming the first missing, unexpected or misshapen tensor.

    Accepts both the stacked and the list layout of `params["layers"]`.
    """
    common.check_params_against(param_shapes(cfg), cfg.n_layers, params, source)


# ---------------------------------------------------------------------------
# Building blocks (one sequence: x [S, E])


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies `[R/2]` float32, with Llama-3 or LongRoPE scaling if configured."""
    inv_freq = common.rope_inv_freq(cfg.rope_dims, cfg.rope_theta)
    lr = cfg.long_rope
    if lr is not None:  # transformers: 1 / (ext_factors * base ** (2i / R))
        long = cfg.max_seq_len > lr.original_max_position_embeddings
        ext = np.asarray(lr.long_factor if long else lr.short_factor, np.float32)
        base = np.float32(cfg.rope_theta) ** (np.arange(0, cfg.rope_dims, 2, dtype=np.float32)
                                               / np.float32(cfg.rope_dims))
        return (np.float32(1.0) / (ext * base)).astype(np.float32)
    s = cfg.rope_scaling
    if s is not None:
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        mid = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_mid, mid, scaled)
    return inv_freq.astype(np.float32)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens `[...]` int32 -> hidden `[..., E]`."""
    return quant.take_rows(params["embed"], tokens)


def qkv(cfg: LlamaConfig, lp: Params, x: jax.Array, positions: jax.Array):
    """Pre-attention norm, projections, bias, QK-norm and RoPE for one layer.

    Args:
      lp: one layer's parameters (the `layers` subtree indexed at l).
      x: `[S, E]`; positions: `[S]` int32.
    Returns:
      q `[S, H, D]`, k `[S, K, D]`, v `[S, K, D]` in the model dtype.
    """
    S = x.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
    q, k, v = common.project(h, lp, ("wq", "wk", "wv"), (H * D, K * D, K * D))
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k = q.reshape(S, H, D), k.reshape(S, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.norm_eps)
    inv_freq = rope_frequencies(cfg)
    q = apply_rope(q, positions, inv_freq, cfg.rope_mscale)
    k = apply_rope(k, positions, inv_freq, cfg.rope_mscale)
    return q, k, v.reshape(S, K, D)


def attn_out_and_mlp(cfg: LlamaConfig, lp: Params, x: jax.Array, o: jax.Array) -> jax.Array:
    """Output projection, residual, SwiGLU MLP (or sparse MoE FFN) and residual.

    Args:
      x: `[S, E]` the layer's input; o: `[S, H, D]` the attention output.
    Returns:
      `[S, E]`, the layer's output.
    """
    S = x.shape[0]
    x = x + o.reshape(S, -1).astype(x.dtype) @ lp["wo"]
    h = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
    return x + ffn(cfg, lp, h)


def ffn(cfg: LlamaConfig, lp: Params, h: jax.Array) -> jax.Array:
    """The feed-forward of one layer on normed activations h `[S, E]` -> `[S, E]`:
    the dense SwiGLU, or with `cfg.n_experts` the sparse MoE (`models.families.moe.moe_ffn`)."""
    if cfg.n_experts:
        return moe.moe_ffn(lp, h, k=cfg.n_experts_per_tok, norm_topk=cfg.norm_topk)
    g, u = common.project(h, lp, ("w_gate", "w_up"), (cfg.ffn_dim, cfg.ffn_dim))
    return (jax.nn.silu(g) * u) @ lp["w_down"]


def layer(cfg: LlamaConfig, lp: Params, x: jax.Array, positions: jax.Array, attend: AttendFn):
    """One decoder block with attention supplied by the caller.

    Returns:
      (x `[S, E]`, (k `[S, K, D]`, v `[S, K, D]`)): the new residual stream
      and this call's keys/values, for the caller's KV cache.
    """
    q, k, v = qkv(cfg, lp, x, positions)
    o = attend(q, k, v)
    return attn_out_and_mlp(cfg, lp, x, o), (k, v)


def router_choices(cfg: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """The experts each position is routed to, per layer (causal forward of one sequence).

    Args:
      tokens: `[S]` int32; `cfg.n_experts` must be > 0.
    Returns:
      `[L, S, k]` int32, each position's k experts in descending order of
      router probability (`models.families.moe.route`), from the same residual stream
      as `forward_one`.
    """
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def block(lp, x, attend, _):
        q, k, v = qkv(cfg, lp, x, positions)
        o = attend(q, k, v)
        x_attn = x + o.reshape(x.shape[0], -1).astype(x.dtype) @ lp["wo"]
        h = rms_norm(x_attn, lp["mlp_norm"], cfg.norm_eps)
        _, idx = moe.route(h @ lp["router"], cfg.n_experts_per_tok, cfg.norm_topk)
        return x_attn + ffn(cfg, lp, h), (idx, idx)

    _, (idx, _) = common.run_layer_stack(block, params["layers"], embed(params, tokens),
                                         lambda _: causal_attend(None))
    return jnp.stack(idx) if isinstance(idx, list) else idx


def logits(cfg: LlamaConfig, params: Params, x: jax.Array) -> jax.Array:
    """Final norm and output projection: x `[..., E]` -> logits `[..., V]` float32."""
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return quant.matmul(h, w, jnp.float32)


# ---------------------------------------------------------------------------
# Whole model


def run_layers(cfg: LlamaConfig, params: Params, x, positions, attend_for_layer, layer_xs=None,
               post_layer=None, post_xs=None):
    """Run the decoder blocks.

    Two parameter layouts are accepted (see `unstack_layers`): `params["layers"]`
    as a dict of arrays stacked over L (run with one `lax.scan`; compact
    programs, the loaders' layout) or as a list of L per-layer dicts (run as
    an unrolled Python loop; the serving layout: on CPU a scan slices every
    weight out of the stacked array with a copy per step, several times
    slower per decode step).

    Args:
      x: `[S, E]`; positions: `[S]`.
      attend_for_layer: `f(layer_xs_l) -> AttendFn`, builds layer l's attention
        from that layer's slice of `layer_xs` (e.g. its KV cache).
      layer_xs: per-layer inputs: a sequence of L items (list layout) or a
        pytree with leading axis L (stacked layout), or None.
      post_layer: optional `f(x [S, E], post_xs_l) -> x [S, E]` applied after each
        block (Bridge layers, arXiv 2510.01143, hook in here).
      post_xs: a pytree with leading axis L for `post_layer`, or None.
    Returns:
      (x `[S, E]`, (k, v)): with stacked params k, v are `[L, S, K, D]`; with
      list params they are lists of L arrays `[S, K, D]`.
    """
    return common.run_layer_stack(
        lambda lp, x, attend, _: layer(cfg, lp, x, positions, attend), params["layers"], x,
        attend_for_layer, layer_xs, post_layer, post_xs)


def run_causal(cfg: LlamaConfig, params: Params, x, positions, valid_len=None, post_layer=None,
               post_xs=None):
    """`run_layers` with plain causal attention within the call (prefill, scoring, the oracle).

    Args:
      x: `[S, E]`; positions: `[S]` int32; valid_len: `[]` int32 or None (keys
        at call positions `>= valid_len` are masked).
    Returns:
      As `run_layers`.
    """
    return run_layers(cfg, params, x, positions, lambda _: causal_attend(valid_len),
                      post_layer=post_layer, post_xs=post_xs)


def forward_one(cfg: LlamaConfig, params: Params, tokens: jax.Array, valid_len=None):
    """Causal forward of one sequence: tokens `[S]` -> (logits `[S, V]` f32, kv).

    Either parameter layout (see `run_layers`).
    """
    return common.forward_one(sys.modules[__name__], cfg, params, tokens, valid_len)


def forward(cfg: LlamaConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Plain causal forward without a cache (scoring, and the oracle of cached decode).

    Args:
      tokens: `[B, S]` int32.
    Returns:
      logits `[B, S, V]` float32.
    """
    return common.forward(sys.modules[__name__], cfg, params, tokens)
