"""The checkpoint tokenizers against transformers' ids (stored in tests/data)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from paths import DATA

from jaxsample.models.checkpoints import registry
from jaxsample.models.checkpoints.gguf_loader import read_gguf
from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer

REF = json.loads((DATA / "smollm2_reference.json").read_text())
TINY = np.load(DATA / "tiny_reference.npz")
TINY_TEXTS = ["Hello tiny world!", "café ☕ 日本 🙂", "<|im_start|>user\nhi<|im_end|>\n", "x = 12345"]


@pytest.fixture(scope="module")
def smol_meta():
    return read_gguf(registry.embedded_path())[1]


@pytest.fixture(scope="module")
def smol(smol_meta):
    """The SmolLM2 tokenizer alone (built from the GGUF metadata, no weights)."""
    return CheckpointTokenizer.from_gguf_metadata(smol_meta, "smollm2.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REF["prompts"]))
def test_smollm2_ids_match_reference(smol, name):
    p = REF["prompts"][name]
    assert smol.encode(p["text"]) == p["ids"]
    assert smol.decode(p["ids"], skip_special_tokens=False) == p["decoded"]


def test_smollm2_long_prompt_is_long(smol):
    assert len(smol.encode(REF["prompts"]["long800"]["text"])) == 800


@pytest.mark.parametrize("name", [n for n in REF["prompts"] if not n.startswith(("chat", "specials"))])
def test_smollm2_raw_round_trip(smol, name):
    text = REF["prompts"][name]["text"]
    assert smol.decode(smol.encode(text)) == text


@pytest.mark.parametrize("name", list(REF["chats"]))
def test_smollm2_chat_template_matches_transformers(smol, name):
    rendered = smol.apply_chat_template(REF["chats"][name], add_generation_prompt=True)
    assert rendered == REF["prompts"][name]["text"]
    assert rendered.endswith("<|im_start|>assistant\n")
    assert not smol.apply_chat_template(REF["chats"][name], add_generation_prompt=False).endswith(
        "assistant\n")


@pytest.mark.parametrize("messages,where", [
    ([{"rol": "user", "content": "x"}], "messages[0]"),
    ([{"role": "user", "content": "x"}, {"role": "", "content": "y"}], "messages[1]"),
    ([{"role": "user", "content": 3}], "messages[0]"),
    (["hi"], "messages[0]"), ([], "non-empty"), ("hi", "non-empty list")])
def test_chat_template_refuses_malformed_messages_as_input(smol, messages, where):
    """Bad messages are the caller's error (InputError naming the message), never the
    model file's (ModelLoadError, which a template failure used to raise)."""
    from jaxsample.errors import InputError

    with pytest.raises(InputError, match=re.escape(where)):
        smol.apply_chat_template(messages)


def test_smollm2_special_tokens(smol):
    assert smol.vocab_size == 49152
    assert smol.encode("<|im_start|>") == [1] and smol.encode("<|im_end|>") == [2]
    assert smol.encode("<|endoftext|>") == [0]
    assert smol.eos_token_ids == (2, 0)  # <|im_end|> (declared EOS), <|endoftext|>
    assert smol.pad_token_id == 2 and smol.bos_token_id == 1
    assert smol.add_bos is False  # the GGUF says tokenizer.ggml.add_bos_token = false
    assert smol.decode([1, 4093, 198, 6004, 2]) == "user\nhi"
    assert smol.decode([1, 4093, 198, 6004, 2], skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>")


def test_smollm2_digits_split_individually(smol):
    ids = smol.encode("2024")
    assert [smol.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_add_bos_flag_respected(smol_meta, smol):
    tok = CheckpointTokenizer.from_gguf_metadata(
        {**smol_meta, "tokenizer.ggml.add_bos_token": True}, "x.gguf")
    assert tok.encode("hi") == [1] + smol.encode("hi")
    assert tok.encode("<|im_start|>user")[:2] == [1, 4093]  # no double BOS


def test_unsupported_tokenizer_model(smol_meta):
    from jaxsample.errors import ModelLoadError, UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="x.gguf.*'t5'.*'gpt2'.*'llama'"):
        CheckpointTokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.model": "t5"}, "x.gguf")
    with pytest.raises(ModelLoadError, match="x.gguf.*scores"):  # SentencePiece needs its scores
        CheckpointTokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(UnsupportedModelError, match="pre"):
        CheckpointTokenizer.from_gguf_metadata({**smol_meta, "tokenizer.ggml.pre": "nope"}, "x.gguf")


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_llama3_untied"])
def test_tiny_hf_tokenizer_matches_transformers(name):
    tok = CheckpointTokenizer.from_hf_dir(DATA / name)
    for j, text in enumerate(TINY_TEXTS):
        assert tok.encode(text) == TINY[f"{name}/ids{j}"].tolist()
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids[0] == tok.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                  "<|im_start|>assistant\n")


def test_tiny_gguf_tokenizer_equals_its_tokenizer_json():
    gg = CheckpointTokenizer.from_gguf_metadata(read_gguf(DATA / "tiny_llama.gguf")[1], "tiny.gguf")
    hf = CheckpointTokenizer.from_hf_dir(DATA / "tiny_llama")
    assert gg.vocab_size == hf.vocab_size == 300
    for text in TINY_TEXTS + [p["text"] for p in REF["prompts"].values()]:
        assert gg.encode(text) == hf.encode(text)
    assert gg.eos_token_ids == hf.eos_token_ids and gg.pad_token_id == hf.pad_token_id
