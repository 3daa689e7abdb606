"""Write the tiny Qwen3, Gemma 2 and Phi-3 checkpoints and references tests/models/test_families.py compares against.

Needs torch and transformers (never the tests); run with the interpreter that has them:

    /usr/bin/env python scripts/make_family_references.py     # writes tests/data/<family>/

For each family it builds a tiny random model with transformers' own class
(`Qwen3ForCausalLM`, `Gemma2ForCausalLM`, `Phi3ForCausalLM`), and writes into tests/data/<family>/:

* `config.json`, `model.safetensors` (float16: the GGUF copy below is then
  lossless) and the tokenizer files (tiny_llama's byte-level BPE of 300
  tokens for Qwen3 and Phi-3, tiny_gemma3's SentencePiece-style vocabulary of 512 for
  Gemma 2);
* `model.gguf`, the same weights written with `gguf.GGUFWriter` in llama.cpp's
  layout for that architecture (names from `gguf.TENSOR_NAMES`, metadata
  keys from `gguf.Keys`; Gemma norm weights stored as `1 + w`, as
  `convert_hf_to_gguf.py`'s `Gemma2Model` does; Phi-3's fused attn_qkv and
  ffn_up kept, LongRoPE as `rope_factors_long` / `rope_factors_short` tensors
  with `rope.scaling.original_context_length` and `rope.scaling.attn_factor`,
  as its `Phi3MiniModel` does), with the tokenizer metadata
  of tests/data/tiny_llama.gguf / tiny_spm_gemma.gguf;
* `reference.npz`: the saved files reloaded by transformers in float32
  (eager attention): the full logit rows at the last position of a short
  prompt (12 tokens) and of a long one (300 tokens, far past Gemma 2's tiny
  sliding window of 8 and long enough for RoPE errors to show), the rows at
  a few inner positions of the long prompt, and 8 greedy tokens after the
  short prompt with the top-1/top-2 margin of every step.

Tiny configs: Qwen3 with head_dim 32 independent of hidden 64 / 4 heads, GQA
4/2, QK-norm, untied head, random norms; Gemma 2 with 4 layers alternating
local (window 8) / global, query_pre_attn_scalar 24 (not head_dim 16),
attention soft-cap 5 and final soft-cap 3 (small enough to bend the
random model's scores and logits), GQA 4/2, tied head; Phi-3 with fused
qkv_proj / gate_up_proj, partial_rotary_factor 0.5 (8 of 16 head dims
rotated), LongRoPE (random short and long factors, original context 64 of
512, so the 300-token prompt runs on the long factors and the short prompt on
the short ones, as transformers switches by the call's length) and a
sliding window of 448.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import gguf
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SHORT, LONG = 12, 300
INNER = (0, 7, 8, 9, 63, 199)
GREEDY = 8


def randomize(model: torch.nn.Module, seed: int, gemma: bool):
    """Random weights large enough that logits differ clearly between tokens and positions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if gemma else 1.0  # Gemma scales by 1 + w
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def copy_tokenizer_kv(w: gguf.GGUFWriter, src: pathlib.Path):
    """The tokenizer metadata of an existing tiny GGUF (`tokenizer.*` keys)."""
    reader = gguf.GGUFReader(src)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)


def write_gguf(d: pathlib.Path, arch: str, hf: dict, tok_src: pathlib.Path, names: dict,
               norm_shift: float):
    """model.gguf in llama.cpp's layout of `arch` (F16 matrices, F32 norms)."""
    sd = {k: v.astype(np.float32) for k, v in load_file(d / "model.safetensors").items()}
    path = d / "model.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":  # convert_hf_to_gguf.py Phi3MiniModel
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(hf["sliding_window"] or 0)
        scale = hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            rope["original_max_position_embeddings"])) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if arch == "gemma2":
        w.add_sliding_window(hf["sliding_window"])
        w.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hf["final_logit_softcapping"])
    copy_tokenizer_kv(w, tok_src)

    def put(name, a):
        if name.endswith("norm.weight"):
            w.add_tensor(name, (a + norm_shift).astype(np.float32))
        else:
            w.add_tensor(name, np.ascontiguousarray(a.astype(np.float16)))

    put("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    put("output_norm.weight", sd.pop("model.norm.weight"))
    if "lm_head.weight" in sd and not hf.get("tie_word_embeddings"):
        put("output.weight", sd.pop("lm_head.weight"))
    for i in range(hf["num_hidden_layers"]):
        for hf_name, g in names.items():
            put(f"blk.{i}.{g}.weight", sd.pop(f"model.layers.{i}.{hf_name}.weight"))
    assert not [k for k in sd if k != "lm_head.weight"], sorted(sd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMACPP_NAMES = {  # transformers name -> llama.cpp name (gguf.TENSOR_NAMES)
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
QWEN3_NAMES = {**LLAMACPP_NAMES, "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm"}
PHI3_NAMES = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GEMMA2_NAMES = {**LLAMACPP_NAMES, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}

FAMILIES = {
    "tiny_qwen3": dict(
        config=lambda: transformers.Qwen3Config(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
            max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=2),
        cls=lambda c: transformers.Qwen3ForCausalLM(c), gemma=False, arch="qwen3",
        names=QWEN3_NAMES, tokenizer=DATA / "tiny_llama", gguf_tokenizer=DATA / "tiny_llama.gguf",
        vocab=300),
    "tiny_gemma2": dict(
        config=lambda: transformers.Gemma2Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=512, rope_theta=10000.0, sliding_window=8,
            query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
            tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
            bos_token_id=2, eos_token_id=1, pad_token_id=0),
        cls=lambda c: transformers.Gemma2ForCausalLM(c), gemma=True, arch="gemma2",
        names=GEMMA2_NAMES, tokenizer=DATA / "tiny_gemma3",
        gguf_tokenizer=DATA / "tiny_spm_gemma.gguf", vocab=512),
    "tiny_phi3": dict(
        config=lambda: transformers.Phi3Config(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=512, original_max_position_embeddings=64,
            sliding_window=448, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=2, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 2.8, 6.0, 11.0]}),
        cls=lambda c: transformers.Phi3ForCausalLM(c), gemma=False, arch="phi3",
        names=PHI3_NAMES, tokenizer=DATA / "tiny_llama", gguf_tokenizer=DATA / "tiny_llama.gguf",
        vocab=300),
}


def logits_rows(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def make(name: str, spec: dict, seed: int):
    d = DATA / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    torch.manual_seed(seed)
    model = spec["cls"](spec["config"]())
    randomize(model, 100 + seed, spec["gemma"])
    model.to(torch.float16).save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(spec["tokenizer"] / f, d / f)
    for f in d.iterdir():
        if f.name not in ("config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"):
            f.unlink()
    hf = json.loads((d / "config.json").read_text())
    if spec["arch"] is not None:
        write_gguf(d, spec["arch"], hf, spec["gguf_tokenizer"], spec["names"],
                   1.0 if spec["gemma"] else 0.0)
    # The reference: the saved files, reloaded in float32.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(seed)
    V = spec["vocab"]
    short = rng.integers(3, V, size=SHORT).astype(np.int32)
    long = rng.integers(3, V, size=LONG).astype(np.int32)
    rows = logits_rows(model, long.tolist())
    ref = {"short": short, "long": long, "inner": np.array(INNER, np.int32),
           "short_last": logits_rows(model, short.tolist())[-1].astype(np.float32),
           "long_last": rows[-1].astype(np.float32),
           "long_inner": rows[list(INNER)].astype(np.float32)}
    seq, new, margins = short.tolist(), [], []
    for _ in range(GREEDY):  # plain argmax loop, no processors
        row = logits_rows(model, seq)[-1]
        top2 = np.sort(row)[-2:]
        margins.append(top2[1] - top2[0])
        new.append(int(np.argmax(row)))
        seq.append(new[-1])
    ref["greedy"] = np.array(new, np.int32)
    ref["greedy_margins"] = np.array(margins, np.float64)
    np.savez_compressed(d / "reference.npz", **ref)
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {size / 1e3:.0f} kB, |logits| max {np.abs(rows).max():.2f}, "
          f"min greedy margin {min(margins):.4f}")


def main():
    torch.set_num_threads(2)
    import sys

    only = sys.argv[1:]
    for seed, (name, spec) in enumerate(FAMILIES.items()):
        if not only or name in only:
            make(name, spec, seed)


if __name__ == "__main__":
    main()
