"""The weight cache: dequantised GGUF weights as one safetensors file per checkpoint.

Used by `jaxsample.load` (`cache=` chooses; on by default). An entry holds the
float32 weights in the loader's stacked layout, with the model config and the
tokenizer in its header, keyed by the SHA-256 of the whole GGUF file and its
size (`jaxsample.file_hashes.source_sha256`), plus `FORMAT`. `load(weights="int8")`
keeps a second entry per file (`int8_entry`): the int8 weights, their scales
and calibrated outlier channels (`models.quantization.quant.quantize_params`), keyed also by
`INT8_FORMAT` and the calibration recipe (`models.quantization.outliers.RECIPE`), so a second
int8 load skips the calibration forward and the quantisation. Each entry carries
the CRC-32 of every tensor's bytes and the SHA-256 of its metadata (config,
tokenizer, int8 layout: `meta_digest`), checked when it loads. An entry that
cannot be read, is truncated, has a malformed or changed header, belongs to
another file, format version or recipe, fails its CRC-32 check, or whose
tensors do not match the shapes the config implies (or, int8, the layout
`quantize_params` writes) is ignored (one warning line on stderr, logger
`jaxsample.disk_cache`) and rewritten, never an error. The file is only ever
written whole under a temporary name and renamed into place, so a crash or a
concurrent writer leaves either the old entry or the new one; one path keeps
one entry (writing a new content's entry removes the older one of the same
path and kind).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib
import tempfile
import time
import zlib
from typing import Any

import numpy as np

from jaxsample import disk_cache
from jaxsample.disk_cache import STALE_TMP_S, CacheMiss, log, read_header
from jaxsample.file_hashes import HASH_BLOCK_BYTES, source_sha256

FORMAT = "jaxsample-gguf-weights-3"  # bump when the cached layout or the loader's output changes
INT8_FORMAT = "jaxsample-int8-weights-4"  # bump when quantize_params' output or its layout changes


WEIGHT_CACHE_MIN_BYTES = 16 * 2**20  # smaller GGUF files dequantise fast: not cached


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
    return base / "weights" / f"{_stem(key)}-{key.digest}.safetensors"


def int8_entry(base: pathlib.Path, key: WeightKey) -> pathlib.Path:
    """The int8 entry of `key` (`load(weights="int8")`) under the cache directory `base`."""
    digest = hashlib.sha256("|".join(_int8_meta(key).values()).encode()).hexdigest()[:24]
    return base / "weights" / f"{_stem(key)}-int8-{digest}.safetensors"


def _stem(key: WeightKey) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in pathlib.Path(key.source).stem)
    return stem[:64]


def warn_bad_entry(entry: pathlib.Path, source: str, reason: str) -> None:
    """The one line on stderr (logger `jaxsample.disk_cache`, WARNING) for an entry that
    exists but cannot be used; without a logging configuration, Python prints it bare.
    A directory that is not empty at the entry's path is named as such (it is never
    rewritten: `disk_cache.in_the_way`)."""
    if disk_cache.in_the_way(entry):
        disk_cache.warn_in_the_way("weight cache entry", entry)
        return
    log.warning("jaxsample: warning: weight cache entry %s is unusable (%s); ignored: reading "
                "%s again and rewriting it", entry, " ".join(str(reason).split())[:200], source)


def _config_to_json(cfg) -> str:
    return json.dumps({"family": cfg.family, **dataclasses.asdict(cfg)}, sort_keys=True)


def _config_from_json(text: str):
    from jaxsample.models.families import gemma3, llama

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

    from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer

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


def _int8_meta(key: WeightKey) -> dict[str, str]:
    from jaxsample.models.quantization import outliers

    return {"format": INT8_FORMAT, "size": str(key.size), "source_sha256": key.sha256,
            "recipe": outliers.RECIPE}


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
      or the disk is full. The other entries of the same source path and kind
      (an older content of the file) are then removed: one entry per path.
    """
    return _write_entry(entry, key, _flatten(params), _key_meta(key), cfg, tokenizer)


def store_int8(entry: pathlib.Path, key: WeightKey, cfg, params, tokenizer) -> bool:
    """`store_weights` for int8 weights: `params` is `quant.quantize_params`' output
    (list layout, numpy leaves, float leaves float32); the entry holds each
    `QuantizedWeight`'s q (int8), scale, and outlier channels (int32 idx, float32
    keep and w) as `<name>.<field>` tensors and its orientation in the metadata.
    Its key adds `INT8_FORMAT` and the calibration recipe
    (`models.quantization.outliers.RECIPE`)."""
    flat, kinds = _flatten_int8(params)
    return _write_entry(entry, key, flat, {**_int8_meta(key), "quantized": json.dumps(kinds)},
                        cfg, tokenizer)


def _write_entry(entry, key, flat, meta, cfg, tokenizer) -> bool:
    import safetensors.numpy

    meta = {**meta, "source": key.source,
            "tensor_crc32": json.dumps({name: _crc32(a) for name, a in flat.items()},
                                       sort_keys=True),
            "config": _config_to_json(cfg.replace(dtype="float32")),
            "tokenizer": _tokenizer_to_json(tokenizer)}
    meta["meta_sha256"] = meta_digest(meta)
    tmp = None
    if disk_cache.in_the_way(entry):  # said when it was read (`warn_bad_entry`)
        return False
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=entry.name + ".", suffix=".tmp", dir=entry.parent)
        os.close(fd)
        safetensors.numpy.save_file(flat, tmp, metadata=meta)
        os.replace(tmp, entry)
        tmp = None
    except Exception as e:  # noqa: BLE001  (OSError, a full disk, safetensors' own errors)
        log.warning("jaxsample: warning: weight cache not written to %s: %s", entry.parent,
                    " ".join(str(e).split())[:200])
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _remove_stale(entry, key.source, meta["format"])
    return True


def _remove_stale(entry: pathlib.Path, source: str, fmt: str) -> None:
    """Remove the other entries of the same kind (float32 or int8: the format's
    prefix) written for the same source path (an older content, an older format
    or recipe), and temporary files left by a writer that died (older than
    `STALE_TMP_S`: a live writer renames its file within seconds)."""
    kind = _kind(fmt)
    now = time.time()
    for other in entry.parent.iterdir():
        if other == entry:
            continue
        try:
            if other.name.endswith(".tmp"):
                if now - other.stat().st_mtime > STALE_TMP_S:
                    other.unlink()
            elif other.suffix == ".safetensors":
                meta = read_header(other)[1]
                if meta.get("source") == source and _kind(meta.get("format", "")) == kind:
                    other.unlink()
        except (CacheMiss, OSError):
            continue


def meta_digest(meta: dict[str, str]) -> str:
    """SHA-256 of an entry's metadata other than itself (the config, tokenizer and
    layout that the tensors' CRC-32s do not cover), stored as "meta_sha256"."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _read_meta(entry: pathlib.Path, want: dict[str, str]):
    """`read_header` with the key and the metadata's own SHA-256 checked."""
    header, meta, start = read_header(entry)
    _check_key(meta, want)
    if meta.get("meta_sha256") != meta_digest(meta):
        raise CacheMiss("its metadata (config, tokenizer or layout) changed since it was written")
    return header, meta, start


def _kind(fmt: str) -> str:
    return "int8" if fmt.startswith("jaxsample-int8-") else "float32"


def _check_key(meta: dict[str, str], want: dict[str, str]) -> None:
    if any(meta.get(k) != v for k, v in want.items()):
        raise CacheMiss("written for another file, format or calibration recipe")


_DTYPES = {"F32": np.float32, "I8": np.int8, "I32": np.int32}


def _map_entry(entry: pathlib.Path, key: WeightKey, want: dict[str, str], tokenizer,
               dtypes: tuple[str, ...], verify: bool):
    """(cfg, flat {name: read-only view}, tokenizer, metadata) of one entry whose
    tensors have one of `dtypes`; raises CacheAbsent / CacheMiss as `load_weights`."""
    header, meta, start = _read_meta(entry, want)
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
            dt = np.dtype(_DTYPES[spec["dtype"]]) if spec["dtype"] in dtypes else None
            ok = (dt is not None and 0 <= lo <= hi and start + hi <= size
                  and all(d >= 0 for d in shape)
                  and hi - lo == dt.itemsize * int(np.prod(shape, dtype=np.int64)))
            if ok:
                flat[name] = np.frombuffer(mm, dt, (hi - lo) // dt.itemsize,
                                           start + lo).reshape(shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CacheMiss(f"bad tensor entry {name!r}")
    if verify:
        _verify_crc32(flat, crcs)
    return cfg, flat, tokenizer, meta


def load_weights(entry: pathlib.Path, key: WeightKey, tokenizer=None, *, verify: bool = True):
    """Read one entry: (cfg float32, stacked params of read-only numpy views, tokenizer).

    `tokenizer`: one already read from this entry (`read_cached_model`), so its
    JSON is not parsed again.

    The tensors are views of a read-only memory map of the entry (no copy;
    on CPU `jnp.asarray` can then alias them too). The entry is only ever
    replaced by renaming, never written in place, so the mapping stays valid.
    With `verify` (the default), every tensor's CRC-32 is checked against the
    one stored when the entry was written (what that costs:
    docs/how-to/caches.md).

    Raises:
      CacheAbsent: no entry.
      CacheMiss: unreadable, stale (another key or FORMAT), truncated or
        malformed, a tensor whose bytes changed since it was written (a CRC-32
        mismatch), or tensors that do not match the stored config.
    """
    from jaxsample.models.families import families

    cfg, flat, tokenizer, _ = _map_entry(entry, key, _key_meta(key), tokenizer, ("F32",), verify)
    params = _unflatten(flat)
    try:
        families.module_for(cfg).check_params(cfg, params, str(entry))
    except (ValueError, KeyError, TypeError) as e:
        raise CacheMiss(str(e)) from None
    return cfg, params, tokenizer


def load_int8(entry: pathlib.Path, key: WeightKey, *, verify: bool = True):
    """Read one int8 entry (`store_int8`): (cfg float32, list-layout params with
    `QuantizedWeight`s of read-only numpy views, float leaves float32, tokenizer).

    Raises:
      CacheAbsent: no entry.
      CacheMiss: as `load_weights`, and for another `INT8_FORMAT` or calibration
        recipe, or int8 weights whose parts disagree with each other or the config.
    """
    from jaxsample.models.families import families

    cfg, flat, tokenizer, meta = _map_entry(entry, key, _int8_meta(key), None,
                                            ("F32", "I8", "I32"), verify)
    try:
        params = _unflatten_int8(flat, json.loads(meta["quantized"]))
        family = families.module_for(cfg)
        family.check_params(cfg, _shape_view(params, family.param_shapes(cfg)), str(entry))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CacheMiss(f"bad int8 weights: {e}") from None
    return cfg, params, tokenizer


_QW_FIELDS = ("q", "scale", "idx", "keep", "w_out")


def _flatten_int8(params) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """List-layout params -> ({"embed.q": .., "layers.3.wq.scale": .., "final_norm": ..},
    {"embed": {"rows": .., "transposed": ..}, ...} for each QuantizedWeight)."""
    from jaxsample.models.quantization import quant

    flat, kinds = {}, {}

    def put(name, a):
        if isinstance(a, quant.QuantizedWeight):
            kinds[name] = {"rows": a.rows, "transposed": a.transposed}
            parts = (a.q, a.scale) + (tuple(a.outliers) if a.outliers is not None else ())
            flat.update({f"{name}.{f}": np.ascontiguousarray(v)
                         for f, v in zip(_QW_FIELDS, parts)})
        else:
            flat[name] = np.ascontiguousarray(np.asarray(a).astype(np.float32))

    for k, v in params.items():
        if k == "layers":
            for i, lp in enumerate(v):
                for name, a in lp.items():
                    put(f"layers.{i}.{name}", a)
        else:
            put(k, v)
    return flat, kinds


def _unflatten_int8(flat: dict[str, np.ndarray], kinds: dict[str, dict]):
    """`_flatten_int8` inverted (with checks: ValueError/KeyError on any mismatch)."""
    from jaxsample.models.quantization import quant

    parts: dict[str, dict] = {name: {} for name in kinds}
    leaves: dict[str, Any] = {}
    for name, a in flat.items():
        base, _, field = name.rpartition(".")
        if base in kinds and field in _QW_FIELDS:
            parts[base][field] = a
        else:
            leaves[name] = a
    for name, kind in kinds.items():
        p = parts[name]
        kept = (p["idx"], p["keep"], p["w_out"]) if "idx" in p else None
        # As quantize_params stores them: the embedding per row, an untied head per
        # column, every projection [out, in] used transposed.
        want = {"embed": (True, False), "lm_head": (False, False)}.get(name, (True, True))
        if (kind["rows"], kind["transposed"]) != want or not name.startswith(
                ("embed", "lm_head", "layers.")):
            raise ValueError(f"{name}: rows/transposed {kind['rows']!r}/"
                             f"{kind['transposed']!r}, expected {want[0]}/{want[1]}")
        w = quant.QuantizedWeight(p["q"], p["scale"], kept, rows=want[0], transposed=want[1])
        quant.check_quantized(w, name)
        leaves[name] = w
    params: dict[str, Any] = {}
    layers: dict[int, dict] = {}
    for name, a in leaves.items():
        if name.startswith("layers."):
            i, _, key = name[len("layers."):].partition(".")
            layers.setdefault(int(i), {})[key] = a
        else:
            params[name] = a
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"layers {sorted(layers)} are not 0..{len(layers) - 1}")
    params["layers"] = [layers[i] for i in range(len(layers))]
    return params


def _shape_view(params, want):
    """The params with each QuantizedWeight as a shape and each fused projection
    (`common.FUSED`) as its members' shapes, split by `want` (the family's
    `param_shapes`), for `check_params`."""
    import jax

    from jaxsample.models.families import common
    from jaxsample.models.quantization import quant

    is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731
    view = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, np.float32) if is_q(a) else a, params,
        is_leaf=is_q)
    layers = []
    for lp in view["layers"]:
        lp = dict(lp)
        for fused, members in common.FUSED.items():
            if fused in lp:
                a = lp.pop(fused)
                outs = [want["layers"][m][-1] for m in members]
                if sum(outs) != a.shape[-1]:
                    raise ValueError(f"{fused} has shape {list(a.shape)}, not its parts' "
                                     f"{outs} outputs side by side")
                lp.update({m: jax.ShapeDtypeStruct(a.shape[:-1] + (o,), a.dtype)
                           for m, o in zip(members, outs)})
        layers.append(lp)
    return {**view, "layers": layers}


def read_cached_model(entry: pathlib.Path, key: WeightKey, *, tokenizer: bool = True):
    """(config float32, tokenizer or None) stored in an entry, without touching its
    tensors (milliseconds; the tokenizer adds about 0.1 s).

    Raises:
      CacheAbsent: no entry. CacheMiss: unreadable, stale or malformed.
    """
    _, meta, _ = _read_meta(entry, _key_meta(key))
    try:
        cfg = _config_from_json(meta["config"])
        tok = _tokenizer_from_json(meta["tokenizer"], key.source) if tokenizer else None
    except Exception as e:  # noqa: BLE001
        raise CacheMiss(str(e)) from None
    return cfg, tok
