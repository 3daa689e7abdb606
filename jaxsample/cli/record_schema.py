"""The schema of a results line, for `--resume`: a kept line counts as a finished
request only when it holds everything `console.json_record` writes for one.

`check_line` refuses a line that lacks a field, has one the writer never writes,
or holds a value of the wrong type or out of its range (a branch's tokens in
[0, max_new_tokens], its token ids as many as its tokens, as many branches as
the request asks, ...), and, when the line's id is a request of the prompt
file, a line whose settings (model, dtype, weights, prompt or messages,
position, sampling settings, chat, reducer) differ from what that request asks
now. A stub (`{"id": "m3"}`) or an edited line is therefore never kept as done:
`--resume` refuses the file, naming the line and what is wrong.

The schema follows the writer: top-level fields `TOP_FIELDS` (plus "messages"
for a chat request), a branch's `BRANCH_FIELDS` (plus `LOGPROB_FIELDS` with
logprobs), the result's fields per reducer (`RESULT_FIELDS`), usage, batch,
timings, and the bill's `Bill` fields; its optional parts (`cost.bill.PARTS`) and
an adaptive result's "saving" (`RESULT_OPTIONAL`) may be absent, so files
written without them resume.
"""

from __future__ import annotations

import dataclasses
import json
import math

from jaxsample.cli.console import dumps, model_fields, record_params
from jaxsample.errors import short_repr

TOP_FIELDS = ("index", "id", "model", "dtype", "weights", "prompt", "params", "branches",
              "result", "bill", "timings", "usage", "batch")
BRANCH_FIELDS = ("text", "answer", "tokens", "mean_logprob", "finish_reason")
LOGPROB_FIELDS = ("token_ids", "token_logprobs")  # with logprobs K >= 0
TOP_LOGPROB_FIELDS = ("top_token_ids", "top_logprobs")  # with K >= 1
RESULT_FIELDS = {
    "vote": ("answer", "share", "support", "branch"),
    "best": ("answer", "share", "branch"),  # "score" too once a branch is chosen
    "none": ("answer", "share", "branch"),
    "adaptive": ("answer", "share", "support", "branch", "n_used", "terminated", "adaptive"),
}
# Result fields a kept line may hold that the writer does not write: an adaptive
# result's comparison with the fixed run, which the bill's "adaptive" part holds.
RESULT_OPTIONAL = {"adaptive": ("saving",)}
FINISH_REASONS = ("stop", "length", "terminated")  # "terminated": an adaptive rule's
TIMINGS = ("load", "compile", "prefill", "decode", "total")
USAGE = ("prompt_tokens", "decoded_tokens", "kept_tokens")
BATCH = ("index", "requests")


class _Bad(ValueError):
    """What is wrong with a line (one message)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _fields(obj, where: str, required, optional=()) -> None:
    """`obj` is a dict with every `required` key and no key outside `required` + `optional`."""
    if not isinstance(obj, dict):
        raise _Bad(f"{where} must be an object, got {short_repr(obj, 60)}")
    missing = [k for k in required if k not in obj]
    extra = [k for k in obj if k not in required and k not in optional]
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
            [f"unexpected {', '.join(map(repr, extra))}"] if extra else [])
        head = f"{where}: " if where else ""
        raise _Bad(f"{head}{'; '.join(parts)} (not a line jaxsample wrote)")


def _int(v, where: str, lo: int = 0, hi: int | None = None) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        span = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise _Bad(f"{where} must be an int {span}, got {short_repr(v, 60)}")
    return v


def _number(v, where: str, null: bool = True, lo: float | None = None,
            hi: float | None = None) -> None:
    ok = _is_number(v) and (lo is None or v >= lo) and (hi is None or v <= hi)
    if not (ok or (null and v is None)):
        span = "" if lo is None else f" in [{lo:g}, {hi:g}]" if hi is not None else f" >= {lo:g}"
        raise _Bad(f"{where} must be a number{span}{' or null' if null else ''}, got "
                   f"{short_repr(v, 60)}")


def _str(v, where: str, null: bool = False) -> None:
    if not (isinstance(v, str) or (null and v is None)):
        raise _Bad(f"{where} must be a string{' or null' if null else ''}, got {short_repr(v, 60)}")


def _list(v, where: str, length: int | None = None) -> list:
    if not isinstance(v, list) or (length is not None and len(v) != length):
        what = f"a list of {length}" if length is not None else "a list"
        got = f"{len(v)} items" if isinstance(v, list) else short_repr(v, 60)
        raise _Bad(f"{where} must be {what}, got {got}")
    return v


def _branch(b, where: str, T: int, k: int | None) -> None:
    extra = () if k is None else LOGPROB_FIELDS + (TOP_LOGPROB_FIELDS if k > 0 else ())
    _fields(b, where, BRANCH_FIELDS + extra)
    _str(b["text"], f"{where}.text")
    _str(b["answer"], f"{where}.answer", null=True)
    L = _int(b["tokens"], f"{where}.tokens", 0, T)
    _number(b["mean_logprob"], f"{where}.mean_logprob")
    if b["finish_reason"] not in FINISH_REASONS:
        raise _Bad(f"{where}.finish_reason must be one of {list(FINISH_REASONS)}, got "
                   f"{short_repr(b['finish_reason'], 60)}")
    if k is None:
        return
    for t, x in enumerate(_list(b["token_ids"], f"{where}.token_ids", L)):
        _int(x, f"{where}.token_ids[{t}]")
    for t, x in enumerate(_list(b["token_logprobs"], f"{where}.token_logprobs", L)):
        _number(x, f"{where}.token_logprobs[{t}]")
    if k == 0:
        return
    for name, item in (("top_token_ids", _int), ("top_logprobs", _number)):
        for t, row in enumerate(_list(b[name], f"{where}.{name}", L)):
            for j, x in enumerate(_list(row, f"{where}.{name}[{t}]", k)):
                item(x, f"{where}.{name}[{t}][{j}]")


def _numbers(d, where: str, required, parts=()) -> None:
    """A bill: a dict with every `required` field, each value a number, null or a
    (nested) list of numbers (per-branch counts); each of `parts` present is null or
    such a dict itself."""
    if not isinstance(d, dict):
        raise _Bad(f"{where} must be an object, got {short_repr(d, 60)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise _Bad(f"{where}: missing {', '.join(map(repr, missing))} (not a line jaxsample wrote)")

    def ok(v):
        return v is None or _is_number(v) or (isinstance(v, list) and all(map(ok, v)))

    for key, v in d.items():
        if key in parts:
            if v is not None:
                _numbers(v, f"{where}.{key}", ())
        elif not ok(v):
            raise _Bad(f"{where}.{key} must be a number, got {short_repr(v, 60)}")


def _schema(obj: dict, adaptive: bool, max_n: int | None) -> None:
    """The line's structure and types, with its own params for n, T and K."""
    from jaxsample.cost.bill import PARTS, Bill

    _fields(obj, "", TOP_FIELDS, ("messages",) if obj.get("prompt") is None else ())
    _int(obj["index"], "index")
    for name in ("model", "dtype"):
        _str(obj[name], name)
    _str(obj["weights"], "weights", null=True)
    _str(obj["prompt"], "prompt", null=True)
    if obj["prompt"] is None and "messages" not in obj:
        raise _Bad('missing "messages" (a line without a prompt holds the chat messages)')
    params = obj["params"]
    if not isinstance(params, dict):
        raise _Bad(f"params must be an object, got {short_repr(params, 60)}")
    n = _int(params.get("n"), "params.n", 1)
    T = _int(params.get("max_new_tokens"), "params.max_new_tokens")
    k = params.get("logprobs")
    if k is not None:
        _int(k, "params.logprobs")
    reducer = params.get("reducer")
    kind = reducer.get("kind") if isinstance(reducer, dict) else None
    kind = "adaptive" if adaptive else kind
    if kind not in RESULT_FIELDS:
        raise _Bad(f"params.reducer.kind must be one of {sorted(set(RESULT_FIELDS) - {'adaptive'})},"
                   f" got {short_repr(kind, 60)}")
    branches = _list(obj["branches"], "branches", None if adaptive else n)
    if adaptive and not 1 <= len(branches) <= (max_n or len(branches)):
        raise _Bad(f"branches must be a list of 1 to {max_n} (the adaptive rule's max_n), got "
                   f"{len(branches)} items")
    for i, b in enumerate(branches):
        _branch(b, f"branches[{i}]", T, k)
    result = obj["result"]
    optional = ("score",) if kind == "best" and isinstance(result, dict) and \
        result.get("branch") is not None else RESULT_OPTIONAL.get(kind, ())
    _fields(result, "result", RESULT_FIELDS[kind], optional)
    _str(result["answer"], "result.answer", null=True)
    _number(result["share"], "result.share", lo=0, hi=1)
    if "support" in result:
        _number(result["support"], "result.support", lo=0)
    if "score" in result:
        _number(result["score"], "result.score")
    if result["branch"] is not None:
        _int(result["branch"], "result.branch", 0, len(branches) - 1)
    if kind == "adaptive":
        if result["n_used"] != len(branches):
            raise _Bad(f"result.n_used must be the number of branches ({len(branches)}), got "
                       f"{short_repr(result['n_used'], 60)}")
        _int(result["terminated"], "result.terminated")
        _str(result["adaptive"], "result.adaptive")
        if "saving" in result:
            _numbers(result["saving"], "result.saving", ())
    _numbers(obj["bill"], "bill", [f.name for f in dataclasses.fields(Bill) if f.name not in PARTS],
             PARTS)
    _fields(obj["timings"], "timings", TIMINGS)
    for name in TIMINGS:
        _number(obj["timings"][name], f"timings.{name}", null=False, lo=0)
    _fields(obj["usage"], "usage", USAGE)
    for name in USAGE:
        _int(obj["usage"][name], f"usage.{name}")
    usage, kept = obj["usage"], sum(b["tokens"] for b in branches)
    if not adaptive and usage["kept_tokens"] != kept:
        raise _Bad(f"usage.kept_tokens must be the branches' tokens ({kept}), got "
                   f"{usage['kept_tokens']}")
    if usage["decoded_tokens"] < usage["kept_tokens"]:
        raise _Bad(f"usage.decoded_tokens ({usage['decoded_tokens']}) must be at least "
                   f"usage.kept_tokens ({usage['kept_tokens']})")
    _fields(obj["batch"], "batch", BATCH)
    _int(obj["batch"]["index"], "batch.index")
    members = _list(obj["batch"]["requests"], "batch.requests")
    for j, x in enumerate(members):
        _int(x, f"batch.requests[{j}]")
    if obj["index"] not in members:
        raise _Bad(f"batch.requests {short_repr(members, 60)} must hold the line's index "
                   f"{obj['index']}")


def check_line(obj: dict, request, cfg, model: str, adaptive: str | None = None,
               max_n: int | None = None) -> None:
    """A kept line of `--resume`: its schema, then (when `request` is not None) the
    settings its request asks now.

    Args:
      obj: the line's object (a dict with a string "id").
      request: the prompt file's `Request` with the line's id, or None (a line of an
        id not in the prompt file: kept as it is, its schema checked with its own
        params, adaptive when its result says so).
      cfg: the run's `RunConfig`; model: the name records carry (`loading.model_name`).
      adaptive, max_n: the run's `--adaptive` rule (None: not adaptive) and `--max-n`.
    Raises:
      ValueError: what is wrong, in one line: missing or unexpected fields, a
        value of the wrong type or range, or the settings that differ (each as
        "name kept -> asked").
    """
    if request is None:
        result = obj.get("result")
        try:
            _schema(obj, isinstance(result, dict) and "n_used" in result, None)
        except _Bad as e:
            raise ValueError(f"not a finished result: {e}; remove that line, or use another "
                             "--out") from None
        return
    want = {**model_fields(model, cfg), "index": request.index,
            "prompt": request.prompt if request.messages is None else None,
            "params": record_params(cfg, request.sampling, request.sampling.seed)}
    if request.messages is not None:
        want["messages"] = request.messages
    want = json.loads(dumps(want))  # as a line reads back (tuples as lists, ...)
    got = {k: obj[k] for k in want if k in obj}
    if request.sampling.seed is None:  # a fresh draw each run: any seed matches
        want["params"].pop("seed")
        if isinstance(got.get("params"), dict):
            got["params"] = {k: v for k, v in got["params"].items() if k != "seed"}
    diff = []
    for field in want:
        if field not in got:
            continue  # the schema names it
        if field == "params" and isinstance(got[field], dict):
            names = sorted(set(got[field]) | set(want[field]))
            diff += [f"{k} {short_repr(got[field].get(k))} -> {short_repr(want[field].get(k))}"
                     for k in names if got[field].get(k) != want[field].get(k)]
        elif got[field] != want[field]:
            diff.append(f"{field} {short_repr(got[field])} -> {short_repr(want[field])}")
    if diff:
        raise ValueError(f"written with other settings than {request.where} asks "
                         f"({'; '.join(diff)}): use another --out, or remove that line to "
                         "redo it")
    try:
        _schema(obj, adaptive is not None, max_n)
        if adaptive is not None and obj["result"]["adaptive"] != adaptive:
            raise _Bad(f"result.adaptive {short_repr(obj['result']['adaptive'])} -> "
                       f"{adaptive!r}")
    except _Bad as e:
        raise ValueError(f"not a finished result of {request.where}: {e}; remove that line "
                         "to redo it") from None
