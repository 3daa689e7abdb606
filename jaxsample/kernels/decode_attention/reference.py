"""The pure-JAX reference of `kernel.segments`: the engine's XLA attention, row by row.

Each batch element is `common.partial_attention` (the XLA path of the decode
step) over its segment with the mask `lo <= j < hi` per query row, the queries
taken as already scaled (score scale 1, the soft-cap kept): the kernel's
oracle in the tests and its definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsample.models.families import common


def segments(q, k, v, lo, hi, *, softcap: float | None = None):
    """`kernel.segments`' result computed by `common.partial_attention`.

    Args:
      q: `[B, K, M, D]` scaled queries; k, v: `[B, K, L, D]`; lo, hi: `[B, M]` int32.
      softcap: the score soft-cap or None.
    Returns:
      (out `[B, K, M, D]` float32, lse `[B, K, M]` float32).
    """
    scale = 1.0 if softcap is None else common.SoftCappedScale(1.0, softcap)
    j = jnp.arange(k.shape[2])

    def one(q, k, v, lo, hi):
        # [K, M, D] as M positions of K heads with one query head each (G = 1).
        mask = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])  # [M, L]
        out, lse = common.partial_attention(q.swapaxes(0, 1), k, v, mask, scale)
        return out.swapaxes(0, 1), lse.swapaxes(0, 1)

    return jax.vmap(one)(q, k, v, lo, hi)
