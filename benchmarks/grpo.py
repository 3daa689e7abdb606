"""GRPO with LoRA on the embedded SmolLM2 (add1), and group rollouts with a shared prefix
against the prompt repeated G times.

Training (`jaxsample.training.grpo`): add1's 81 problems (`benchmarks/tasks.py`,
"What is a + b? Answer with just the number.", chat prompts) are split once,
deterministically: `--eval-problems` (64) held out, the rest (17) trained on.
Each step draws `--prompts-per-step` training problems, samples
`--group-size` branches of each (one shared prefix per problem) at
`--temperature`, rewards 1 when the last number of the answer is right
(`jaxsample.reduce.answers`), and takes one optimizer step of the clipped
policy-gradient loss on LoRA adapters (rank `--rank` on every projection).
Held-out pass@1 is measured before and after with `--eval-samples` branches
per problem at the training temperature and the same seed (paired), with
standard errors over problems; the run stops after `--steps` steps or
`--minutes` of training. The JSON (`--out`) is rewritten after every step;
the reward curve goes to a PNG beside it.

Rollout comparison: one prompt of P = `--compare-prompt` (1024) tokens, G =
`--compare-group` (16) branches of 32 tokens (`ignore_eos`), end to end with
`jaxsample.generate` (shared prefix) and `engine.naive.naive_generate` (the
prompt copied G times, as a sampler without prefix sharing does); the first
call (compiles) and a second one.

CPU (about 30 minutes on 2 cores, nothing else running):
    python -m benchmarks.grpo
Smoke test (the tiny random model, 2 steps, about 2 minutes):
    python -m benchmarks.grpo --tiny --out /tmp/grpo_tiny.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

import numpy as np

from benchmarks.common import environment, md_table, prompt_ids, se
from benchmarks.tasks import make_tasks


def grade(text: str, answer: str) -> float:
    """1.0 when the last number in `text` is the answer."""
    from jaxsample.reduce import answers

    got = answers.extract(text, "number")
    return float(got is not None and got == answers.normalize(answer))


def split_tasks(n_eval: int):
    """(train, held-out): all of add1's problems, shuffled once with a fixed seed."""
    tasks = make_tasks("add1", 81, seed=0)
    random.Random(20261204).shuffle(tasks)
    if not 0 < n_eval < len(tasks):
        raise SystemExit(f"--eval-problems must be in [1, {len(tasks) - 1}], got {n_eval}")
    return tasks[n_eval:], tasks[:n_eval]


def evaluate(lm, params, tasks, args) -> dict:
    """Held-out pass@1: `eval_samples` branches per problem; mean, SE over problems."""
    import jaxsample

    t0 = time.perf_counter()
    gen = jaxsample.generate(dataclasses.replace(lm, params=params), [t.prompt for t in tasks],
                             jaxsample.SamplingParams(n=args.eval_samples,
                                                      temperature=args.temperature,
                                                      max_tokens=args.max_tokens,
                                                      seed=args.seed + 99),
                             chat=True)
    per = np.asarray([[grade(x, t.answer) for x in row] for row, t in zip(gen.texts, tasks)])
    return {"pass@1": float(per.mean()), "se": se(per.mean(1)), "per_problem": per.mean(1).tolist(),
            "mean_tokens": float(gen.lengths.mean()), "seconds": time.perf_counter() - t0,
            "example": gen.texts[0][0]}


def rollout_compare(lm, args) -> list[dict]:
    """End-to-end seconds of G branches of one P-token prompt: shared prefix vs naive."""
    import jaxsample
    from jaxsample.engine.naive import naive_generate

    ids = prompt_ids(0, args.compare_prompt, lm.vocab_limit)
    sp = jaxsample.SamplingParams(n=args.compare_group, max_tokens=32, ignore_eos=True, seed=0)
    rows = []
    for naive in (False, True):
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            g = (naive_generate if naive else jaxsample.generate)(lm, [ids], sp)
            times.append(time.perf_counter() - t0)
        rows.append({"engine": "naive (prompt repeated G times)" if naive else "shared prefix",
                     "P": len(ids), "G": args.compare_group, "T": int(g.lengths.max()),
                     "first_s": times[0], "second_s": times[1], "timings": g.timings})
    for r in rows:
        r["naive_over_shared_second"] = rows[1]["second_s"] / rows[0]["second_s"]
        r["naive_over_shared_first"] = rows[1]["first_s"] / rows[0]["first_s"]
    return rows


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    steps = [h["step"] for h in hist]
    reward = np.asarray([h["reward"] for h in hist])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, ".", alpha=0.5, label="batch mean reward (training problems)")
    if len(reward) >= 5:
        ax.plot(steps[4:], np.convolve(reward, np.ones(5) / 5, "valid"), "-",
                label="its mean over 5 steps")
    for key, style in (("before", "--"), ("after", "-")):
        ev = report.get(key)
        if ev:
            ax.axhline(ev["pass@1"], ls=style, color="k", lw=1,
                       label=f"held-out pass@1 {key}: {ev['pass@1']:.3f} ± {ev['se']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / pass@1")
    ax.set_ylim(0, 1)
    ax.set_title(report["title"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(report: dict) -> list[str]:
    """The markdown lines of the results page."""
    lines = []
    b, a = report.get("before"), report.get("after")
    if b and a:
        d = np.asarray(a["per_problem"]) - np.asarray(b["per_problem"])
        lines += md_table(["held-out pass@1", "before", "after", "after - before (paired)"],
                          [[f"{len(d)} problems x {report['args']['eval_samples']}",
                            f"{b['pass@1']:.3f} ± {b['se']:.3f}",
                            f"{a['pass@1']:.3f} ± {a['se']:.3f}",
                            f"{d.mean():+.3f} ± {se(d):.3f}"]])
    hist = report["history"][1:] or report["history"]
    if hist:
        med = {k: float(np.median([h[k] for h in hist])) for k in
               ("seconds", "rollout_s", "logprobs_s", "update_s")}
        lines += [""] + md_table(["seconds per step (median)", "rollout", "log-probabilities",
                                  "update", "total"],
                                 [[f"{len(hist)} steps", f"{med['rollout_s']:.1f}",
                                   f"{med['logprobs_s']:.1f}", f"{med['update_s']:.1f}",
                                   f"{med['seconds']:.1f}"]])
    if report.get("rollout_compare"):
        lines += [""] + md_table(["rollouts", "P", "G", "first call s", "second call s"],
                                 [[r["engine"], r["P"], r["G"], f"{r['first_s']:.1f}",
                                   f"{r['second_s']:.1f}"] for r in report["rollout_compare"]])
        r = report["rollout_compare"][0]
        lines.append(f"\nnaive / shared: {r['naive_over_shared_second']:.2f}x (second call), "
                     f"{r['naive_over_shared_first']:.2f}x (first call)")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random model, smoke sizes")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=25.0, help="training time budget")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--eval-problems", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--compare-prompt", type=int, default=1024)
    p.add_argument("--compare-group", type=int, default=16)
    p.add_argument("--skip", choices=["compare", "train"], action="append", default=[])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/grpo.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.eval_problems, args.eval_samples = min(args.steps, 2), 8, 2
        args.compare_prompt, args.compare_group, args.max_tokens = 64, 4, 12


    import jaxsample
    from jaxsample.training import grpo, lora

    jaxsample.enable_compilation_cache()
    if args.tiny:
        from jaxsample.tiny import make_tiny_lm

        lm = make_tiny_lm()
    else:
        lm = jaxsample.load()
    train_tasks, eval_tasks = split_tasks(args.eval_problems)
    report = {"title": f"GRPO + LoRA r{args.rank} on {lm.name}, add1", "args": vars(args),
              "env": environment(), "train_problems": len(train_tasks), "history": []}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    png = os.path.splitext(args.out)[0] + "_reward.png"

    def write():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.out)

    if "compare" not in args.skip:
        report["rollout_compare"] = rollout_compare(lm, args)
        write()
        print("\n".join(summary({**report, "history": []})), flush=True)
    if "train" not in args.skip:
        cfg = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
        # Rollouts through the engine object: each step hands it the merged weights.
        policy = grpo.lora_policy(jaxsample.LLM(lm, compilation_cache=False), cfg,
                                  seed=args.seed)
        config = grpo.GRPOConfig(steps=args.steps, prompts_per_step=args.prompts_per_step,
                                 group_size=args.group_size, max_tokens=args.max_tokens,
                                 temperature=args.temperature, chat=True,
                                 learning_rate=args.lr, kl_coef=args.kl_coef, seed=args.seed)
        report["trained_params"] = lora.num_params(policy.params)
        report["before"] = evaluate(lm, lora.merge(lm.params, policy.params, cfg), eval_tasks,
                                    args)
        print("before:", {k: v for k, v in report["before"].items() if k != "per_problem"},
              flush=True)
        write()
        t_start = time.perf_counter()

        def on_step(rec, state):
            report["history"].append(rec)
            write()
            return time.perf_counter() - t_start > 60 * args.minutes

        params, _, _ = grpo.train(policy, train_tasks, config,
                                  reward=lambda task, text: grade(text, task.answer),
                                  on_step=on_step)
        report["train_seconds"] = time.perf_counter() - t_start
        report["after"] = evaluate(lm, lora.merge(lm.params, params, cfg), eval_tasks, args)
        print("after:", {k: v for k, v in report["after"].items() if k != "per_problem"},
              flush=True)
        write()
        plot(report, png)
    print("\n".join(summary(report)))
    print(f"wrote {args.out}" + (f" and {png}" if report["history"] else ""))


if __name__ == "__main__":
    main()
