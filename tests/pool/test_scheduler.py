"""The pool's scheduler on synthetic branch lengths, with no JAX and no model.

A tiny host simulator plays the device: each slot holding a live branch
advances one token per step, and a branch finishes when it reaches its drawn
length. The scheduler's plans (`Boundary`, `Compaction`) are applied to the
simulator's own copy of the pool, so the checks are on what a device would
hold, not on the scheduler's map of it.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
from paths import ROOT

from jaxsample.engine.scheduler import COMPACT_FRACTION, Scheduler


class Device:
    """What the device would hold: the prompt of each row, and per slot the
    (prompt, column) branch and its position; applies plans as the runner does."""

    def __init__(self, sched: Scheduler, ids: np.ndarray):
        self.ids = ids
        R_dev, N_dev = sched.shape
        self.prompt = np.array(sched.row_of)
        self.branch = np.full((R_dev, N_dev), -1)  # global branch id, -1 empty
        self.pos = np.zeros((R_dev, N_dev), int)
        self.done = np.ones((R_dev, N_dev), bool)
        for i in np.nonzero(sched.row_placed)[0]:
            for j, c in enumerate(sched.col_of[i]):
                if c >= 0:
                    self.branch[i, j], self.done[i, j] = ids[self.prompt[i], c], False

    def apply(self, b):
        before = (self.branch.copy(), self.pos.copy(), self.done.copy())
        for si, sj, di, dj in b.moves:  # every move reads the state before them all
            assert self.prompt[si] == self.prompt[di], "a branch moved to another prompt's row"
            self.branch[di, dj], self.pos[di, dj], self.done[di, dj] = (
                before[0][si, sj], before[1][si, sj], before[2][si, sj])
            self.branch[si, sj], self.done[si, sj] = -1, True
        for i, r in b.inserts:
            self.prompt[i] = r
        reset = b.reset
        self.branch[reset] = np.where(b.live[reset], b.new_ids[reset], -1)
        self.pos[reset] = 0
        self.done[reset] = ~b.live[reset]

    def compact(self, c):
        self.prompt = self.prompt[c.src_rows]
        self.branch = np.where(c.live, self.branch[c.slot_rows, c.slots], -1)
        self.pos = self.pos[c.slot_rows, c.slots]
        self.done = np.where(c.live, self.done[c.slot_rows, c.slots], True)


def simulate(lengths, rows, slots, *, chunk=3, lockstep=False, warmup=None, compact=True):
    """Run the scheduler over `lengths` (`[R, N]` tokens per branch, 0 = never drawn)
    to the end; with `warmup`, a prompt's columns from `warmup` on are admitted
    once its first `warmup` are done (as adaptive self-consistency's confidence
    rule does); returns (finished branch ids in order, starts per id, steps,
    slot-steps used, slot-steps held)."""
    lengths = np.asarray(lengths)
    R, N = lengths.shape
    ids = np.where(lengths > 0, np.arange(R * N).reshape(R, N), -1).astype(np.int32)
    sched = Scheduler(ids, rows, slots, lockstep=lockstep)
    if warmup is not None:
        sched.admit[:] = warmup
    dev = Device(sched, ids)
    where = {int(b): divmod(int(b), N) for b in ids[ids >= 0]}
    starts = {int(b): 0 for b in ids[ids >= 0]}
    for b in dev.branch[dev.branch >= 0]:
        starts[int(b)] += 1
    finished, steps, used, held = [], 0, 0, 0
    while not sched.done.all():
        b = sched.boundary()
        dev.apply(b)
        for b_id in b.new_ids[b.reset & b.live]:
            starts[int(b_id)] += 1
        _check_map(sched, dev, ids)
        _check_no_idle(sched, dev, lockstep)
        if compact and (c := sched.compaction()) is not None:
            live_before = sorted(dev.branch[~dev.done].tolist())
            dev.compact(c)
            assert sorted(dev.branch[~dev.done].tolist()) == live_before
            _check_map(sched, dev, ids)
        assert (~dev.done).any(), "a boundary left nothing to run while branches remain"
        for _ in range(chunk):
            run = ~dev.done
            used += int(run.sum())
            held += dev.done.size
            dev.pos[run] += 1
            steps += 1
            for i, j in zip(*np.nonzero(run)):
                b_id = int(dev.branch[i, j])
                r, c = where[b_id]
                if dev.pos[i, j] >= lengths[r, c]:
                    dev.done[i, j] = True
                    sched.done[r, c] = True
                    finished.append(b_id)
            if dev.done.all():
                break
        if warmup is not None:
            for r in np.nonzero(sched.admit < N)[0]:
                if sched.done[r, :warmup].all():
                    sched.admit[r] = N
                else:  # nothing past the warm-up has started
                    assert not any(starts[int(b)] for b in ids[r, warmup:] if b >= 0)
    return finished, starts, steps, used, held


def _check_map(sched, dev, ids):
    """The scheduler's map names exactly what the device holds."""
    assert sched.shape == dev.branch.shape
    for i in np.nonzero(sched.row_placed)[0]:
        assert dev.prompt[i] == sched.row_of[i]
        for j, c in enumerate(sched.col_of[i]):
            if c >= 0 and not sched.done[sched.row_of[i], c]:
                assert dev.branch[i, j] == ids[sched.row_of[i], c]
                assert not dev.done[i, j]
    assert (sched.slot_ids()[sched.live_slots()] == dev.branch[sched.live_slots()]).all()


def _check_no_idle(sched, dev, lockstep):
    """After a boundary, no slot of a row is free while its prompt has an admitted
    branch waiting (outside lockstep, where rows take whole prompts)."""
    if lockstep:
        return
    for i in np.nonzero(sched.row_placed)[0]:
        r = int(sched.row_of[i])
        ready = [c for c in sched.waiting.get(r, []) if c < sched.admit[r]]
        if ready:
            assert not dev.done[i].any(), f"row {i} idles a slot while prompt {r} waits"


LENGTHS = np.random.default_rng(0).integers(1, 30, size=(5, 6))


@pytest.mark.parametrize("rows,slots", [(5, 6), (2, 4), (3, 2), (1, 8), (4, 8)])
def test_every_branch_runs_once_to_its_end(rows, slots):
    finished, starts, *_ = simulate(LENGTHS, rows, slots)
    assert sorted(finished) == sorted(starts) and len(set(finished)) == len(finished)
    assert set(starts.values()) == {1}


def test_never_drawn_columns_never_start():
    lengths = LENGTHS.copy()
    lengths[1, 3:] = 0
    lengths[4] = 0
    finished, starts, *_ = simulate(lengths, 2, 3)
    assert sorted(finished) == sorted(int(b) for b in starts)
    assert all(divmod(b, 6)[0] != 4 for b in finished)
    assert all(divmod(b, 6) not in {(1, 3), (1, 4), (1, 5)} for b in finished)


@pytest.mark.parametrize("rows,slots", [(2, 2), (3, 3), (1, 2)])
def test_admit_holds_branches_back_until_the_warmup_is_done(rows, slots):
    """DeepConf's warm-up: a prompt's columns past `admit` start only once it is
    raised (checked each chunk inside `simulate`), and then every branch runs."""
    finished, starts, *_ = simulate(LENGTHS, rows, slots, warmup=3)
    assert set(starts.values()) == {1} and len(finished) == LENGTHS.size


def test_lockstep_rows_take_whole_prompts():
    finished, starts, *_ = simulate(LENGTHS, 2, 6, lockstep=True)
    assert set(starts.values()) == {1} and len(finished) == LENGTHS.size
    with pytest.raises(ValueError, match="lockstep"):
        Scheduler(np.arange(12).reshape(2, 6), 2, 4, lockstep=True)


def test_refill_and_migration_beat_a_pool_without_them():
    """The pool keeps its slots busier than rows that wait for their slowest
    branch: the same branches in fewer held slot-steps (an oracle computed
    from the lengths: a row per prompt, each running its longest branch)."""
    lengths = np.random.default_rng(1).integers(1, 60, size=(8, 8))
    _, _, steps, used, held = simulate(lengths, 2, 8, chunk=1)
    assert used == lengths.sum()  # every token decoded once
    static = 8 * lengths.max(axis=1).sum()  # two rows of 8, prompt by prompt, no refill
    assert held < static


def test_compaction_shrinks_to_a_bucket_and_keeps_every_live_branch():
    ids = np.arange(32).reshape(4, 8).astype(np.int32)
    s = Scheduler(ids, 4, 8)
    s.done[:, 2:] = True  # two live branches per prompt: 8 of 32 slots
    s.waiting.clear()
    plan = s.compaction()
    assert plan is not None
    R_new, N_new = plan.live.shape
    assert R_new * N_new <= COMPACT_FRACTION * 32 and int(plan.live.sum()) == 8
    kept = {(int(s.row_of[i]), int(s.col_of[i, j])) for i, j in zip(*np.nonzero(plan.live))}
    assert kept == {(r, c) for r in range(4) for c in range(2)}
    assert s.compaction() is None  # nothing smaller fits now


def test_scheduler_imports_no_jax():
    """The scheduler and the buckets it uses are numpy and Python only."""
    for name in ("scheduler", "buckets"):
        tree = ast.parse((ROOT / "jaxsample" / "engine" / f"{name}.py").read_text())
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                mods.add(node.module or "")
        assert mods <= {"__future__", "dataclasses", "numpy", "jaxsample.engine.buckets"}, mods
