"""Adaptive self-consistency against fixed-N: accuracy vs decoded tokens and decode time.

For each task family (benchmarks/tasks.py, chat prompts, integer answers graded
by exact match of the extracted number):

1. a fixed pool of `--max-n` branches per problem (`generate`, with the top-20
   logprobs for DeepConf), whose decode wall time is fixed maj@max_n's;
2. fixed-N self-consistency for N = 1, 2, 4, ..., max_n (exact expected maj@N
   over N-subsets of the pool, `estimators.maj_at_k`), best-of-N by mean
   logprob (`estimators.best_of_k`) and pass@1, with tokens = N x the mean
   branch length; decode wall time measured for N in `--time-n`;
3. the online adaptive runs (`adaptive_self_consistency`: ESC, Beta,
   DeepConf-low, DeepConf-high; Dirichlet offline only) with their measured
   decoded tokens and decode wall time, and the offline rule replayed on the
   pool (`stopping.replay`): online and offline must agree but for float ties.

Branch keys depend on (seed, prompt index, branch index) only, so every run
of a problem shares the pool's branches. Standard errors are across problems.

    python -m benchmarks.adaptive                       # run, write results
    python -m benchmarks.adaptive --from-json benchmarks/results/adaptive_pool_issue21.json   # report only

Outputs: benchmarks/results/adaptive.json, adaptive.md, adaptive.png.
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

ONLINE = [("esc", "esc", None), ("beta", "beta", None),
          ("deepconf-low", "beta", "deepconf-low"), ("deepconf-high", "beta", "deepconf-high")]
OFFLINE_ONLY = [("dirichlet", "dirichlet", None)]


_se = functools.partial(se, fewer=0.0)  # 0 for a single problem


def _pool(lm, tasks, args, family_index, first=0):
    """The fixed pool: max_n branches per problem with top-20 logprobs; returns records, seconds."""
    from jaxsample import SamplingParams, generate
    from jaxsample.reduce import adaptive_rules as stopping
    from jaxsample.reduce import answers

    params = SamplingParams(n=args.max_n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed, logprobs=20)
    records, decode_s = [], 0.0
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start:start + args.batch]
        offset = family_index * 10_000 + first + start
        gen = generate(lm, [t.prompt for t in chunk], params, chat=True, prompt_index_offset=offset)
        decode_s += gen.timings["decode"]
        mlp = gen.mean_logprob()
        for b, task in enumerate(chunk):
            L = gen.lengths[b]
            conf = [stopping.token_confidence(gen.top_logprobs[b, n, :L[n]]) for n in range(args.max_n)]
            ans = [answers.extract(t, "number") for t in gen.texts[b]]
            records.append({
                "question": task.question, "reference": task.answer, "offset": offset + b,
                "answers": ans, "correct": [a == task.answer for a in ans],
                "mean_logprob": [float(x) for x in mlp[b]],
                "lengths": [int(x) for x in gen.bill.decoded_tokens_per_branch[b]],
                "token_conf": [c.round(5).tolist() for c in conf]})
    return records, decode_s


def _timed_fixed(lm, tasks, args, family_index, n, first=0):
    """Decode wall time and decoded tokens of fixed-N self-consistency (measured)."""
    from jaxsample import SamplingParams, generate

    params = SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    decode_s, tokens, steps = 0.0, 0, 0
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start:start + args.batch]
        gen = generate(lm, [t.prompt for t in chunk], params, chat=True,
                       prompt_index_offset=family_index * 10_000 + first + start)
        decode_s += gen.timings["decode"]
        tokens += gen.bill.decoded_tokens_total
        steps += gen.bill.branch_steps
    return decode_s, tokens, steps


def _online(lm, tasks, args, family_index, rule, confidence, first=0):
    from jaxsample import SamplingParams, adaptive_self_consistency

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    out, decode_s, steps = [], 0.0, 0
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start:start + args.batch]
        res = adaptive_self_consistency(
            lm, [t.prompt for t in chunk], params, max_n=args.max_n, window=args.window,
            rule=rule, threshold=args.threshold, confidence=confidence, warmup=args.warmup,
            group_size=args.group_size, extract="number", chat=True,
            chunk_size=args.chunk_size,
            prompt_index_offset=family_index * 10_000 + first + start)
        decode_s += res.generation.timings["decode"]
        steps += res.generation.bill.branch_steps
        for b, task in enumerate(chunk):
            out.append({"winner": res.winner[b], "correct": res.winner[b] == task.answer,
                        "n_used": int(res.n_used[b]), "terminated": int(res.terminated[b]),
                        "decoded_tokens": int(sum(res.generation.bill.decoded_tokens_per_branch[b]))})
    return out, decode_s, steps


def _replay(rec, args, rule, confidence):
    from jaxsample.reduce import adaptive_rules as stopping

    weights = term = None
    if confidence:
        conf = [np.asarray(c) for c in rec["token_conf"]]
        weights = [stopping.lowest_group_confidence(c, args.group_size) for c in conf]
        thr = stopping.threshold_from_warmup(weights[:args.warmup], confidence)
        term = [n >= args.warmup and stopping.first_low_group(c, args.group_size, thr) is not None
                for n, c in enumerate(conf)]
    r = stopping.replay(rec["answers"], max_n=args.max_n, window=args.window, rule=rule,
                        threshold=args.threshold, weights=weights, terminated=term,
                        warmup=args.warmup if confidence else 0)
    return r


def analyse(data) -> dict:
    """Per family: fixed-N curves, online and offline rule results, targets."""
    from jaxsample.reduce import estimators

    args = argparse.Namespace(**data["config"])
    out = {}
    for fam, f in data["families"].items():
        recs = f["pool"]
        n = args.max_n
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n]
        mean_len = [np.mean(r["lengths"]) for r in recs]
        fixed = []
        for k in ks:
            maj = [estimators.maj_at_k(r["answers"], r["reference"], k) for r in recs]
            best = [estimators.best_of_k(r["mean_logprob"], r["correct"], k) for r in recs]
            fixed.append({"n": k, "maj": float(np.mean(maj)), "maj_se": _se(maj),
                          "best": float(np.mean(best)), "best_se": _se(best),
                          "tokens": float(k * np.sum(mean_len))})
        pass1 = [np.mean(r["correct"]) for r in recs]
        rules = {}
        for name, rule, conf in ONLINE + OFFLINE_ONLY:
            reps = [_replay(r, args, rule, conf) for r in recs]
            acc = [float(rp.winner == r["reference"]) for rp, r in zip(reps, recs)]
            tokens = [sum(r["lengths"][:rp.n_used]) for rp, r in zip(reps, recs)]
            entry = {"offline_acc": float(np.mean(acc)), "offline_se": _se(acc),
                     "offline_tokens": float(np.sum(tokens)),
                     "offline_n_used": float(np.mean([rp.n_used for rp in reps]))}
            if name in f.get("online", {}):
                on = f["online"][name]
                acc_on = [float(o["correct"]) for o in on["problems"]]
                agree = sum(o["n_used"] == rp.n_used and o["winner"] == rp.winner
                            for o, rp in zip(on["problems"], reps))
                entry.update({"acc": float(np.mean(acc_on)), "se": _se(acc_on),
                              "tokens": float(sum(o["decoded_tokens"] for o in on["problems"])),
                              "n_used": float(np.mean([o["n_used"] for o in on["problems"]])),
                              "terminated": float(np.mean([o["terminated"] for o in on["problems"]])),
                              "decode_s": on["decode_s"], "agree_with_offline": int(agree),
                              "branch_steps": on.get("branch_steps"),
                              "problems": len(on["problems"])})
            rules[name] = entry
        full = fixed[-1]
        # maj@max_n's decode time: its own run without logprobs when --time-n holds
        # max_n (the online ESC / Beta runs keep none either), else the pool's.
        timed = {str(k): v for k, v in f.get("timed", {}).items()}
        fixed_s = timed.get(str(n), f["pool_decode_s"])
        base_steps = f.get("timed_counts", {}).get(str(n), {}).get("branch_steps")
        targets = {}
        for name, e in rules.items():
            if "acc" not in e:
                continue
            t = targets[name] = {
                "acc_within_1se": e["acc"] >= full["maj"] - full["maj_se"],
                "token_ratio": e["tokens"] / full["tokens"] if full["tokens"] else math.nan,
                "time_ratio": e["decode_s"] / fixed_s if fixed_s else math.nan,
                "slot_steps_ratio": (e["branch_steps"] / base_steps
                                     if e.get("branch_steps") and base_steps else None)}
            # Issue 21: a rule's token saving becomes time (decode time within 0.1 of tokens).
            t["time_minus_tokens"] = t["time_ratio"] - t["token_ratio"]
        out[fam] = {"problems": len(recs), "pass1": float(np.mean(pass1)), "pass1_se": _se(pass1),
                    "fixed": fixed, "rules": rules, "targets": targets,
                    "fixed_decode_s": {str(k): v for k, v in f.get("timed", {}).items()},
                    "pool_decode_s": f["pool_decode_s"], "max_decode_s": fixed_s,
                    "max_decode_source": ("maj@%d without logprobs" % n if str(n) in timed
                                          else "the pool (top-20 logprobs)")}
    return out


def markdown(summary, config) -> str:
    lines = []
    for fam, s in summary.items():
        n = config["max_n"]
        lines += [f"### {fam} ({s['problems']} problems, pass@1 {s['pass1']:.3f} ± {s['pass1_se']:.3f})",
                  "", "| method | accuracy ± SE | decoded tokens | vs maj@%d | decode s | vs maj@%d | branches/problem |" % (n, n),
                  "|---|---|---|---|---|---|---|"]
        full = s["fixed"][-1]
        for row in s["fixed"]:
            t = s["fixed_decode_s"].get(str(row["n"]))
            if row["n"] == n:
                t = s["max_decode_s"]
            ts = "-" if t is None else f"{t:.1f}"
            tr = "-" if t is None else f"{t / s['max_decode_s']:.2f}"
            lines.append(f"| maj@{row['n']} | {row['maj']:.3f} ± {row['maj_se']:.3f} | "
                         f"{row['tokens']:.0f} | {row['tokens'] / full['tokens']:.2f} | {ts} | {tr} | {row['n']} |")
        for row in s["fixed"]:
            if row["n"] in (4, 16, n):
                lines.append(f"| best-of-{row['n']} (mean logprob) | {row['best']:.3f} ± {row['best_se']:.3f} | "
                             f"{row['tokens']:.0f} | {row['tokens'] / full['tokens']:.2f} | - | - | {row['n']} |")
        for name, e in s["rules"].items():
            if "acc" in e:
                lines.append(f"| {name} (online) | {e['acc']:.3f} ± {e['se']:.3f} | {e['tokens']:.0f} | "
                             f"{e['tokens'] / full['tokens']:.2f} | {e['decode_s']:.1f} | "
                             f"{e['decode_s'] / s['max_decode_s']:.2f} | {e['n_used']:.1f} "
                             f"(terminated {e['terminated']:.1f}; online = offline on "
                             f"{e['agree_with_offline']}/{e['problems']}) |")
            else:
                lines.append(f"| {name} (offline on the pool) | {e['offline_acc']:.3f} ± {e['offline_se']:.3f} | "
                             f"{e['offline_tokens']:.0f} | {e['offline_tokens'] / full['tokens']:.2f} | - | - | "
                             f"{e['offline_n_used']:.1f} |")
        lines += ["", f"Decode time of maj@{n}: {s['max_decode_s']:.1f} s "
                  f"({s['max_decode_source']}). Issue 21's check, a rule's token saving "
                  "becoming time:", "",
                  "| rule | tokens vs maj | slot-steps vs maj | decode time vs maj | "
                  "time - tokens | within 0.1 |", "|---|---|---|---|---|---|"]
        for name, t in s["targets"].items():
            ss = "-" if t.get("slot_steps_ratio") is None else f"{t['slot_steps_ratio']:.2f}"
            gap = t["time_ratio"] - t["token_ratio"]
            lines.append(f"| {name} | {t['token_ratio']:.2f} | {ss} | {t['time_ratio']:.2f} | "
                         f"{gap:+.2f} | {'yes' if abs(gap) <= 0.1 else 'no'} |")
        lines.append("")
        for name, t in s["targets"].items():
            ok = t["acc_within_1se"] and t["token_ratio"] <= 0.4 and t["time_ratio"] <= 0.5
            lines.append(f"- {name}: accuracy within 1 SE of maj@{n}: {t['acc_within_1se']}; "
                         f"tokens {t['token_ratio']:.2f}x (target <= 0.40); decode time "
                         f"{t['time_ratio']:.2f}x (target <= 0.50): **{'met' if ok else 'missed'}**")
        lines.append("")
    return "\n".join(lines)


def plot(summary, config, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(summary)
    colors = {"esc": "tab:green", "beta": "tab:red", "deepconf-low": "tab:purple",
              "deepconf-high": "tab:brown", "dirichlet": "tab:pink"}
    fig, axes = plt.subplots(2, len(fams), figsize=(6 * len(fams), 8), squeeze=False)
    for j, fam in enumerate(fams):
        s = summary[fam]
        full_tokens = s["fixed"][-1]["tokens"]
        ax = axes[0, j]
        xs = [r["tokens"] for r in s["fixed"]]
        ax.errorbar(xs, [r["maj"] for r in s["fixed"]], yerr=[r["maj_se"] for r in s["fixed"]],
                    marker="o", label="fixed-N maj@N")
        ax.errorbar(xs, [r["best"] for r in s["fixed"]], yerr=[r["best_se"] for r in s["fixed"]],
                    marker="s", label="best-of-N (mean logprob)", alpha=0.7)
        for name, e in s["rules"].items():
            if "acc" in e:
                ax.errorbar([e["tokens"]], [e["acc"]], yerr=[e["se"]], marker="*", markersize=12,
                            linestyle="none", label=name, color=colors[name])
        ax.set_xscale("log")
        ax.set_xlabel("decoded tokens (all problems)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{fam}: accuracy vs decoded tokens")
        ax.axvline(0.4 * full_tokens, color="grey", linestyle=":", label="40% of maj@max tokens")
        ax.legend(fontsize=7)
        ax = axes[1, j]
        pts = sorted((int(k), v) for k, v in s["fixed_decode_s"].items())
        pts = [(k, v) for k, v in pts if k != config["max_n"]] + [(config["max_n"],
                                                                   s["max_decode_s"])]
        accs = {r["n"]: r["maj"] for r in s["fixed"]}
        ax.plot([t for _, t in pts], [accs[k] for k, _ in pts], marker="o", label="fixed-N maj@N (measured)")
        for name, e in s["rules"].items():
            if "acc" in e:
                ax.errorbar([e["decode_s"]], [e["acc"]], yerr=[e["se"]], marker="*", markersize=12,
                            linestyle="none", label=name, color=colors[name])
        ax.axvline(0.5 * s["max_decode_s"], color="grey", linestyle=":", label="50% of maj@max time")
        ax.set_xlabel("decode wall time (s, all problems)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{fam}: accuracy vs decode time")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default="add1,add2")
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--task-seed", type=int, default=0)
    ap.add_argument("--max-n", type=int, default=64)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-n", default="8,16",
                    help="fixed N whose decode time is measured (without logprobs; with "
                         "max_n among them, maj@max_n's time is that run's, not the pool's)")
    ap.add_argument("--chunk-size", type=int, default=8,
                    help="adaptive_self_consistency's chunk_size (decode steps between checks)")
    ap.add_argument("--from-json", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "adaptive")
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        import jax

        import jaxsample
        from benchmarks.tasks import make_tasks

        lm = jaxsample.load()
        data = {"config": {k: v for k, v in vars(args).items() if k not in ("from_json", "out")},
                "machine": {"platform": platform.platform(), "python": platform.python_version(),
                            "jax": jax.__version__, "devices": str(jax.devices()),
                            "date": datetime.date.today().isoformat()},
                "families": {}}
        t_all = time.perf_counter()
        for fi, fam in enumerate(args.families.split(",")):
            tasks = make_tasks(fam, args.problems, args.task_seed)
            f = {"pool": [], "pool_decode_s": 0.0, "timed": {}, "online": {}}
            # Batch by batch, every method on the same problems one after the other, so
            # the decode times compared were measured under the same machine load.
            for start in range(0, len(tasks), args.batch):
                part = tasks[start:start + args.batch]
                sub = argparse.Namespace(**{**vars(args), "batch": len(part)})
                offset_fi = fi  # prompt_index_offset = family * 10000 + problem index
                pool, s = _pool(lm, part, sub, offset_fi, start)
                f["pool"] += pool
                f["pool_decode_s"] += s
                for n in [int(x) for x in args.time_n.split(",") if x]:
                    s, tok, steps = _timed_fixed(lm, part, sub, offset_fi, n, start)
                    f["timed"][n] = f["timed"].get(n, 0.0) + s
                    t = f.setdefault("timed_counts", {}).setdefault(
                        str(n), {"tokens": 0, "branch_steps": 0})
                    t["tokens"] += tok
                    t["branch_steps"] += steps
                for name, rule, conf in ONLINE:
                    probs, s, steps = _online(lm, part, sub, offset_fi, rule, conf, start)
                    on = f["online"].setdefault(name, {"problems": [], "decode_s": 0.0,
                                                       "branch_steps": 0})
                    on["problems"] += probs
                    on["decode_s"] += s
                    on["branch_steps"] += steps
                print(f"{fam} {start + len(part)}/{len(tasks)}: pool {f['pool_decode_s']:.1f} s; "
                      + "; ".join(f"{k} {v['decode_s']:.1f} s" for k, v in f["online"].items()),
                      flush=True)
                data["families"][fam] = f  # partial results survive an interrupted run
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.with_suffix(".json").write_text(json.dumps(data))
        data["wall_s"] = time.perf_counter() - t_all
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(data))
    summary = analyse(data)
    md = markdown(summary, data["config"])
    args.out.with_suffix(".md").write_text(md)
    plot(summary, data["config"], args.out.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
