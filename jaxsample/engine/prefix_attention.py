"""Attention of every branch over the shared prefix, as one matmul per kv head.

The decode step is written for one branch and vmapped over the N branches
with the prefix unbatched (`step.branch_step`). Left to `jax.vmap`, the
prefix part of the attention becomes a dot whose rows are ordered (N, K, G)
while the dot's batch is K: on XLA CPU the compiled step then transposes
every layer's prefix keys (`[K, P, D]` -> `[K, D, P]`, a copy of the whole
prefix K per step) and copies the probabilities `[N, K, G, P]` back to
kv-head-major order before the product with V: layout copies of more bytes
per step than the prefix itself (counted by `jaxsample.engine.step_cost`).

`prefix_attention` is the one-branch `common.partial_attention` with a
custom batching rule (`jax.custom_batching.custom_vmap`): when the queries
are batched over branches and the prefix is not, the N branches' queries
become the rows of one `[K, N*G*S, D]` query block, so the scores
`[K, N*G*S, P]` and the product with V are canonical batched matmuls over
the prefix exactly as laid out in the cache, read once. Any other batching
(a prefix batched over rows, e.g. the row vmap or the naive engine) is the
plain vmap. The arithmetic is that of `partial_attention` on the
concatenated rows: the same dot products, softmax and normalisation per
(branch, head), so results agree with the plain vmap to float32 rounding
(the matmul's blocking may differ).

With `kernel=True` (the int8 decode step) that concatenated block goes to
`models.cpu_kernels.cpu_kernels.segment_attention` on CPU: scores, softmax and the
product with V in one pass over the prefix, split over the intra-op pool,
faster on XLA CPU than its two batched dots and softmax (docs/ARCHITECTURE.md,
"Attention over a shared prefix").

Hydragen (Juravsky et al. 2024, arXiv 2402.05099) batches the shared
prefix's attention across sequences in the same way.
"""

from __future__ import annotations

import jax
from jax import custom_batching

from jaxsample.models.families import common


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scale: float | None = None, kernel: bool = False):
    """`common.partial_attention(q, k, v, mask[None], scale)` for one branch, batched well.

    Args:
      q: `[S, H, D]` one branch's queries (roped, not scaled).
      k, v: `[K, P, D]` the shared prefix (kv-head-major, as cached).
      mask: `[P]` bool, the prefix positions the query may see (the same for
        every query position of the call).
      scale: the score scale (a Python float), None for `1/sqrt(D)`.
      kernel: use the CPU kernel `cpu_kernels.segment_attention` where it runs
        (the int8 decode step: `branch_step` passes it for quantised params).
    Returns:
      (out `[S, H, D]` float32, lse `[S, H]` float32), as `partial_attention`.
    """

    def one(q, k, v, mask):
        return common.partial_attention(q, k, v, mask[None], scale, kernel)

    def plain(q, k, v, mask):
        return common.partial_attention(q, k, v, mask[None], scale)

    f = custom_batching.custom_vmap(one)

    @f.def_vmap
    def rule(axis_size, in_batched, q, k, v, mask):
        qb, kb, vb, mb = in_batched
        if qb and not (kb or vb or mb):
            N, S, H, D = q.shape
            out, lse = one(q.reshape(N * S, H, D), k, v, mask)
            return (out.reshape(N, S, H, D), lse.reshape(N, S, H)), (True, True)
        # Anything else (a mask per branch: a sliding window in a pool whose slots sit
        # at different positions) is XLA's batched dots, not one kernel call per branch.
        axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(plain, in_axes=axes, axis_size=axis_size)(q, k, v, mask)
        return out, (True, True)

    return f(q, k, v, mask)
