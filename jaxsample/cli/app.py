"""`main`: the `jaxsample` command's dispatch, `run` and `cache`.

    jaxsample run --prompt "What is 3 + 4? Answer with a number." --n 16
    jaxsample run --prompt-file q.txt --config configs/best_of_n.yaml --json
    jaxsample run --prompt-file requests.jsonl --json        # one JSON line per request
    jaxsample run --prompt-file requests.jsonl --out out.jsonl [--resume]  # each line as it completes
    jaxsample price --model smollm2-135m --prompt-tokens 4096 --new-tokens 256 --n 1,4,16,64
    jaxsample cache info          # where the cache is, what it holds; `cache clear` empties it

`run` loads a model (`jaxsample.loading.load`), samples N branches that share
the prompt's KV cache (`jaxsample.engine.generate`), reduces them (vote,
best-of-N or none) and prints the branches, the result and the bill (with
--out, writes each request's record as it completes: `jaxsample.cli.out_file`). Bad input
of any kind (every `JaxsampleError`, `ValueError`, `OSError`, `OverflowError`)
is one line on stderr (`jaxsample: error: ...`) and exit status 2; a reader of
stdout that leaves (`| head -1`) ends it quietly with status 141. What the
command guarantees (strict JSON, float32 digits, flag values, caches) is in
docs/ARCHITECTURE.md, "The command line".
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Sequence

from jaxsample import cache_paths, cost
from jaxsample import disk_cache as cache_lib
from jaxsample.cli import config as config_lib
from jaxsample.cli.batches import make_mesh, run_batch
from jaxsample.cli.console import (
    EXIT_BROKEN_PIPE,
    EXIT_OK,
    EXIT_USAGE,
    dumps,
    json_record,
    print_run,
    stdout_console,
)
from jaxsample.cli.parser import UsageError, build_parser
from jaxsample.cli.price import price_command
from jaxsample.cli.requests import (
    check_adaptive,
    check_kv_budget,
    check_requests,
    check_results,
    group_requests,
    is_jsonl,
    read_requests,
    read_shared_prefix,
)
from jaxsample.errors import ConfigError, InputError, JaxsampleError


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
        if args.command == "merge":
            from jaxsample.cli.merge import merge_command

            return merge_command(args)
        return price_command(args)
    except BrokenPipeError:  # `jaxsample run ... | head -1`: the reader left
        return _broken_pipe()
    except (UsageError, JaxsampleError, ValueError, OSError, OverflowError) as e:
        # OverflowError: a user value too large for a fixed-width type (int32,
        # float) that slipped past validation; still bad input, not a crash.
        _fail(e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jaxsample: interrupted", file=sys.stderr)
        return 130


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
    if isinstance(e, UsageError):  # "jaxsample run: message"
        prog, _, msg = msg.partition(": ")
    print(f"{prog}: error: {msg}", file=sys.stderr)


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
    switches = ("weights", "prefix_kv_dtype", "cpu_kernels")
    if args.model is not None or args.dtype is not None or any(
            getattr(args, k, None) for k in switches):
        cfg = cfg.replace(model=dataclasses.replace(
            cfg.model, name=args.model if args.model is not None else cfg.model.name,
            dtype=args.dtype or cfg.model.dtype,
            **{k: getattr(args, k, None) or getattr(cfg.model, k) for k in switches}))
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


def _load_model(name: str | None, dtype: str, *, use_cache: bool = True, weights=None,
                prefix_kv_dtype: str = "auto", cpu_kernels: str = "auto"):
    from jaxsample import loading

    return loading.load(name, dtype=dtype, cache=None if use_cache else False, weights=weights,
                        prefix_kv_dtype=prefix_kv_dtype, cpu_kernels=cpu_kernels)


def _model_header(cfg: config_lib.RunConfig, use_cache: bool):
    """(config, tokenizer) of the run's model, without its weights."""
    from jaxsample import loading

    return loading.read_model(cfg.model.name, cache=None if use_cache else False)


def _run(args) -> int:
    t_start = time.perf_counter()
    cfg = resolve_run_config(args)
    requests = read_requests(args, cfg)
    shared = read_shared_prefix(args)
    use_cache = not args.no_cache and not cache_paths.cache_disabled()
    if shared is not None and args.adaptive:
        raise InputError("--shared-prefix cannot be combined with --adaptive")
    if getattr(args, "out", None) is not None or args.resume:
        from jaxsample.cli.out_file import check_out_args

        check_out_args(args, requests)
    if args.adaptive and args.kv_budget is not None:
        raise InputError("--kv-budget sizes the decode pool; it cannot be combined with "
                         "--adaptive (whose rounds size their own batches)")
    if args.adaptive:
        if cfg.reducer.kind != "vote":
            raise InputError(f"--adaptive votes; it cannot be combined with --reduce "
                             f"{cfg.reducer.kind}")
        check_adaptive(args)
    check_distributed(args)
    # Every check that needs the model, made on its metadata and tokenizer alone, so bad
    # input is refused before the weights load (and before any progress line).
    t0 = time.perf_counter()
    header = _model_header(cfg, use_cache)
    check_requests(*header, requests, cfg.chat, shared)
    if not args.adaptive:  # (adaptive rounds hold --window branches at a time)
        check_results(requests, streamed=getattr(args, "out", None) is not None
                      and shared is None)
    if args.kv_budget is not None and shared is None:
        check_kv_budget(*header, requests, cfg.chat, args.kv_budget)
    t_meta = time.perf_counter() - t0  # reading the header counts as loading
    all_requests = requests
    if args.distributed:  # before any JAX computation (the meshes below count)
        requests = _take_share(args, requests)
    for r in requests:
        make_mesh(cfg.mesh, r.sampling.n)
    from jaxsample import loading

    results = None
    if getattr(args, "out", None) is not None:  # opened (created) only now: input all valid
        from jaxsample.cli.out_file import open_results

        results = open_results(args, requests, cfg, loading.model_name(cfg.model.name))
        if results is None:  # --resume: every request is in the file already
            return EXIT_OK
    from jaxsample.progress import Progress

    progress = None if args.quiet else Progress()
    if use_cache:
        cache_lib.enable_compilation_cache()
    what = cfg.model.name or "the embedded model"
    t0 = time.perf_counter()
    try:
        if progress is not None:
            with progress.phase(f"loading {what}") as ph:
                lm = _load_model(cfg.model.name, cfg.model.dtype, use_cache=use_cache,
                                 weights=cfg.model.weights,
                                 prefix_kv_dtype=cfg.model.prefix_kv_dtype,
                                 cpu_kernels=cfg.model.cpu_kernels)
                ph.cancel()
        else:
            lm = _load_model(cfg.model.name, cfg.model.dtype, use_cache=use_cache,
                             weights=cfg.model.weights, prefix_kv_dtype=cfg.model.prefix_kv_dtype,
                             cpu_kernels=cfg.model.cpu_kernels)
    except BaseException:
        if results is not None:
            results.close(failed=True)
        raise
    # One figure, said twice: the header and tokenizer read first, then the weights.
    t_load = t_meta + time.perf_counter() - t0
    if progress is not None:
        info = loading.load_info(lm)
        how = _load_how(info)
        progress.line(f"loaded {lm.name} in {t_load:.2f} s ({how})")
    if getattr(args, "out", None) is not None:
        from jaxsample.cli.out_file import run_to_file

        return run_to_file(lm, cfg, args, requests, shared, results, progress,
                           t_start=t_start, t_load=t_load, run_batch=run_batch,
                           all_requests=all_requests)
    single = not is_jsonl(args)  # one prompt: one JSON object / one table
    console = None if args.json else stdout_console()
    try:
        # Each call's requests are printed as soon as that call ends, so a later
        # call's error or Ctrl-C keeps what is done (--out keeps each request).
        for k, batch in enumerate(group_requests(requests)):
            outputs = run_batch(lm, cfg, args, batch, shared, progress, k,
                                t_start if k == 0 else None, t_load)
            for i, out in enumerate(outputs):
                if args.json:
                    print(dumps(json_record(lm, cfg, out, single)))
                else:
                    print_run(console, lm, out, single, bill=i + 1 == len(outputs),
                              batch_requests=None if single else out["requests"])
            sys.stdout.flush()
    finally:
        if progress is not None:
            progress.close()
    return EXIT_OK


def check_distributed(args) -> None:
    """--distributed and its three flags, before anything runs (InputError naming them)."""
    given = [f for f, v in (("--coordinator", args.coordinator),
                            ("--num-processes", args.num_processes),
                            ("--process-id", args.process_id)) if v is not None]
    if not args.distributed:
        if given:
            raise InputError(f"{given[0]} sets up --distributed; pass --distributed too")
        return
    if getattr(args, "out", None) is None:
        raise InputError("--distributed writes one part of --out per process; give --out "
                         "FILE.jsonl")
    if given and len(given) != 3:
        raise InputError("--distributed: give all of --coordinator, --num-processes and "
                         "--process-id, or none (JAX then detects the cluster)")
    if given:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--coordinator must be HOST:PORT (a port in [1, 65535]), got "
                             f"{args.coordinator!r}")
    if args.join_timeout < 1:
        raise InputError(f"--join-timeout must be >= 1 second, got {args.join_timeout}")
    if given and args.num_processes < 1:
        raise InputError(f"--num-processes must be >= 1, got {args.num_processes}")
    if given and args.process_id >= args.num_processes:
        raise InputError(f"--process-id must be in [0, {args.num_processes}), got "
                         f"{args.process_id}")


def _take_share(args, requests):
    """Join the processes (`sharding.initialize_distributed`), keep this process's
    contiguous block of the requests (their positions, hence keys, unchanged) and
    point --out at its part (`merge.part_path`)."""
    import jax

    from jaxsample import sharding
    from jaxsample.cli.merge import part_path
    from jaxsample.engine.shard_requests import share_bounds

    if not args.quiet:  # joining blocks until every process is there: say so
        who = (f"process {args.process_id} waiting for all {args.num_processes} processes at "
               f"{args.coordinator}" if args.coordinator else "waiting for the cluster's processes")
        print(f"jaxsample: {who} to join (JAX ends this process if they have not within "
              f"--join-timeout {args.join_timeout} s)", file=sys.stderr, flush=True)
    sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                                    timeout_s=args.join_timeout)
    p, C = jax.process_index(), jax.process_count()
    start, stop = share_bounds(len(requests), p, C)
    args.out = part_path(args.out, p, C)
    if not args.quiet:
        print(f"jaxsample: process {p} of {C}: requests {start}..{stop - 1} of "
              f"{len(requests)} -> {args.out}", file=sys.stderr, flush=True)
    return requests[start:stop]


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
    off = f" (off: {cache_paths.ENV_OFF} is set)" if info["disabled"] else ""
    print(f"cache directory: {info['dir']}{off}" + ("" if info["exists"] else " (empty)"))
    print(f"weights: {len(info['weights'])} entries, {fb(info['weights_bytes'])}")
    for w in info["weights"]:
        print(f"  {Path(w['file']).name}  {fb(w['bytes'])}  written {_age(w['age_s'])} ago  "
              f"from {w['source'] or '(unreadable entry)'}")
    print(f"compiled programs: {info['compiled_programs']}, {fb(info['compiled_bytes'])}")
    print(f"exported programs: {info['exported_programs']}, {fb(info['exported_bytes'])}")
    print(f"assembled checkpoints: {len(info['models'])}, {fb(info['models_bytes'])}")
    for m in info["models"]:
        print(f"  {Path(m['file']).name}  {fb(m['bytes'])}  written {_age(m['age_s'])} ago")
    print(f"int8 CPU kernels: {fb(info['kernels_bytes'])}")
    print(f"total: {fb(info['total_bytes'])}")
    return EXIT_OK


def _load_how(info: dict) -> str:
    """The loaded line's parenthesis: where the weights came from (`loading.load_info`)."""
    if info.get("quantized") == "cache":
        return "int8 weights from the cache"
    if info.get("quantized") == "calibrated":
        return ("calibrated and quantised to int8; cached for the next run"
                if info.get("cache_entry") else "calibrated and quantised to int8")
    return ("dequantised weights from the cache" if info.get("weights") == "cache"
            else "dequantised; cached for the next run" if info.get("cache_entry")
            else "read from the checkpoint")
