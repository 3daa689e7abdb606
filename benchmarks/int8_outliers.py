"""Where W8A8's accuracy goes, and three known remedies measured (SmolLM2, CPU).

The W8A8 product (`models.quantization.quant`, activations quantised per row) with every
input channel in int8 more than doubles weight-only's last-position logit
error against float32 (docs/benchmarks.md, "Int8 weights"). The usual
cause is activation outlier channels: one large channel sets a row's scale
and flattens the others. Three remedies:

* outlier channels (the library's, `models.quantization.outliers`, on by default in
  `load(weights="int8")`): each projection's K largest input channels by
  calibration kept float; K = 16 as shipped, and 4, 8, 32;
* activation blocks: each row's blocks of B input channels get their own
  scale (llama.cpp's Q8_0 activations use B = 32);
* SmoothQuant (Xiao et al. 2023, arXiv 2211.10438): per input channel, s_j =
  max|X_j|^alpha / max|W_j|^(1 - alpha) from a calibration pass; X / s is
  folded into the preceding RMSNorm gain (q/k/v, gate/up) or into w_up's
  output columns (the down projection's input, silu(gate) * up), W * s into
  the projection's rows: the float model is unchanged, the int8 rounding of
  the activations sees flatter channels. With `+ head`, the tied output head
  is untied into its own int8 matrix smoothed after the final norm (+28 MB).

Calibration (SmoothQuant's): the float32 model run on chat prompts of the
bundled tasks (add1, word, compare; seed 1) and two long-answer prompts,
joined into one sequence, recording max|x| per input channel at each
projection (`models.quantization.outliers.channel_maxima`; the outlier channels use the
library's own built-in calibration text). Evaluation: the 20 prompts of
`benchmarks/quantized.py`, whose last-position logits are compared with
float32's (max |diff| / std of the float32 logits, median and max over
prompts, and how many argmaxes agree): the same metric as that script.

    python -m benchmarks.int8_outliers [--out benchmarks/results/int8_outliers.json]

Speed is not measured here: `benchmarks/quantized.py` measures the outlier channels'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

QMAX = 127


def blocked_rows(block):
    """A `quant._w8a8_rows` with per-block activation scales (`block` channels)."""
    import jax
    import jax.numpy as jnp

    def rows(x, q, scale, *, transposed, kernels=True):  # kernels: unused (XLA only)
        one = x.shape[0] == 1
        xf = x.astype(jnp.float32)
        if one:
            xf = jnp.concatenate([xf, jnp.zeros_like(xf)])
        M, I = xf.shape
        g = I // block if I % block == 0 else 1
        xg = xf.reshape(M, g, I // g)
        sx = jnp.max(jnp.abs(xg), axis=-1, keepdims=True) / QMAX
        sx = jnp.where(sx > 0, sx, 1.0)
        xq = jnp.clip(jnp.round(xg / sx), -QMAX, QMAX).astype(jnp.int8)
        qg = (q.T if transposed else q).reshape(g, I // g, -1)
        y = jax.lax.dot_general(xq, qg, (((2,), (1,)), ((1,), (0,))),
                                preferred_element_type=jnp.int32)  # [g, M, out]
        y = jnp.einsum("gmo,mg->mo", y.astype(jnp.float32), sx[..., 0]) * scale
        return y[:1] if one else y

    return rows


def calibrate(lm, texts):
    """{(layer, key) or "head": max|x| per input channel}:
    `models.quantization.outliers.channel_maxima` over the texts, each through the chat
    template, joined into one sequence."""
    from jaxsample.models.quantization import outliers

    tok = lm.tokenizer
    ids = [i for t in texts for i in tok.encode(
        tok.apply_chat_template([{"role": "user", "content": t}]))]
    return outliers.channel_maxima(lm.config, lm.params, np.asarray(ids, np.int32))


def _factor(x_max, w_max, alpha):
    return np.clip(x_max ** alpha / np.maximum(w_max, 1e-8) ** (1 - alpha), 1e-5, None)


def smooth(params, stats, alpha, head: bool):
    """SmoothQuant's rescaling of a float32 Llama parameter tree (list layout)."""
    out = dict(params)
    layers = []
    for i, lp in enumerate(params["layers"]):
        lp = {k: np.asarray(v, np.float64) for k, v in lp.items()}
        for norm, ws, key in (("attn_norm", ("wq", "wk", "wv"), "wq"),
                              ("mlp_norm", ("w_gate", "w_up"), "w_gate")):
            s = _factor(stats[(i, key)], np.max([np.abs(lp[w]).max(1) for w in ws], axis=0),
                        alpha)
            lp[norm] = lp[norm] / s
            for w in ws:
                lp[w] = lp[w] * s[:, None]
        s = _factor(stats[(i, "w_down")], np.abs(lp["w_down"]).max(1), alpha)
        lp["w_up"] = lp["w_up"] / s[None, :]
        lp["w_down"] = lp["w_down"] * s[:, None]
        layers.append({k: v.astype(np.float32) for k, v in lp.items()})
    out["layers"] = layers
    if head:
        E = np.asarray(params["embed"], np.float64)
        s = _factor(stats["head"], np.abs(E).max(0), alpha)
        out["final_norm"] = (np.asarray(params["final_norm"], np.float64) / s).astype(np.float32)
        out["lm_head"] = (E.T * s[:, None]).astype(np.float32)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alphas", default="0.4,0.5,0.6")
    ap.add_argument("--blocks", default="64,32")
    ap.add_argument("--outlier-counts", default="4,8,32", help="K besides the shipped 16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from benchmarks.quantized import PROMPTS
    from benchmarks.tasks import make_tasks
    from jaxsample.loading import load
    from jaxsample.models.quantization import outliers, quant

    f32, q8 = load(None), load(None, weights="int8")
    assert f32.config.arch == "llama", "SmoothQuant folding here is Llama's (RMSNorm gain)"
    tok = f32.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in PROMPTS]
    S = max(map(len, ids))
    batch = np.array([x + [tok.pad_token_id] * (S - len(x)) for x in ids], np.int32)
    last = np.array([len(x) - 1 for x in ids])
    ref = np.asarray(f32.forward(batch))[np.arange(len(ids)), last]

    def error(lm):
        jax.clear_caches()  # the product may have been swapped (blocks)
        lg = np.asarray(lm.forward(batch))[np.arange(len(ids)), last]
        d = np.abs(lg - ref).max(1) / ref.std(1)
        return {"rel_std_median": float(np.median(d)), "rel_std_max": float(d.max()),
                "argmax_equal": int((lg.argmax(1) == ref.argmax(1)).sum()), "prompts": len(ids)}

    def int8(params, tied=True, mode="w8a8"):
        qp = jax.tree_util.tree_map(jnp.asarray, quant.quantize_params(params, mode=mode))
        cfg = q8.config if tied else dataclasses.replace(q8.config, tie_embeddings=False)
        return dataclasses.replace(q8, params=qp, config=cfg)

    plain = int8(f32.params)  # every channel in int8: what `load` shipped before outliers
    rows = {"W8A8 per row, no outlier channels": error(plain),
            "weight-only, no outlier channels": error(dataclasses.replace(
                plain, params=quant.with_mode(plain.params, "weight_only"))),
            "W8A8 + 16 outlier channels (shipped)": error(q8),
            "weight-only + 16 outlier channels": error(dataclasses.replace(
                q8, params=quant.with_mode(q8.params, "weight_only")))}
    for k in [int(x) for x in args.outlier_counts.split(",") if x]:
        kept = outliers.calibrate(f32.config, f32.params, tok, k)
        rows[f"W8A8 + {k} outlier channels"] = error(dataclasses.replace(
            q8, params=jax.tree_util.tree_map(
                jnp.asarray, quant.quantize_params(f32.params, outliers=kept))))
    shipped = quant._w8a8_rows
    try:
        for b in [int(x) for x in args.blocks.split(",") if x]:
            quant._w8a8_rows = blocked_rows(b)
            quant._w8a8_fn.cache_clear()
            rows[f"W8A8, activation blocks of {b}"] = error(plain)
    finally:
        quant._w8a8_rows = shipped
        quant._w8a8_fn.cache_clear()
    calib = [t.prompt for fam in ("add1", "word", "compare") for t in make_tasks(fam, 4, 1)]
    calib += ["Write a short story about a lighthouse.", "Explain how a bicycle works in detail."]
    stats = calibrate(f32, calib)
    for a in [float(x) for x in args.alphas.split(",") if x]:
        rows[f"W8A8, SmoothQuant alpha {a}"] = error(int8(smooth(f32.params, stats, a, False)))
        rows[f"W8A8, SmoothQuant alpha {a} + head"] = error(
            int8(smooth(f32.params, stats, a, True), tied=False))
    print("| variant | logit error / std, median | max | argmax equal |")
    print("|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['rel_std_median']:.3f} | {r['rel_std_max']:.3f} | "
              f"{r['argmax_equal']}/{r['prompts']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calibration_prompts": calib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
