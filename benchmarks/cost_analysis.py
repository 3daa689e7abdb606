"""XLA's cost analysis of the compiled decode step: shared, naive and ideal bytes.

For each (P, N): `jaxsample.engine.step_cost.decode_step_cost` compiles one decode
step (the loop body, state donated; see its module docstring for how XLA
counts conditionals and loops) of the shared-prefix engine and of the naive
engine (N prefix copies) for the model's config, with abstract inputs (no
weights are read, nothing runs), and reports `cost_analysis()` bytes
accessed and FLOPs beside the ideal (weights + prefix once + N tails + N
rows of logits). Runs on any CPU in seconds per cell.

Usage:

    python -m benchmarks.cost_analysis --prompt-lengths 2048 --branches 16 \
        --new-tokens 64 [--json out.jsonl]

`benchmarks/decode.py --cost-analysis` runs it on the grid of its own run and
prints the same table after its own.
"""

from __future__ import annotations

import argparse
import json


def rows(model: str, Ps, Ns, T: int) -> list[dict]:
    """One dict per (P, N): shared and naive `StepCost`s and their ratios."""
    from jaxsample.engine import step_cost

    if model == "smollm2":
        from jaxsample.loading import read_config

        cfg = read_config()
    else:
        raise ValueError(f"unknown model {model!r} (cost analysis knows smollm2)")
    out = []
    for P in Ps:
        for N in Ns:
            sh = step_cost.decode_step_cost(cfg, P, N, T)
            nv = step_cost.decode_step_cost(cfg, P, N, T, naive=True)
            out.append(dict(kind="cost_analysis", model=model, P=P, N=N, T=T,
                            shared_bytes=sh.bytes_accessed, naive_bytes=nv.bytes_accessed,
                            ideal_bytes=sh.ideal_bytes, weight_bytes=sh.weight_bytes,
                            prefix_bytes=sh.prefix_bytes, tail_bytes=sh.tail_bytes,
                            logits_bytes=sh.logits_bytes, shared_flops=sh.flops,
                            naive_flops=nv.flops, shared_over_ideal=sh.ratio_to_ideal,
                            naive_over_ideal=nv.ratio_to_ideal,
                            naive_over_shared=nv.bytes_accessed / sh.bytes_accessed))
    return out


def table(rs) -> str:
    lines = ["| P | N | shared GB | naive GB | ideal GB (weights + prefix + tails + logits) "
             "| shared / ideal | naive / ideal | naive / shared | GFLOP |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        parts = " + ".join(f"{r[k] / 1e9:.3f}" for k in ("weight_bytes", "prefix_bytes",
                                                         "tail_bytes", "logits_bytes"))
        lines.append(f"| {r['P']} | {r['N']} | {r['shared_bytes'] / 1e9:.3f} | "
                     f"{r['naive_bytes'] / 1e9:.3f} | {r['ideal_bytes'] / 1e9:.3f} ({parts}) | "
                     f"{r['shared_over_ideal']:.2f} | {r['naive_over_ideal']:.2f} | "
                     f"{r['naive_over_shared']:.2f} | {r['shared_flops'] / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-lengths", default="2048")
    ap.add_argument("--branches", default="16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="append one JSON line per cell here")
    a = ap.parse_args(argv)
    rs = rows(a.model, [int(x) for x in a.prompt_lengths.split(",")],
              [int(x) for x in a.branches.split(",")], a.new_tokens)
    print(table(rs))
    if a.json:
        with open(a.json, "a") as fh:
            for r in rs:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
