"""Selection rules on the device's signals: accuracy at k = 4, 16, 64 from one pool, and the
step-time cost of the signals.

1. Accuracy. For each task family (benchmarks/tasks.py, chat prompts, integer
   answers graded by exact match of the extracted number) one pool of
   `--max-n` branches per problem is drawn with `SamplingParams(signals=True,
   logprobs=20)`, so every rule reads the same branches. Rules:
   maj@k; best-of-k by mean logprob, mean self-certainty (arXiv 2502.18581),
   DeepConf's tail, lowest-group and bottom-10% group confidence (arXiv
   2508.15260) on both token confidences (the on-device self-certainty,
   "sig", and DeepConf's own minus mean top-20 logprob, "top20"); DeepConf's
   confidence-weighted vote and its top-10% / top-90% filtered votes (weights:
   lowest group confidence); Borda voting by self-certainty rank (power 0.5).
   maj@k and best-of-k are exact expectations over all k-subsets of the pool
   (`estimators.maj_at_k`, `estimators.best_of_k`); the votes have no exact
   estimator here, so they are averaged over `--subsets` random k-subsets per
   problem (exact at k = max_n: the one subset). Standard errors across
   problems.
2. Cost (`--overhead`): the decode time of one request with signals off, on,
   and with `logprobs=20`, interleaved in one process (median of `--repeats`
   runs each), at the model's V (SmolLM2: 49,152; Gemma 3 270M: 262,144).
3. DeepConf online (`--deepconf-online`): `adaptive_self_consistency(confidence=
   "deepconf-low")` on the first family's problems with the on-device signals
   (`confidence_source="signals"`) and with the top-20 logprobs, alternated in one
   process: decode seconds (medians of `--repeats`), tokens, branches, accuracy.

    python -m benchmarks.selection --families add1,add2,mul21 --problems 48
    python -m benchmarks.selection --overhead --model gemma3-270m
    python -m benchmarks.selection --deepconf-online --families add1 --problems 16 --max-n 32
    python -m benchmarks.selection --from-json benchmarks/results/selection.json

Outputs: benchmarks/results/selection[-MODEL].json and .md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import pathlib
import platform
import time

import numpy as np

from benchmarks.common import se

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
KS = (4, 16, 64)
SCORE_RULES = [("mean logprob", "mean_logprob")] + [
    (f"{name} ({src})", f"{key}:{src}") for src in ("sig", "top20")
    for name, key in (("tail confidence", "tail"), ("lowest group confidence", "lowest"),
                      ("bottom-10% group confidence", "bottom"))]
SCORE_RULES.insert(1, ("self-certainty", "mean:sig"))
SCORE_RULES.insert(2, ("mean confidence (top20)", "mean:top20"))
VOTE_RULES = [("DeepConf weighted vote (lowest group, sig)", "lowest:sig", None),
              ("DeepConf top-10% filtered vote (lowest group, sig)", "lowest:sig", 10),
              ("DeepConf top-90% filtered vote (lowest group, sig)", "lowest:sig", 90),
              ("DeepConf weighted vote (lowest group, top20)", "lowest:top20", None),
              ("DeepConf top-10% filtered vote (lowest group, top20)", "lowest:top20", 10),
              ("DeepConf top-90% filtered vote (lowest group, top20)", "lowest:top20", 90),
              ("Borda by self-certainty rank (p = 0.5)", "mean:sig", "borda"),
              # The same three votes on the mean logprob (weights: its exp, the branch's
              # geometric-mean token probability), to test whether voting adds to best-of-k.
              ("vote weighted by exp(mean logprob)", "exp:mean_logprob", None),
              ("top-10% by mean logprob, weighted vote", "exp:mean_logprob", 10),
              ("Borda by mean-logprob rank (p = 0.5)", "mean_logprob", "borda")]


_se = functools.partial(se, fewer=0.0)  # 0 for a single problem


def _pool(lm, tasks, args, family_index):
    from jaxsample import SamplingParams, generate
    from jaxsample import reduce as reducers
    from jaxsample.reduce import answers

    params = SamplingParams(n=args.max_n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, logprobs=20,
                            signals=True)
    recs, decode_s = [], 0.0
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start:start + args.batch]
        gen = generate(lm, [t.prompt for t in chunk], params, chat=True,
                       prompt_index_offset=family_index * 10_000 + start)
        decode_s += gen.timings["decode"]
        scores = {"mean_logprob": gen.mean_logprob().astype(np.float64)}
        for src, name in (("sig", "signals"), ("top20", "top_logprobs")):
            conf = reducers.token_confidence(gen, name)
            for key, kind in (("mean", "mean"), ("tail", "tail"), ("lowest", "lowest_group"),
                              ("bottom", "bottom_group")):
                scores[f"{key}:{src}"] = reducers.confidence_scores(
                    conf, gen.lengths, kind, window=args.group_size, tail=args.tail)
        for b, task in enumerate(chunk):
            ans = [answers.extract(t, "number") for t in gen.texts[b]]
            recs.append({"question": task.question, "reference": task.answer, "answers": ans,
                         "correct": [a == task.answer for a in ans],
                         "lengths": [int(x) for x in gen.lengths[b]],
                         "scores": {k: [float(x) for x in v[b]] for k, v in scores.items()}})
        print(f"  {start + len(chunk)}/{len(tasks)} problems, decode {decode_s:.1f} s", flush=True)
    return recs, decode_s


def _vote_accuracy(rec, key, how, k, subsets, rng):
    """Mean correctness of a vote over random k-subsets (the one subset when k = n)."""
    from jaxsample import reduce as reducers

    n = len(rec["answers"])
    ids_of = {}
    ids = np.array([-1 if a is None else ids_of.setdefault(a, len(ids_of))
                    for a in rec["answers"]], np.int32)
    ref = ids_of.get(rec["reference"], -2)
    exp = key.startswith("exp:")
    conf = np.array(rec["scores"][key.removeprefix("exp:")], np.float64)
    conf = (np.exp(conf) if exp else conf).astype(np.float32)
    if k >= n:
        picks = np.arange(n)[None]
    else:
        picks = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(subsets)])
    sub_ids, sub_conf = ids[picks], conf[picks]
    if how == "borda":
        v = reducers.borda_vote(sub_ids, sub_conf, power=0.5)
    else:
        v = reducers.confidence_vote(sub_ids, sub_conf, top_percent=how)
    return float(np.mean(np.asarray(v.winner) == ref))


def _complete_first(rec, key, cfg) -> np.ndarray:
    """A branch's score for best-of-k as the command line picks (`--reduce best`: a branch
    cut at max_new_tokens never beats a complete one; with none complete, the best of all):
    complete branches ranked above the others, each group by its score. Complete = shorter
    than max_new_tokens (the pool does not record finish reasons: a branch whose stop token
    fell exactly on the last position counts as cut)."""
    score = np.array(rec["scores"][key], np.float64)
    cut = np.array(rec["lengths"]) >= cfg["max_new_tokens"]
    finite = score[np.isfinite(score)]
    spread = float(finite.max() - finite.min()) + 1.0 if finite.size else 1.0
    return score - cut * spread


def analyse(data) -> dict:
    from jaxsample.reduce import estimators

    cfg = data["config"]
    rng = np.random.default_rng(0)
    out = {}
    for fam, f in data["families"].items():
        recs = f["pool"]
        rows = {}
        for k in KS:
            if k > cfg["max_n"]:
                continue
            acc = [estimators.maj_at_k(r["answers"], r["reference"], k) for r in recs]
            rows.setdefault("maj@k", {})[k] = (float(np.mean(acc)), _se(acc))
            for name, key in SCORE_RULES:
                acc = [estimators.best_of_k(_complete_first(r, key, cfg), np.array(r["correct"]),
                                            k, valid=np.array(r["lengths"]) > 0) for r in recs]
                rows.setdefault(f"best-of-k by {name}", {})[k] = (float(np.mean(acc)), _se(acc))
            for name, key, how in VOTE_RULES:
                acc = [_vote_accuracy(r, key, how, k, cfg["subsets"], rng) for r in recs]
                rows.setdefault(name, {})[k] = (float(np.mean(acc)), _se(acc))
        pass1 = [np.mean(r["correct"]) for r in recs]
        out[fam] = {"problems": len(recs), "pass1": float(np.mean(pass1)), "pass1_se": _se(pass1),
                    "rows": rows, "pool_decode_s": f["pool_decode_s"]}
    return out


def markdown(summary, data) -> str:
    cfg = data["config"]
    ks = [k for k in KS if k <= cfg["max_n"]]
    lines = []
    for fam, s in summary.items():
        lines += [f"### {fam} ({s['problems']} problems, pool of {cfg['max_n']}, pass@1 "
                  f"{s['pass1']:.3f} ± {s['pass1_se']:.3f})", "",
                  "| rule | " + " | ".join(f"k = {k}" for k in ks) + " |",
                  "|---|" + "---|" * len(ks)]
        base = s["rows"]["best-of-k by mean logprob"]
        for name, by_k in s["rows"].items():
            cells = []
            for k in ks:
                a, se = by_k[k]
                b, bse = base[k]
                mark = " **+**" if a - b > 2 * math.hypot(se, bse) else ""
                cells.append(f"{a:.3f} ± {se:.3f}{mark}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("**+**: above best-of-k by mean logprob by more than two standard errors of the "
                 "difference (independent-error approximation; the rules share the pool, so this "
                 "is conservative).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# DeepConf online: the on-device signals against the top-20 logprobs


def deepconf_online(lm, args) -> dict:
    """`adaptive_self_consistency(confidence="deepconf-low")` on the first family's
    problems with `confidence_source="signals"` (no top-k copied) and "top_logprobs"
    (k = 20), alternated `--repeats` times in one process after a warm-up of each:
    decode seconds (medians), decoded tokens, branches drawn and accuracy."""
    from benchmarks.tasks import make_tasks
    from jaxsample import SamplingParams, adaptive_self_consistency

    tasks = make_tasks(args.families.split(",")[0], args.problems, args.task_seed)
    prompts = [t.prompt for t in tasks]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    kw = dict(max_n=args.max_n, window=8, rule="beta", confidence="deepconf-low",
              warmup=16, group_size=args.group_size, chat=True, extract="number")
    sources = ("signals", "top_logprobs")

    def one(src):
        r = adaptive_self_consistency(lm, prompts, params, confidence_source=src, **kw)
        acc = float(np.mean([w == t.answer for w, t in zip(r.winner, tasks)]))
        bill = r.generation.bill
        return (float(r.generation.timings["decode"]), int(bill.decoded_tokens_total),
                int(bill.adaptive.branches_drawn), acc)

    for src in sources:  # compile and warm up
        one(src)
    runs = {src: [] for src in sources}
    for _ in range(args.repeats):
        for src in sources:
            runs[src].append(one(src))
    out = {src: {"decode_s": float(np.median([x[0] for x in v])),
                 "decode_s_all": [x[0] for x in v], "decoded_tokens": v[0][1],
                 "branches_drawn": v[0][2], "accuracy": v[0][3]} for src, v in runs.items()}
    out["signals_decode_vs_top20"] = out["signals"]["decode_s"] / out["top_logprobs"]["decode_s"]
    out["problems"] = len(tasks)
    return out


# ---------------------------------------------------------------------------
# Step-time overhead


def overhead(lm, args) -> dict:
    """Decode seconds per step with signals off / on / logprobs=20, interleaved medians."""
    from jaxsample import SamplingParams, generate

    base = SamplingParams(n=args.overhead_n, temperature=0.8, max_new_tokens=args.overhead_tokens,
                          seed=0, ignore_eos=True)
    variants = {"off": base, "signals": base.replace(signals=True),
                "logprobs=20": base.replace(logprobs=20)}
    prompt = "Write a long story about a lighthouse keeper."
    for p in variants.values():  # compile (and warm) each program first
        generate(lm, [prompt], p, chat=True)
    times = {k: [] for k in variants}
    for _ in range(args.repeats):
        for k, p in variants.items():
            g = generate(lm, [prompt], p, chat=True)
            times[k].append(g.timings["decode"] / int(g.bill.decode_steps))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"V": lm.config.vocab_size, "vocab_limit": lm.vocab_limit, "n": args.overhead_n,
            "tokens": args.overhead_tokens, "repeats": args.repeats, "step_s": med,
            "all_step_s": times,
            "signals_overhead": med["signals"] / med["off"] - 1,
            "logprobs20_overhead": med["logprobs=20"] / med["off"] - 1}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model name (default: the embedded SmolLM2)")
    ap.add_argument("--families", default="add1,add2,mul21")
    ap.add_argument("--problems", type=int, default=48)
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--max-n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=8, help="DeepConf's window (paper: 2048)")
    ap.add_argument("--tail", type=int, default=8, help="tail confidence tokens (paper: 2048)")
    ap.add_argument("--subsets", type=int, default=64, help="random k-subsets per vote estimate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead", action="store_true", help="only the step-time measurement")
    ap.add_argument("--deepconf-online", action="store_true",
                    help="only DeepConf-low online: signals against top-20 logprobs (decode time)")
    ap.add_argument("--overhead-n", type=int, default=16)
    ap.add_argument("--overhead-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--from-json", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    tag = "" if args.model is None else "-" + args.model.replace("/", "_")
    name = ("selection_overhead" if args.overhead else "selection_deepconf_online"
            if args.deepconf_online else "selection")
    out = args.out or RESULTS / (name + tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        import jax

        import jaxsample
        from benchmarks.tasks import make_tasks

        lm = jaxsample.load(args.model) if args.model else jaxsample.load()
        data = {"config": {k: str(v) if isinstance(v, pathlib.Path) else v
                           for k, v in vars(args).items() if k not in ("from_json", "out")},
                "model": lm.name,
                "machine": {"platform": platform.platform(), "python": platform.python_version(),
                            "jax": jax.__version__, "devices": str(jax.devices()),
                            "date": datetime.date.today().isoformat()}}
        t0 = time.perf_counter()
        if args.overhead:
            data["overhead"] = overhead(lm, args)
            data["wall_s"] = time.perf_counter() - t0
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))
            o = data["overhead"]
            print(json.dumps({k: o[k] for k in ("V", "n", "step_s", "signals_overhead",
                                                "logprobs20_overhead")}, indent=1))
            return
        if args.deepconf_online:
            data["deepconf_online"] = deepconf_online(lm, args)
            data["wall_s"] = time.perf_counter() - t0
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))
            print(json.dumps(data["deepconf_online"], indent=1))
            return
        data["families"] = {}
        for fi, fam in enumerate(args.families.split(",")):
            print(f"{fam}:", flush=True)
            tasks = make_tasks(fam, args.problems, args.task_seed)
            recs, s = _pool(lm, tasks, args, fi)
            data["families"][fam] = {"pool": recs, "pool_decode_s": s}
            out.with_suffix(".json").write_text(json.dumps(data))  # partial results survive
        data["wall_s"] = time.perf_counter() - t0
        out.with_suffix(".json").write_text(json.dumps(data))
    summary = analyse(data)
    md = markdown(summary, data)
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
