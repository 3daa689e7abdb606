"""What the cache directory holds: JAX's compilation cache, the exported programs, and a report.

One directory (`jaxsample.cache_paths.cache_dir()`) holds, beside the
checkpoints that are assembled rather than shipped whole:

    <cache dir>/xla/       JAX's persistent compilation cache: the compiled
                           prefill and decode programs (the engine's AOT
                           `jit(...).lower(...).compile()` goes through it too)
    <cache dir>/exported/  the engine's programs as StableHLO (`jax.export`),
                           so a second process skips tracing and lowering
                           (`jaxsample.engine.exported`); written beside
                           `xla/` when `enable_compilation_cache` turned it on
    <cache dir>/weights/   the dequantised weights of GGUF files
                           (`jaxsample.weight_cache`) and the GGUFs' remembered
                           SHA-256 (`jaxsample.file_hashes`)
    <cache dir>/models/    checkpoints assembled from several packages (Gemma 3
                           270M: `models.checkpoints.registry`), written once,
                           also with the caches off (`cache_paths.models_dir()`)
    <cache dir>/kernels/   the int8 CPU kernels built here
                           (`models.cpu_kernels.cpu_kernels`)

Where the directory is (`$JAXSAMPLE_CACHE_DIR`, `$XDG_CACHE_HOME`, and
`JAXSAMPLE_NO_CACHE=1`, which turns every cache off) is `jaxsample.cache_paths`,
which the model folders read too. `JAXSAMPLE_NO_EXPORTED=1` turns off only the
exported programs (`exported_dir`). Library code never changes JAX's global
configuration by itself: the compilation cache is turned on by an explicit call
(`jaxsample.enable_compilation_cache()`, which the command line makes).
`cache_info` and `clear` report and empty the directory (`jaxsample cache
info|clear`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import time
import warnings
from typing import Any

from jaxsample import cache_paths, file_hashes, xla_cache
from jaxsample.cache_files import atomic_write, in_the_way, log, warn_in_the_way  # noqa: F401

ENV_NO_EXPORTED = "JAXSAMPLE_NO_EXPORTED"


STALE_TMP_S = 3600.0  # a temporary entry file older than this was left by a writer that died


_EXPORTED: list[pathlib.Path] = []  # the exported programs' directory, once turned on


def exported_dir() -> pathlib.Path | None:
    """Where the engine reads and writes exported programs, or None: off unless
    `enable_compilation_cache` turned it on, and off while `JAXSAMPLE_NO_CACHE`
    or `JAXSAMPLE_NO_EXPORTED` is set (read at every lookup)."""
    if not _EXPORTED or cache_paths.cache_disabled() or cache_paths.env_flag(ENV_NO_EXPORTED):
        return None
    return _EXPORTED[-1]


def enable_compilation_cache(path: str | os.PathLike | None = None, *,
                             min_compile_time_s: float = 0.0,
                             exported: bool | str | os.PathLike = True
                             ) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache (process-wide), so a second
    process reuses the compiled prefill and decode programs instead of
    compiling them again.

    This changes global JAX configuration (`jax_compilation_cache_dir` and
    the two thresholds below), which is why jaxsample never does it on
    import: call it once, early, in the program that wants it. Ahead-of-time
    compilation (`jax.jit(f).lower(...).compile()`, what the engine's
    `PROGRAMS` use) reads and writes the same cache as plain `jit`.

    Args:
      path: the directory; default `cache_paths.cache_dir() / "xla"`. Created if missing.
      min_compile_time_s: programs that compile faster than this (seconds) are
        not written (JAX's own default is 1 s; 0 caches every program, so the
        small ones that add up on a second run are skipped too).
      exported: also keep the engine's programs exported (`jax.export`), so a
        second process skips tracing and lowering them too
        (`jaxsample.engine.exported`): True puts them in
        `cache_paths.cache_dir() / "exported"` (nothing with `JAXSAMPLE_NO_CACHE`), a path
        there, False not at all. Only when the compilation cache was turned
        on (a second process would compile them again otherwise).

    Returns:
      The directory in use, or None when caching is off (`JAXSAMPLE_NO_CACHE`
      and no explicit `path`) or the directory cannot be created (one warning
      line says why; never an error: the run only gets slower). A directory
      that cannot be written is still read (one warning line).

    Raises:
      ConfigError: `path` or `exported` names an unknown home (`~nosuchuser`).

    An entry JAX cannot read (corrupt, truncated) is compiled again and
    rewritten (`xla_cache.rewrite_unreadable_entries`; JAX itself keeps the old file).
    """
    base = cache_paths.cache_dir()
    if path is None:
        if base is None:
            return None
        path = base / "xla"
    path = cache_paths.expand(path, "enable_compilation_cache(path=...)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("jaxsample: warning: compilation cache off: cannot create %s: %s", path,
                    " ".join(str(e).split()))
        return None
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:  # read what is there; JAX would warn twice per program it writes
        log.warning("jaxsample: warning: compilation cache read-only: cannot write %s: %s; "
                    "programs it lacks are compiled, not cached", path,
                    " ".join(str(e).split()))
        warnings.filterwarnings("ignore", message="Error writing persistent compilation cache")
    import jax

    try:  # a cache already opened on another directory must be re-opened (private API)
        from jax._src import compilation_cache as _cc

        if _cc.is_initialized() and jax.config.jax_compilation_cache_dir != str(path):
            _cc.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        pass
    if xla_cache.rewrite_unreadable_entries():  # then JAX's two-line warning repeats ours
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    if exported is False or (exported is True and base is None):
        _EXPORTED.clear()
    else:
        _EXPORTED[:] = [base / "exported" if exported is True
                        else cache_paths.expand(exported, "enable_compilation_cache(exported=...)")]
    return path


class CacheMiss(Exception):
    """An entry that is unreadable, stale or malformed (never user-visible)."""


class CacheAbsent(CacheMiss):
    """No entry (the normal first load: nothing to warn about)."""


def read_header(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor entries, metadata, data start) of a safetensors file, or CacheMiss
    (CacheAbsent when there is no file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CacheMiss("short file")
            n = int.from_bytes(head, "little")
            if not 0 < n <= 100_000_000:  # safetensors' own header limit
                raise CacheMiss("bad header length")
            raw = f.read(n)
    except (FileNotFoundError, NotADirectoryError):  # a file where a directory would be: none
        raise CacheAbsent("no entry") from None
    except OSError as e:
        raise CacheMiss(str(e)) from None
    if len(raw) != n:
        raise CacheMiss("truncated header")
    try:
        header = json.loads(raw)
    except ValueError:
        raise CacheMiss("header is not JSON") from None
    if not isinstance(header, dict):
        raise CacheMiss("header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise CacheMiss("metadata is not an object")
    return header, meta, 8 + n


def _files(d: pathlib.Path):
    try:
        return sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink())
    except OSError:
        return []


def cache_info(base: pathlib.Path | None = None) -> dict[str, Any]:
    """What the cache directory holds, read from the disk (nothing created).

    Args:
      base: the cache directory; default `cache_paths.cache_root()` (whether or not
        `JAXSAMPLE_NO_CACHE` is set: it reports what is there).
    Returns:
      {"dir": str, "exists": bool, "disabled": bool (JAXSAMPLE_NO_CACHE),
       "weights": [{"file", "source" (the GGUF it was made from, or None for a
       file that is not a readable entry), "format", "bytes", "age_s"
       (seconds since written)}], "weights_bytes",
       "compiled_programs" (JAX's `*-cache` files), "compiled_bytes",
       "exported_programs" (`*.jaxexport` files), "exported_bytes",
       "models": [{"file", "bytes", "age_s"}], "models_bytes",
       "kernels_bytes" (the int8 CPU kernels built here, `kernels/`),
       "total_bytes" (every file under the directory)}; bytes are file sizes.
    """
    base = pathlib.Path(base) if base is not None else cache_paths.cache_root()
    now = time.time()
    weights, models = [], []
    for p in _files(base / "weights"):
        if p.suffix != ".safetensors":
            continue
        try:
            meta = read_header(p)[1]
        except CacheMiss:
            meta = {}
        st = p.stat()
        weights.append({"file": str(p), "source": meta.get("source"),
                        "format": meta.get("format"), "bytes": st.st_size,
                        "age_s": max(0.0, now - st.st_mtime)})
    for p in _files(base / "models"):
        st = p.stat()
        models.append({"file": str(p), "bytes": st.st_size, "age_s": max(0.0, now - st.st_mtime)})
    compiled = [p for p in _files(base / "xla") if p.name.endswith("-cache")]
    exported = [p for p in _files(base / "exported") if p.name.endswith(".jaxexport")]
    total = 0
    if base.is_dir():
        for root, _, names in os.walk(base):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
    return {"dir": str(base), "exists": base.is_dir(), "disabled": cache_paths.cache_disabled(),
            "weights": weights, "weights_bytes": sum(w["bytes"] for w in weights),
            "compiled_programs": len(compiled),
            "compiled_bytes": sum(p.stat().st_size for p in _files(base / "xla")),
            "exported_programs": len(exported),
            "exported_bytes": sum(p.stat().st_size for p in _files(base / "exported")),
            "models": models, "models_bytes": sum(m["bytes"] for m in models),
            "kernels_bytes": sum(p.stat().st_size for p in _files(base / "kernels")
                                 if _OURS["kernels"](p.name)),
            "total_bytes": total}


CLEAR_PARTS = ("weights", "compiled", "exported", "models", "kernels")


_PART_DIRS = {"weights": "weights", "compiled": "xla", "exported": "exported",
              "models": "models", "kernels": "kernels"}


def clear(parts=CLEAR_PARTS, base: pathlib.Path | None = None) -> int:
    """Delete parts of the cache directory: "weights" (`weights/`, its hash index
    included), "compiled" (`xla/`), "exported" (`exported/`), "models"
    (`models/`: re-assembled on the next load, seconds), "kernels" (`kernels/`,
the int8 CPU kernels: rebuilt on the next int8 load, seconds). Only the files the
    caches write are removed (`_OURS`: entries, their temporary files, JAX's
    `-cache` / `-atime` files); anything else, and the folder holding it, is left
    (a cache directory shared with other files loses none of them).

    Args:
      parts: a subset of `CLEAR_PARTS`.
      base: the cache directory; default `cache_paths.cache_root()`.
    Returns:
      The bytes freed.
    Raises:
      ValueError: an unknown part. OSError: a file that cannot be removed.
    """
    bad = [p for p in parts if p not in CLEAR_PARTS]
    if bad:
        raise ValueError(f"cache parts must be among {list(CLEAR_PARTS)}, got {bad}")
    base = pathlib.Path(base) if base is not None else cache_paths.cache_root()
    freed = 0
    for part in dict.fromkeys(parts):
        d = base / _PART_DIRS[part]
        if d.is_symlink() or not d.is_dir():
            continue
        for p in _files(d):
            if _OURS[part](p.name):
                freed += p.stat().st_size
                p.unlink()
        with contextlib.suppress(OSError):
            d.rmdir()  # only when nothing else is in it
    file_hashes.forget()
    return freed


# The files each part's writer makes (entries and their temporary files), the
# only ones `clear` removes.
_OURS = {
    "weights": lambda n: n.endswith((".safetensors", ".tmp")) or n == file_hashes.HASH_INDEX,
    "compiled": lambda n: n.endswith(("-cache", "-atime", ".tmp")) or n == ".lockfile",
    "exported": lambda n: n.endswith((".jaxexport", ".tmp")),
    "models": lambda n: n.endswith((".gguf", ".tmp")),
    "kernels": lambda n: n.startswith("cpu_kernels-") and n.endswith((".so", ".sha256", ".tmp")),
}
