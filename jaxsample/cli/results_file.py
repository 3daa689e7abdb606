"""The output file of a many-request run: one strict JSON line per completed request.

Written for `jaxsample run --prompt-file in.jsonl --out out.jsonl [--resume]`
(issue 21, part 5; `jaxsample.cli.out_file` drives it):

- each completed request is one line of strict JSON (RFC 8259: no NaN or
  Infinity, a non-finite float becomes null), written whole, then flushed and
  fsynced, so a crash or Ctrl-C leaves every completed line intact;
- `--resume` reads the ids already complete; a last line without its newline
  or that does not parse (the write a crash interrupted) is torn: it is cut
  off the file and its request is redone. Any other bad line is an error
  naming the line (the file is not ours, or was edited).

Lines are `{"id": str, ...}`; ids are unique in a file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from jaxsample.cli.console import dumps, loads
from jaxsample.errors import InputError


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM held while a line is written, so Ctrl-C lands after the line
    is whole and fsynced, never inside it. Python runs signal handlers in the main
    thread whichever thread the OS signal reached, so the handlers are swapped for one
    that records the signal, and the signal is raised again, to its own handler, when
    the block ends. A no-op off the main thread or when a handler was not set from
    Python (`signal.getsignal` is None)."""
    names = [getattr(signal, n) for n in ("SIGINT", "SIGTERM") if hasattr(signal, n)]
    if threading.current_thread() is not threading.main_thread() or any(
            signal.getsignal(n) is None for n in names):
        yield
        return
    held = []
    old = {n: signal.signal(n, lambda signum, frame: held.append(signum)) for n in names}
    try:
        yield
    finally:
        for n, handler in old.items():
            signal.signal(n, handler)
        if held:
            signal.raise_signal(held[0])


# What a line must share with its request.
SETTINGS = ("model", "dtype", "weights", "prompt", "messages", "params")


class ResultsFile:
    """An append-only JSON-lines file of completed requests.

    Args:
      path: the output file.
      resume: keep the lines already there (their ids are `done`), cutting a
        torn last line; False: start the file empty.
    Raises:
      InputError: with `resume`, a line other than the last that is not a
        JSON object with a string "id", or an id twice (naming the line).
    """

    def __init__(self, path, resume: bool = False):
        self.path = os.fspath(path)
        self.done: set[str] = set()
        # With resume: each kept line's number and the settings it records ("model",
        # "prompt", "messages", "params", those present), for `out_file.check_kept`.
        self.kept: dict[str, tuple[int, dict]] = {}
        self.torn: str | None = None  # the torn last line's text, if one was cut
        if resume and os.path.exists(self.path):
            self._read()
            self._f = open(self.path, "a", encoding="utf-8")
        else:
            self._f = open(self.path, "w", encoding="utf-8")

    def _read(self):
        with open(self.path, "rb") as f:
            data = f.read()
        good = 0  # bytes of complete, valid lines
        lines = data.split(b"\n")
        for i, raw in enumerate(lines):
            last = i == len(lines) - 1
            if last and raw == b"":
                break  # the file ends with a newline
            try:
                if last:
                    raise ValueError("no newline: the write was interrupted")
                obj = loads(raw.decode("utf-8"))
                if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                    raise ValueError('not an object with a string "id"')
            except (ValueError, UnicodeDecodeError) as e:
                if last:
                    self.torn = raw.decode("utf-8", "replace")
                    break
                raise InputError(f"{self.path} line {i + 1}: {e}; not a results file "
                                 f"written by jaxsample (or edited): refusing to resume") from None
            if obj["id"] in self.done:
                raise InputError(f"{self.path} line {i + 1}: id {obj['id']!r} appears twice")
            self.done.add(obj["id"])
            self.kept[obj["id"]] = (i + 1, {k: obj[k] for k in SETTINGS if k in obj})
            good += len(raw) + 1
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())

    def write(self, obj: dict) -> None:
        """Append one completed request (a dict with a string "id"), flushed and fsynced,
        with SIGINT and SIGTERM held until the line is whole.

        Raises:
          ValueError: no string "id", or an id already in the file.
        """
        rid = obj.get("id") if isinstance(obj, dict) else None
        if not isinstance(rid, str):
            raise ValueError('a result line needs a string "id"')
        if rid in self.done:
            raise ValueError(f"id {rid!r} is already in {self.path}")
        line = dumps(obj) + "\n"
        with _signals_held():  # a Ctrl-C lands after the line, never inside it
            self._f.write(line)
            self._f.flush()
            os.fsync(self._f.fileno())
            self.done.add(rid)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
