"""The Llama family's config mappings: a GGUF file's metadata or a config.json to a `LlamaConfig`.

Every value is read through `ConfigReader` (validated, errors naming the file
and key); RoPE scaling (Llama 3, linear, LongRoPE), Qwen3-MoE / Mixtral
expert fields and the refusals (each naming what is supported) live here.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import checks
from jaxsample.models.checkpoints.loader_core import (
    ConfigReader,
    gguf_attention,
    gguf_embedding,
    hf_attention,
)
from jaxsample.models.families import llama

HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3moe",
}


def llama3_from_factors(factors: np.ndarray, base: llama.LlamaConfig) -> llama.RopeScaling | None:
    """Llama-3 scaling parameters whose per-frequency divisors equal `factors` `[D/2]`, or None."""
    plain = llama.rope_frequencies(base.replace(rope_scaling=None)).astype(np.float64)
    factor = float(np.max(factors))
    if np.allclose(factors, 1.0):
        return None
    # (orig, low, high) and (c*orig, c*low, c*high) give the same frequencies: prefer low = 1,
    # then Llama 3.1/3.2's high = 4 and orig = 8192.
    for low, high, orig in itertools.product(
            (1.0, 2.0, 0.5), (4.0, 2.0, 8.0, 1.0), [8192] + [2 ** k for k in range(4, 21)]):
        if high <= low:
            continue
        cand = llama.RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                                 original_max_position_embeddings=orig)
        scaled = llama.rope_frequencies(base.replace(rope_scaling=cand)).astype(np.float64)
        if np.allclose(plain / scaled, factors, rtol=1e-3, atol=1e-4):
            return cand
    raise ValueError("rope_freqs.weight does not match any Llama-3 scaling")


def gguf_longrope(r: ConfigReader, tensors: dict[str, Any], rope_dims: int) -> llama.LongRope | None:
    """LongRoPE of a phi3 GGUF (llama.cpp's `Phi3MiniModel` converter): tensors
    `rope_factors_long` / `rope_factors_short` `[R/2]`, keys
    `rope.scaling.original_context_length` and `rope.scaling.attn_factor`; None without them."""
    import gguf

    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if not any(n in tensors for n in names):
        return None
    factors = []
    for n in names:
        if n not in tensors:
            raise ModelLoadError(f"{r.source}: missing tensor {n} (LongRoPE needs both factor sets)")
        t = tensors[n]
        f = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        if f.shape != (rope_dims // 2,) or not (np.isfinite(f) & (f > 0)).all():
            raise ModelLoadError(f"{r.source}: {n} must hold {rope_dims // 2} finite factors > 0, "
                                 f"got {checks.short_repr(f.tolist())}")
        factors.append(tuple(float(x) for x in f))
    return llama.LongRope(short_factor=factors[0], long_factor=factors[1],
                          original_max_position_embeddings=r.count(
                              "rope.scaling.original_context_length"),
                          attention_factor=r.positive("rope.scaling.attn_factor", 1.0))


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                     dtype: str = "float32") -> llama.LlamaConfig:
    """Build the `LlamaConfig` a llama / mistral / qwen2 / qwen3 / phi3 / qwen3moe GGUF file
    describes, validating every key.

    Rules (`ARCH` is `general.architecture`; `models.checkpoints.checks` has the type rules):

        ARCH.embedding_length, .block_count, .feed_forward_length,
        .attention.head_count, .context_length       required, integers in [1, 2**31 - 1]
        .attention.head_count_kv                     optional (default head_count), same
                                                     range, and head_count must be a multiple
        .attention.key_length                        optional; if absent, embedding_length
                                                     must be a multiple of head_count and the
                                                     head dim is their ratio; the head dim
                                                     must be even (RoPE rotates pairs)
        .attention.value_length, .rope.dimension_count  optional, positive, = the head dim
        .vocab_size                                  optional, positive, = rows of token_embd
        .attention.sliding_window                    optional, integer >= 0 (0: none)
        .attention.layer_norm_rms_epsilon            required, finite float > 0
        .rope.freq_base                              optional (10000), finite float > 0
        .rope.scaling.type                           optional string: none, or linear with
                                                     factor 1; others are unsupported
        .rope.scaling.factor                         optional, finite float >= 0 (0 means
                                                     unset, llama.cpp's convention)
        token_embd.weight                            2-D, [E, V] in GGUF order, E =
                                                     embedding_length
        rope_freqs.weight                            [D/2] finite divisors > 0
        .expert_count, .expert_used_count            optional (0: a dense MLP); with
                                                     experts (Mixtral as llama.cpp writes it),
                                                     integers with 1 <= used <= count, and
                                                     feed_forward_length is one expert's width
                                                     qwen3moe: both required (count >= 1);
        .expert_feed_forward_length                  qwen3moe: optional, positive integer,
                                                     one expert's width (default
                                                     feed_forward_length // expert_used_count,
                                                     llama.cpp's fallback)
        .expert_weights_scale                        qwen3moe: optional; only 0 or 1 (none)

    Args:
      meta: key -> value from `loader_core.read_gguf`.
      tensors: tensor name -> `gguf.ReaderTensor` (for shapes and rope_freqs).
      source: the file, for messages.
    Raises:
      UnsupportedModelError: an option we do not implement (rope scaling
        type, partial rotary, ...).
      ModelLoadError: a required key is missing, or a key has the wrong
        type, is out of range or is inconsistent with another key or a tensor
        shape; the message names the file and the key.
    """
    arch = meta["general.architecture"]
    r = ConfigReader(meta, source, arch)
    dim, n_vocab = gguf_embedding(tensors, r)
    n_heads, n_kv, head_dim = gguf_attention(r, dim)
    rot = r.count("rope.dimension_count", head_dim)
    if rot != head_dim and (arch != "phi3" or rot > head_dim or rot % 2):
        raise UnsupportedModelError(
            f"{source}: partial rotary embeddings ({arch}.rope.dimension_count = {rot}, head dim "
            f"{head_dim}) are not supported" + (" (phi3: an even count <= the head dim)"
                                                if arch == "phi3" else ""))
    meta_vocab = r.count("vocab_size", None)
    if meta_vocab is not None and meta_vocab != n_vocab:
        raise ModelLoadError(f"{source}: {arch}.vocab_size = {meta_vocab} but token_embd.weight "
                             f"has {n_vocab} rows")
    ctx = r.count("context_length")
    window = r.count("attention.sliding_window", 0, minimum=0)
    if window and window < ctx:
        ctx = window  # full attention equals sliding-window attention within the window

    gguf_check_rope_scaling(r, source)
    # qwen3moe: llama.cpp's graph always renormalises the top-k weights (norm_w = true).
    moe = moe_fields(r, "expert_count", "expert_used_count", norm_topk=True,
                     required=(arch == "qwen3moe"))
    ffn_dim = gguf_ffn_dim(r, arch, moe)
    try:
        cfg = llama.LlamaConfig(
            vocab_size=n_vocab, dim=dim, n_layers=r.count("block_count"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=ffn_dim,
            norm_eps=r.positive("attention.layer_norm_rms_epsilon"),
            rope_theta=r.positive("rope.freq_base", 10000.0), max_seq_len=ctx,
            tie_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm=(arch in ("qwen3", "qwen3moe")),
            rotary_dim=None if rot == head_dim else rot,
            long_rope=gguf_longrope(r, tensors, rot) if arch == "phi3" else None, dtype=dtype,
            arch=arch, **moe)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent metadata: {e}") from e
    if "rope_freqs.weight" in tensors:
        cfg = gguf_rope_freqs(tensors["rope_freqs.weight"], cfg, source)
    if cfg.qkv_bias and arch != "qwen2":
        raise UnsupportedModelError(f"{source}: q/k/v biases are only supported for qwen2")
    return cfg


def gguf_check_rope_scaling(r: ConfigReader, source: str) -> None:
    """rope.scaling.type none, or linear with factor 1 (or unset); UnsupportedModelError
    for any other (Llama 3's scaling comes as rope_freqs.weight)."""
    scaling_type = r.string("rope.scaling.type", "none")
    factor = r.positive("rope.scaling.factor", None, allow_zero=True)  # 0: unset (llama.cpp)
    if scaling_type == "linear" and factor in (None, 0.0, 1.0):
        scaling_type = "none"
    if scaling_type != "none":
        raise UnsupportedModelError(
            f"{source}: rope scaling type {scaling_type!r} is not supported (only none and "
            "Llama-3 rope_freqs)")


def gguf_ffn_dim(r: ConfigReader, arch: str, moe: dict[str, Any]) -> int:
    """The MLP's (or one expert's) width: feed_forward_length, or for qwen3moe
    expert_feed_forward_length (default feed_forward_length // expert_used_count,
    llama.cpp's fallback), whose expert_weights_scale must be 0 or 1."""
    if arch != "qwen3moe":
        return r.count("feed_forward_length")
    ffn_dim = r.count("expert_feed_forward_length", None)
    if ffn_dim is None:  # llama.cpp: n_ff_exp = n_ff / n_expert_used
        ffn_dim = r.count("feed_forward_length") // moe["n_experts_per_tok"]
    scale = r.positive("expert_weights_scale", None, allow_zero=True)
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedModelError(
            f"{r.what('expert_weights_scale')} = {scale} (scaled expert "
            "weights) is not supported (only 0 or 1: unscaled)")
    return ffn_dim


def gguf_rope_freqs(t, cfg: llama.LlamaConfig, source: str) -> llama.LlamaConfig:
    """`cfg` with the Llama 3 rope scaling that the rope_freqs.weight tensor `t` (`[D/2]`
    finite divisors > 0) describes; ModelLoadError for a bad tensor,
    UnsupportedModelError for factors that are not Llama 3's."""
    import gguf

    head_dim = cfg.head_dim
    factors = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"{source}: rope_freqs.weight has shape {factors.shape}, expected "
                             f"({head_dim // 2},)")
    if not (np.isfinite(factors) & (factors > 0)).all():
        raise ModelLoadError(f"{source}: rope_freqs.weight must hold finite divisors > 0, got "
                             f"{checks.short_repr(factors.tolist())}")
    try:
        return cfg.replace(rope_scaling=llama3_from_factors(factors, cfg))
    except ValueError as e:
        raise UnsupportedModelError(f"{source}: {e}") from e


def hf_rope(r: ConfigReader) -> tuple[float, dict | None, str]:
    """(rope_theta, the scaling object or None, the key it came from).

    transformers 4 writes `rope_theta` and `rope_scaling`; 5 writes one
    `rope_parameters` object holding both.
    """
    hf = r.values
    rope = hf.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ModelLoadError(f"{r.what('rope_parameters')} must be an object or null, got "
                             f"{checks.short_repr(rope)}")
    rope = dict(rope or {})
    if "rope_theta" in rope and rope["rope_theta"] is not None:
        theta = checks.positive_float(rope["rope_theta"], r.what("rope_parameters") + ".rope_theta")
    else:
        theta = r.positive("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
    scaling_key = "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise ModelLoadError(f"{r.what('rope_scaling')} must be an object or null, got "
                             f"{checks.short_repr(scaling)}")
    if not scaling and rope:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling_key = "rope_parameters"
    return theta, scaling or None, scaling_key


def rope_kind(r: ConfigReader, scaling: dict | None, scaling_key: str) -> str:
    """The scaling's `rope_type` (or legacy `type`), "default" when there is none."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return checks.string_value(kind, r.what(scaling_key) + ".rope_type")


def llama3_scaling(r: ConfigReader, scaling: dict, scaling_key: str) -> llama.RopeScaling:
    """`rope_type: llama3` fields, validated (transformers' `_validate_llama3_parameters`)."""
    where = r.what(scaling_key)

    def field(k):
        if scaling.get(k) is None:
            raise ModelLoadError(f"{r.source}: llama3 rope scaling lacks {k!r}")
        return scaling[k], f"{where}.{k}"

    factor = checks.positive_float(*field("factor"))
    if factor < 1.0:
        raise ModelLoadError(f"{where}.factor must be >= 1, got {factor}")
    low = checks.positive_float(*field("low_freq_factor"))
    high = checks.positive_float(*field("high_freq_factor"))
    if high <= low:
        raise ModelLoadError(f"{where}.high_freq_factor ({high}) must be "
                             f"greater than low_freq_factor ({low})")
    orig = checks.int_value(*field("original_max_position_embeddings"))
    return llama.RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                             original_max_position_embeddings=orig)


def longrope_scaling(r: ConfigReader, scaling: dict, scaling_key: str, max_pos: int,
                     rope_dims: int) -> llama.LongRope:
    """`rope_type: longrope` (Phi-3): short/long factors, original context, attention factor.

    The original context is the scaling's `original_max_position_embeddings`
    or config.json's; the attention factor is `attention_factor` if given, else
    transformers' `_compute_longrope_parameters` default: with s = `factor`
    if given, else max_position_embeddings / original, `sqrt(1 + ln(s) /
    ln(original))` for s > 1 and 1 otherwise.
    """
    where = r.what(scaling_key)
    factors = {}
    for k in ("short_factor", "long_factor"):
        v = scaling.get(k)
        if not isinstance(v, list) or len(v) != rope_dims // 2:
            raise ModelLoadError(f"{where}.{k} must list rotary dims / 2 = {rope_dims // 2} "
                                 f"numbers, got {checks.short_repr(v)}")
        factors[k] = tuple(checks.positive_float(f, f"{where}.{k}") for f in v)
    orig = scaling.get("original_max_position_embeddings")
    if orig is None:
        orig = r.count("original_max_position_embeddings")
    else:
        orig = checks.int_value(orig, f"{where}.original_max_position_embeddings")
    factor = scaling.get("factor")
    factor = max_pos / orig if factor is None else checks.positive_float(factor, f"{where}.factor")
    attn = scaling.get("attention_factor")
    if attn is not None:
        attn = checks.positive_float(attn, f"{where}.attention_factor")
    elif factor <= 1.0:
        attn = 1.0
    elif orig < 2:
        raise ModelLoadError(f"{where}: original_max_position_embeddings must be >= 2 for the "
                             f"default attention factor (ln of it divides), got {orig}")
    else:
        attn = math.sqrt(1 + math.log(factor) / math.log(orig))
    return llama.LongRope(short_factor=factors["short_factor"], long_factor=factors["long_factor"],
                          original_max_position_embeddings=orig, attention_factor=attn)


def moe_fields(r: ConfigReader, count_key: str, used_key: str, *, norm_topk: bool,
               required: bool = False) -> dict[str, Any]:
    """`LlamaConfig`'s expert fields (`n_experts`, `n_experts_per_tok`, `norm_topk`).

    Args:
      r: the reader; count_key / used_key: the keys of X and k (GGUF
        `expert_count` / `expert_used_count`; config.json `num_local_experts`
        / `num_experts_per_tok` for Mixtral, `num_experts` for Qwen3-MoE).
      norm_topk: renormalise the top-k weights (Mixtral: always).
      required: the keys must be present (an HF MoE class); otherwise absent
        or 0 means a dense model.
    Returns:
      {} for a dense model, else the three fields.
    Raises:
      ModelLoadError: a key missing (when required), not an integer, or
        k > X (naming the key).
    """
    X = r.count(count_key) if required else r.count(count_key, 0, minimum=0)
    if not X:
        return {}
    k = r.count(used_key)
    if k > X:
        raise ModelLoadError(f"{r.what(used_key)} ({k}) must be <= {r.full_key(count_key)!r} "
                             f"({X})")
    return dict(n_experts=X, n_experts_per_tok=k, norm_topk=norm_topk)


def hf_common_checks(r: ConfigReader, arch_name: str, *, bias_ok: bool) -> None:
    """hidden_act silu, no mlp_bias, attention_bias only where `bias_ok`."""
    source = r.source
    act = r.string("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only silu)")
    if r.flag("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias is not supported")
    if not bias_ok and r.flag("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias (biases on q/k/v/o) is not supported "
                                    f"for {arch_name}")


def hf_rotary_dim(r: ConfigReader, arch_name: str, head_dim: int, scaling: dict | None,
                  scaling_key: str) -> int | None:
    """The rotary dims of a partial rotary embedding (partial_rotary_factor, or
    transformers 5's in rope_parameters): None for all of the head dim; phi3 only, an
    even number in [2, head dim]."""
    partial = r.positive("partial_rotary_factor", None)
    if partial is None and scaling_key == "rope_parameters" and scaling:  # transformers 5
        partial = checks.positive_float(scaling.get("partial_rotary_factor", 1.0),
                                        r.what("rope_parameters") + ".partial_rotary_factor")
    partial = 1.0 if partial is None else partial
    if partial == 1.0:
        return None
    if HF_CLASSES[arch_name] != "phi3":
        raise UnsupportedModelError(f"{r.source}: partial_rotary_factor is not supported for "
                                    f"{arch_name}")
    rotary_dim = int(head_dim * partial)  # transformers: int(head_dim * factor)
    if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"{r.what('partial_rotary_factor')} = {partial} gives "
                             f"{rotary_dim} rotary dims of head dim {head_dim}; it must "
                             "be an even number in [2, head dim]")
    return rotary_dim


def hf_experts(r: ConfigReader, arch: str) -> tuple[dict[str, Any], str]:
    """(the mixture of experts' `LlamaConfig` fields, or {} for a dense model; the key
    of the MLP's or one expert's width)."""
    if arch == "mixtral":
        # Mixtral: transformers' MixtralTopKRouter (softmax over X, top k, renormalise).
        return moe_fields(r, "num_local_experts", "num_experts_per_tok", norm_topk=True,
                          required=True), "intermediate_size"
    if arch != "qwen3moe":
        return {}, "intermediate_size"
    # Qwen3MoeTopKRouter: softmax over X, top k, renormalised only if norm_topk_prob.
    # Every layer must be sparse: one stacked layout for all L layers.
    step = r.count("decoder_sparse_step", 1)
    dense_layers = r.get("mlp_only_layers", [])
    if not isinstance(dense_layers, list):
        raise ModelLoadError(f"{r.what('mlp_only_layers')} must be a list of layer "
                             f"indices, got {checks.short_repr(dense_layers)}")
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"{r.source}: dense MLP layers between the sparse ones (decoder_sparse_step = "
            f"{step}, mlp_only_layers = {dense_layers}) are not supported; only "
            "decoder_sparse_step 1 with mlp_only_layers []")
    # The Hub's configs say num_experts; transformers 5 saves num_local_experts.
    count_key = "num_experts" if r.raw("num_experts") is not None else "num_local_experts"
    moe = moe_fields(r, count_key, "num_experts_per_tok",
                     norm_topk=bool(r.flag("norm_topk_prob", False)), required=True)
    return moe, "moe_intermediate_size"  # one expert's width


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32",
                   arch_name: str = "LlamaForCausalLM") -> llama.LlamaConfig:
    """Build a `LlamaConfig` from a parsed config.json of a Llama, Mistral or Qwen2 model.

    Accepts both the `rope_theta` / `rope_scaling` keys and transformers 5's
    `rope_parameters`. Rules (`models.checkpoints.checks` has the type rules; null is
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
      UnsupportedModelError: an activation, biases or rope scaling type we do
        not implement; ModelLoadError: a required key is missing, or a key
        has the wrong type, is out of range or is inconsistent with another;
        the message names the directory and the key.
    """
    arch = HF_CLASSES[arch_name]
    r = ConfigReader(hf, source)
    hf_common_checks(r, arch_name, bias_ok=(arch == "qwen2"))
    dim, n_heads, n_kv, head_dim = hf_attention(r)
    theta, scaling, scaling_key = hf_rope(r)
    rotary_dim = hf_rotary_dim(r, arch_name, head_dim, scaling, scaling_key)
    kind = rope_kind(r, scaling, scaling_key)
    rope_scaling = long_rope = None
    ctx = r.count("max_position_embeddings", 2048)
    if kind == "llama3":
        rope_scaling = llama3_scaling(r, scaling, scaling_key)
    elif kind == "longrope" and arch == "phi3":
        long_rope = longrope_scaling(r, scaling, scaling_key, ctx, rotary_dim or head_dim)
    elif kind != "default":
        raise UnsupportedModelError(
            f"{source}: rope scaling type {kind!r} is not supported for {arch_name} (only "
            f"{'llama3, longrope' if arch == 'phi3' else 'llama3'})")

    window = r.count("sliding_window", 0, minimum=0)
    use_window = r.flag("use_sliding_window")
    if arch in ("qwen3", "qwen3moe") and use_window:
        raise UnsupportedModelError(f"{source}: use_sliding_window (sliding-window layers above "
                                    "max_window_layers) is not supported for Qwen3ForCausalLM")
    if window and (arch not in ("qwen2", "qwen3", "qwen3moe") or use_window) and window < ctx:
        ctx = window  # full attention equals sliding-window attention within the window
    tie = r.flag("tie_word_embeddings")
    moe, ffn_key = hf_experts(r, arch)
    try:
        return llama.LlamaConfig(
            vocab_size=r.count("vocab_size"), dim=dim, n_layers=r.count("num_hidden_layers"),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=r.count(ffn_key), norm_eps=r.positive("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=rope_scaling, max_seq_len=ctx,
            tie_embeddings=bool(tie) if tie is not None else False,
            qkv_bias=(arch == "qwen2"), qk_norm=(arch in ("qwen3", "qwen3moe")),
            rotary_dim=rotary_dim, long_rope=long_rope, dtype=dtype, arch=arch, **moe)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent config.json: {e}") from e
