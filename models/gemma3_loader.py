"""Load Gemma 3 checkpoints (GGUF and Hugging Face directories) into `models.gemma3` params.

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
tiny random checkpoints (tests/test_gemma3.py).

Hugging Face: `Gemma3ForCausalLM` (model_type `gemma3_text`: 270M, 1B and
text-only exports) with either transformers 4's `rope_theta`,
`rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern` or
transformers 5's `rope_parameters` per layer type and `layer_types`.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models import gemma3

GGUF_ARCH = "gemma3"
HF_ARCHITECTURES = ("Gemma3ForCausalLM",)

# GGUF per-layer tensor name -> (our `layers` key, is a matrix to transpose)
_GGUF_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_q_norm.weight": ("q_norm", False),
    "attn_k_norm.weight": ("k_norm", False),
    "attn_output.weight": ("wo", True),
    "post_attention_norm.weight": ("post_attn_norm", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
    "post_ffw_norm.weight": ("post_mlp_norm", False),
}
# HF per-layer name (after "model.layers.{i}.") -> (our key, is a matrix to transpose)
_HF_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


def _number(value, key: str, source: str, kind=int):
    """`value` as a positive int (kind=int) or a positive finite float, else ModelLoadError naming key."""
    bad = isinstance(value, (bool, str, list, dict)) or value is None
    if not bad:
        try:
            out = kind(value)
            bad = (kind is int and out != value) or not math.isfinite(out) or out <= 0
        except (TypeError, ValueError, OverflowError):
            bad = True
    if bad:
        what = "a positive integer" if kind is int else "a positive number"
        raise ModelLoadError(f"{source}: {key} must be {what}, got {value!r}")
    return out


# ---------------------------------------------------------------------------
# GGUF


def config_from_gguf_metadata(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                              dtype: str = "float32") -> gemma3.Gemma3Config:
    """Build the `Gemma3Config` a `gemma3` GGUF file describes.

    Args:
      meta: key -> value from `models.gguf_loader.read_gguf`.
      tensors: tensor name -> `gguf.ReaderTensor` (for shapes).
      source: the file, for messages.
    Raises:
      ModelLoadError: a required key is missing, not a positive number, or
        inconsistent with the tensors; UnsupportedModelError: an option we do
        not implement (attention soft-capping, a rope scaling other than
        linear, per-layer kv-head counts, ...).
    """
    a = GGUF_ARCH

    def get(key, default=KeyError, kind=int):
        full = f"{a}.{key}"
        v = meta.get(full)
        if v is None:
            if default is KeyError:
                raise ModelLoadError(f"{source}: missing metadata key {full}")
            return default
        if isinstance(v, list) and key == "attention.head_count_kv":
            raise UnsupportedModelError(f"{source}: per-layer kv-head counts ({full}) are not "
                                        "supported")
        return _number(v, full, source, kind)

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source}: missing tensor token_embd.weight")
    emb_shape = tuple(int(s) for s in tensors["token_embd.weight"].shape)  # gguf order (E, V)
    dim, n_layers = get("embedding_length"), get("block_count")
    n_heads = get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    head_dim = get("attention.key_length", dim // n_heads)
    value_dim = get("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{source}: key and value head sizes differ ({head_dim} vs "
                                    f"{value_dim})")
    rot = get("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise UnsupportedModelError(f"{source}: partial rotary embeddings ({a}.rope.dimension_count"
                                    f" = {rot}, head dim {head_dim}) are not supported")
    if len(emb_shape) != 2 or emb_shape[0] != dim:
        raise ModelLoadError(f"{source}: token_embd.weight has GGUF shape {list(emb_shape)}, "
                             f"expected [{a}.embedding_length = {dim}, vocabulary]")
    n_vocab = emb_shape[1]
    meta_vocab = get("vocab_size", None)
    if meta_vocab is not None and meta_vocab != n_vocab:
        raise ModelLoadError(f"{source}: {a}.vocab_size = {meta_vocab} but token_embd.weight "
                             f"has {n_vocab} rows")
    window = get("attention.sliding_window")
    windows = _gguf_layer_windows(meta.get(f"{a}.attention.sliding_window_pattern"), n_layers,
                                  window, source)
    if meta.get(f"{a}.attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{source}: attention logit soft-capping "
                                    f"({a}.attn_logit_softcapping) is not supported")
    softcap = get("final_logit_softcapping", None, float)

    scaling_type = meta.get(f"{a}.rope.scaling.type", "none")
    factor = get("rope.scaling.factor", 1.0, float)
    if scaling_type in ("none", None) or factor == 1.0:
        factor = 1.0
    elif scaling_type != "linear":
        raise UnsupportedModelError(f"{source}: rope scaling type {scaling_type!r} is not "
                                    "supported for gemma3 (only linear)")
    # llama.cpp (LLM_ARCH_GEMMA3): f_attention_scale = 1/sqrt(E/H) for the 27B model, else 1/sqrt(D).
    scalar = dim / n_heads if n_layers == 62 else head_dim
    try:
        return gemma3.Gemma3Config(
            vocab_size=n_vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
            head_dim=head_dim, ffn_dim=get("feed_forward_length"), layer_windows=windows,
            norm_eps=get("attention.layer_norm_rms_epsilon", kind=float),
            rope_theta=get("rope.freq_base", 1_000_000.0, float), rope_local_theta=10_000.0,
            rope_scaling_factor=factor, query_pre_attn_scalar=float(scalar),
            final_logit_softcapping=softcap, max_seq_len=get("context_length"),
            tie_embeddings="output.weight" not in tensors, dtype=dtype, arch=a)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent metadata: {e}") from e


def _gguf_layer_windows(pattern, n_layers: int, window: int, source: str):
    """Per-layer windows from `gemma3.attention.sliding_window_pattern` (absent: period 6)."""
    key = f"{GGUF_ARCH}.attention.sliding_window_pattern"
    if pattern is None:
        return gemma3.layer_pattern(n_layers, window)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, (bool, int, np.integer))
                                               for p in pattern):
            raise ModelLoadError(f"{source}: {key} must hold {n_layers} booleans (one per "
                                 f"layer), got {pattern!r:.120}")
        return tuple(int(window) if p else None for p in pattern)
    return gemma3.layer_pattern(n_layers, window, _number(pattern, key, source))


def params_from_gguf(reader, cfg: gemma3.Gemma3Config, source: str) -> dict[str, Any]:
    """Dequantise and map every tensor into the stacked `[in, out]` pytree (numpy float32).

    Norm weights are stored by llama.cpp as `1 + w`; 1 is subtracted.

    Raises:
      ModelLoadError: a tensor is missing, misshapen or cannot be dequantised;
        UnsupportedModelError: a tensor the model has no place for.
    """
    from jaxsample.models.gguf_loader import dequantize_tensor

    shapes = gemma3.param_shapes(cfg)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    filled: set[tuple[str, int]] = set()
    params: dict[str, Any] = {"layers": layers}
    for t in reader.tensors:
        name = t.name
        a = dequantize_tensor(t, source)
        if name.endswith("norm.weight"):
            a = a - np.float32(1.0)
        if name == "token_embd.weight":
            params["embed"] = a
        elif name == "output_norm.weight":
            params["final_norm"] = a
        elif name == "output.weight":
            if a.shape != (cfg.vocab_size, cfg.dim):
                raise ModelLoadError(f"{source}: output.weight has shape {a.shape}, expected "
                                     f"({cfg.vocab_size}, {cfg.dim}) to match token_embd.weight")
            params["lm_head"] = a.T
        else:
            m = _BLOCK_RE.match(name)
            if not m or m.group(2) not in _GGUF_LAYER_TENSORS or int(m.group(1)) >= cfg.n_layers:
                raise UnsupportedModelError(f"{source}: unexpected tensor {name}; the model has no "
                                            "place for it")
            i, (key, matrix) = int(m.group(1)), _GGUF_LAYER_TENSORS[m.group(2)]
            a = a.T if matrix else a
            if a.shape != layers[key].shape[1:]:
                raise ModelLoadError(f"{source}: tensor {name} has shape {a.shape} after "
                                     f"transposing to [in, out], expected {layers[key].shape[1:]}")
            layers[key][i] = a
            filled.add((key, i))
    from jaxsample.models.gguf_loader import check_complete

    return check_complete(gemma3, cfg, params, filled, _GGUF_LAYER_TENSORS, source)


# ---------------------------------------------------------------------------
# Hugging Face directories


def is_gemma3_hf(hf: dict[str, Any]) -> bool:
    """A parsed config.json declares a Gemma 3 architecture (text-only or multimodal)."""
    archs = hf.get("architectures") if isinstance(hf, dict) else None
    archs = [archs] if isinstance(archs, str) else archs
    return isinstance(archs, list) and any(isinstance(x, str) and x.startswith("Gemma3")
                                           for x in archs)


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32") -> gemma3.Gemma3Config:
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

    def get(key, default=KeyError, kind=int):
        v = hf.get(key)
        if v is None:
            if default is KeyError:
                raise ModelLoadError(f"{source}: config.json has no {key!r}")
            return default
        return _number(v, f"config.json {key!r}", source, kind)

    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not supported "
                                    f"(only tanh-approximated GELU: {list(_GELU_TANH)})")
    for flag in ("attention_bias", "use_bidirectional_attention", "attn_logit_softcapping"):
        if hf.get(flag):
            raise UnsupportedModelError(f"{source}: config.json {flag} = {hf[flag]!r} is not "
                                        "supported")
    n_layers = get("num_hidden_layers")
    window = get("sliding_window", 4096)
    types = hf.get("layer_types")
    if types is not None:
        if (not isinstance(types, list) or len(types) != n_layers
                or not set(types) <= {"sliding_attention", "full_attention"}):
            raise ModelLoadError(f"{source}: config.json 'layer_types' must list {n_layers} of "
                                 f"'sliding_attention' / 'full_attention', got {types!r:.160}")
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        period = get("sliding_window_pattern", 6)
        windows = gemma3.layer_pattern(n_layers, window, period)

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
    factor = 1.0
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "linear":
        factor = _number(full.get("factor"), "config.json rope scaling 'factor'", source, float)
    elif kind != "default":
        raise UnsupportedModelError(f"{source}: rope scaling type {kind!r} is not supported for "
                                    "Gemma 3 (only linear)")
    local_kind = local.get("rope_type", "default")
    if local_kind != "default":
        raise UnsupportedModelError(f"{source}: local-layer rope type {local_kind!r} is not "
                                    "supported (only default)")
    dim, n_heads = get("hidden_size"), get("num_attention_heads")
    tie = hf.get("tie_word_embeddings")
    try:
        return gemma3.Gemma3Config(
            vocab_size=get("vocab_size"), dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads", n_heads), head_dim=get("head_dim", 256),
            ffn_dim=get("intermediate_size"), layer_windows=windows,
            norm_eps=get("rms_norm_eps", 1e-6, float),
            rope_theta=_number(full.get("rope_theta", 1e6), "config.json rope_theta", source,
                               float),
            rope_local_theta=_number(local.get("rope_theta", 10_000.0),
                                     "config.json local rope_theta", source, float),
            rope_scaling_factor=factor,
            query_pre_attn_scalar=get("query_pre_attn_scalar", 256, float),
            final_logit_softcapping=get("final_logit_softcapping", None, float),
            max_seq_len=get("max_position_embeddings", 131_072),
            tie_embeddings=True if tie is None else bool(tie), dtype=dtype, arch="gemma3")
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from e


def params_from_hf_tensors(cfg: gemma3.Gemma3Config, tensors: dict[str, np.ndarray],
                           source: str) -> dict[str, Any]:
    """Map HF tensor names into the stacked `[in, out]` pytree (numpy float32).

    Raises:
      ModelLoadError: a tensor is missing or misshapen; UnsupportedModelError:
        a tensor the model has no place for.
    """
    shapes = gemma3.param_shapes(cfg)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    params: dict[str, Any] = {"layers": layers}
    tensors = dict(tensors)

    def take(name):
        if name not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {name}")
        return np.asarray(tensors.pop(name), np.float32)

    params["embed"] = take("model.embed_tokens.weight")
    params["final_norm"] = take("model.norm.weight")
    if not cfg.tie_embeddings:
        params["lm_head"] = take("lm_head.weight").T
    else:
        tensors.pop("lm_head.weight", None)
    for i in range(cfg.n_layers):
        for hf_name, (key, matrix) in _HF_LAYER_TENSORS.items():
            a = take(f"model.layers.{i}.{hf_name}")
            a = a.T if matrix else a
            if a.shape != layers[key].shape[1:]:
                raise ModelLoadError(f"{source}: tensor model.layers.{i}.{hf_name} has shape "
                                     f"{a.shape} after transposing, expected {layers[key].shape[1:]}")
            layers[key][i] = a
    from jaxsample.models.hf_loader import check_leftovers

    return check_leftovers(gemma3, cfg, params, tensors, source)
