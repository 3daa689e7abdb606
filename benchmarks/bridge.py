"""Does a Bridge help? RL-train cross-branch layers, then compare at widths 1, 2, 4, 8.

Conditions (arXiv 2510.01143, its control included):
  base     the base model, independent branches (no Bridge);
  bridge   base + Bridge (cross-branch attention) trained with GRPO-style RL;
  control  the same block and parameter count with attention restricted to
           the branch itself (`BridgeConfig(cross_branch=False)`), same training.

Problems: jaxsample/bridge_training/tasks.py (one-step arithmetic word problems, a
two-example few-shot prompt, the answer line ends at a newline = stop token).
Metrics on held-out problems at each width N: mean per-branch accuracy,
majority vote (maj@N, ties -> the earliest branch's answer) and pass@N (any
branch correct), with binomial standard errors over problems, and the paired
difference against the base model.

CPU (about 30 minutes on 2 loaded cores, SmolLM2-135M embedded):
    python -m benchmarks.bridge
The first (failed) CPU run: python -m benchmarks.bridge --preset cpu-v1
GPU, longer: see benchmarks/bridge_gpu.sh (`--preset gpu`).
Smoke test on the tiny random model: python -m benchmarks.bridge --tiny --steps 2
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import se
from jaxsample import (
    SamplingParams,
    engine,
)
from jaxsample import bridge as bridge_lib  # noqa: E402
from jaxsample.bridge_training import grpo as bridge_grpo  # noqa: E402
from jaxsample.bridge_training.tasks import make_problems  # noqa: E402
from jaxsample.reduce import answers  # noqa: E402

# cpu: the settings of the reported CPU run (docs/benchmarks.md, Bridge).
# cpu-v1: the first CPU run, which collapsed both trained models to ~0 accuracy
# (lr 1e-3 and Adam's momentum on zero-signal steps wrecked the answer format:
# the models stopped emitting the newline and ran into the 12-token limit).
# Kept to reproduce that failure.
PRESETS = {
    "cpu": dict(train_problems=64, test_problems=48, steps=24, groups=4, n=4, widths="1,2,4,8",
                lr=3e-5, max_new_tokens=16, temperature=0.7, sft_steps=0, skip_no_signal=True),
    "cpu-v1": dict(train_problems=64, test_problems=48, steps=24, groups=2, n=4,
                   widths="1,2,4,8", lr=1e-3, max_new_tokens=12, temperature=0.7, sft_steps=0,
                   skip_no_signal=False),
    "gpu": dict(train_problems=512, test_problems=400, steps=400, groups=16, n=8,
                widths="1,2,4,8,16", lr=3e-5, max_new_tokens=16, temperature=0.7, sft_steps=0,
                skip_no_signal=True),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--train-problems", type=int)
    ap.add_argument("--test-problems", type=int)
    ap.add_argument("--steps", type=int, help="RL steps (each: groups problems x n branches)")
    ap.add_argument("--groups", type=int)
    ap.add_argument("--n", type=int, help="branches per problem during training")
    ap.add_argument("--widths", help="comma-separated evaluation widths")
    ap.add_argument("--sft-steps", type=int, help="warm-up steps on correct samples")
    ap.add_argument("--bridge-dim", type=int, default=64)
    ap.add_argument("--bridge-heads", type=int, default=2)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--skip-no-signal", action=argparse.BooleanOptionalAction, default=None,
                    help="leave params and Adam state untouched on steps with no reward "
                         "variance in any group (default on; off in --preset cpu-v1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model name or path (default: embedded)")
    ap.add_argument("--tiny", action="store_true", help="tiny random model (smoke test only)")
    ap.add_argument("--ckpt-dir", default=None,
                    help="default: /tmp/jaxsample_bridge_ckpt/<hash of the training settings>, "
                         "so a run never resumes another run's checkpoints")
    ap.add_argument("--out", default="benchmarks/results/bridge.json")
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.widths = [int(w) for w in str(args.widths).split(",")]
    if args.ckpt_dir is None:
        keys = ("train_problems", "steps", "groups", "n", "sft_steps", "bridge_dim",
                "bridge_heads", "lr", "temperature", "max_new_tokens", "seed", "model", "tiny",
                "skip_no_signal")
        h = hashlib.sha256(json.dumps({k: getattr(args, k) for k in keys}).encode()).hexdigest()
        args.ckpt_dir = f"/tmp/jaxsample_bridge_ckpt/{h[:12]}"
    return args


def load_model(args):
    if args.tiny:
        from jaxsample.tiny import make_tiny_lm

        return make_tiny_lm()
    from jaxsample.loading import load

    return load(args.model)


def score(lm, bridge, problems, n, seed, args, stop_ids):
    """Per-problem metrics at width n: rewards [B, n], maj [B], pass [B]."""
    gen = engine.generate(lm, [p.prompt for p in problems],
                          SamplingParams(n=n, temperature=args.temperature,
                                         max_new_tokens=args.max_new_tokens, seed=seed,
                                         stop_token_ids=stop_ids), bridge=bridge)
    rewards = np.array([[bridge_grpo.reward(t, p.answer) for t in row]
                        for row, p in zip(gen.texts, problems)], np.float32)
    maj = []
    for row, p in zip(gen.texts, problems):
        got = [answers.extract(t, "number") for t in row]
        got = [g for g in got if g is not None]
        winner = collections.Counter(got).most_common(1)[0][0] if got else None
        maj.append(float(winner is not None and winner == answers.normalize(p.answer)))
    return rewards, np.array(maj), rewards.max(1), gen


def truncated(gen):
    """Fraction of branches cut by max_new_tokens (no stop token reached)."""
    return float(np.mean([[r == "length" for r in row] for row in gen.finish_reason]))


def main(argv=None):
    args = parse_args(argv)
    t_all = time.perf_counter()
    lm = load_model(args)
    stop_ids = tuple(lm.tokenizer.encode("\n"))[:1]
    train_set = make_problems("train", args.train_problems)
    test_set = make_problems("test", args.test_problems)
    key = jax.random.key(args.seed)
    configs = {
        "bridge": bridge_lib.BridgeConfig(dim=args.bridge_dim, n_heads=args.bridge_heads),
        "control": bridge_lib.BridgeConfig(dim=args.bridge_dim, n_heads=args.bridge_heads,
                                           cross_branch=False),
    }
    report = {"args": {k: v for k, v in vars(args).items()}, "model": lm.name,
              "backend": jax.default_backend(), "train": {}, "eval": {}}
    trained = {"base": None}
    for name, bcfg in configs.items():
        b0 = bridge_lib.init(lm, bcfg, key)  # same init for both: only the attention differs
        count = bridge_lib.param_count(b0)
        frac = bridge_lib.param_fraction(b0, lm.params)
        print(f"[{name}] new parameters: {count:,} ({100 * frac:.2f}% of {lm.name})", flush=True)
        t0 = time.perf_counter()
        trained_b, state, hist = bridge_grpo.train(
            lm, b0, train_set, steps=args.steps, n=args.n, groups=args.groups,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            learning_rate=args.lr, seed=args.seed, sft_steps=args.sft_steps,
            ckpt_dir=os.path.join(args.ckpt_dir, name), save_every=max(1, args.steps // 4),
            chat=False, stop_token_ids=stop_ids, skip_no_signal=args.skip_no_signal,
            log=lambda s, name=name: print(f"[{name}] {s}", flush=True))
        trained[name] = trained_b
        report["train"][name] = {"param_count": count, "param_fraction": frac,
                                 "seconds": time.perf_counter() - t0, "history": hist}
    eval_seed = 10_000 + args.seed
    per_problem = {}
    for width in args.widths:
        for name, b in trained.items():
            t0 = time.perf_counter()
            rewards, maj, pas, gen = score(lm, b, test_set, width, eval_seed, args, stop_ids)
            per_problem[(name, width)] = (rewards.mean(1), maj, pas)
            report["eval"][f"{name}@{width}"] = {
                "problems": len(test_set), "width": width,
                "branch_acc": float(rewards.mean()), "branch_acc_se": se(rewards.mean(1)),
                "maj": float(maj.mean()), "maj_se": se(maj),
                "pass": float(pas.mean()), "pass_se": se(pas), "truncated": truncated(gen),
                "seconds": time.perf_counter() - t0}
            if name != "base":
                base_acc, base_maj, _ = per_problem[("base", width)]
                d_acc, d_maj = rewards.mean(1) - base_acc, maj - base_maj
                report["eval"][f"{name}@{width}"].update(
                    d_branch_acc=float(d_acc.mean()), d_branch_acc_se=se(d_acc),
                    d_maj=float(d_maj.mean()), d_maj_se=se(d_maj))
            e = report["eval"][f"{name}@{width}"]
            print(f"[eval] {name:8s} N={width:2d}: branch acc {e['branch_acc']:.3f}"
                  f" ± {e['branch_acc_se']:.3f}, maj {e['maj']:.3f} ± {e['maj_se']:.3f},"
                  f" pass {e['pass']:.3f} ± {e['pass_se']:.3f},"
                  f" truncated {e['truncated']:.2f}", flush=True)
    report["seconds"] = time.perf_counter() - t_all
    print_table(report)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot_rewards(report, out.with_suffix(".png"))
    print(f"wrote {out} ({report['seconds']:.0f} s)")
    return report


def print_table(report):
    print("\n| width | condition | branch acc | maj@N | pass@N | Δ branch acc vs base | Δ maj vs base |")
    print("|---|---|---|---|---|---|---|")
    for key, e in report["eval"].items():
        name = key.split("@")[0]
        d = (f"{e['d_branch_acc']:+.3f} ± {e['d_branch_acc_se']:.3f} | "
             f"{e['d_maj']:+.3f} ± {e['d_maj_se']:.3f}") if "d_maj" in e else "– | –"
        print(f"| {e['width']} | {name} | {e['branch_acc']:.3f} ± {e['branch_acc_se']:.3f} | "
              f"{e['maj']:.3f} ± {e['maj_se']:.3f} | {e['pass']:.3f} ± {e['pass_se']:.3f} | {d} |")
    for name, t in report["train"].items():
        r = [h["reward"] for h in t["history"]]
        k = max(1, len(r) // 4)
        upd = sum(not h.get("skipped", False) for h in t["history"])
        print(f"{name}: train reward first {k} steps {np.mean(r[:k]):.3f}, "
              f"last {k} steps {np.mean(r[-k:]):.3f} ({t['seconds']:.0f} s, "
              f"{upd}/{len(r)} steps with a reward-variance signal)")


def plot_rewards(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    for i, (name, t) in enumerate(report["train"].items()):
        r = np.array([h["reward"] for h in t["history"]])
        k = max(1, min(5, len(r)))
        smooth = np.convolve(r, np.ones(k) / k, mode="valid")
        # Dashed / thicker solid: identical curves (same problems and keys) stay visible.
        ax.plot(np.arange(k, len(r) + 1), smooth, ls=("-", "--", ":")[i % 3], lw=3 - i,
                label=f"{name} (moving avg {k})")
        ax.plot(np.arange(1, len(r) + 1), r, ls="", marker="o", ms=2, alpha=0.5,
                color=ax.lines[-1].get_color())
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward (train)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
