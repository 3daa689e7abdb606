"""The decode chunk's loops: a step loop whose trip count XLA knows, the same tokens
whatever the chunk size or the steps between checks, and the GPU compile options.

Oracles: XLA's own reading of the optimised program (`known_trip_count` in the
HLO, read by `step_cost.program_control`, itself checked on loops written both
ways); the single-call run with the default `loop.STEPS_PER_CHECK` (a chunk
runs the same step whatever its blocks, so tokens and logprobs agree bit for
bit); XLA's own parser of the compile options (it refuses an unknown kind).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import SamplingParams, disk_cache, engine
from jaxsample.engine import exported, loop, step_cost
from jaxsample.tiny import TINY

PROMPTS = ["Hello there, branch!", "ab", "A somewhat longer prompt: 123 + 456 = ?"]


def _loops(k_inner, traced_inner=False):
    """A while loop around an inner loop of `k_inner` steps with a matmul (or, with
    `traced_inner`, an inner loop bounded by a traced value), compiled on the CPU."""
    def f(x, w, n):
        def block(c):
            t, y = c
            if traced_inner:
                return jax.lax.while_loop(lambda c: c[0] < t + k_inner,
                                          lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (t, y))
            return jax.lax.fori_loop(0, k_inner, lambda _, c: (c[0] + 1, jnp.tanh(c[1] @ w)),
                                     (t, y))
        return jax.lax.while_loop(lambda c: c[0] < n, block, (jnp.int32(0), x))[1]

    return jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.int32(9)).compile()


def test_program_control_reads_known_and_unknown_trip_counts():
    known = step_cost.program_control(_loops(6).as_text())
    (inner,) = known.step_loops()
    assert inner.trip_count == 6 and inner.matmuls >= 1 and not inner.captured
    assert [lp.trip_count for lp in known.loops if not lp.matmuls] == [None]  # the outer loop
    unknown = step_cost.program_control(_loops(6, traced_inner=True).as_text())
    assert [lp.trip_count for lp in unknown.step_loops()] == [None]
    with pytest.raises(ValueError, match="no HLO computation"):
        step_cost.program_control("not hlo")


def test_program_control_reads_command_buffers_and_conditionals():
    """A GPU module's shape (written by hand: no GPU here): a while inside a
    `command_buffer` computation is captured, a conditional outside is not."""
    text = """HloModule m
%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %d = f32[4]{0} dot(%a, %b), lhs_contracting_dims={0}
}
%cond (p: (s32[], f32[4])) -> pred[] {
  %lt = pred[] compare(%i, %n), direction=LT
}
%command_buffer (p0: (s32[], f32[4])) -> (s32[], f32[4]) {
  %w = (s32[], f32[4]) while(%p0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
}
%t (p: f32[]) -> f32[] {
  %x = f32[] negate(%p)
}
ENTRY %main (a: f32[4]) -> f32[4] {
  %c = (s32[], f32[4]) call(%a), to_apply=%command_buffer
  %k = f32[] conditional(%q, %r, %r), branch_computations={%t, %t}
}
"""
    pc = step_cost.program_control(text)
    assert pc.loops == (step_cost.HloLoop("w", 8, 1, True),)
    assert (pc.conditionals, pc.conditionals_captured) == (1, 0)


@pytest.mark.slow
def test_the_step_loop_has_a_known_trip_count():
    """Every loop that runs the model's matrix products is the chunk's inner loop,
    of `STEPS_PER_CHECK` passes known to XLA (no predicate read back per step)."""
    text = step_cost.compile_decode_step(TINY, 16, 4, 16, chunk=True).as_text()
    pc = step_cost.program_control(text)
    assert pc.step_loops(), "no loop runs the forward pass"
    assert {lp.trip_count for lp in pc.step_loops()} == {loop.STEPS_PER_CHECK}
    assert any(lp.trip_count is None for lp in pc.loops)  # the outer check, once per block
    # The skipped branch passes the state through: XLA keeps updating the tails in
    # place (no copy of a tail buffer [R, N, K, T, D] anywhere in the program).
    tail = r"f32\[1,4,%d,16,%d\]" % (TINY.n_kv_heads, TINY.head_dim)
    assert re.search(tail + r"\{[^}]*\} parameter", text)  # the pattern matches the tails
    assert not re.search(tail + r"\{[^}]*\} copy\(", text)


def _same(a, b, steps=True):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.top_logprobs, b.top_logprobs)
    assert a.finish_reason == b.finish_reason
    if steps:
        assert a.bill.decode_steps == b.bill.decode_steps
        assert a.bill.branch_steps == b.bill.branch_steps


@pytest.mark.slow
def test_tokens_do_not_depend_on_the_chunk_or_the_steps_between_checks(tiny_lm, monkeypatch):
    params = SamplingParams(n=4, max_new_tokens=21, seed=11, temperature=1.0, top_p=0.9,
                            logprobs=2, stop_token_ids=[101])
    one = engine.generate(tiny_lm, PROMPTS, params)
    assert (one.lengths < 21).any() and (one.lengths == 21).any()  # early stops and full ones
    for chunk in (1, 7, 8, 9, 16):
        _same(one, engine.generate(tiny_lm, PROMPTS, params, chunk_size=chunk))
    # A pool (its own shapes, so compared with itself; no compaction, whose buckets
    # change shapes at chunk boundaries): slots refill at chunk boundaries, so the
    # steps it takes depend on the chunk, the tokens do not.
    pool = dict(max_rows=2, max_slots=3, compact=False)
    _same(engine.generate(tiny_lm, PROMPTS, params, chunk_size=8, **pool),
          engine.generate(tiny_lm, PROMPTS, params, chunk_size=3, **pool), steps=False)
    for k in (1, 3):
        monkeypatch.setattr(loop, "STEPS_PER_CHECK", k)
        engine.PROGRAMS.clear()  # the in-memory programs are keyed by shapes only
        try:
            for chunk in (None, 2, 5):
                _same(one, engine.generate(tiny_lm, PROMPTS, params, chunk_size=chunk))
        finally:
            engine.PROGRAMS.clear()


def test_steps_per_check_is_in_the_exported_key(monkeypatch):
    args = (jnp.ones(4),)
    base = exported.entry_key(("toy",), args, ())
    monkeypatch.setattr(loop, "STEPS_PER_CHECK", loop.STEPS_PER_CHECK + 1)
    assert exported.entry_key(("toy",), args, ()) != base


def test_gpu_compiler_options_are_xlas_and_only_for_a_gpu():
    assert loop.compiler_options("cpu") == {} and loop.compiler_options("tpu") == {}
    assert loop.compiler_options("gpu") == loop.GPU_COMPILER_OPTIONS
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    # The CPU compiler parses the GPU options (and ignores them): a kind XLA does not
    # know is refused, so this names only kinds XLA has.
    np.testing.assert_array_equal(lowered.compile(loop.compiler_options("gpu"))(jnp.ones(3)),
                                  2 * np.ones(3))
    with pytest.raises(Exception, match="not a valid"):
        lowered.compile({"xla_gpu_enable_command_buffer": "FUSION,NO_SUCH_KIND"})


@pytest.mark.parametrize("exported_on", [False, True])
def test_programs_compile_with_their_platforms_options(tmp_path, monkeypatch, exported_on):
    seen = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        seen.append(compiler_options)
        return compile_(self, compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    monkeypatch.setattr(disk_cache, "exported_dir",
                        lambda: tmp_path / "exported" if exported_on else None)
    args = (jnp.arange(6.0),)
    f = lambda x: jnp.cumsum(x) * 3  # noqa: E731
    for platform, want in (("cpu", None), ("gpu", loop.GPU_COMPILER_OPTIONS)):
        monkeypatch.setattr(loop, "_platform", lambda _args, p=platform: p)
        seen.clear()
        compiled, _ = loop.Programs().get(("toy", platform), f, args)
        np.testing.assert_array_equal(compiled(*args), np.cumsum(np.arange(6.0)) * 3)
        assert seen == [want]
    assert any((tmp_path / "exported").glob("*" + exported.SUFFIX)) == exported_on
