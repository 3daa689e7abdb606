"""Continuous scheduling: the decode pool against the batch-by-batch loop, side by side.

A skewed workload (branches that finish at very different lengths): chat
prompts mixing the bundled arithmetic tasks (benchmarks/tasks.py; answers of a
few tokens) with a long-answer task (a story: runs to `max_new_tokens`), one
long prompt every `--long-every`. Under the same decode shape, rows x slots
(R prompts x S branches held at once, the same KV for the tails):

  pool   `generate(lm, all prompts, params, max_rows=R, max_slots=S)`: one call;
         between chunks a finished slot takes its prompt's next waiting
         branch and a settled row the next waiting prompt (engine/round.py);
  batch  `generate` on consecutive batches of R prompts (`prompt_index_offset`
         = the batch's start, so every branch has the same key as in the pool),
         S = n branches each: every batch decodes until its longest branch ends.

Both are warmed up first (the first pass of each compiles; its compile seconds
are reported apart), then `--repeats` passes alternate pool / batch so that both
see the same machine load. Reported per pass: end-to-end wall seconds (prefill
+ decode + host work), decoded tokens per second, slot utilisation = decoded
tokens / branch-steps computed (`Generation.bill`), peak RSS. The pool's
tokens are compared with the batch loop's per (prompt, branch): equal, or
diverged at a float tie (the tie oracle's test, tests/ties.py, counted here
instead of asserted), or a real mismatch.

    python -m benchmarks.scheduler                    # the small CPU default
    python -m benchmarks.scheduler --issue            # issue 21's sizes: 64 prompts x N=16 x 256 tokens

Outputs: benchmarks/results/scheduler_cpu.json (raw rows: env, config, one row
per pass, the token check, the summary) and the markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from benchmarks.common import PeakRSS, environment, md_table, ru_maxrss_bytes

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

LONG_TOPICS = ["a lighthouse keeper who finds a map", "a robot learning to paint",
               "a city that floats above the sea", "two friends crossing a desert",
               "a dragon who is afraid of fire", "the last library on Mars",
               "a clockmaker's apprentice", "a storm over a small fishing village"]
SHORT_FAMILIES = ["add1", "add2", "word", "compare", "addsub", "mul1"]


def long_prompt(i: int) -> str:
    return (f"Write a long, detailed story about {LONG_TOPICS[i % len(LONG_TOPICS)]}. "
            f"Describe every scene at length.")


def workload(count: int, long_every: int, seed: int = 0) -> list[dict]:
    """`count` chat prompts: one long-answer prompt every `long_every`, the others
    the bundled tasks (families in turn). Returns [{"kind", "family", "prompt"}]."""
    from benchmarks.tasks import make_tasks

    n_long = count // long_every if long_every > 0 else 0
    per_family = -(-(count - n_long) // len(SHORT_FAMILIES))
    pools = {f: make_tasks(f, per_family, seed) for f in SHORT_FAMILIES}
    out, j, k = [], 0, 0
    for i in range(count):
        if long_every > 0 and i % long_every == long_every - 1:
            out.append({"kind": "long", "family": "story", "prompt": long_prompt(k)})
            k += 1
        else:
            fam = SHORT_FAMILIES[j % len(SHORT_FAMILIES)]
            out.append({"kind": "short", "family": fam,
                        "prompt": pools[fam][j // len(SHORT_FAMILIES)].prompt})
            j += 1
    return out


def _counts(gens):
    decoded = sum(g.bill.decoded_tokens_total for g in gens)
    steps = sum(g.bill.branch_steps for g in gens)
    t = {k: sum(g.timings.get(k, 0.0) for g in gens) for k in ("compile", "prefill", "decode",
                                                             "host")}
    return decoded, steps, t


def batch_kv_bytes(lm, prompts, params, rows) -> int:
    """KV bytes of the batch loop's largest batch: `rows` prompts' prefixes and
    rows x n branch slots (`engine.budget`'s row and slot sizes, at the
    buckets the engine picks for the whole workload)."""
    from jaxsample.engine import budget, inputs
    from jaxsample.engine.buckets import bucket

    ids, _ = inputs.encode_prompts(lm, prompts, chat=True)
    cfg = lm.config
    row = budget.row_bytes(cfg, bucket(max(len(x) for x in ids)))
    slot = budget.slot_bytes(cfg, bucket(params.max_new_tokens))
    return rows * row + rows * params.n * slot


def pool_plan(lm, prompts, params, kv_bytes) -> tuple[int, int]:
    """The (rows, slots) `generate(max_kv_bytes=kv_bytes)` picks for the workload."""
    from jaxsample.engine import budget, inputs
    from jaxsample.engine.buckets import bucket

    ids, _ = inputs.encode_prompts(lm, prompts, chat=True)
    return budget.plan(lm.config, B=len(prompts), n=params.n,
                       p_cap=bucket(max(len(x) for x in ids)),
                       t_cap=bucket(params.max_new_tokens), budget=kv_bytes)


def run_pool(lm, prompts, params, rows, slots, chunk, kv_bytes=None):
    from jaxsample import generate

    with PeakRSS() as rss:
        t0 = time.perf_counter()
        g = generate(lm, prompts, params, chat=True, max_rows=rows, max_slots=slots,
                     chunk_size=chunk, max_kv_bytes=kv_bytes)
        wall = time.perf_counter() - t0
    return [g], wall, rss


def run_batches(lm, prompts, params, rows, chunk):
    from jaxsample import generate

    gens = []
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        for b0 in range(0, len(prompts), rows):
            gens.append(generate(lm, prompts[b0:b0 + rows], params, chat=True,
                                 prompt_index_offset=b0, chunk_size=chunk))
        wall = time.perf_counter() - t0
    return gens, wall, rss


def row(name, rep, gens, wall, rss, shape):
    decoded, steps, t = _counts(gens)
    run_s = wall - t["compile"]
    return {"kind": "pass", "method": name, "repeat": rep, "rows": shape[0], "slots": shape[1],
            "wall_s": wall, "compile_s": t["compile"], "end_to_end_s": run_s,
            "prefill_s": t["prefill"], "decode_s": t["decode"], "host_s": t["host"],
            "decoded_tokens": int(decoded), "branch_steps": int(steps),
            "slot_utilisation": decoded / steps if steps else 0.0,
            "tokens_per_s": decoded / run_s if run_s > 0 else None,
            "peak_rss_bytes": int(rss.peak), "rss_start_bytes": int(rss.start),
            "kv_bytes_per_device": max(int(g.bill.kv_bytes_per_device) for g in gens)}


def compare_tokens(lm, pool_gen, batch_gens, params, tol=1e-4):
    """Per (prompt, branch): equal / diverged at a float tie / mismatch (the test of
    tests/ties.py, written out here because benchmarks never import the tests;
    counted rather than asserted)."""
    import jax
    import jax.numpy as jnp

    def branch_key(seed, b, n, t):  # the engine's key for token t of branch (b, n)
        key = jax.random.fold_in(jax.random.key(np.uint32(seed)), b)
        return jax.random.fold_in(jax.random.fold_in(key, n), t)

    def gumbel(key):  # [V] the noise the draw adds at that key
        return np.asarray(jax.random.gumbel(key, (lm.config.vocab_size,), jnp.float32), np.float64)

    tok = np.concatenate([g.tokens for g in batch_gens])
    lp = np.concatenate([g.logprobs for g in batch_gens])
    ln = np.concatenate([g.lengths for g in batch_gens])
    B, N, _ = tok.shape
    equal = ties = 0
    mismatches = []
    for b in range(B):
        for n in range(N):
            ta, tb = tok[b, n], pool_gen.tokens[b, n]
            diff = np.nonzero(ta != tb)[0]
            t = int(diff[0]) if diff.size else None
            if t is None:
                if ln[b, n] == pool_gen.lengths[b, n]:
                    equal += 1
                else:
                    mismatches.append({"prompt": b, "branch": n, "at": None,
                                       "why": "lengths differ with equal tokens"})
                continue
            a, c = int(ta[t]), int(tb[t])
            dz = float(lp[b, n, t]) - float(pool_gen.logprobs[b, n, t])
            g = gumbel(branch_key(params.seed, b, n, t))
            gap = abs(dz / params.temperature + g[a] - g[c])
            if gap <= tol / params.temperature:
                ties += 1
            else:
                mismatches.append({"prompt": b, "branch": n, "at": t, "batch_token": a,
                                   "pool_token": c, "score_gap": gap})
    return {"kind": "token_check", "branches": B * N, "equal": equal, "ties": ties,
            "mismatches": len(mismatches), "mismatch_rows": mismatches[:20], "tol": tol}


def bounds(lengths, rows, slots):
    """What the lengths allow: the batch loop's slot-steps (requests.batch_branch_steps)
    and the row-refill bound (a row is held until its prompt's longest branch ends:
    decoded / sum over prompts of n x its longest branch)."""
    from jaxsample.engine.requests import batch_branch_steps

    lengths = np.asarray(lengths)
    decoded = int(lengths.sum())
    per_row = int((lengths.max(axis=1) * lengths.shape[1]).sum())
    bb = batch_branch_steps(lengths, rows, slots)
    return {"kind": "bounds", "decoded_tokens": decoded, "row_refill_bound": decoded / per_row,
            "batch_branch_steps_estimate": int(bb), "batch_utilisation_estimate": decoded / bb,
            "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
            "median_length": float(np.median(lengths))}


def summarise(rows_, names):
    out = {}
    # With --repeats 0 the warm-up pass is the only one: its end to end excludes
    # its compile seconds, so it is reported (the first call's other one-off
    # costs, e.g. allocating, stay in it).
    first = 0 if max(r["repeat"] for r in rows_) == 0 else 1
    for m in ["batch"] + names:
        rs = [r for r in rows_ if r["method"] == m and r["repeat"] >= first]
        if not rs:
            continue
        out[m] = {k: float(np.median([r[k] for r in rs]))
                  for k in ("end_to_end_s", "decode_s", "prefill_s", "tokens_per_s",
                            "slot_utilisation", "peak_rss_bytes")}
        out[m]["compile_s"] = [r for r in rows_ if r["method"] == m and r["repeat"] == 0][0]["compile_s"]
        out[m]["passes"] = len(rs)
        # Side by side: each pass against the batch pass of the same repeat.
        bs = {r["repeat"]: r for r in rows_ if r["method"] == "batch" and r["repeat"] >= first}
        sp = [bs[r["repeat"]]["end_to_end_s"] / r["end_to_end_s"] for r in rs if r["repeat"] in bs]
        out[m]["speedup_vs_batch"] = sp
    return out


def markdown(summary, checks, bnds, cfg):
    header = ["method", "rows x slots", "end to end s (median)", "vs batch (per repeat)",
              "decode s", "decoded tok/s", "slot utilisation", "compile s (first pass)",
              "peak RSS MiB"]
    lines = md_table(header, [
        [m, f"{cfg['rows']}x{cfg['n']}" if m == "batch" else m.split()[1],
         f"{s['end_to_end_s']:.1f}",
         ", ".join(f"{x:.2f}x" for x in s["speedup_vs_batch"]),
         f"{s['decode_s']:.1f}", f"{s['tokens_per_s']:.1f}", f"{s['slot_utilisation']:.1%}",
         f"{s['compile_s']:.1f}", f"{s['peak_rss_bytes'] / 2**20:.0f}"]
        for m, s in summary.items()])
    lines.append("")
    b = bnds
    lines.append(f"Branch lengths: mean {b['mean_length']:.1f}, median {b['median_length']:.0f}, "
                 f"max {b['max_length']} of {cfg['max_new_tokens']}; "
                 f"{b['decoded_tokens']} decoded tokens. Row-refill bound on utilisation "
                 f"(each row held until its prompt's longest branch ends): "
                 f"{b['row_refill_bound']:.1%}; `batch_branch_steps` estimate of the batch "
                 f"loop: {b['batch_utilisation_estimate']:.1%}.")
    for m, c in checks.items():
        lines.append(f"Tokens, {m} vs batch: {c['equal']}/{c['branches']} branches equal, "
                     f"{c['ties']} diverged at a float tie, {c['mismatches']} mismatches.")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--long-every", type=int, default=4,
                    help="one long-answer prompt every this many (0: none)")
    ap.add_argument("--n", type=int, default=8, help="branches per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="prompts held at once (both methods)")
    ap.add_argument("--pool-shapes", default="",
                    help="extra pool shapes RxS besides rows x n, e.g. 8x4 (same slot count)")
    ap.add_argument("--same-shape-pool", action=argparse.BooleanOptionalAction, default=True,
                    help="run the pool at the batch loop's shape (rows x n)")
    ap.add_argument("--budget-pool", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the pool sized by the engine from a KV budget equal to "
                         "the batch loop's (its largest batch's prefixes + rows x n slots); "
                         "the budget also holds every prompt's prefix, prefilled at the start")
    ap.add_argument("--chunk-size", type=int, default=4,
                    help="pool: decode steps between refills (the batch loop runs each batch "
                         "in one call, stopping when all its branches have ended)")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes after the warm-up")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--issue", action="store_true",
                    help="issue 21's sizes: 64 prompts, N=16, 256 new tokens, 4 rows")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "scheduler_cpu.json")
    args = ap.parse_args(argv)
    if args.issue:
        args.prompts, args.n, args.max_new_tokens = 64, 16, 256

    import jaxsample
    from jaxsample import SamplingParams

    env = environment()
    lm = jaxsample.load()
    work = workload(args.prompts, args.long_every, args.seed)
    prompts = [w["prompt"] for w in work]
    params = SamplingParams(n=args.n, temperature=args.temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    shapes = [(args.rows, args.n)] * args.same_shape_pool + [tuple(int(x) for x in s.split("x"))
                                      for s in args.pool_shapes.split(",") if s]
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    cfg["out"] = str(args.out)
    kv_bytes = None
    if args.budget_pool:
        kv_bytes = batch_kv_bytes(lm, prompts, params, args.rows)
        shapes.append(pool_plan(lm, prompts, params, kv_bytes))
        cfg["kv_budget_bytes"] = kv_bytes
        cfg["budget_pool_shape"] = list(shapes[-1])
        print(f"KV budget of the batch loop: {kv_bytes:,} bytes -> pool "
              f"{shapes[-1][0]}x{shapes[-1][1]}", flush=True)
    names = [f"pool {r}x{s}" for r, s in shapes]
    if args.budget_pool:
        names[-1] += " (budget)"
    data = {"env": env, "config": cfg, "workload": work, "rows": []}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))

    last = {}
    for rep in range(args.repeats + 1):  # pass 0: the warm-up (compiles)
        order = [("batch", None)] + [(m, (r, s)) for m, (r, s) in zip(names, shapes)]
        if rep % 2 == 0:
            order = order[::-1]
        for name, shape in order:
            if shape is None:
                gens, wall, rss = run_batches(lm, prompts, params, args.rows, None)
                shape = (args.rows, args.n)
            else:
                budgeted = name.endswith("(budget)")
                gens, wall, rss = run_pool(lm, prompts, params, None if budgeted else shape[0],
                                           None if budgeted else shape[1], args.chunk_size,
                                           kv_bytes if budgeted else None)
            r = row(name, rep, gens, wall, rss, shape)
            data["rows"].append(r)
            last[name] = gens
            print(f"pass {rep} {name}: {r['end_to_end_s']:.1f} s end to end "
                  f"(compile {r['compile_s']:.1f} s), {r['decoded_tokens']} tokens, "
                  f"utilisation {r['slot_utilisation']:.1%}", flush=True)
            save()
    lengths = np.concatenate([g.lengths for g in last["batch"]])
    data["bounds"] = bounds(lengths, args.rows, args.n)
    data["token_checks"] = {m: compare_tokens(lm, g[0], last["batch"], params)
                            for m, g in last.items() if m != "batch"}
    data["summary"] = summarise(data["rows"], names)
    data["ru_maxrss_bytes"] = ru_maxrss_bytes()
    save()
    print(markdown(data["summary"], data["token_checks"], data["bounds"],
                   {"rows": args.rows, "n": args.n, "max_new_tokens": args.max_new_tokens}))


if __name__ == "__main__":
    main()
