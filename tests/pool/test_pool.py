"""The decode pool: slots refilled as branches finish, rows as prompts settle.

Oracle: per-prompt `generate` with the same seed and the prompt's global index
(`prompt_index_offset`). Keys are fold_in(fold_in(key(seed), prompt), branch)
folded with each slot's own token index, so a branch's tokens may not depend
on the pool's size, its slot, the order prompts arrive in, or its neighbours;
the pool's programs have other shapes than the oracle's, so tokens agree up to
float ties (tests/ties.py).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from ties import assert_same_tokens_up_to_ties, rows

from jaxsample import SamplingParams, engine
from jaxsample.engine import api
from jaxsample.errors import InputError

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]
STOPS = tuple(range(0, 256, 23))  # frequent stop ids: branches end at different lengths


def _params(**kw):
    base = dict(n=5, max_new_tokens=12, seed=11, temperature=1.0, top_p=0.9,
                stop_token_ids=STOPS)
    base.update(kw)
    return SamplingParams(**base)


def _per_prompt(lm, prompts, params, **kw):
    return [engine.generate(lm, [p], params, prompt_index_offset=b, **kw)
            for b, p in enumerate(prompts)]


def _assert_equal_per_prompt(lm, refs, got, max_ties=1):
    ties = 0
    for b, ref in enumerate(refs):
        ties += assert_same_tokens_up_to_ties(lm, ref, rows(got, b, b + 1),
                                              prompt_index_offset=b, max_ties=max_ties)
        if ties == 0:
            assert got.texts[b] == ref.texts[0]
            assert got.finish_reason[b] == ref.finish_reason[0]
    assert ties <= max_ties


@pytest.fixture(scope="module")
def refs(tiny_lm):
    return _per_prompt(tiny_lm, PROMPTS, _params())


@pytest.mark.parametrize("max_rows,max_slots", [(1, 1), (2, 3), (3, 8), (1, 3)])
def test_pool_equals_per_prompt_generate(tiny_lm, refs, max_rows, max_slots):
    got = engine.generate(tiny_lm, PROMPTS, _params(), max_rows=max_rows, max_slots=max_slots,
                          chunk_size=2, compact=False)
    _assert_equal_per_prompt(tiny_lm, refs, got)
    # The pool ran with its own shape: every step paid for rows x slots, no more.
    R, S = min(max_rows, 3), min(max_slots, 5)
    assert got.bill.branch_steps == got.bill.decode_steps * R * S
    # ...and the branches really shared the slots: more branch-tokens than the
    # slots could hold in one pass (control: the refills happened).
    assert got.lengths.sum() > R * S * 1
    assert (got.lengths > 0).all()


def test_branches_end_at_different_lengths(tiny_lm, refs):
    """Control for the oracle: branches end at different lengths (else the
    refill at different token indices would never be exercised)."""
    lens = np.concatenate([r.lengths[0] for r in refs])
    assert len(set(lens.tolist())) > 2


@pytest.mark.slow
def test_shuffled_arrival_order(tiny_lm, refs):
    params = _params()
    s = engine.Session(tiny_lm, PROMPTS, params)
    order = [2, 0, 1]
    ids = np.broadcast_to(np.arange(5, dtype=np.int32), (3, 5))
    rnd = s.round(order, ids, max_rows=1, max_slots=2)
    while rnd.run(3):
        pass
    got = api.finish(s, [rnd])
    _assert_equal_per_prompt(tiny_lm, refs, got)


@pytest.mark.slow
def test_pool_with_stop_strings_min_tokens_penalties_logprobs(tiny_lm):
    params = _params(stop=["e", "lo"], min_tokens=3, repetition_penalty=1.3,
                     presence_penalty=0.4, frequency_penalty=0.2, logprobs=3,
                     prompt_logprobs=2, stop_token_ids=STOPS[:3], max_new_tokens=14)
    refs = _per_prompt(tiny_lm, PROMPTS, params)
    got = engine.generate(tiny_lm, PROMPTS, params, max_rows=2, max_slots=2)
    _assert_equal_per_prompt(tiny_lm, refs, got)
    for b, ref in enumerate(refs):
        if (ref.tokens[0] == got.tokens[b]).all():
            np.testing.assert_allclose(got.top_logprobs[b], ref.top_logprobs[0], atol=1e-5)
            np.testing.assert_array_equal(got.top_token_ids[b], ref.top_token_ids[0])
            np.testing.assert_array_equal(got.token_ranks[b], ref.token_ranks[0])
        np.testing.assert_allclose(got.prompt_token_logprobs[b], ref.prompt_token_logprobs[0],
                                   atol=1e-5)


@pytest.mark.slow
def test_pool_with_shared_prefix(tiny_lm):
    params = _params(n=4)
    ctx = "A common context: "
    ref = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=ctx)
    got = engine.generate(tiny_lm, PROMPTS, params, shared_prefix=ctx, max_rows=2, max_slots=3)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


@pytest.mark.slow
def test_pool_with_sliding_windows():
    from helpers import GEMMA_WINDOWS, tiny_gemma

    glm = tiny_gemma(GEMMA_WINDOWS["mixed windows"])
    params = _params(n=4, max_new_tokens=20, stop_token_ids=STOPS[::2])
    ref = engine.generate(glm, PROMPTS, params)
    # Tails longer than the window of 8: the local layers' rings wrap, at each
    # slot's own position.
    assert ref.lengths.max() > 8
    got = engine.generate(glm, PROMPTS, params, max_rows=2, max_slots=3, chunk_size=3)
    assert_same_tokens_up_to_ties(glm, ref, got)
    # The longest prompt first: the later ones are prefilled at their own, shorter
    # bucket and padded into the pool's (global and local layers).
    rev = PROMPTS[::-1]
    got = engine.generate(glm, rev, params, max_rows=1, max_slots=4, chunk_size=3)
    ref = engine.generate(glm, rev, params)
    assert_same_tokens_up_to_ties(glm, ref, got)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_pool_on_a_mesh(tiny_lm, shape):
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh(shape, ("data", "branch"))
    params = _params(n=8)
    ref = engine.generate(tiny_lm, PROMPTS, params)
    got = engine.generate(tiny_lm, PROMPTS, params, mesh=mesh, max_rows=shape[0],
                          max_slots=4, chunk_size=2)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


@pytest.mark.slow
def test_bridge_rows_refill_in_lockstep(tiny_lm):
    from helpers import nonzero

    from jaxsample import bridge as bridge_lib

    b = nonzero(tiny_lm, bridge_lib.BridgeConfig(dim=8, n_heads=2))
    params = _params(n=3)
    ref = engine.generate(tiny_lm, PROMPTS, params, bridge=b)
    got = engine.generate(tiny_lm, PROMPTS, params, bridge=b, max_rows=1, chunk_size=2)
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)
    with pytest.raises(InputError, match="max_slots"):
        engine.generate(tiny_lm, PROMPTS, params, bridge=b, max_slots=2)


@pytest.mark.parametrize("kw", [dict(max_rows=0), dict(max_slots=-1), dict(max_slots=1.5),
                                dict(max_rows=True)])
def test_pool_shape_is_validated(tiny_lm, kw):
    with pytest.raises(InputError, match=next(iter(kw))):
        engine.generate(tiny_lm, PROMPTS, _params(), **kw)


def test_results_too_large_for_host_memory_are_refused_before_any_compute(tiny_lm):
    """`{"prompt": "hi", "n": 2147483647, "max_tokens": 2}` was accepted
    and the process was killed for memory; now one line naming n, with the numbers."""
    before = engine.PROGRAMS.compilations
    with pytest.raises(InputError, match=r"n=2147483647 .*bytes") as e:
        engine.generate(tiny_lm, "hi", SamplingParams(n=2147483647, max_tokens=2))
    assert "\n" not in str(e.value)
    assert engine.PROGRAMS.compilations == before  # nothing compiled, nothing ran


def test_a_budget_below_one_row_and_one_slot_is_refused(tiny_lm):
    from jaxsample.engine import budget as pool

    cfg = tiny_lm.config
    row = pool.row_bytes(cfg, engine.bucket(40))
    with pytest.raises(InputError, match=r"max_kv_bytes=\d.*one branch"):
        engine.generate(tiny_lm, PROMPTS, _params(), max_kv_bytes=2 * row)
    with pytest.raises(InputError, match="max_kv_bytes"):
        engine.generate(tiny_lm, PROMPTS, _params(), max_kv_bytes=0)


@pytest.mark.slow
def test_a_prompt_runs_in_several_rows_at_once(tiny_lm):
    """A free pool row takes the waiting branches of a prompt already in the
    pool (its own copy of the prefix): one prompt's 8 branches run in 4 rows
    of 2 slots in one pass, not in 4 passes of one row."""
    T = 12
    params = _params(n=8, max_new_tokens=T, min_tokens=T, stop_token_ids=())
    ref = engine.generate(tiny_lm, PROMPTS[:1], params)
    got = engine.generate(tiny_lm, PROMPTS[:1], params, max_rows=4, max_slots=2, chunk_size=2)
    assert (got.lengths == T).all()  # min_tokens = max_new_tokens: every branch runs T
    assert got.bill.decode_steps == T  # one pass (one row alone would take 4 T)
    assert got.bill.branch_steps == T * 4 * 2
    assert_same_tokens_up_to_ties(tiny_lm, ref, got)


@pytest.mark.slow
def test_compaction_packs_a_prompt_from_several_rows_into_one(tiny_lm):
    """One prompt's 8 branches run in 4 rows of 2 slots; the host ends one
    branch per row: compaction groups the 4 survivors by prompt, not by row,
    into 1 row x 4 slots (by row: 4 rows x 1 slot, the same slot count but 4
    prefix copies, no gain over 3/4). Tokens: those of the plain round."""
    T = 12
    params = _params(n=8, max_new_tokens=T, min_tokens=T, stop_token_ids=())
    ref = engine.generate(tiny_lm, PROMPTS[:1], params)
    s = engine.Session(tiny_lm, PROMPTS[:1], params, lazy_prefill=True)
    rnd = s.round([0], np.arange(8, dtype=np.int32)[None], max_rows=4, max_slots=2)
    rnd.run(3)
    assert rnd.col_of.shape == (4, 2) and (rnd.row_of == 0).all()
    end = np.zeros((1, 8), bool)
    end[0, rnd.col_of[:, 1]] = True  # the second slot of every row
    rnd.finish_slots(end)
    assert rnd.compact() and rnd.col_of.shape == (1, 4)
    assert sorted(rnd.col_of[0].tolist()) == sorted(np.nonzero(~end[0])[0].tolist())
    while rnd.run(4):
        pass
    got = engine.finish(s, [rnd])
    np.testing.assert_array_equal(got.lengths[0][end[0]], 3)
    np.testing.assert_array_equal(got.lengths[0][~end[0]], T)
    np.testing.assert_array_equal(got.tokens[:, end[0], :3], ref.tokens[:, end[0], :3])
    ties = 0
    for c in np.nonzero(~end[0])[0]:  # the survivors, decoded on in the packed row
        one = slice(c, c + 1)
        ties += assert_same_tokens_up_to_ties(tiny_lm, rows(ref, 0, 1, one), rows(got, 0, 1, one),
                                              branch_index_offset=int(c))
    assert ties <= 1
    assert got.bill.branch_steps == 3 * 4 * 2 + (T - 3) * 4


@pytest.mark.slow
@pytest.mark.parametrize("extra,shape", [({}, None),
                                         pytest.param({}, (2, 2), marks=pytest.mark.multidevice),
                                         ({"logprobs": 2, "presence_penalty": 0.7,
                                           "repetition_penalty": 1.3}, None)])
def test_a_prompts_last_branches_are_packed_to_free_rows(tiny_lm, extra, shape):
    """Once a prompt has nothing left to start, its live branches move into the
    free slots of its other rows (identical prefix copies) and the emptied rows
    take the waiting prompts: branches moved with their tails, positions,
    counts and outputs draw the tokens per-prompt `generate` draws.

    The host ends prompt 0 after 2 steps, so its row takes prompt 1's waiting
    branches (prompt 1 then runs in both rows while prompt 2 waits)."""
    params = _params(n=8, **extra)
    refs = _per_prompt(tiny_lm, PROMPTS, params)
    mesh = None if shape is None else jax.make_mesh(shape, ("data", "branch"))
    s = engine.Session(tiny_lm, PROMPTS, params, lazy_prefill=True, mesh=mesh)
    rnd = s.round(range(3), np.broadcast_to(np.arange(8, dtype=np.int32), (3, 8)),
                  max_rows=2, max_slots=2)
    rnd.run(2)
    end = np.zeros((3, 8), bool)
    end[0] = True
    rnd.finish_slots(end)
    while rnd.run(2):
        pass
    got = engine.finish(s, [rnd])
    assert rnd.moved > 0  # control: the packing happened
    ties = sum(assert_same_tokens_up_to_ties(tiny_lm, refs[b], rows(got, b, b + 1),
                                             prompt_index_offset=b) for b in (1, 2))
    assert ties <= 1
    np.testing.assert_array_equal(got.lengths[0, 2:], 0)  # ended by the host before a slot
    np.testing.assert_array_equal(got.lengths[0, :2], np.minimum(refs[0].lengths[0, :2], 2))
    np.testing.assert_array_equal(got.tokens[0, :2, :2], refs[0].tokens[0, :2, :2])


@pytest.mark.slow
def test_moves_of_one_boundary_never_chain(tiny_lm):
    """Many rows per prompt (4 prompts x 24 branches in 12 rows of 2): a row that
    takes a moved branch is never emptied in the same boundary (each move reads
    the state from before them all; chained moves once copied a slot's stale
    contents: 3 of 4 prompts diverged, score gaps 1.3-3.0)."""
    prompts = PROMPTS + ["xyz"]
    params = _params(n=24, max_new_tokens=12)
    refs = _per_prompt(tiny_lm, prompts, params)
    s = engine.Session(tiny_lm, prompts, params, lazy_prefill=True)
    rnd = s.round(range(4), np.broadcast_to(np.arange(24, dtype=np.int32), (4, 24)),
                  max_rows=12, max_slots=2)
    while rnd.run(2):
        pass
    got = engine.finish(s, [rnd])
    assert rnd.moved >= 10  # control: many moves
    ties = sum(assert_same_tokens_up_to_ties(tiny_lm, ref, rows(got, b, b + 1),
                                             prompt_index_offset=b)
               for b, ref in enumerate(refs))
    assert ties <= 1


@pytest.mark.slow
def test_rows_shared_between_prompts_and_copies(tiny_lm, refs):
    """Prompts of different lengths in a pool of more rows than prompts: every
    free row takes a resident prompt's next branches; tokens as per prompt."""
    got = engine.generate(tiny_lm, PROMPTS, _params(), max_rows=5, max_slots=2, chunk_size=2,
                          compact=False)
    _assert_equal_per_prompt(tiny_lm, refs, got)
    assert got.bill.branch_steps == got.bill.decode_steps * 5 * 2
    # By default a pool compacts its drain (once nothing waits): fewer slot-steps, same tokens.
    auto = engine.generate(tiny_lm, PROMPTS, _params(), max_rows=5, max_slots=2, chunk_size=2)
    _assert_equal_per_prompt(tiny_lm, refs, auto)
    assert auto.bill.branch_steps < got.bill.branch_steps
    assert auto.bill.decode_steps == got.bill.decode_steps


def test_pool_slots_keep_the_prefix_copies_small(tiny_lm):
    from jaxsample.engine import budget as pool

    cfg = tiny_lm.config
    for p_cap, t_cap in [(16, 256), (64, 64), (1024, 16), (4096, 16)]:
        row, slot = pool.row_bytes(cfg, p_cap), pool.slot_bytes(cfg, t_cap)
        S = pool.pool_slots(64, row, slot)
        assert S & (S - 1) == 0 and 1 <= S <= 64  # a power of two, at most n
        # The fewest slots whose tails hold SHARING_RATIO x the prefix copy (or n).
        assert S == 64 or S * slot >= pool.SHARING_RATIO * row
        assert S == 1 or (S // 2) * slot < pool.SHARING_RATIO * row
    # Short prompts, long answers: small rows; a long prompt: all n branches share it.
    short = pool.pool_slots(64, pool.row_bytes(cfg, 16), pool.slot_bytes(cfg, 256))
    long = pool.pool_slots(64, pool.row_bytes(cfg, 4096), pool.slot_bytes(cfg, 16))
    assert short < 8 and long == 64
    assert pool.pool_slots(5, pool.row_bytes(cfg, 4096), pool.slot_bytes(cfg, 16), nb=2) == 6
    # A budget short of everything at once: rows of pool_slots slots, as many as fit.
    B, n, row, slot = 3, 16, pool.row_bytes(cfg, 16), pool.slot_bytes(cfg, 256)
    S = pool.pool_slots(n, row, slot)
    budget = B * row + 3 * (row + S * slot)
    assert pool.plan(cfg, B=B, n=n, p_cap=16, t_cap=256, budget=budget) == (3, S)
    # Lockstep (Bridge): n slots per row, whatever the sizes.
    budget = B * row + 2 * (row + n * slot)
    assert pool.plan(cfg, B=B, n=n, p_cap=16, t_cap=256, budget=budget, lockstep=True) == (2, n)


def test_plan_sizes_the_pool_from_the_budget(tiny_lm):
    from jaxsample.engine import budget as pool

    cfg = tiny_lm.config
    row, slot = pool.row_bytes(cfg, 512), pool.slot_bytes(cfg, 16)
    # A slot: its tail, its buffers and its decode step's temporaries.
    assert slot == pool.kv_size(cfg, 16) + 4 * cfg.vocab_size + 8 * 16 + pool.step_bytes(cfg)
    # Everything at once: every prefix and every branch's slot.
    full = 3 * row + 15 * slot
    assert pool.plan(cfg, B=3, n=5, p_cap=512, t_cap=16, budget=full) == (3, 5)
    # A pool: rows of pool_slots slots (16 here: a 512-token prefix outweighs a
    # 16-token tail and its step), each row 2 x row (the prefill beside its copy)
    # + 16 slots.
    assert pool.pool_slots(16, row, slot) == 16
    per_row = 2 * row + 16 * slot
    budget = 2 * per_row + slot
    assert 3 * (row + 16 * slot) > budget  # not everything at once
    assert pool.plan(cfg, B=3, n=16, p_cap=512, t_cap=16, budget=budget) == (2, 16)
    # Not one full row: one row with as many slots as fit.
    assert pool.plan(cfg, B=3, n=16, p_cap=512, t_cap=16, budget=2 * row + 3 * slot) == (1, 3)
    with pytest.raises(InputError, match="max_kv_bytes"):
        pool.plan(cfg, B=3, n=16, p_cap=512, t_cap=16, budget=2 * row + slot - 1)
    # KV bytes: k and v, every layer, K x D per position in float32.
    assert pool.kv_size(cfg, 10) == cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4 * 10


@pytest.mark.slow
def test_a_pool_prefills_each_prompt_when_a_row_takes_it(tiny_lm, refs):
    """Lazy prefill: a pool's session prefills nothing up front; the round
    prefills its first rows, then each prompt as a row takes it, once (a
    prompt in several rows is copied, not prefilled again)."""
    params = _params(prompt_logprobs=2)
    s = engine.Session(tiny_lm, PROMPTS, params, lazy_prefill=True)
    assert s.prefix is None and s.prefilled_rows == 0
    ids = np.broadcast_to(np.arange(5, dtype=np.int32), (3, 5))
    # The longest prompt first: "ab" comes last, prefilled at its own bucket.
    assert engine.bucket(len(s.ids[1])) < s.p_cap
    rnd = s.round([2, 0, 1], ids, max_rows=2, max_slots=2)
    assert s.prefilled_rows == 2  # the two rows the pool starts with
    while rnd.run(2):
        pass
    assert s.prefilled_rows == 3  # prompt 1 when a row freed up; copies are not prefills
    got = api.finish(s, [rnd])
    _assert_equal_per_prompt(tiny_lm, refs, got)
    eager = engine.generate(tiny_lm, PROMPTS, params)
    for b in range(3):
        np.testing.assert_allclose(got.prompt_token_logprobs[b], eager.prompt_token_logprobs[b],
                                   atol=1e-5)
    # The bill counts the prefix caches the pool held (its 2 rows), not all 3 prompts'.
    assert got.bill.kv_bytes_shared_prefix * 3 == eager.bill.kv_bytes_shared_prefix * 2


def test_a_budget_makes_the_request_a_pool_with_the_same_tokens(tiny_lm, refs):
    from jaxsample.engine import budget as pool

    cfg = tiny_lm.config
    s = engine.Session(tiny_lm, PROMPTS, _params())
    p_cap, t_cap = engine.bucket(max(len(x) for x in s.ids)), engine.bucket(12)
    row, slot = pool.row_bytes(cfg, p_cap), pool.slot_bytes(cfg, t_cap)
    budget = 2 * row + 3 * slot
    assert pool.plan(cfg, B=3, n=5, p_cap=p_cap, t_cap=t_cap, budget=budget) == (1, 3)
    got = engine.generate(tiny_lm, PROMPTS, _params(), max_kv_bytes=budget, compact=False)
    assert got.bill.branch_steps == got.bill.decode_steps * 1 * 3  # one row of three slots
    _assert_equal_per_prompt(tiny_lm, refs, got)


def test_run_requests_yields_each_request_tagged_with_its_id(tiny_lm, refs):
    from jaxsample.engine.requests import Request, run_pool

    # Requests without their own seed draw from the run's seed and their position
    # (the refs' keys); one with its own seed would draw from (seed, branch) alone.
    reqs = [Request(id=f"q{b}", prompt=p, params=_params(seed=None)) for b, p in enumerate(PROMPTS)]
    seen = {}
    run = run_pool(tiny_lm, reqs, max_kv_bytes=None, chunk_size=2, seed=_params().seed)
    for res in run:
        assert run.bill is None  # the run's bill once the last result is out
        assert res.output.request_id == res.id == f"q{res.index}"
        seen[res.id] = res
    assert sorted(seen) == ["q0", "q1", "q2"]
    # The run's bill: what each request's own bill says it decoded, summed; the
    # slots x steps of one pool of 3 x 5 (everything fits the default budget).
    bill = run.bill
    assert bill.pool.requests == 3 and bill.num_prompts == 3 and bill.adaptive is None
    assert bill.decoded_tokens_total == sum(r.generation.bill.decoded_tokens_total
                                            for r in seen.values())
    assert bill.decoded_tokens_per_branch == [r.generation.bill.decoded_tokens_per_branch[0]
                                              for r in sorted(seen.values(),
                                                              key=lambda r: r.index)]
    assert bill.kept_tokens_total == sum(int(r.generation.lengths.sum()) for r in seen.values())
    # (each request's bill counts the pool's steps up to its completion; the last, all)
    assert bill.decode_steps == max(r.generation.bill.decode_steps for r in seen.values())
    assert bill.branch_steps == bill.decode_steps * 15
    assert 0 < bill.slot_utilisation <= 1
    assert bill.slot_utilisation == bill.decoded_tokens_total / bill.branch_steps
    assert bill.prompt_tokens_prefilled == sum(len(r.output.prompt_token_ids)
                                               for r in seen.values())
    assert bill.pool.requests_per_second > 0 and bill.pool.batch_branch_steps > 0
    assert "pool: 3 requests" in bill.summary()
    d = bill.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d and d["pool"]["requests"] == 3
    for b, ref in enumerate(refs):
        got = seen[f"q{b}"].generation
        assert_same_tokens_up_to_ties(tiny_lm, ref, got, prompt_index_offset=b)
        assert [o.text for o in seen[f"q{b}"].output.outputs] == got.texts[0]


@pytest.mark.parametrize("bad,match", [
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "repeats"),
    ([{"id": "a", "prompt": "x", "messages": "y"}], "exactly one"),
    ([{"id": "a", "prompt": "x", "n": 3}], "unknown fields"),
    ([{"id": "a", "prompt": "x", "params": {"n": 2}}], "SamplingParams"),
    ([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": ""}], r"request 1 \('b'\): prompt 0 is empty")])
def test_requests_are_validated_before_any_compute(tiny_lm, bad, match):
    from jaxsample.engine.requests import run_pool

    before = engine.PROGRAMS.compilations
    with pytest.raises(InputError, match=match):
        list(run_pool(tiny_lm, bad))
    assert engine.PROGRAMS.compilations == before


@pytest.mark.slow
def test_llm_generate_and_chat_are_the_pool_in_input_order(tiny_lm):
    from jaxsample import LLM

    params = _params(n=2, max_new_tokens=6)
    llm = LLM(model=tiny_lm)
    outs = llm.generate(PROMPTS, params)
    # Each request has its own seed: it draws what it draws alone (vLLM's rule).
    ref = [engine.generate(tiny_lm, [p], params).outputs()[0] for p in PROMPTS]
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in ref]
    # One pool over all three (same params): the same tokens, up to float ties.
    same = sum(a.token_ids == b.token_ids for o, r in zip(outs, ref)
               for a, b in zip(o.outputs, r.outputs))
    assert same >= 5
    with pytest.raises(InputError, match="lora_request"):
        llm.generate(PROMPTS, params, lora_request=object())
    with pytest.raises(InputError, match="sampling_params"):
        llm.generate(PROMPTS, [params, params])


@pytest.mark.slow
def test_batch_branch_steps_by_hand():
    from jaxsample.engine.requests import batch_branch_steps

    lengths = [[1, 5, 2], [3, 3, 3]]
    # one row, rounds of two slots: (max 5, max 2) x 2 for prompt 0, (3, 3) x 2 for prompt 1
    assert batch_branch_steps(lengths, 1, 2) == (5 + 2) * 2 + (3 + 3) * 2
    # both prompts in one batch of 2 x 3 slots: the longest branch, 5 steps
    assert batch_branch_steps(lengths, 2, 3) == 5 * 6
