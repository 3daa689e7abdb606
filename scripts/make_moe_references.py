"""Write the tiny mixture-of-experts checkpoints and references for tests/models/test_moe.py.

Needs torch and transformers (not needed by the tests):

    python scripts/make_moe_references.py        # writes tests/data/

Each model is built with transformers' own class, its weights randomised
(`randomize`, larger than the default init so logits and router choices
differ clearly), saved with `save_pretrained` in float32 together with the
tiny byte-level BPE tokenizer of tests/data/tiny_llama, and reloaded from
the saved files for the reference:

* `tiny_mixtral/` (`MixtralForCausalLM`): E 32, L 2, H 4, K 2, D 8, X 8
  experts of width F 48, top 2, untied head.
* `tiny_qwen3_moe/` (`Qwen3MoeForCausalLM`): E 32, L 2, H 4, K 2, D 16
  (head_dim != E / H), QK-norm, X 8 experts of width 48
  (`moe_intermediate_size`), top 2, `norm_topk_prob=False` (the default,
  the top-k probabilities are not renormalised), untied head.
* `tiny_mixtral.gguf`: tiny_mixtral written with `gguf.GGUFWriter` as
  llama.cpp's `convert_hf_to_gguf.py` writes Mixtral (arch `llama`, Q/K rows
  permuted, `ffn_gate_inp` the router, experts stacked into
  `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps`, `llama.expert_count`,
  `llama.expert_used_count`).
* `tiny_qwen3_moe.gguf`: tiny_qwen3_moe's saved safetensors written as llama.cpp's
  `convert_hf_to_gguf.py` writes Qwen3-MoE (`Qwen3MoeModel(Qwen2MoeModel)`: arch
  `qwen3moe`, Q/K rows unpermuted, `attn_{q,k}_norm`, `ffn_gate_inp`, stacked
  `ffn_*_exps`, `qwen3moe.expert_count` / `expert_used_count` /
  `expert_feed_forward_length`). llama.cpp's qwen3moe graph always renormalises the
  top-k weights (`build_moe_ffn(..., norm_w=true)`), so its reference,
  `tiny_qwen3_moe_gguf/...`, is transformers on the same weights with
  `norm_topk_prob=True`.
* `tiny_moe_reference.npz`, per model `<name>/...` (and `tiny_qwen3_moe_gguf/...`):
  `logits` `[S, V]` float32 over a fixed 40-token sequence `sequence`;
  `router_logits` `[L, S, X]` (transformers' `output_router_logits`);
  `greedy` `[G]` int32, 16 greedy tokens after `prompt`, with `margins`
  `[G]` (top-1 minus top-2 logit at each step: a test may only compare a
  token whose margin is above float rounding).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import gguf
import numpy as np
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TOKENIZER_FROM = DATA / "tiny_llama"
GREEDY = 16

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, max_position_embeddings=512, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
SPECS = {
    "tiny_mixtral": (transformers.MixtralConfig, dict(
        head_dim=8, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "tiny_qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        head_dim=16, intermediate_size=64, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
}


def randomize(model: torch.nn.Module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight") and p.dim() == 2 and "proj" not in name:
                # the router: spread its logits so top-k choices have clear margins
                p.copy_(3.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py, `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def start_gguf(path: pathlib.Path, arch: str, name: str, cfg) -> gguf.GGUFWriter:
    """A writer holding the metadata both MoE files share (convert_hf_to_gguf.py `TextModel`)
    and the tiny byte-level BPE tokenizer."""
    tok = json.loads((TOKENIZER_FROM / "tokenizer.json").read_text())
    tcfg = json.loads((TOKENIZER_FROM / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    specials = {t["content"] for t in tok["added_tokens"]}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(COMMON["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    X = cfg.num_local_experts if arch == "llama" else cfg.num_experts
    w.add_expert_count(X)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = sorted(vocab, key=vocab.get)
    merges = tok["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_pad_token_id(vocab[tcfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])
    return w


def finish_gguf(w: gguf.GGUFWriter, sd):
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_mixtral_gguf(sd, cfg, path: pathlib.Path):
    """llama.cpp's Mixtral layout (convert_hf_to_gguf.py `LlamaModel`, experts stacked)."""
    w = start_gguf(path, "llama", "tiny-mixtral", cfg)
    H, K, X = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "block_sparse_moe.gate": "ffn_gate_inp"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            a = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                a = llamacpp_permute(a, H, H)
            elif gg == "attn_k":
                a = llamacpp_permute(a, H, K)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
        for hf, gg in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
            a = np.stack([sd[f"model.layers.{i}.block_sparse_moe.experts.{j}.{hf}.weight"]
                          for j in range(X)])  # [X, out, in]
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
    finish_gguf(w, sd)


def write_qwen3_moe_gguf(sd, cfg, path: pathlib.Path):
    """llama.cpp's qwen3moe layout (convert_hf_to_gguf.py `Qwen3MoeModel(Qwen2MoeModel)`):
    Q/K rows as transformers has them (no permutation: NEOX RoPE), `attn_{q,k}_norm`,
    `ffn_gate_inp` the router, experts stacked `[X, out, in]` in every layer."""
    w = start_gguf(path, "qwen3moe", "tiny-qwen3-moe", cfg)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_proj": "attn_k",
             "self_attn.k_norm": "attn_k_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate": "ffn_gate_inp"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            a = sd[f"model.layers.{i}.{hf}.weight"]
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
        for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                       ("down_proj", "ffn_down_exps")):
            a = np.stack([sd[f"model.layers.{i}.mlp.experts.{j}.{hf}.weight"]
                          for j in range(cfg.num_experts)])  # [X, out, in]
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
    finish_gguf(w, sd)


def reference(model, name: str, seq: np.ndarray, prompt: np.ndarray) -> dict[str, np.ndarray]:
    """`<name>/logits`, `router_logits`, `greedy` and `margins` of one transformers model."""
    ref = {}
    with torch.no_grad():
        out = model(torch.tensor(seq[None]), output_router_logits=True)
        ref[f"{name}/logits"] = out.logits[0].numpy().astype(np.float32)
        ref[f"{name}/router_logits"] = np.stack(
            [r.reshape(len(seq), -1).numpy() for r in out.router_logits]).astype(np.float32)
        ids = torch.tensor(prompt[None])
        greedy, margins = [], []
        for _ in range(GREEDY):  # greedy by hand: the margin of every step
            row = model(ids).logits[0, -1]
            top2 = torch.topk(row, 2).values
            tok = int(torch.argmax(row))
            greedy.append(tok)
            margins.append(float(top2[0] - top2[1]))
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
    ref[f"{name}/greedy"] = np.array(greedy, np.int32)
    ref[f"{name}/margins"] = np.array(margins, np.float32)
    return ref


def main():
    torch.set_num_threads(2)
    vocab = json.loads((TOKENIZER_FROM / "tokenizer.json").read_text())
    V = len(vocab["model"]["vocab"]) + sum(
        t["id"] >= len(vocab["model"]["vocab"]) for t in vocab["added_tokens"])
    rng = np.random.default_rng(24)
    seq = rng.integers(0, V, size=40)
    prompt = rng.integers(0, V, size=12)
    ref = {"sequence": seq.astype(np.int32), "prompt": prompt.astype(np.int32)}
    for i, (name, (cls, extra)) in enumerate(SPECS.items()):
        d = DATA / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cfg = cls(vocab_size=V, **COMMON, **extra)
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, seed=240 + i)
        model.save_pretrained(d, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TOKENIZER_FROM / f, d / f)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ref.update(reference(model, name, seq, prompt))
        # transformers 5 holds the experts fused in memory; the saved file has
        # the per-expert names llama.cpp's converter reads.
        from safetensors.numpy import load_file
        sd = load_file(str(d / "model.safetensors"))
        if name == "tiny_mixtral":
            write_mixtral_gguf(sd, cfg, DATA / "tiny_mixtral.gguf")
        else:
            write_qwen3_moe_gguf(sd, cfg, DATA / "tiny_qwen3_moe.gguf")
            # llama.cpp's qwen3moe graph renormalises the top-k weights whatever
            # norm_topk_prob was: its reference is the same weights with norm_topk_prob=True.
            model = transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.float32, norm_topk_prob=True).eval()
            assert model.config.norm_topk_prob is True
            ref.update(reference(model, "tiny_qwen3_moe_gguf", seq, prompt))
        for f in d.iterdir():
            if f.name not in ("config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json"):
                f.unlink()
    np.savez_compressed(DATA / "tiny_moe_reference.npz", **ref)
    for p in sorted(DATA.glob("tiny_*moe*")) + sorted(DATA.glob("tiny_mixtral*")):
        size = sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")))
        print(f"{p.relative_to(ROOT)}: {size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
