"""`run --prompt-file in.jsonl --out out.jsonl [--resume]`: each request's record
written as it completes.

- Every line of the prompt file, the flags and (with --resume) the out file are
  checked before the weights are read; a bad one is one error line naming it,
  exit 2, and the out file is left as it was (one this run created removed).
- One run writes a file at a time: `ResultsFile` locks it before reading or
  writing it, and a second run is refused naming the holder's pid.
- Each completed request is `json_record`'s object (what `--json` prints for a
  .jsonl request) with "id" as a string (`out_id`), written by `ResultsFile`:
  one strict JSON line, fsynced, so Ctrl-C (exit 130) or a crash keeps every
  finished line.
- Without --adaptive or --shared-prefix, requests stream through the decode
  pool (`engine.run_pool`) and are written in completion order; with
  either, `run_requests` has no place for the adaptive rounds or the common
  context, so each call of consecutive equal-settings requests runs as without
  --out and its lines are written when the call ends.
- `--resume` keeps the file's lines and runs the requests whose id is not in
  it; a torn last line is cut and its request redone. A kept line must be a
  finished result of what its request asks now (`record_schema.check_line`:
  every field the writer writes, with its type, and the same settings), else
  the file is refused naming the line. A remaining request keeps its position
  as its prompt index (`index_offset`), so its branches are those of the
  uninterrupted run (up to float ties). The bill's pool figures (decode steps,
  branch steps, KV bytes) and the timings are the pool's that ran it, so they
  differ from the uninterrupted run's.
"""

from __future__ import annotations

import os
import sys
import time

from jaxsample.cli.console import EXIT_OK, dumps, json_record
from jaxsample.cli.record_schema import check_line
from jaxsample.cli.requests import group_requests, is_jsonl, render
from jaxsample.cli.results_file import ResultsFile
from jaxsample.errors import InputError


def out_id(r) -> str:
    """The "id" of request `r`'s line in the out file: the .jsonl line's id if a string,
    a number id as its JSON text ("7", "2.5"), else the request's position ("0", "1", ...)."""
    if isinstance(r.id, str):
        return r.id
    return dumps(r.id) if r.id is not None else str(r.index)


def _note(args, message: str) -> None:
    if not args.quiet:
        print("jaxsample: " + message, file=sys.stderr, flush=True)


def check_out_args(args, requests) -> None:
    """--out / --resume against the flags and the requests, before anything is opened.

    Raises:
      InputError: --resume without --out; --out without a .jsonl --prompt-file; --out
        naming the prompt file; two requests with the same `out_id` (naming both lines).
    """
    if args.out is None:
        raise InputError("--resume continues an --out file; give --out FILE")
    if not is_jsonl(args):
        raise InputError("--out writes one line per request of a .jsonl --prompt-file "
                         "(use --json for one prompt)")
    try:
        same = os.path.exists(args.out) and os.path.samefile(args.out, args.prompt_file)
    except OSError:
        same = False
    if same:
        raise InputError(f"--out: {args.out} is the --prompt-file; write the results elsewhere")
    seen = {}
    for r in requests:
        key = out_id(r)
        if key in seen:
            raise InputError(f"{r.where}: id {key!r} repeats {seen[key].where}'s (--out tells "
                             "requests apart by id; a line without one is named by its position)")
        seen[key] = r


def open_results(args, requests, cfg, model: str) -> ResultsFile | None:
    """The out file, opened and locked (`ResultsFile`: created, or with --resume read,
    each kept line checked (`record_schema.check_line`) and a torn last line cut).

    Args:
      cfg: the run's `RunConfig`; model: the name the records carry (`loading.model_name`).
    Returns:
      The `ResultsFile` (holding the file's lock until it is closed), or None (closed)
      when --resume finds every request in it.
    Raises:
      InputError: FILE is a directory; another run is writing FILE (naming its pid);
        without --resume, a non-empty FILE (never truncated: pass --resume or remove
        it); with it, a FILE that is not a results file, or a kept line that is not a
        finished result of what its request asks now (naming the line).
      OSError: FILE cannot be created, locked or read.
    """
    path = args.out
    if os.path.isdir(path):
        raise InputError(f"--out: {path} is a directory; name a file")
    by_id = {out_id(r): r for r in requests}
    adaptive = args.adaptive or None

    def check(obj):
        check_line(obj, by_id.get(obj["id"]), cfg, model, adaptive,
                   args.max_n if adaptive else None)

    results = ResultsFile(path, resume=args.resume, check=check)
    if args.resume:
        done = len(set(by_id) & results.done)
        extra = len(results.done - set(by_id))
        torn = "; its torn last line was cut" if results.torn is not None else ""
        other = f"; {extra} lines of ids not in the prompt file kept" if extra else ""
        if done == len(requests):
            _note(args, f"--resume: all {done} requests are in {path} already{torn}{other}; "
                        "nothing to run")
            results.close()
            return None
        _note(args, f"--resume: {done} of {len(requests)} requests are in {path} already, "
                    f"running the other {len(requests) - done}{torn}{other}")
    return results


def _runs(requests):
    """Requests cut into runs of consecutive positions (a resumed run's gaps split them)."""
    out = []
    for r in requests:
        if out and out[-1][-1].index + 1 == r.index:
            out[-1].append(r)
        else:
            out.append([r])
    return out


class _Counter:
    """Requests done / total, tokens/s and the time left, on stderr as requests complete
    (off a terminal at most one line per `progress.interval` seconds, and the last)."""

    def __init__(self, progress, total: int, done: int):
        self.progress, self.total, self.done, self.done0 = progress, total, done, done
        self.tokens, self.t0, self.last = 0, time.perf_counter(), -float("inf")
        self.first = None  # (time, tokens) at the first completion: rates count from it,
        # so the first request's compile does not weigh on them

    def add(self, tokens: int) -> None:
        from jaxsample.progress import format_seconds

        self.done += 1
        self.tokens += int(tokens)
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, self.tokens)
        p = self.progress
        if p is None:
            return
        final = self.done == self.total
        if not (final or p.terminal or now - self.last >= p.interval):
            return
        self.last = now
        ran = self.done - self.done0
        if ran >= 2:  # since the first completion
            run, tokens, ran = max(now - self.first[0], 1e-9), self.tokens - self.first[1], ran - 1
        else:
            run, tokens = max(now - self.t0, 1e-9), self.tokens
        left = (self.total - self.done) * run / ran
        p.line(f"requests: {self.done}/{self.total} done, {tokens / run:,.0f} tokens/s, "
               f"about {format_seconds(left)} left")


def run_to_file(lm, cfg, args, requests, shared, results, progress, *, t_start, t_load,
                run_batch=None, all_requests=None) -> int:
    """Run the requests not in `results` and write each one's line as it completes.

    `all_requests` (default `requests`) is the whole prompt file when `requests` is
    one process's share (--distributed): calls ("batch" in a record) are numbered
    over it, so the merged parts read as a one-process run.

    Returns:
      0 (EXIT_OK). KeyboardInterrupt and errors propagate after the file is closed
      (every line written before them stays).
    """
    from jaxsample.cli import batches as app_lib

    run_batch = run_batch or app_lib.run_batch
    try:
        pending = [r for r in requests if out_id(r) not in results.done]
        groups = group_requests(requests if all_requests is None else all_requests)
        batch_of = {r.index: (k, [x.index for x in g]) for k, g in enumerate(groups) for r in g}
        counter = _Counter(progress, len(requests), len(requests) - len(pending))
        bills = []

        def write(out):
            record = json_record(lm, cfg, out, False)
            record["id"] = out_id(out["request"])
            results.write(record)
            counter.add(out["gen"].bill.decoded_tokens_total)

        try:
            if args.adaptive or shared is not None:  # each call's lines as it ends
                waiting = {r.index for r in pending}
                for k, g in enumerate(groups):
                    for run in _runs([r for r in g if r.index in waiting]):
                        for out in run_batch(lm, cfg, args, run, shared, progress, k, None,
                                             t_load, requests=batch_of[run[0].index][1]):
                            write(out)
            else:
                for run in _runs(pending):
                    bills.append(_stream(lm, cfg, args, run, progress, batch_of, write,
                                         t_start, t_load, app_lib))
        except KeyboardInterrupt:
            done = len(results.done & {out_id(r) for r in requests})
            print(f"jaxsample: {done} of {len(requests)} requests are in {args.out}; "
                  "--resume runs the rest", file=sys.stderr, flush=True)
            raise
        if progress is not None:
            progress.line(_bill_line(args.out, counter, bills))
    except BaseException:
        results.close(failed=True)
        raise
    finally:
        results.close()  # (a no-op once closed)
        if progress is not None:
            progress.close()
    return EXIT_OK


def _stream(lm, cfg, args, run, progress, batch_of, write, t_start, t_load, app_lib):
    """One `run_pool` call over consecutive requests; each written as it completes."""
    from jaxsample.engine.requests import Request, run_pool

    by_id = {out_id(r): r for r in run}
    # The run's seed is the engine's: a request with the run's seed draws from (seed, its
    # index in the file); a line with a seed of its own, from (that seed, branch) alone.
    seed = cfg.sampling.seed
    own = lambda sp: sp if sp.seed != seed else sp.replace(seed=None)
    reqs = [Request(id=out_id(r), prompt=render(lm.tokenizer, r, cfg.chat),
                    params=own(r.sampling)) for r in run]
    stream = run_pool(lm, reqs, max_kv_bytes=args.kv_budget,
                          mesh=app_lib.make_mesh(cfg.mesh, run[0].sampling.n),
                          index_offset=run[0].index, progress=progress or False, seed=seed)
    for res in stream:
        r, gen = by_id[res.id], res.generation
        k, members = batch_of[r.index]
        sc = app_lib.vote(gen, cfg.reducer) if cfg.reducer.kind == "vote" else None
        result, answers = app_lib.reduce_one(gen, cfg.reducer, 0, sc)
        timings = {"load": t_load,
                   "compile": float(gen.timings.get("compile", 0.0)),
                   "prefill": float(gen.timings.get("prefill", 0.0)),
                   "decode": float(gen.timings.get("decode", 0.0)),
                   "total": time.perf_counter() - t_start}
        write(dict(request=r, batch=k, gen=gen, b=0, result=result, answers=answers,
                   adaptive=None, timings=timings, cfg=cfg.replace(sampling=r.sampling),
                   requests=members))
    return stream.bill


def _bill_line(path, counter, bills) -> str:
    """The run's bill (the `run_pool` runs' `Bill`s summed): requests, decoded tokens,
    branch-steps, slot utilisation, prefill tokens, requests/s and the batch-by-batch
    estimate (`Bill.pool`)."""
    ran = counter.done - counter.done0
    s = time.perf_counter() - counter.t0
    head = f"wrote {ran} requests to {path} in {s:.1f} s"
    if not bills:
        return head
    dec = sum(b.decoded_tokens_total for b in bills)
    steps = sum(b.branch_steps for b in bills)
    batch = sum(b.pool.batch_branch_steps for b in bills)
    util = f"{dec / steps:.0%}" if steps else "n/a"
    batch_util = f"{dec / batch:.0%}" if batch else "n/a"
    return (f"{head}: {dec:,} tokens decoded over {steps:,} branch-steps (slot utilisation "
            f"{util}; batch by batch {batch:,} branch-steps, {batch_util}), "
            f"{sum(b.prompt_tokens_prefilled for b in bills):,} prefill tokens, "
            f"{ran / max(s, 1e-9):.2f} requests/s")
