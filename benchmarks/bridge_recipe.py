"""Bridge with the paper's full recipe (SFT warm-up, then GRPO) against its controls, on two tasks.

Dong et al., arXiv 2510.01143. Conditions, trained identically on the same
warm-up groups, the same RL problems and the same rollout keys:

  base      the base model, independent branches (no Bridge);
  bridge    Bridge blocks (cross-branch attention) after every block;
  mlp       the paper's control: an equal-parameter per-token MLP adapter in the
            same places (`BridgeConfig(kind="mlp")`, inner width 2d, the same count);
  nocross   the Bridge block with attention restricted to the branch itself
            (`cross_branch=False`, the same parameters);
  center    (opt-in, `--conditions center,...`) the Bridge with
            `BridgeConfig(center=True)`: q, k and attended values from the
            branches' deviations from the group mean, plus the per-token path;
  bridge_self, center_self (evaluation only) the trained Bridge with
            cross-branch attention masked to self (`jaxsample.bridge.self_only`):
            the ablation.

Tasks:
  coord     jaxsample/bridge_training/coord_tasks.py: name two different listed items,
            different from every other branch; metric = distinct valid answers
            per group, at widths 2, 4, 8 (trained at 4);
  accuracy  jaxsample/bridge_training/tasks.py (one-step arithmetic): per-branch accuracy,
            maj@N, pass@N, consistency (all N correct), at widths 1, 2, 4, 8.

Intervals: standard errors over problems; paired differences (bridge minus each
control on the same problems, same eval seed) with 95 % t intervals.

CPU:  python -m benchmarks.bridge_recipe --task coord        (--preset cpu)
      python -m benchmarks.bridge_recipe --task accuracy
GPU:  benchmarks/bridge_recipe_gpu.sh (--preset gpu, < 10 min on one H200)
Smoke test: python -m benchmarks.bridge_recipe --tiny --preset smoke
Tables of a finished run: python -m benchmarks.bridge_recipe --from-json <report.json>
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import sys
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bridge import load_model  # noqa: E402  (the same model for both scripts)
from benchmarks.common import se
from jaxsample import (
    SamplingParams,
    engine,
)
from jaxsample import bridge as bridge_lib  # noqa: E402
from jaxsample.bridge_training import coord_tasks as bridge_coord_tasks  # noqa: E402
from jaxsample.bridge_training import diagnostics as bridge_diagnostics  # noqa: E402
from jaxsample.bridge_training import grpo as bridge_grpo  # noqa: E402
from jaxsample.bridge_training import sft as bridge_sft  # noqa: E402
from jaxsample.bridge_training import tasks as bridge_tasks  # noqa: E402
from jaxsample.reduce import answers  # noqa: E402

TRAINED = ("bridge", "mlp", "nocross", "center")
ATTENTION = ("bridge", "center")  # conditions with cross-branch attention (paired against the rest)
DEFAULT_CONDITIONS = ("bridge", "mlp", "nocross")
PRESETS = {
    "cpu": dict(train_problems=48, test_problems=40, sft_n=8, sft_group=4, sft_steps=24,
                sft_lr=1e-3, steps=16, groups=4, n=4, lr=3e-4, temperature=0.7,
                max_new_tokens=8),
    "gpu": dict(train_problems=512, test_problems=200, sft_n=8, sft_group=8, sft_steps=60,
                sft_lr=1e-3, steps=60, groups=16, n=4, lr=3e-4, temperature=0.7,
                max_new_tokens=8),
    "smoke": dict(train_problems=4, test_problems=3, sft_n=4, sft_group=4, sft_steps=2,
                  sft_lr=1e-3, steps=2, groups=2, n=4, lr=3e-4, temperature=1.0,
                  max_new_tokens=6),
}
WIDTHS = {"coord": (2, 4, 8), "accuracy": (1, 2, 4, 8)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(WIDTHS), default="coord")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for k, v in PRESETS["cpu"].items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v))
    ap.add_argument("--widths", help="comma-separated evaluation widths")
    ap.add_argument("--conditions", default=",".join(DEFAULT_CONDITIONS),
                    help="trained conditions to run (a probe may train the bridge alone)")
    ap.add_argument("--diagnostics", action=argparse.BooleanOptionalAction, default=True,
                    help="per-layer norms and attention mass before/after training")
    ap.add_argument("--diagnose", default=None,
                    help="comma-separated conditions to diagnose (default: every trained one "
                         "but nocross)")
    ap.add_argument("--bridge-dim", type=int, default=64)
    ap.add_argument("--bridge-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model name or path (default: embedded)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny random model (smoke test only: its warm-up keeps every sample, "
                         "it never writes a valid answer)")
    ap.add_argument("--ckpt-dir", default=None,
                    help="default /tmp/jaxsample_bridge_recipe/<hash of the settings>")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/bridge_coordination.json (coord) or "
                         "bridge_accuracy_recipe.json (accuracy)")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.widths = ([int(w) for w in args.widths.split(",")] if args.widths
                   else list(WIDTHS[args.task]))
    args.conditions = [c for c in args.conditions.split(",") if c]
    if not args.conditions or not set(args.conditions) <= set(TRAINED):
        ap.error(f"--conditions must be a subset of {','.join(TRAINED)}")
    if args.out is None:
        args.out = ("benchmarks/results/bridge_coordination.json" if args.task == "coord"
                    else "benchmarks/results/bridge_accuracy_recipe.json")
    if args.ckpt_dir is None:
        keys = sorted(set(PRESETS["cpu"]) | {"task", "bridge_dim", "bridge_heads", "seed",
                                               "model", "tiny"})  # not conditions: shared
        h = hashlib.sha256(json.dumps({k: getattr(args, k) for k in keys}).encode()).hexdigest()
        args.ckpt_dir = f"/tmp/jaxsample_bridge_recipe/{h[:12]}"
    return args


# ---------------------------------------------------------------------------
# Tasks: rewards for training, per-problem metrics for evaluation


class Coord:
    name = "coord"
    make_problems = staticmethod(bridge_coord_tasks.make_problems)

    @staticmethod
    def group_reward(texts, p):
        return bridge_grpo.distinct_rewards([bridge_coord_tasks.parse(t, p) for t in texts])

    @staticmethod
    def sft_keep(texts, p):
        """The first copy of each distinct valid answer (duplicates add no new group member)."""
        seen, keep = set(), []
        for t in texts:
            a = bridge_coord_tasks.parse(t, p)
            keep.append(a is not None and a not in seen)
            seen.add(a)
        return keep

    @staticmethod
    def metrics(texts, p):
        got = [bridge_coord_tasks.parse(t, p) for t in texts]
        return {"distinct": float(bridge_grpo.distinct_correct(got)),
                "valid": float(np.mean([g is not None for g in got])),
                "reward": float(np.mean(bridge_grpo.distinct_rewards(got)))}


class Accuracy:
    name = "accuracy"
    make_problems = staticmethod(bridge_tasks.make_problems)
    group_reward = None

    @staticmethod
    def sft_keep(texts, p):
        return [bridge_grpo.reward(t, p.answer) > 0 for t in texts]

    @staticmethod
    def metrics(texts, p):
        ok = [bridge_grpo.reward(t, p.answer) for t in texts]
        got = [g for g in (answers.extract(t, "number") for t in texts) if g is not None]
        winner = collections.Counter(got).most_common(1)[0][0] if got else None
        return {"branch_acc": float(np.mean(ok)),
                "maj": float(winner is not None and winner == answers.normalize(p.answer)),
                "pass": float(max(ok)), "consistency": float(min(ok))}


# ---------------------------------------------------------------------------
# Statistics


def t975(dof: int) -> float:
    """The 97.5 % quantile of Student's t (Cornish-Fisher expansion; < 1e-3 off for dof >= 5)."""
    z = 1.959963984540054
    if dof <= 0:
        return float("nan")
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def paired(a, b):
    """Paired difference a - b over problems: mean, SE, 95 % t interval."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    m, s = float(d.mean()), se(d)
    h = t975(len(d) - 1) * s
    return {"mean": m, "se": s, "ci95": [m - h, m + h], "problems": len(d)}


# ---------------------------------------------------------------------------
# Training and evaluation


def bridge_configs(args):
    d, h = args.bridge_dim, args.bridge_heads
    return {"bridge": bridge_lib.BridgeConfig(dim=d, n_heads=h),
            "mlp": bridge_lib.BridgeConfig(dim=d, n_heads=h, kind="mlp"),
            "nocross": bridge_lib.BridgeConfig(dim=d, n_heads=h, cross_branch=False),
            "center": bridge_lib.BridgeConfig(dim=d, n_heads=h, center=True)}


def train_all(lm, task, args, stop_ids, report):
    train_set = task.make_problems("train", args.train_problems)
    log = lambda s: print(s, flush=True)
    t0 = time.perf_counter()
    data_path = os.path.join(args.ckpt_dir, "sft_data.npz")
    if os.path.exists(data_path):
        data = bridge_sft.load_data(data_path)
    else:
        data = bridge_sft.collect(lm, train_set, n=args.sft_n, max_group=args.sft_group,
                                  seed=args.seed + 777, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, chat=False,
                                  stop_token_ids=stop_ids, log=log,
                                  keep_fn=(lambda t, p: [True] * len(t)) if args.tiny
                                  else task.sft_keep)
        os.makedirs(args.ckpt_dir, exist_ok=True)
        bridge_sft.save_data(data_path, data)
    report["sft_data"] = {"problems_drawn": data.drawn, "groups_kept": int(len(data.kept)),
                          "mean_group": float(np.mean(data.kept)),
                          "seconds": time.perf_counter() - t0}
    print(f"[sft data] {report['sft_data']}", flush=True)
    key = jax.random.key(args.seed)
    trained = {}
    for name, bcfg in bridge_configs(args).items():
        if name not in args.conditions:
            continue
        b0 = bridge_lib.init(lm, bcfg, key)  # the same key for every condition
        rec = {"param_count": bridge_lib.param_count(b0),
               "param_fraction": bridge_lib.param_fraction(b0, lm.params)}
        print(f"[{name}] new parameters: {rec['param_count']:,} "
              f"({100 * rec['param_fraction']:.2f}%)", flush=True)
        t0 = time.perf_counter()
        b1, _, h_sft = bridge_sft.train_sft(
            lm, b0, data, steps=args.sft_steps, groups=args.groups, learning_rate=args.sft_lr,
            seed=args.seed, ckpt_dir=os.path.join(args.ckpt_dir, name, "sft"),
            save_every=max(1, args.sft_steps // 2), log=lambda s, n=name: print(f"[{n}] {s}",
                                                                               flush=True))
        b2, _, h_rl = bridge_grpo.train(
            lm, b1, train_set, steps=args.steps, n=args.n, groups=args.groups,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            learning_rate=args.lr, seed=args.seed, ckpt_dir=os.path.join(args.ckpt_dir, name, "rl"),
            save_every=max(1, args.steps // 2), chat=False, stop_token_ids=stop_ids,
            group_reward_fn=task.group_reward,
            log=lambda s, n=name: print(f"[{n}] {s}", flush=True))
        rec.update(seconds=time.perf_counter() - t0, sft_history=h_sft, rl_history=h_rl)
        report["train"][name] = rec
        trained[name] = b2
    return trained


def evaluate(lm, task, bridge, problems, width, seed, args, stop_ids):
    gen = engine.generate(lm, [p.prompt for p in problems],
                          SamplingParams(n=width, temperature=args.temperature, seed=seed,
                                         max_new_tokens=args.max_new_tokens,
                                         stop_token_ids=stop_ids), bridge=bridge)
    per = [task.metrics(row, p) for row, p in zip(gen.texts, problems)]
    trunc = float(np.mean([[r == "length" for r in row] for row in gen.finish_reason]))
    return {k: np.array([m[k] for m in per]) for k in per[0]}, trunc, gen


def diagnostics(lm, bridge_init, bridge_trained, problems, args, stop_ids):
    """Diagnostics on the same width-4 groups (sampled by the trained Bridge) before/after."""
    batch, _, _ = bridge_grpo.rollout(lm, bridge_trained, problems, args.n, 20_000 + args.seed,
                                      args.max_new_tokens, args.temperature, chat=False,
                                      stop_token_ids=stop_ids)
    out = {}
    for label, b in (("before", bridge_init), ("after", bridge_trained)):
        out[label] = bridge_diagnostics.diagnose(lm, b, batch)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--from-json"]:
        print(table(json.loads(pathlib.Path(argv[1]).read_text())))
        return None
    args = parse_args(argv)
    t_all = time.perf_counter()
    task = Coord if args.task == "coord" else Accuracy
    lm = load_model(args)
    stop_ids = tuple(lm.tokenizer.encode("\n"))[:1]
    test_set = task.make_problems("test", args.test_problems)
    report = {"args": dict(vars(args)), "model": lm.name, "backend": jax.default_backend(),
              "train": {}, "eval": {}, "paired": {}, "diagnostics": {},
              "per_problem": {}}
    trained = train_all(lm, task, args, stop_ids, report)
    conds = {"base": None, **trained}
    for a in ATTENTION:
        if a in trained:
            conds[a + "_self"] = bridge_lib.self_only(trained[a])
    eval_seed = 10_000 + args.seed
    per_problem = {}
    for width in args.widths:
        for name, b in conds.items():
            t0 = time.perf_counter()
            m, trunc, _ = evaluate(lm, task, b, test_set, width, eval_seed, args, stop_ids)
            per_problem[(name, width)] = m
            report["per_problem"][f"{name}@{width}"] = {k: v.tolist() for k, v in m.items()}
            e = {"problems": len(test_set), "width": width, "truncated": trunc,
                 "seconds": time.perf_counter() - t0}
            for k, v in m.items():
                e[k], e[k + "_se"] = float(v.mean()), se(v)
            report["eval"][f"{name}@{width}"] = e
            print(f"[eval] {name:11s} N={width}: " + ", ".join(
                f"{k} {e[k]:.3f} ± {e[k + '_se']:.3f}" for k in m), flush=True)
        main_metric = "distinct" if args.task == "coord" else "branch_acc"
        for a in [c for c in ATTENTION if c in conds]:
            others = ["base", "mlp", "nocross"] + (["bridge"] if a == "center" else []) + [a + "_self"]
            for other in [c for c in others if c in conds]:
                report["paired"][f"{a}-{other}@{width}"] = {
                    k: paired(per_problem[(a, width)][k], per_problem[(other, width)][k])
                    for k in per_problem[(a, width)]}
                d = report["paired"][f"{a}-{other}@{width}"][main_metric]
                print(f"[paired] {a} - {other:11s} N={width}: {main_metric} {d['mean']:+.3f} "
                      f"(95% CI {d['ci95'][0]:+.3f} .. {d['ci95'][1]:+.3f})", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))  # the evaluations, in case diagnostics fail
    diag = [c for c in trained if c != "nocross"]  # nocross: self mass 1 by construction
    if args.diagnose is not None:
        diag = [c for c in args.diagnose.split(",") if c in trained]
    for name in diag if args.diagnostics else ():
        b_init = bridge_lib.init(lm, bridge_configs(args)[name], jax.random.key(args.seed))
        report["diagnostics"][name] = diagnostics(lm, b_init, trained[name], test_set, args,
                                                  stop_ids)
    for name, dg in report["diagnostics"].items():
        for label, d in dg.items():
            print(f"[diag] {name} {label}: rel_norm mean {np.mean(d['rel_norm']):.2e} max "
                  f"{np.max(d['rel_norm']):.2e}, self_mass mean {np.mean(d['self_mass']):.3f} "
                  f"(uniform {d['uniform_self_mass']:.3f}), attention TV from uniform mean "
                  f"{np.mean(d.get('tv_from_uniform', [0.0])):.3f} max "
                  f"{np.max(d.get('tv_from_uniform', [0.0])):.3f}, max|W_out| "
                  f"{np.max(d['out_max_abs']):.2e}", flush=True)
    report["seconds"] = time.perf_counter() - t_all
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"), "distinct" if args.task == "coord" else "branch_acc")
    print(table(report))
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    return report


def table(report) -> str:
    """Markdown tables of a report: metrics per condition and width, paired differences."""
    keys = [k[:-3] for k in next(iter(report["eval"].values())) if k.endswith("_se")]
    lines = ["| N | condition | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for k, e in report["eval"].items():
        lines.append(f"| {e['width']} | {k.split('@')[0]} | " + " | ".join(
            f"{e[m]:.3f} ± {e[m + '_se']:.3f}" for m in keys) + " |")
    lines += ["", "| N | difference | " + " | ".join(keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for k, d in report["paired"].items():
        name, n = k.split("@")
        lines.append(f"| {n} | {name} | " + " | ".join(
            f"{d[m]['mean']:+.3f} [{d[m]['ci95'][0]:+.3f}, {d[m]['ci95'][1]:+.3f}]"
            for m in keys) + " |")
    return "\n".join(lines)


def plot(report, path, metric):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    widths = report["args"]["widths"]
    names = [c for c in ("base", "bridge", "mlp", "nocross", "bridge_self", "center", "center_self")
             if f"{c}@{widths[0]}" in report["eval"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(widths))
    w = 0.8 / len(names)
    for i, name in enumerate(names):
        m = [report["eval"][f"{name}@{n}"][metric] for n in widths]
        s = [report["eval"][f"{name}@{n}"][metric + "_se"] for n in widths]
        ax.bar(x + (i - len(names) / 2 + 0.5) * w, m, w, yerr=s, capsize=2, label=name)
    if metric == "distinct":
        ax.plot(x, widths, "k_", ms=20, label="N (all distinct)")
    ax.set_xticks(x, [f"N={n}" for n in widths])
    ax.set_ylabel({"distinct": "distinct valid answers / group",
                   "branch_acc": "per-branch accuracy"}[metric])
    ax.set_title(f"{report['args']['task']}: trained at N={report['args']['n']} "
                 f"({report['eval'][f'base@{widths[0]}']['problems']} problems, ± SE)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
