"""What `run` is asked: prompts from flags, files, stdin or JSONL lines, checked against the model's context before any weight is read."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from jaxsample.cli import config as config_lib
from jaxsample.cli.console import unique_keys
from jaxsample.cli.parser import ADAPTIVE
from jaxsample.errors import ConfigError, InputError, lone_surrogate, short_repr
from jaxsample.sampling_params import FOREIGN_KEYWORDS

PROMPT_FILE_LIMIT = 64 * 2**20  # bytes; a larger prompt file is an error, never truncated


def read_shared_prefix(args) -> str | None:
    """The text of --shared-prefix or --shared-prefix-file, or None.

    Raises:
      InputError: as --prompt-file for the file, or an empty (blank) text.
    """
    if getattr(args, "shared_prefix", None) is not None:
        text, where = args.shared_prefix, "--shared-prefix"
    elif getattr(args, "shared_prefix_file", None) is not None:
        _check_stdin_read_once(args)
        name = args.shared_prefix_file
        where = "--shared-prefix-file: " + ("stdin" if name == "-" else name)
        text = _read_text(name, "stdin" if name == "-" else name, "--shared-prefix-file")
    else:
        return None
    if not text.strip():
        raise InputError(f"{where}: the shared prefix is empty")
    check_text(text, where, "the shared prefix")
    return text


_STDIN_NAMES = ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")


def _check_stdin_read_once(args) -> None:
    """InputError if --prompt-file and --shared-prefix-file both name stdin (the
    first would read it all and the second find it empty)."""
    if (getattr(args, "shared_prefix_file", None) in _STDIN_NAMES
            and getattr(args, "prompt_file", None) in _STDIN_NAMES):
        raise InputError("--prompt-file and --shared-prefix-file cannot both read stdin; "
                         "give one of them a file")


def _read_prompt(args) -> str:
    """The prompt text of --prompt or --prompt-file.

    --prompt-file reads any readable file as UTF-8: a regular file, a pipe
    (`<(echo hi)`), /dev/stdin, or stdin itself for "-".

    Raises:
      InputError: no such file, a directory, unreadable, not UTF-8, larger
        than PROMPT_FILE_LIMIT bytes, or an empty (blank) prompt.
    """
    if args.prompt is not None:
        prompt = args.prompt
        where = "--prompt"
    else:
        where = "stdin" if args.prompt_file == "-" else args.prompt_file
        prompt = _read_text(args.prompt_file, where)
    if not prompt.strip():
        raise InputError(f"the prompt is empty ({where})")
    check_text(prompt, where, "the prompt")
    return prompt


def check_text(value, where: str, what: str) -> None:
    """Every string in `value` (a string, or JSON lists and objects, keys included) is
    Unicode text: a lone surrogate (JSON's unpaired `"\\udfff"` escape, or bytes that
    are not UTF-8 in a command-line argument) cannot be tokenised or written back.

    Raises:
      InputError: naming `where`, the item (`what`, "messages[0].content", ...) and
        the surrogate's position.
    """
    if isinstance(value, str):
        at = lone_surrogate(value)
        if at is not None:
            raise InputError(f"{where}: {what} holds a lone surrogate ({value[at]!a} at "
                             f"character {at}), which is not Unicode text (an unpaired \\u "
                             "escape in JSON, or bytes that are not UTF-8)")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where, f"the key {k!a}" if lone_surrogate(k) is not None else k)
            check_text(v, where, k if what == "the line" else f"{what}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, where, f"{what}[{i}]")


def _read_text(name: str, where: str, flag: str = "--prompt-file") -> str:
    try:
        if name == "-":
            stream = getattr(sys.stdin, "buffer", sys.stdin)
            if stream is None:
                raise InputError(f"{flag}: -: there is no stdin to read")
            data = stream.read(PROMPT_FILE_LIMIT + 1)
        else:
            path = Path(name)
            if path.is_dir():
                raise InputError(f"{flag}: {path}: is a directory")
            with open(path, "rb") as f:
                data = f.read(PROMPT_FILE_LIMIT + 1)
    except FileNotFoundError:
        raise InputError(f"{flag}: {where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{flag}: {where}: is a directory") from None
    except PermissionError:
        raise InputError(f"{flag}: {where}: permission denied") from None
    except OSError as e:
        raise InputError(f"{flag}: {where}: cannot read: {e.strerror or e}") from None
    if len(data) > PROMPT_FILE_LIMIT:
        raise InputError(f"{flag}: {where}: larger than the {PROMPT_FILE_LIMIT // 2**20} MiB "
                         "limit for prompt files")
    if isinstance(data, str):  # a text stdin without a byte buffer (tests, embedding)
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{flag}: {where}: not UTF-8 text (invalid byte at offset "
                         f"{e.start})") from None


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt of a run.

    Attributes:
      index: its position in the run (0 for --prompt; the request's order in a
        .jsonl file, blank lines not counted).
      id: the "id" the .jsonl line gave (any JSON scalar), or None.
      prompt: the prompt text (None when `messages` is given).
      messages: a chat message list [{"role": ..., "content": ...}, ...], or None.
      sampling: the `SamplingParams` for this request (flags and config, then
        the line's own fields).
      where: the line ("F line 3") or the flag, for messages.
    """

    index: int
    id: Any
    prompt: str | None
    messages: list | None
    sampling: Any
    where: str


# SamplingParams fields a .jsonl line may set, with vLLM's max_tokens as an alias.
_ALIASES = {"max_tokens": "max_new_tokens"}


def _sampling_fields(cfg: config_lib.RunConfig) -> set[str]:
    return {f.name for f in dataclasses.fields(cfg.sampling)}


def read_requests(args, cfg: config_lib.RunConfig) -> list[Request]:
    """The run's requests: --prompt, a text --prompt-file, or a .jsonl --prompt-file.

    Raises:
      InputError: an unreadable or empty file or prompt; for .jsonl, a line
        that is not a JSON object, has neither or both of "prompt" and
        "messages", a malformed message list, an unknown key, or a sampling
        value SamplingParams refuses (each naming the line).
    """
    _check_stdin_read_once(args)
    if not is_jsonl(args):
        where = "--prompt" if args.prompt is not None else (
            "stdin" if args.prompt_file == "-" else args.prompt_file)
        return [Request(0, None, _read_prompt(args), None, cfg.sampling, where)]
    name = args.prompt_file
    where = "stdin" if name == "-" else name
    text = _read_text(name, where)
    fields = _sampling_fields(cfg)
    requests = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        at = f"--prompt-file: {where} line {lineno}"
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except ValueError as e:
            raise InputError(f"{at}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InputError(f"{at}: expected a JSON object like {{\"prompt\": \"...\"}}, got "
                             f"{type(obj).__name__}")
        check_text(obj, at, "the line")
        if ("prompt" in obj) == ("messages" in obj):
            raise InputError(f"{at}: give exactly one of \"prompt\" (a string) and "
                             "\"messages\" (a chat message list)")
        prompt, messages = obj.get("prompt"), obj.get("messages")
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise InputError(f"{at}: \"prompt\" must be a non-empty string")
        if "prompt" in obj and prompt is None:
            raise InputError(f"{at}: \"prompt\" must be a non-empty string")
        if "messages" in obj:
            ok = isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages)
            if not ok:
                raise InputError(f"{at}: \"messages\" must be a non-empty list of "
                                 "{\"role\": string, \"content\": string} objects")
        rid = obj.get("id")
        if not _json_id(rid):
            raise InputError(f"{at}: \"id\" must be a string, an integer or a finite number, "
                             f"got {short_repr(rid)}")
        overrides = {}
        for key, value in obj.items():
            if key in ("prompt", "messages", "id"):
                continue
            field = _ALIASES.get(key, key)
            if key in FOREIGN_KEYWORDS:
                raise InputError(f"{at}: {key}: {FOREIGN_KEYWORDS[key]}")
            if field not in fields:
                raise InputError(f"{at}: unknown key {key!r}; a line holds \"prompt\" or "
                                 f"\"messages\", optionally \"id\", and SamplingParams fields "
                                 f"{sorted(fields | set(_ALIASES))}")
            if field in overrides:
                raise InputError(f"{at}: {key!r} repeats {field!r}")
            overrides[field] = tuple(value) if isinstance(value, list) else value
        try:
            sampling = cfg.sampling.replace(**overrides) if overrides else cfg.sampling
        except (ConfigError, TypeError) as e:
            raise InputError(f"{at}: {e}") from None
        requests.append(Request(len(requests), rid, prompt, messages, sampling, at))
    if not requests:
        raise InputError(f"--prompt-file: {where}: no requests (every line is blank)")
    return requests


def _json_id(rid) -> bool:
    """A .jsonl "id" that `--json` can echo as given: null (none), a string, an integer or
    a finite number (JSON has no NaN or Infinity; Python's json reads `1e400` as inf)."""
    if rid is None or isinstance(rid, str):
        return True
    if isinstance(rid, bool):
        return False
    return isinstance(rid, int) or (isinstance(rid, float) and math.isfinite(rid))


def _prompt_tokens(tokenizer, r: Request, chat: bool, shared: str | None) -> int:
    """Tokens before the first new one: the rendered prompt, or the shared prefix
    and the prompt's own tokens (as `engine.inputs.encode_shared` splits them)."""
    if shared is None:
        return len(tokenizer.encode(render(tokenizer, r, chat)))
    from jaxsample.engine import inputs

    if chat:
        head = tokenizer.apply_chat_template([{"role": "system", "content": shared}],
                                             add_generation_prompt=False)
        turns = r.messages if r.messages is not None else [{"role": "user", "content": r.prompt}]
        full = tokenizer.apply_chat_template([{"role": "system", "content": shared}] + turns)
        own = full[len(head):] if full.startswith(head) else full
    else:
        head, own = shared, render(tokenizer, r, False)
    return len(tokenizer.encode(head)) + len(inputs.without_bos(tokenizer, tokenizer.encode(own)))


def check_requests(model_cfg, tokenizer, requests: list[Request], chat: bool,
                   shared: str | None = None) -> None:
    """Refuse what the context cannot hold, from the model's metadata and tokenizer,
    before any weight is read: a budget `max_new_tokens` plus one prompt token, then
    each rendered prompt's tokens (after the shared prefix, if any) plus the budget.

    Also refuses `logit_bias` token ids outside the vocabulary.

    Raises:
      InputError: naming the flag or the .jsonl line, the counts and the context.
    """
    ctx = model_cfg.max_seq_len
    vocab = min(int(tokenizer.vocab_size), model_cfg.vocab_size)  # `LanguageModel.vocab_limit`
    for r in requests:
        T = r.sampling.max_new_tokens
        line = " line " in r.where
        bad_bias = [i for i, _ in (r.sampling.logit_bias or ()) if i >= vocab]
        if bad_bias:  # what the engine refuses after the load (engine/session.py)
            what = r.where if line else "logit_bias"
            raise InputError(f"{what}: logit_bias has token ids outside the vocabulary "
                             f"[0, {vocab}): {bad_bias[:5]}")
        if T + 1 > ctx:
            what = r.where if line else "--max-new-tokens"
            raise InputError(f"{what}: max_new_tokens={T} plus at least one prompt token exceeds "
                             f"the model's context of {ctx} tokens (its metadata); use at most "
                             f"{ctx - 1}")
        n = _prompt_tokens(tokenizer, r, chat, shared)
        if n + T > ctx:
            what = f"{r.where}: " if line else ""
            whose = "--shared-prefix and the prompt have" if shared else "the prompt has"
            raise InputError(f"{what}{whose} {n} tokens; with max_new_tokens={T} that "
                             f"is {n + T} > the model's context of {ctx} tokens")


def check_kv_budget(model_cfg, tokenizer, requests: list[Request], chat: bool,
                    kv_budget: int) -> None:
    """--kv-budget against each call of consecutive equal-settings requests, from the
    model's metadata (`engine.budget.plan`, as the engine sizes the pool), before the
    out file is opened or a weight is read.

    Raises:
      InputError: naming --kv-budget, when one call cannot hold one pool row and slot.
    """
    from jaxsample.engine import budget
    from jaxsample.engine.buckets import bucket

    for group in group_requests(requests):
        sp = group[0].sampling
        p_cap = bucket(max(_prompt_tokens(tokenizer, r, chat, None) for r in group))
        try:
            budget.plan_params(model_cfg, sp, B=len(group), p_cap=p_cap, budget=kv_budget)
        except InputError as e:
            where = group[0].where if " line " in group[0].where else "--kv-budget"
            raise InputError(f"{where}: --kv-budget {str(e).replace('max_kv_bytes=', '')}") from None


def check_results(requests: list[Request], streamed: bool) -> None:
    """Each call's results against host memory (`engine.budget.check_results_fit`, as
    the engine checks them), before any weight is read: one request at a time when
    `streamed` (`--out` through `run_requests`), else each call of consecutive
    equal-settings requests (`group_requests`), whose results are held together.

    Raises:
      InputError: naming the line (or --n), with the numbers.
    """
    from jaxsample.engine import budget

    for group in ([[r] for r in requests] if streamed else group_requests(requests)):
        sp = group[0].sampling
        try:
            budget.check_results_fit(len(group), sp.n, sp.max_new_tokens, sp.logprobs or 0,
                                     sp.logprobs is not None, sp.signals)
        except InputError as e:
            where = group[0].where if " line " in group[0].where else "--n"
            raise InputError(f"{where}: {e}") from None


def check_adaptive(args) -> None:
    """The ranges `adaptive_self_consistency` checks, before the model loads.

    Raises:
      InputError: as `adaptive_self_consistency` (max_n, window, threshold, warmup).
    """
    def int_in(name, value, lo, hi):
        if not lo <= value <= hi:
            raise InputError(f"--{name.replace('_', '-')}: {name} must be an int in [{lo}, "
                             f"{hi}], got {value}")

    int_in("max_n", args.max_n, 1, 2**20)
    int_in("window", args.window, 1, args.max_n)
    if not 0.0 < args.threshold < 1.0:
        raise InputError(f"--threshold: threshold must be a float in (0, 1), got {args.threshold}")
    if ADAPTIVE[args.adaptive][1] is not None:  # DeepConf's warm-up: two windows
        int_in("max_n", args.max_n, 2 * args.window, 2**20)


def group_requests(requests: list[Request]) -> list[list[Request]]:
    """Consecutive requests with equal SamplingParams, each run as one call.

    Each call passes `prompt_index_offset` = the index of its first request, so
    a request draws the same branches as it would in one call of all requests.
    """
    out: list[list[Request]] = []
    for r in requests:
        if out and out[-1][-1].sampling == r.sampling:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def render(tokenizer, r: Request, chat: bool) -> str:
    """The text given to the model: a message list through the chat template, a
    prompt through it as one user turn when `chat`, else the prompt as is (what
    `generate(chat=...)` does; rendered here so that one call can mix both)."""
    if r.messages is not None:
        return tokenizer.apply_chat_template(r.messages)
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}])
    return r.prompt


def is_jsonl(args) -> bool:
    return args.prompt is None and (args.prompt_format == "jsonl" or (
        args.prompt_format == "auto" and args.prompt_file.lower().endswith(".jsonl")))
