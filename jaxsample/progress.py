"""Progress of a request on stderr: a rich bar on a terminal, plain lines otherwise.

`generate(..., progress=True)`, `stream(..., progress=True)` and the command
line report through a `Progress`:

    phases     model loading, preparing a program: on a terminal a spinner
               while it runs and a line when it ends; without a terminal
               (CI logs, pipes) a line when it starts (at once for loading,
               after `slow_after` seconds for a program, so a program found
               compiled in memory prints nothing), a line every `interval`
               seconds while it runs, and a line when it ends. A program is
               "prepared" (traced, lowered, then compiled by XLA or fetched
               from JAX's persistent compilation cache; or read already
               traced from the exported programs, then fetched); its end line
               says which: "compiled prefill in 4.7 s", "loaded prefill from
               the compilation cache in 2.1 s" (traced, not compiled) or
               "loaded prefill from cache in 0.3 s" (neither)
    adaptive   adaptive self-consistency's rounds: the round, the branches
               drawn and the prompts settled, as a bar on a terminal and
               otherwise a line every `interval` seconds and one at the end
    decode     steps done of the budget, live branches, tokens/s and time
               left: on a terminal a bar refreshed at every chunk boundary;
               otherwise one line every `interval` seconds, and a last line
               with the tokens decoded and the rate

Every plain line starts with `jaxsample: ` and never contains "error:", so a
log reader can tell them from the command line's one-line errors. Progress
never writes to stdout.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO

PREFIX = "jaxsample: "


class _Phase:
    """A running phase; `cancel()` drops its end line (a lookup that found the
    program compiled already); `from_cache()` (program phases) swaps the end
    line for the one saying the persistent compilation cache served it;
    `from_exported()` for the one saying the whole program came from the cache
    (read exported, not traced, and not compiled)."""

    __slots__ = ("start", "end", "after", "t0", "announced", "task", "cancelled", "cached_end",
                 "last", "exported_end")

    def __init__(self, start, end, after, cached_end=None, exported_end=None):
        self.start, self.end, self.after = start, end, after
        self.t0 = time.perf_counter()
        self.last = self.t0  # the last line printed for it (plain mode)
        self.announced = False
        self.task = None
        self.cancelled = False
        self.cached_end = cached_end
        self.exported_end = exported_end

    def cancel(self):
        self.cancelled = True

    def from_cache(self):
        if self.cached_end is not None:
            self.end = self.cached_end

    def from_exported(self):
        if self.exported_end is not None:
            self.end = self.exported_end


class Progress:
    """Reports phases and decode progress of requests on a text stream.

    Args:
      file: where to write (default: `sys.stderr` at construction).
      terminal: draw a rich progress bar (True) or print plain lines
        (False); default: whether `file` is a terminal.
      interval: seconds between two plain decode lines (0: one per chunk).
      slow_after: seconds after which a running compile is announced in
        plain mode (0: at once); a compile that ends sooner prints nothing.
    """

    def __init__(self, file: IO[str] | None = None, *, terminal: bool | None = None,
                 interval: float = 5.0, slow_after: float = 1.0):
        self.file = sys.stderr if file is None else file
        if terminal is None:
            isatty = getattr(self.file, "isatty", None)
            terminal = bool(isatty and isatty())
        self.terminal = terminal
        self.interval = float(interval)
        self.slow_after = float(slow_after)
        self._lock = threading.RLock()
        self._phases: list[_Phase] = []
        self._ticker: threading.Thread | None = None
        self._live = None  # rich.progress.Progress while something is shown
        self._decode = None  # state of the decode being reported
        self._adaptive = None  # state of the adaptive rounds being reported
        self._console = None

    # -- output -----------------------------------------------------------------

    def line(self, message: str) -> None:
        """Print one line (above the bar on a terminal)."""
        with self._lock:
            if self.terminal:
                self._rich_console().print(message, markup=False, highlight=False,
                                           style="dim")
            else:
                print(PREFIX + message, file=self.file, flush=True)

    def _rich_console(self):
        if self._live is not None:
            return self._live.console
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.file, highlight=False)
        return self._console

    def _ensure_live(self):
        if self._live is None:
            from rich.progress import BarColumn, SpinnerColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                TextColumn("{task.fields[info]}"), console=self._rich_console(),
                transient=True, refresh_per_second=8)
            self._live.start()
        return self._live

    def _maybe_stop_live(self):
        if (self._live is not None and not self._phases and self._decode is None
                and self._adaptive is None):
            live, self._live = self._live, None
            live.stop()

    # -- phases -----------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, start: str, end: str | None = None, *, announce_after: float = 0.0,
              cached_end: str | None = None, exported_end: str | None = None):
        """Report a phase that blocks (loading, compiling).

        Args:
          start: what is being done ("loading smollm2-135m-instruct").
          end: the line printed when it ends, formatted with the seconds it
            took as `{s}` ("loaded it in {s:.1f} s"); default `start` + " done".
          announce_after: seconds before the phase is shown at all; a phase
            that ends sooner prints nothing.
          cached_end: the end line after `handle.from_cache()` (as `end`).
          exported_end: the end line after `handle.from_exported()` (as `end`).

        Yields:
          A handle whose `cancel()` drops the end line and whose `from_cache()`
          picks `cached_end`. Off a terminal, a phase still running prints
          "<start>: <s> s so far" every `interval` seconds.
        """
        ph = _Phase(start, end or (start + ": done in {s:.1f} s"), announce_after, cached_end,
                    exported_end)
        with self._lock:
            self._phases.append(ph)
            if announce_after <= 0:
                self._show(ph)
            if announce_after > 0 or (not self.terminal and self.interval > 0):
                self._start_ticker()  # to announce it later, or to say it is still running
        ok = False
        try:
            yield ph
            ok = True
        finally:
            with self._lock:
                self._phases.remove(ph)
                if ph.task is not None and self._live is not None:
                    self._live.remove_task(ph.task)
                s = time.perf_counter() - ph.t0
                shown = ph.announced or s >= announce_after
                if ok and shown and not ph.cancelled:
                    self.line(ph.end.format(s=s))
                if self.terminal:
                    self._maybe_stop_live()

    def compiling(self, name: str):
        """The engine's hook around every program lookup: `name` is "prefill",
        "decode", ...; the engine cancels the handle of a lookup that found the
        program compiled in memory (it then prints nothing, unless `slow_after`
        is 0), calls `from_cache()` when JAX's persistent compilation cache
        served it, and `from_exported()` when, besides, the program was read
        from the exported programs rather than traced. The start line
        ("preparing prefill") cannot know which yet; the end line says
        "compiled" only when XLA compiled, and "loaded prefill from cache"
        only when nothing was traced or compiled."""
        return self.phase(f"preparing {name}", f"compiled {name} in {{s:.1f}} s",
                          announce_after=self.slow_after,
                          cached_end=f"loaded {name} from the compilation cache in {{s:.1f}} s",
                          exported_end=f"loaded {name} from cache in {{s:.1f}} s")

    def _show(self, ph: _Phase):
        ph.announced = True
        ph.last = time.perf_counter()
        if self.terminal:
            ph.task = self._ensure_live().add_task(ph.start, total=None, info="")
        else:
            print(PREFIX + ph.start + " ...", file=self.file, flush=True)

    def _start_ticker(self):
        if self._ticker is not None and self._ticker.is_alive():
            return
        self._ticker = threading.Thread(target=self._tick, name="jaxsample-progress",
                                        daemon=True)
        self._ticker.start()

    def _tick(self):
        while True:
            time.sleep(0.05)
            with self._lock:
                if not self._phases:
                    self._ticker = None
                    return
                now = time.perf_counter()
                for ph in self._phases:
                    if not ph.announced and now - ph.t0 >= ph.after:
                        self._show(ph)
                    elif (ph.announced and not self.terminal and self.interval > 0
                          and now - ph.last >= self.interval):
                        ph.last = now
                        print(f"{PREFIX}{ph.start}: {now - ph.t0:.0f} s so far", file=self.file,
                              flush=True)

    # -- decode -----------------------------------------------------------------

    def decode_start(self, steps: int, prompts: int, branches: int) -> None:
        """A decode of up to `steps` tokens for `prompts` x `branches` branches begins."""
        with self._lock:
            now = time.perf_counter()
            self._decode = {"steps": int(steps), "total": int(prompts) * int(branches),
                            "t0": now, "last": now, "step": 0, "tokens": 0, "task": None,
                            "compile0": None}
            what = (f"decoding {branches} branch{'es' if branches != 1 else ''} of "
                    f"{prompts} prompt{'s' if prompts != 1 else ''}, up to {steps} tokens each")
            if self.terminal:
                self._decode["task"] = self._ensure_live().add_task(
                    "decode", total=int(steps), info="")
            else:
                self.line(what)

    def decode_update(self, step: int, live: int, tokens: int, compile_s: float = 0.0) -> None:
        """After a chunk: `step` tokens per branch so far, `live` branches still
        decoding, `tokens` decoded over all branches, `compile_s` seconds of
        compiling spent since the decode began (left out of the rate)."""
        with self._lock:
            d = self._decode
            if d is None:
                return
            now = time.perf_counter()
            d.update(step=int(step), tokens=int(tokens), live=int(live))
            run = max(now - d["t0"] - compile_s, 1e-9)
            rate = tokens / run
            left = (d["steps"] - step) * run / max(step, 1) if live else 0.0
            info = (f"{live}/{d['total']} live  {rate:,.0f} tok/s  "
                    f"{format_seconds(left)} left")
            if self.terminal:
                self._live.update(d["task"], completed=int(step), info=info)
            elif live and step < d["steps"] and now - d["last"] >= self.interval:
                d["last"] = now
                self.line(f"decode: step {step}/{d['steps']} "
                          f"({100 * step / max(d['steps'], 1):.0f}%), {live}/{d['total']} "
                          f"branches live, {rate:,.0f} tokens/s, at most {format_seconds(left)} left")

    def decode_end(self, tokens: int, compile_s: float = 0.0) -> None:
        """The decode is over: `tokens` decoded over all branches."""
        with self._lock:
            d = self._decode
            if d is None:
                return
            self._decode = None
            if self.terminal and self._live is not None:
                self._live.remove_task(d["task"])
            run = max(time.perf_counter() - d["t0"] - compile_s, 1e-9)
            self.line(f"decoded {tokens:,} tokens in {run:.1f} s ({tokens / run:,.0f} tokens/s "
                      "over all branches)")
            if self.terminal:
                self._maybe_stop_live()

    # -- adaptive rounds ----------------------------------------------------------

    def adaptive_update(self, round: int, drawn: int, settled: int, prompts: int,
                        final: bool = False) -> None:
        """Adaptive self-consistency (`jaxsample.adaptive_self_consistency`): in
        round `round` (from 1), `drawn` branches drawn over all prompts so far
        (those of the running round included), `settled` of `prompts` prompts
        stopped. Called after every chunk and round; off a terminal a line is
        printed at most every `interval` seconds, and always when `final`."""
        with self._lock:
            now = time.perf_counter()
            a = self._adaptive
            if a is None:  # the first report prints at once
                a = self._adaptive = {"t0": now, "last": -float("inf"), "task": None}
            info = (f"round {round}, {drawn} branch{'es' if drawn != 1 else ''} drawn, "
                    f"{settled}/{prompts} prompt{'s' if prompts != 1 else ''} settled")
            if self.terminal:
                if a["task"] is None:
                    a["task"] = self._ensure_live().add_task("adaptive", total=None, info=info)
                self._live.update(a["task"], info=info)
                if final:
                    self._live.remove_task(a["task"])
            elif final or now - a["last"] >= self.interval:
                a["last"] = now
                self.line(f"adaptive: {info} ({now - a['t0']:.0f} s)")
            if final:
                self._adaptive = None
                if self.terminal:
                    self.line(f"adaptive: {info} in {now - a['t0']:.1f} s")
                    self._maybe_stop_live()

    def close(self) -> None:
        """Remove the bar (if any) from the terminal."""
        with self._lock:
            self._decode = self._adaptive = None
            if self._live is not None:
                live, self._live = self._live, None
                live.stop()


def format_seconds(s: float) -> str:
    """A duration for a progress line: "42 s", "3 min 05 s", "1 h 02 min"."""
    s = max(float(s), 0.0)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def resolve(progress) -> Progress | None:
    """`progress=` of the API: False/None -> None, True -> Progress() on stderr, or a Progress.

    Raises:
      InputError: anything else.
    """
    if progress is None or progress is False:
        return None
    if progress is True:
        return Progress()
    if isinstance(progress, Progress):
        return progress
    from jaxsample.errors import InputError

    raise InputError(f"progress must be a bool or a jaxsample.progress.Progress, "
                     f"got {type(progress).__name__}")


__all__ = ["Progress", "resolve", "PREFIX"]
