"""The checkpoint's own tokenizer, built with the `tokenizers` package.

Two sources:

* a GGUF file's `tokenizer.*` metadata (`tokenizer.ggml.tokens`, `merges`,
  `scores`, `token_type`, the special-token ids, `add_bos_token`,
  `add_space_prefix` and `tokenizer.chat_template`): byte-level BPE
  (`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer named by
  `tokenizer.ggml.pre`, mirroring llama.cpp's `llama-vocab.cpp` (e.g.
  `smollm` splits every digit, then the GPT-2 regex), or SentencePiece BPE
  with byte fallback (`"llama"`: Llama 2, Mistral, Gemma), built as
  transformers builds these files' tokenizers;
* a Hugging Face directory's `tokenizer.json` (+ `tokenizer_config.json` for
  the chat template, the special tokens and `add_bos_token`, and
  `generation_config.json` for extra stop ids).

Chat templates are rendered with jinja2 the way `transformers` does
(sandboxed, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`),
as untrusted code within bounds of time, size and recursion
(`models/checkpoints/chat_template.py`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from jaxsample.errors import InputError, ModelLoadError, UnsupportedModelError, lone_surrogate
from jaxsample.models.checkpoints import chat_template as template_lib
from jaxsample.models.checkpoints import checks

# llama.cpp token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Tokens that end a turn or a text in the families we load; each one present
# in the vocabulary as a special token is a default stop id.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
               "</s>", "<|end|>", "<end_of_turn>", "<eos>")

# Gemma's turn format, for Gemma GGUF files that carry no tokenizer.chat_template
# (the pretrained 270M file does not): `<bos>`, then per message
# `<start_of_turn>{user|model}\n{content, stripped}<end_of_turn>\n`, a system
# message folded into the first user turn followed by a blank line, roles
# alternating from the user, and `<start_of_turn>model\n` to ask for a reply.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + (m['content'] | trim) }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (pre-tokenizer factory, normalizer factory or None)
_PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt2", "default", "mpt", "olmo", "jais"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r"), "digits+gpt2"),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"), "llama3"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), "qwen2"),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pre_tokenizer(kind: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[kind]
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"), byte_level])


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], source: str):
    """(tokenizer, vocab) for `tokenizer.ggml.model == "gpt2"` (without added tokens)."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    kind = _PRE_TOKENIZERS.get(pre)
    if kind is None:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.pre = {pre!r} is not supported; known: "
            f"{sorted(_PRE_TOKENIZERS)}")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"{source}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alphabet:  # respell raw UTF-8 into the byte alphabet
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    try:
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, ignore_merges=(kind == "llama3"))
    except Exception as e:  # noqa: BLE001  (tokenizers raises bare Exceptions)
        raise ModelLoadError(f"{source}: inconsistent BPE vocabulary/merges: {e}") from e
    tok = tokenizers.Tokenizer(bpe)
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(kind)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


def sentencepiece_merges(vocab: Mapping[str, int], priority: Mapping[str, float]):
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every split of a token into two vocabulary pieces is a merge ranked by the
    token's priority (higher first; ties: longer left piece, then longer right
    piece; then the pieces' ids). The rule of transformers'
    `tokenization_utils_base.generate_merges`, which builds the reference
    tokenizers of SentencePiece GGUF files (llama.cpp's `llm_tokenizer_spm`
    merges the adjacent pair whose union has the best score, the same order).

    Args:
      vocab: token -> id.
      priority: token -> rank key, in the vocabulary's order (its score, or
        minus its id where the scores do not follow the merge order).
    Returns:
      A list of (left, right) pairs.
    """
    merges = []
    for merged, score in priority.items():
        local = []
        for i in range(1, len(merged)):
            left, right = merged[:i], merged[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], source: str):
    """(tokenizer, vocab) for `tokenizer.ggml.model == "llama"` (without added tokens).

    SentencePiece BPE with byte fallback (`<0x00>`..`<0xFF>` tokens), spaces
    written as U+2581 "▁", built the way transformers builds these files'
    reference tokenizers (`integrations/gguf/gguf_tokenizer_mapping.py`):

    * Gemma (`general.architecture` gemma*): no prefix space, a
      `Replace(" ", "▁")` normalizer; tokens made only of spaces are stored
      as real spaces and are respelled as "▁" runs; merges are ranked by
      token id (Gemma's scores do not follow its merge order);
    * others (Llama 2, Mistral): a `Metaspace` pre-tokenizer that prefixes
      "▁" to the start of the text when `tokenizer.ggml.add_space_prefix` is
      true (the default), and merges ranked by score; decoding strips that
      prefix again.
    """
    scores = meta.get("tokenizer.ggml.scores")
    arch = str(meta.get("general.architecture", ""))
    gemma = arch.startswith("gemma")
    if scores is None and not gemma:
        raise ModelLoadError(f"{source}: SentencePiece vocabulary without tokenizer.ggml.scores")
    if scores is not None and len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: {len(tokens)} tokens but {len(scores)} scores")
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        priority = {t: -i for i, t in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, (float(x) for x in scores)))
    vocab = {t: i for i, t in enumerate(tokens)}
    n = len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = None if unk_id is None else tokens[checks.token_id(
        unk_id, n, f"{source}: tokenizer.ggml.unknown_token_id")]
    try:
        bpe = models.BPE(vocab=vocab, merges=sentencepiece_merges(vocab, priority), unk_token=unk,
                         fuse_unk=True, byte_fallback=True)
    except Exception as e:  # noqa: BLE001  (tokenizers raises bare Exceptions)
        raise ModelLoadError(f"{source}: inconsistent SentencePiece vocabulary: {e}") from e
    tok = tokenizers.Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", not gemma))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma and not prefix:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok, vocab


def is_chat_message(m) -> bool:
    """Whether `m` is one chat message as the templates take it: a mapping with a
    non-empty string "role" and a string "content" (other keys pass through)."""
    return (isinstance(m, Mapping) and isinstance(m.get("role"), str) and bool(m["role"])
            and isinstance(m.get("content"), str))


class CheckpointTokenizer:
    """A checkpoint's tokenizer; satisfies `jaxsample.lm.Tokenizer`.

    Attributes:
      vocab_size: number of token ids (base vocabulary and added tokens).
      bos_token_id: the beginning-of-sequence id, or None.
      eos_token_ids: default stop ids (end-of-turn and end-of-text), in order
        of preference; the first is the checkpoint's declared EOS.
      pad_token_id: the padding id (the checkpoint's, else the first stop id).
      add_bos: `encode` prepends `bos_token_id` (GGUF `add_bos_token`, or
        the Hugging Face post-processor's own rule).
      chat_template: the checkpoint's jinja2 chat template, or None.
      source: the file or directory the tokenizer came from (for messages).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], pad_token_id: int | None, add_bos: bool,
                 chat_template: str | None, source: str, use_post_processor: bool = False):
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if not self.eos_token_ids:
            raise ModelLoadError(f"{source}: the tokenizer declares no end-of-sequence token")
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else self.eos_token_ids[0]
        specials = [("bos_token_id", bos_token_id), ("pad_token_id", self.pad_token_id)]
        for name, i in specials + [("eos_token_ids", i) for i in self.eos_token_ids]:
            if i is not None:
                checks.token_id(i, self.vocab_size, f"{source}: {name}")
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.chat_template = chat_template
        self.source = source
        self._use_post_processor = use_post_processor
        self._template = None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._tok.id_to_token(self.eos_token_ids[0])

    # -- the Tokenizer protocol ------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text -> token ids; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.

        A BOS is prepended when the checkpoint asks for one (and the text
        does not already start with it, e.g. from a chat template).

        Raises:
          InputError: `text` is not a string, or holds a lone surrogate (not
            Unicode text: `tokenizers` cannot take it).
        """
        if not isinstance(text, str):
            raise InputError(f"encode: text must be a string, got {type(text).__name__}")
        at = lone_surrogate(text)
        if at is not None:
            raise InputError(f"encode: the text holds a lone surrogate ({text[at]!a} at "
                             f"character {at}), which is not Unicode text")
        ids = self._tok.encode(text, add_special_tokens=self._use_post_processor).ids
        if self.add_bos and not self._use_post_processor and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text (byte-level pieces joined, invalid UTF-8 replaced by U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the checkpoint's template.

        Raises:
          InputError: `messages` is not a non-empty list of dicts, each with a
            non-empty string "role" and a string "content" (the message names
            the first that is not).
          ModelLoadError: the checkpoint has no chat template, or the template
            fails to compile or render, or goes past a bound of
            `chat_template` (time, size, recursion): the message names the
            source and what went wrong.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InputError(f"apply_chat_template: messages must be a non-empty list of "
                             f"{{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
                             f"{'' if messages else ' (empty)'}")
        for j, m in enumerate(messages):
            if not is_chat_message(m):
                raise InputError(f"apply_chat_template: messages[{j}] must be a dict with a "
                                 f"non-empty string 'role' and a string 'content', got "
                                 f"{str(m)[:80]}")
        if self.chat_template is None:
            raise ModelLoadError(f"{self.source}: the checkpoint has no chat template; "
                                 "pass raw prompts instead of messages")
        try:
            if self._template is None:
                self._template = template_lib.compile_template(self.chat_template)
            return template_lib.render(
                self._template, messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token)
        except template_lib.TemplateFailure as e:
            raise ModelLoadError(f"{self.source}: its chat template failed: {e}") from None

    def __repr__(self):
        return (f"CheckpointTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, pad={self.pad_token_id}, add_bos={self.add_bos}, "
                f"source={self.source!r})")

    # -- constructors ----------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str) -> "CheckpointTokenizer":
        """Build from a GGUF file's metadata.

        Two vocabularies (`tokenizer.ggml.model`):

        * `"gpt2"`: byte-level BPE with `tokenizer.ggml.merges` and the
          pre-tokenizer named by `tokenizer.ggml.pre`;
        * `"llama"`: SentencePiece BPE with byte fallback (Llama 2, Mistral,
          Gemma): tokens and scores, no merges; see `_sentencepiece_bpe`.

        Args:
          meta: key -> Python value for the file's `tokenizer.*` keys
            (`tokenizer.ggml.tokens` a list of str, `merges` a list of
            "left right" str, `scores` a list of float, `token_type` a list of
            int, ids as int) and `general.architecture`.
          source: the file, for messages.
        Raises:
          ModelLoadError: the vocabulary is missing or inconsistent, or a special
            token id (any `tokenizer.ggml.*_token_id`) is outside it (naming the key).
          UnsupportedModelError: a tokenizer model or pre-tokenizer we do not
            implement (only `"gpt2"` and `"llama"`).
        """
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens (the file carries no vocabulary)")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"{source}: tokenizer.ggml.model = {model!r}; only byte-level BPE ('gpt2') and "
                "SentencePiece BPE ('llama') are supported (load the Hugging Face directory with "
                "its tokenizer.json instead)")
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: {len(tokens)} tokens but {len(types)} token types")
        if model == "gpt2":
            tok, vocab = _byte_level_bpe(meta, tokens, source)
            add_bos_default = False
        else:
            tok, vocab = _sentencepiece_bpe(meta, tokens, source)
            add_bos_default = True  # llama.cpp and transformers: SentencePiece files add BOS unless told
        added = []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (_CONTROL, _USER_DEFINED) and vocab.get(t) == i:
                added.append(tokenizers.AddedToken(t, special=(ty == _CONTROL), normalized=False))
        tok.add_special_tokens([a for a in added if a.special])
        tok.add_tokens([a for a in added if not a.special])

        n = len(tokens)
        for key in sorted(meta):  # every special token id, used here or not
            if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
                checks.token_id(meta[key], n, f"{source}: {key}")

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)

        bos, eos, pad = tid("bos_token_id"), tid("eos_token_id"), tid("padding_token_id")
        stops = [i for i in (eos, tid("eot_token_id"), tid("eom_token_id")) if i is not None]
        specials = {t for t, ty in zip(tokens, types) if ty == _CONTROL}
        stops += [tok.token_to_id(t) for t in _END_TOKENS if t in specials]
        template = meta.get("tokenizer.chat_template")
        if template is None and {"<start_of_turn>", "<end_of_turn>"} <= specials and str(
                meta.get("general.architecture", "")).startswith("gemma"):
            template = GEMMA_CHAT_TEMPLATE
        return cls(tok, bos_token_id=bos, eos_token_ids=stops, pad_token_id=pad,
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   chat_template=template, source=source)

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> "CheckpointTokenizer":
        """Build from a Hugging Face directory (tokenizer.json + tokenizer_config.json).

        Raises:
          ModelLoadError: tokenizer.json is missing or unreadable, a special
            token named in tokenizer_config.json is not in it, or a special token
            id of config.json / generation_config.json is outside it (naming the
            file and key).
        """
        path = pathlib.Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (needed to build the tokenizer)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{tj}: cannot read tokenizer: {e}") from e
        cfg = _read_json(path / "tokenizer_config.json") or {}
        gen = _read_json(path / "generation_config.json") or {}
        model_cfg = _read_json(path / "config.json") or {}

        def token_id(key):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if v is None:
                return None
            i = tok.token_to_id(v)
            if i is None:
                raise ModelLoadError(f"{path / 'tokenizer_config.json'}: {key} {v!r} is not in tokenizer.json")
            return i

        n = int(tok.get_vocab_size(with_added_tokens=True))

        def ids(cfg_, name, key):
            v = cfg_.get(key)
            return [] if v is None else [checks.token_id(x, n, f"{path / name}: {key}")
                                         for x in (v if isinstance(v, list) else [v])]

        bos = token_id("bos_token")
        if bos is None and model_cfg.get("bos_token_id") is not None:
            bos = (ids(model_cfg, "config.json", "bos_token_id") or [None])[0]
        eos = token_id("eos_token")
        stops = ([eos] if eos is not None else []) + ids(
            gen, "generation_config.json", "eos_token_id") + ids(model_cfg, "config.json",
                                                                 "eos_token_id")
        specials = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
        stops += [tok.token_to_id(t) for t in _END_TOKENS if t in specials]
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(tok, bos_token_id=bos, eos_token_ids=stops, pad_token_id=token_id("pad_token"),
                   add_bos=bool(cfg.get("add_bos_token", False)), chat_template=template,
                   source=str(path), use_post_processor=True)


def _read_json(path: pathlib.Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


class ByteTokenizer:
    """A toy byte-level tokenizer for random-weight models (tests, benchmarks, demos).

    Ids 0-255 are UTF-8 bytes; other ids decode to nothing. It satisfies the
    `jaxsample.lm.Tokenizer` protocol, so the engine can run a random model
    without a checkpoint's vocabulary.

    Args:
      vocab_size: real token ids (logits rows past it are never sampled).
      eos_token_ids: stop ids (default: none, so branches run to max_new_tokens).
      pad_token_id: the id written after a branch stops.
    """

    bos_token_id = None

    def __init__(self, vocab_size: int = 258, eos_token_ids: tuple[int, ...] = (),
                 pad_token_id: int = 0):
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = int(pad_token_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        body = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")
