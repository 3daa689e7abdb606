"""The decode pool's scheduler: which branch runs in which slot, as plain data.

The pool (`round.Round`) holds R_dev device rows x N_dev slots; a row holds
one prompt's prefix cache, a slot one branch's tail. The scheduler keeps the
host's map from device slots to (round row, branch column) and decides,
between chunks, what the device must do (`Boundary`: slots to refill with a
prompt's next branch, rows to insert a prompt into, branches to move between
rows of their prompt) and when the live branches fit a smaller state
(`Compaction`: gather indices and the new shape). It is numpy and Python
only: no JAX, no device, no model. The runner (`round.Round`) applies its
plans to the device state, so the scheduling can be tested on synthetic
branch lengths (tests/pool/test_scheduler.py).

The rules (continuous batching: vLLM's scheduler, JetStream's prefill /
insert / generate, with the prefix shared by the slots of a row):

* refill: a finished slot takes the next waiting branch of its row's prompt
  (a prompt's branches start in column order, never beyond `admit`: DeepConf's
  warm-up must finish before later branches start);
* migration: a prompt with nothing left to start packs its live branches into
  fewer of its rows, so the others free up for the next prompt (a branch moves
  with its tail, outputs and position; only between rows of one prompt, which
  hold identical prefix copies);
* row refill: a free row takes first a prompt already in the pool with at
  least a row's worth of admitted branches waiting, then the next prompt off
  the queue, then a resident prompt with fewer waiting branches;
* lockstep (Bridge: a prompt's branches attend to each other at the same
  position): no slot refill inside a row and no migration; rows take whole
  prompts;
* compaction: once nothing waits, the live branches are grouped by prompt
  into the smallest power-of-two shape (times the mesh axes) that holds them,
  when it is at most `COMPACT_FRACTION` of the slots.

Letters: R round rows (prompts, or prompt copies in the naive baseline), N
branch columns, R_dev x N_dev the device rows x slots.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxsample.engine.buckets import slot_bucket

COMPACT_FRACTION = 0.75  # compact when the live slots fit in buckets this much smaller


@dataclasses.dataclass
class Boundary:
    """What the device does before a chunk, in this order: moves, inserts, refill.

    Attributes:
      moves: (src row, src slot, dst row, dst slot) device positions; every move
        reads the state from before them all.
      inserts: (device row, round row) pairs: the row takes that prompt's prefix.
      reset: `[R_dev, N_dev]` bool, slots that start a new branch at token 0.
      new_ids: `[R_dev, N_dev]` int32 its global branch id (where reset).
      live: `[R_dev, N_dev]` bool, False for a reset slot left empty.
    """

    moves: list[tuple[int, int, int, int]]
    inserts: list[tuple[int, int]]
    reset: np.ndarray
    new_ids: np.ndarray
    live: np.ndarray

    @property
    def empty(self) -> bool:
        return not self.moves and not self.inserts and not self.reset.any()


@dataclasses.dataclass
class Compaction:
    """A smaller device state: new row i takes the prefix of old row `src_rows[i]`,
    its slot j the slot (`slot_rows[i, j]`, `slots[i, j]`); `live` False marks
    filler slots (repeats of a live one, started done)."""

    src_rows: np.ndarray  # [R'] int32
    slot_rows: np.ndarray  # [R', N'] int32
    slots: np.ndarray  # [R', N'] int32
    live: np.ndarray  # [R', N'] bool


class Scheduler:
    """The host's map of the pool and its decisions (see the module docstring).

    Args:
      branch_ids: `[R, N]` int32, the global branch id of each round row's
        column (-1: a column that is never drawn).
      rows, slots: the device shape R_dev x N_dev (multiples of the mesh's
        data and branch axes).
      lockstep: a Bridge's rows (see the module docstring).

    Attributes:
      row_of: `[R_dev]` the round row each device row holds (meaningful where
        `row_placed`); col_of: `[R_dev, N_dev]` the branch column each slot
        holds (-1: empty); done: `[R, N]` bool, branches finished (or never
        drawn); waiting: round row -> its columns not yet given a slot;
        queue: round rows not yet in the pool; admit: `[R]` columns below it
        may start.

    Raises:
      ValueError: `branch_ids` not 2-D, or a lockstep row with more branches
        than slots.
    """

    def __init__(self, branch_ids: np.ndarray, rows: int, slots: int, lockstep: bool = False):
        branch_ids = np.asarray(branch_ids, np.int32)
        if branch_ids.ndim != 2:
            raise ValueError(f"branch_ids must be [R, N], got {branch_ids.shape}")
        R, N = branch_ids.shape
        self.branch_ids = branch_ids
        self.lockstep = bool(lockstep)
        self.done = branch_ids < 0
        valid = ~self.done
        if self.lockstep and int(valid.sum(axis=1).max(initial=0)) > slots:
            raise ValueError(f"lockstep (Bridge) rows need every branch of a prompt at once: "
                             f"{int(valid.sum(axis=1).max())} branches > {slots} slots")
        placed = min(R, rows)
        self.row_of = np.array(list(range(placed)) + [0] * (rows - placed), np.int64)
        self.row_placed = np.arange(rows) < placed
        self.col_of = np.full((rows, slots), -1, np.int64)
        self.waiting: dict[int, list[int]] = {}
        for i in range(placed):
            cols = np.nonzero(valid[i])[0]
            if slots >= N:  # every column in its own slot (the layout of a plain round)
                self.col_of[i, :N] = np.where(valid[i], np.arange(N), -1)
            else:
                self.col_of[i, :min(cols.size, slots)] = cols[:slots]
                self.waiting[i] = [int(c) for c in cols[slots:]]
        self.queue = list(range(placed, R))
        self.admit = np.full(R, N, np.int64)
        self.moved = 0  # branches moved between rows of their prompt

    # -- views ------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """(R_dev, N_dev)."""
        return self.col_of.shape

    def slot_ids(self) -> np.ndarray:
        """`[R_dev, N_dev]` int32 the global branch id of each slot (0 where empty)."""
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        return np.where(self.col_of >= 0, self.branch_ids[rr, np.maximum(self.col_of, 0)],
                        0).astype(np.int32)

    def live_slots(self) -> np.ndarray:
        """`[R_dev, N_dev]` bool: slots holding a branch not seen finished."""
        real = self.col_of >= 0
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        live = np.zeros(self.col_of.shape, bool)
        live[real] = ~self.done[rr[real], self.col_of[real]]
        return live

    @property
    def waiting_branches(self) -> int:
        """Branches not yet given a slot (in rows in the pool, and in waiting rows)."""
        queued = sum(int(((self.branch_ids[r] >= 0) & ~self.done[r]).sum()) for r in self.queue)
        return sum(len(w) for w in self.waiting.values()) + queued

    # -- between chunks ---------------------------------------------------------

    def boundary(self) -> Boundary:
        """The refills, moves and inserts before the next chunk; the map is updated
        to what the device holds once they are applied."""
        R_dev, N_dev = self.col_of.shape
        reset = np.zeros((R_dev, N_dev), bool)
        new_ids = np.zeros((R_dev, N_dev), np.int32)
        live = np.zeros((R_dev, N_dev), bool)
        if not self.queue and not any(self.waiting.values()):
            return Boundary([], [], reset, new_ids, live)
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
        moves = self._migrate(reset)
        busy = self.live_slots().any(axis=1)
        for i in np.nonzero(self.row_placed & ~busy)[0]:
            if not self.waiting[int(self.row_of[i])]:  # nothing left of it here: free it
                self.row_placed[i] = False
                self.col_of[i] = -1
                free_rows.append(int(i))
        inserts = []
        for i in free_rows:
            r = self._next_prompt(N_dev)
            if r is None:
                break
            w = self.waiting[r]
            first = [c for c in w if c < self.admit[r]][:N_dev]
            taken = set(first)
            self.waiting[r] = [c for c in w if c not in taken]
            self.row_of[i], self.row_placed[i] = r, True
            self.col_of[i] = -1
            m = len(first)
            self.col_of[i, :m] = first
            reset[i] = True
            live[i, :m] = True
            new_ids[i, :m] = self.branch_ids[r, first]
            inserts.append((i, r))
        for r in [r for r, w in self.waiting.items() if not w]:
            if not (self.row_placed & (self.row_of == r)).any():
                del self.waiting[r]  # settled: no row holds it, nothing waits
        return Boundary(moves, inserts, reset, new_ids, live)

    def _migrate(self, reset: np.ndarray) -> list[tuple[int, int, int, int]]:
        """Pack the live branches of a prompt with nothing left to start into fewer
        of its rows, so the rows emptied take the next prompt now (only while
        something else waits; not with `lockstep`).

        A prompt run in several rows ends with each row part-empty: a row's
        finished slot cannot take another prompt's branch (the row holds one
        prefix), so without this it idles until the row's slowest branch ends.
        Greedy: the row with the fewest live branches is emptied into the free
        slots of the prompt's other rows while they have room (a row with a slot
        refilled in this boundary, `reset`, is not emptied: its new branch is not
        on the device yet; nor is a row that took a moved branch: every move of a
        boundary reads the state from before them all).
        """
        if self.lockstep or not (self.queue or any(self.waiting.values())):
            return []
        live = self.live_slots()
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
        self.moved += len(moves)
        return moves

    def _next_prompt(self, n_dev: int) -> int | None:
        """The round row whose branches a free device row takes next (None: none).
        See the module docstring's "row refill"."""
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

    def compaction(self, nb: int = 1, nd: int = 1) -> Compaction | None:
        """The smaller state the live branches fit, or None (something waits, nothing
        is live, or no shape is at most `COMPACT_FRACTION` of the slots).

        Live branches are grouped by prompt, not by row: a prompt running in
        several rows (each with a copy of its prefix) is packed into as few rows
        as its branches need. Rows x slots are `slot_bucket`s of the mesh's data
        (`nd`) and branch (`nb`) axes; of the shapes that hold every live branch,
        the one with the fewest slots (then the fewest rows). The map is updated
        to the new state.
        """
        if self.waiting_branches:
            return None
        live = self.live_slots()
        if not live.any():
            return None
        by_prompt: dict[int, list[tuple[int, int]]] = {}  # round row -> live (row, slot)
        for i, j in zip(*np.nonzero(live)):
            by_prompt.setdefault(int(self.row_of[i]), []).append((int(i), int(j)))
        R_dev, N_dev = self.col_of.shape
        widest = slot_bucket(max(len(v) for v in by_prompt.values()), nb)
        best, n = None, nb
        while n <= widest:
            r = slot_bucket(sum(-(-len(v) // n) for v in by_prompt.values()), nd)
            if best is None or (r * n, r) < (best[0] * best[1], best[0]):
                best = (r, n)
            n *= 2
        R_new, N_new = best
        if R_new * N_new > COMPACT_FRACTION * R_dev * N_dev:
            return None
        plan = Compaction(src_rows=np.zeros((R_new,), np.int32),
                          slot_rows=np.zeros((R_new, N_new), np.int32),
                          slots=np.zeros((R_new, N_new), np.int32),
                          live=np.zeros((R_new, N_new), bool))
        col_of = np.full((R_new, N_new), -1, np.int64)
        row_of = np.zeros((R_new,), np.int64)
        i = 0
        for r, members in by_prompt.items():
            for k in range(0, len(members), N_new):
                part = members[k:k + N_new]
                plan.src_rows[i], row_of[i] = part[0][0], r
                for j, (a, b) in enumerate(part):
                    plan.slot_rows[i, j], plan.slots[i, j] = a, b
                    col_of[i, j] = self.col_of[a, b]
                    plan.live[i, j] = True
                plan.slot_rows[i, len(part):], plan.slots[i, len(part):] = part[0]  # fillers
                i += 1
        placed = i
        plan.src_rows[placed:] = plan.src_rows[0]  # padding rows: copies of the first, done
        plan.slot_rows[placed:], plan.slots[placed:] = plan.slot_rows[0, 0], plan.slots[0, 0]
        row_of[placed:] = row_of[0]
        self.row_of, self.col_of = row_of, col_of
        self.row_placed = np.arange(R_new) < placed
        return plan
