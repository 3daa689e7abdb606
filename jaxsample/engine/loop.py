"""The resumable decode loop: chunks of steps, fresh states, compaction, compiled programs.

A chunk advances the state to token `knobs.t_stop`, the budget, or until every
slot is done, then returns it to the host (JetStream's engine API at the
granularity of k steps). Its shape is two loops:

    while t < t_stop and some slot is live:        # checked every k steps
        repeat k = STEPS_PER_CHECK times:         # a static trip count
            step if t < t_stop and some slot is live, else nothing

so the loop XLA runs step by step has a trip count it knows (the optimised
HLO's `known_trip_count`): a GPU runs the k steps without reading a predicate
back to the host after each, and can record them as one command buffer (a
CUDA graph, `GPU_COMPILER_OPTIONS`). `t_stop` is traced, so every chunk size
runs the same compiled program, and a step past `t_stop` leaves the state
as it is: a chunked run is token-identical to a single call (`t_stop =
max_new_tokens`) whatever the chunk size and k.
Compaction gathers the live slots (and rows) into smaller buckets; keys stay
tied to the global branch index carried in the state, so it never changes a
branch's draws.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import disk_cache
from jaxsample.engine import exported
from jaxsample.engine.prefill import window_extent
from jaxsample.engine.state import (
    ROW_FIELDS,
    SLOT_FIELDS,
    DecodeState,
    Knobs,
    Outputs,
    PrefixCache,
    Static,
)
from jaxsample.engine.step import all_done, branch_keys, make_step

STEPS_PER_CHECK = 8
"""Steps between two reads of a chunk's "t_stop reached or every slot done" (the
inner loop's static trip count). 8 is the engine's chunk between stop-string
checks and the pool's refills (`api.STOP_CHUNK`), so those chunks are one block
and no step of theirs is a skipped one; a chunk of another size skips at most
k - 1 guarded steps at its end, and a chunk whose slots all finish mid-block
skips the rest of the block (a predicate and nothing else, on the CPU about a
microsecond each). On a GPU without command buffers the host reads the
outer predicate once per k steps instead of once per step; larger k adds
skipped steps and nothing else. Read when a chunk is traced (the exported
programs' keys carry it, `exported.TRACE_KNOBS`)."""

GPU_COMPILER_OPTIONS = {
    "xla_gpu_enable_command_buffer":
        "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
}
"""XLA options of every engine program compiled for a GPU (`compiler_options`),
per program: nothing global is set. XLA's default command buffer kinds (the
first six: CUDA graphs of fusions, cuBLAS, cuDNN and custom calls) plus WHILE
and CONDITIONAL, which let a graph hold the chunk's loops and the step's
`lax.cond`s with their predicates evaluated on the device (CUDA conditional
nodes, CUDA 12.3 on): outside a graph XLA copies every loop predicate and
`cond` predicate to the host and waits for it. benchmarks/gpu_run.sh measures
the step with and without them; `{}` leaves XLA's defaults (XLA itself drops
kinds the driver cannot run)."""


def compiler_options(platform: str) -> dict:
    """The XLA compile options of an engine program for `platform` ("cpu", "gpu",
    "tpu"): `GPU_COMPILER_OPTIONS` on a GPU, none elsewhere."""
    return dict(GPU_COMPILER_OPTIONS) if platform == "gpu" else {}


def decode_chunk(st: Static, params, prefix: PrefixCache, state: DecodeState, knobs: Knobs,
                 bridge_params=None, context=None) -> DecodeState:
    """Advance every live slot until the clock `state.t` reaches `knobs.t_stop`, or
    every slot is done (blocks of `STEPS_PER_CHECK` guarded steps, module docstring).

    Each slot decodes at its own token index (`state.lengths`), so slots that
    were refilled between chunks (`refill`) run beside slots that started
    earlier; `state.t` counts the steps this state has run (for a state whose
    slots all started together it equals every live slot's token index).

    Args:
      params: model parameters in the list layout (`llama.unstack_layers`).
      prefix: the rows' PrefixCache (L x `[R, K, P, D]`).
      state: the DecodeState (`[R, N, ...]`), donated.
      bridge_params: `[L, ...]` Bridge parameters when `st.bridge` is set.
      context: None or the `ContextCache` common to all rows (`shared_prefix=`).
    """
    keys = branch_keys(knobs, state.prompt_index, state.branch_ids)
    step = make_step(st, params, prefix, knobs, keys, bridge_params, context)

    def running(s: DecodeState):
        return (s.t < knobs.t_stop) & ~all_done(st, s.done)

    def guarded(_, s: DecodeState):
        # The state passes through the skipped branch untouched: XLA updates it in
        # place either way (no copy of the tails, checked in the optimised HLO).
        return jax.lax.cond(running(s), step, lambda x: x, s)

    def block(s: DecodeState):
        return jax.lax.fori_loop(0, STEPS_PER_CHECK, guarded, s)

    return jax.lax.while_loop(running, block, state)


def init_state(st: Static, last_logits: jax.Array, prompt_index: jax.Array,
               branch_ids: jax.Array, live: jax.Array,
               prompt_mask: jax.Array | None = None) -> DecodeState:
    """Fresh decode buffers for R rows of N slots, all at token 0.

    Args:
      last_logits: `[R, V]` float32, each row's distribution for token 0.
      prompt_index: `[R]` int32 global prompt index of each row.
      branch_ids: `[R, N]` int32 global branch index of each slot.
      live: `[R, N]` bool; False for padding slots (a data axis the prompts do
        not divide, a round narrower than the bucket): they start done, so they
        never keep the loop running, and the bill never counts them.
      prompt_mask: `[R, V]` bool, the tokens of each row's prompt; required
        with `st.penalties`, ignored otherwise.
    """
    cfg = st.cfg
    R, N, T = last_logits.shape[0], branch_ids.shape[1], st.t_cap
    V = last_logits.shape[-1]
    if st.penalties:
        if prompt_mask is None or prompt_mask.shape != (R, V):
            raise ValueError(f"st.penalties needs prompt_mask [{R}, {V}], got "
                             f"{None if prompt_mask is None else prompt_mask.shape}")
        counts, prompt_mask = jnp.zeros((R, N, V), jnp.int32), prompt_mask.astype(bool)
    else:
        counts, prompt_mask = jnp.zeros((R, N, 0), jnp.int32), jnp.zeros((R, 0), bool)
    tail = tuple(jnp.zeros((R, N, cfg.n_kv_heads, window_extent(T, w), cfg.head_dim),
                           cfg.jnp_dtype) for w in cfg.layer_windows)
    return DecodeState(
        t=jnp.zeros((), jnp.int32),
        logits=jnp.broadcast_to(last_logits[:, None], (R, N, last_logits.shape[-1])),
        out=empty_outputs(st, R, N, jnp),
        lengths=jnp.zeros((R, N), jnp.int32),
        done=~live,
        stopped=jnp.zeros((R, N), bool),
        prompt_index=prompt_index,
        branch_ids=branch_ids,
        tail_k=tail, tail_v=tail,
        counts=counts, prompt_mask=prompt_mask)


def empty_outputs(st: Static, R: int, N: int, xp=np) -> Outputs:
    """`Outputs` of R rows x N slots x `st.t_cap` tokens with nothing written
    (`Outputs.fill`), as `xp` arrays: jax.numpy on the device, numpy for the
    host's copy."""
    T, k, pad = st.t_cap, st.top_logprobs, st.pad_id
    return Outputs(tokens=xp.full((R, N, T), pad, np.int32),
                   logprobs=xp.zeros((R, N, T), np.float32),
                   top_logprobs=xp.zeros((R, N, T, k), np.float32),
                   top_ids=xp.full((R, N, T, k), pad, np.int32),
                   token_ranks=xp.zeros((R, N, T if st.token_ranks else 0), np.int32),
                   signals=xp.zeros((R, N, T, 3), np.float32) if st.signals else None)


def compact(prefix: PrefixCache, state: DecodeState, rows: jax.Array, slot_rows: jax.Array,
            slots: jax.Array, live: jax.Array) -> tuple[PrefixCache, DecodeState]:
    """Gather some slots of some rows into a smaller state.

    A new row may take slots from several old rows when they hold the same
    prompt (the pool runs one prompt in several rows, each with an identical
    copy of its prefix): its prefix, prompt index and prompt mask come from
    `rows`, each slot's tail, tokens and counts from (`slot_rows`, `slots`).

    Args:
      rows: `[R']` int32 old row whose prefix each new row takes.
      slot_rows: `[R', N']` int32 old row of each new slot (a row holding the
        same prompt as `rows`).
      slots: `[R', N']` int32 old slot (within that row) of each new slot.
      live: `[R', N']` bool; False for filler slots (repeats of a done slot),
        which are marked done.
    Returns:
      The new rows' PrefixCache and the gathered DecodeState (every field:
      the penalties' counts by slot, the prompt mask by row).
    """
    take_rows = lambda a: jnp.take(a, rows, axis=0)
    take_slots = lambda a: a[slot_rows, slots]  # [R, N, ...] -> [R', N', ...]

    new_prefix = PrefixCache(tuple(map(take_rows, prefix.k)), tuple(map(take_rows, prefix.v)),
                             take_rows(prefix.lengths))
    tm = jax.tree_util.tree_map
    new = state._replace(**{f: tm(take_slots, getattr(state, f)) for f in SLOT_FIELDS},
                         **{f: tm(take_rows, getattr(state, f)) for f in ROW_FIELDS})
    return new_prefix, new._replace(done=new.done | ~live)


def refill(state: DecodeState, last_logits: jax.Array, reset: jax.Array,
           branch_ids: jax.Array, live: jax.Array) -> DecodeState:
    """Give some slots a new branch between chunks (the pool's insert), in place.

    Same shapes, traced values: refilling never recompiles. A reset slot
    starts at token 0 with its row's last prefix logits and empty penalty
    counts; its old tokens, logprobs and tail entries stay in the buffers but
    are never read (columns `>= lengths` are masked, and each step writes
    slot `lengths` before a later step reads it).

    Args:
      state: the DecodeState `[R, N, ...]` (donated).
      last_logits: `[R, V]` float32 each row's distribution for token 0.
      reset: `[R, N]` bool, the slots to restart.
      branch_ids: `[R, N]` int32 the new global branch id of each reset slot
        (ignored elsewhere).
      live: `[R, N]` bool: False for a reset slot left empty (it starts done).
    """
    s = state
    r3 = reset[..., None]
    return s._replace(
        logits=jnp.where(r3, last_logits[:, None], s.logits),
        lengths=jnp.where(reset, 0, s.lengths),
        done=jnp.where(reset, ~live, s.done),
        stopped=jnp.where(reset, False, s.stopped),
        branch_ids=jnp.where(reset, branch_ids, s.branch_ids),
        counts=jnp.where(r3, 0, s.counts) if s.counts.shape[-1] else s.counts)


def new_columns(state: DecodeState, starts: jax.Array, width: int) -> tuple:
    """Each slot's `width` output columns from its own start (the host's copy of a chunk).

    Args:
      state: the DecodeState `[R, N, ...]`.
      starts: `[R, N]` int32, the first column each slot's host copy lacks.
      width: static, the most columns a slot can have written since (the chunk's
        steps); columns past the buffer repeat its last.
    Returns:
      `Outputs` of `[R, N, width, ...]` (token_ranks `[R, N, 0]` without ranks).
    """
    T = state.out.tokens.shape[2]
    idx = jnp.clip(starts[..., None] + jnp.arange(width, dtype=jnp.int32), 0, T - 1)
    take = jax.vmap(jax.vmap(lambda row, i: row[i] if row.shape[0] else row[:0]))
    return jax.tree_util.tree_map(lambda a: take(a, idx), state.out)


def move_slots(state: DecodeState, src_rows: jax.Array, src_slots: jax.Array,
               dst_rows: jax.Array, dst_slots: jax.Array) -> DecodeState:
    """Move branches to other slots between chunks, in place (rows of one prompt).

    Every per-slot field (`state.SLOT_FIELDS`: the next-token logits, outputs,
    tail KV, counts, position) of slot (src_rows[k], src_slots[k]) is copied into
    (dst_rows[k], dst_slots[k]), and the source slot is marked done. Only
    meaningful between rows holding the same prompt (the per-row prefix,
    prompt index and prompt mask stay where they are: a moved branch reads
    its new row's, an identical copy). Duplicated pairs are harmless (the
    pool pads the list to a power of two with repeats of its first pair).

    Args:
      state: the DecodeState `[R, N, ...]` (donated).
      src_rows, src_slots, dst_rows, dst_slots: `[M]` int32; no destination
        may be a source.
    """
    def mv(a):
        return a.at[dst_rows, dst_slots].set(a[src_rows, src_slots])

    moved = {f: jax.tree_util.tree_map(mv, getattr(state, f)) for f in SLOT_FIELDS}
    moved["done"] = moved["done"].at[src_rows, src_slots].set(True)
    return state._replace(**moved)


def insert_rows(prefix: PrefixCache, last: jax.Array, prompt_index: jax.Array,
                prompt_mask: jax.Array, src: PrefixCache, src_last: jax.Array,
                src_rows: jax.Array, rows: jax.Array, src_index: jax.Array,
                src_mask: jax.Array):
    """Copy prefilled prompts into rows of the pool (JetStream's insert).

    Args:
      prefix, last, prompt_index, prompt_mask: the pool's PrefixCache (L x
        `[R, K, P, D]`), last logits `[R, V]`, prompt indices `[R]` and
        prompt mask `[R, V']` (`V' = 0` without penalties).
      src, src_last: the prefilled prompts (L x `[M0, K, P', D]`, P' <= the
        pool's P: a shorter bucket is padded at the end, which is where a
        prefix's padding lies on every layer: a local layer's P_l' < P_l only
        when the prompt is shorter than both extents, so both start at 0;
        `[M0, V]`).
      src_rows: `[M]` int32 the prefilled row to copy into each of `rows`.
      rows: `[M]` int32 the pool row to fill; R (out of range) drops the entry.
      src_index: `[M]` int32 the global prompt index of each (the keys).
      src_mask: `[M, V']` bool the prompt mask of each.
    Returns:
      (prefix, last, prompt_index, prompt_mask) with those rows replaced; the
      rows' slots are left to `refill`.
    """
    def take(a, like=None):
        a = jnp.take(a, src_rows, axis=0)
        if like is not None and a.shape[2] < like.shape[2]:  # [M, K, P', D] -> P
            a = jnp.pad(a, ((0, 0), (0, 0), (0, like.shape[2] - a.shape[2]), (0, 0)))
        return a

    put = lambda a, b: a.at[rows].set(take(b, a if a.ndim == 4 else None).astype(a.dtype),
                                      mode="drop")
    new_prefix = PrefixCache(tuple(map(put, prefix.k, src.k)), tuple(map(put, prefix.v, src.v)),
                             put(prefix.lengths, src.lengths))
    pm = (prompt_mask.at[rows].set(src_mask, mode="drop") if prompt_mask.shape[-1]
          else prompt_mask)
    return (new_prefix, put(last, src_last), prompt_index.at[rows].set(src_index, mode="drop"),
            pm)


def _platform(args) -> str:
    """The platform of the first argument placed on a device, else the default backend's."""
    for a in jax.tree_util.tree_leaves(args):
        devices = getattr(getattr(a, "sharding", None), "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return jax.default_backend()


_PERSISTENT_HITS = threading.local()  # per thread: programs JAX's persistent cache served
_LISTENING = []


def _count_persistent_hits(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _PERSISTENT_HITS.n = getattr(_PERSISTENT_HITS, "n", 0) + 1


def _persistent_hits() -> int:
    """Programs fetched from JAX's persistent compilation cache by this thread so far,
    from JAX's own monitoring event (`jax.monitoring`, recorded by
    `jax._src.compiler.compile_or_get_cached` on a hit)."""
    if not _LISTENING:
        jax.monitoring.register_event_listener(_count_persistent_hits)
        _LISTENING.append(True)
    return getattr(_PERSISTENT_HITS, "n", 0)


class Programs:
    """AOT-compiled programs, cached by static settings and shapes, so compile
    time is measured apart from run time.

    With exported programs on (`disk_cache.exported_dir()`: the command line,
    or `enable_compilation_cache()`), a program is read from its exported
    entry instead of traced, or exported and written when there is none
    (`engine.exported`); otherwise `jit(fn).lower(*args).compile()`.

    Attributes:
      compilations: programs built so far (compiled, or fetched from JAX's
        persistent compilation cache).
      from_cache: how many of them the persistent cache served.
      last_from_cache: whether the last program built came from that cache
        (XLA compiled nothing).
      from_exported: programs read from an exported entry (not traced).
      last_exported: whether the last program built was read from one.
    """

    def __init__(self):
        self._cache: dict[Any, Any] = {}
        self._unsupported: set = set()  # keys jax.export could not export (this process)
        self.compilations = 0
        self.from_cache = 0
        self.last_from_cache = False
        self.from_exported = 0
        self.last_exported = False

    def get(self, key, fn, args, donate=(), out_shardings=None):
        """Returns (compiled, seconds spent compiling now). Compiled with
        `compiler_options` for the platform of the arguments' devices (the
        default backend for arguments without one)."""
        full_key = (key, tuple((a.shape, a.dtype, getattr(a, "sharding", None))
                               for a in jax.tree_util.tree_leaves(args)),
                    jax.tree_util.tree_structure(args))
        hit = self._cache.get(full_key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        hits = _persistent_hits()
        directory = disk_cache.exported_dir() if out_shardings is None else None
        compiled, read = None, False
        options = compiler_options(_platform(args))
        if (directory is not None and full_key not in self._unsupported
                and exported.available()):
            try:
                compiled, read = exported.build(directory, key, fn, args, donate, options)
            except exported.Unsupported:
                self._unsupported.add(full_key)
        if compiled is None:
            kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
            compiled = jax.jit(fn, donate_argnums=donate, **kwargs).lower(*args).compile(
                options or None)
        self._cache[full_key] = compiled
        self.compilations += 1
        self.last_from_cache = _persistent_hits() > hits
        self.from_cache += self.last_from_cache
        self.last_exported = read
        self.from_exported += read
        return compiled, time.perf_counter() - t0

    def clear(self) -> None:
        """Drop every cached program, so its compiled code can be freed (each XLA CPU
        executable holds memory mappings of its own; a long-lived process that
        compiles many shapes can exhaust the kernel's map count, vm.max_map_count)."""
        self._cache.clear()


PROGRAMS = Programs()
