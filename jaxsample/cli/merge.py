"""`jaxsample merge`: join the parts a multi-host run wrote into one results file.

Under `jax.distributed` each process runs its contiguous share of the
requests (`jaxsample.engine.shard_requests.process_share`) and writes its own
results file, named by `part_path`:

    out.jsonl  ->  out.jsonl.part-00000-of-00002, out.jsonl.part-00001-of-00002

    jaxsample merge --out out.jsonl                      # the parts beside out.jsonl
    jaxsample merge --out out.jsonl PART... [--expect R] # the parts named

A part is a `ResultsFile` (one strict JSON object per line, each with a string
"id" and the request's global position "index", an int >= 0). The merge
reads every part strictly and refuses, in one line naming the file and line
(exit 2): a part missing from its set (`-of-N` names N parts), a last line
without its newline (the part is unfinished: its process was interrupted;
finish it with `--resume`, then merge), a line that is not such an object
(NaN and Infinity are not JSON), an id or index twice across the parts, a
gap in the indices (a request with no line), fewer than `--expect` lines, a
part (or OUT) that a run is still writing (it holds the file's lock).
The output holds the parts' lines byte for byte, ordered by "index" (the
input's order, which is what a single-process run's `--out` holds once sorted
the same way), written to a temporary file, fsynced and renamed over OUT.
"""

from __future__ import annotations

import glob
import os
import re

from jaxsample.cli.console import loads
from jaxsample.cli.results_file import writer_of
from jaxsample.errors import InputError

_PART = re.compile(r"^(?P<out>.+)\.part-(?P<index>\d{5,})-of-(?P<count>\d{5,})$")


def part_path(out, process_index: int, process_count: int) -> str:
    """The part file process `process_index` of `process_count` writes for `out`.

    `part_path("out.jsonl", 1, 2)` is `"out.jsonl.part-00001-of-00002"`.
    """
    if not 0 <= process_index < process_count:
        raise InputError(f"process_index {process_index} is not in [0, {process_count})")
    return f"{os.fspath(out)}.part-{process_index:05d}-of-{process_count:05d}"


def _part_set(out: str, parts) -> list[str]:
    """The parts in process order, every one of its set present."""
    if not parts:
        parts = sorted(glob.glob(glob.escape(out) + ".part-*-of-*"))
        if not parts:
            raise InputError(f"no part files {out}.part-*-of-* found (name them after --out)")
    named = {}
    for p in parts:
        m = _PART.match(os.path.basename(p))
        if m is None:
            raise InputError(f"{p}: not a part name (expected NAME.part-KKKKK-of-NNNNN)")
        if os.path.abspath(p) == os.path.abspath(out):
            raise InputError(f"{p}: the output cannot be one of the parts")
        k, n = int(m["index"]), int(m["count"])
        if k in named and os.path.abspath(named[k][0]) != os.path.abspath(p):
            raise InputError(f"{p} and {named[k][0]} are both part {k}")
        named[k] = (p, n)
    counts = {n for _, n in named.values()}
    if len(counts) > 1:
        raise InputError(f"parts of different runs: -of- counts {sorted(counts)} "
                         f"({', '.join(p for p, _ in named.values())})")
    (n,) = counts
    if any(k >= n for k in named):
        raise InputError(f"{named[max(named)][0]}: part {max(named)} of {n} does not exist")
    first = next(iter(named.values()))[0]
    for k in range(n):
        if k not in named:
            missing = re.sub(r"part-\d+-of", f"part-{k:05d}-of", first)
            raise InputError(f"missing part {missing} ({n} parts, {len(named)} given)")
        if not os.path.isfile(named[k][0]):
            raise InputError(f"{named[k][0]}: no such part file")
    return [named[k][0] for k in range(n)]


def read_part(path: str) -> list[tuple[int, str, bytes, int]]:
    """A part's lines as (index, id, raw line without its newline, line number).

    Raises:
      InputError: an unfinished part (last line without its newline) or a line
        that is not a strict JSON object with a string "id" and an int "index"
        >= 0, naming the file and line.
    """
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise InputError(f"{path} line {len(lines)}: no newline at the end: the part is "
                         f"unfinished (its process was interrupted; finish it with --resume, "
                         f"then merge)")
    out = []
    for i, raw in enumerate(lines[:-1]):
        try:
            obj = loads(raw.decode("utf-8"))
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                raise ValueError('not an object with a string "id"')
            index = obj.get("index")
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f'"index" must be an int >= 0 (the request\'s position), '
                                 f'got {index!r}')
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"{path} line {i + 1}: {e}") from None
        out.append((index, obj["id"], raw, i + 1))
    return out


def merge_parts(out, parts=None, expect: int | None = None) -> dict:
    """Join the parts of `out` into `out` in request order (module docstring).

    Args:
      out: the merged file to write (replaced whole, never half-written).
      parts: the part files (default: `out`.part-*-of-* beside it).
      expect: the number of requests of the run, if known (a missing last
        request is then an error too).
    Returns:
      {"out", "parts", "lines"}.
    Raises:
      InputError: as the module docstring lists, before `out` is touched.
    """
    out = os.fspath(out)
    files = _part_set(out, [os.fspath(p) for p in parts or []])
    for path in files + [out]:  # a run still writing a part, or writing OUT itself
        pid = writer_of(path)
        if pid is not None:
            raise InputError(f"{path} is being written by a run (pid {pid}); merge once it "
                             "has ended")
    by_id, by_index = {}, {}
    for path in files:
        for index, rid, raw, line in read_part(path):
            if rid in by_id:
                p, n = by_id[rid]
                raise InputError(f"{path} line {line}: id {rid!r} is already in {p} line {n}")
            if index in by_index:
                p, n, _ = by_index[index]
                raise InputError(f"{path} line {line}: index {index} is already in {p} line {n}")
            by_id[rid] = (path, line)
            by_index[index] = (path, line, raw)
    total = len(by_index)
    for i in range(total):
        if i not in by_index:
            raise InputError(f"no line has index {i} (the parts hold {total} lines, indices up "
                             f"to {max(by_index)}): a part is incomplete")
    if expect is not None and total != expect:
        raise InputError(f"--expect {expect}: the parts hold {total} requests")
    tmp = f"{out}.merging-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for i in range(total):
                f.write(by_index[i][2] + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"out": out, "parts": files, "lines": total}


def merge_command(args) -> int:
    """`jaxsample merge --out OUT [PART ...] [--expect R]`: one line on stdout."""
    got = merge_parts(args.out, args.parts, args.expect)
    print(f"merged {got['lines']} requests from {len(got['parts'])} parts into {got['out']}")
    return 0
