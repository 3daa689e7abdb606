"""`Round`: one decode state over some of a `Session`'s prefilled rows, run in
chunks, and the decode pool (slots and rows refilled between chunks: the
scheduling is `pool.PoolSchedule`, a mixin of `Round`).

The outputs are copied to host arrays indexed by (prompt row, branch) as each
chunk ends, so refills and compaction never lose or move them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.loop import compact, decode_chunk, empty_outputs, init_state, new_columns
from jaxsample.engine.pool import PoolSchedule
from jaxsample.engine.placement import kv_bytes, to_host
from jaxsample.engine.prefill import take_rows
from jaxsample.engine.state import Static, bucket, slot_bucket
from jaxsample.sharding import BRANCH_AXIS

COMPACT_FRACTION = 0.75  # compact when the live slots fit in buckets this much smaller


class Round(PoolSchedule):
    """One decode state: rows x slots, decoded in chunks (see the module docstring).

    The device state holds `R_dev` rows x `N_dev` slots; by default every
    round row and every branch column has its own (`generate`: all admitted
    at once). Given fewer (`rows=`, `slots=`), the round is a pool
    (continuous batching, vLLM; JetStream's prefill / insert / generate, with
    the prefix shared by the row's slots instead of copied into each): before
    each chunk the host gives every finished slot the next waiting branch of
    its row's prompt (`loop.refill`), frees a row whose prompt has no branch
    left to run, and inserts the next waiting prompt into it
    (`loop.insert_rows`, from the session's prefill). Slots run at their own
    token index, keys come from (prompt index, branch id), so a branch's
    tokens depend neither on the pool's size, its slot, nor its neighbours.
    With `lockstep=True` (Bridge: a prompt's branches attend to each other at
    the same position) slots are never refilled inside a row: a prompt enters
    with all its branches, rows are refilled only.

    Host-side outputs (indexed by the round's own rows and branch columns):
      tokens `[R, N, T]` int32, logprobs `[R, N, T]` float32, top_logprobs and
      top_ids `[R, N, T, k]`, token_ranks `[R, N, T]` int32 (`[R, N, 0]`
      without `SamplingParams.logprobs`), lengths `[R, N]` int32, stopped `[R, N]` bool
      (ended by a stop token), done `[R, N]` bool, signals `[R, N, T, 3]`
      float32 (entropy, self-certainty, top-2 margin) with
      `SamplingParams.signals`, else None.

    Args:
      session: the `session.Session` whose prefilled rows the round decodes
        (not annotated: session.py builds rounds, so an annotation would make
        an import cycle).
      rows, branch_ids, max_rows, max_slots, lockstep: as `Session.round`.

    Raises:
      ValueError: `slots` smaller than a prompt's branches with `lockstep`, or
        `branch_ids` not `[R, N]`.
    """

    def __init__(self, session, rows: list[int], branch_ids: np.ndarray,
                 max_rows: int | None = None, max_slots: int | None = None,
                 lockstep: bool = False):
        s = session
        self.s = s
        R, N = len(rows), branch_ids.shape[1]
        if branch_ids.shape[0] != R:
            raise ValueError(f"branch_ids must be [{R}, N], got {branch_ids.shape}")
        self.R, self.N = R, N
        self.branch_ids = branch_ids
        # The host's copy of every branch's outputs, [R, N, T, ...] (T: the requests'
        # longest max_new_tokens).
        self.out = empty_outputs(dataclasses.replace(s.st, t_cap=s.T), R, N)
        self.lengths = np.zeros((R, N), np.int32)
        self.prev = self.lengths.copy()  # lengths before the last chunk
        self.stopped = np.zeros((R, N), bool)
        self.done = branch_ids < 0
        self.t = 0  # the clock: steps this round has run
        self.moved = 0  # branches moved between rows of their prompt (`_migrate`)
        self.lockstep = bool(lockstep)
        # Device slots: a bucket of rows (a multiple of the data axis) x slots
        # (a multiple of the branch axis); slot (i, j) holds round row
        # row_of[i], column col_of[i, j] (-1: empty).
        N_dev = -(-min(N, max_slots or N) // s.nb) * s.nb
        # Rows: at most enough for every branch at once (a prompt's branches may
        # run in several rows, `_next_prompt`), at most max_rows.
        R_all = R if lockstep else R * -(-N // N_dev)
        R_dev = -(-min(R_all, max_rows or R) // s.nd) * s.nd
        self.pooled = R_dev < R or N_dev < N  # fewer device rows x slots than rows x branches
        valid = branch_ids >= 0
        if self.lockstep and int(valid.sum(axis=1).max(initial=0)) > N_dev:
            raise ValueError(f"lockstep (Bridge) rows need every branch of a prompt at once: "
                             f"{int(valid.sum(axis=1).max())} branches > {N_dev} slots")
        placed = min(R, R_dev)
        self.row_of = np.array(list(range(placed)) + [0] * (R_dev - placed), np.int64)
        self.row_placed = np.arange(R_dev) < placed
        self.col_of = np.full((R_dev, N_dev), -1, np.int64)
        self.waiting: dict[int, list[int]] = {}  # round row -> its branch columns not yet run
        for i in range(placed):
            cols = np.nonzero(valid[i])[0]
            if N_dev >= N:  # every column in its own slot (the layout of a plain round)
                self.col_of[i, :N] = np.where(valid[i], np.arange(N), -1)
            else:
                self.col_of[i, :min(cols.size, N_dev)] = cols[:N_dev]
                self.waiting[i] = [int(c) for c in cols[N_dev:]]
        self.queue = list(range(placed, R))  # round rows not yet in the pool
        # Per round row: only branch columns < admit[r] may take a slot (the host
        # raises it: DeepConf's warm-up must finish before later branches start).
        self.admit = np.full(R, N, np.int64)
        prefix_rows = np.array([rows[i] for i in self.row_of[:placed]], np.int32)
        # Padding rows: the session's own padding rows when the round takes every
        # prompt (no gather), else repeats of the first row.
        fill = (np.arange(R, R_dev) if list(rows) == list(range(R)) and R_dev == s.rows_alloc
                else np.full(R_dev - placed, prefix_rows[0]))
        prefix_rows = np.concatenate([prefix_rows, fill]).astype(np.int32)
        self.live_rows_alloc = R_dev
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        ids = np.where(self.col_of >= 0, branch_ids[rr, np.maximum(self.col_of, 0)],
                       0).astype(np.int32)
        pidx = np.array([s.key_of_row(int(r)) for r in prefix_rows], np.int32)
        live = self.col_of >= 0
        live[~self.row_placed] = False
        self.rows = rows
        self._start(prefix_rows, pidx, ids, live)

    # -- device programs ------------------------------------------------------

    def _static(self, n_dev: int) -> Static:
        return dataclasses.replace(self.s.st, n=n_dev // self.s.nb)

    def _mask(self, session_rows) -> np.ndarray:
        """`[M, V]` bool the prompt tokens of some session rows (repetition penalty;
        `[M, 0]` without penalties)."""
        s = self.s
        V = s.cfg.vocab_size if s.st.penalties else 0
        mask = np.zeros((len(session_rows), V), bool)
        if s.st.penalties:
            for j, r in enumerate(session_rows):
                if 0 <= r < len(s.row_prompt):
                    mask[j, s.prompt_ids[s.row_prompt[r]]] = True
        return mask

    def _start(self, prefix_rows, pidx, ids, live):
        s = self.s
        if s.lazy:  # the pool's rows are prefilled here, and are the only prefix caches held
            placed = int(self.row_placed.sum())
            prefix, last = s.prefill_rows(prefix_rows[:placed])
            if prefix.lengths.shape[0] != len(prefix_rows):  # padding rows: copies of row 0
                idx = np.arange(len(prefix_rows))
                idx[placed:] = 0
                out_specs = None if s.m is None else (s.m.prefix_spec, s.m.Ps(s.m.d))
                prefix, last = s.gather("take_rows", take_rows,
                                        (prefix, last, jnp.asarray(idx, jnp.int32)), out_specs)
            s.prefix_bytes = kv_bytes(prefix.k + prefix.v, len(prefix_rows), len(prefix_rows))
        elif np.array_equal(prefix_rows, np.arange(s.rows_alloc)):
            prefix, last = s.prefix, s.last
        else:
            out_specs = None if s.m is None else (s.m.prefix_spec, s.m.Ps(s.m.d))
            prefix, last = s.gather("take_rows", take_rows, (s.prefix, s.last,
                                                             jnp.asarray(prefix_rows)), out_specs)
        st = self._static(ids.shape[1])
        # The prompts' tokens as a [R, V] mask (repetition penalty), built on the host.
        mask = self._mask(prefix_rows)
        fn = lambda l, p, b, v, pm: init_state(st, l, p, b, v, pm)
        args = (last, s.put(pidx, "rows"), s.put(ids, "slots"), s.put(live, "slots"),
                s.put(mask, "rows"))
        if s.m is not None:
            m = s.m
            fn = m.shard_map(fn, (m.Ps(m.d), m.Ps(m.d), m.Ps(m.d, BRANCH_AXIS),
                                  m.Ps(m.d, BRANCH_AXIS), m.Ps(m.d)), s.state_spec)
        prog = s.program(("init", st, s.mesh), fn, args)
        self.prefix, self.last, self.state = prefix, last, prog(*args)
        # The tails as first allocated (the largest they get: compaction shrinks them).
        self.tail_bytes = kv_bytes(self.state.tail_k + self.state.tail_v, self.R,
                                    ids.shape[0])

    def run(self, steps: int) -> bool:
        """Refill the pool (`_schedule`), decode up to `steps` more steps, and copy
        the new tokens to the host arrays.

        Returns:
          True while some branch is live or waiting.
        """
        s = self.s
        self._schedule()
        if self.waiting_branches and not self._live_slots().any():
            raise RuntimeError("the pool has waiting branches but no live slot: a row's "
                               "admit limit was never raised")
        t0 = self.t
        t_stop = t0 + max(int(steps), 1)
        st = self._static(self.col_of.shape[1])
        fn = lambda p, pre, state, kn, bp, c: decode_chunk(st, p, pre, state, kn, bp, c)
        knobs = s.knob_args(t_stop, [self.rows[int(r)] for r in self.row_of])
        args = (s.model_params, self.prefix, self.state, knobs, s.bridge_dev, s.context)
        if s.m is not None:
            m = s.m
            fn = m.shard_map(fn, (m.Ps(), m.prefix_spec, s.state_spec, m.knob_spec, m.Ps(),
                                  m.context_spec), s.state_spec)
        prog = s.program(("decode", st, s.mesh), fn, args, donate=(2,))
        t_run = time.perf_counter()
        self.state = jax.block_until_ready(prog(*args))
        s.timings["decode"] += time.perf_counter() - t_run
        t_host = time.perf_counter()
        t1 = int(to_host(self.state.t))
        ran = t1 - t0
        s.decode_steps += ran
        s.branch_steps += ran * self.col_of.size
        self.t = t1
        self._collect(max(int(steps), 1))
        s.timings["host"] += time.perf_counter() - t_host
        return bool((~self.done).any())

    def _live_slots(self) -> np.ndarray:
        """`[R_dev, N_dev]` bool: slots holding a branch the host has not seen finish."""
        real = self.col_of >= 0
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        live = np.zeros(self.col_of.shape, bool)
        live[real] = ~self.done[rr[real], self.col_of[real]]
        return live

    def _collect(self, width: int):
        """Copy each slot's new tokens (its columns from the host's length to the
        device's: at most `width`, the chunk's steps) and every slot's flags to the
        host arrays. The columns are gathered on the device per slot
        (`loop.new_columns`, one program per width), so what crosses to the host is
        `[R, N, width]`, whatever lengths the chunk ended at."""
        s, st = self.s, self.state
        done = to_host(st.done)
        lengths = to_host(st.lengths)
        stopped = to_host(st.stopped)
        real = self.col_of >= 0
        ri = np.broadcast_to(self.row_of[:, None], self.col_of.shape)[real]
        ci = self.col_of[real]
        self.prev = self.lengths.copy()
        l0, l1 = self.lengths[ri, ci], lengths[real]
        grew = l1 > l0
        if grew.any():
            starts = np.zeros(self.col_of.shape, np.int32)
            starts[real] = l0
            width = int(min(bucket(width), s.st.t_cap))  # few widths: few programs
            fn = lambda state, a: new_columns(state, a, width)
            args = (st, s.put(starts, "slots"))
            if s.m is not None:
                m = s.m
                fn = m.shard_map(fn, (s.state_spec, m.Ps(m.d, BRANCH_AXIS)), s.state_spec.out)
            cols = s.program(("new_columns", width, s.mesh), fn, args)(*args)
            g = l1 - l0
            si, wi = np.nonzero(np.arange(width)[None] < np.where(grew, g, 0)[:, None])
            dst = (ri[si], ci[si], l0[si] + wi)
            for host, col in zip(self.out, cols):
                if host is not None and host.shape[2]:
                    host[dst] = to_host(col)[real][si, wi]
        self.lengths[ri, ci] = l1
        self.stopped[ri, ci] = stopped[real]
        self.done[ri, ci] = done[real] | self.done[ri, ci]

    @property
    def tokens(self):
        return self.out.tokens

    @property
    def logprobs(self):
        return self.out.logprobs

    @property
    def top_logprobs(self):
        return self.out.top_logprobs

    @property
    def top_ids(self):
        return self.out.top_ids

    @property
    def token_ranks(self):
        return self.out.token_ranks

    @property
    def signals(self):
        return self.out.signals

    def clear_branch(self, r: int, c: int) -> None:
        """Forget what branch (round row r, column c) recorded (every output back to
        its fill value), as if it had never been drawn."""
        for host, fill in zip(self.out, self.out.fill(self.s.st.pad_id)):
            if host is not None:
                host[r, c] = fill

    def new_tokens(self, t0=None):
        """(row, column, new tokens excluding a final stop token) of every branch
        that decoded something in the last chunk (`t0`, the chunk's global start
        step that the callers pass, is ignored: slots of a pool run at their own
        positions)."""
        out = []
        for r, c in zip(*np.nonzero(self.lengths > self.prev)):
            L = int(self.lengths[r, c])
            p = int(self.prev[r, c])
            end = L - 1 if self.stopped[r, c] else L
            out.append((int(r), int(c), self.tokens[r, c, p:max(end, p)]))
        return out

    def finish_slots(self, mask: np.ndarray):
        """Mark branches done from the host (`mask [R, N]` bool, round rows x
        columns); a branch not yet in a slot is then never run."""
        mask = np.asarray(mask, bool) & ~self.done
        if not mask.any():
            return
        self.done |= mask
        real = self.col_of >= 0
        dev = np.zeros(self.col_of.shape, bool)
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        dev[real] = mask[rr[real], self.col_of[real]]
        if dev.any():
            done = to_host(self.state.done) | dev
            self.state = self.state._replace(done=self.s.put(done, "slots"))

    def compact(self) -> bool:
        """Gather the live branches into a smaller state when one fits in at most
        `COMPACT_FRACTION` of the slots (only once nothing waits for a slot: a
        pool refills instead).

        Live branches are grouped by prompt, not by row: a prompt running in
        several rows (each with a copy of its prefix) is packed into as few
        rows as its branches need. Rows x slots are powers of two (times the
        mesh axes: `slot_bucket`), so the compiled shapes stay few; of the
        shapes that hold every live branch, the one with the fewest slots
        (then the fewest rows) is taken. Rows may become wider than before
        (a prompt's stragglers from four 2-slot rows in one 8-slot row).

        Returns:
          True if the state was compacted.
        """
        s = self.s
        if self.waiting_branches:
            return False
        live = self._live_slots()
        if not live.any():
            return False
        by_prompt: dict[int, list[tuple[int, int]]] = {}  # round row -> live (pool row, slot)
        for i, j in zip(*np.nonzero(live)):
            by_prompt.setdefault(int(self.row_of[i]), []).append((int(i), int(j)))
        R_dev, N_dev = self.col_of.shape
        widest = slot_bucket(max(len(v) for v in by_prompt.values()), s.nb)
        best = None
        n = s.nb
        while n <= widest:
            r = slot_bucket(sum(-(-len(v) // n) for v in by_prompt.values()), s.nd)
            if best is None or (r * n, r) < (best[0] * best[1], best[0]):
                best = (r, n)
            n *= 2
        R_new, N_new = best
        if R_new * N_new > COMPACT_FRACTION * R_dev * N_dev:
            return False
        src_rows = np.zeros((R_new,), np.int32)
        slot_rows = np.zeros((R_new, N_new), np.int32)
        slots = np.zeros((R_new, N_new), np.int32)
        new_live = np.zeros((R_new, N_new), bool)
        col_of = np.full((R_new, N_new), -1, np.int64)
        row_of = np.zeros((R_new,), np.int64)
        i = 0
        for r, members in by_prompt.items():
            for k in range(0, len(members), N_new):
                part = members[k:k + N_new]
                src_rows[i], row_of[i] = part[0][0], r
                for j, (a, b) in enumerate(part):
                    slot_rows[i, j], slots[i, j] = a, b
                    col_of[i, j] = self.col_of[a, b]
                    new_live[i, j] = True
                slot_rows[i, len(part):], slots[i, len(part):] = part[0]  # fillers: done
                i += 1
        placed = i
        src_rows[placed:] = src_rows[0]  # padding rows: copies of the first, all slots done
        slot_rows[placed:], slots[placed:] = slot_rows[0, 0], slots[0, 0]
        row_of[placed:] = row_of[0]
        t0, c0 = time.perf_counter(), s.timings["compile"]
        args = (self.prefix, self.state, jnp.asarray(src_rows), jnp.asarray(slot_rows),
                jnp.asarray(slots), jnp.asarray(new_live))
        out_specs = None if s.m is None else (s.m.prefix_spec, s.state_spec)
        self.prefix, self.state = jax.block_until_ready(s.gather("compact", compact, args,
                                                                 out_specs))
        s.timings["decode"] += time.perf_counter() - t0 - (s.timings["compile"] - c0)
        self.row_of = row_of
        self.row_placed = np.arange(R_new) < placed
        self.last = None  # no refill after a compaction (nothing waits)
        self.col_of = col_of
        return True
