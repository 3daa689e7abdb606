"""Writing one cache file: atomically, never over a user's directory, with one warning line.

Shared by the caches (`jaxsample.disk_cache`, `weight_cache`, `xla_cache`,
`engine.exported`); `log` is the logger of every cache warning (one line each,
never an error).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import tempfile

log = logging.getLogger("jaxsample.disk_cache")


def atomic_write(path: pathlib.Path, data: bytes) -> bool:
    """Write `data` to a temporary file beside `path`, then rename it over `path`
    (a reader sees the old file or the new one, never a part). Creates the
    directory. Returns False (and leaves nothing behind) on an OSError, or when a
    directory that is not empty stands at `path` (`in_the_way`)."""
    tmp = None
    if in_the_way(path):
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


def in_the_way(path: pathlib.Path) -> bool:
    """True when a directory that is not empty stands where the cache file `path`
    goes: never ours to delete, so the file is not written and the caller says
    so. An empty directory is removed (the file can then be written)."""
    if not path.is_dir():
        return False
    with contextlib.suppress(OSError):
        path.rmdir()
    return path.is_dir()


def warn_in_the_way(what: str, path: pathlib.Path) -> None:
    """The one warning line for `in_the_way`."""
    log.warning("jaxsample: warning: %s %s is a directory, not a cache file; ignored and "
                "not rewritten (remove it to cache again)", what, path)
