"""The Gemma 2 and Gemma 3 text decoders as pure JAX functions (the interface of `families.llama`).

Letters as in `models/families/llama.py`. What differs from Llama (Gemma Team 2025,
"Gemma 3 Technical Report", arXiv 2503.19786; Hugging Face
`modeling_gemma3.py`, `Gemma3ForCausalLM`):

* the embedding is scaled by `sqrt(E)`, rounded to the model dtype first
  (`Gemma3TextScaledWordEmbedding`);
* RMSNorm scales by `1 + weight` (weights start at zero), computed in
  float32 and cast back after the scale;
* QK-norm: an RMSNorm over D on every query and key head, before RoPE;
* four norms per block: `attn_norm` (input_layernorm) -> attention ->
  `post_attn_norm` -> residual; `mlp_norm` (pre_feedforward_layernorm) ->
  MLP -> `post_mlp_norm` -> residual;
* GeGLU MLP: `down(gelu_tanh(gate(h)) * up(h))`;
* attention scores scaled by `query_pre_attn_scalar ** -0.5` (the config's
  `attention_scale`, passed to `common.partial_attention(scale=)`), not
  `1/sqrt(D)`;
* local and global layers: `layer_windows[l]` is the sliding window of a
  local layer (the query at p sees keys in `(p - window, p]`) or None for a
  global one; Gemma 3 has five local layers then one global, window 512 (270M,
  1B) or 1024;
* two RoPE bases: `rope_local_theta` (10k) on local layers, `rope_theta` (1M)
  with optional linear scaling (`rope_scaling_factor`, 4B and larger) on
  global ones;
* optional final logit soft-capping `tanh(logits / c) * c`;
* tied embeddings (an untied `lm_head` is accepted too).

Gemma 2 (Gemma Team 2024, "Gemma 2", arXiv 2408.00118; transformers
`modeling_gemma2.py`, `Gemma2ForCausalLM`) is the same block without
QK-norm (`qk_norm=False`) and with attention logit soft-capping
(`attn_logit_softcapping`: scores `c * tanh(s / c)` before the softmax,
through `common.SoftCappedScale`), final soft-capping 30, local and global
layers alternating (window 4096, the first layer local) and one RoPE base
for both (`rope_local_theta == rope_theta`).

Parameters (`param_shapes`) are stacked over L like Llama's; norm weights are
stored the Hugging Face way (the scale is `1 + weight`): llama.cpp's GGUF
stores `1 + weight`, which `models.checkpoints.gemma3_loader` undoes.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.models.families import common
from jaxsample.models.families.common import (  # noqa: F401
    AttendFn,
    Params,
    apply_rope,
    causal_attend,
    merge_attention,
    partial_attention,
    stack_layers,
    unstack_layers,
)
from jaxsample.models.quantization import quant


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config:
    """Shapes and constants of a Gemma 3 text decoder.

    The engine-facing fields are those of `models.families.llama.LlamaConfig`
    (vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim,
    max_seq_len, tie_embeddings, dtype, jnp_dtype, n_groups, qkv_bias,
    layer_windows, attention_scale, family).

    Attributes:
      vocab_size: V; dim: E; n_layers: L; n_heads: H; n_kv_heads: K (H must be
        a multiple of K); head_dim: D (256 for every Gemma 3, not E / H);
        ffn_dim: F, the GeGLU hidden width.
      layer_windows: L entries, the sliding window (tokens) of each local
        layer or None for a global layer.
      norm_eps: RMSNorm epsilon (all norms, QK-norm included).
      rope_theta: RoPE base of the global layers.
      rope_local_theta: RoPE base of the local layers.
      rope_scaling_factor: linear RoPE scaling of the global layers
        (positions divided by it; 1.0 = none).
      query_pre_attn_scalar: attention scores are scaled by its inverse
        square root; None means D.
      final_logit_softcapping: c in `tanh(logits / c) * c`, or None.
      attn_logit_softcapping: c in `tanh(scores / c) * c` on the attention
        scores (Gemma 2), or None.
      qk_norm: QK-norm on every query and key head (Gemma 3; Gemma 2 has none).
      max_seq_len: the context length in tokens (prompt + new tokens).
      tie_embeddings: the output projection is the embedding transposed.
      dtype: "float32" (default) or "bfloat16" for weights and activations;
        norms, softmax and logits are accumulated in float32.
      arch: the architecture name the checkpoint declared (informational).
    """

    family: ClassVar[str] = "gemma3"
    qkv_bias: ClassVar[bool] = False

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    layer_windows: tuple[int | None, ...]
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_theta: float = 10_000.0
    rope_scaling_factor: float = 1.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    qk_norm: bool = True
    max_seq_len: int = 32768
    tie_embeddings: bool = True
    dtype: str = "float32"
    arch: str = "gemma3"

    def __post_init__(self):
        common.check_positive_ints(self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads",
                                          "head_dim", "ffn_dim", "max_seq_len"), "Gemma3Config")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Gemma3Config.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"Gemma3Config.head_dim must be even (RoPE pairs), got {self.head_dim}")
        if not isinstance(self.layer_windows, tuple):
            object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        if len(self.layer_windows) != self.n_layers:
            raise ValueError(f"Gemma3Config.layer_windows has {len(self.layer_windows)} entries, "
                             f"expected n_layers = {self.n_layers}")
        for l, w in enumerate(self.layer_windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                                  or w < 1):
                raise ValueError(f"Gemma3Config.layer_windows[{l}] must be None or a positive "
                                 f"integer, got {w!r}")
        for name in ("norm_eps", "rope_theta", "rope_local_theta", "rope_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Gemma3Config.{name} must be a positive finite number, got {v!r}")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ValueError(f"Gemma3Config.{name} must be None or a positive finite number, "
                                 f"got {v!r}")
        if self.dtype not in common.DTYPES:
            raise ValueError(f"Gemma3Config.dtype must be one of {sorted(common.DTYPES)}, "
                             f"got {self.dtype!r}")

    @property
    def jnp_dtype(self):
        return common.DTYPES[self.dtype]

    @property
    def n_groups(self) -> int:
        """G = H / K, query heads sharing one kv head."""
        return self.n_heads // self.n_kv_heads

    @property
    def attention_scale(self) -> float:
        """The attention score scale, `query_pre_attn_scalar ** -0.5` (D when unset): a
        `common.SoftCappedScale` carrying `attn_logit_softcapping` when that is set."""
        s = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        scale = float(s) ** -0.5
        if self.attn_logit_softcapping is not None:
            return common.SoftCappedScale(scale, self.attn_logit_softcapping)
        return scale

    def replace(self, **changes) -> "Gemma3Config":
        return dataclasses.replace(self, **changes)


def layer_pattern(n_layers: int, window: int, period: int = 6) -> tuple[int | None, ...]:
    """Gemma 3's default layer windows: every `period`-th layer global, the others local.

    Layer l is global when `(l + 1) % period == 0` (Hugging Face's
    `sliding_window_pattern`, llama.cpp's `set_swa_pattern(6)`).
    """
    return tuple(None if (l + 1) % period == 0 else int(window) for l in range(n_layers))


# ---------------------------------------------------------------------------
# Parameters


def param_shapes(cfg: Gemma3Config) -> Params:
    """The parameter pytree's structure with shapes as tuples.

    Keys: `embed [V, E]`, `final_norm [E]`, `lm_head [E, V]` (untied only),
    and `layers` with arrays stacked over L: `attn_norm [L, E]`,
    `wq [L, E, H*D]`, `wk [L, E, K*D]`, `wv [L, E, K*D]`, `q_norm [L, D]`,
    `k_norm [L, D]` (qk_norm only), `wo [L, H*D, E]`, `post_attn_norm [L, E]`,
    `mlp_norm [L, E]`, `w_gate [L, E, F]`, `w_up [L, E, F]`, `w_down [L, F, E]`,
    `post_mlp_norm [L, E]`. Norm weights are Hugging Face's (scale `1 + w`).
    """
    L, E, F, V, D = cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.head_dim
    HD, KD = cfg.n_heads * D, cfg.n_kv_heads * D
    layers = {
        "attn_norm": (L, E), "wq": (L, E, HD), "wk": (L, E, KD), "wv": (L, E, KD),
        "q_norm": (L, D), "k_norm": (L, D), "wo": (L, HD, E), "post_attn_norm": (L, E),
        "mlp_norm": (L, E), "w_gate": (L, E, F), "w_up": (L, E, F), "w_down": (L, F, E),
        "post_mlp_norm": (L, E),
    }
    if not cfg.qk_norm:
        del layers["q_norm"], layers["k_norm"]
    shapes = {"embed": (V, E), "final_norm": (E,), "layers": layers}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def init_params(cfg: Gemma3Config, key: jax.Array, scale: float = 0.02) -> Params:
    """Random parameters (normal, std `scale`; norm weights 0, i.e. scale 1) for tests.

    Returns the same pytree the loaders produce: see `param_shapes`.
    """
    return common.init_from_shapes(param_shapes(cfg), key, scale, cfg.jnp_dtype,
                                   lambda path, _: "norm" in path, 0.0)


def check_params(cfg: Gemma3Config, params: Params, source: str = "params") -> None:
    """Raises ValueError naming the first missing, unexpected or misshapen tensor."""
    common.check_params_against(param_shapes(cfg), cfg.n_layers, params, source)


# ---------------------------------------------------------------------------
# Building blocks (one sequence: x [S, E])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: `x / rms(x) * (1 + weight)` in float32, cast back to x's dtype."""
    return common.rms_norm(x, weight, eps, unit_offset=True)


def rope_frequencies(cfg: Gemma3Config, local: bool) -> np.ndarray:
    """Inverse frequencies `[D/2]` float32 of a local or a global layer."""
    if local:
        return common.rope_inv_freq(cfg.head_dim, cfg.rope_local_theta).astype(np.float32)
    inv = common.rope_inv_freq(cfg.head_dim, cfg.rope_theta).astype(np.float32)
    if cfg.rope_scaling_factor != 1.0:  # linear scaling (transformers: inv_freq / factor)
        inv = (inv / np.float32(cfg.rope_scaling_factor)).astype(np.float32)
    return inv


def layer_rope_frequencies(cfg: Gemma3Config) -> np.ndarray:
    """`[L, D/2]` float32: each layer's inverse frequencies (local or global)."""
    local, glob = rope_frequencies(cfg, True), rope_frequencies(cfg, False)
    return np.stack([glob if w is None else local for w in cfg.layer_windows])


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens `[...]` int32 -> hidden `[..., E]`, scaled by `sqrt(E)` rounded to the embedding dtype."""
    table = params["embed"]
    scale = np.float32(math.sqrt(table.shape[-1]))  # transformers: a float32 buffer, cast to the dtype
    return quant.take_rows(table, tokens) * jnp.asarray(scale).astype(table.dtype)


def qkv(cfg: Gemma3Config, lp: Params, x: jax.Array, positions: jax.Array, inv_freq):
    """Pre-attention norm, projections, QK-norm (Gemma 3) and RoPE for one layer.

    Args:
      lp: one layer's parameters; x: `[S, E]`; positions: `[S]` int32;
      inv_freq: `[D/2]` this layer's RoPE frequencies (`layer_rope_frequencies`).
    Returns:
      q `[S, H, D]` (not scaled: see `Gemma3Config.attention_scale`), k `[S, K, D]`,
      v `[S, K, D]` in the model dtype.
    """
    S = x.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
    q, k, v = common.project(h, lp, ("wq", "wk", "wv"), (H * D, K * D, K * D))
    q, k, v = q.reshape(S, H, D), k.reshape(S, K, D), v.reshape(S, K, D)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.norm_eps)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attn_out_and_mlp(cfg: Gemma3Config, lp: Params, x: jax.Array, o: jax.Array) -> jax.Array:
    """Output projection, post-attention norm, residual, GeGLU MLP between its norms, residual.

    Args:
      x: `[S, E]` the layer's input; o: `[S, H, D]` the attention output.
    Returns:
      `[S, E]`, the layer's output.
    """
    S = x.shape[0]
    a = o.reshape(S, -1).astype(x.dtype) @ lp["wo"]
    x = x + rms_norm(a, lp["post_attn_norm"], cfg.norm_eps)
    h = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
    g, u = common.project(h, lp, ("w_gate", "w_up"), (cfg.ffn_dim, cfg.ffn_dim))
    m = (jax.nn.gelu(g, approximate=True) * u) @ lp["w_down"]
    return x + rms_norm(m, lp["post_mlp_norm"], cfg.norm_eps)


def layer(cfg: Gemma3Config, lp: Params, x: jax.Array, positions: jax.Array, attend: AttendFn,
          inv_freq):
    """One decoder block with attention supplied by the caller.

    Returns:
      (x `[S, E]`, (k `[S, K, D]`, v `[S, K, D]`)).
    """
    q, k, v = qkv(cfg, lp, x, positions, inv_freq)
    o = attend(q, k, v)
    return attn_out_and_mlp(cfg, lp, x, o), (k, v)


def logits(cfg: Gemma3Config, params: Params, x: jax.Array) -> jax.Array:
    """Final norm, output projection and soft-capping: x `[..., E]` -> logits `[..., V]` float32."""
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    out = quant.matmul(h, w, jnp.float32)
    c = cfg.final_logit_softcapping
    if c is not None:
        out = jnp.tanh(out / c) * c
    return out


# ---------------------------------------------------------------------------
# Whole model


def run_layers(cfg: Gemma3Config, params: Params, x, positions, attend_for_layer, layer_xs=None,
               post_layer=None, post_xs=None):
    """Run the decoder blocks (signature and layouts of `models.families.llama.run_layers`).

    Each layer's RoPE base (local or global) is chosen here; the sliding
    window is the attention's business: `attend_for_layer(layer_xs_l)` must
    return an attention that masks keys outside `(p - window, p]` on the
    layers where `cfg.layer_windows[l]` is not None (put the window in
    `layer_xs`; `run_causal` does) and scales scores by `cfg.attention_scale`.

    Args:
      x: `[S, E]`; positions: `[S]` int32 absolute positions.
      attend_for_layer: `f(layer_xs_l) -> AttendFn`.
      layer_xs, post_layer, post_xs: as `models.families.llama.run_layers`.
    Returns:
      (x `[S, E]`, (k, v)): lists of L arrays `[S, K, D]` (list layout) or
      arrays `[L, S, K, D]` (stacked layout).
    """
    freqs = layer_rope_frequencies(cfg)
    layers = params["layers"]
    consts = list(freqs) if isinstance(layers, (list, tuple)) else jnp.asarray(freqs)
    return common.run_layer_stack(
        lambda lp, x, attend, inv_freq: layer(cfg, lp, x, positions, attend, inv_freq),
        layers, x, attend_for_layer, layer_xs, post_layer, post_xs, consts)


def window_xs(cfg: Gemma3Config, stacked: bool):
    """The per-layer windows as `layer_xs` for `causal_attend`-style attentions.

    A list of L Python ints / None (list layout: masks are static), or an
    int32 array `[L]` with `common.NO_WINDOW` for global layers (stacked layout).
    """
    if not stacked:
        return list(cfg.layer_windows)
    return jnp.asarray([common.NO_WINDOW if w is None else w for w in cfg.layer_windows],
                       jnp.int32)


def run_causal(cfg: Gemma3Config, params: Params, x, positions, valid_len=None, post_layer=None,
               post_xs=None):
    """`run_layers` with causal attention within the call, sliding windows on local layers.

    Args:
      x: `[S, E]`; positions: `[S]` int32 (call positions are 0..S-1 for the masks);
      valid_len: `[]` int32 or None (keys at positions `>= valid_len` are masked).
    Returns:
      As `run_layers`.
    """
    stacked = not isinstance(params["layers"], (list, tuple))
    scale = cfg.attention_scale
    return run_layers(cfg, params, x, positions,
                      lambda w: causal_attend(valid_len, window=w, scale=scale),
                      window_xs(cfg, stacked), post_layer, post_xs)


def forward_one(cfg: Gemma3Config, params: Params, tokens: jax.Array, valid_len=None):
    """Causal forward of one sequence: tokens `[S]` -> (logits `[S, V]` f32, kv).

    Either parameter layout (see `run_layers`).
    """
    return common.forward_one(sys.modules[__name__], cfg, params, tokens, valid_len)


def forward(cfg: Gemma3Config, params: Params, tokens: jax.Array) -> jax.Array:
    """Plain causal forward with sliding windows, without a cache (scoring, the oracle).

    Args:
      tokens: `[B, S]` int32.
    Returns:
      logits `[B, S, V]` float32.
    """
    return common.forward(sys.modules[__name__], cfg, params, tokens)
