"""The request at the API boundary: prompts to token ids, and every check made
before any compute (so bad input loses nothing and never reaches the device)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jaxsample.errors import InputError
from jaxsample.lm import LanguageModel
from jaxsample.models.checkpoints.tokenizer import is_chat_message
from jaxsample.sharding import BRANCH_AXIS, DATA_AXIS


def token_ids(lm: LanguageModel, p, i: int, name: str | None = None) -> list[int]:
    """One prompt given as token ids -> list of ints in [0, vocab_limit), or InputError
    (naming `name`, default "prompt i")."""
    what = name or f"prompt {i}"
    arr = np.asarray(p, dtype=object) if not isinstance(p, np.ndarray) else p
    if arr.ndim != 1:
        raise InputError(f"{what}: token ids must be a flat sequence of ints, "
                         f"got shape {arr.shape}")
    bad = [t for t in arr.tolist() if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise InputError(f"{what}: token ids must be ints, got {bad[:3]!r}")
    toks = [int(t) for t in arr.tolist()]
    limit = lm.vocab_limit
    out = [t for t in toks if not 0 <= t < limit]
    if out:
        raise InputError(f"{what} has token ids outside the vocabulary [0, {limit}): {out[:5]}")
    return toks


CHAT_SHAPE = "a string or a list of {'role': ..., 'content': ...} dicts"


def _short(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _is_messages(p) -> bool:
    """A non-empty list/tuple whose items are all mappings (one conversation)."""
    return isinstance(p, (list, tuple)) and len(p) > 0 and all(isinstance(m, Mapping) for m in p)


def chat_messages(p, i: int, name: str | None = None) -> list[dict]:
    """One chat prompt -> its messages, or InputError saying what was expected.

    A string is one user turn; a list of `{"role": str, "content": str}`
    mappings (other keys are passed to the template as they are) is used as
    given, system and assistant turns included. Errors name `name` (default
    "prompt i").
    """
    what = name or f"prompt {i}"
    if isinstance(p, str):
        if not p.strip():
            raise InputError(f"{what} is empty")
        return [{"role": "user", "content": p}]
    if not _is_messages(p):
        got = "an empty list" if isinstance(p, (list, tuple)) and not p else _short(p)
        raise InputError(f"{what}: a chat prompt must be {CHAT_SHAPE}, got {got}")
    out = []
    for j, m in enumerate(p):
        if not is_chat_message(m):
            raise InputError(
                f"{what}, message {j}: a chat message must be a dict with a non-empty "
                f"string 'role' and a string 'content', got {_short(dict(m))}")
        out.append(dict(m))
    return out


def encode_prompts(lm: LanguageModel, prompts, chat: bool):
    """Prompts -> (B token-id lists, B rendered texts or None). Raises InputError.

    Without `chat`: B strings (as given) or B token-id sequences. With
    `chat`: B chat prompts (`chat_messages`: a string or a list of messages),
    rendered with `lm.tokenizer.apply_chat_template` (the generation prompt
    added); a single conversation (a list of messages) is one prompt.
    """
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2):
            raise InputError(f"prompts as an array must be [S] or [B, S] token ids, "
                             f"got shape {prompts.shape}")
        prompts = [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
        prompts = [list(prompts)]  # one prompt given as token ids
    elif chat and _is_messages(prompts):
        prompts = [prompts]  # one conversation
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise InputError("prompts must be a non-empty string, list of strings or list of "
                         f"token-id lists, got {type(prompts).__name__} {prompts!r:.80}")
    ids, texts = [], []
    for i, p in enumerate(prompts):
        if chat:
            text = lm.tokenizer.apply_chat_template(chat_messages(p, i))
            toks = list(lm.tokenizer.encode(text))
            texts.append(text)
        elif isinstance(p, str):
            if not p.strip():
                raise InputError(f"prompt {i} is empty")
            toks = list(lm.tokenizer.encode(p))
            texts.append(p)
        elif _is_messages(p):
            raise InputError(f"prompt {i} is a list of chat messages: pass chat=True to render "
                             "it with the model's chat template")
        elif isinstance(p, (list, tuple, np.ndarray)):
            toks = token_ids(lm, p, i)
            texts.append(None)
        else:
            raise InputError(f"prompt {i} must be a string or a list of token ids, "
                             f"got {type(p).__name__}")
        if not toks:
            raise InputError(f"prompt {i} is empty (0 tokens)")
        ids.append(toks)
    return ids, texts


def without_bos(tokenizer, ids: list[int]) -> list[int]:
    """A prompt's own ids after a shared prefix: without the BOS the tokenizer may
    prepend (the BOS, if any, starts the shared prefix)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
        return ids[1:]
    return ids


SHARED_SHAPE = ("a non-empty string or list of token ids (with chat=True: a string, one "
                "system turn, or a list of {'role': ..., 'content': ...} messages)")


def encode_shared(lm: LanguageModel, shared_prefix, prompts, chat: bool):
    """A context common to all prompts and the prompts' own suffixes.

    Without `chat`: `shared_prefix` is a string (tokenised alone, with the BOS
    the tokenizer adds) or token ids; each prompt is tokenised alone (a string,
    without a BOS) or given as ids, and the model sees `context ids + prompt
    ids`. With `chat`: `shared_prefix` is the conversation's common first turns
    (a list of messages, or a string: one system turn); each prompt's own
    messages follow them, the whole conversation is rendered with the chat
    template, and the context is the rendering of the common turns alone
    (`add_generation_prompt=False`), which must be where every rendering
    starts.

    Returns:
      (context ids `[C]` list, B suffix id lists, B prompt texts (the full
      rendering with chat) or None for id prompts).
    Raises:
      InputError: an empty or malformed `shared_prefix`, a bad prompt, or a
        chat template that does not render the common turns as a prefix.
    """
    sp = shared_prefix
    if isinstance(sp, np.ndarray):
        sp = sp.tolist()
    if isinstance(sp, str):
        if not sp.strip():
            raise InputError("shared_prefix is empty")
    elif isinstance(sp, (list, tuple)):
        if not sp:
            raise InputError("shared_prefix is empty (0 tokens)")
    else:
        raise InputError(f"shared_prefix must be {SHARED_SHAPE}, got {_short(sp)}")
    tok = lm.tokenizer
    if not chat:
        if _is_messages(sp):
            raise InputError("shared_prefix is a list of chat messages: pass chat=True to "
                             "render it with the model's chat template")
        context = (list(tok.encode(sp)) if isinstance(sp, str)
                   else token_ids(lm, sp, 0, name="shared_prefix"))
        ids, texts = encode_prompts(lm, prompts, chat=False)
        ids = [without_bos(tok, x) if isinstance(t, str) else x for x, t in zip(ids, texts)]
        for i, x in enumerate(ids):
            if not x:
                raise InputError(f"prompt {i} is empty (0 tokens after the shared prefix)")
        return context, ids, texts
    if isinstance(sp, str):
        common = [{"role": "system", "content": sp}]
    elif _is_messages(sp):
        common = chat_messages(sp, 0, name="shared_prefix")
    else:
        raise InputError(f"with chat=True, shared_prefix must be a string (one system turn) or "
                         f"a list of {{'role': ..., 'content': ...}} messages, got {_short(sp)}")
    head = tok.apply_chat_template(common, add_generation_prompt=False)
    if isinstance(prompts, str) or (_is_messages(prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError(f"prompts must be a non-empty list of chat prompts ({CHAT_SHAPE}), "
                         f"got {_short(prompts)}")
    ids, texts = [], []
    for i, p in enumerate(prompts):
        full = tok.apply_chat_template(common + chat_messages(p, i))
        if not full.startswith(head):
            raise InputError(f"prompt {i}: the chat template does not render the shared_prefix "
                             "turns as the start of the conversation; pass the whole "
                             "conversations as prompts without shared_prefix")
        x = without_bos(tok, list(tok.encode(full[len(head):])))
        if not x:
            raise InputError(f"prompt {i} is empty (0 tokens after the shared prefix)")
        ids.append(x)
        texts.append(full)
    return list(tok.encode(head)), ids, texts


def resolve_mesh(mesh, N: int):
    """(mesh, data axis name or None, branch axis size, data axis size). Raises InputError."""
    if mesh is None:
        return None, None, 1, 1
    import jax

    if not isinstance(mesh, jax.sharding.Mesh):
        raise InputError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if BRANCH_AXIS not in names:
        raise InputError(f"mesh must have a {BRANCH_AXIS!r} axis, got axes {names}")
    extra = [a for a in names if a not in (BRANCH_AXIS, DATA_AXIS)]
    if extra:
        raise InputError(f"mesh axes must be among ({DATA_AXIS!r}, {BRANCH_AXIS!r}), got {names}")
    nb = mesh.shape[BRANCH_AXIS]
    nd = mesh.shape[DATA_AXIS] if DATA_AXIS in names else 1
    if N % nb:
        raise InputError(f"params.n ({N}) must be a multiple of the mesh's {BRANCH_AXIS!r} "
                         f"axis size ({nb})")
    return mesh, (DATA_AXIS if DATA_AXIS in names else None), nb, nd


def check_int(name: str, value, lo: int, hi: int) -> int:
    """An int argument in [lo, hi], or InputError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise InputError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)
