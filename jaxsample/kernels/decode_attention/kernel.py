"""The decode attention kernel in Pallas: blocks of queries against one KV segment.

One call computes, for every batch element b and kv head h, the un-normalised
attention of a block of query rows over a KV segment (the shared prefix of a
row, or one slot's tail), blocked over the segment's positions with an online
softmax (FlashAttention-2's running max and sum, Dao 2023), and returns the
normalised output and the log-sum-exp, the two halves of a log-sum-exp merge
(`common.merge_attention`). Letters: B batch elements, K kv heads, M query rows
per kv head (N branches x G query heads x S positions, when a prefix's
branches form one block), L segment positions, D head dim.

Row m of batch element b sees segment position j iff `lo[b, m] <= j < hi[b, m]`
(the valid length and a sliding window's lower bound, in the segment's slot
indices): blocks with no visible position for any row of the query block are
skipped. The queries come scaled (the caller multiplies them by the score scale
in their own dtype, as `common.partial_attention` does); `softcap` maps each
score s to `c * tanh(s / c)` before the mask. Scores, the softmax and both
products accumulate in float32; the probabilities are cast to the values'
dtype before the product with V (as `partial_attention` does). A row with no
visible position returns out 0 and lse -inf.

Two drivers of the same block update (`_update`):

* "triton" (GPU: the Triton backend of Pallas): grid (B, K, M / bm, c), each
  program keeps its [bm, D] accumulator in registers and loops over its
  share of the segment's blocks of bl positions, from the first to the last
  visible one (a loop with traced bounds: blocks past a slot's length are
  never loaded). The c splits of the segment (flash-decoding's split-K:
  `triton_splits`, enough programs to fill the GPU when B x K x M / bm is
  small, as for one row's long prefix) are merged by log-sum-exp after the
  call. Triton wants power-of-two tiles and dot operands of at least
  16 x 16: bm in [16, 64] (powers of two, M padded), bl = 64 (32 for
  D > 128), D a power of two >= 16; the last block is a masked load when bl
  does not divide L.
* "mosaic" (TPU): grid (B, K, M / bm, L / bl), the last axis "arbitrary" (a
  sequential reduction into VMEM scratch), the output block resident across
  it. The first and last visible block of each (b, query block) are
  prefetched scalars (SMEM): the K/V index map clamps the block index into
  that range, so the pipeline issues no copy for skipped blocks (the same
  block index twice in a row is not copied again), and their compute is
  skipped with `pl.when`. TPU blocks need their last two dims divisible by
  (8, 128) or equal to the array's: bm a multiple of 8 (16 for 16-bit
  queries) up to 256, D whole, bl the largest of 512, 256, ..., 16 dividing
  L, else L whole.

`interpret=True` runs either driver on any backend (Pallas's interpreter: the
CPU test suite runs both against `reference.segments`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from jaxsample.models.families import common

BACKENDS = ("triton", "mosaic")

TRITON_MAX_ROWS = 64  # bm: the [bm, D] float32 accumulator lives in registers
TRITON_PROGRAMS = 256  # split-K target: about two programs per SM of a 132-SM H100
TRITON_MIN_SPLIT_BLOCKS = 4  # position blocks per split at least
MOSAIC_MAX_ROWS = 256  # bm: one MXU pass (v6e) per block of queries
MOSAIC_KEY_BLOCKS = (512, 256, 128, 64, 32, 16)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_shapes(backend: str, M: int, L: int, D: int, q_dtype) -> tuple[int, int]:
    """(bm, bl): query rows and segment positions per block (see the module docstring).

    Args:
      backend: "triton" or "mosaic".
      M, L, D: query rows per kv head, segment positions, head dim.
      q_dtype: the queries' dtype (16-bit queries pack two rows per sublane on TPU).
    Returns:
      bm (M is padded to a multiple of it) and bl.
    """
    if backend == "triton":
        bm = min(max(_next_pow2(M), 16), TRITON_MAX_ROWS)
        bl = max(min(64 if D <= 128 else 32, _next_pow2(L)), 16)
        return bm, bl
    if backend == "mosaic":
        sub = 16 if jnp.dtype(q_dtype).itemsize == 2 else 8
        nm = -(-M // MOSAIC_MAX_ROWS)
        bm = -(-(-(-M // nm)) // sub) * sub
        bl = L if L <= MOSAIC_KEY_BLOCKS[0] else next(
            (b for b in MOSAIC_KEY_BLOCKS if L % b == 0), L)
        return bm, bl
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def triton_splits(programs: int, L: int, bl: int) -> int:
    """c, the splits of the segment for the Triton driver: `TRITON_PROGRAMS` programs
    in all when `programs` (B x K x M / bm) are fewer, each split at least
    `TRITON_MIN_SPLIT_BLOCKS` blocks of bl positions."""
    blocks = -(-L // bl)
    return max(1, min(-(-TRITON_PROGRAMS // programs), blocks // TRITON_MIN_SPLIT_BLOCKS))


def check_shapes(backend: str, D: int) -> None:
    """ValueError unless the compiled (not interpreted) `backend` can tile head dim D.

    Triton needs D a power of two >= 16 (its tiles and dots); Mosaic takes D whole.
    """
    if backend == "triton" and (D < 16 or D & (D - 1)):
        raise ValueError(f"the Triton decode attention kernel needs a head dim that is a power "
                         f"of two >= 16, got {D}")


def _update(q, k, v, lo, hi, start, softcap, carry):
    """One block of the online softmax.

    Args:
      q: `[bm, D]` scaled queries; k, v: `[bl, D]`; lo, hi: `[bm, 1]` int32;
      start: the block's first segment position; carry: (m `[bm, 1]` running
      max, -inf before any visible score; l `[bm, 1]` running sum; acc
      `[bm, D]` running weighted sum), all float32.
    """
    m, l, acc = carry
    dt = jnp.promote_types(q.dtype, k.dtype)
    s = jax.lax.dot_general(q.astype(dt), k.astype(dt), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [bm, bl]
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    j = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s = jnp.where((j >= lo) & (j < hi), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)  # 0 while nothing was visible
    p = jnp.exp(s - m_safe)  # exactly 0 at masked positions
    pv_dt = jnp.promote_types(v.dtype, q.dtype)
    pv = jax.lax.dot_general(p.astype(pv_dt), v.astype(pv_dt), (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv


def _finish(carry):
    """(out `[bm, D]`, lse `[bm, 1]`) from the final carry."""
    m, l, acc = carry
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)
    lse = jnp.where(seen, jnp.log(jnp.where(seen, l, 1.0)) + m, -jnp.inf)
    return out, lse


def _init(bm: int, D: int):
    return (jnp.full((bm, 1), -jnp.inf, jnp.float32), jnp.zeros((bm, 1), jnp.float32),
            jnp.zeros((bm, D), jnp.float32))


def _triton_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, o_ref, lse_ref, *, bl, L, softcap,
                   per_split):
    bm, D = q_ref.shape
    q, lo, hi = q_ref[...], lo_ref[...], hi_ref[...]
    split = pl.program_id(3)  # this program's blocks: [split, split + 1) * per_split
    first = jnp.maximum(jnp.min(lo) // bl, split * per_split)
    end = jnp.minimum((jnp.max(hi) + bl - 1) // bl, (split + 1) * per_split)

    def load(ref, start):
        if L % bl == 0:
            return ref[pl.ds(start, bl), :]
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (bl, D), 0)
        return plgpu.load(ref.at[pl.ds(start, bl), :], mask=rows < L, other=0)

    def body(jb, carry):
        start = jb * bl
        return _update(q, load(k_ref, start), load(v_ref, start), lo, hi, start, softcap, carry)

    out, lse = _finish(jax.lax.fori_loop(first, end, body, _init(bm, D)))
    o_ref[...] = out
    lse_ref[...] = lse


def _mosaic_kernel(first_ref, end_ref, q_ref, k_ref, v_ref, lo_ref, hi_ref, o_ref, lse_ref,
                   m_ref, l_ref, acc_ref, *, bl, nm, softcap):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    first, end = first_ref[b * nm + i], end_ref[b * nm + i]

    @pl.when(j == 0)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _init(*acc_ref.shape)

    @pl.when((j >= first) & (j < end))
    def _():
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = _update(
            q_ref[...], k_ref[...], v_ref[...], lo_ref[...], hi_ref[...], j * bl, softcap, carry)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        o_ref[...], lse_ref[...] = _finish((m_ref[...], l_ref[...], acc_ref[...]))


@functools.partial(jax.jit, static_argnames=("softcap", "backend", "interpret", "blocks",
                                             "splits"))
def segments(q, k, v, lo, hi, *, softcap: float | None = None, backend: str = "triton",
             interpret=False, blocks: tuple[int, int] | None = None,
             splits: int | None = None):
    """Attention of blocks of queries over one KV segment per batch element (Pallas).

    Args:
      q: `[B, K, M, D]` queries, already multiplied by the score scale.
      k, v: `[B, K, L, D]` the segments (kv-head-major, as cached).
      lo, hi: `[B, M]` int32: row m sees positions `lo <= j < hi` (hi <= L).
      softcap: the score soft-cap c (`common.SoftCappedScale.softcap`) or None.
      backend: "triton" (GPU) or "mosaic" (TPU): which driver (module docstring).
      interpret: run in Pallas's interpreter (any backend; the CPU's tests): True,
        or a `pltpu.InterpretParams` (the TPU interpreter, for the Mosaic driver).
      blocks: (bm, bl) instead of `block_shapes`' (tests: several blocks on tiny
        shapes); the Mosaic driver needs bl to divide L.
      splits: the Triton driver's c instead of `triton_splits`' (tests).
    Returns:
      (out `[B, K, M, D]` float32 normalised within the segment, lse `[B, K, M]`
      float32, -inf for a row with no visible position), as
      `common.partial_attention`.
    Raises:
      ValueError: an unknown backend, a head dim the compiled backend cannot tile, or
        blocks the driver cannot use.
    """
    B, K, M, D = q.shape
    L = k.shape[2]
    if not interpret:
        check_shapes(backend, D)
    bm, bl = block_shapes(backend, M, L, D, q.dtype) if blocks is None else blocks
    if backend == "mosaic" and L % bl:
        raise ValueError(f"the Mosaic driver needs a position block dividing L = {L}, got {bl}")
    Mp = -(-M // bm) * bm
    nm = Mp // bm
    lo = lo.astype(jnp.int32)
    hi = jnp.minimum(hi.astype(jnp.int32), L)
    if Mp != M:  # padding rows see nothing (lo = L, hi = 0: no block bound moves)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
        lo = jnp.pad(lo, ((0, 0), (0, Mp - M)), constant_values=L)
        hi = jnp.pad(hi, ((0, 0), (0, Mp - M)))
    out_shape = (jax.ShapeDtypeStruct((B, K, Mp, D), jnp.float32),
                 jax.ShapeDtypeStruct((B, K, Mp, 1), jnp.float32))
    row_spec = pl.BlockSpec((None, None, bm, D), lambda b, h, i, *_: (b, h, i, 0))
    lse_spec = pl.BlockSpec((None, None, bm, 1), lambda b, h, i, *_: (b, h, i, 0))
    bound_spec = pl.BlockSpec((None, bm, 1), lambda b, h, i, *_: (b, i, 0))
    bounds = (lo[..., None], hi[..., None])
    if backend == "triton":
        c = triton_splits(B * K * nm, L, bl) if splits is None else splits
        per_split = -(-(-(-L // bl)) // c)
        seg_spec = pl.BlockSpec((None, None, L, D), lambda b, h, i, s: (b, h, 0, 0))
        split_spec = lambda spec: pl.BlockSpec(  # noqa: E731
            (None,) + spec.block_shape, lambda b, h, i, s: (s, b, h, i, 0))
        out, lse = pl.pallas_call(
            functools.partial(_triton_kernel, bl=bl, L=L, softcap=softcap, per_split=per_split),
            out_shape=[jax.ShapeDtypeStruct((c,) + o.shape, o.dtype) for o in out_shape],
            grid=(B, K, nm, c),
            in_specs=[row_spec, seg_spec, seg_spec, bound_spec, bound_spec],
            out_specs=[split_spec(row_spec), split_spec(lse_spec)],
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            interpret=interpret, name="decode_attention")(q, k, v, *bounds)
        if c == 1:
            out, lse = out[0], lse[0]
        else:  # the splits' partial softmaxes, merged by log-sum-exp
            lse = lse[..., 0]
            out = common.merge_attention(list(zip(out, lse)))
            lse = jax.nn.logsumexp(lse, axis=0)[..., None]
    elif backend == "mosaic":
        nl = L // bl
        # Blocks [first, end) of each (b, query block) hold a visible position.
        first = jnp.clip(lo.reshape(B, nm, bm).min(-1) // bl, 0, nl - 1).reshape(-1)
        end = jnp.clip((hi.reshape(B, nm, bm).max(-1) + bl - 1) // bl, 0, nl).reshape(-1)

        def seg_index(b, h, i, j, first_ref, end_ref):
            f, e = first_ref[b * nm + i], end_ref[b * nm + i]
            return b, h, jnp.clip(j, f, jnp.maximum(e - 1, f)), 0

        seg_spec = pl.BlockSpec((None, None, bl, D), seg_index)
        out, lse = pl.pallas_call(
            functools.partial(_mosaic_kernel, bl=bl, nm=nm, softcap=softcap),
            out_shape=out_shape,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2, grid=(B, K, nm, nl),
                in_specs=[row_spec, seg_spec, seg_spec, bound_spec, bound_spec],
                out_specs=[row_spec, lse_spec],
                scratch_shapes=[pltpu.VMEM((bm, 1), jnp.float32),
                                pltpu.VMEM((bm, 1), jnp.float32),
                                pltpu.VMEM((bm, D), jnp.float32)]),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret, name="decode_attention")(first, end, q, k, v, *bounds)
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return out[:, :, :M], lse[:, :, :M, 0]
