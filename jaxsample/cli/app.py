"""The `jaxsample` command line: `run` (sample, vote, bill) and `price` (the cost model).

    jaxsample run --prompt "What is 3 + 4? Answer with a number." --n 16
    jaxsample run --prompt-file q.txt --config configs/best_of_n.yaml --json
    jaxsample run --prompt-file requests.jsonl --json        # one JSON line per request
    jaxsample price --model smollm2-135m --prompt-tokens 4096 --new-tokens 256 --n 1,4,16,64
    jaxsample cache info          # where the cache is, what it holds; `cache clear` empties it

`run` loads a model (`jaxsample.loading.load`), samples N branches that
share the prompt's KV cache (`jaxsample.engine.generate`), reduces them
(self-consistency vote, best-of-N or none) and prints the branches, the
result and the bill; `--json` prints exactly one JSON object instead (one
JSON line per request of a `.jsonl` prompt file: `read_requests`).
`price` prints the analytic cost table of `jaxsample.cost` (shared prefix
against N separate retries) from the model's config alone.

Before any weight is read, `run` checks the request against the model's
metadata and tokenizer (`loading.read_model`: the budget and each prompt
against the context), so bad input is refused in about a second. While it
works it reports on stderr (`jaxsample.progress`): loading, compiling and
decoding, as a rich bar on a terminal and as plain `jaxsample: ...` lines
otherwise; `--quiet` silences it; stdout carries only the result. `run`
turns on JAX's persistent compilation cache and the weight cache
(`jaxsample.disk_cache`, under `$JAXSAMPLE_CACHE_DIR` or
`$XDG_CACHE_HOME/jaxsample`), so a second run skips dequantising and
compiling; `--no-cache` or `JAXSAMPLE_NO_CACHE=1` turns both off.

Flags given explicitly override the `--config` file, which overrides the
defaults (`jaxsample.cli.config`). Bad input (unknown model, missing file, a
broken or impossible checkpoint, bad flag values, empty or too long prompt,
a malformed request line, unreadable config, a model whose logits are all
NaN) prints one line on stderr (`jaxsample: error: ...`; progress lines, if
any came before it, never contain "error:") and exits with status 2, never
a traceback: every `JaxsampleError` (`ModelLoadError`, `ConfigError`,
`InputError`, `NumericalError`) and any `ValueError`, `OSError` or
`OverflowError` maps to that.

`--json` output is strict JSON (`dumps`: no NaN or Infinity, a non-finite
value is null; a .jsonl "id" must be a string, an integer or a finite
number, echoed as given, else the line is refused), float32 figures written
as the shortest decimal that reads back as the same float32 (`_f32`).
`--max-tokens` is vLLM's name for `--max-new-tokens`; `--logprobs K` adds
per-token ids and logprobs (and the top K) to each branch of the JSON. When
the reader of stdout leaves (`| head -1`), the command stops quietly with
status 141 (128 + SIGPIPE), as a Unix filter killed by SIGPIPE does.

Flag values: integers are decimal (`1e3` and `1.5` are refused); `price
--n` takes comma-separated integers >= 1 without empty items (repeats are
dropped); `--prompt-tokens` / `--new-tokens` are integers >= 0; names and
paths (`--model`, `--config`, `--prompt-file`, `--plot`) must be non-empty.
`price --plot` writes exactly the file it reports (`.png` added to a name
without an extension) and needs matplotlib (`pip install 'jaxsample[plot]'`).

JAX is imported only when a model is needed, so `--help`, `--version` and
`price` with a named config answer immediately.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from jaxsample import disk_cache as cache_lib
from jaxsample.cli import config as config_lib
from jaxsample import cost
from jaxsample.errors import ConfigError, InputError, JaxsampleError, ModelLoadError, short_repr
from jaxsample.sampling_params import FOREIGN_KEYWORDS

EXIT_OK = 0
EXIT_USAGE = 2  # bad input of any kind (argparse's convention)

# Published shapes of a few Llama-family models, for `price` only (no weights
# needed). From each model's Hugging Face `config.json`.
PRICE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=264, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64, max_seq_len=512),
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         head_dim=64, ffn_dim=1536, max_seq_len=8192, rope_theta=100000.0),
    "smollm2-360m": dict(vocab_size=49152, dim=960, n_layers=32, n_heads=15, n_kv_heads=5,
                         head_dim=64, ffn_dim=2560, max_seq_len=8192, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         head_dim=64, ffn_dim=4864, max_seq_len=32768, rope_theta=1000000.0,
                         qkv_bias=True, arch="qwen2"),
    "llama-3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         head_dim=64, ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0),
    "llama-3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, ffn_dim=14336, max_seq_len=131072, rope_theta=500000.0,
                         tie_embeddings=False),
}
PRICE_PRESETS["smollm2-135m-instruct"] = PRICE_PRESETS["smollm2-135m"]


# ---------------------------------------------------------------------------
# Argument parsing


def _version_line() -> str:
    """'jaxsample 0.1.0 (jax 0.10.2, jaxlib 0.10.2)', without importing JAX."""
    import importlib.metadata

    from jaxsample import __version__

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"jaxsample {__version__} (jax {version('jax')}, jaxlib {version('jaxlib')})"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and no `sys.exit` surprises."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: {message} (see --help)")


class _UsageError(Exception):
    pass


def _int(text: str) -> int:
    """An integer flag value (ranges are checked where the value is used)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    return value


def _non_negative_int(text: str) -> int:
    """An integer >= 0 (token counts of `price`)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, e.g. "1,4,16"; repeats are dropped (first kept, order kept).

    Every item must be present ("1,,4", "1," and "" are refused) and be an
    integer (no "1.5", no "1e3").
    """
    example = "comma-separated integers >= 1 like 1,4,16"
    values = []
    for i, item in enumerate(text.split(",")):
        if not item.strip():
            raise argparse.ArgumentTypeError(
                f"item {i + 1} of {text!r} is empty; expected {example}")
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"item {i + 1} of {text!r} is {item.strip()!r}, not an integer; expected "
                f"{example}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(
                f"item {i + 1} of {text!r} is {value}; branch counts must be >= 1 ({example})")
        values.append(value)
    return list(dict.fromkeys(values))


def _non_empty(text: str) -> str:
    """A name or path flag: the empty string is refused (it would mean "not given")."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty value, got {text!r}")
    return text


# --adaptive NAME -> (stopping rule, DeepConf confidence filter)
ADAPTIVE = {"esc": ("esc", None), "beta": ("beta", None), "dirichlet": ("dirichlet", None),
            "deepconf-low": ("beta", "deepconf-low"), "deepconf-high": ("beta", "deepconf-high")}
ADAPTIVE_CHOICES = tuple(ADAPTIVE)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = _Parser(prog="jaxsample",
                     description="Parallel sampling from language models in JAX: one prompt, "
                                 "N branches sharing its KV cache, then a vote or best-of-N.")
    parser.add_argument("--version", action="version", version=_version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    run = sub.add_parser("run", help="sample N branches of one prompt, reduce, print the bill",
                         description="Sample N branches of one prompt sharing its KV cache, "
                                     "reduce them and print the branches, result and bill. "
                                     "Flags given explicitly override --config.")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="F", type=_non_empty,
                     help="read the prompt (UTF-8) from a file, a pipe or /dev/stdin; '-' is "
                          "stdin (a file named '-': ./-). A .jsonl file holds one request per "
                          "line: {\"prompt\": TEXT} or {\"messages\": [{\"role\": ..., "
                          "\"content\": ...}, ...]}, optional \"id\" and SamplingParams "
                          "fields (n, temperature, top_p, max_new_tokens or max_tokens, stop, "
                          "seed, ...) overriding the flags for that request; they run as one "
                          "batch (consecutive requests with equal settings share a call)")
    shared = run.add_mutually_exclusive_group()
    shared.add_argument("--shared-prefix", metavar="TEXT",
                        help="a context common to every prompt of the run (a few-shot block, a "
                             "document; with --chat, one system turn before each "
                             "conversation): prefilled and stored once for all prompts and "
                             "branches (generate(shared_prefix=...)); not with --adaptive")
    shared.add_argument("--shared-prefix-file", metavar="F", type=_non_empty,
                        help="read --shared-prefix (UTF-8) from a file ('-' is stdin)")
    run.add_argument("--prompt-format", choices=("auto", "text", "jsonl"), default="auto",
                     help="how to read --prompt-file: auto (jsonl for a name ending in .jsonl, "
                          "else one text prompt), text or jsonl")
    run.add_argument("--model", metavar="NAME_OR_PATH", type=_non_empty,
                     help="a model name or a .gguf file / Hugging Face directory "
                          "(default: the embedded SmolLM2-135M-Instruct)")
    run.add_argument("--config", metavar="YAML", type=_non_empty,
                     help="a run configuration (configs/NAME.yaml, or just NAME)")
    run.add_argument("--dtype", choices=config_lib.DTYPES, help="weights/activations dtype")
    # Sampling: None means "not given" so the config file's value stands.
    d = config_lib.DEFAULT_SAMPLING
    run.add_argument("--n", type=_int, help=f"branches N (default {d['n']})")
    run.add_argument("--temperature", type=float,
                     help=f"sampling temperature, 0 is greedy (default {d['temperature']})")
    run.add_argument("--top-p", type=float, help=f"nucleus mass in (0, 1] (default {d['top_p']})")
    run.add_argument("--top-k", type=_int, help=f"top-k, 0 is off (default {d['top_k']})")
    run.add_argument("--min-p", type=float, help=f"min-p in [0, 1] (default {d['min_p']})")
    run.add_argument("--max-new-tokens", type=_int,
                     help=f"decode budget per branch (default {d['max_new_tokens']})")
    run.add_argument("--max-tokens", dest="max_new_tokens", type=_int,
                     help="vLLM's name for --max-new-tokens")
    run.add_argument("--logprobs", type=_int, metavar="K",
                     help="K in [0, 20]: with --json, every branch also carries its token_ids "
                          "and each one's logprob, and (K >= 1) the K most likely token ids "
                          "and their logprobs at every position (vLLM's logprobs)")
    run.add_argument("--seed", type=_int, help=f"PRNG seed (default {d['seed']})")
    run.add_argument("--stop", action="append", metavar="TEXT",
                     help="a stop string (repeatable)")
    run.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="render the prompt with the model's chat template (default: on)")
    run.add_argument("--reduce", choices=config_lib.REDUCER_KINDS,
                     help="vote (self-consistency), best (best-of-N by mean logprob) or none "
                          "(default: vote)")
    run.add_argument("--select", metavar="SCORE", type=_score_name,
                     help="best-of-N by this score (implies --reduce best): "
                          + ", ".join(s.replace("_", "-") for s in config_lib.SCORES)
                          + "; all but the logprob ones record the selection signals "
                          "(self-certainty, arXiv 2502.18581; DeepConf's confidences, "
                          "arXiv 2508.15260)")
    run.add_argument("--extract", choices=config_lib.EXTRACT_KINDS,
                     help="answer extraction for the vote (default: number)")
    run.add_argument("--adaptive", choices=ADAPTIVE_CHOICES,
                     help="adaptive self-consistency: draw --window branches at a time over "
                          "one prefill and stop when the vote is settled: esc (a unanimous "
                          "window), beta / dirichlet (Adaptive-Consistency's posterior >= "
                          "--threshold), deepconf-low / deepconf-high (DeepConf's confidence "
                          "filter, stopping by the beta rule); --n is ignored")
    run.add_argument("--max-n", type=_int, default=64,
                     help="--adaptive: the most branches (default 64)")
    run.add_argument("--window", type=_int, default=8,
                     help="--adaptive: branches per round (default 8)")
    run.add_argument("--threshold", type=float, default=0.95,
                     help="--adaptive beta/dirichlet/deepconf: the posterior probability that "
                          "stops (default 0.95)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object (one JSON line per request of a .jsonl file)")
    run.add_argument("--no-cache", action="store_true",
                     help="neither read nor write the compilation and weight caches "
                          f"(also {cache_lib.ENV_OFF}=1; the directory is ${cache_lib.ENV_DIR}, "
                          "else $XDG_CACHE_HOME/jaxsample)")
    run.add_argument("-q", "--quiet", action="store_true",
                     help="no progress on stderr (loading, compiling, decoding)")

    price = sub.add_parser("price", help="the analytic cost table: shared prefix vs N retries",
                           description="Price N branches over one shared prompt against N "
                                       "separate retries, from the model's config alone.")
    price.add_argument("--model", metavar="NAME_OR_PATH", default=None, type=_non_empty,
                       help="a model name or path, or a preset: "
                            + ", ".join(sorted(PRICE_PRESETS)) + " (default: the embedded model)")
    price.add_argument("--prompt-tokens", type=_non_negative_int, default=4096, metavar="P",
                       help="prompt length P in tokens (default 4096)")
    price.add_argument("--new-tokens", type=_non_negative_int, default=256, metavar="T",
                       help="new tokens per branch T (default 256)")
    price.add_argument("--context-tokens", type=_non_negative_int, default=0, metavar="C",
                       help="tokens of a context common to all --prompts, prefilled and "
                            "stored once (three levels: generate(shared_prefix=...)); "
                            "--prompt-tokens is then each prompt's own (default 0: none)")
    price.add_argument("--prompts", type=_int, default=1, metavar="B",
                       help="prompts sharing the context, an integer >= 1 (default 1)")
    price.add_argument("--n", type=_int_list, default=[1, 4, 16, 64], metavar="N,N,...",
                       help="branch counts, integers >= 1; repeats are dropped "
                            "(default 1,4,16,64)")
    price.add_argument("--dtype", choices=config_lib.DTYPES,
                       help="bytes per weight/KV element (default: the model's dtype)")
    price.add_argument("--plot", metavar="FILE.png", type=_non_empty,
                       help="also plot the table to this file (.png added to a name without "
                            "an extension; .pdf, .svg, ... by their extension); needs "
                            "matplotlib: pip install 'jaxsample[plot]'")
    price.add_argument("--json", action="store_true", help="print one JSON object")
    _add_cache_parser(sub)
    return parser


# ---------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
      argv: the arguments (default `sys.argv[1:]`).
    Returns:
      The exit status: 0 on success, 2 on bad input (one line on stderr), 141
      (quietly) when the reader of stdout went away, 130 on Ctrl-C.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0)
        if args.command == "run":
            return _run(args)
        if args.command == "cache":
            return _cache_command(args)
        return _price(args)
    except BrokenPipeError:  # `jaxsample run ... | head -1`: the reader left
        return _broken_pipe()
    except (_UsageError, JaxsampleError, ValueError, OSError, OverflowError) as e:
        # OverflowError: a user value too large for a fixed-width type (int32,
        # float) that slipped past validation; still bad input, not a crash.
        _fail(e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxsample: interrupted", file=sys.stderr)
        return 130


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a filter killed by it


def _broken_pipe() -> int:
    """The reader of stdout (or stderr) went away (`| head -1`): stop quietly, as Unix
    filters do, with the status a filter killed by SIGPIPE has (141; `set -o pipefail`
    sees it, a plain pipeline does not). Both streams are pointed at /dev/null first,
    so neither this exit nor the interpreter's last flush prints "Broken pipe" (the
    recipe of the Python docs, "Note on SIGPIPE")."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (AttributeError, OSError, ValueError):  # not a real file (tests, embedding)
            pass
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _fail(e: BaseException) -> None:
    msg = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        msg = f"{e.filename}: {e.strerror}"
    msg = " ".join(msg.split())  # one line, whatever the message
    prog = "jaxsample"
    if isinstance(e, _UsageError):  # "jaxsample run: message"
        prog, _, msg = msg.partition(": ")
    print(f"{prog}: error: {msg}", file=sys.stderr)


# ---------------------------------------------------------------------------
# run


def resolve_run_config(args: argparse.Namespace) -> config_lib.RunConfig:
    """Defaults, then the --config file, then the flags given explicitly.

    Raises:
      ConfigError: an unreadable config file or a bad flag value (the same
        validation as `SamplingParams`).
    """
    cfg = config_lib.load_config(args.config) if args.config else config_lib.RunConfig()
    sampling = {name: getattr(args, name) for name in
                ("n", "temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed",
                 "logprobs")
                if getattr(args, name) is not None}
    if args.stop:
        sampling["stop"] = tuple(args.stop)
    if sampling:
        try:
            cfg = cfg.replace(sampling=cfg.sampling.replace(**sampling))
        except ConfigError as e:
            flag = str(e).split(".", 1)[-1].split(" ", 1)[0]
            raise ConfigError(f"--{flag.replace('_', '-')}: {e}") from None
    if args.model is not None or args.dtype is not None:
        cfg = cfg.replace(model=config_lib.ModelConfig(
            name=args.model if args.model is not None else cfg.model.name,
            dtype=args.dtype or cfg.model.dtype))
    if args.reduce is not None or args.extract is not None:
        cfg = cfg.replace(reducer=dataclasses.replace(
            cfg.reducer, kind=args.reduce or cfg.reducer.kind,
            extract=args.extract or cfg.reducer.extract))
    if getattr(args, "select", None) is not None:
        if args.reduce not in (None, "best"):
            raise ConfigError(f"--select picks the best branch; it cannot be combined with "
                              f"--reduce {args.reduce}")
        cfg = cfg.replace(reducer=dataclasses.replace(cfg.reducer, kind="best", score=args.select))
    if cfg.reducer.kind == "best" and cfg.reducer.score in config_lib.SIGNAL_SCORES:
        cfg = cfg.replace(sampling=cfg.sampling.replace(signals=True))
    if args.chat is not None:
        cfg = cfg.replace(chat=args.chat)
    return cfg


def _score_name(text: str) -> str:
    """--select: a score name, hyphens or underscores."""
    name = text.strip().replace("-", "_")
    name = "bottom_group_confidence" if name == "bottom_10_group_confidence" else name
    if name not in config_lib.SCORES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from "
            + ", ".join(s.replace("_", "-") for s in config_lib.SCORES) + ")")
    return name


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
    return prompt


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


# ---------------------------------------------------------------------------
# Requests: one prompt, or one per line of a .jsonl file


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
    if not _is_jsonl(args):
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
            obj = json.loads(line)
        except ValueError as e:
            raise InputError(f"{at}: not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise InputError(f"{at}: expected a JSON object like {{\"prompt\": \"...\"}}, got "
                             f"{type(obj).__name__}")
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
        return len(tokenizer.encode(_render(tokenizer, r, chat)))
    from jaxsample.engine import inputs

    if chat:
        head = tokenizer.apply_chat_template([{"role": "system", "content": shared}],
                                             add_generation_prompt=False)
        turns = r.messages if r.messages is not None else [{"role": "user", "content": r.prompt}]
        full = tokenizer.apply_chat_template([{"role": "system", "content": shared}] + turns)
        own = full[len(head):] if full.startswith(head) else full
    else:
        head, own = shared, _render(tokenizer, r, False)
    return len(tokenizer.encode(head)) + len(inputs.without_bos(tokenizer, tokenizer.encode(own)))


def check_requests(model_cfg, tokenizer, requests: list[Request], chat: bool,
                   shared: str | None = None) -> None:
    """Refuse what the context cannot hold, from the model's metadata and tokenizer,
    before any weight is read: a budget `max_new_tokens` plus one prompt token, then
    each rendered prompt's tokens (after the shared prefix, if any) plus the budget.

    Raises:
      InputError: naming the flag or the .jsonl line, the counts and the context.
    """
    ctx = model_cfg.max_seq_len
    for r in requests:
        T = r.sampling.max_new_tokens
        line = " line " in r.where
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


def _batches(requests: list[Request]) -> list[list[Request]]:
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


def _render(tokenizer, r: Request, chat: bool) -> str:
    """The text given to the model: a message list through the chat template, a
    prompt through it as one user turn when `chat`, else the prompt as is (what
    `generate(chat=...)` does; rendered here so that one call can mix both)."""
    if r.messages is not None:
        return tokenizer.apply_chat_template(r.messages)
    if chat:
        return tokenizer.apply_chat_template([{"role": "user", "content": r.prompt}])
    return r.prompt


def _load_model(name: str | None, dtype: str, *, use_cache: bool = True):
    from jaxsample import loading

    return loading.load(name, dtype=dtype, cache=None if use_cache else False)


def _make_mesh(mesh_cfg: config_lib.MeshConfig, n: int):
    """The ("data", "branch") mesh of the config, or None for one device."""
    if mesh_cfg.devices == 1:
        return None
    if n % mesh_cfg.branch:
        raise InputError(f"--n {n} must be a multiple of mesh.branch ({mesh_cfg.branch})")
    from jaxsample import sharding

    try:
        return sharding.make_mesh(branch=mesh_cfg.branch, data=mesh_cfg.data)
    except ValueError as e:
        raise InputError(f"mesh: {e}") from None


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _f32(x) -> float | None:
    """A float32-derived value for JSON: the Python float of the shortest decimal that
    rounds back to the same float32 (0.53333336, not float64's 0.5333333611488342), or
    None (JSON null) when it is not finite.

    numpy's Dragon4 (`format_float_scientific(unique=True)`) gives the shortest float32
    digits, at most 9 significant; the float64 nearest to them prints back (`repr`, what
    `json` writes) as exactly those digits, since two decimals of <= 9 digits are much
    farther apart than a float64 ulp.
    """
    import numpy as np

    x = np.float32(x)
    if not np.isfinite(x):
        return None
    return float(np.format_float_scientific(x, unique=True))


def _f32_list(a) -> list:
    """`_f32` of every element of a float32 array, as nested lists."""
    import numpy as np

    a = np.asarray(a, np.float32)
    if a.ndim == 0:
        return _f32(a)
    return [_f32_list(x) for x in a]


def _strict(value):
    """`value` with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def dumps(obj) -> str:
    """The one JSON writer of the command line: strict JSON (RFC 8259: no NaN or
    Infinity; a non-finite float that reaches it becomes null), UTF-8 text as is."""
    return json.dumps(_strict(obj), ensure_ascii=False, allow_nan=False)


def _model_header(cfg: config_lib.RunConfig, use_cache: bool):
    """(config, tokenizer) of the run's model, without its weights."""
    from jaxsample import loading

    return loading.read_model(cfg.model.name, cache=None if use_cache else False)


def _run(args) -> int:
    t_start = time.perf_counter()
    cfg = resolve_run_config(args)
    requests = read_requests(args, cfg)
    shared = read_shared_prefix(args)
    use_cache = not args.no_cache and not cache_lib.cache_disabled()
    if shared is not None and args.adaptive:
        raise InputError("--shared-prefix cannot be combined with --adaptive")
    if args.adaptive:
        if cfg.reducer.kind != "vote":
            raise InputError(f"--adaptive votes; it cannot be combined with --reduce "
                             f"{cfg.reducer.kind}")
        check_adaptive(args)
    for r in requests:
        _make_mesh(cfg.mesh, r.sampling.n)
    # Every check that needs the model, made on its metadata and tokenizer alone, so bad
    # input is refused before the weights load (and before any progress line).
    t0 = time.perf_counter()
    check_requests(*_model_header(cfg, use_cache), requests, cfg.chat, shared)
    t_meta = time.perf_counter() - t0  # reading the header counts as loading
    from jaxsample import loading
    from jaxsample.progress import Progress

    progress = None if args.quiet else Progress()
    if use_cache:
        cache_lib.enable_compilation_cache()
    what = cfg.model.name or "the embedded model"
    t0 = time.perf_counter()
    if progress is not None:
        with progress.phase(f"loading {what}") as ph:
            lm = _load_model(cfg.model.name, cfg.model.dtype, use_cache=use_cache)
            ph.cancel()
    else:
        lm = _load_model(cfg.model.name, cfg.model.dtype, use_cache=use_cache)
    # One figure, said twice: the header and tokenizer read first, then the weights.
    t_load = t_meta + time.perf_counter() - t0
    if progress is not None:
        info = loading.load_info(lm)
        how = ("dequantised weights from the cache" if info.get("weights") == "cache"
               else "dequantised; cached for the next run" if info.get("cache_entry")
               else "read from the checkpoint")
        progress.line(f"loaded {lm.name} in {t_load:.2f} s ({how})")
    outputs = []  # one per request: (request, batch index, gen, b, result, answers, adaptive)
    batches = _batches(requests)
    for k, batch in enumerate(batches):
        run_cfg = cfg.replace(sampling=batch[0].sampling)
        mesh = _make_mesh(cfg.mesh, run_cfg.sampling.n)
        texts = [_render(lm.tokenizer, r, cfg.chat) for r in batch]
        kwargs = {"chat": False, "prompt_index_offset": batch[0].index}
        if mesh is not None:
            kwargs["mesh"] = mesh
        t_batch = time.perf_counter()
        if args.adaptive:
            adaptive = _run_adaptive(lm, texts, run_cfg, args, kwargs, progress)
            gen = adaptive.generation
            per = [_adaptive_result(adaptive, b, args) for b in range(len(batch))]
        else:
            from jaxsample import engine

            adaptive = None
            if shared is not None:  # the prompts after the common context
                # With chat, generate renders [system turn] + each conversation itself.
                kwargs.update(chat=cfg.chat, shared_prefix=shared)
                texts = [(r.messages if r.messages is not None else r.prompt) if cfg.chat
                         else _render(lm.tokenizer, r, False) for r in batch]
            gen = engine.generate(lm, texts, run_cfg.sampling, progress=progress or False,
                                  **kwargs)
            sc = _vote(gen, cfg.reducer) if cfg.reducer.kind == "vote" else None
            per = [_reduce(gen, cfg.reducer, b, sc) for b in range(len(batch))]
        timings = {"load": t_load,
                   "compile": float(gen.timings.get("compile", 0.0)),
                   "prefill": float(gen.timings.get("prefill", 0.0)),
                   "decode": float(gen.timings.get("decode", 0.0)),
                   "total": time.perf_counter() - (t_start if k == 0 else t_batch)}
        for b, (r, (result, answers)) in enumerate(zip(batch, per)):
            outputs.append(dict(request=r, batch=k, gen=gen, b=b, result=result,
                                answers=answers, adaptive=adaptive, timings=timings,
                                cfg=run_cfg, requests=[x.index for x in batch]))
    if progress is not None:
        progress.close()
    single = not _is_jsonl(args)  # one prompt: one JSON object / one table, as ever
    if args.json:
        for out in outputs:
            print(dumps(_json_record(lm, cfg, out, single)))
        return EXIT_OK
    console = _stdout_console()
    for i, out in enumerate(outputs):
        last_of_batch = i + 1 == len(outputs) or outputs[i + 1]["batch"] != out["batch"]
        _print_run(console, lm, out, single, bill=last_of_batch,
                   batch_requests=None if single else out["requests"])
    return EXIT_OK


def _is_jsonl(args) -> bool:
    return args.prompt is None and (args.prompt_format == "jsonl" or (
        args.prompt_format == "auto" and args.prompt_file.lower().endswith(".jsonl")))


def _branches(out) -> list[dict]:
    gen, b, adaptive = out["gen"], out["b"], out["adaptive"]
    mean_lp = gen.mean_logprob()[b]
    shown = gen.n if adaptive is None else int(adaptive.n_used[b])
    answers = out["answers"]
    rows = [{"text": gen.texts[b][i], "answer": answers[i], "tokens": int(gen.lengths[b, i]),
             "mean_logprob": _f32(mean_lp[i]), "finish_reason": gen.finish_reason[b][i]}
            for i in range(shown)]
    k = getattr(gen.params, "logprobs", None)
    if k is None:
        return rows
    for i, row in enumerate(rows):  # --logprobs K (or a .jsonl line's "logprobs": K)
        L = row["tokens"]  # the kept tokens, a stop token included
        row["token_ids"] = [int(t) for t in gen.tokens[b, i, :L]]
        row["token_logprobs"] = _f32_list(gen.logprobs[b, i, :L])
        if k > 0 and gen.top_token_ids is not None:
            row["top_token_ids"] = [[int(t) for t in ids]
                                    for ids in gen.top_token_ids[b, i, :L, :k]]
            row["top_logprobs"] = _f32_list(gen.top_logprobs[b, i, :L, :k])
    return rows


def _json_result(result: dict) -> dict:
    """The result with its float32 figures (vote share and support, best-of-N score)
    written at float32 precision (`_f32`)."""
    return {k: _f32(v) if k in ("share", "support", "score") and isinstance(v, float) else v
            for k, v in result.items()}


def _json_record(lm, cfg, out, single: bool) -> dict:
    """The JSON object of one request (the documented schema of `run --json`)."""
    r, gen, b = out["request"], out["gen"], out["b"]
    params = out["cfg"].to_dict()["sampling"]
    params["seed"] = gen.params.seed
    record = {"model": lm.name, "prompt": r.prompt if r.messages is None else None,
              "params": {**params, "chat": cfg.chat,
                         "reducer": dataclasses.asdict(cfg.reducer)},
              "branches": _branches(out), "result": _json_result(out["result"]),
              "bill": gen.bill.to_dict(), "timings": out["timings"]}
    if single:
        return record
    lengths = gen.bill.decoded_tokens_per_branch[b]
    head = {"index": r.index, "id": r.id}
    if r.messages is not None:
        head["messages"] = r.messages
    record["usage"] = {"prompt_tokens": len(gen.prompt_tokens[b]),
                       "decoded_tokens": int(sum(lengths)),
                       "kept_tokens": int(gen.lengths[b].sum())}
    record["batch"] = {"index": out["batch"], "requests": out["requests"]}
    return {**head, **record}


def _run_adaptive(lm, prompts, cfg, args, kwargs, progress=None):
    """`jaxsample.adaptive_self_consistency` for `run --adaptive`."""
    from jaxsample.reduce import adaptive as adaptive_lib

    rule, confidence = ADAPTIVE[args.adaptive]
    ctx = (progress.phase("adaptive self-consistency: rounds of "
                          f"{args.window} branches, up to {args.max_n}")
           if progress is not None else contextlib.nullcontext())
    with ctx:
        return adaptive_lib.adaptive_self_consistency(
            lm, prompts, cfg.sampling, max_n=args.max_n, window=args.window, rule=rule,
            threshold=args.threshold, confidence=confidence, extract=cfg.reducer.extract,
            warmup=2 * args.window if confidence else 16, progress=progress or False,
            **kwargs)


def _adaptive_result(adaptive, b: int, args):
    counted = adaptive.counted[b]
    first = next((i for i, (a, c) in enumerate(zip(adaptive.answers[b], counted))
                  if c and a == adaptive.winner[b]), None)
    result = {"answer": adaptive.winner[b], "share": _finite(adaptive.share[b]),
              "support": _finite(adaptive.support[b]),  # the winner's (weighted) votes
              "branch": first, "n_used": int(adaptive.n_used[b]),
              "terminated": int(adaptive.terminated[b]), "adaptive": args.adaptive,
              "saving": adaptive.bill.to_dict()}
    return result, list(adaptive.answers[b])


def _vote(gen, reducer: config_lib.ReducerConfig):
    from jaxsample.reduce import vote as reducers

    return reducers.self_consistency(gen, extract=reducer.extract, weights=reducer.weights)


def _reduce(gen, reducer: config_lib.ReducerConfig, b: int = 0, sc=None):
    """The result ({"answer", "share", "branch"}) of prompt b and each branch's extracted
    answer; `sc` is the batch's `self_consistency` (computed here if None)."""
    import numpy as np

    from jaxsample.reduce import answers as answers_lib
    from jaxsample.reduce import vote as reducers

    texts = gen.texts[b]
    if reducer.kind == "vote":
        sc = _vote(gen, reducer) if sc is None else sc
        branch = int(sc.first_branch[b])
        result = {"answer": sc.winner[b], "share": _finite(sc.share[b]),
                  "support": _finite(sc.support[b]), "branch": branch if branch >= 0 else None}
        return result, list(sc.answers[b])

    def one(text):
        a = answers_lib.extract(text, reducer.extract)
        return (answers_lib.normalize(a) or None) if a is not None else None

    answers = [one(t) for t in texts]
    if reducer.kind == "best":
        scores = reducers.branch_scores(gen, reducer.score)
        # Prefer complete branches (ended by a stop): a branch cut at max_new_tokens
        # may carry a truncated answer. Without any complete branch, take them all.
        lengths = np.asarray(gen.lengths)[b:b + 1]
        complete = np.array([[r == "stop" for r in gen.finish_reason[b]]]) & (lengths > 0)
        valid = complete if complete.any() else lengths > 0
        idx = int(reducers.best_of_n(np.asarray(scores)[b:b + 1], valid)[0])
        if idx < 0:
            return {"answer": None, "share": None, "branch": None}, answers
        return {"answer": answers[idx], "share": None, "branch": idx,
                "score": _finite(scores[b, idx])}, answers
    return {"answer": None, "share": None, "branch": None}, answers


def _stdout_console(width: int | None = None):
    """A rich console on stdout: the terminal's width; into a pipe or file, $COLUMNS
    if set, else 120 columns."""
    import os

    from rich.console import Console

    if width is None and not sys.stdout.isatty():
        try:
            width = int(os.environ.get("COLUMNS", "")) or 120
        except ValueError:
            width = 120
    console = Console(file=sys.stdout, highlight=False, width=width)

    def on_broken_pipe():  # rich's own exits with status 1; main() ends as for --json
        raise BrokenPipeError(32, "Broken pipe")

    console.on_broken_pipe = on_broken_pipe
    return console


def _first_line(text: str, width: int = 60) -> str:
    """The first non-blank line, control characters shown as spaces, cut to `width`."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = "".join(c if c.isprintable() else " " for c in line)
    return line if len(line) <= width else line[:width - 1] + "…"


def branch_table(title: str, branches: list[dict], chosen: int | None, width: int):
    """The table of N branches, readable at `width` columns (>= 40).

    Columns, widest first to go: # | answer | tokens | finish | mean logprob |
    first line (what is left of the width, cut with an ellipsis). Below 72
    columns the headers shorten; below 60 "finish" goes, below 48 "mean
    logprob" too. Answers longer than 12 characters are cut with an ellipsis.
    """
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, expand=True,
                  title_justify="left")
    narrow = width < 72
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("answer", no_wrap=True, overflow="ellipsis", max_width=12)
    table.add_column("tok" if narrow else "tokens", justify="right", no_wrap=True)
    show_finish, show_lp = width >= 60, width >= 48
    if show_finish:
        table.add_column("finish", no_wrap=True)
    if show_lp:
        table.add_column("logprob" if narrow else "mean logprob", justify="right",
                         no_wrap=True)
    table.add_column("first line", no_wrap=True, overflow="ellipsis", ratio=1, min_width=8)
    for i, b in enumerate(branches):
        row = [str(i), str(b["answer"]) if b["answer"] is not None else "-", str(b["tokens"])]
        if show_finish:
            row.append(b["finish_reason"])
        if show_lp:
            row.append("n/a" if b["mean_logprob"] is None else f"{b['mean_logprob']:.3f}")
        row.append(_first_line(b["text"], 200))
        table.add_row(*row, style="bold" if i == chosen else None)
    return table


def _print_run(console, lm, out, single: bool, *, bill: bool = True, batch_requests=None):
    cfg, gen, result, timings = out["cfg"], out["gen"], out["result"], out["timings"]
    adaptive, r = out["adaptive"], out["request"]
    branches = _branches(out)
    p = cfg.sampling
    head = "" if single else f"request {r.index}" + (f" ({r.id})" if r.id is not None else "") + ": "
    title = (f"{head}{lm.name}: {len(branches)} branches (temperature {p.temperature}, "
             f"top-p {p.top_p}, top-k {p.top_k}, min-p {p.min_p}, seed {gen.params.seed})")
    console.print(branch_table(title, branches, result.get("branch"), console.width))
    kind = cfg.reducer.kind
    if kind == "vote":
        if result["answer"] is None:
            console.print("vote: no branch gave an answer "
                          f"(extract={cfg.reducer.extract})")
        else:
            answering = sum(b["answer"] is not None for b in branches)
            console.print(f"vote: [bold]{result['answer']}[/bold]  share {result['share']:.2f}  "
                          f"support {result['support']:g} of {answering} answering branches "
                          f"({len(branches)} sampled; first given by branch {result['branch']})")
    elif kind == "best":
        if result["branch"] is None:
            console.print("best-of-N: no valid branch")
        else:
            console.print(f"best-of-N by {cfg.reducer.score}: branch {result['branch']} "
                          f"(score {result['score']:.3f}), answer {result['answer']}")
            console.print(gen.texts[out["b"]][result["branch"]], markup=False)
    if "n_used" in result:
        console.print(f"adaptive ({result['adaptive']}): {result['n_used']} branches drawn, "
                      f"{result['terminated']} terminated", markup=False)
    if not bill:
        console.print()
        return
    which = "" if batch_requests is None else (
        f" (requests {batch_requests[0]}-{batch_requests[-1]}, one call)"
        if len(batch_requests) > 1 else f" (request {batch_requests[0]})")
    console.print(f"[bold]bill[/bold]{which}")
    console.print(gen.bill.summary(), markup=False)
    if adaptive is not None:
        console.print(adaptive.bill.summary(), markup=False)
    tokens = gen.bill.decoded_tokens_total
    rate = tokens / timings["decode"] if timings["decode"] > 0 else float("nan")
    console.print(f"timings: load {timings['load']:.2f} s, compile (first call) "
                  f"{timings['compile']:.2f} s, prefill {timings['prefill']:.3f} s, decode "
                  f"{timings['decode']:.2f} s ({rate:.0f} tokens/s over all branches), "
                  f"total {timings['total']:.2f} s (with tokenisation, reduction, imports)",
                  markup=False)
    if not single:
        console.print()


# ---------------------------------------------------------------------------
# price


def resolve_model_config(name: str | None):
    """A `LlamaConfig` for pricing, as cheaply as possible.

    Order: a preset name (`PRICE_PRESETS`); a config-only reader of
    `jaxsample.loading` if it offers one (no dequantisation); else the
    config of the fully loaded model.

    Raises:
      ModelLoadError / InputError: unknown name or unreadable checkpoint.
    """
    from jaxsample.models.llama import LlamaConfig

    from jaxsample import loading

    key = (name or _default_model_name()).lower()
    if key in PRICE_PRESETS:
        return LlamaConfig(**PRICE_PRESETS[key]), key

    for attr in ("load_config", "read_config", "model_config"):
        reader = getattr(loading, attr, None)
        if callable(reader):
            cfg = reader(name) if name is not None else reader()
            cfg = getattr(cfg, "config", cfg)
            if isinstance(cfg, LlamaConfig) or hasattr(cfg, "family"):  # any model family
                return cfg, name or "embedded"
    try:
        lm = loading.load(name) if name is not None else loading.load()
    except ModelLoadError as e:
        if name is not None and Path(name).expanduser().exists():
            raise  # a broken checkpoint: the presets are no answer to that
        raise ModelLoadError(f"{e}; price also knows the presets {sorted(PRICE_PRESETS)}") from e
    return lm.config, lm.name


def _default_model_name() -> str:
    try:
        from jaxsample.models.registry import DEFAULT_MODEL
    except ImportError:  # pragma: no cover - the registry ships with the package
        return "smollm2-135m-instruct"
    return DEFAULT_MODEL


def _short_flops(n: float) -> str:
    """2.5e12 -> '2.50T' (FLOPs, decimal prefixes), for narrow tables."""
    return cost.format_flops(n).replace(" ", "").replace("FLOP", "")


def _short_bytes(n: float) -> str:
    """1536 -> '1.5Ki' (bytes, binary prefixes), for narrow tables."""
    return cost.format_bytes(n).replace(" ", "").replace("B", "")


def _price(args) -> int:
    if any(n < 1 for n in args.n):
        raise InputError(f"--n: branch counts must be >= 1, got {args.n}")
    if args.prompt_tokens < 0 or args.new_tokens < 0:
        raise InputError("--prompt-tokens and --new-tokens must be >= 0")
    if args.prompts < 1:
        raise InputError(f"--prompts: the number of prompts must be >= 1, got {args.prompts}")
    plot = _plot_target(args.plot) if args.plot else None  # before any work: bad paths fail fast
    model_cfg, label = resolve_model_config(args.model)
    dtype_bytes = cost._DTYPE_BYTES[args.dtype or model_cfg.dtype]
    P, T = args.prompt_tokens, args.new_tokens
    C, B = args.context_tokens, args.prompts
    levels = dict(context_tokens=C, num_prompts=B)
    rows = cost.table(model_cfg, P, T, args.n, dtype_bytes=dtype_bytes, **levels)
    head = cost.estimate(model_cfg, P, T, 1, dtype_bytes=dtype_bytes, **levels)
    if plot is not None:
        _plot(rows, plot, f"{label}: P={P}, T={T}, {dtype_bytes} bytes per element")
    if args.json:
        out = {"model": label, "config": dataclasses.asdict(model_cfg),
               "prompt_tokens": P, "new_tokens": T, "dtype_bytes": dtype_bytes,
               "context_tokens": C, "num_prompts": B,
               "n_params": head.n_params, "weight_bytes": head.weight_bytes,
               "kv_bytes_per_token": head.kv_bytes_per_token,
               "fits_context": C + P + T <= model_cfg.max_seq_len,
               "rows": rows, "estimates": [cost.estimate(model_cfg, P, T, n, dtype_bytes,
                                                         **levels).to_dict() for n in args.n]}
        if plot is not None:
            out["plot"] = str(plot)
        print(dumps(out))
        return EXIT_OK

    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = _stdout_console()
    fb = cost.format_bytes
    console.print(f"{label}: {head.n_params / 1e6:.1f}M parameters, weights "
                  f"{fb(head.weight_bytes)}, KV {fb(head.kv_bytes_per_token)}/token "
                  f"({dtype_bytes} bytes per element); P={P} prompt tokens, T={T} new tokens "
                  "per branch", markup=False)
    if C or B > 1:
        console.print(f"{B} prompts of P={P} own tokens after a C={C}-token context common to "
                      "all: shared = the context once, each prompt once, N tails per prompt; "
                      f"separate = {B} x N retries of C + P tokens", markup=False)
    if C + P + T > model_cfg.max_seq_len:
        what = "C + P + T" if C else "P + T"
        console.print(f"note: {what} = {C + P + T} exceeds the model's context "
                      f"({model_cfg.max_seq_len} tokens)", markup=False)
    table = Table(title="shared prefix (this engine) vs N separate retries, batched",
                  caption="FLOPs with decimal prefixes, bytes with binary ones (Ki, Mi, Gi)",
                  box=box.SIMPLE_HEAD)
    for col in ("N", "prefill\nshared", "prefill\nseparate", "decode\n(both)",
                "read/step\nshared", "read/step\nseparate", "KV held\nshared",
                "KV held\nseparate", "KV\nsaving"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["n"]), _short_flops(r["prefill_flops_shared"]),
                      _short_flops(r["prefill_flops_separate"]), _short_flops(r["decode_flops"]),
                      _short_bytes(r["step_bytes_shared"]), _short_bytes(r["step_bytes_separate"]),
                      _short_bytes(r["kv_bytes_shared"]),
                      _short_bytes(r["kv_bytes_separate"]), f"{r['kv_saving']:.1f}x")
    console.print(table)
    if C:
        console.print(f"the context prefixed to each prompt instead (two levels): prefill "
                      f"{_short_flops(rows[0]['prefill_flops_two_level'])} against "
                      f"{_short_flops(rows[0]['prefill_flops_shared'])} "
                      f"({rows[0]['prefill_flops_two_level'] / max(rows[0]['prefill_flops_shared'], 1):.1f}x)",
                      markup=False)
    console.print("Prefix sharing saves prefill FLOPs and prefix KV memory and reads; decode "
                  "FLOPs are the same either way. read/step: bytes the last decode step reads "
                  "(weights once + KV). Counting conventions: jaxsample/cost.py.", markup=False)
    if plot is not None:
        console.print(f"plot written to {plot}", markup=False)
    return EXIT_OK


# ---------------------------------------------------------------------------
# cache


def _add_cache_parser(sub) -> None:
    """`jaxsample cache info|clear`: what the cache directory holds, and emptying it."""
    cache = sub.add_parser("cache", help="what the weight/compilation cache holds; clear it",
                           description="The cache directory ($JAXSAMPLE_CACHE_DIR, else "
                                       "$XDG_CACHE_HOME/jaxsample, else ~/.cache/jaxsample): "
                                       "dequantised weights, compiled programs and assembled "
                                       "checkpoints.")
    what = cache.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=_Parser)
    what.required = True
    info = what.add_parser("info", help="where the cache is and what it holds (sizes, ages)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    clear = what.add_parser("clear", help="delete the cache (all of it, or the parts named)",
                            description="Delete the cache's weights, compiled programs and "
                                        "assembled checkpoints; with flags, only those parts.")
    for part, text in (("weights", "the dequantised weights (weights/)"),
                       ("compiled", "the compiled programs (xla/)"),
                       ("models", "the assembled checkpoints (models/; re-assembled on the "
                                  "next load)")):
        clear.add_argument(f"--{part}", action="store_true", help=f"clear {text}")
    clear.add_argument("--json", action="store_true", help="print one JSON object")


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _cache_command(args) -> int:
    info = cache_lib.cache_info()
    if args.cache_command == "clear":
        parts = ([p for p in cache_lib.CLEAR_PARTS if getattr(args, p)]
                 or list(cache_lib.CLEAR_PARTS))
        freed = cache_lib.clear(parts)
        if args.json:
            print(dumps({"dir": info["dir"], "cleared": parts, "freed_bytes": freed}))
        else:
            print(f"cleared {', '.join(parts)} in {info['dir']}: {cost.format_bytes(freed)} freed")
        return EXIT_OK
    if args.json:
        print(dumps(info))
        return EXIT_OK
    fb = cost.format_bytes
    off = f" (off: {cache_lib.ENV_OFF} is set)" if info["disabled"] else ""
    print(f"cache directory: {info['dir']}{off}" + ("" if info["exists"] else " (empty)"))
    print(f"weights: {len(info['weights'])} entries, {fb(info['weights_bytes'])}")
    for w in info["weights"]:
        print(f"  {Path(w['file']).name}  {fb(w['bytes'])}  written {_age(w['age_s'])} ago  "
              f"from {w['source'] or '(unreadable entry)'}")
    print(f"compiled programs: {info['compiled_programs']}, {fb(info['compiled_bytes'])}")
    print(f"assembled checkpoints: {len(info['models'])}, {fb(info['models_bytes'])}")
    for m in info["models"]:
        print(f"  {Path(m['file']).name}  {fb(m['bytes'])}  written {_age(m['age_s'])} ago")
    print(f"total: {fb(info['total_bytes'])}")
    return EXIT_OK


PLOT_EXTRA = "pip install 'jaxsample[plot]'"


def _plot_target(text: str) -> Path:
    """The file `price --plot` writes, exactly as it will be reported.

    A name without an extension gets ".png"; an extension picks the format
    (png, pdf, svg, ... whatever matplotlib writes).

    Raises:
      InputError: matplotlib is not installed (naming the extra that brings
        it), the path is a directory (or ends with a slash), its directory
        does not exist, or matplotlib cannot write that extension.
    """
    import os

    try:
        import matplotlib
    except ImportError:
        raise InputError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None
    path = Path(text).expanduser()
    if text.endswith(("/", os.sep)) or path.is_dir():
        raise InputError(f"--plot: {text} is a directory; give a file name such as "
                         f"{path / 'price.png'}")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if not path.parent.is_dir():
        raise InputError(f"--plot: directory {path.parent} does not exist")
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise InputError(f"--plot: cannot write {path.suffix!r} files; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (or no extension "
                         "for .png)")
    return path


def _unit(values, kind: str) -> tuple[float, str]:
    """(divisor, unit) that puts the largest of `values` in [1, 1024) (bytes: KiB, MiB,
    GiB, TiB) or [1, 1000) (FLOPs: kFLOP ... PFLOP)."""
    top = max([abs(float(v)) for v in values] + [1.0])
    if kind == "bytes":
        units, base = ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0
    else:
        units, base = ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"), 1000.0
    k = 0
    while k + 1 < len(units) and top >= base ** (k + 1):
        k += 1
    return base ** k, units[k]


def _plot(rows, path: Path, title: str) -> None:
    """Three panels against N (log-log): KV cache held, bytes read by the last decode
    step, total FLOPs; shared prefix against separate retries. Each y axis is in one
    unit (MiB, GiB, GFLOP, ... chosen by its largest value); the N axis has a tick at
    each N priced and nowhere else."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ns = [r["n"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = [
        ("KV cache held", "kv_bytes_shared", "kv_bytes_separate", "bytes"),
        ("bytes read by the last decode step", "step_bytes_shared", "step_bytes_separate",
         "bytes"),
        ("total FLOPs (prefill + decode)", "total_flops_shared", "total_flops_separate",
         "flops"),
    ]
    for ax, (name, shared, separate, kind) in zip(axes, series):
        values = [r[shared] for r in rows] + [r[separate] for r in rows]
        div, unit = _unit(values, kind)
        ax.plot(ns, [r[shared] / div for r in rows], "o-", label="shared prefix")
        ax.plot(ns, [r[separate] / div for r in rows], "s--", label="separate retries")
        if len(ns) > 1:
            ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ns))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        positive = [v / div for v in values if v > 0]
        if positive and max(positive) / min(positive) > 10:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        ax.set_xlabel("branches N")
        ax.set_ylabel(unit)
        ax.set_title(f"{name} ({unit})", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120, format=path.suffix[1:].lower())
    finally:
        plt.close(fig)

