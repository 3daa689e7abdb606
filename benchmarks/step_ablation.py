"""Decode-step time with and without a change, side by side in one process (CPU).

One worker process loads the model once, compiles every variant's programs
(each variant has its own program cache), then alternates the variants call
by call (A B A B ...), so a noisy neighbour on a shared machine hits them
alike. The step time of a call is its decode seconds / forward steps (T - 1
forwards for T tokens); every figure is a median over `--reps` calls (>= 5)
of T - 1 steps each. The "before" of a change is recreated by a patch
(`PATCHES`) that puts the old code back while that variant is traced and
compiled; "now" is the code as it is.

Usage:

    python -m benchmarks.step_ablation --variants now,old_prefix_attention \
        --prompt-length 1024 --branches 1,16 --new-tokens 16 --reps 7

Prints a markdown table (median, min, max step ms per variant and N) and,
with `--out`, one JSON line per (variant, N).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics


@contextlib.contextmanager
def _old_prefix_attention():
    """The prefix segment as a plain vmap of `partial_attention` (before
    engine/prefix_attention.py)."""
    from jaxsample.engine import step
    from jaxsample.models.families import common

    new = step.prefix_attention
    step.prefix_attention = lambda q, k, v, m, s: common.partial_attention(q, k, v, m[None], s)
    try:
        yield
    finally:
        step.prefix_attention = new


@contextlib.contextmanager
def _unfused_w8a8():
    """W8A8's product as XLA's ops around the int8 custom call (before cpu_w8a8.cc)."""
    from jaxsample.models.cpu_kernels import cpu_kernels
    from jaxsample.models.quantization import quant

    new = cpu_kernels.w8a8_dot

    def unfused(x, q, scale, kept=None):
        return quant.w8a8_expression(x, q, scale, *(kept or ()), transposed=True,
                                     int8_dot=cpu_kernels.int8_dot)

    cpu_kernels.w8a8_dot = unfused
    try:
        yield
    finally:
        cpu_kernels.w8a8_dot = new


@contextlib.contextmanager
def _while_loop_chunk():
    """A chunk as one `lax.while_loop` of single steps whose predicate (the traced
    t_stop, every slot done) is read every step (before `loop.decode_chunk`'s blocks
    of `loop.STEPS_PER_CHECK` steps with a static trip count). Replaced wherever the
    engine imported `decode_chunk` by name."""
    import sys

    import jax

    from jaxsample.engine import loop
    from jaxsample.engine.step import all_done, branch_keys, make_step

    new = loop.decode_chunk

    def old(st, params, prefix, state, knobs, bridge_params=None, context=None):
        keys = branch_keys(knobs, state.prompt_index, state.branch_ids)
        step = make_step(st, params, prefix, knobs, keys, bridge_params, context)
        return jax.lax.while_loop(
            lambda s: (s.t < knobs.t_stop) & ~all_done(st, s.done), step, state)

    mods = [m for name, m in list(sys.modules.items())
            if name.startswith("jaxsample.engine") and getattr(m, "decode_chunk", None) is new]
    for m in mods:
        m.decode_chunk = old
    try:
        yield
    finally:
        for m in mods:
            m.decode_chunk = new


PATCHES = {
    "now": contextlib.nullcontext,
    "while_loop_chunk": _while_loop_chunk,
    "old_prefix_attention": _old_prefix_attention,
    "prefix_kv_float32": contextlib.nullcontext,  # with --weights int8: MODEL_SWITCHES
    "unfused_w8a8": _unfused_w8a8,  # with --weights int8
}

# Variants that are a model's switch, not a patch: the session's model gets these fields.
MODEL_SWITCHES = {"prefix_kv_float32": {"prefix_kv_dtype": "model"}}


def _decode(s, N, T, chunk=None):
    """One fresh round of N branches over the session's prefix, in device calls of
    `chunk` steps (default T): seconds per forward step (the host's work between
    chunks is not in them)."""
    import numpy as np

    d0, k0 = s.timings["decode"], s.decode_steps
    rnd = s.round([0], np.arange(N, dtype=np.int32)[None])
    while rnd.run(chunk or T):
        pass
    assert (rnd.lengths == T).all()
    return (s.timings["decode"] - d0) / max(s.decode_steps - k0 - 1, 1)


def run(variants, P, Ns, T, reps, temperature=1.0, top_k=0, top_p=1.0, weights=None, out=None,
        chunk=None):
    """{(variant, N): [step seconds per call]}, the variants interleaved call by call; `out`
    (a dict) is filled as the calls come, so a run cut short keeps what it measured."""
    import dataclasses

    from benchmarks.common import NoEosTokenizer
    from benchmarks.common import prompt_ids as _prompt_ids
    from jaxsample import SamplingParams, disk_cache
    from jaxsample.engine import loop, session
    from jaxsample.loading import load

    # Each variant's programs are traced under its patch: never read from the exported
    # programs on disk, whose keys cannot see a patch (the compilation cache can: its
    # key is the traced program's).
    os.environ[disk_cache.ENV_NO_EXPORTED] = "1"
    lm = load(None, dtype="float32", weights=weights)
    lm = dataclasses.replace(lm, tokenizer=NoEosTokenizer(lm.tokenizer))
    ids = _prompt_ids(0, P, lm.vocab_limit)
    programs = {v: loop.Programs() for v in variants}
    out = {} if out is None else out
    for N in Ns:
        sp = SamplingParams(n=N, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=T, seed=0)
        sessions = {}
        for v in variants:  # prefill once; compile each variant (and warm up) under its patch
            session.PROGRAMS = programs[v]
            with PATCHES[v]():
                lm_v = dataclasses.replace(lm, **MODEL_SWITCHES.get(v, {}))
                sessions[v] = s = session.Session(lm_v, [ids], sp)
                _decode(s, N, T, chunk)
        for _ in range(reps):
            for v in variants:
                session.PROGRAMS = programs[v]
                s = sessions[v]
                c0 = s.timings["compile"]
                out.setdefault((v, N), []).append(_decode(s, N, T, chunk))
                assert s.timings["compile"] == c0, "a variant recompiled"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="now")
    ap.add_argument("--prompt-length", type=int, default=1024)
    ap.add_argument("--branches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=None,
                    help="decode steps per device call (default: all T in one)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--weights", default=None, choices=["int8", "int8-weight-only"],
                    help="quantised weights (default: float32)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in PATCHES:
            ap.error(f"unknown variant {v!r}; choose from {sorted(PATCHES)}")
    res = {}
    try:
        run(variants, a.prompt_length, [int(x) for x in a.branches.split(",")],
            a.new_tokens, a.reps, a.temperature, a.top_k, a.top_p, a.weights, out=res,
            chunk=a.chunk)
    finally:  # what was measured is printed and written, even after Ctrl-C or an error
        _report(a, variants, res)


def _report(a, variants, res):
    print("| variant | N | median step ms | min | max | calls |\n|---|---|---|---|---|---|")
    for (v, N), xs in sorted(res.items(), key=lambda kv: (kv[0][1], variants.index(kv[0][0]))):
        print(f"| {v} | {N} | {statistics.median(xs) * 1e3:.2f} | {min(xs) * 1e3:.2f} | "
              f"{max(xs) * 1e3:.2f} | {len(xs)} |")
    if a.out:
        with open(a.out, "a") as fh:
            for (v, N), xs in res.items():
                fh.write(json.dumps(dict(variant=v, weights=a.weights, N=N, P=a.prompt_length,
                                         T=a.new_tokens, chunk=a.chunk,
                                         step_s=xs, median_step_s=statistics.median(xs))) + "\n")


if __name__ == "__main__":
    main()
