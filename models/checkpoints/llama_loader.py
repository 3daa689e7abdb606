"""The Llama family's loader: config mappings and tensor tables (Llama, Mistral, Qwen2, Qwen3,
Mixtral).

GGUF (llama.cpp's `convert_hf_to_gguf.py`): metadata `ARCH.*`, tensors
`token_embd`, `output_norm`, `output`, `blk.{i}.attn_{norm,q,k,v,output}`,
`blk.{i}.ffn_{norm,gate,up,down}`, `rope_freqs` (Llama 3 scaling). The
`llama` and `mistral` architectures have llama.cpp's RoPE row permutation
on attn_q / attn_k (undone with `loader_core.unpermute_rope_rows`); `qwen2`
and `qwen3` are written unpermuted (llama.cpp runs them with NEOX, i.e.
rotate-half, RoPE); `qwen3` adds `blk.{i}.attn_{q,k}_norm` (QK-norm).

Llama-3 RoPE scaling is stored by llama.cpp as a `rope_freqs.weight` tensor
of per-frequency divisors, not as parameters; the parameters are recovered
by matching the divisors against the Llama-3 formula (`llama3_from_factors`).

Mixtral (a sparse MoE FFN, `models.families.moe`): GGUF arch `llama` with
`ARCH.expert_count` / `expert_used_count` and `blk.{i}.ffn_gate_inp` (router),
`ffn_{gate,up,down}_exps` (experts stacked `[X, out, in]`); Hugging Face
`MixtralForCausalLM` (`block_sparse_moe.gate`, `.experts.{e}.w1/w3/w2`), and
`Qwen3MoeForCausalLM` (Qwen3's QK-norm; `mlp.gate`, `mlp.experts.{e}.gate_proj/
up_proj/down_proj`; `moe_intermediate_size`, `norm_topk_prob`; every layer
sparse: `decoder_sparse_step` 1, `mlp_only_layers` [], else refused).

Qwen3-MoE GGUF (arch `qwen3moe`, llama.cpp's `Qwen3MoeModel(Qwen2MoeModel)` converter
and `src/models/qwen3moe.cpp`): Qwen3's layout (Q/K rows unpermuted, NEOX RoPE,
`attn_{q,k}_norm`) with Mixtral's stacked expert tensors in every layer;
`qwen3moe.expert_count` / `expert_used_count` are required (llama.cpp throws
without them), one expert's width is `qwen3moe.expert_feed_forward_length`
(llama.cpp's fallback without it: `feed_forward_length / expert_used_count`).
llama.cpp's graph renormalises the top-k weights unconditionally for qwen3moe
(`build_moe_ffn(..., norm_w=true, ...)`; the converter writes no
`expert_weights_norm` and the graph reads none), so `norm_topk` is True whatever
the source's `norm_topk_prob` was; a `qwen3moe.expert_weights_scale` other than
0 / 1 (llama.cpp would scale the weights by it) is refused.

Hugging Face: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`
(q/k/v bias), `Qwen3ForCausalLM` (QK-norm, no biases, `head_dim` independent
of hidden / heads); transformers 4's `rope_theta` / `rope_scaling` and 5's
`rope_parameters`. Reference: transformers `modeling_llama.py`,
`modeling_qwen2.py`, `modeling_rope_utils.py` (`rope_type: llama3`).
"""

from __future__ import annotations

from jaxsample.models.checkpoints.llama_config import HF_CLASSES, config_from_gguf, config_from_hf
from jaxsample.models.checkpoints.loader_core import (
    Architecture,
    Tensor,
    TensorTable,
    unpermute_rope_rows,
)
from jaxsample.models.families import llama

GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3moe")


# Sparse mixture-of-experts FFN tensors (models.families.moe), replacing the MLP's.
# llama.cpp stacks the experts ([X, out, in] per layer, `convert_hf_to_gguf.py`
# LlamaModel for Mixtral); transformers' save_pretrained writes one tensor per
# expert (Mixtral: w1 gate, w3 up, w2 down).
_GGUF_MOE = {
    "ffn_gate_inp.weight": Tensor("router", True),
    "ffn_gate_exps.weight": Tensor("w_gate", True),
    "ffn_up_exps.weight": Tensor("w_up", True),
    "ffn_down_exps.weight": Tensor("w_down", True),
}


_HF_MOE = {
    "block_sparse_moe.gate.weight": Tensor("router", True),
    "block_sparse_moe.experts.{e}.w1.weight": Tensor("w_gate", True),
    "block_sparse_moe.experts.{e}.w3.weight": Tensor("w_up", True),
    "block_sparse_moe.experts.{e}.w2.weight": Tensor("w_down", True),
}


_HF_QWEN3_MOE = {
    "mlp.gate.weight": Tensor("router", True),
    "mlp.experts.{e}.gate_proj.weight": Tensor("w_gate", True),
    "mlp.experts.{e}.up_proj.weight": Tensor("w_up", True),
    "mlp.experts.{e}.down_proj.weight": Tensor("w_down", True),
}


_MLP = ("w_gate", "w_up", "w_down")


def with_moe(layer: dict, moe: dict) -> dict:
    """A layer table with the dense MLP's entries replaced by the MoE's."""
    out = {n: t for n, t in layer.items() if not set(t.keys) & set(_MLP)}
    out.update(moe)
    return out


_GGUF_LAYER = {
    "attn_norm.weight": Tensor("attn_norm"),
    "attn_q.weight": Tensor("wq", True),
    "attn_k.weight": Tensor("wk", True),
    "attn_v.weight": Tensor("wv", True),
    "attn_output.weight": Tensor("wo", True),
    "attn_q.bias": Tensor("bq"),
    "attn_k.bias": Tensor("bk"),
    "attn_v.bias": Tensor("bv"),
    "attn_q_norm.weight": Tensor("q_norm"),
    "attn_k_norm.weight": Tensor("k_norm"),
    "ffn_norm.weight": Tensor("mlp_norm"),
    "ffn_gate.weight": Tensor("w_gate", True),
    "ffn_up.weight": Tensor("w_up", True),
    "ffn_down.weight": Tensor("w_down", True),
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
    "self_attn.o_proj.weight": Tensor("wo", True),
    "self_attn.q_proj.bias": Tensor("bq"),
    "self_attn.k_proj.bias": Tensor("bk"),
    "self_attn.v_proj.bias": Tensor("bv"),
    "self_attn.q_norm.weight": Tensor("q_norm"),
    "self_attn.k_norm.weight": Tensor("k_norm"),
    "post_attention_layernorm.weight": Tensor("mlp_norm"),
    "mlp.gate_proj.weight": Tensor("w_gate", True),
    "mlp.up_proj.weight": Tensor("w_up", True),
    "mlp.down_proj.weight": Tensor("w_down", True),
}


# Phi-3: fused q/k/v and gate/up rows, split on load (transformers `Phi3Attention`, `Phi3MLP`).
_HF_PHI3_LAYER = {
    "input_layernorm.weight": Tensor("attn_norm"),
    "self_attn.qkv_proj.weight": Tensor(("wq", "wk", "wv"), True),
    "self_attn.o_proj.weight": Tensor("wo", True),
    "post_attention_layernorm.weight": Tensor("mlp_norm"),
    "mlp.gate_up_proj.weight": Tensor(("w_gate", "w_up"), True),
    "mlp.down_proj.weight": Tensor("w_down", True),
}


# llama.cpp's phi3 keeps both fusions: attn_qkv, and ffn_up holding gate then up rows.
_GGUF_PHI3_LAYER = {
    "attn_norm.weight": Tensor("attn_norm"),
    "attn_qkv.weight": Tensor(("wq", "wk", "wv"), True),
    "attn_output.weight": Tensor("wo", True),
    "ffn_norm.weight": Tensor("mlp_norm"),
    "ffn_up.weight": Tensor(("w_gate", "w_up"), True),
    "ffn_down.weight": Tensor("w_down", True),
}


_GGUF_LONGROPE = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})


_HF_TOP = {
    "model.embed_tokens.weight": Tensor("embed"),
    "model.norm.weight": Tensor("final_norm"),
    "lm_head.weight": Tensor("lm_head", True),
}


ROTARY_BUFFERS = ("rotary_emb.inv_freq",)


def gguf_table(cfg: llama.LlamaConfig) -> TensorTable:
    """llama.cpp's names; the `llama` / `mistral` Q/K rows are un-permuted."""
    transform = None
    if cfg.arch in ("llama", "mistral"):
        heads = {"wq": cfg.n_heads, "bq": cfg.n_heads, "wk": cfg.n_kv_heads, "bk": cfg.n_kv_heads}

        def transform(key, a):
            return unpermute_rope_rows(a, heads[key]) if key in heads else a

    if cfg.arch == "phi3":
        return TensorTable("blk.{i}.", _GGUF_TOP, _GGUF_PHI3_LAYER, ignore=_GGUF_LONGROPE)
    layer = with_moe(_GGUF_LAYER, _GGUF_MOE) if cfg.n_experts else _GGUF_LAYER
    return TensorTable("blk.{i}.", _GGUF_TOP, layer, ignore=frozenset({"rope_freqs.weight"}),
                       transform=transform)


def hf_table(cfg: llama.LlamaConfig) -> TensorTable:
    """transformers' state-dict names (a tied checkpoint's stored head copy is skipped)."""
    top = dict(_HF_TOP)
    ignore = frozenset()
    if cfg.tie_embeddings:
        del top["lm_head.weight"]
        ignore = frozenset({"lm_head.weight"})  # some tied checkpoints store the copy anyway
    if cfg.n_experts:
        layer = with_moe(_HF_LAYER, _HF_QWEN3_MOE if cfg.arch == "qwen3moe" else _HF_MOE)
    else:
        layer = _HF_PHI3_LAYER if cfg.arch == "phi3" else _HF_LAYER
    return TensorTable("model.layers.{i}.", top, layer, ignore=ignore,
                       ignore_suffixes=ROTARY_BUFFERS)


ARCHITECTURE = Architecture(
    family=llama, hf_classes=tuple(HF_CLASSES), gguf_archs=GGUF_ARCHS,
    config_from_hf=config_from_hf, config_from_gguf=config_from_gguf,
    hf_table=hf_table, gguf_table=gguf_table)
