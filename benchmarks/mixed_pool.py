"""A mixed workload through one pool against one pool per settings group, end to end.

`--requests` chat prompts (the bundled arithmetic tasks, benchmarks/tasks.py)
whose SamplingParams change every few requests, as a dataset of mixed
requests does: n in {1, 4, 8, 16}, max_tokens in {24, 48, 64}, greedy and
sampled, top-p / top-k / min-p, a repetition penalty on some, stop strings on
some. Two modes, each in its own fresh process (so each pays its own
compiles; JAX's persistent compilation cache off in both):

  mixed    `LLM.generate(prompts, [params_i])`: every request in one pool, one
           decode program (`engine.requests`);
  groups   one `LLM.generate` call per run of consecutive requests with equal
           SamplingParams: a pool per settings group, each group's shapes
           compiled (what `run_requests` did before the pool took mixed
           settings).

Both modes draw the same tokens (every request has its own seed). Reported
per mode: end-to-end seconds of the first pass (compiles included) and of a
second pass in the same process (compiled), decode programs compiled,
decoded tokens, tokens/s of the second pass, and whether the two modes'
texts agree.

    python -m benchmarks.mixed_pool                       # 64 requests on SmolLM2
    python -m benchmarks.mixed_pool --requests 8 --model tiny   # a smoke run

Output: benchmarks/results/mixed_pool.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"


def settings():
    """The settings groups, in the order the workload cycles through them."""
    from jaxsample import SamplingParams

    return [
        dict(n=8, temperature=0.8, top_p=0.95, max_tokens=48),
        dict(n=1, temperature=0.0, max_tokens=24),
        dict(n=16, temperature=1.0, top_k=40, max_tokens=64, stop=["\n\n"]),
        dict(n=4, temperature=0.7, min_p=0.05, max_tokens=48, repetition_penalty=1.1),
        dict(n=8, temperature=0.6, top_p=0.9, max_tokens=24),
        dict(n=4, temperature=0.0, max_tokens=64, stop=["."]),
    ], SamplingParams


def workload(count: int):
    """(prompts, params): chat prompts with their own seeds, settings changing every
    1-5 requests (a deterministic pattern)."""
    from benchmarks.tasks import make_tasks

    groups, SamplingParams = settings()
    tasks = make_tasks("add2", count, seed=0)
    prompts, params, g, i = [], [], 0, 0
    while len(prompts) < count:
        run = 1 + (g * 3) % 5
        for _ in range(run):
            if len(prompts) == count:
                break
            prompts.append([{"role": "user", "content": tasks[i].prompt}])
            params.append(SamplingParams(seed=1000 + i, **groups[g % len(groups)]))
            i += 1
        g += 1
    return prompts, params


def _groups(params):
    out = []
    for i, p in enumerate(params):
        if out and params[out[-1][-1]] == p:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def worker(mode: str, model: str, count: int) -> dict:
    import jax

    from jaxsample import LLM, engine
    from jaxsample.tiny import make_tiny_lm

    lm = make_tiny_lm() if model == "tiny" else None
    llm = LLM(lm if lm is not None else model, compilation_cache=False)
    prompts, params = workload(count)
    passes = []
    texts = None
    for _ in range(2):
        t0 = time.perf_counter()
        if mode == "mixed":
            outs = llm.chat(prompts, params, use_tqdm=False)
        else:
            outs = [None] * count
            for idx in _groups(params):
                got = llm.chat([prompts[i] for i in idx], params[idx[0]], use_tqdm=False)
                for i, o in zip(idx, got):
                    outs[i] = o
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        passes.append({"seconds": wall, "tokens": tokens})
        texts = [[c.text for c in o.outputs] for o in outs]
    decode = sum(1 for k in engine.PROGRAMS._cache if k[0][0] == "decode")
    return {"mode": mode, "passes": passes, "decode_programs": decode,
            "groups": len(_groups(params)), "texts": texts, "jax": jax.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a model name or path, or 'tiny' (the random test model)")
    ap.add_argument("--out", default=str(RESULTS / "mixed_pool.json"))
    ap.add_argument("--worker", choices=["mixed", "groups"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.requests)))
        return 0
    from benchmarks.common import environment, md_table

    def write(rows) -> bool:
        """The JSON with the modes measured so far (rewritten after each mode, so a
        later failure or Ctrl-C keeps the finished ones); True if both gave the same
        texts."""
        same = (len(rows) == 2 and all("texts" in r for r in rows)
                and rows[0]["texts"] == rows[1]["texts"])
        result = {"env": env_info, "requests": args.requests, "model": args.model,
                  "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows],
                  "same_texts": same}
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return same

    env_info = environment()
    rows = []
    for mode in ("mixed", "groups"):
        env = {**os.environ, "JAXSAMPLE_NO_CACHE": "1"}
        out = subprocess.run([sys.executable, "-m", "benchmarks.mixed_pool", "--worker", mode,
                              "--model", args.model, "--requests", str(args.requests)],
                             capture_output=True, text=True, env=env, check=False)
        if out.returncode:
            rows.append({"mode": mode, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        same = write(rows)
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["mode"], "error", str(r["error"]), "", "", ""])
            continue
        first, second = r["passes"]
        table.append([r["mode"], str(r["groups"]), str(r["decode_programs"]),
                      f"{first['seconds']:.1f}", f"{second['seconds']:.1f}",
                      f"{second['tokens'] / second['seconds']:.0f}"])
    print(md_table(["mode", "settings groups", "decode programs", "first pass s",
                    "second pass s", "tokens/s (second)"], table))
    print(f"same texts in both modes: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
