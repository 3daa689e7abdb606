"""Load a GGUF file (llama.cpp's format) of any supported architecture.

Every tensor is dequantised to float32 with `gguf.quants.dequantize` (any
quantisation the `gguf` package implements: F32, F16, BF16, Q4_0/1, Q5_0/1,
Q8_0, K-quants, ...) and copied by `loader_core.copy_tensors` through the
family's tensor table (llama.cpp's names) into the stacked parameter pytree
of the family's `param_shapes`, transposed from GGUF's `[out, in]` rows to
our `[in, out]`. `general.architecture` picks the family
(`models.checkpoints.architectures.for_gguf`); the family's loader module holds its
metadata rules (`models.checkpoints.llama_config.config_from_gguf`,
`models.checkpoints.gemma3_loader.config_from_gguf_metadata`).
"""

from __future__ import annotations

import os
from typing import Any

from jaxsample.errors import ModelLoadError
from jaxsample.models.checkpoints import architectures, loader_core
from jaxsample.models.checkpoints.loader_core import (  # noqa: F401
    dequantize_tensor,
    permute_rope_rows,
    read_gguf,
    unpermute_rope_rows,
)
from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                         dtype: str = "float32"):
    """The config (`LlamaConfig`, `Gemma3Config`, ...) a GGUF file's metadata describes.

    Args:
      meta: key -> value from `read_gguf`.
      tensors: tensor name -> `gguf.ReaderTensor` (shapes; `rope_freqs`).
      source: the file, for messages.
    Raises:
      UnsupportedModelError: an architecture not in `architectures.supported_gguf_archs()`
        (one line naming them), or an option the family does not implement.
      ModelLoadError: a missing key, or one of the wrong type, out of range or
        inconsistent; the message names the file and the key.
    """
    arch = architectures.for_gguf(meta, source)
    return arch.config_from_gguf(meta, tensors, source, dtype=dtype)


def load_gguf_params(reader, meta: dict[str, Any], cfg, source: str) -> dict[str, Any]:
    """Dequantise and copy every tensor into the family's stacked `[in, out]` pytree (numpy float32).

    Raises:
      ModelLoadError: a tensor is missing, misshapen or holds NaN or inf;
        UnsupportedModelError: a tensor the model has no place for.
    """
    arch = architectures.for_gguf(meta, source)
    by_name = {t.name: t for t in reader.tensors}
    return loader_core.copy_tensors(arch.family, cfg, arch.gguf_table(cfg), list(by_name),
                                    lambda name: dequantize_tensor(by_name[name], source), source)


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32", header=None):
    """Load a GGUF checkpoint: config, dequantised parameters and tokenizer.

    Args:
      path: the `.gguf` file.
      dtype: "float32" or "bfloat16" for the parameters.
      header: optional `(reader, metadata)` from an earlier `read_gguf(path)` of
        the same file, so the header is not parsed twice.
    Returns:
      (cfg of the file's family, params pytree of numpy float32 `[in, out]`
       arrays, tokenizer `CheckpointTokenizer`).
    Raises:
      ModelLoadError / UnsupportedModelError: see `read_gguf`,
        `config_from_metadata`, `load_gguf_params`; every message names the file.
    """
    source = str(path)
    reader, meta = header if header is not None else read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = config_from_metadata(meta, tensors, source, dtype=dtype)
    tokenizer = CheckpointTokenizer.from_gguf_metadata(meta, source)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {cfg.vocab_size} rows")
    params = load_gguf_params(reader, meta, cfg, source)
    return cfg, params, tokenizer
