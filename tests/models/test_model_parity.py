"""Our loaders + `models.families.llama.forward` against transformers' float32 logits.

The reference data comes from `scripts/make_reference.py` (torch and
transformers are not needed here): the embedded SmolLM2-135M-Instruct Q4_1
GGUF as loaded by transformers, and tiny random Llama / Qwen2 / Llama-3-scaled
checkpoints (GQA, head_dim 16) plus a GGUF written with llama.cpp's Q/K
permutation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from paths import DATA

from jaxsample.loading import load
from jaxsample.models.checkpoints import gguf_loader
from jaxsample.models.families import llama

REF = json.loads((DATA / "smollm2_reference.json").read_text())
TINY = np.load(DATA / "tiny_reference.npz")
LOGIT_ATOL = 1e-3  # float32; SmolLM2 logits are of order 10-30
BF16_ATOL = 1.0  # bfloat16 forward against the float32 reference (see the bf16 smoke test)


def _pad(rows, length, pad):
    out = np.full((len(rows), length), pad, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.fixture(scope="module")
def smol_logits(lm):
    """Our logits at every reference position: {(prompt, position): row [V]}.

    Prompts are right-padded into two batches (causal attention: padding after
    a position cannot change it), so only two shapes are compiled.
    """
    names = [n for n, p in REF["prompts"].items() if "logits" in p]
    short = [n for n in names if len(REF["prompts"][n]["ids"]) <= 128]
    long = [n for n in names if n not in short]
    out = {}
    for group, length in ((short, 128), (long, 800)):
        ids = [REF["prompts"][n]["ids"] for n in group]
        logits = np.asarray(lm.forward(_pad(ids, length, lm.tokenizer.pad_token_id)))
        for i, n in enumerate(group):
            for pos in REF["prompts"][n]["logits"]:
                out[n, int(pos)] = logits[i, int(pos)]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, p in REF["prompts"].items() if "logits" in p])
def test_smollm2_logits_match_transformers(smol_logits, name):
    for pos, ref in REF["prompts"][name]["logits"].items():
        ours = smol_logits[name, int(pos)].astype(np.float64)
        ids = np.array(ref["top_ids"])
        np.testing.assert_allclose(ours[ids], ref["top_values"], atol=LOGIT_ATOL, rtol=0,
                                   err_msg=f"{name} position {pos}")
        # The reference's best token is our best up to the tolerance (an exact argmax
        # would flip wherever the top two logits are closer than float32 noise).
        assert ours[ids[0]] >= ours.max() - 2 * LOGIT_ATOL
        lse = np.log(np.sum(np.exp(ours - ours.max()))) + ours.max()
        assert abs(lse - ref["logsumexp"]) < LOGIT_ATOL
        assert abs(ours.mean() - ref["mean"]) < LOGIT_ATOL
        assert abs(ours.std(ddof=1) - ref["std"]) < LOGIT_ATOL


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(lm):
    names = [n for n, p in REF["prompts"].items() if "greedy" in p]
    seqs = [list(REF["prompts"][n]["ids"]) for n in names]
    steps = len(REF["prompts"][names[0]]["greedy"]["ids"])
    length = max(map(len, seqs)) + steps
    for _ in range(steps):
        logits = np.asarray(lm.forward(_pad(seqs, length, lm.tokenizer.pad_token_id)))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    for n, s in zip(names, seqs):
        ref = REF["prompts"][n]["greedy"]
        assert min(ref["margins"]) > 10 * LOGIT_ATOL  # no near-tie that float noise could flip
        got = s[len(REF["prompts"][n]["ids"]):]
        assert got == ref["ids"], f"{n}: {lm.tokenizer.decode(got)!r} != {ref['text']!r}"


@pytest.mark.slow
def test_smollm2_bfloat16_smoke(lm):
    lm16 = load(dtype="bfloat16")
    assert lm16.config.dtype == "bfloat16" and lm16.params["embed"].dtype.name == "bfloat16"
    p = REF["prompts"]["chat_france"]
    logits = np.asarray(lm16.forward([p["ids"]]))[0, -1]
    ref = p["logits"][str(len(p["ids"]) - 1)]
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    # bfloat16 keeps 8 significant bits: weights and activations are rounded by up to
    # 2**-9 relative at every one of the 30 layers, which moves logits of size ~25 by up
    # to ~1 here. So the top logits agree within BF16_ATOL, and the reference's best token
    # is within 2 * BF16_ATOL of our best: never the exact argmax, which flips wherever
    # the float32 top two are closer than that (here "The" 25.325 vs "L" 25.243).
    np.testing.assert_allclose(logits[ref["top_ids"][:8]], ref["top_values"][:8], atol=BF16_ATOL)
    assert logits[ref["top_ids"][0]] >= logits.max() - 2 * BF16_ATOL
    top8 = set(np.argsort(-logits)[:8].tolist())
    assert len(top8 & set(ref["top_ids"][:8])) >= 4  # the same head of the distribution


TINY_NAMES = ["tiny_llama", "tiny_qwen2", "tiny_llama3_untied"]


def _tiny_logits(model):
    seq = TINY["tiny_sequence"]
    return np.asarray(model.forward(seq[None]))[0, TINY["tiny_positions"]]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_hf_checkpoints_match_transformers(name):
    model = load(DATA / name)
    ref = TINY[f"{name}/logits"]
    assert np.abs(ref).max() > 1.0  # the random model is not trivially flat
    np.testing.assert_allclose(_tiny_logits(model), ref, atol=1e-4, rtol=0)


def test_tiny_hf_configs():
    q = load(DATA / "tiny_qwen2").config
    assert (q.arch, q.qkv_bias, q.tie_embeddings, q.n_heads, q.n_kv_heads, q.head_dim) == (
        "qwen2", True, True, 4, 2, 16)
    l3 = load(DATA / "tiny_llama3_untied").config
    assert not l3.tie_embeddings and l3.rope_scaling is not None
    assert (l3.rope_scaling.factor, l3.rope_scaling.original_max_position_embeddings) == (8.0, 64)


def test_tiny_gguf_with_llamacpp_permutation_matches_transformers():
    model = load(DATA / "tiny_llama.gguf")
    assert (model.config.n_heads, model.config.n_kv_heads, model.config.head_dim) == (4, 2, 16)
    np.testing.assert_allclose(_tiny_logits(model), TINY["tiny_llama/logits"], atol=1e-4, rtol=0)


def test_tiny_gguf_unpermute_direction_matters():
    """Permuting again instead of un-permuting must visibly break parity (head_dim 16, K < H)."""
    import dataclasses

    model = load(DATA / "tiny_llama.gguf")
    cfg = model.config
    wrong = llama.stack_layers(model.params)
    layers = dict(wrong["layers"])
    for key, heads in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads)):
        w = np.asarray(layers[key])  # [L, E, H*D] in HF order; undo then apply the permutation twice
        back = np.stack([gguf_loader.permute_rope_rows(x.T, heads) for x in w])
        layers[key] = np.stack([gguf_loader.permute_rope_rows(x, heads).T for x in back])
    wrong["layers"] = layers
    bad = dataclasses.replace(model, params=wrong)
    assert np.abs(_tiny_logits(bad) - TINY["tiny_llama/logits"]).max() > 0.1


def test_tiny_bfloat16_smoke():
    model = load(DATA / "tiny_llama", dtype="bfloat16")
    assert model.params["layers"][0]["wq"].dtype.name == "bfloat16"
    ref = TINY["tiny_llama/logits"]
    got = _tiny_logits(model)
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def _llamacpp_llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.generate_extra_tensors` (rope_freqs.weight)."""
    import math

    s = cfg.get("rope_scaling") or cfg["rope_parameters"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, np.float32)


def test_tiny_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """An untied Llama-3-scaled GGUF as llama.cpp writes it (permuted Q/K, rope_freqs.weight, output.weight)."""
    import gguf
    from safetensors.numpy import load_file

    d = DATA / "tiny_llama3_untied"
    hf = json.loads((d / "config.json").read_text())
    sd = {k: v.astype(np.float32) for k, v in load_file(d / "model.safetensors").items()}
    H, K, D = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    src = gguf.GGUFReader(DATA / "tiny_llama.gguf")  # reuse its tokenizer metadata
    w = gguf.GGUFWriter(str(tmp_path / "l3.gguf"), "llama")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_tensor("rope_freqs.weight", _llamacpp_llama3_rope_factors(hf, D))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(hf["num_hidden_layers"]):
        for hf_name, g in names.items():
            a = sd[f"model.layers.{i}.{hf_name}.weight"]
            if g in ("attn_q", "attn_k"):
                a = gguf_loader.permute_rope_rows(a, H if g == "attn_q" else K)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load(tmp_path / "l3.gguf")
    assert model.config.rope_scaling == load(d).config.rope_scaling
    assert not model.config.tie_embeddings
    np.testing.assert_allclose(_tiny_logits(model), TINY["tiny_llama3_untied/logits"], atol=1e-4, rtol=0)
