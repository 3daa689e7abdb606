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
from jaxsample.models import checks, llama
from jaxsample.models.tokenizer import CheckpointTokenizer

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}

# Sparse MoE expert tensors (after "model.layers.{i}.{block}.experts.{j}."), per
# checkpoint prefix: our key for each HF name. Mixtral: w1 gate, w3 up, w2 down.
_EXPERT_TENSORS = {
    "block_sparse_moe": {"w1.weight": "w_gate", "w3.weight": "w_up", "w2.weight": "w_down"},
    "mlp": {"gate_proj.weight": "w_gate", "up_proj.weight": "w_up", "down_proj.weight": "w_down"},
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


_MISSING = object()


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32") -> llama.LlamaConfig:
    """Build a `LlamaConfig` from a parsed config.json, validating every key it reads.

    Accepts both the `rope_theta` / `rope_scaling` keys and transformers 5's
    `rope_parameters`. Rules (`models.checks` has the type rules; null is
    the same as absent):

        hidden_size, num_attention_heads, num_hidden_layers,
        intermediate_size, vocab_size            required, integers in [1, 2**31 - 1]
        num_key_value_heads                      optional (default num_attention_heads),
                                                 same range; num_attention_heads must be
                                                 a multiple of it
        head_dim                                 optional; if absent, hidden_size must be a
                                                 multiple of num_attention_heads and the head
                                                 dim is their ratio; it must be even (RoPE)
        max_position_embeddings                  optional (2048), positive integer
        sliding_window                           optional, integer >= 0 (0: none)
        rms_norm_eps                             optional (1e-6), finite number > 0
        rope_theta                               optional (10000), finite number > 0
        rope_scaling / rope_parameters           optional objects; rope_type default or
                                                 llama3 (factor finite >= 1, low_freq_factor
                                                 finite > 0, high_freq_factor finite >
                                                 low_freq_factor, original_max_position_
                                                 embeddings a positive integer)
        partial_rotary_factor                    optional number; only 1 is supported
        tie_word_embeddings, use_sliding_window,
        mlp_bias, attention_bias                 optional booleans
        hidden_act                               optional string: silu (or swish)

    Raises:
      UnsupportedModelError: unknown architecture, activation, biases or
        rope scaling type; ModelLoadError: a required key is missing, or a
        key has the wrong type, is out of range or is inconsistent with
        another; the message names the directory and the key.
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

    def what(key):
        return f"{source}: config.json {key!r}"

    def get(key, default=_MISSING):
        v = hf.get(key)
        if v is None:
            if default is _MISSING:
                raise ModelLoadError(f"{source}: config.json has no {key!r}")
            return default
        return v

    def count(key, default=_MISSING, minimum=1):
        v = get(key, default)
        return v if v is default else checks.int_value(v, what(key), minimum=minimum)

    def positive(key, default=_MISSING):
        v = get(key, default)
        return v if v is default else checks.positive_float(v, what(key))

    def flag(key):
        v = hf.get(key)
        return None if v is None else checks.bool_value(v, what(key))

    act = checks.string_value(get("hidden_act", "silu"), what("hidden_act"))
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if flag("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias is not supported")
    if arch != "qwen2" and flag("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias (biases on q/k/v/o) is not supported "
                                    f"for {arch_name}")
    dim, n_heads = count("hidden_size"), count("num_attention_heads")
    n_kv = count("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ModelLoadError(f"{source}: config.json 'num_attention_heads' ({n_heads}) must be a "
                             f"multiple of 'num_key_value_heads' ({n_kv})")
    head_dim = count("head_dim", None)
    if head_dim is None:
        if dim % n_heads:
            raise ModelLoadError(
                f"{source}: config.json 'hidden_size' ({dim}) must be a multiple of "
                f"'num_attention_heads' ({n_heads}) when 'head_dim' is absent (the head dim is "
                "their ratio)")
        head_dim = dim // n_heads
    if head_dim % 2:
        raise ModelLoadError(f"{source}: config.json: the head dim ('head_dim' or hidden_size / "
                             f"num_attention_heads) must be even for rotary embeddings, "
                             f"got {head_dim}")
    if positive("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor is not supported")

    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ModelLoadError(f"{what('rope_parameters')} must be an object or null, got "
                             f"{checks.short_repr(rope)}")
    rope = dict(rope or {})
    if "rope_theta" in rope and rope["rope_theta"] is not None:
        theta = checks.positive_float(rope["rope_theta"], what("rope_parameters") + ".rope_theta")
    else:
        theta = positive("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    scaling_key = "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"{what('rope_scaling')} must be an object or null, got "
                             f"{checks.short_repr(scaling)}")
    if not scaling and rope:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling_key = "rope_parameters"
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        kind = checks.string_value(kind, what(scaling_key) + ".rope_type")
        if kind == "llama3":
            def field(k):
                if scaling.get(k) is None:
                    raise ModelLoadError(f"{source}: llama3 rope scaling lacks {k!r}")
                return scaling[k], f"{what(scaling_key)}.{k}"

            factor = checks.positive_float(*field("factor"))
            if factor < 1.0:
                raise ModelLoadError(f"{what(scaling_key)}.factor must be >= 1, got {factor}")
            low = checks.positive_float(*field("low_freq_factor"))
            high = checks.positive_float(*field("high_freq_factor"))
            if high <= low:
                raise ModelLoadError(f"{what(scaling_key)}.high_freq_factor ({high}) must be "
                                     f"greater than low_freq_factor ({low})")
            orig = checks.int_value(*field("original_max_position_embeddings"))
            rope_scaling = llama.RopeScaling(factor=factor, low_freq_factor=low,
                                             high_freq_factor=high,
                                             original_max_position_embeddings=orig)
        elif kind != "default":
            raise UnsupportedModelError(
                f"{source}: rope scaling type {kind!r} is not supported (only 'llama3')")

    ctx = count("max_position_embeddings", 2048)
    window = count("sliding_window", 0, minimum=0)
    use_window = flag("use_sliding_window")
    if window and (arch != "qwen2" or use_window) and window < ctx:
        ctx = window  # full attention equals sliding-window attention within the window
    tie = flag("tie_word_embeddings")
    moe = {}
    if arch == "mixtral":  # transformers' MixtralTopKRouter: softmax, top k, renormalise
        experts = count("num_local_experts")
        used = count("num_experts_per_tok")
        if used > experts:
            raise ModelLoadError(f"{what('num_experts_per_tok')} ({used}) must be <= "
                                 f"'num_local_experts' ({experts})")
        moe = dict(n_experts=experts, n_experts_per_tok=used, norm_topk=True)
    try:
        return llama.LlamaConfig(
            vocab_size=count("vocab_size"), dim=dim, n_layers=count("num_hidden_layers"),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=count("intermediate_size"), norm_eps=positive("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=rope_scaling, max_seq_len=ctx,
            tie_embeddings=bool(tie) if tie is not None else False,
            qkv_bias=(arch == "qwen2"), dtype=dtype, arch=arch, **moe)
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
    from jaxsample.models import gemma3_loader

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
      ModelLoadError: a tensor is missing, misshapen or holds NaN or inf;
        UnsupportedModelError: a tensor the model has no place for.
    """
    shapes = llama.param_shapes(cfg)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    params: dict[str, Any] = {"layers": layers}
    tensors = dict(tensors)

    def take(name, shape=None):
        if name not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {name}")
        a = np.asarray(tensors.pop(name), np.float32)
        if shape is not None and a.shape != shape:
            raise ModelLoadError(f"{source}: tensor {name} has shape {a.shape}, expected {shape} "
                                 "(from config.json)")
        if not np.isfinite(a).all():
            raise ModelLoadError(f"{source}: tensor {name} holds {int((~np.isfinite(a)).sum())} "
                                 "non-finite values (NaN or inf); the checkpoint is corrupt")
        return a

    params["embed"] = take("model.embed_tokens.weight", (cfg.vocab_size, cfg.dim))
    params["final_norm"] = take("model.norm.weight", (cfg.dim,))
    if not cfg.tie_embeddings:
        params["lm_head"] = take("lm_head.weight", (cfg.vocab_size, cfg.dim)).T
    else:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for i in range(cfg.n_layers):
        if cfg.n_experts:
            take_experts(cfg, layers, i, take, source)
        for hf_name, (key, matrix) in _LAYER_TENSORS.items():
            if key not in layers or (cfg.n_experts and key in _EXPERT_KEYS):
                continue
            a = take(f"model.layers.{i}.{hf_name}")
            a = a.T if matrix else a
            if a.shape != layers[key].shape[1:]:
                raise ModelLoadError(f"{source}: tensor model.layers.{i}.{hf_name} has shape "
                                     f"{a.shape} after transposing, expected {layers[key].shape[1:]}")
            layers[key][i] = a
    return check_leftovers(llama, cfg, params, tensors, source)


_EXPERT_KEYS = ("w_gate", "w_up", "w_down")


def take_experts(cfg, layers, i: int, take, source: str) -> None:
    """Layer i's router and X experts into `layers` (stacked `[L, ...]` numpy arrays).

    Reads `model.layers.{i}.block_sparse_moe.{gate, experts.{j}.w1/w2/w3}.weight`
    (Mixtral) or `model.layers.{i}.mlp.{gate, experts.{j}.gate_proj/up_proj/
    down_proj}.weight` (Qwen3-MoE), as transformers' save_pretrained writes them.
    `take(name, shape)` pops one tensor (ModelLoadError if missing or misshapen).
    """
    E, F, X = cfg.dim, cfg.ffn_dim, cfg.n_experts
    block = "block_sparse_moe" if cfg.arch == "mixtral" else "mlp"
    base = f"model.layers.{i}.{block}"
    layers["router"][i] = take(f"{base}.gate.weight", (X, E)).T
    for j in range(X):
        for hf_name, key in _EXPERT_TENSORS[block].items():
            shape = (E, F) if key == "w_down" else (F, E)
            layers[key][i, j] = take(f"{base}.experts.{j}.{hf_name}", shape).T


def check_leftovers(family, cfg, params, tensors, source: str):
    """No tensor of the checkpoint was left unread (RoPE `inv_freq` buffers aside),
    and the params fit the family's shapes (`family.check_params`).

    Returns:
      params.
    Raises:
      UnsupportedModelError: unread tensors (the first five named).
      ModelLoadError: a shape that does not fit the config.
    """
    extra = sorted(k for k in tensors if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UnsupportedModelError(f"{source}: unexpected tensors {extra[:5]}"
                                    f"{' ...' if len(extra) > 5 else ''}")
    try:
        family.check_params(cfg, params, source)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return params
