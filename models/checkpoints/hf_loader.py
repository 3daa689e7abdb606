"""Load a Hugging Face model directory (config.json + *.safetensors + tokenizer.json).

config.json's `architectures` picks the family (`models.checkpoints.architectures.for_hf`;
the list is `architectures.supported_hf_classes()`), whose loader module
holds its config rules and tensor table (`models.checkpoints.llama_loader`,
`models.checkpoints.gemma3_loader`). Weights are read with the `safetensors` package as
numpy (BF16, which numpy lacks, is widened to float32 from the raw bytes)
and copied by `loader_core.copy_tensors`, transposed from PyTorch's
`Linear.weight [out, in]` to our `[in, out]`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError
from jaxsample.models.checkpoints import architectures, loader_core
from jaxsample.models.checkpoints.loader_core import json_kind
from jaxsample.models.checkpoints.tokenizer import CheckpointTokenizer


def config_from_hf(hf: dict[str, Any], source: str, dtype: str = "float32"):
    """The config (`LlamaConfig`, `Gemma3Config`, ...) a parsed config.json describes.

    Raises:
      ModelLoadError: the top level is not an object, `architectures` is not
        a list of strings, or a key is missing, of the wrong type, out of
        range or inconsistent (the family's rules: `llama_config.config_from_hf`, ...).
      UnsupportedModelError: no listed class is supported (one line naming
        `architectures.supported_hf_classes()`), or an option the family does
        not implement.
    """
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{source}: config.json: the top level must be a JSON object, "
                             f"got a JSON {json_kind(hf)}")
    arch, name = architectures.for_hf(hf, source)
    return arch.config_from_hf(hf, source, dtype=dtype, arch_name=name)


def read_config_json(path: pathlib.Path) -> dict[str, Any]:
    """The parsed config.json of a model directory.

    Raises:
      ModelLoadError: absent, unreadable, not JSON or not a JSON object.
    """
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise ModelLoadError(f"{cfg_path}: the top level must be a JSON object, "
                             f"got a JSON {json_kind(hf)}")
    return hf


def load_hf_dir(path: str | os.PathLike, *, dtype: str = "float32"):
    """Load a Hugging Face model directory.

    Args:
      path: a directory with config.json, one or more *.safetensors and tokenizer.json.
      dtype: "float32" or "bfloat16" for the parameters.
    Returns:
      (cfg of the declared family, params pytree of numpy float32 `[in, out]`
       arrays, tokenizer `CheckpointTokenizer`).
    Raises:
      ModelLoadError / UnsupportedModelError naming the directory or file.
    """
    path = pathlib.Path(path)
    source = str(path)
    hf = read_config_json(path)
    arch, name = architectures.for_hf(hf, source)
    cfg = arch.config_from_hf(hf, source, dtype=dtype, arch_name=name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (PyTorch .bin files are not supported)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(loader_core.read_safetensors(f))
    tokenizer = CheckpointTokenizer.from_hf_dir(path)

    def fetch(name):
        return loader_core.finite(np.asarray(tensors[name], np.float32), name, source)

    params = loader_core.copy_tensors(arch.family, cfg, arch.hf_table(cfg), list(tensors), fetch,
                                      source)
    return cfg, params, tokenizer
