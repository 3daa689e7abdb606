"""The decode pool's scheduling between chunks: refill, row refill, slot moves.

`PoolSchedule` is the half of `round.Round` that runs on the host before each
chunk when the round has fewer device rows x slots than prompts x branches
(continuous batching; see `Round` and docs/ARCHITECTURE.md, "The decode
pool"): a finished slot takes its row's prompt's next waiting branch, a
prompt with nothing left to start packs its live branches into fewer of its
rows (`_migrate`), a settled row is freed, and a free row takes the next
branches of a prompt (`_next_prompt`), prefilled then if it is new
(`_insert`). It reads and writes the Round's host bookkeeping (`row_of`,
`col_of`, `row_placed`, `waiting`, `queue`, `admit`, `done`) and its device
state.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.loop import insert_rows, move_slots, refill
from jaxsample.engine.state import bucket, slot_bucket
from jaxsample.sharding import BRANCH_AXIS


class PoolSchedule:
    """The pool's between-chunk scheduling (a mixin of `round.Round`)."""

    @property
    def waiting_branches(self) -> int:
        """Branches not yet given a slot (in rows in the pool, and in waiting rows)."""
        queued = sum(int(((self.branch_ids[r] >= 0) & ~self.done[r]).sum())
                     for r in self.queue)
        return sum(len(w) for w in self.waiting.values()) + queued

    def _schedule(self):
        """Before a chunk: refill finished slots with their row's prompt's waiting
        branches, free settled rows, and give each free row the next branches
        of a prompt (`_next_prompt`)."""
        if not self.queue and not any(self.waiting.values()):
            return
        R_dev, N_dev = self.col_of.shape
        reset = np.zeros((R_dev, N_dev), bool)
        new_ids = np.zeros((R_dev, N_dev), np.int32)
        live = np.zeros((R_dev, N_dev), bool)
        free_rows = []
        for i in range(R_dev):
            if not self.row_placed[i]:
                free_rows.append(i)
                continue
            r = int(self.row_of[i])
            cols = self.col_of[i]
            free = (cols < 0) | self.done[r, np.maximum(cols, 0)]
            w = [c for c in self.waiting.get(r, []) if not self.done[r, c]]
            if not self.lockstep:
                for j in np.nonzero(free)[0]:
                    if not w or w[0] >= self.admit[r]:
                        break
                    c = w.pop(0)
                    self.col_of[i, j] = c
                    reset[i, j] = live[i, j] = True
                    new_ids[i, j] = self.branch_ids[r, c]
                    free[j] = False
            self.waiting[r] = w
        self._migrate(reset)
        busy = self._live_slots().any(axis=1)
        for i in np.nonzero(self.row_placed & ~busy)[0]:
            if not self.waiting[int(self.row_of[i])]:  # nothing left of it for this row: free it
                self.row_placed[i] = False
                self.col_of[i] = -1
                free_rows.append(int(i))
        inserted = []
        for i in free_rows:
            r = self._next_prompt(N_dev)
            if r is None:
                break
            w = self.waiting[r]
            first = [c for c in w if c < self.admit[r]][:N_dev]
            self.waiting[r] = [c for c in w if c not in set(first)]
            self.row_of[i], self.row_placed[i] = r, True
            self.col_of[i] = -1
            m = len(first)
            self.col_of[i, :m] = first
            reset[i] = True
            live[i, :m] = True
            new_ids[i, :m] = self.branch_ids[r, first]
            inserted.append((i, r))
        for r in [r for r, w in self.waiting.items() if not w]:
            if not (self.row_placed & (self.row_of == r)).any():
                del self.waiting[r]  # settled: no row holds it, nothing waits
        if inserted:
            self._insert(inserted)
        if reset.any():
            self._refill(reset, new_ids, live)

    def _migrate(self, reset: np.ndarray):
        """Pack the live branches of a prompt with nothing left to start into fewer
        of its rows, so the rows emptied take the next prompt now (only while
        something else waits; not with `lockstep`).

        A prompt run in several rows ends with each row part-empty: a row's
        finished slot cannot take another prompt's branch (the row holds one
        prefix), so without this it idles until the row's slowest branch ends.
        The rows of one prompt hold identical prefix copies, so a branch moves
        to another of them with its tail, outputs and position
        (`loop.move_slots`) and its tokens are unchanged. Greedy: the row with
        the fewest live branches is emptied into the free slots of the
        prompt's other rows while they have room (a row with a slot refilled
        in this boundary, `reset`, is not emptied: its new branch is not on
        the device yet; nor is a row that took a moved branch: every move of
        a boundary reads the state from before them all).
        """
        if self.lockstep or not (self.queue or any(self.waiting.values())):
            return
        live = self._live_slots()
        rows_of: dict[int, list[int]] = {}
        for i in np.nonzero(self.row_placed)[0]:
            r = int(self.row_of[i])
            if not self.waiting.get(r):
                rows_of.setdefault(r, []).append(int(i))
        moves = []
        for r, rows in rows_of.items():
            if len(rows) < 2:
                continue
            open_ = {i: [int(j) for j in np.nonzero(~live[i] & ~reset[i])[0]] for i in rows}
            received = set()
            for src in sorted(rows, key=lambda i: int(live[i].sum())):
                n_live = int(live[src].sum())
                # A row that received a branch in this boundary is no source: the
                # moves all read the state before any of them (`move_slots`).
                if n_live == 0 or reset[src].any() or src in received:
                    continue
                dests = [i for i in sorted(rows, key=lambda i: -int(live[i].sum())) if i != src]
                if sum(len(open_[i]) for i in dests) < n_live:
                    continue
                for j in np.nonzero(live[src])[0]:
                    d = next(i for i in dests if open_[i])
                    dj = open_[d].pop(0)
                    moves.append((src, int(j), d, dj))
                    received.add(d)
                    self.col_of[d, dj] = self.col_of[src, j]
                    self.col_of[src, j] = -1
                    live[d, dj], live[src, j] = True, False
                open_[src] = []  # emptied: takes no branch back
        if moves:
            self._move(moves)
            self.moved += len(moves)

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

    def _next_prompt(self, n_dev: int) -> int | None:
        """The round row whose branches a free pool row takes next (None: none).

        First a prompt already in the pool with at least a row's worth of
        admitted branches waiting (its branches then run in several rows, each
        with its own copy of the prefix: the pool never idles while a prompt
        has work), then the next waiting prompt (taken off the queue, its
        branches then wait in `waiting`), then a prompt in the pool with
        fewer waiting branches (better a part-filled row than an idle one).
        Lockstep (Bridge) rows take whole prompts off the queue only.
        """
        def ready(r):
            return sum(1 for c in self.waiting[r] if c < self.admit[r] and not self.done[r, c])

        resident = [] if self.lockstep else [(r, ready(r)) for r in sorted(self.waiting)]
        for r, k in resident:
            if k >= n_dev:
                return r
        while self.queue:
            r = self.queue.pop(0)
            cols = np.nonzero((self.branch_ids[r] >= 0) & ~self.done[r])[0]
            if cols.size:
                self.waiting[r] = [int(c) for c in cols]
                return r
        resident = [(k, -r) for r, k in resident if k > 0]
        return -max(resident)[1] if resident else None

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
