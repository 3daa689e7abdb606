"""Int8 weights (`load(..., weights="int8")`): decode-step time, the compiled step's
HLO and the accuracy cost against float32, in one script (CPU).

Four parts (`--parts`, default all):

* speed: the decode step of SmolLM2 at P = 1024 for N = 1 and 16 with
  float32, bfloat16, int8 weight-only and int8 W8A8 weights (`models.quantization.quant`
  modes; both with `load`'s calibrated outlier channels, `models.quantization.outliers`)
  and W8A8 without outlier channels (every channel int8), one process, the variants alternated call by call (A B C D A B
  ...) as in `benchmarks/step_ablation.py`; a call's step time is its decode
  seconds / (T - 1) forward steps; medians over `--reps` calls and the ratio
  of each median to float32's.
* hlo: the N = 1 decode step compiled (`engine.step_cost.compile_decode_step`)
  for float32 and each int8 mode; counts the instructions (not fused
  bodies) whose result is a whole weight `[in, out]` made by a convert of
  the int8 one (a float32 or int32 copy of a weight materialised per step),
  and the dots by result type (s32: XLA's int8 GEMM).
* accuracy: per model (SmolLM2, Gemma 3 270M), 20 chat prompts: the
  last-position logits of int8 in both modes, W8A8 without outlier channels
  (and bfloat16) against float32 (max |diff|,
  and that over the float32 logits' standard deviation, per prompt, then
  the max and median over prompts), and greedy decoding of 32 tokens (end
  of text ignored): the fraction of tokens equal before the first
  divergence, and prompts whose 32 tokens are all equal. Where the int8 models
  store the prefix KV in float16 (`engine.state.prefix_kv_dtype`), the same
  greedy run with a float32 prefix against it: agreement as above and the
  largest logprob difference before the first divergence.
* invariance: per model, how far each variant's results move under changes
  that float32 rounding alone makes: the same 20 prompts' last-position
  logprobs in a batch of 20 against a batch of 10, against the model with
  one layer-0 norm weight moved by one ulp, and (with 2 or more devices,
  `XLA_FLAGS=--xla_force_host_platform_device_count=2`) under a
  `shard_map` over 2 devices; max |diff| over the tokens with float32
  probability > 0.01, max and median over prompts.

Usage:

    python -m benchmarks.quantized [--parts speed,hlo,accuracy,invariance] [--reps 5] \
        [--out benchmarks/results/quantized.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics

PROMPTS = [
    "What is 17 + 25?", "Name three primary colours.", "Write a haiku about the sea.",
    "Explain what a prime number is.", "What is the capital of France?",
    "Give me a synonym for happy.", "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.", "What does a thermometer measure?",
    "List two uses of copper.", "Why is the sky blue?", "What is 9 times 8?",
    "Describe a cat in one sentence.", "What is photosynthesis?",
    "Suggest a name for a pet goldfish.", "What comes after Tuesday?",
    "Who wrote Romeo and Juliet?", "Convert 3 kilometres to metres.",
    "What is the boiling point of water in Celsius?", "Tell me a fun fact about octopuses.",
]


def _variants():
    from benchmarks.common import NoEosTokenizer, int8_without_outliers
    from jaxsample.loading import load
    from jaxsample.models.quantization import quant

    f32 = load(None, dtype="float32")
    q8 = load(None, weights="int8")
    out = {"float32": f32, "bfloat16": load(None, dtype="bfloat16"),
           "int8 weight-only": dataclasses.replace(q8, params=quant.with_mode(q8.params,
                                                                              "weight_only")),
           "int8 W8A8": dataclasses.replace(q8, params=quant.with_mode(q8.params, "w8a8")),
           "int8 W8A8, no outlier channels": int8_without_outliers(f32)}
    return {k: dataclasses.replace(v, tokenizer=NoEosTokenizer(v.tokenizer))
            for k, v in out.items()}


def speed(P, Ns, T, reps):
    """{(variant, N): [step seconds per call]}, the variants interleaved call by call."""
    from benchmarks.common import prompt_ids
    from benchmarks.step_ablation import _decode
    from jaxsample import SamplingParams
    from jaxsample.engine import session

    lms = _variants()
    ids = prompt_ids(0, P, lms["float32"].vocab_limit)
    out = {}
    for N in Ns:
        sp = SamplingParams(n=N, temperature=1.0, max_new_tokens=T, seed=0)
        sessions = {}
        for v, lm in lms.items():  # prefill, compile and warm up each variant once
            sessions[v] = s = session.Session(lm, [ids], sp)
            _decode(s, N, T)
        for _ in range(reps):
            for v, s in sessions.items():
                out.setdefault((v, N), []).append(_decode(s, N, T))
    return out


def hlo(P=1024, T=64):
    """Per variant: the N = 1 step's float32 weight copies, its dots by result type and
    its calls of the int8 CPU kernels (`models.cpu_kernels.cpu_kernels`, when they are on)."""
    from jaxsample.engine.step_cost import compile_decode_step
    from jaxsample.loading import read_config
    from jaxsample.models.cpu_kernels import cpu_kernels

    cfg = read_config(None)
    E, F, V = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    HD, KD = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {(E, HD), (E, KD), (KD, E), (HD, E), (E, F), (F, E), (V, E), (E, V),
              (HD + 2 * KD, E), (2 * F, E)}  # the fused q/k/v and gate/up, stored [out, in]
    rows = {}
    for name, kw in (("float32", {}), ("int8 weight-only", dict(weights="int8", mode="weight_only")),
                     ("int8 W8A8", dict(weights="int8", mode="w8a8"))):
        text = compile_decode_step(cfg, P, 1, T, **kw).as_text()
        copies, dots = [], {}
        for line in text.splitlines():  # instructions, not the bodies of fused computations
            m = re.match(r"\s*%([\w.\-]+) = (f32|s32|bf16)\[(\d+),(\d+)\]\{[^}]*\} "
                         r"(fusion|convert)\(", line)
            if m and (int(m[3]), int(m[4])) in shapes and "convert" in m[1] + m[5]:
                copies.append(f"{m[1]} {m[2]}[{m[3]},{m[4]}]")
            d = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[[\d,]*\]\{[^}]*\} dot\(", line)
            if d:
                dots[d[1]] = dots.get(d[1], 0) + 1
        kernels = {t: text.count(f'custom_call_target="{t}"') for t in cpu_kernels.TARGETS}
        rows[name] = dict(weight_copies_per_step=len(copies), examples=copies[:3],
                          dots_by_result_type=dots, cpu_kernel_calls=kernels)
    return rows


def accuracy(models=("smollm2-135m-instruct", "gemma3-270m"), T=32):
    import numpy as np

    from benchmarks.common import NoEosTokenizer, int8_without_outliers
    from jaxsample import SamplingParams, generate
    from jaxsample.engine import state
    from jaxsample.loading import load
    from jaxsample.models.quantization import quant

    out = {}
    for name in models:
        q8 = load(name, weights="int8")
        lms = {"float32": load(name), "bfloat16": load(name, dtype="bfloat16"),
               "int8 W8A8": dataclasses.replace(q8, params=quant.with_mode(q8.params, "w8a8")),
               "int8 weight-only": dataclasses.replace(
                   q8, params=quant.with_mode(q8.params, "weight_only")),
               "int8 W8A8, no outlier channels": int8_without_outliers(load(name))}
        batch, last = _chat_batch(lms["float32"].tokenizer)
        ids = [[int(t) for t in r[:n + 1]] for r, n in zip(batch, last)]
        logits = {k: np.asarray(lm.forward(batch))[np.arange(len(ids)), last]
                  for k, lm in lms.items()}
        sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=T, seed=0)
        greedy = lambda lm: generate(  # noqa: E731
            dataclasses.replace(lm, tokenizer=NoEosTokenizer(lm.tokenizer)), ids, sp)
        gens = {k: greedy(lm) for k, lm in lms.items()}
        toks = {k: g.tokens[:, 0] for k, g in gens.items()}
        ref, ref_t = logits["float32"], toks["float32"]
        row = {}
        for k in ("int8 W8A8", "int8 weight-only"):  # the float16 prefix's own cost
            if state.prefix_kv_dtype(lms[k].config, lms[k].params, lms[k].prefix_kv_dtype) is None:
                continue  # stored float32 already (sliding windows, kernels off)
            g32 = greedy(dataclasses.replace(lms[k], prefix_kv_dtype="model"))
            same = g32.tokens[:, 0] == toks[k]
            first = np.where(same.all(1), T, np.argmin(same, axis=1))
            agree = np.arange(T)[None] < first[:, None]  # tokens before the first divergence
            d = np.abs(g32.logprobs[:, 0] - gens[k].logprobs[:, 0])[agree]
            row[f"{k}: float16 prefix against float32 prefix"] = dict(
                greedy_prefix_fraction=float(first.mean() / T),
                greedy_prompts_equal=int((first == T).sum()), prompts=len(ids), tokens=T,
                logprob_max_abs=float(d.max()), logprob_median_abs=float(np.median(d)))
        for k in ("bfloat16", "int8 W8A8", "int8 weight-only", "int8 W8A8, no outlier channels"):
            d = np.abs(logits[k] - ref).max(axis=1)
            rel = d / ref.std(axis=1)
            same = ref_t == toks[k]
            first = np.where(same.all(1), T, np.argmin(same, axis=1))
            row[k] = dict(logit_max_abs=float(d.max()), logit_max_abs_median=float(np.median(d)),
                          logit_rel_std_max=float(rel.max()),
                          logit_rel_std_median=float(np.median(rel)),
                          argmax_equal=int((logits[k].argmax(1) == ref.argmax(1)).sum()),
                          greedy_prefix_fraction=float(first.mean() / T),
                          greedy_prompts_equal=int((first == T).sum()), prompts=len(ids),
                          tokens=T)
        out[name] = row
    return out


def _chat_batch(tok):
    """The 20 chat prompts padded into one batch: (tokens [20, S] int32, last index [20])."""
    import numpy as np

    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS]
    S = max(map(len, ids))
    batch = np.array([x + [tok.pad_token_id] * (S - len(x)) for x in ids], np.int32)
    return batch, np.array([len(x) - 1 for x in ids])


def invariance(models=("smollm2-135m-instruct", "gemma3-270m")):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxsample.loading import load
    from jaxsample.models.families import families
    from jaxsample.models.quantization import quant

    out = {}
    for name in models:
        f32, q8 = load(name), load(name, weights="int8")
        lms = {"float32": f32,
               "int8 weight-only": dataclasses.replace(
                   q8, params=quant.with_mode(q8.params, "weight_only")),
               "int8 W8A8": dataclasses.replace(q8, params=quant.with_mode(q8.params, "w8a8"))}
        batch, last = _chat_batch(f32.tokenizer)
        rows = np.arange(len(last))
        mod = families.module_for(f32.config)
        fwd = jax.jit(lambda p, t: jax.nn.log_softmax(mod.forward(f32.config, p, t), -1))
        mesh = jax.make_mesh((2,), ("d",)) if jax.device_count() >= 2 else None

        def bump(params):  # layer 0's first norm weight, each element one ulp up
            p = dict(params, layers=list(params["layers"]))
            l0 = dict(p["layers"][0])
            k = sorted(k for k in l0 if k.endswith("norm"))[0]
            l0[k] = jnp.nextafter(l0[k], jnp.full_like(l0[k], jnp.inf))
            p["layers"][0] = l0
            return p

        ref = np.asarray(fwd(f32.params, batch))[rows, last]
        keep = np.exp(ref) > 0.01
        row = {}
        for k, lm in lms.items():
            base = np.asarray(fwd(lm.params, batch))[rows, last]
            half = len(rows) // 2
            other = {"batch of 10": np.concatenate(
                         [np.asarray(fwd(lm.params, batch[i:i + half]))[np.arange(half),
                                                                        last[i:i + half]]
                          for i in (0, half)]),
                     "one-ulp norm weight": np.asarray(fwd(bump(lm.params), batch))[rows, last]}
            if mesh is not None:
                from jax.sharding import NamedSharding
                from jax.sharding import PartitionSpec as Ps
                g = jax.jit(jax.shard_map(lambda p, t: fwd(p, t), mesh=mesh,
                                          in_specs=(Ps(), Ps("d")), out_specs=Ps("d")))
                other["shard_map over 2 devices"] = np.asarray(g(
                    jax.device_put(lm.params, NamedSharding(mesh, Ps())),
                    jax.device_put(batch, NamedSharding(mesh, Ps("d")))))[rows, last]
            other["float32 (the error itself)"] = ref
            row[k] = {}
            for what, y in other.items():
                d = np.where(keep, np.abs(y - base), 0).max(axis=1)
                row[k][what] = dict(max=float(d.max()), median=float(np.median(d)))
        out[name] = row
    return out


def main(argv=None):
    from benchmarks.common import environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="speed,hlo,accuracy,invariance")
    ap.add_argument("--prompt-length", type=int, default=1024)
    ap.add_argument("--branches", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    res = {"environment": environment()}

    def save():  # after every part: a later part's error or Ctrl-C keeps the earlier ones
        if a.out:
            tmp = a.out + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(res, fh, indent=1)
            os.replace(tmp, a.out)

    if "speed" in parts:
        sp = speed(a.prompt_length, [int(x) for x in a.branches.split(",")], a.new_tokens,
                   a.reps)
        print("| weights | N | median step ms | min | max | calls | / float32 |")
        print("|---|---|---|---|---|---|---|")
        res["speed"] = []
        for (v, N), xs in sp.items():
            base = statistics.median(sp[("float32", N)])
            med = statistics.median(xs)
            print(f"| {v} | {N} | {med * 1e3:.2f} | {min(xs) * 1e3:.2f} | {max(xs) * 1e3:.2f} "
                  f"| {len(xs)} | {med / base:.2f} |")
            res["speed"].append(dict(variant=v, N=N, P=a.prompt_length, T=a.new_tokens,
                                     step_s=xs, median_step_s=med, ratio_to_float32=med / base))
        save()
    if "hlo" in parts:
        res["hlo"] = hlo(a.prompt_length)
        print(json.dumps(res["hlo"], indent=1))
        save()
    if "accuracy" in parts:
        res["accuracy"] = accuracy(tuple(a.models.split(",")))
        print(json.dumps(res["accuracy"], indent=1))
        save()
    if "invariance" in parts:
        res["invariance"] = invariance(tuple(a.models.split(",")))
        print(json.dumps(res["invariance"], indent=1))
    save()


if __name__ == "__main__":
    main()
