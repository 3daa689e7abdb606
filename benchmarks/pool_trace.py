"""The decode pool chunk by chunk: where its slot utilisation goes (CPU or any device).

Runs `benchmarks/scheduler.py`'s skewed workload through the pool alone (one
`generate` at the KV budget of the batch-by-batch loop of `--rows` prompts, as
that script's "pool (budget)"), and records after every chunk the pool's
shape (rows x slots), its live slots, the branches still waiting and the
branches moved between rows of a prompt, and every compaction. Utilisation =
decoded tokens / branch-steps (`Generation.bill`). Reports how the idle
slot-steps split between the part of the run where branches wait (rows whose
prompt has nothing left for a free slot) and the drain (nothing waits).

    python -m benchmarks.pool_trace --prompts 64 --n 16 --max-new-tokens 256 \
        --out benchmarks/results/pool_trace_issue.json

Outputs the JSON (config, env, bill, timings, the trace, branch lengths) and,
with `--tokens`, the tokens and lengths as `.npz` beside it; `--compare
OTHER.json` counts the branches whose length differs from another run's
(e.g. before a scheduling change: the tokens must not change).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from benchmarks.common import environment


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=4, help="the batch loop's prompts (the budget)")
    ap.add_argument("--chunk-size", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", action="store_true", help="also write tokens and lengths (.npz)")
    ap.add_argument("--compare", type=pathlib.Path, default=None)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args(argv)

    import jaxsample
    from benchmarks.scheduler import batch_kv_bytes, workload
    from jaxsample import SamplingParams
    from jaxsample.engine import round as round_lib

    trace = []
    run, compact = round_lib.Round.run, round_lib.Round.compact

    def traced_run(self, steps):
        t0, moved = self.t, self.moved
        more = run(self, steps)
        trace.append({"kind": "chunk", "t0": t0, "t1": self.t, "shape": list(self.col_of.shape),
                      "live_after": int(self.sched.live_slots().sum()),
                      "waiting": int(self.waiting_branches), "moved": self.moved - moved})
        return more

    def traced_compact(self):
        before = list(self.col_of.shape)
        done = compact(self)
        if done:
            trace.append({"kind": "compact", "t": self.t, "before": before,
                          "after": list(self.col_of.shape)})
        return done

    round_lib.Round.run, round_lib.Round.compact = traced_run, traced_compact
    env = environment()
    lm = jaxsample.load()
    prompts = [w["prompt"] for w in workload(args.prompts, args.long_every, args.seed)]
    params = SamplingParams(n=args.n, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    kv = batch_kv_bytes(lm, prompts, params, args.rows)
    t = time.perf_counter()
    g = jaxsample.generate(lm, prompts, params, chat=True, chunk_size=args.chunk_size,
                           max_kv_bytes=kv)
    wall = time.perf_counter() - t
    b = g.bill
    chunks = [e for e in trace if e["kind"] == "chunk"]
    idle_wait = sum((e["t1"] - e["t0"]) * (e["shape"][0] * e["shape"][1] - e["live_after"])
                    for e in chunks if e["waiting"])
    idle_drain = sum((e["t1"] - e["t0"]) * (e["shape"][0] * e["shape"][1] - e["live_after"])
                     for e in chunks if not e["waiting"])
    out = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v
                      for k, v in vars(args).items()},
           "env": env, "kv_budget_bytes": kv, "wall_s": wall, "timings": g.timings,
           "end_to_end_s": wall - g.timings["compile"],
           "decoded_tokens": int(b.decoded_tokens_total), "branch_steps": int(b.branch_steps),
           "slot_utilisation": b.slot_utilisation,
           "moved": sum(e["moved"] for e in chunks),
           # Upper estimates: slots that ended inside a chunk count as idle for all of it.
           "idle_slot_steps_while_waiting": int(idle_wait),
           "idle_slot_steps_drain": int(idle_drain),
           "trace": trace, "lengths": np.asarray(g.lengths).tolist()}
    if args.compare:
        other = np.asarray(json.loads(args.compare.read_text())["lengths"])
        out["lengths_differ_from"] = {"file": str(args.compare),
                                      "branches": int((other != np.asarray(g.lengths)).sum())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    if args.tokens:
        np.savez_compressed(args.out.with_suffix(".npz"), tokens=np.asarray(g.tokens),
                            lengths=np.asarray(g.lengths))
    print(f"pool {chunks[0]['shape'][0]}x{chunks[0]['shape'][1]}: {out['end_to_end_s']:.1f} s "
          f"end to end (compile {g.timings['compile']:.1f} s), {out['decoded_tokens']} tokens, "
          f"utilisation {out['slot_utilisation']:.1%}, {out['moved']} branches moved; idle "
          f"slot-steps (upper estimates) {idle_wait} while waiting, {idle_drain} in the drain")
    if args.compare:
        print(f"lengths differ from {args.compare}: {out['lengths_differ_from']['branches']} "
              f"branches")


if __name__ == "__main__":
    main()
