"""On-disk caches that make a second run start at once.

Two caches share one directory (`cache_dir()`):

    <cache dir>/xla/       JAX's persistent compilation cache: the compiled
                           prefill and decode programs (the engine's AOT
                           `jit(...).lower(...).compile()` goes through it too)
    <cache dir>/weights/   the dequantised weights of GGUF files, one
                           safetensors file per checkpoint, with the model
                           config and the tokenizer in its header

The directory is `$JAXSAMPLE_CACHE_DIR` if set, else
`$XDG_CACHE_HOME/jaxsample` (`~/.cache/jaxsample` without it).
`JAXSAMPLE_NO_CACHE=1` turns both caches off (the command line's
`--no-cache` does the same for one run).

Library code never changes JAX's global configuration by itself: the
compilation cache is turned on by an explicit call
(`jaxsample.enable_compilation_cache()`, which the command line makes). The
weight cache is used by `jaxsample.load` (`cache=` chooses; on by default).

Weight-cache entries are keyed by the GGUF file's size, modification time
and a SHA-256 of its first `HEADER_HASH_BYTES` bytes (the header: metadata
and tensor index), plus `FORMAT`. An entry that cannot be read, is
truncated, has a malformed header, belongs to another file or another
format version, or does not match the shapes the config implies is ignored
and rewritten, never an error. The tensor bytes themselves carry no checksum
(hashing 0.5 GB would cost the time the cache saves); the file is only ever
written whole under a temporary name and renamed into place, so a crash or a
concurrent writer leaves either the old entry or the new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import tempfile
import warnings
from typing import Any

import numpy as np

ENV_DIR = "JAXSAMPLE_CACHE_DIR"
ENV_OFF = "JAXSAMPLE_NO_CACHE"
FORMAT = "jaxsample-gguf-weights-1"  # bump when the cached layout or the loader's output changes
HEADER_HASH_BYTES = 16 * 2**20  # bytes of the GGUF hashed into the key (its header and more)
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
    explicit = os.environ.get(ENV_DIR, "").strip()
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = pathlib.Path(xdg) if xdg and os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return base / "jaxsample"


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


@dataclasses.dataclass(frozen=True)
class WeightKey:
    """What identifies one GGUF file's content for the weight cache.

    Attributes:
      source: the resolved path (for the entry's name and stale-entry cleanup).
      size: bytes. mtime_ns: modification time in nanoseconds.
      header_sha256: SHA-256 of the first `HEADER_HASH_BYTES` bytes.
    """

    source: str
    size: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def of(cls, path: str | os.PathLike) -> "WeightKey":
        """Raises OSError if the file cannot be read."""
        p = pathlib.Path(path)
        st = p.stat()
        with open(p, "rb") as f:
            digest = hashlib.sha256(f.read(HEADER_HASH_BYTES)).hexdigest()
        return cls(str(p), int(st.st_size), int(st.st_mtime_ns), digest)

    @property
    def digest(self) -> str:
        """The entry's name: size, mtime, header hash and FORMAT (not the path:
        identical copies share one entry)."""
        text = f"{FORMAT}|{self.size}|{self.mtime_ns}|{self.header_sha256}"
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def weights_entry(base: pathlib.Path, key: WeightKey) -> pathlib.Path:
    """The entry file of `key` under the cache directory `base`."""
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in pathlib.Path(key.source).stem)
    return base / "weights" / f"{stem[:64]}-{key.digest}.safetensors"


class CacheMiss(Exception):
    """An entry that is absent, unreadable, stale or malformed (never user-visible)."""


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


def store_weights(entry: pathlib.Path, key: WeightKey, cfg, params, tokenizer) -> bool:
    """Write one entry atomically (a temporary file renamed into place).

    Args:
      entry: `weights_entry(base, key)`.
      cfg: the model config of any family (stored as JSON with its family, dtype float32).
      params: the loader's stacked pytree of numpy float32 arrays.
      tokenizer: the `CheckpointTokenizer` (stored as its JSON and ids).
    Returns:
      True if written; False (and a warning) if the directory is not writable
      or the disk is full. Other entries of the same source file are removed.
    """
    import safetensors.numpy

    meta = {"format": FORMAT, "source": key.source, "size": str(key.size),
            "mtime_ns": str(key.mtime_ns), "header_sha256": key.header_sha256,
            "config": _config_to_json(cfg.replace(dtype="float32")),
            "tokenizer": _tokenizer_to_json(tokenizer)}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=entry.parent)
        os.close(fd)
        safetensors.numpy.save_file(_flatten(params), tmp, metadata=meta)
        os.replace(tmp, entry)
        tmp = None
    except Exception as e:  # noqa: BLE001  (OSError, a full disk, safetensors' own errors)
        warnings.warn(f"jaxsample: weight cache not written to {entry.parent}: {e}",
                      stacklevel=3)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _remove_stale(entry, key)
    return True


def _remove_stale(entry: pathlib.Path, key: WeightKey) -> None:
    """Remove the other entries written for the same source file (an older mtime or content)."""
    for other in entry.parent.glob("*.safetensors"):
        if other == entry:
            continue
        try:
            if _read_header(other)[1].get("source") == key.source:
                other.unlink()
        except (CacheMiss, OSError):
            continue


def _read_header(path: pathlib.Path) -> tuple[dict[str, Any], dict[str, str], int]:
    """(tensor entries, metadata, data start) of a safetensors file, or CacheMiss."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CacheMiss("short file")
            n = int.from_bytes(head, "little")
            if not 0 < n <= 100_000_000:  # safetensors' own header limit
                raise CacheMiss("bad header length")
            raw = f.read(n)
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


def load_weights(entry: pathlib.Path, key: WeightKey, tokenizer=None):
    """Read one entry: (cfg float32, stacked params of read-only numpy views, tokenizer).

    `tokenizer`: one already read from this entry (`read_cached_model`), so its
    JSON is not parsed again.

    The tensors are views of a read-only memory map of the entry (no copy;
    on CPU `jnp.asarray` can then alias them too). The entry is only ever
    replaced by renaming, never written in place, so the mapping stays valid.

    Raises:
      CacheMiss: absent, unreadable, stale (another key or FORMAT), truncated
        or malformed, or tensors that do not match the stored config.
    """
    from jaxsample.models import families

    header, meta, start = _read_header(entry)
    want = {"format": FORMAT, "size": str(key.size), "mtime_ns": str(key.mtime_ns),
            "header_sha256": key.header_sha256}
    if any(meta.get(k) != v for k, v in want.items()):
        raise CacheMiss("stale entry")
    try:
        cfg = _config_from_json(meta["config"])
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
      CacheMiss: absent, unreadable, stale or malformed.
    """
    _, meta, _ = _read_header(entry)
    want = {"format": FORMAT, "size": str(key.size), "mtime_ns": str(key.mtime_ns),
            "header_sha256": key.header_sha256}
    if any(meta.get(k) != v for k, v in want.items()):
        raise CacheMiss("stale entry")
    try:
        cfg = _config_from_json(meta["config"])
        tok = _tokenizer_from_json(meta["tokenizer"], key.source) if tokenizer else None
    except Exception as e:  # noqa: BLE001
        raise CacheMiss(str(e)) from None
    return cfg, tok


__all__ = ["cache_dir", "cache_disabled", "enable_compilation_cache", "WeightKey",
           "weights_entry", "load_weights", "store_weights", "read_cached_model", "CacheMiss",
           "ENV_DIR", "ENV_OFF", "FORMAT"]
