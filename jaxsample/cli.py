"""The `jaxsample` command line: `run` (sample, vote, bill) and `price` (the cost model).

    jaxsample run --prompt "What is 3 + 4? Answer with a number." --n 16
    jaxsample run --prompt-file q.txt --config configs/best_of_n.yaml --json
    jaxsample price --model smollm2-135m --prompt-tokens 4096 --new-tokens 256 --n 1,4,16,64

`run` loads a model (`jaxsample.loading.load`), samples N branches that
share the prompt's KV cache (`jaxsample.engine.generate`), reduces them
(self-consistency vote, best-of-N or none) and prints the branches, the
result and the bill; `--json` prints exactly one JSON object instead.
`price` prints the analytic cost table of `jaxsample.cost` (shared prefix
against N separate retries) from the model's config alone.

Flags given explicitly override the `--config` file, which overrides the
defaults (`jaxsample.config`). Bad input (unknown model, missing file, a
broken or impossible checkpoint, bad flag values, empty or too long prompt,
unreadable config, a model whose logits are all NaN) prints one line on
stderr and exits with status 2, never a traceback: every `JaxsampleError`
(`ModelLoadError`, `ConfigError`, `InputError`, `NumericalError`) and any
`ValueError`, `OSError` or `OverflowError` maps to that.

Flag values: integers are decimal (`1e3` and `1.5` are refused); `price
--n` takes comma-separated integers >= 1 without empty items (repeats are
dropped); `--prompt-tokens` / `--new-tokens` are integers >= 0; names and
paths (`--model`, `--config`, `--prompt-file`, `--plot`) must be non-empty.

JAX is imported only when a model is needed, so `--help` and `price` with a
named config answer immediately.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from jaxsample import config as config_lib
from jaxsample import cost
from jaxsample.errors import ConfigError, InputError, JaxsampleError, ModelLoadError

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
                          "stdin (a file named '-': ./-)")
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
    run.add_argument("--seed", type=_int, help=f"PRNG seed (default {d['seed']})")
    run.add_argument("--stop", action="append", metavar="TEXT",
                     help="a stop string (repeatable)")
    run.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="render the prompt with the model's chat template (default: on)")
    run.add_argument("--reduce", choices=config_lib.REDUCER_KINDS,
                     help="vote (self-consistency), best (best-of-N by mean logprob) or none "
                          "(default: vote)")
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
    run.add_argument("--json", action="store_true", help="print one JSON object")

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
    price.add_argument("--n", type=_int_list, default=[1, 4, 16, 64], metavar="N,N,...",
                       help="branch counts, integers >= 1; repeats are dropped "
                            "(default 1,4,16,64)")
    price.add_argument("--dtype", choices=config_lib.DTYPES,
                       help="bytes per weight/KV element (default: the model's dtype)")
    price.add_argument("--plot", metavar="FILE.png", type=_non_empty,
                       help="also plot the table to a PNG file")
    price.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


# ---------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
      argv: the arguments (default `sys.argv[1:]`).
    Returns:
      The exit status: 0 on success, 2 on bad input (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0)
        if args.command == "run":
            return _run(args)
        return _price(args)
    except (_UsageError, JaxsampleError, ValueError, OSError, OverflowError) as e:
        # OverflowError: a user value too large for a fixed-width type (int32,
        # float) that slipped past validation; still bad input, not a crash.
        _fail(e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxsample: interrupted", file=sys.stderr)
        return 130


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
                ("n", "temperature", "top_p", "top_k", "min_p", "max_new_tokens", "seed")
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
    if args.chat is not None:
        cfg = cfg.replace(chat=args.chat)
    return cfg


PROMPT_FILE_LIMIT = 64 * 2**20  # bytes; a larger prompt file is an error, never truncated


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


def _read_text(name: str, where: str) -> str:
    flag = "--prompt-file"
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


class _Progress:
    """Transient progress on stderr: a rich spinner on a terminal, nothing otherwise."""

    def __init__(self, enabled: bool):
        self.console = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            self.console = Console(file=sys.stderr)

    @contextlib.contextmanager
    def step(self, message: str):
        if self.console is None:
            yield
            return
        with self.console.status(message):
            yield

    def note(self, message: str):
        if self.console is not None:
            self.console.print(message, style="dim")


def _load_model(name: str | None, dtype: str):
    from jaxsample import loading

    kwargs = {}
    if "dtype" in inspect.signature(loading.load).parameters:
        kwargs["dtype"] = dtype
    lm = loading.load(name, **kwargs) if name is not None else loading.load(**kwargs)
    if lm.config.dtype != dtype:  # a loader without a dtype option: cast here
        import jax
        import jax.numpy as jnp

        from jaxsample.lm import LanguageModel
        new_cfg = lm.config.replace(dtype=dtype)
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, new_cfg.jnp_dtype), lm.params)
        lm = LanguageModel(config=new_cfg, params=params, tokenizer=lm.tokenizer,
                           name=lm.name, source=lm.source)
    return lm


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


def _run(args) -> int:
    t_start = time.perf_counter()
    cfg = resolve_run_config(args)
    prompt = _read_prompt(args)
    progress = _Progress(enabled=not args.json)

    from jaxsample import engine

    mesh = _make_mesh(cfg.mesh, cfg.sampling.n)
    what = cfg.model.name or "the embedded model"
    with progress.step(f"loading and dequantising {what}"):
        t0 = time.perf_counter()
        lm = _load_model(cfg.model.name, cfg.model.dtype)
        t_load = time.perf_counter() - t0
    adaptive = None
    with progress.step(f"compiling (first call) and decoding {cfg.sampling.n} branches of up to "
                       f"{cfg.sampling.max_new_tokens} tokens"):
        kwargs = {"chat": cfg.chat}
        if mesh is not None:
            kwargs["mesh"] = mesh
        if args.adaptive:
            adaptive = _run_adaptive(lm, prompt, cfg, args, kwargs)
            gen = adaptive.generation
        else:
            gen = engine.generate(lm, [prompt], cfg.sampling, **kwargs)
    if adaptive is not None:
        n_used = int(adaptive.n_used[0])
        counted = adaptive.counted[0]
        first = next((i for i, (a, c) in enumerate(zip(adaptive.answers[0], counted))
                      if c and a == adaptive.winner[0]), None)
        result = {"answer": adaptive.winner[0], "share": _finite(adaptive.share[0]),
                  "support": float(sum(counted)) if adaptive.winner[0] is not None else 0.0,
                  "branch": first, "n_used": n_used,
                  "terminated": int(adaptive.terminated[0]), "adaptive": args.adaptive,
                  "saving": adaptive.bill.to_dict()}
        answers = list(adaptive.answers[0])
    else:
        result, answers = _reduce(gen, cfg.reducer)
    timings = {"load": t_load,
               "compile": float(gen.timings.get("compile", 0.0)),
               "prefill": float(gen.timings.get("prefill", 0.0)),
               "decode": float(gen.timings.get("decode", 0.0)),
               "total": time.perf_counter() - t_start}
    mean_lp = gen.mean_logprob()[0]
    shown = gen.n if adaptive is None else int(adaptive.n_used[0])
    branches = [{"text": gen.texts[0][i], "answer": answers[i], "tokens": int(gen.lengths[0, i]),
                 "mean_logprob": _finite(mean_lp[i]), "finish_reason": gen.finish_reason[0][i]}
                for i in range(shown)]
    if args.json:
        params = cfg.to_dict()["sampling"]
        params["seed"] = gen.params.seed
        out = {"model": lm.name, "prompt": prompt,
               "params": {**params, "chat": cfg.chat,
                          "reducer": dataclasses.asdict(cfg.reducer)},
               "branches": branches, "result": result, "bill": gen.bill.to_dict(),
               "timings": timings}
        print(json.dumps(out, ensure_ascii=False))
        return EXIT_OK
    _print_run(lm, cfg, gen, branches, result, timings, adaptive)
    return EXIT_OK


def _run_adaptive(lm, prompt, cfg, args, kwargs):
    """`jaxsample.adaptive_self_consistency` for `run --adaptive` (one prompt)."""
    from jaxsample import adaptive as adaptive_lib

    if cfg.reducer.kind != "vote":
        raise InputError(f"--adaptive votes; it cannot be combined with --reduce "
                         f"{cfg.reducer.kind}")
    rule, confidence = ADAPTIVE[args.adaptive]
    return adaptive_lib.adaptive_self_consistency(
        lm, [prompt], cfg.sampling, max_n=args.max_n, window=args.window, rule=rule,
        threshold=args.threshold, confidence=confidence, extract=cfg.reducer.extract,
        warmup=2 * args.window if confidence else 16, **kwargs)


def _reduce(gen, reducer: config_lib.ReducerConfig):
    """The result ({"answer", "share", "branch"}) and each branch's extracted answer."""
    import numpy as np

    from jaxsample import answers as answers_lib
    from jaxsample import reducers

    texts = gen.texts[0]
    if reducer.kind == "vote":
        sc = reducers.self_consistency(gen, extract=reducer.extract, weights=reducer.weights)
        branch = int(sc.first_branch[0])
        result = {"answer": sc.winner[0], "share": _finite(sc.share[0]),
                  "support": _finite(sc.support[0]), "branch": branch if branch >= 0 else None}
        return result, list(sc.answers[0])

    def one(text):
        a = answers_lib.extract(text, reducer.extract)
        return (answers_lib.normalize(a) or None) if a is not None else None

    answers = [one(t) for t in texts]
    if reducer.kind == "best":
        scores = gen.mean_logprob() if reducer.score == "mean_logprob" else gen.sum_logprob()
        # Prefer complete branches (ended by a stop): a branch cut at max_new_tokens
        # may carry a truncated answer. Without any complete branch, take them all.
        complete = np.array([[r == "stop" for r in gen.finish_reason[0]]]) & (gen.lengths > 0)
        valid = complete if complete.any() else gen.lengths > 0
        idx = int(reducers.best_of_n(scores, valid)[0])
        if idx < 0:
            return {"answer": None, "share": None, "branch": None}, answers
        return {"answer": answers[idx], "share": None, "branch": idx,
                "score": _finite(scores[0, idx])}, answers
    return {"answer": None, "share": None, "branch": None}, answers


def _stdout_console():
    """A rich console on stdout: the terminal's width, or 120 columns into a pipe or file."""
    from rich.console import Console

    return Console(file=sys.stdout, highlight=False,
                   width=None if sys.stdout.isatty() else 120)


def _first_line(text: str, width: int = 60) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 1] + "…"


def _print_run(lm, cfg, gen, branches, result, timings, adaptive=None):
    from rich.console import Console
    from rich.table import Table

    console = _stdout_console()
    p = cfg.sampling
    table = Table(title=f"{lm.name}: {len(branches)} branches (temperature {p.temperature}, "
                        f"top-p {p.top_p}, top-k {p.top_k}, min-p {p.min_p}, seed {gen.params.seed})")
    table.add_column("#", justify="right")
    table.add_column("answer")
    table.add_column("tokens", justify="right")
    table.add_column("finish")
    table.add_column("mean logprob", justify="right")
    table.add_column("first line", overflow="ellipsis", no_wrap=True, max_width=60)
    chosen = result.get("branch")
    for i, b in enumerate(branches):
        lp = "n/a" if b["mean_logprob"] is None else f"{b['mean_logprob']:.3f}"
        table.add_row(str(i), str(b["answer"]) if b["answer"] is not None else "-",
                      str(b["tokens"]), b["finish_reason"], lp, _first_line(b["text"]),
                      style="bold" if i == chosen else None)
    console.print(table)
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
            console.print(gen.texts[0][result["branch"]], markup=False)
    if "n_used" in result:
        console.print(f"adaptive ({result['adaptive']}): {result['n_used']} branches drawn, "
                      f"{result['terminated']} terminated", markup=False)
    console.print("[bold]bill[/bold]")
    console.print(gen.bill.summary(), markup=False, soft_wrap=True)
    if adaptive is not None:
        console.print(adaptive.bill.summary(), markup=False, soft_wrap=True)
    tokens = gen.bill.decoded_tokens_total
    rate = tokens / timings["decode"] if timings["decode"] > 0 else float("nan")
    console.print(f"timings: load {timings['load']:.2f} s, compile (first call) "
                  f"{timings['compile']:.2f} s, prefill {timings['prefill']:.3f} s, decode "
                  f"{timings['decode']:.2f} s ({rate:.0f} tokens/s over all branches), "
                  f"total {timings['total']:.2f} s (with tokenisation, reduction, imports)",
                  markup=False, soft_wrap=True)


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
            if isinstance(cfg, LlamaConfig):
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
    model_cfg, label = resolve_model_config(args.model)
    dtype_bytes = cost._DTYPE_BYTES[args.dtype or model_cfg.dtype]
    P, T = args.prompt_tokens, args.new_tokens
    rows = cost.table(model_cfg, P, T, args.n, dtype_bytes=dtype_bytes)
    head = cost.estimate(model_cfg, P, T, 1, dtype_bytes=dtype_bytes)
    if args.plot:
        _plot(rows, args.plot, f"{label}: P={P}, T={T}")
    if args.json:
        out = {"model": label, "config": dataclasses.asdict(model_cfg),
               "prompt_tokens": P, "new_tokens": T, "dtype_bytes": dtype_bytes,
               "n_params": head.n_params, "weight_bytes": head.weight_bytes,
               "kv_bytes_per_token": head.kv_bytes_per_token,
               "fits_context": P + T <= model_cfg.max_seq_len,
               "rows": rows, "estimates": [cost.estimate(model_cfg, P, T, n, dtype_bytes)
                                           .to_dict() for n in args.n]}
        if args.plot:
            out["plot"] = args.plot
        print(json.dumps(out))
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
    if P + T > model_cfg.max_seq_len:
        console.print(f"note: P + T = {P + T} exceeds the model's context "
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
    console.print("Prefix sharing saves prefill FLOPs and prefix KV memory and reads; decode "
                  "FLOPs are the same either way. read/step: bytes the last decode step reads "
                  "(weights once + KV). Counting conventions: jaxsample/cost.py.", markup=False)
    if args.plot:
        console.print(f"plot written to {args.plot}", markup=False)
    return EXIT_OK


def _plot(rows, path: str, title: str) -> None:
    out = Path(path)
    if not out.parent.is_dir():
        raise InputError(f"--plot: directory {out.parent} does not exist")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = [
        ("KV cache held (bytes)", "kv_bytes_shared", "kv_bytes_separate"),
        ("bytes read by the last decode step", "step_bytes_shared", "step_bytes_separate"),
        ("total FLOPs (prefill + decode)", "total_flops_shared", "total_flops_separate"),
    ]
    for ax, (name, shared, separate) in zip(axes, series):
        ax.plot(ns, [r[shared] for r in rows], "o-", label="shared prefix")
        ax.plot(ns, [r[separate] for r in rows], "s--", label="separate retries")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("branches N")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
