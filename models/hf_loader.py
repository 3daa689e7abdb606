"""Load a Hugging Face model directory (config.json + *.safetensors + tokenizer.json).

Architectures: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`
(q/k/v bias), and `Gemma3ForCausalLM` (through `models.gemma3_loader`).
Weights are read with the `safetensors` package as numpy
(BF16, which numpy lacks, is widened to float32 from the raw bytes) and
transposed from PyTorch's `Linear.weight [out, in]` to our `[in, out]`.

Reference: `transformers` `modeling_llama.py`, `modeling_qwen2.py`,
`modeling_rope_utils.py` (`rope_type: llama3`).
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from models import llama
from models.tokenizer import CheckpointTokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

# HF per-layer name (after "model.layers.{i}.") -> (our key, is a matrix to transpose)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def _json_kind(value: Any) -> str:
    """'array', 'string', ... : the JSON name of a parsed value's type."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32") -> llama.LlamaConfig:
    """Build a `LlamaConfig` from a parsed config.json.

    Accepts both the `rope_theta` / `rope_scaling` keys and transformers 5's
    `rope_parameters`.

    Raises:
      UnsupportedModelError: unknown architecture, activation, biases or
        rope scaling type; ModelLoadError: a required key is missing.
    """
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{source}: config.json: the top level must be a JSON object, "
                             f"got a JSON {_json_kind(hf)}")
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{source}: config.json 'architectures' must be a list of "
                             f"strings, got {archs!r}")
    arch_name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch_name is None:
        raise UnsupportedModelError(f"{source}: architectures {archs} not supported; supported: "
                                    f"{sorted(SUPPORTED_ARCHITECTURES) + ['Gemma3ForCausalLM']}")
    arch = SUPPORTED_ARCHITECTURES[arch_name]

    def get(key, default=KeyError):
        v = hf.get(key)
        if v is None:
            if default is KeyError:
                raise ModelLoadError(f"{source}: config.json has no {key!r}")
            return default
        return v

    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias is not supported")
    if arch != "qwen2" and hf.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias (biases on q/k/v/o) is not supported "
                                    f"for {arch_name}")
    dim, n_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = int(get("head_dim", dim // n_heads))
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")

    rope = dict(hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                         if rope else None)
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "llama3":
            try:
                rope_scaling = llama.RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
            except KeyError as e:
                raise ModelLoadError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from None
        elif kind != "default":
            raise UnsupportedModelError(
                f"{source}: rope scaling type {kind!r} is not supported (only 'llama3')")

    ctx = int(get("max_position_embeddings", 2048))
    window = hf.get("sliding_window")
    if window and (arch != "qwen2" or hf.get("use_sliding_window")) and int(window) < ctx:
        ctx = int(window)  # full attention equals sliding-window attention within the window
    tie = hf.get("tie_word_embeddings")
    try:
        return llama.LlamaConfig(
            vocab_size=int(get("vocab_size")), dim=dim, n_layers=int(get("num_hidden_layers")),
            n_heads=n_heads, n_kv_heads=int(get("num_key_value_heads", n_heads)), head_dim=head_dim,
            ffn_dim=int(get("intermediate_size")), norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=rope_scaling, max_seq_len=ctx,
            tie_embeddings=bool(tie) if tie is not None else False,
            qkv_bias=(arch == "qwen2"), dtype=dtype, arch=arch)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from e


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy (BF16 widened to float32)."""
    from safetensors import safe_open

    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out = {}
        bf16 = {k for k, v in header.items() if k != "__metadata__" and v.get("dtype") == "BF16"}
        with safe_open(str(path), framework="numpy") as sf:
            for k in sf.keys():
                if k not in bf16:
                    out[k] = sf.get_tensor(k)
        if bf16:
            raw = np.memmap(path, np.uint8, mode="r")
            for k in bf16:
                begin, end = header[k]["data_offsets"]
                u16 = np.frombuffer(raw[8 + n + begin:8 + n + end].tobytes(), "<u2")
                out[k] = (u16.astype(np.uint32) << 16).view(np.float32).reshape(header[k]["shape"])
        return out
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise ModelLoadError(f"{path}: not a readable safetensors file: {type(e).__name__}: {e}") from e


def load_hf_dir(path: str | os.PathLike, *, dtype: str = "float32"):
    """Load a Hugging Face model directory.

    Args:
      path: a directory with config.json, one or more *.safetensors and tokenizer.json.
      dtype: "float32" or "bfloat16" for the parameters.
    Returns:
      (cfg `LlamaConfig`, params pytree of numpy float32 `[in, out]` arrays,
       tokenizer `CheckpointTokenizer`).
    Raises:
      ModelLoadError / UnsupportedModelError naming the directory or file.
    """
    path = pathlib.Path(path)
    source = str(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{cfg_path}: the top level must be a JSON object, "
                             f"got a JSON {_json_kind(hf)}")
    from models import gemma3_loader

    gemma = gemma3_loader.is_gemma3_hf(hf)
    cfg = (gemma3_loader.config_from_hf if gemma else config_from_hf)(hf, source, dtype=dtype)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (PyTorch .bin files are not supported)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(_read_safetensors(f))
    tokenizer = CheckpointTokenizer.from_hf_dir(path)
    to_params = gemma3_loader.params_from_hf_tensors if gemma else params_from_hf_tensors
    return cfg, to_params(cfg, tensors, source), tokenizer


def params_from_hf_tensors(cfg: llama.LlamaConfig, tensors: dict[str, np.ndarray],
                           source: str) -> dict[str, Any]:
    """Map HF tensor names into the stacked `[in, out]` pytree (numpy float32).

    Raises:
      ModelLoadError: a tensor is missing or misshapen; UnsupportedModelError:
        a tensor the model has no place for.
    """
    shapes = llama.param_shapes(cfg)
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
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for i in range(cfg.n_layers):
        for hf_name, (key, matrix) in _LAYER_TENSORS.items():
            if key not in layers:
                continue
            a = take(f"model.layers.{i}.{hf_name}")
            a = a.T if matrix else a
            if a.shape != layers[key].shape[1:]:
                raise ModelLoadError(f"{source}: tensor model.layers.{i}.{hf_name} has shape "
                                     f"{a.shape} after transposing, expected {layers[key].shape[1:]}")
            layers[key][i] = a
    extra = sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UnsupportedModelError(f"{source}: unexpected tensors {extra[:5]}"
                                    f"{' ...' if len(extra) > 5 else ''}")
    try:
        llama.check_params(cfg, params, source)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return params
