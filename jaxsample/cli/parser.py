"""The command line's arguments: the parser, its value types and the exit statuses."""

from __future__ import annotations

import argparse

from jaxsample import cache_paths
from jaxsample.cli import config as config_lib
from jaxsample.models.checkpoints import registry


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
        raise UsageError(f"{self.prog}: {message} (see --help)")


class UsageError(Exception):
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


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """--kv-budget: a byte count >= 1, a number with an optional unit: "2GiB",
    "512 MiB", "1.5e9", "4GB" (B, kB/MB/GB/TB powers of 1000, KiB/MiB/GiB/TiB of 1024)."""
    import math
    import re

    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    try:
        value = float(m.group(1)) if m else float("nan")
    except ValueError:
        value = float("nan")
    if unit not in _BYTE_UNITS or not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a byte size like 2GiB, 512MiB or 1e9, got {text!r}")
    size = int(value * _BYTE_UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 byte, got {text!r}")
    return size


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

    _add_run_parser(sub)
    _add_price_parser(sub)
    _add_cache_parser(sub)
    _add_merge_parser(sub)
    return parser


def _add_run_parser(sub) -> None:
    """`jaxsample run`: sample N branches of one prompt (or a .jsonl file of requests),
    reduce them, print or write the results."""
    run = sub.add_parser("run", help="sample N branches of one prompt, reduce, print the bill",
                         description="Sample N branches of one prompt sharing its KV cache, "
                                     "reduce them and print the branches, result and bill. "
                                     "Flags given explicitly override --config.")
    _add_input_args(run)
    _add_sampling_args(run)
    _add_reduce_args(run)
    _add_output_args(run)
    _add_placement_args(run)


def _add_input_args(run) -> None:
    """`run`'s input: the prompt or prompt file, a shared prefix, the model and how it
    is loaded (dtype, weights, the prefix KV dtype, the CPU kernels)."""
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
                     help="a model name (" + ", ".join(registry.known_names()) + ") or a "
                          ".gguf file / Hugging Face directory (default: the embedded "
                          "SmolLM2-135M-Instruct)")
    run.add_argument("--config", metavar="YAML", type=_non_empty,
                     help="a run configuration (configs/NAME.yaml, or just NAME)")
    run.add_argument("--dtype", choices=config_lib.DTYPES, help="weights/activations dtype")
    run.add_argument("--weights", choices=config_lib.WEIGHTS[1:],
                     help="int8: int8 weights and activations (W8A8); int8-weight-only: int8 "
                          "weights in a float product (reproducible across meshes)")
    run.add_argument("--prefix-kv-dtype", choices=config_lib.PREFIX_KV_DTYPES,
                     help="the prompts' stored KV cache: auto (float16 for --weights int8 on "
                          "the CPU kernels, else the model's dtype) or model (the model's "
                          "dtype); default auto")
    run.add_argument("--cpu-kernels", choices=config_lib.CPU_KERNELS,
                     help="the int8 products' CPU kernels: auto (where they build) or off "
                          "(XLA's products); JAXSAMPLE_CPU_KERNELS=0 overrides auto; "
                          "default auto")


def _add_sampling_args(run) -> None:
    """`run`'s sampling settings (None when not given, so the --config file's value
    stands) and the chat template."""
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


def _add_reduce_args(run) -> None:
    """`run`'s reduction: vote, best-of-N (by a score) or none, the answer extraction,
    and adaptive self-consistency with its options."""
    run.add_argument("--reduce", choices=config_lib.REDUCER_KINDS,
                     help="vote (self-consistency), best (best-of-N by mean logprob) or none "
                          "(default: vote)")
    run.add_argument("--select", metavar="SCORE", type=score_name,
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


def _add_output_args(run) -> None:
    """`run`'s output: --json, the caches, progress, and the results file (--out, --resume)."""
    run.add_argument("--json", action="store_true",
                     help="print one JSON object (one JSON line per request of a .jsonl file)")
    run.add_argument("--no-cache", action="store_true",
                     help="neither read nor write the compilation and weight caches "
                          f"(also {cache_paths.ENV_OFF}=1; the directory is "
                          f"${cache_paths.ENV_DIR}, else $XDG_CACHE_HOME/jaxsample)")
    run.add_argument("-q", "--quiet", action="store_true",
                     help="no progress on stderr (loading, compiling, decoding)")
    run.add_argument("--out", metavar="FILE.jsonl", type=_non_empty,
                     help="with a .jsonl --prompt-file: write each request's --json record to "
                          "FILE as one strict JSON line as soon as the request completes "
                          "(flushed and fsynced; Ctrl-C or a crash keeps every finished line); "
                          "\"id\" is then a string (a number id as its JSON text, a line without "
                          "one its position); nothing goes to stdout")
    run.add_argument("--resume", action="store_true",
                     help="with --out: keep FILE's lines and run only the requests whose id is "
                          "not in it (a torn last line is cut and redone)")


def _add_placement_args(run) -> None:
    """Where `run` computes: several hosts (jax.distributed) and the decode pool's KV budget."""
    run.add_argument("--distributed", action="store_true",
                     help="several hosts (jax.distributed): with --out, each process runs its "
                          "contiguous share of the .jsonl requests and writes "
                          "OUT.part-KKKKK-of-NNNNN; join them with `jaxsample merge --out OUT`. "
                          "Without the three flags below JAX detects the cluster (TPU pods, "
                          "SLURM, ...)")
    run.add_argument("--coordinator", metavar="HOST:PORT", type=_non_empty,
                     help="with --distributed: process 0's address")
    run.add_argument("--num-processes", metavar="N", type=_int,
                     help="with --distributed: the number of processes")
    run.add_argument("--process-id", metavar="I", type=_non_negative_int,
                     help="with --distributed: this process's id in [0, N)")
    run.add_argument("--join-timeout", metavar="SECONDS", type=_int, default=300,
                     help="with --distributed: how long a process waits for all N to join "
                          "(JAX's initialization_timeout; JAX then ends the process; default 300)")
    run.add_argument("--kv-budget", metavar="BYTES", type=byte_size,
                     help="the decode pool's KV budget, e.g. 2GiB (generate(max_kv_bytes=...); "
                          "default: a fraction of the device's memory); not with --adaptive")


def _add_price_parser(sub) -> None:
    """`jaxsample price`: the analytic cost table, shared prefix against N retries."""
    price = sub.add_parser("price", help="the analytic cost table: shared prefix vs N retries",
                           description="Price N branches over one shared prompt against N "
                                       "separate retries, from the model's config alone.")
    price.add_argument("--model", metavar="NAME_OR_PATH", default=None, type=_non_empty,
                       help="a model name (" + registry.describe_names() + ") or path "
                            "(default: the embedded model)")
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


def _add_merge_parser(sub) -> None:
    """`jaxsample merge --out OUT [PART ...]`: join a multi-host run's parts (cli/merge.py)."""
    merge = sub.add_parser("merge", help="join the parts a multi-host run wrote, in request order",
                           description="Join the results files the processes of a multi-host "
                                       "run wrote (OUT.part-KKKKK-of-NNNNN) into OUT, ordered "
                                       "by each line's request index; every part must be "
                                       "present and finished.")
    merge.add_argument("--out", required=True, metavar="OUT", type=_non_empty,
                       help="the merged file to write")
    merge.add_argument("parts", nargs="*", metavar="PART", type=_non_empty,
                       help="the part files (default: OUT.part-*-of-* beside OUT)")
    merge.add_argument("--expect", type=_non_negative_int, metavar="R", default=None,
                       help="the run's number of requests (fewer lines is an error)")


def score_name(text: str) -> str:
    """--select: a score name, hyphens or underscores."""
    name = text.strip().replace("-", "_")
    name = "bottom_group_confidence" if name == "bottom_10_group_confidence" else name
    if name not in config_lib.SCORES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from "
            + ", ".join(s.replace("_", "-") for s in config_lib.SCORES) + ")")
    return name


def _add_cache_parser(sub) -> None:
    """`jaxsample cache info|clear`: what the cache directory holds, and emptying it."""
    cache = sub.add_parser("cache", help="what the weight/compilation cache holds; clear it",
                           description="The cache directory ($JAXSAMPLE_CACHE_DIR, else "
                                       "$XDG_CACHE_HOME/jaxsample, else ~/.cache/jaxsample): "
                                       "dequantised and int8 weights, compiled and exported "
                                       "programs "
                                       "assembled checkpoints and the int8 CPU kernels.")
    what = cache.add_subparsers(dest="cache_command", metavar="ACTION", parser_class=_Parser)
    what.required = True
    info = what.add_parser("info", help="where the cache is and what it holds (sizes, ages)")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    clear = what.add_parser("clear", help="delete the cache (all of it, or the parts named)",
                            description="Delete the cache's weights, compiled and exported "
                                        "programs, assembled checkpoints and built CPU "
                                        "kernels; with flags, only those parts.")
    for part, text in (("weights", "the dequantised and int8 weights (weights/)"),
                       ("compiled", "the compiled programs (xla/)"),
                       ("exported", "the exported programs (exported/: traced and lowered, "
                                    "so a second run skips tracing)"),
                       ("models", "the assembled checkpoints (models/; re-assembled on the "
                                  "next load)"),
                       ("kernels", "the int8 CPU kernels (kernels/; rebuilt on the next int8 "
                                   "load)")):
        clear.add_argument(f"--{part}", action="store_true", help=f"clear {text}")
    clear.add_argument("--json", action="store_true", help="print one JSON object")
