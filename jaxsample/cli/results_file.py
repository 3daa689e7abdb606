"""The output file of a many-request run: one strict JSON line per completed request.

Written for `jaxsample run --prompt-file in.jsonl --out out.jsonl [--resume]`
(`jaxsample.cli.out_file` drives it):

- one writer per file: the file is opened and locked (`fcntl.flock`, exclusive,
  held until `close`; the kernel drops it when its process ends, however it
  ends) before anything reads or writes it. A second run on the same file (by
  any path to it) is refused at once, naming the file and the holder's pid
  (from /proc/locks where there is one), and leaves the file as it was;
- each completed request is one line of strict JSON (RFC 8259: no NaN or
  Infinity, a non-finite float becomes null), written whole, then fsynced, so
  a crash or Ctrl-C leaves every completed line intact; a write that fails (a
  full disk) is cut back off the file and raised as an OSError naming it;
- without resume, a file that holds anything is refused, never truncated;
- with resume, the ids already complete are read; a last line without its
  newline or that does not parse (the write a crash interrupted) is torn: it
  is cut off the file and its request is redone. Blank lines and a leading
  UTF-8 byte-order mark (an editor's) are skipped. Any other bad line, or a
  line the caller's `check` refuses (`out_file` checks each against a result
  line's full schema and its request's settings), is an error naming the line.

Lines are `{"id": str, ...}`; ids are unique in a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import threading
from typing import Callable

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks (one writer is then the user's care)
    fcntl = None

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




_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which some editors write first


def lock_holder(fd: int) -> str | None:
    """The pid holding a `flock` on the file open at `fd`, from Linux's /proc/locks
    (its lines read `1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF`,
    the device in hex), or None where that cannot be read."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == inode:
                    return parts[4]
    except OSError:
        pass
    return None


def writer_of(path) -> str | None:
    """Whether a run is writing `path` now (holds its lock): its pid ("unknown" where
    /proc/locks cannot say), or None (no writer, or no such file)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        return lock_holder(fd) or "unknown"
    finally:
        os.close(fd)  # (a shared lock taken here goes with it)


def _open_locked(path: str) -> tuple[int, bool]:
    """(fd, created): `path` opened for appending (created if missing) and locked.

    The lock is taken before the caller reads or writes anything, and the open
    retried when the path names another file once locked (a run that removed an
    empty file it had created, between this open and this lock).

    Raises:
      InputError: another process holds the lock (naming the file and its pid).
      OSError: the file cannot be opened, or locked (a filesystem without locks).
    """
    flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        try:
            fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:  # (or removed since: O_CREAT again; or a dangling link)
            fd, created = os.open(path, flags | os.O_CREAT, 0o666), False
        if fcntl is None:
            return fd, created
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid = lock_holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise OSError(e.errno, f"cannot lock it: {e.strerror}", path) from None
            who = f"pid {pid}" if pid is not None else "its pid unknown"
            raise InputError(f"{path} is being written by another run ({who}); one file "
                             "takes one writer: wait for that run to end, or write "
                             "elsewhere") from None
        mine = os.fstat(fd)
        try:
            now = os.stat(path)
            same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            return fd, created
        os.close(fd)
    raise OSError(errno.EAGAIN, "the file kept being replaced while it was locked", path)


class ResultsFile:
    """An append-only JSON-lines file of completed requests, with its writer's lock.

    Args:
      path: the output file (created if missing).
      resume: keep the lines already there (their ids are `done`), cutting a
        torn last line; False: the file must be missing or empty.
      check: with `resume`, called on each kept line's object (a dict with a
        string "id"); raises ValueError (its message says what is wrong) to
        refuse the file.
    Raises:
      InputError: another run holds the file (naming its pid); without
        `resume`, a non-empty file; with it, a line other than the last that is
        not a JSON object with a string "id", an id twice, or a line `check`
        refuses (each naming the line). The file is left as it was.
      OSError: the file cannot be opened, locked or read.
    """

    def __init__(self, path, resume: bool = False,
                 check: Callable[[dict], None] | None = None):
        self.path = os.fspath(path)
        self.done: set[str] = set()
        self.torn: str | None = None  # the torn last line's text, if one was cut
        self._fd, self._created = _open_locked(self.path)
        self._written = 0  # lines this object wrote
        st = os.fstat(self._fd)
        self._regular = stat.S_ISREG(st.st_mode)
        try:
            if resume and not self._regular:
                raise InputError(f"{self.path} is not a regular file; --resume reads back a "
                                 "results file")
            if resume:
                self._read(check)
            elif st.st_size > 0:
                raise InputError(f"{self.path} already holds results; pass --resume to "
                                 "continue it, or remove it")
        except BaseException:
            self.close(failed=True)  # the lock released; a file created here removed
            raise

    def _read(self, check):
        with open(self.path, "rb") as f:
            data = f.read()
        good = len(_BOM) if data.startswith(_BOM) else 0  # bytes of complete, valid lines
        lines = data[good:].split(b"\n")
        for i, raw in enumerate(lines):
            last = i == len(lines) - 1
            if last and raw == b"":
                break  # the file ends with a newline
            if not last and not raw.strip():
                good += len(raw) + 1  # a blank line
                continue
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
            if check is not None:
                try:
                    check(obj)
                except ValueError as e:
                    raise InputError(f"{self.path} line {i + 1} (id {obj['id']!r}): {e}") from None
            self.done.add(obj["id"])
            good += len(raw) + 1
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())

    def write(self, obj: dict) -> None:
        """Append one completed request (a dict with a string "id"), fsynced, with
        SIGINT and SIGTERM held until the line is whole.

        Raises:
          ValueError: no string "id", an id already in the file, or text that is
            not valid Unicode (a lone surrogate).
          OSError: the write failed (a full disk), naming the file; the part of
            the line written is cut off again, so every line in the file is whole.
        """
        rid = obj.get("id") if isinstance(obj, dict) else None
        if not isinstance(rid, str):
            raise ValueError('a result line needs a string "id"')
        if rid in self.done:
            raise ValueError(f"id {rid!r} is already in {self.path}")
        try:
            line = (dumps(obj) + "\n").encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the line of id {rid!r} holds text that is not valid Unicode "
                             f"({e.reason}); nothing written") from None
        with _signals_held():  # a Ctrl-C lands after the line, never inside it
            size = os.fstat(self._fd).st_size
            try:
                self._write_all(line)
                if self._regular:
                    os.fsync(self._fd)
            except OSError as e:
                if self._regular:
                    with contextlib.suppress(OSError):
                        os.ftruncate(self._fd, size)
                raise OSError(e.errno, f"{e.strerror} (writing the line of id {rid!r}; the "
                                       "lines before it are whole)", self.path) from None
            self.done.add(rid)
            self._written += 1

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def close(self, failed: bool = False) -> None:
        """Release the lock and close. `failed`: the run ends on an error; a file this
        object created and never wrote to is then removed, so a run that failed before
        its first line leaves nothing (an empty file of a run that succeeded with no
        request to write, a process's empty share, stays)."""
        if self._fd is None:
            return
        try:
            if failed and self._created and self._written == 0 and \
                    os.fstat(self._fd).st_size == 0:
                with contextlib.suppress(OSError):
                    os.remove(self.path)  # still under the lock: `_open_locked` retries
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        self.close(failed=kind is not None)
