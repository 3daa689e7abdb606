"""One branch's attention over one KV segment, batched onto the Pallas kernel by vmap.

The decode step is written for one branch and vmapped over the N slots of a
row and over the rows (`engine.step`). `segment_attention` is that one-branch
op; its batching rule (`jax.custom_batching.custom_vmap`) decides at each
vmap level how the mapped axis enters `kernel.segments`:

* the segment is not mapped (the shared prefix under the branch vmap; the
  common context under both vmaps): the mapped queries join the query block
  (`[B, K, n*M, D]`), so the segment is read once per step for all of them,
  as Hydragen (Juravsky et al. 2024, arXiv 2402.05099) and FlashInfer's
  cascade attention batch a shared prefix;
* the segment is mapped (a slot's own tail; the prefix under the row vmap):
  the axis joins the batch axis (`[n*B, ...]`, a reshape, no copy), each
  element reading its own segment up to its own bound.

Nested vmaps compose: the rule calls the batched op again, which the next
vmap level batches by the same rule, so the kernel sees the prefix as
`[R, K, P, D]` with the queries of a row's N slots in one block, and the
tails as `[R*N, K, T, D]`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import custom_batching

from jaxsample.kernels.decode_attention import kernel


def segment_attention(q, k, v, lo, hi, scale=None, *, backend: str = "triton",
                      interpret: bool = False):
    """`common.partial_attention` over the segment positions `lo <= j < hi`, by the kernel.

    Args:
      q: `[S, H, D]` one branch's queries (roped, not scaled).
      k, v: `[K, L, D]` the segment (kv-head-major, as cached).
      lo, hi: `[]` int32, the first visible position and the end of the visible
        ones (slot indices of the segment), the same for the S queries.
      scale: the score scale (a Python float, a `common.SoftCappedScale` also
        soft-caps); None means `1/sqrt(D)`.
      backend, interpret: `kernel.segments`' driver and interpret mode.
    Returns:
      (out `[S, H, D]` float32, lse `[S, H]` float32), as
      `common.partial_attention(q, k, v, mask, scale)` with that mask.
    """
    S, H, D = q.shape
    K = k.shape[0]
    G = H // K
    # [S, H, D] -> [K, G*S, D], scaled in q's dtype (as `partial_attention`).
    qg = q.reshape(S, K, G, D).transpose(1, 2, 0, 3).reshape(K, G * S, D)
    qg = qg * jnp.asarray(1.0 / math.sqrt(D) if scale is None else float(scale), qg.dtype)
    rows = lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.int32), (1, G * S))  # noqa: E731
    op = batched_segments(getattr(scale, "softcap", None), backend, interpret)
    out, lse = op(qg[None], k[None], v[None], rows(lo), rows(hi))
    out = out[0].reshape(K, G, S, D).transpose(2, 0, 1, 3).reshape(S, H, D)
    return out, lse[0].reshape(K, G, S).transpose(2, 0, 1).reshape(S, H)


def batched_segments(softcap, backend: str, interpret: bool):
    """`kernel.segments` (q `[B, K, M, D]`, k, v `[B, K, L, D]`, lo, hi `[B, M]`) with
    the batching rule of the module docstring."""

    def call(q, k, v, lo, hi):
        return kernel.segments(q, k, v, lo, hi, softcap=softcap, backend=backend,
                               interpret=interpret)

    op = custom_batching.custom_vmap(call)

    @op.def_vmap
    def rule(n, in_batched, q, k, v, lo, hi):
        grow = lambda a, b: a if b else jnp.broadcast_to(a, (n,) + a.shape)  # noqa: E731
        qb, kb, vb, lob, hib = in_batched
        q, lo, hi = grow(q, qb), grow(lo, lob), grow(hi, hib)
        if not (kb or vb):  # a shared segment: the mapped queries join the query block
            B, K, M, D = q.shape[1:]
            rows = lambda a: a.transpose(1, 0, 2).reshape(B, n * M)  # noqa: E731
            out, lse = op(q.transpose(1, 2, 0, 3, 4).reshape(B, K, n * M, D), k, v, rows(lo),
                          rows(hi))
            return ((out.reshape(B, K, n, M, D).transpose(2, 0, 1, 3, 4),
                     lse.reshape(B, K, n, M).transpose(2, 0, 1, 3)), (True, True))
        # One segment per mapped element: the axis joins the batch axis.
        k, v = grow(k, kb), grow(v, vb)
        flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
        out, lse = op(*map(flat, (q, k, v, lo, hi)))
        return (out.reshape((n, -1) + out.shape[1:]), lse.reshape((n, -1) + lse.shape[1:])), (
            True, True)

    return op
