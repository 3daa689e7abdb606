"""`Round`: one decode state over some of a `Session`'s prefilled rows, run in
chunks: the pool's runner. Its scheduler (`scheduler.Scheduler`, host data
only) decides between chunks which slots refill, which rows take which
prompts, which branches move and when the state compacts; the round applies
those plans to the device state (`loop`: refill, insert_rows, move_slots,
compact) and runs the chunks.

The outputs are copied to host arrays indexed by (prompt row, branch) as each
chunk ends, so refills and compaction never lose or move them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.buckets import bucket, slot_bucket
from jaxsample.engine.loop import (
    compact,
    decode_chunk,
    empty_outputs,
    init_state,
    insert_rows,
    move_slots,
    new_columns,
    refill,
)
from jaxsample.engine.placement import kv_bytes, to_host
from jaxsample.engine.prefill import take_rows
from jaxsample.engine.scheduler import Scheduler
from jaxsample.engine.state import Static
from jaxsample.sharding import BRANCH_AXIS


class Round:
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
        self.t = 0  # the clock: steps this round has run
        # Device slots: a bucket of rows (a multiple of the data axis) x slots
        # (a multiple of the branch axis); the scheduler maps slot (i, j) to round
        # row row_of[i], column col_of[i, j] (-1: empty).
        N_dev = -(-min(N, max_slots or N) // s.nb) * s.nb
        # Rows: at most enough for every branch at once (a prompt's branches may
        # run in several rows), at most max_rows.
        R_all = R if lockstep else R * -(-N // N_dev)
        R_dev = -(-min(R_all, max_rows or R) // s.nd) * s.nd
        self.pooled = R_dev < R or N_dev < N  # fewer device rows x slots than rows x branches
        self.sched = Scheduler(branch_ids, R_dev, N_dev, lockstep)
        placed = int(self.sched.row_placed.sum())
        prefix_rows = np.array([rows[i] for i in self.row_of[:placed]], np.int32)
        # Padding rows: the session's own padding rows when the round takes every
        # prompt (no gather), else repeats of the first row.
        fill = (np.arange(R, R_dev) if list(rows) == list(range(R)) and R_dev == s.rows_alloc
                else np.full(R_dev - placed, prefix_rows[0]))
        prefix_rows = np.concatenate([prefix_rows, fill]).astype(np.int32)
        self.live_rows_alloc = R_dev
        pidx = np.array([s.key_of_row(int(r)) for r in prefix_rows], np.int32)
        live = self.sched.col_of >= 0
        live[~self.sched.row_placed] = False
        self.rows = rows
        self._start(prefix_rows, pidx, self.sched.slot_ids(), live)

    # -- the scheduler's map, read through the round ------------------------------

    @property
    def row_of(self):
        return self.sched.row_of

    @property
    def col_of(self):
        return self.sched.col_of

    @property
    def row_placed(self):
        return self.sched.row_placed

    @property
    def done(self):
        return self.sched.done

    @property
    def admit(self):
        return self.sched.admit

    @property
    def waiting_branches(self) -> int:
        return self.sched.waiting_branches

    @property
    def moved(self) -> int:
        """Branches moved between rows of their prompt so far."""
        return self.sched.moved

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
        """Apply the scheduler's boundary plan (refills, inserts, moves), decode up
        to `steps` more steps, and copy the new tokens to the host arrays.

        Returns:
          True while some branch is live or waiting.
        """
        s = self.s
        self._apply(self.sched.boundary())
        if self.waiting_branches and not self.sched.live_slots().any():
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
        self.sched.done[ri, ci] = done[real] | self.sched.done[ri, ci]

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
        self.sched.done |= mask
        real = self.col_of >= 0
        dev = np.zeros(self.col_of.shape, bool)
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        dev[real] = mask[rr[real], self.col_of[real]]
        if dev.any():
            done = to_host(self.state.done) | dev
            self.state = self.state._replace(done=self.s.put(done, "slots"))

    def compact(self) -> bool:
        """Gather the live branches into a smaller state when the scheduler finds
        one (`Scheduler.compaction`: once nothing waits, the smallest power-of-two
        shape holding every live branch, grouped by prompt, at most
        `scheduler.COMPACT_FRACTION` of the slots).

        Returns:
          True if the state was compacted.
        """
        s = self.s
        plan = self.sched.compaction(s.nb, s.nd)
        if plan is None:
            return False
        t0, c0 = time.perf_counter(), s.timings["compile"]
        args = (self.prefix, self.state, jnp.asarray(plan.src_rows), jnp.asarray(plan.slot_rows),
                jnp.asarray(plan.slots), jnp.asarray(plan.live))
        out_specs = None if s.m is None else (s.m.prefix_spec, s.state_spec)
        self.prefix, self.state = jax.block_until_ready(s.gather("compact", compact, args,
                                                                 out_specs))
        s.timings["decode"] += time.perf_counter() - t0 - (s.timings["compile"] - c0)
        self.last = None  # no refill after a compaction (nothing waits)
        return True

    # -- applying the scheduler's plans ---------------------------------------------

    def _apply(self, plan) -> None:
        """A `scheduler.Boundary` on the device: the moves, then the inserts, then
        the refill."""
        if plan.moves:
            self._move(plan.moves)
        if plan.inserts:
            self._insert(plan.inserts)
        if plan.reset.any():
            self._refill(plan.reset, plan.new_ids, plan.live)

    def _move(self, moves):
        """`loop.move_slots` for (src row, src slot, dst row, dst slot) `moves`."""
        s = self.s
        M = slot_bucket(len(moves))
        m = np.array(moves + moves[:1] * (M - len(moves)), np.int32).T
        args = (self.state,) + tuple(jnp.asarray(a) for a in m)
        t0, c0 = time.perf_counter(), s.timings["compile"]
        if s.m is None:
            self.state = s.program(("move_slots",), move_slots, args, donate=(0,))(*args)
        else:
            self.state = s.gather("move_slots", move_slots, args, s.state_spec)
        jax.block_until_ready(self.state)
        s.timings["decode"] += time.perf_counter() - t0 - (s.timings["compile"] - c0)

    def _insert(self, inserted):
        """Copy the prefixes of `inserted` ((pool row, round row) pairs) into the pool.

        Eager sessions copy from the session's prefill. Lazy ones prefill each
        prompt not already in a pool row (one `prefill_rows` call per length
        bucket, at that bucket, its rows a power-of-two count), then copy a
        prompt already in the pool from its row (a prompt running in several
        rows is prefilled once).
        """
        s = self.s
        t0, c0, p0 = time.perf_counter(), s.timings["compile"], s.timings["prefill"]
        if not s.lazy:
            self._insert_from(s.prefix, s.last, [(i, self.rows[r]) for i, r in inserted])
        else:
            dest = {i for i, _ in inserted}
            held = {}  # round row -> a pool row (not being replaced) holding its prefix
            for i in np.nonzero(self.row_placed)[0]:
                if int(i) not in dest:
                    held.setdefault(int(self.row_of[i]), int(i))
            fresh, copies = [], []
            for i, r in inserted:
                if r in held:
                    copies.append((i, held[r]))
                else:
                    held[r] = i
                    fresh.append((i, r))
            by_bucket = {}  # one prefill per length bucket of the prompts taken now
            for i, r in fresh:
                n_tok = len(s.ids[s.row_prompt[self.rows[r]]])
                by_bucket.setdefault(bucket(n_tok), []).append((i, r))
            for group in by_bucket.values():
                M = slot_bucket(len(group), s.nd)
                src_rows = [self.rows[r] for _, r in group]
                src_rows += src_rows[:1] * (M - len(src_rows))
                prefix, last = s.prefill_rows(src_rows, own_bucket=True)
                self._insert_from(prefix, last, [(i, j) for j, (i, _) in enumerate(group)],
                                  [self.rows[r] for _, r in group])
            if copies:
                self._insert_from(self.prefix, self.last, copies,
                                  [self.rows[int(self.row_of[j])] for _, j in copies])
        dt = time.perf_counter() - t0
        s.timings["decode"] += dt - (s.timings["compile"] - c0) - (s.timings["prefill"] - p0)

    def _insert_from(self, prefix, last, pairs, session_rows=None):
        """`loop.insert_rows`: pool row i <- row j of (prefix, last) for (i, j) in
        `pairs`; `session_rows` (default: the j) are the session rows they hold
        (their prompt indices and masks)."""
        s = self.s
        R_dev = self.col_of.shape[0]
        M = slot_bucket(len(pairs))
        dest = np.full((M,), R_dev, np.int32)  # R_dev: dropped (padding)
        src = np.zeros((M,), np.int32)
        rows = np.zeros((M,), np.int32)
        session_rows = [j for _, j in pairs] if session_rows is None else session_rows
        for k, ((i, j), r) in enumerate(zip(pairs, session_rows)):
            dest[k], src[k], rows[k] = i, j, r
        pidx = np.array([s.key_of_row(int(r)) for r in rows], np.int32)
        mask = self._mask(rows)
        args = (self.prefix, self.last, self.state.prompt_index, self.state.prompt_mask,
                prefix, last, jnp.asarray(src), jnp.asarray(dest), jnp.asarray(pidx),
                jnp.asarray(mask))
        out_specs = (None if s.m is None
                     else (s.m.prefix_spec, s.m.Ps(s.m.d), s.m.Ps(s.m.d), s.m.Ps(s.m.d)))
        self.prefix, self.last, pi, pm = jax.block_until_ready(
            s.gather("insert_rows", insert_rows, args, out_specs))
        self.state = self.state._replace(prompt_index=pi, prompt_mask=pm)

    def _refill(self, reset, new_ids, live):
        s = self.s
        fn = refill
        args = (self.state, self.last, s.put(reset, "slots"), s.put(new_ids, "slots"),
                s.put(live, "slots"))
        if s.m is not None:
            m = s.m
            sl = m.Ps(m.d, BRANCH_AXIS)
            fn = m.shard_map(fn, (s.state_spec, m.Ps(m.d), sl, sl, sl), s.state_spec)
        prog = s.program(("refill", self._static(self.col_of.shape[1]), s.mesh), fn, args,
                         donate=(0,))
        self.state = prog(*args)
