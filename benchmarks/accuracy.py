"""Accuracy vs budget k: pass@k, maj@k (self-consistency), best-of-k by mean logprob.

Draws a pool of N branches per problem with `jaxsample.generate` (chat
template, one shared prefix per problem), grades every branch by exact match
of the extracted number, then reports for k = 1, 2, 4, ..., N the exact
expected accuracy over random k-subsets of each problem's pool
(`jaxsample.reduce.estimators`):

  pass@k   some branch of the k is correct (an oracle verifier; upper bound)
  maj@k    the majority answer of the k is correct (self-consistency,
           Wang et al. 2022, arXiv 2203.11171; ties: first occurrence)
  best@k   the branch with the highest mean token logprob is correct

and, as a cross-check, maj@N computed directly with
`jaxsample.self_consistency` on each full pool (must equal maj@k at k = N).
Uncertainty: standard error across problems and a 95% bootstrap interval
(problems resampled).

    python -m benchmarks.accuracy                        # run the model, write results
    python -m benchmarks.accuracy --from-json benchmarks/results/accuracy.json  # recompute only
    python -m benchmarks.accuracy --probe add1,add2,...  # quick family probe (10 x 8)

Outputs (benchmarks/results/): accuracy.json (config + raw pool: per branch
text, answer, correctness, mean logprob, length, finish reason; metrics),
accuracy.md (the table), accuracy.png (accuracy vs k, log2 axis),
accuracy_probe.json (the family probe).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"

METRICS = ("pass@1", "maj@k", "best@k", "pass@k")  # pass@1 is flat in k (reference line)


# ----------------------------------------------------------------------------
# Sampling


def _sample(lm, tasks, n, args, seed):
    """Generate N branches for every task; returns per-problem records and seconds."""
    from jaxsample import SamplingParams, generate, self_consistency
    from jaxsample.reduce import answers

    params = SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=seed)
    records, seconds = [], 0.0
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start:start + args.batch]
        t0 = time.perf_counter()
        # Prompt indices fold into the keys, so a batch's seed is offset by its start
        # to keep every problem's branches independent of the others'.
        gen = generate(lm, [t.prompt for t in chunk], params.replace(seed=seed + start),
                       chat=True)
        sc = self_consistency(gen, extract=args.extract)
        dt = time.perf_counter() - t0
        seconds += dt
        mlp = gen.mean_logprob()
        for b, task in enumerate(chunk):
            ans = [answers.extract(x, args.extract) for x in gen.texts[b]]
            records.append({
                "question": task.question, "prompt": task.prompt, "reference": task.answer,
                "texts": gen.texts[b], "answers": ans,
                "correct": [a == task.answer for a in ans],
                "mean_logprob": [float(x) for x in mlp[b]],
                "lengths": [int(x) for x in gen.lengths[b]],
                "finish_reason": list(gen.finish_reason[b]),
                "self_consistency_winner": sc.winner[b],
                "self_consistency_answers_match": sc.answers[b] == ans,
            })
        done = sum(r["correct"].count(True) for r in records)
        print(f"  problems {start + len(chunk)}/{len(tasks)}: {dt:.1f} s "
              f"(compile {gen.timings.get('compile', 0):.1f} s); "
              f"running pass@1 {done / (len(records) * n):.3f}", flush=True)
    return records, seconds


def probe(lm, args):
    """~10 problems x 8 samples per family: pass@1 and the mean of truncated branches."""
    from benchmarks.tasks import make_tasks

    out = {}
    for fam in args.probe.split(","):
        tasks = make_tasks(fam, args.probe_problems, seed=args.probe_task_seed)
        saved = args.batch
        args.batch = len(tasks)
        recs, sec = _sample(lm, tasks, args.probe_n, args, args.seed)
        args.batch = saved
        corr = np.array([r["correct"] for r in recs])
        out[fam] = {
            "problems": len(tasks), "n": args.probe_n, "pass@1": float(corr.mean()),
            "se": float(corr.mean(1).std(ddof=1) / math.sqrt(len(tasks))),
            "per_problem": corr.mean(1).round(3).tolist(),
            "truncated": float(np.mean([[f == "length" for f in r["finish_reason"]] for r in recs])),
            "seconds": round(sec, 1), "example": {"prompt": tasks[0].prompt,
                                                  "texts": recs[0]["texts"][:3]},
        }
        print(f"{fam:8s} pass@1 {out[fam]['pass@1']:.3f} ± {out[fam]['se']:.3f} "
              f"truncated {out[fam]['truncated']:.2f} ({sec:.0f} s)", flush=True)
    return out


# ----------------------------------------------------------------------------
# Metrics (no model needed)


def ks_for(n: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(n)) + 1)] + ([n] if n & (n - 1) else [])


def per_problem(records, ks):
    """{metric: [P, len(ks)] float} exact expected accuracy per problem and k."""
    from jaxsample.reduce.estimators import best_of_k, maj_at_k, pass_at_k

    out = {m: np.zeros((len(records), len(ks))) for m in METRICS}
    out["maj@k (random ties)"] = np.zeros((len(records), len(ks)))
    for i, r in enumerate(records):
        corr = np.array(r["correct"], bool)
        n, c = len(corr), int(corr.sum())
        scores = np.array(r["mean_logprob"], np.float64)
        for j, k in enumerate(ks):
            out["pass@1"][i, j] = c / n
            out["pass@k"][i, j] = pass_at_k(n, c, k)
            out["maj@k"][i, j] = maj_at_k(r["answers"], r["reference"], k)
            out["maj@k (random ties)"][i, j] = maj_at_k(r["answers"], r["reference"], k,
                                                        tie="random")
            out["best@k"][i, j] = best_of_k(scores, corr, k)
    return out


def summarize(records, boot=2000, boot_seed=0):
    n = len(records[0]["correct"])
    ks = ks_for(n)
    pp = per_problem(records, ks)
    P = len(records)
    rng = np.random.default_rng(boot_seed)
    idx = rng.integers(0, P, size=(boot, P))
    table = {}
    for m, v in pp.items():
        means = v.mean(0)
        se = v.std(0, ddof=1) / math.sqrt(P) if P > 1 else np.zeros_like(means)
        bs = v[idx].mean(1)  # [boot, K]
        lo, hi = np.percentile(bs, [2.5, 97.5], axis=0)
        table[m] = {"mean": means.tolist(), "se": se.tolist(), "ci95": [lo.tolist(), hi.tolist()]}
    # Cross-check: the library's self_consistency on the full pool vs maj_at_k(k = N).
    direct = np.array([r["self_consistency_winner"] == r["reference"] for r in records], float)
    paired = {}
    for m in ("maj@k", "best@k"):
        d = pp[m] - pp["pass@1"]
        paired[f"{m} - pass@1"] = {"mean": d.mean(0).tolist(),
                                   "se": (d.std(0, ddof=1) / math.sqrt(P)).tolist()}
    answered = np.mean([[a is not None for a in r["answers"]] for r in records])
    truncated = np.mean([[f == "length" for f in r["finish_reason"]] for r in records])
    return {
        "ks": ks, "problems": P, "n": n, "table": table, "paired": paired,
        "maj@N direct (self_consistency)": float(direct.mean()),
        "maj@N via maj_at_k": float(pp["maj@k"][:, -1].mean()),
        "maj@N per-problem agreement": bool(np.array_equal(direct, pp["maj@k"][:, -1])),
        "self_consistency answers == extract": all(r["self_consistency_answers_match"]
                                                   for r in records),
        "answered fraction": float(answered), "truncated fraction": float(truncated),
        "mean length": float(np.mean([r["lengths"] for r in records])),
        "problems never solved": int(sum(not any(r["correct"]) for r in records)),
        "problems always solved": int(sum(all(r["correct"]) for r in records)),
    }


def markdown(summary) -> str:
    ks, t = summary["ks"], summary["table"]
    cols = [("pass@1", "pass@1"), ("maj@k", "maj@k"), ("best@k", "best-of-k (mean logprob)"),
            ("pass@k", "pass@k (oracle)")]
    lines = ["| k | " + " | ".join(c for _, c in cols) + " |",
             "|---:|" + "---|" * len(cols)]
    for j, k in enumerate(ks):
        cells = []
        for m, _ in cols:
            cells.append(f"{t[m]['mean'][j]:.3f} ± {t[m]['se'][j]:.3f} "
                         f"[{t[m]['ci95'][0][j]:.2f}, {t[m]['ci95'][1][j]:.2f}]")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks, t = np.array(summary["ks"]), summary["table"]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = {"pass@k": ("pass@k (oracle verifier)", "tab:green", "o"),
              "maj@k": ("maj@k (self-consistency)", "tab:blue", "s"),
              "best@k": ("best-of-k by mean logprob", "tab:red", "^"),
              "pass@1": ("pass@1 (one sample)", "gray", None)}
    for m, (label, color, marker) in styles.items():
        mean = np.array(t[m]["mean"])
        lo, hi = np.array(t[m]["ci95"][0]), np.array(t[m]["ci95"][1])
        ls = "--" if m == "pass@1" else "-"
        ax.plot(ks, mean, ls, color=color, marker=marker, label=label)
        ax.fill_between(ks, lo, hi, color=color, alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def report(data, out_stem):
    summary = summarize(data["records"])
    data["summary"] = summary
    cfg = data["config"]
    md = markdown(summary)
    title = (f"SmolLM2-135M-Instruct, {cfg['family']}: {summary['problems']} problems x "
             f"N={summary['n']}, T={cfg['temperature']}\n(bands: bootstrap 95% over problems)")
    plot(summary, out_stem.with_suffix(".png"), title)
    out_stem.with_suffix(".md").write_text(md)
    print(md)
    for key in ("maj@N direct (self_consistency)", "maj@N via maj_at_k",
                "maj@N per-problem agreement", "self_consistency answers == extract",
                "answered fraction", "truncated fraction", "mean length",
                "problems never solved", "problems always solved"):
        print(f"{key}: {summary[key]}")
    for key, v in summary["paired"].items():
        print(key, " ".join(f"k={k}: {m:+.3f}±{s:.3f}" for k, m, s in
                            zip(summary["ks"], v["mean"], v["se"])))
    t = summary["table"]["maj@k (random ties)"]
    print("maj@k (random ties):", " ".join(f"{m:.3f}" for m in t["mean"]))
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="add1")
    ap.add_argument("--problems", type=int, default=48)
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extract", default="number")
    ap.add_argument("--weights", default=None,
                    choices=["int8", "int8-weight-only", "int8-no-outliers"],
                    help="load(weights='int8'): int8 projections, W8A8 (the default) or "
                         "weight-only (quant.with_mode), models/quantization/quant.py; "
                         "int8-no-outliers: W8A8 without the calibrated outlier channels "
                         "(models/quantization/outliers.py)")
    ap.add_argument("--out", default=str(RESULTS / "accuracy.json"))
    ap.add_argument("--from-json", default=None, help="recompute tables/plot from a saved pool")
    ap.add_argument("--probe", default=None, help="comma-separated families to probe first")
    ap.add_argument("--probe-problems", type=int, default=10)
    ap.add_argument("--probe-n", type=int, default=8)
    ap.add_argument("--probe-task-seed", type=int, default=123)
    ap.add_argument("--probe-only", action="store_true")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out_stem = out.with_suffix("")

    if args.from_json:
        data = json.loads(pathlib.Path(args.from_json).read_text())
        report(data, out_stem)
        return

    import jax

    import jaxsample
    from benchmarks.tasks import make_tasks

    RESULTS.mkdir(exist_ok=True)
    t_all = time.perf_counter()
    lm = jaxsample.load(weights="int8" if args.weights in ("int8", "int8-weight-only") else None)
    if args.weights == "int8-weight-only":
        import dataclasses

        from jaxsample.models.quantization import quant

        lm = dataclasses.replace(lm, params=quant.with_mode(lm.params, "weight_only"))
    elif args.weights == "int8-no-outliers":
        from benchmarks.common import int8_without_outliers

        lm = int8_without_outliers(lm)
    if args.probe:
        print(f"Probe: {args.probe_problems} problems x {args.probe_n} samples per family")
        pr = probe(lm, args)
        (out.parent / f"{out_stem.name}_probe.json").write_text(json.dumps({
            "config": {k: getattr(args, k) for k in ("temperature", "top_p", "max_new_tokens",
                                                       "seed", "extract", "probe_problems",
                                                       "probe_n", "probe_task_seed")},
            "families": pr}, indent=1))
        if args.probe_only:
            return
    tasks = make_tasks(args.family, args.problems, seed=args.task_seed)
    print(f"Pool: {args.family}, {len(tasks)} problems x N={args.n}, batch {args.batch}")
    records, seconds = _sample(lm, tasks, args.n, args, args.seed)
    data = {
        "config": {"family": args.family, "problems": args.problems, "task_seed": args.task_seed,
                   "n": args.n, "batch": args.batch, "temperature": args.temperature,
                   "top_p": args.top_p, "max_new_tokens": args.max_new_tokens,
                   "seed": args.seed, "extract": args.extract, "chat": True,
                   "model": lm.name, "dtype": "float32", "weights": args.weights},
        "command": " ".join(["python -m benchmarks.accuracy"] +
                            (argv if argv is not None else sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "platform": {"jax": jax.__version__, "backend": jax.default_backend(),
                     "python": platform.python_version(), "cpus": os.cpu_count()},
        "generate_seconds": round(seconds, 1),
        "records": records,
    }
    data = report(data, out_stem)
    data["total_seconds"] = round(time.perf_counter() - t_all, 1)
    out.write_text(json.dumps(data, indent=None))
    print(f"generate {seconds:.0f} s, total {data['total_seconds']:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
