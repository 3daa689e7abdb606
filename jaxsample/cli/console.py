"""What `run` prints: the strict JSON writer (`dumps`), JSON records and the rich tables."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

from jaxsample.floats import shortest_float32

EXIT_OK = 0


EXIT_USAGE = 2  # bad input of any kind (argparse's convention)


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a filter killed by it


def finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _f32(x) -> float | None:
    """A float32-derived value for JSON (`floats.shortest_float32`: 0.53333336, not
    float64's 0.5333333611488342), or None (JSON null) when it is not finite."""
    return shortest_float32(x)


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


def unique_keys(pairs) -> dict:
    """`json.loads`'s object_pairs_hook that refuses a key given twice in one object
    (Python keeps the last silently; RFC 8259 leaves it undefined).

    Raises:
      ValueError: naming the key.
    """
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice in one object")
        obj[key] = value
    return obj


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def loads(text: str):
    """The strict reader of our own JSON lines: no NaN / Infinity, no key twice.

    Raises:
      ValueError: what is wrong (json.JSONDecodeError for malformed text).
    """
    return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=unique_keys)


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


def record_params(cfg, sampling, seed) -> dict:
    """A record's "params": the request's sampling settings (the YAML layout) with the
    seed it ran with, the chat flag and the reducer."""
    params = cfg.replace(sampling=sampling).to_dict()["sampling"]
    params["seed"] = seed
    return {**params, "chat": cfg.chat, "reducer": dataclasses.asdict(cfg.reducer)}


def model_fields(name: str, cfg) -> dict:
    """A record's model, with the dtype and weights it was loaded in (what `--resume`
    compares, `out_file.check_kept`, besides the prompt and the params)."""
    return {"model": name, "dtype": cfg.model.dtype, "weights": cfg.model.weights}


def json_record(lm, cfg, out, single: bool) -> dict:
    """The JSON object of one request (the documented schema of `run --json`)."""
    r, gen, b = out["request"], out["gen"], out["b"]
    record = {**model_fields(lm.name, cfg), "prompt": r.prompt if r.messages is None else None,
              "params": record_params(cfg, out["cfg"].sampling, gen.params.seed),
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


def stdout_console(width: int | None = None):
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


def print_run(console, lm, out, single: bool, *, bill: bool = True, batch_requests=None):
    cfg, gen, result, timings = out["cfg"], out["gen"], out["result"], out["timings"]
    r = out["request"]
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
    console.print(gen.bill.summary(), markup=False)  # an adaptive run's: its adaptive line too
    tokens = gen.bill.decoded_tokens_total
    rate = tokens / timings["decode"] if timings["decode"] > 0 else float("nan")
    console.print(f"timings: load {timings['load']:.2f} s, compile (first call) "
                  f"{timings['compile']:.2f} s, prefill {timings['prefill']:.3f} s, decode "
                  f"{timings['decode']:.2f} s ({rate:.0f} tokens/s over all branches), "
                  f"total {timings['total']:.2f} s (with tokenisation, reduction, imports)",
                  markup=False)
    if not single:
        console.print()
