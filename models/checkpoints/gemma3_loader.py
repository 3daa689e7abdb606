"""Load Gemma 2 and 3 checkpoints (GGUF, Hugging Face directories) as `families.gemma3` params.

Gemma 2 (`general.architecture = gemma2`, `Gemma2ForCausalLM`) is described
at the end of this docstring.

GGUF (`general.architecture = gemma3`, llama.cpp's `convert_hf_to_gguf.py`
`Gemma3Model`):

* metadata `gemma3.*`: context_length, embedding_length, block_count,
  feed_forward_length, attention.head_count, attention.head_count_kv,
  attention.key_length / value_length (D = 256), attention.layer_norm_rms_epsilon,
  rope.freq_base (the global layers' base), attention.sliding_window,
  optionally rope.scaling.type/factor (linear, global layers only),
  attention.sliding_window_pattern (an int period or one bool per layer,
  True = local) and final_logit_softcapping;
* not in the file, fixed by llama.cpp for the architecture (`llama-model.cpp`,
  `LLM_ARCH_GEMMA3`): five local layers then one global
  (`set_swa_pattern(6)`), local RoPE base 10000, attention scale
  `1/sqrt(D)` except the 27B model (62 layers), which uses `1/sqrt(E/H)`
  (Hugging Face's `query_pre_attn_scalar` 168);
* norm weights are stored as `1 + w` (the converter adds 1 to every
  `*norm.weight`; transformers' `Gemma2TensorProcessor` subtracts it again):
  we subtract 1 so the params hold Hugging Face's `w`;
* Q/K rows are *not* permuted (llama.cpp runs Gemma with NEOX, i.e.
  rotate-half, RoPE), unlike the `llama` architecture.

Verified against transformers on the real Gemma 3 270M Q4_K_M file and on
tiny random checkpoints (tests/models/test_gemma3.py).

Hugging Face: `Gemma3ForCausalLM` (model_type `gemma3_text`: 270M, 1B and
text-only exports) with either transformers 4's `rope_theta`,
`rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern` or
transformers 5's `rope_parameters` per layer type and `layer_types`.

Gemma 2 (`models.families.gemma3.Gemma3Config` with `qk_norm=False`): no QK-norm
tensors; attention soft-capping `attn_logit_softcapping` (config.json
default 50, GGUF `gemma2.attn_logit_softcapping`) and final soft-capping
(default 30); alternating local/global layers, the first local
(transformers' default `layer_types`; llama.cpp `set_swa_pattern(2)`),
window `sliding_window` (4096); one RoPE base for all layers. A GGUF file
carries no `query_pre_attn_scalar`: llama.cpp (`LLM_ARCH_GEMMA2`) scales by
`1/sqrt(E/H)` for the 27B model (46 layers) and `1/sqrt(D)` otherwise, and
so does `config_from_gguf_gemma2`. Norm weights are stored as `1 + w` in
GGUF as for Gemma 3 (`Gemma2Model.modify_tensors`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import llama_config
from jaxsample.models.checkpoints.loader_core import (
    Architecture,
    ConfigReader,
    Tensor,
    TensorTable,
    gguf_attention,
    gguf_embedding,
)
from jaxsample.models.families import gemma3

GGUF_ARCH = "gemma3"
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)
GEMMA2_GGUF_ARCH = "gemma2"
GEMMA2_HF_ARCHITECTURES = ("Gemma2ForCausalLM",)

_GGUF_LAYER = {
    "attn_norm.weight": Tensor("attn_norm"),
    "attn_q.weight": Tensor("wq", True),
    "attn_k.weight": Tensor("wk", True),
    "attn_v.weight": Tensor("wv", True),
    "attn_q_norm.weight": Tensor("q_norm"),
    "attn_k_norm.weight": Tensor("k_norm"),
    "attn_output.weight": Tensor("wo", True),
    "post_attention_norm.weight": Tensor("post_attn_norm"),
    "ffn_norm.weight": Tensor("mlp_norm"),
    "ffn_gate.weight": Tensor("w_gate", True),
    "ffn_up.weight": Tensor("w_up", True),
    "ffn_down.weight": Tensor("w_down", True),
    "post_ffw_norm.weight": Tensor("post_mlp_norm"),
}
_GGUF_TOP = {
    "token_embd.weight": Tensor("embed"),
    "output_norm.weight": Tensor("final_norm"),
    "output.weight": Tensor("lm_head", True),
}
_HF_LAYER = {
    "input_layernorm.weight": Tensor("attn_norm"),
    "self_attn.q_proj.weight": Tensor("wq", True),
    "self_attn.k_proj.weight": Tensor("wk", True),
    "self_attn.v_proj.weight": Tensor("wv", True),
    "self_attn.q_norm.weight": Tensor("q_norm"),
    "self_attn.k_norm.weight": Tensor("k_norm"),
    "self_attn.o_proj.weight": Tensor("wo", True),
    "post_attention_layernorm.weight": Tensor("post_attn_norm"),
    "pre_feedforward_layernorm.weight": Tensor("mlp_norm"),
    "mlp.gate_proj.weight": Tensor("w_gate", True),
    "mlp.up_proj.weight": Tensor("w_up", True),
    "mlp.down_proj.weight": Tensor("w_down", True),
    "post_feedforward_layernorm.weight": Tensor("post_mlp_norm"),
}
_HF_TOP = {
    "model.embed_tokens.weight": Tensor("embed"),
    "model.norm.weight": Tensor("final_norm"),
    "lm_head.weight": Tensor("lm_head", True),
}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def _unshift_norm(key: str, a: np.ndarray) -> np.ndarray:
    """llama.cpp stores Gemma norm weights as `1 + w`: subtract the 1."""
    return a - np.float32(1.0) if key.endswith("norm") else a


_QK_NORMS = ("q_norm", "k_norm")


def gguf_table(cfg: gemma3.Gemma3Config) -> TensorTable:
    """llama.cpp's names; norm weights shifted back by 1; Q/K rows are not permuted."""
    layer = {n: t for n, t in _GGUF_LAYER.items() if cfg.qk_norm or t.key not in _QK_NORMS}
    return TensorTable("blk.{i}.", _GGUF_TOP, layer, transform=_unshift_norm)


def hf_table(cfg: gemma3.Gemma3Config) -> TensorTable:
    """transformers' names (a tied checkpoint's stored head copy is skipped)."""
    layer = {n: t for n, t in _HF_LAYER.items() if cfg.qk_norm or t.key not in _QK_NORMS}
    top = dict(_HF_TOP)
    ignore = frozenset()
    if cfg.tie_embeddings:
        del top["lm_head.weight"]
        ignore = frozenset({"lm_head.weight"})
    return TensorTable("model.layers.{i}.", top, layer, ignore=ignore,
                       ignore_suffixes=("rotary_emb.inv_freq",))


# ---------------------------------------------------------------------------
# GGUF


def _gguf_shape(r: ConfigReader, tensors: dict[str, Any]):
    """(E, V, L, H, K, D) of a Gemma GGUF (both architectures), each key validated.

    Raises:
      ModelLoadError: a key missing or inconsistent with the tensors;
      UnsupportedModelError: partial rotary embeddings.
    """
    a, source = r.arch, r.source
    dim, n_vocab = gguf_embedding(tensors, r)
    n_layers = r.count("block_count")
    n_heads, n_kv, head_dim = gguf_attention(r, dim)
    rot = r.count("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise UnsupportedModelError(f"{source}: partial rotary embeddings ({a}.rope.dimension_count"
                                    f" = {rot}, head dim {head_dim}) are not supported")
    meta_vocab = r.count("vocab_size", None)
    if meta_vocab is not None and meta_vocab != n_vocab:
        raise ModelLoadError(f"{source}: {a}.vocab_size = {meta_vocab} but token_embd.weight "
                             f"has {n_vocab} rows")
    return dim, n_vocab, n_layers, n_heads, n_kv, head_dim


def config_from_gguf_metadata(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                              dtype: str = "float32") -> gemma3.Gemma3Config:
    """Build the `Gemma3Config` a `gemma3` GGUF file describes.

    Args:
      meta: key -> value from `models.checkpoints.loader_core.read_gguf`.
      tensors: tensor name -> `gguf.ReaderTensor` (for shapes).
      source: the file, for messages.
    Raises:
      ModelLoadError: a required key is missing, not a positive number, or
        inconsistent with the tensors; UnsupportedModelError: an option we do
        not implement (attention soft-capping, a rope scaling other than
        linear, per-layer kv-head counts, ...).
    """
    a = GGUF_ARCH
    r = ConfigReader(meta, source, a)
    dim, n_vocab, n_layers, n_heads, n_kv, head_dim = _gguf_shape(r, tensors)
    window = r.count("attention.sliding_window")
    windows = _gguf_layer_windows(r, n_layers, window)
    if r.raw("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{source}: attention logit soft-capping "
                                    f"({a}.attn_logit_softcapping) is not supported")
    softcap = r.positive("final_logit_softcapping", None)

    scaling_type = r.string("rope.scaling.type", "none")
    factor = r.positive("rope.scaling.factor", 1.0)
    if scaling_type == "none" or factor == 1.0:
        factor = 1.0
    elif scaling_type != "linear":
        raise UnsupportedModelError(f"{source}: rope scaling type {scaling_type!r} is not "
                                    "supported for gemma3 (only linear)")
    # llama.cpp (LLM_ARCH_GEMMA3): f_attention_scale = 1/sqrt(E/H) for the 27B model, else 1/sqrt(D).
    scalar = dim / n_heads if n_layers == 62 else head_dim
    try:
        return gemma3.Gemma3Config(
            vocab_size=n_vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=r.count("feed_forward_length"), layer_windows=windows,
            norm_eps=r.positive("attention.layer_norm_rms_epsilon"),
            rope_theta=r.positive("rope.freq_base", 1_000_000.0), rope_local_theta=10_000.0,
            rope_scaling_factor=factor, query_pre_attn_scalar=float(scalar),
            final_logit_softcapping=softcap, max_seq_len=r.count("context_length"),
            tie_embeddings="output.weight" not in tensors, dtype=dtype, arch=a)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent metadata: {e}") from e


def _gguf_layer_windows(r: ConfigReader, n_layers: int, window: int):
    """Per-layer windows from `gemma3.attention.sliding_window_pattern` (absent: period 6)."""
    key = "attention.sliding_window_pattern"
    pattern = r.raw(key)
    if pattern is None:
        return gemma3.layer_pattern(n_layers, window)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, (bool, int, np.integer))
                                               for p in pattern):
            raise ModelLoadError(f"{r.what(key)} must hold {n_layers} booleans (one per "
                                 f"layer), got {pattern!r:.120}")
        return tuple(int(window) if p else None for p in pattern)
    return gemma3.layer_pattern(n_layers, window, r.count(key))


# ---------------------------------------------------------------------------
# Hugging Face directories


def _check_activation(hf: dict[str, Any], source: str) -> None:
    """Gemma's MLP is GeGLU with the tanh-approximated GELU; any other activation is refused."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not supported "
                                    f"(only tanh-approximated GELU: {list(_GELU_TANH)})")


def _hf_windows(r: ConfigReader, hf: dict[str, Any], n_layers: int, every: int | None):
    """`layer_windows` from config.json: `layer_types` if given, else one global layer in
    `every` (Gemma 3: the `sliding_window_pattern` key, default 6; Gemma 2: 2)."""
    window = r.count("sliding_window", 4096)
    types = hf.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != n_layers
                or not set(types) <= {"sliding_attention", "full_attention"}):
            raise ModelLoadError(f"{r.source}: config.json 'layer_types' must list {n_layers} of "
                                 f"'sliding_attention' / 'full_attention', got {types!r:.160}")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if every is None:
        every = r.count("sliding_window_pattern", 6)
    return gemma3.layer_pattern(n_layers, window, every)


def _hf_shape(r: ConfigReader, n_layers: int, windows, *, max_seq_len: int) -> dict[str, Any]:
    """The `Gemma3Config` fields Gemma 2 and 3 config.json files spell alike, with
    transformers' defaults (head_dim 256, query_pre_attn_scalar 256, tied embeddings);
    `max_seq_len` is the default of `max_position_embeddings`."""
    dim, n_heads = r.count("hidden_size"), r.count("num_attention_heads")
    tie = r.flag("tie_word_embeddings")
    return dict(
        vocab_size=r.count("vocab_size"), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=r.count("num_key_value_heads", n_heads), head_dim=r.count("head_dim", 256),
        ffn_dim=r.count("intermediate_size"), layer_windows=windows,
        norm_eps=r.positive("rms_norm_eps", 1e-6),
        query_pre_attn_scalar=r.positive("query_pre_attn_scalar", 256.0),
        max_seq_len=r.count("max_position_embeddings", max_seq_len),
        tie_embeddings=True if tie is None else tie)


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32",
                   arch_name: str | None = None) -> gemma3.Gemma3Config:
    """Build a `Gemma3Config` from a parsed config.json (transformers 4 or 5 layout).

    Raises:
      UnsupportedModelError: the multimodal `Gemma3ForConditionalGeneration`,
        attention soft-capping, bidirectional attention, an activation other
        than tanh-GELU or a rope scaling other than linear.
      ModelLoadError: a required key is missing or not a positive number.
    """
    archs = hf.get("architectures")
    archs = [archs] if isinstance(archs, str) else list(archs or [])
    if not any(x in HF_ARCHITECTURES for x in archs):
        raise UnsupportedModelError(
            f"{source}: architectures {archs} not supported; of Gemma 3 only the text decoder "
            f"{list(HF_ARCHITECTURES)} is (the multimodal checkpoints carry a vision tower)")
    r = ConfigReader(hf, source)
    _check_activation(hf, source)
    for flag in ("attention_bias", "use_bidirectional_attention", "attn_logit_softcapping"):
        if hf.get(flag):
            raise UnsupportedModelError(f"{source}: config.json {flag} = {hf[flag]!r} is not "
                                        "supported")
    n_layers = r.count("num_hidden_layers")
    windows = _hf_windows(r, hf, n_layers, every=None)

    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: config.json 'rope_parameters' must be an object")
    if rope and isinstance(rope.get("full_attention"), dict):  # transformers 5
        full = rope["full_attention"]
        local = rope.get("sliding_attention") or {}
    else:  # transformers 4: flat keys
        full = dict(hf.get("rope_scaling") or {})
        full.setdefault("rope_theta", (rope or {}).get("rope_theta", hf.get("rope_theta", 1e6)))
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full_r = ConfigReader(full, source, label="config.json rope parameters (global layers)")
    local_r = ConfigReader(local, source, label="config.json rope parameters (local layers)")
    factor = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        factor = full_r.positive("factor")
    elif kind != "default":
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported for "
                                    "Gemma 3 (only linear)")
    local_kind = local.get("rope_type", "default")
    if local_kind != "default":
        raise UnsupportedModelError(f"{source}: local-layer rope type {local_kind!r} is not "
                                    "supported (only default)")
    shape = _hf_shape(r, n_layers, windows, max_seq_len=131_072)
    try:
        return gemma3.Gemma3Config(
            **shape, rope_theta=full_r.positive("rope_theta", 1e6),
            rope_local_theta=local_r.positive("rope_theta", 10_000.0),
            rope_scaling_factor=factor,
            final_logit_softcapping=r.positive("final_logit_softcapping", None),
            dtype=dtype, arch="gemma3")
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from e


# ---------------------------------------------------------------------------
# Gemma 2


def _optional_cap(r: ConfigReader, key: str, default: float | None):
    """A soft-cap: `default` when the key is absent, None when it is written as null."""
    if r.full_key(key) in r.values and r.values[r.full_key(key)] is None:
        return None
    return r.positive(key, default)


def config_from_gguf_gemma2(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                            dtype: str = "float32") -> gemma3.Gemma3Config:
    """Build the `Gemma3Config` (`qk_norm=False`) a `gemma2` GGUF file describes.

    Keys as for gemma3 (`config_from_gguf_metadata`) under `gemma2.`, plus
    `attn_logit_softcapping` and `final_logit_softcapping` (optional finite
    numbers > 0) and `attention.sliding_window` (required); the layer pattern
    is llama.cpp's (local on even layers).

    Raises:
      ModelLoadError / UnsupportedModelError: as `config_from_gguf_metadata`.
    """
    a = GEMMA2_GGUF_ARCH
    r = ConfigReader(meta, source, a)
    dim, n_vocab, n_layers, n_heads, n_kv, head_dim = _gguf_shape(r, tensors)
    window = r.count("attention.sliding_window")
    scaling_type = r.string("rope.scaling.type", "none")
    if scaling_type != "none" and r.positive("rope.scaling.factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: rope scaling type {scaling_type!r} is not "
                                    "supported for gemma2")
    theta = r.positive("rope.freq_base", 10_000.0)
    # llama.cpp (LLM_ARCH_GEMMA2): f_attention_scale = 1/sqrt(E/H) for the 27B model, else 1/sqrt(D).
    scalar = dim / n_heads if n_layers == 46 else head_dim
    try:
        return gemma3.Gemma3Config(
            vocab_size=n_vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=r.count("feed_forward_length"),
            layer_windows=gemma3.layer_pattern(n_layers, window, 2),
            norm_eps=r.positive("attention.layer_norm_rms_epsilon"),
            rope_theta=theta, rope_local_theta=theta, query_pre_attn_scalar=float(scalar),
            final_logit_softcapping=r.positive("final_logit_softcapping", None),
            attn_logit_softcapping=r.positive("attn_logit_softcapping", None), qk_norm=False,
            max_seq_len=r.count("context_length"),
            tie_embeddings="output.weight" not in tensors, dtype=dtype, arch=a)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent metadata: {e}") from e


def config_from_hf_gemma2(hf: dict[str, Any], source: str, dtype: str = "float32",
                          arch_name: str | None = None) -> gemma3.Gemma3Config:
    """Build a `Gemma3Config` (`qk_norm=False`) from a `Gemma2ForCausalLM` config.json.

    Keys and defaults are transformers' `Gemma2Config`: head_dim 256,
    query_pre_attn_scalar 256, sliding_window 4096, layer_types (default:
    local on even layers), attn_logit_softcapping 50 and
    final_logit_softcapping 30 (null: none), rope_theta / rope_parameters
    (default type only), tie_word_embeddings true.

    Raises:
      UnsupportedModelError: an activation other than tanh-GELU, biases,
        bidirectional attention or a rope scaling type.
      ModelLoadError: a key missing, of the wrong type or out of range.
    """
    r = ConfigReader(hf, source)
    _check_activation(hf, source)
    for flag in ("attention_bias", "use_bidirectional_attention"):
        if r.flag(flag):
            raise UnsupportedModelError(f"{source}: config.json {flag} = true is not supported")
    n_layers = r.count("num_hidden_layers")
    windows = _hf_windows(r, hf, n_layers, every=2)
    theta, scaling, key = llama_config.hf_rope(r)
    kind = llama_config.rope_kind(r, scaling, key)
    if kind != "default":
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported for "
                                    "Gemma 2")
    shape = _hf_shape(r, n_layers, windows, max_seq_len=8192)
    try:
        return gemma3.Gemma3Config(
            **shape, rope_theta=theta, rope_local_theta=theta,
            final_logit_softcapping=_optional_cap(r, "final_logit_softcapping", 30.0),
            attn_logit_softcapping=_optional_cap(r, "attn_logit_softcapping", 50.0),
            qk_norm=False, dtype=dtype, arch="gemma2")
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from e


GEMMA2 = Architecture(
    family=gemma3, hf_classes=GEMMA2_HF_ARCHITECTURES, gguf_archs=(GEMMA2_GGUF_ARCH,),
    config_from_hf=config_from_hf_gemma2, config_from_gguf=config_from_gguf_gemma2,
    hf_table=hf_table, gguf_table=gguf_table)

ARCHITECTURE = Architecture(
    family=gemma3, hf_classes=HF_ARCHITECTURES, gguf_archs=(GGUF_ARCH,),
    config_from_hf=config_from_hf, config_from_gguf=config_from_gguf_metadata,
    hf_table=hf_table, gguf_table=gguf_table, hf_prefixes=("Gemma3",))
