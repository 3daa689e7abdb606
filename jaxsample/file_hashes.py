"""A file's SHA-256, computed once and remembered by the file's stat.

A GGUF's SHA-256 keys its weight cache entry (`jaxsample.weight_cache`) and
verifies a checkpoint assembled from several packages
(`models.checkpoints.registry`). `source_sha256` remembers it, in this process
and in `<cache dir>/weights/source-sha256.json`, by the file's (device, inode,
size, mtime, ctime), so a second run does not read the file again; a file
rewritten with its size and mtime kept has a new ctime and is hashed again.

Below both the caches (`jaxsample.disk_cache` reports and clears the index) and
the model folders (`jaxsample.models`); the cache directory itself is the
caller's (`jaxsample.cache_paths`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

from jaxsample.cache_files import atomic_write

HASH_BLOCK_BYTES = 8 * 2**20  # read and hash files in blocks of this many bytes


HASH_INDEX = "source-sha256.json"  # under weights/: stat id -> the GGUF's SHA-256


HASH_INDEX_MAX = 256  # hashes the index keeps (one per source path)


RACY_NS = 2 * 10**9  # a file changed this recently is hashed again next time (timestamp ticks)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 (hex) of a whole file, read in `HASH_BLOCK_BYTES` blocks (constant memory;
    hashlib releases the GIL). Raises OSError."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_BLOCK_BYTES)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def stat_id(st: os.stat_result) -> str:
    """(device, inode, size, mtime_ns, ctime_ns): what the hash index is keyed by. A
    rewrite keeps size and mtime at will (`cp -p`, `rsync -t`, `touch -r`), never the
    ctime, which only the kernel sets; a replaced file (rename) has a new inode."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


_HASHES: dict[str, str] = {}  # this process's remembered hashes: stat id -> sha256


def forget() -> None:
    """Drop this process's remembered hashes (the index on disk is the caller's to
    remove: `disk_cache.clear`)."""
    _HASHES.clear()


def _index_path(base: pathlib.Path) -> pathlib.Path:
    return base / "weights" / HASH_INDEX


def _read_index(base: pathlib.Path | None) -> dict[str, dict]:
    if base is None:
        return {}
    try:
        index = json.loads(_index_path(base).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _remember(base: pathlib.Path | None, sid: str, source: str, sha256: str) -> None:
    """Add one hash to the index (atomically replaced; a lost concurrent update only
    costs a rehash). The index keeps one hash per source path, `HASH_INDEX_MAX` in all."""
    _HASHES[sid] = sha256
    if base is None:
        return
    index = {k: v for k, v in _read_index(base).items()
             if isinstance(v, dict) and v.get("source") != source}
    index[sid] = {"source": source, "sha256": sha256}
    index = dict(list(index.items())[-HASH_INDEX_MAX:])
    atomic_write(_index_path(base), json.dumps(index, indent=0).encode())


def source_sha256(path: str | os.PathLike, base: pathlib.Path | None = None) -> tuple[str, bool]:
    """(SHA-256 of the whole file, whether it was remembered rather than computed).

    A hash is remembered (in this process, and in `<base>/weights/source-sha256.json`
    when `base` is given) by the file's `stat_id`, so a second run does not read the
    file again. It is not remembered while the file's mtime or ctime is less than
    `RACY_NS` older than the start of hashing ("racy git": a change within one
    timestamp tick would keep the stat id), nor if the file changed while it was read.

    Raises:
      OSError: the file cannot be read.
    """
    st = os.stat(path)
    sid = stat_id(st)
    if sid in _HASHES:
        return _HASHES[sid], True
    hit = _read_index(base).get(sid)
    if isinstance(hit, dict) and isinstance(hit.get("sha256"), str) and len(hit["sha256"]) == 64:
        _HASHES[sid] = hit["sha256"]
        return hit["sha256"], True
    started = time.time_ns()
    sha256 = file_sha256(path)
    if stat_id(os.stat(path)) == sid and max(st.st_mtime_ns, st.st_ctime_ns) < started - RACY_NS:
        _remember(base, sid, str(path), sha256)
    return sha256, False
