"""Boundary checks of the reducers' `[B, N]` inputs (shapes are static, so they also run under jit/vmap)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def host_array(name: str, x: Any) -> Any:
    """`x` as an array without any 64 -> 32-bit cast: numpy for concrete input
    (a jax array or tracer is returned as is). Strings, objects and ragged
    lists raise a ValueError naming `name`."""
    if isinstance(x, jax.Array):
        return x
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a [B, N] numeric array; got {type(x).__name__} ({e})") from None
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be a [B, N] numeric array; got dtype {arr.dtype}")
    return arr


def check_2d(name: str, x: Any) -> jax.Array:
    x = host_array(name, x)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape [B, N] (prompts, branches); got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one branch (N >= 1); got shape {tuple(x.shape)}")
    return x


def check_like(name: str, x: Any, shape: tuple[int, ...], ref: str) -> jax.Array:
    x = host_array(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {ref} {tuple(shape)}; got shape {tuple(x.shape)}")
    return x


def check_valid(valid: Any, shape: tuple[int, ...], ref: str) -> jax.Array:
    if valid is None:
        return jnp.ones(shape, dtype=bool)
    valid = check_like("valid", valid, shape, ref)
    if valid.dtype != jnp.bool_:
        raise ValueError(f"valid must be a bool array; got dtype {valid.dtype}")
    return valid


def check_real(name: str, x: jax.Array) -> None:
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise ValueError(f"{name} must be a real (float or int) array; got dtype {x.dtype}")


def exact_ranks(scores: np.ndarray) -> np.ndarray:
    """Host-side dense ranks per row (int32; equal scores equal ranks, NaN stays NaN).

    Scores whose dtype does not fit the jitted kernel exactly (float64, 64-bit
    ints) become their ranks, so `[[1.0, 1.0 + 1e-9]]` or `[[1e300, 1e301]]`
    keep their order and ties instead of collapsing in a float32 cast."""
    x = scores.astype(np.float64) if np.issubdtype(scores.dtype, np.floating) else scores
    out = np.full(x.shape, np.nan, dtype=np.float32)
    for b in range(x.shape[0]):
        row = x[b]
        ok = ~np.isnan(row) if np.issubdtype(row.dtype, np.floating) else np.ones(row.shape, bool)
        if not ok.any():
            continue
        # np.unique on exact values: equal scores share a rank.
        _, inv = np.unique(row[ok], return_inverse=True)
        out[b, ok] = inv.astype(np.float32)
    return out


def fits_32(x: np.ndarray) -> bool:
    """Whether the kernel's 32-bit dtype holds every value of `x` exactly."""
    if x.dtype.itemsize <= 4 or x.size == 0:
        return x.dtype != np.uint32 or x.size == 0 or int(x.max()) <= np.iinfo(np.int32).max
    if np.issubdtype(x.dtype, np.integer):
        return int(x.min()) >= np.iinfo(np.int32).min and int(x.max()) <= np.iinfo(np.int32).max
    return False  # float64: decided by ranking on the host
