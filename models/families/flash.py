"""Blockwise (flash-style) causal self-attention in plain JAX: no `[S, S]` square.

Letters as in `models/families/llama.py` (S positions, H query heads, K kv heads,
G = H / K query heads per kv head, D head dim).

The sequence is cut into query blocks of `block_q` positions and key blocks of
`block_k`. For each query block a running maximum, a running sum of
exponentials and a rescaled float32 accumulator are carried over the key
blocks (the online softmax of Milakov & Gimelshein 2018, as used by
FlashAttention, Dao et al. 2022, arXiv 2205.14135), so at most one
`[K, G*block_q, block_k]` score block exists at a time and memory grows
linearly with S.

Skipping is decided by loop indices only, never by vmapped values: the query
block index comes from a `lax.scan` over the (static) query blocks, the key
block index from a `lax.scan` over the key blocks, and each key block goes
through a `lax.switch` (skip / no mask / masked) whose index depends on those
two indices, the static `q_offset` and the layer's window (a Python int, or a
traced int32 that is the same for every prompt: the stacked layout's
per-layer scan input). Under the engine's `vmap` over prompts the index is
therefore unbatched and the switch stays a real branch (a batched one would
become a select that runs every side): key blocks entirely above the
diagonal, and on a local layer entirely before the window, cost only the
loop step; blocks entirely inside skip the elementwise mask (15-20 % of the
kernel's time on CPU). Right padding (the prompt's length, batched under
vmap) needs no mask at all: causality already hides it from every real
query. Everything is `lax.scan` + `lax.switch`, so the kernel is
reverse-differentiable (Bridge training runs the base model through
`causal_attend`).

Layout conventions are those of `common.partial_attention`: keys and values
kv-head-major `[K, Sk, D]`; the G query heads of one kv head are one matmul's
rows (`[K, G*block_q, D] x [K, block_k, D]`); scores, softmax statistics and
the accumulator are float32; the probabilities are cast to the value dtype for
the second product (float32 accumulation), as in the dense kernel.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Query / key block size (positions). On CPU with the SmolLM2-135M shapes (H=9,
# K=3, D=64), 128-256 run fastest from S = 512 to 4096 (a [K, G*256, 256] float32
# score block is 2.4 MB); larger blocks are slower, one block of S (the dense
# kernel's shape) several times slower (benchmarks/prefill.py --block).
BLOCK = 256
BLOCKWISE_FROM = (
    # CPU: with SmolLM2, what blockwise saves per call below 1024 positions is small
    # against its program's extra compile time (30 unrolled layers, once per prompt
    # bucket and process; the persistent compilation cache keeps it): docs/benchmarks.md,
    # "Prefill: dense against blockwise attention".
    ("cpu", 1024),
    # GPU: measured on one GPU (the random 1B Llama in bfloat16, H = 32, one prompt,
    # benchmarks/gpu_run.sh's prefill part; docs/benchmarks.md, "GPU: one H200")
    # dense is faster than blockwise at P = 4096 and 16384, within the device's
    # memory. Above 16384 nothing is measured, so the blockwise kernel keeps the
    # memory bounded there. gpu_run.sh measures both kernels at 1K / 4K / 16K for
    # the 1B and 8B shapes and prints the entry they imply.
    ("gpu", 16385),
    # TPU: not measured. Dense up to 4096 positions, where its float32 scores
    # ([H, S, S], 2 GiB at H = 32) fit any TPU's memory beside a 1B model; the same
    # script on a TPU (its header) measures it.
    ("tpu", 4096),
)
"""Per backend, the prompt length (positions) from which `causal_attend` takes the
blockwise kernel: the one table of the dense / blockwise choice (`use_blockwise`).
A backend it does not name takes the "cpu" entry. Read at trace time (part of the
exported programs' keys, `engine.exported.TRACE_KNOBS`)."""


def blockwise_from(backend: str | None = None) -> int:
    """`BLOCKWISE_FROM`'s entry for `backend` (default: JAX's default backend when
    called, i.e. when the program is traced: a program placed on a mesh of another
    backend's devices, a CPU mesh on a GPU host, chooses by the default backend, as
    the exported programs' keys do)."""
    table = dict(BLOCKWISE_FROM)
    return table.get(backend or jax.default_backend(), table["cpu"])


def use_blockwise(S: int, backend: str | None = None) -> bool:
    """The one place that chooses the causal kernel for a call of S positions:
    blockwise from `blockwise_from(backend)` positions on, dense below."""
    return S >= blockwise_from(backend)


def blockwise_attention(q, k, v, *, window=None, scale: float | None = None,
                        q_offset: int = 0, block_q: int | None = None,
                        block_k: int | None = None, return_lse: bool = False):
    """Causal attention of queries over keys, block by block with an online softmax.

    Query i sits at absolute position `q_offset + i`, key j at position j. The
    query at p sees the key at j iff `j <= p` and, on a local layer,
    `j > p - window`. With `q_offset = 0` and `Sk = Sq` this is
    `common.causal_attend`'s self-attention; with keys `[context; suffix]` and
    `q_offset = len(context)` it is a suffix attending to an already-computed
    context plus itself causally.

    Right padding needs no mask: a query below the prompt's length never sees
    a key at or past it (causality), so the outputs there do not depend on the
    padding; outputs at padded query positions are finite and unspecified
    (the dense kernel's `valid_len` mask gives other values there).

    Key block j of query block i is skipped when it lies entirely above the
    diagonal or entirely before the window, computed without any mask when
    it lies entirely inside (the common case), and masked elementwise only
    on the diagonal and the window's edge.

    Args:
      q: `[Sq, H, D]` (normalised and roped, not scaled), any float dtype.
      k, v: `[K, Sk, D]` kv-head-major (the caches' layout); H a multiple of K.
      window: None (global layer) or the sliding window: a Python int >= 1 or
        a traced int32 that does not vary across a vmap (`common.NO_WINDOW`
        means global).
      scale: the score scale (None: `1/sqrt(D)`), applied to q in its dtype;
        a `common.SoftCappedScale` also soft-caps the scores (Gemma 2).
      q_offset: static Python int >= 0, the absolute position of query 0.
      block_q, block_k: static block sizes in positions (default `BLOCK`),
        clipped to Sq / Sk; S need not be a multiple (padding is masked).
      return_lse: also return the log-sum-exp of each query's scores.
    Returns:
      out `[Sq, H, D]` float32, normalised (0 where a query sees no key, which
      needs `q_offset + i >= Sk + window - 1`), and with `return_lse` also lse
      `[Sq, H]` float32 (-inf where it sees no key): the pair
      `common.merge_attention` merges.
    Raises:
      ValueError: shapes that do not fit (naming the argument), block sizes
        or q_offset that are not non-negative Python ints.
    """
    _check_blockwise(q, k, v, block_q, block_k, q_offset)
    Sq, H, D = q.shape
    K, Sk = k.shape[0], k.shape[1]
    G = H // K
    bq = min(block_q or BLOCK, Sq)
    bk = min(block_k or BLOCK, Sk)
    nq, nk = -(-Sq // bq), -(-Sk // bk)
    sc = 1.0 / math.sqrt(D) if scale is None else float(scale)
    t = _Tiling(bq=bq, bk=bk, nk=nk, K=K, G=G, Sk=Sk, q_offset=q_offset, window=window,
                cap=getattr(scale, "softcap", None), padded_keys=nk * bk != Sk)

    qs = q * jnp.asarray(sc, q.dtype)
    qs = jnp.pad(qs, ((0, nq * bq - Sq), (0, 0), (0, 0)))
    # [nq*bq, H, D] -> [nq, K, G*bq, D]: each block's rows grouped per kv head.
    qb = qs.reshape(nq, bq, K, G, D).transpose(0, 2, 3, 1, 4).reshape(nq, K, G * bq, D)
    kp = jnp.pad(k, ((0, 0), (0, nk * bk - Sk), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, nk * bk - Sk), (0, 0)))

    def query_block(_, xs):
        i, qi = xs
        j_lo, j_hi, full_lo, full_hi = _key_ranges(t, i)

        def step(carry, j):
            visible = (j >= j_lo) & (j < j_hi)
            inside = (j >= full_lo) & (j < full_hi)
            branch = jnp.where(visible, jnp.where(inside, 1, 2), 0)
            return jax.lax.switch(branch, [
                lambda c: c,
                lambda c: _key_block(t, kp, vp, qi, c, i, j, masked=False),
                lambda c: _key_block(t, kp, vp, qi, c, i, j, masked=True)], carry), None

        init = (jnp.zeros((K, G * bq, D), jnp.float32),
                jnp.full((K, G * bq), -jnp.inf, jnp.float32),
                jnp.zeros((K, G * bq), jnp.float32))
        (acc, m, l), _ = jax.lax.scan(step, init, jnp.arange(nk, dtype=jnp.int32))
        safe = jnp.where(l > 0, l, 1.0)
        out = acc / safe[..., None]
        lse = jnp.where(l > 0, jnp.log(safe) + m, -jnp.inf)
        return None, (out, lse)

    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(nq, dtype=jnp.int32), qb))
    out = out.reshape(nq, K, G, bq, D).transpose(0, 3, 1, 2, 4).reshape(nq * bq, H, D)[:Sq]
    if not return_lse:
        return out
    lse = lse.reshape(nq, K, G, bq).transpose(0, 3, 1, 2).reshape(nq * bq, H)[:Sq]
    return out, lse


def _check_blockwise(q, k, v, block_q, block_k, q_offset) -> None:
    """`blockwise_attention`'s argument checks (its Raises)."""
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"blockwise_attention: q must be [Sq, H, D] and k, v [K, Sk, D] alike, "
                         f"got q {q.shape}, k {k.shape}, v {v.shape}")
    H, D = q.shape[1], q.shape[2]
    K = k.shape[0]
    if k.shape[2] != D or H % K:
        raise ValueError(f"blockwise_attention: k {k.shape} does not fit q {q.shape} "
                         f"(head dim must match, H a multiple of K)")
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"blockwise_attention: {name} must be a positive int, got {value!r}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"blockwise_attention: q_offset must be a Python int >= 0, "
                         f"got {q_offset!r}")


class _Tiling(NamedTuple):
    """`blockwise_attention`'s layout: block sizes bq, bk; nk key blocks; K kv heads of
    G queries each; Sk keys; the query offset, window and soft cap; whether the last
    key block holds padding."""

    bq: int
    bk: int
    nk: int
    K: int
    G: int
    Sk: int
    q_offset: int
    window: Any  # None, a Python int or a traced int32
    cap: float | None
    padded_keys: bool


def _key_ranges(t: _Tiling, i):
    """(j_lo, j_hi, full_lo, full_hi) of query block i: key blocks in [j_lo, j_hi) are
    visible to some query of it, those in [full_lo, full_hi) to all of them (no mask)."""
    q_first = t.q_offset + i * t.bq  # positions q_first .. q_last
    q_last = q_first + t.bq - 1
    j_hi = q_last // t.bk + 1  # key blocks >= j_hi lie entirely above the diagonal
    full_hi = (q_first + 1) // t.bk  # blocks < full_hi lie entirely below it
    if t.window is None:
        j_lo = full_lo = 0
    else:
        j_lo = jnp.maximum((q_first - t.window + 1) // t.bk, 0)  # blocks < j_lo: before it
        full_lo = -((t.window - q_last - 1) // t.bk)  # ceil((q_last - window + 1) / bk)
    if t.padded_keys:
        full_hi = jnp.minimum(full_hi, t.nk - 1)  # the last key block holds padding
    return j_lo, j_hi, full_lo, full_hi


def _key_block(t: _Tiling, kp, vp, qi, carry, i, j, masked: bool):
    """The online softmax over key block j of query block i: (acc, m, l) updated; masked
    elementwise (causality, window, padding) only when `masked`."""
    K, G, bq, bk = t.K, t.G, t.bq, t.bk
    acc, m, l = carry  # [K, G*bq, D], [K, G*bq], [K, G*bq] float32
    kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
    s = jnp.einsum("kqd,kmd->kqm", qi, kj, preferred_element_type=jnp.float32)
    if t.cap is not None:
        s = jnp.tanh(s / t.cap) * t.cap
    if masked:
        q_pos = t.q_offset + i * bq + jnp.arange(bq, dtype=jnp.int32)  # [bq]
        k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
        mask = k_pos[None, :] <= q_pos[:, None]
        if t.window is not None:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - t.window)
        if t.padded_keys:
            mask = mask & (k_pos < t.Sk)[None, :]
        s = jnp.where(mask[None, None], s.reshape(K, G, bq, bk),
                      -jnp.inf).reshape(K, G * bq, bk)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])  # exactly 0 at masked keys
    alpha = jnp.exp(m - m_safe)  # 0 while nothing was seen (m = -inf)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("kqm,kmd->kqd", p.astype(vp.dtype), vj, preferred_element_type=jnp.float32)
    return alpha[..., None] * acc + pv, m_new, l


def block_pairs(Sq: int, Sk: int, block_q: int, block_k: int, q_offset: int = 0,
                window: int | None = None) -> np.ndarray:
    """`[nq, nk]` bool: which (query block, key block) pairs the kernel computes
    (the same rule as `blockwise_attention`, in numpy; for tests and cost notes)."""
    bq, bk = min(block_q, Sq), min(block_k, Sk)
    nq, nk = -(-Sq // bq), -(-Sk // bk)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    q_first = q_offset + i * bq
    visible = j < (q_first + bq - 1) // bk + 1
    if window is not None:
        visible &= j >= np.maximum((q_first - window + 1) // bk, 0)
    return visible
