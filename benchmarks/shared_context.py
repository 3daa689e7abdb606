"""Three-level sharing: B prompts x N branches over one common context (issue 13, item 3).

Usage (from the repository root; CPU, the embedded SmolLM2-135M-Instruct, float32):

    python -m benchmarks.shared_context --repeats 3 \
        --out benchmarks/results/shared_context.json

One request, two ways, side by side in one process:

* `shared`: `generate(lm, suffixes, params, shared_prefix=context_ids)`: the C
  context tokens are prefilled once (KV L x [K, C, D], no prompt or branch
  axis), then each prompt's own suffix once, attending to the context;
* `per_prompt`: `generate(lm, [context_ids + suffix for each prompt], params)`:
  the context prefixed to every prompt (two-level sharing: each prompt's
  branches still share its prefill).

The context is deterministic few-shot text (arithmetic question/answer
pairs) cut to exactly C tokens; the suffixes are questions cut to lengths
spread over [--suffix-min, --suffix-max] tokens. Figures: the prefill time
(`Generation.timings["prefill"]`, execution only: compilation is timed apart
by the engine's AOT programs), median and all repeats, the two modes
alternating within each repeat; the bill of each mode (prompt tokens
prefilled, prefill FLOPs, KV bytes); and how many branches agree token for
token (the two modes compile to different programs, so a float tie may
rarely flip a sampled token: tests/ties.py is the exact check).

Target (issue 13): one context prefill in the bill and >= 3x less prefill
time than prefixing the context to each prompt, at B = 8, N = 8, C = 2000.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def few_shot_ids(tok, n_tokens: int) -> list[int]:
    """Deterministic few-shot arithmetic text, cut to exactly n_tokens ids."""
    lines, i = [], 0
    ids: list[int] = []
    while len(ids) < n_tokens:
        a, b = (37 * i + 11) % 997, (53 * i + 7) % 991
        lines.append(f"Question: what is {a} + {b}? Let us add them: {a} + {b} = {a + b}. "
                     f"Answer: {a + b}.\n")
        i += 1
        if i % 16 == 0:
            ids = list(tok.encode("".join(lines)))
    return list(tok.encode("".join(lines)))[:n_tokens]


def suffix_ids(tok, b: int, length: int) -> list[int]:
    """Prompt b's own question, cut to `length` ids (tokenised alone, no BOS)."""
    text = (f"Question: a shop sells {b + 3} boxes of {7 * b + 5} apples and {b + 2} bags of "
            f"{3 * b + 4} pears; each apple costs {b + 1} cents and each pear {2 * b + 1} cents. "
            f"How many fruits are there in all, and what do they cost together? Think step by "
            f"step and give the answer at the end.")
    ids = list(tok.encode(text))
    bos = getattr(tok, "bos_token_id", None)
    if getattr(tok, "add_bos", False) and ids[:1] == [bos]:
        ids = ids[1:]
    assert len(ids) >= length, (len(ids), length)
    return ids[:length]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or path (default: embedded)")
    ap.add_argument("--prompts", type=int, default=8, help="B (default 8)")
    ap.add_argument("--n", type=int, default=8, help="N branches per prompt (default 8)")
    ap.add_argument("--context-tokens", type=int, default=2000, help="C (default 2000)")
    ap.add_argument("--suffix-min", type=int, default=30)
    ap.add_argument("--suffix-max", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=16, help="T (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON output file")
    args = ap.parse_args(argv)

    import numpy as np

    import jaxsample
    from jaxsample import SamplingParams, engine

    lm = jaxsample.load(args.model) if args.model else jaxsample.load()
    tok = lm.tokenizer
    B, N, C, T = args.prompts, args.n, args.context_tokens, args.max_new_tokens
    context = few_shot_ids(tok, C)
    span = args.suffix_max - args.suffix_min
    lengths = [args.suffix_min + (span * b) // max(B - 1, 1) for b in range(B)]
    suffixes = [suffix_ids(tok, b, n) for b, n in enumerate(lengths)]
    full = [context + s for s in suffixes]
    params = SamplingParams(n=N, max_new_tokens=T, seed=0, temperature=1.0, ignore_eos=True)

    runs = {"shared": [], "per_prompt": []}
    gens = {}
    for r in range(args.repeats):
        for mode in ("shared", "per_prompt"):
            t0 = time.perf_counter()
            if mode == "shared":
                gen = engine.generate(lm, suffixes, params, shared_prefix=context)
            else:
                gen = engine.generate(lm, full, params)
            wall = time.perf_counter() - t0
            t = dict(gen.timings)
            runs[mode].append({k: float(v) for k, v in t.items()} | {"wall": wall})
            gens[mode] = gen
            print(f"repeat {r} {mode:10s} prefill {t['prefill']:7.3f} s"
                  + (f" (context {t['prefill_context']:.3f} s)" if "prefill_context" in t else "")
                  + f"  compile {t['compile']:6.2f} s  decode {t['decode']:6.3f} s",
                  file=sys.stderr, flush=True)

    med = {m: statistics.median(x["prefill"] for x in v) for m, v in runs.items()}
    bill_keys = ("shared_context_tokens", "prompt_tokens_prefilled",
                 "prompt_tokens_if_context_per_prompt", "prompt_tokens_if_separate",
                 "prefill_flops_shared", "prefill_flops_if_context_per_prompt",
                 "prefill_flops_if_separate", "kv_bytes_shared_context", "kv_bytes_shared_prefix",
                 "kv_bytes_tails", "kv_bytes_held", "kv_bytes_if_separate",
                 "decode_flops_shared", "decoded_tokens_total")
    bills = {m: {k: getattr(g.bill, k) for k in bill_keys} for m, g in gens.items()}
    a, b = gens["shared"], gens["per_prompt"]
    same = int(sum(np.array_equal(a.tokens[i, j], b.tokens[i, j])
                   for i in range(B) for j in range(N)))
    result = {
        "benchmark": "shared_context", "model": lm.name,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "config": {"B": B, "N": N, "C": C, "T": T, "suffix_lengths": lengths,
                   "prompt_bucket_shared": engine.bucket(max(lengths)),
                   "context_bucket": engine.bucket(C),
                   "prompt_bucket_per_prompt": engine.bucket(C + max(lengths)),
                   "repeats": args.repeats, "dtype": lm.config.dtype},
        "runs": runs,
        "prefill_median_s": med,
        "prefill_speedup": med["per_prompt"] / med["shared"],
        "bill": bills,
        "bill_prefill_flops_ratio": (bills["per_prompt"]["prefill_flops_shared"]
                                     / bills["shared"]["prefill_flops_shared"]),
        "identical_branches": f"{same}/{B * N}",
        "target": {"one_context_prefill_in_bill":
                   bills["shared"]["prompt_tokens_prefilled"] == C + sum(lengths),
                   "prefill_speedup_at_least_3x": med["per_prompt"] / med["shared"] >= 3.0},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
