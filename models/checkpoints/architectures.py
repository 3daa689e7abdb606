"""Every architecture jaxsample loads: the one list the loaders dispatch on and quote.

Each family's loader module declares one `loader_core.Architecture` (its
transformers classes, its llama.cpp `general.architecture` names, its config
mappings and tensor tables); this module collects them. The "not supported"
messages of both formats and the README's table are computed from
`ARCHITECTURES`, so the list they name is the list that loads.
"""

from __future__ import annotations

from typing import Any

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import checks, gemma3_loader, llama_loader
from jaxsample.models.checkpoints.loader_core import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (llama_loader.ARCHITECTURE, gemma3_loader.GEMMA2,
                                            gemma3_loader.ARCHITECTURE)


def supported_hf_classes() -> list[str]:
    """The transformers `architectures` names that load, sorted."""
    return sorted(c for a in ARCHITECTURES for c in a.hf_classes)


def supported_gguf_archs() -> list[str]:
    """The GGUF `general.architecture` values that load, sorted."""
    return sorted(g for a in ARCHITECTURES for g in a.gguf_archs if a.config_from_gguf)


def for_gguf(meta: dict[str, Any], source: str) -> Architecture:
    """The family loader of a GGUF file's `general.architecture`.

    Raises:
      UnsupportedModelError: any other value, in one line naming the file,
        the value and `supported_gguf_archs()`.
    """
    arch = meta.get("general.architecture")
    for a in ARCHITECTURES:
        if isinstance(arch, str) and arch in a.gguf_archs and a.config_from_gguf is not None:
            return a
    raise UnsupportedModelError(f"{source}: architecture {checks.short_repr(arch)} is not "
                                f"supported; supported: {supported_gguf_archs()}")


def hf_architectures(hf: dict[str, Any], source: str) -> list[str]:
    """config.json's `architectures` as a list of strings (a lone string is accepted).

    Raises:
      ModelLoadError: not a list of strings.
    """
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{source}: config.json 'architectures' must be a list of "
                             f"strings, got {archs!r}")
    return archs


def for_hf(hf: dict[str, Any], source: str) -> tuple[Architecture, str]:
    """(family loader, class name) of a parsed config.json: the first listed class that loads.

    A class matching a family's `hf_prefixes` (Gemma 3's multimodal classes)
    goes to that family, which refuses it with its own reason.

    Raises:
      ModelLoadError: `architectures` is not a list of strings.
      UnsupportedModelError: no listed class loads; one line naming the
        directory, the classes and `supported_hf_classes()`.
    """
    archs = hf_architectures(hf, source)
    for name in archs:
        for a in ARCHITECTURES:
            if name in a.hf_classes:
                return a, name
    for name in archs:
        for a in ARCHITECTURES:
            if a.hf_prefixes and name.startswith(a.hf_prefixes):
                return a, name
    raise UnsupportedModelError(f"{source}: architectures {archs} not supported; supported: "
                                f"{supported_hf_classes()}")
