"""The loader core (`checkpoints.loader_core`, `.architectures`) and the families added on it.

Family parity data comes from `scripts/make_family_references.py` (torch and
transformers are not needed here).
"""

from __future__ import annotations

import functools
import re
import types

import numpy as np
import pytest
from paths import ROOT

from jaxsample.engine.naive import naive_generate
from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import architectures, loader_core
from jaxsample.models.checkpoints.loader_core import Tensor, TensorTable

# ---------------------------------------------------------------------------
# The copy loop on a toy family (fused rows, per-expert tensors, transforms)


def _toy_family(L=2, X=3, E=4, F=6):
    shapes = {"embed": (5, E), "layers": {"wq": (L, E, 2), "wk": (L, E, 3), "experts": (L, X, E, F)}}

    def check_params(cfg, params, source):
        for k, s in shapes["layers"].items():
            assert params["layers"][k].shape == s

    return types.SimpleNamespace(param_shapes=lambda cfg: shapes, check_params=check_params)


def _toy_table(transform=None):
    return TensorTable("blk.{i}.", {"emb": Tensor("embed")},
                       {"qk.weight": Tensor(("wq", "wk"), True),
                        "exp.{e}.weight": Tensor("experts", True)},
                       ignore=frozenset({"buffer"}), transform=transform)


def _toy_tensors(rng, L=2, X=3, E=4, F=6):
    t = {"emb": rng.normal(size=(5, E)), "buffer": np.zeros(1)}
    for i in range(L):
        t[f"blk.{i}.qk.weight"] = rng.normal(size=(5, E))  # [out = 2 + 3, in]
        for e in range(X):
            t[f"blk.{i}.exp.{e}.weight"] = rng.normal(size=(F, E))
    return {k: v.astype(np.float32) for k, v in t.items()}


def test_copy_splits_fused_rows_and_stacks_experts():
    t = _toy_tensors(np.random.default_rng(0))
    seen = []
    p = loader_core.copy_tensors(_toy_family(), None, _toy_table(lambda k, a: seen.append(k) or a),
                                 list(t), t.__getitem__, "toy")
    np.testing.assert_array_equal(p["layers"]["wq"][1], t["blk.1.qk.weight"][:2].T)
    np.testing.assert_array_equal(p["layers"]["wk"][1], t["blk.1.qk.weight"][2:].T)
    np.testing.assert_array_equal(p["layers"]["experts"][1, 2], t["blk.1.exp.2.weight"].T)
    assert seen.count("wq") == 2 and seen.count("wk") == 2  # per block of the fused tensor


@pytest.mark.parametrize("edit, error, match", [
    (lambda t: t.pop("blk.1.exp.2.weight"), ModelLoadError, "toy: missing tensor blk.1.exp.2.weight"),
    (lambda t: t.pop("blk.0.qk.weight"), ModelLoadError, "toy: missing tensor blk.0.qk.weight"),
    (lambda t: t.pop("emb"), ModelLoadError, "toy: missing tensor emb"),
    (lambda t: t.update({"blk.0.exp.3.weight": np.zeros((6, 4), np.float32)}),
     UnsupportedModelError, "unexpected tensor blk.0.exp.3.weight"),
    (lambda t: t.update({"blk.2.qk.weight": np.zeros((5, 4), np.float32)}),
     UnsupportedModelError, "unexpected tensor blk.2.qk.weight"),
    (lambda t: t.update({"other": np.zeros(1, np.float32)}), UnsupportedModelError,
     "unexpected tensor other; the model has no place for it"),
    (lambda t: t.update({"blk.0.qk.weight": np.zeros((6, 4), np.float32)}), ModelLoadError,
     r"blk.0.qk.weight has shape \(4, 6\) after transposing to \[in, out\], expected \(4, 5\)"),
])
def test_copy_refuses_missing_extra_and_misshapen_tensors(edit, error, match):
    t = _toy_tensors(np.random.default_rng(0))
    edit(t)
    with pytest.raises(error, match=match):
        loader_core.copy_tensors(_toy_family(), None, _toy_table(), list(t), t.__getitem__, "toy")


def test_config_reader_names_file_and_key_in_both_formats():
    g = loader_core.ConfigReader({"qwen3.block_count": 0}, "f.gguf", "qwen3")
    with pytest.raises(ModelLoadError, match="f.gguf: qwen3.block_count must be a positive"):
        g.count("block_count")
    with pytest.raises(ModelLoadError, match="f.gguf: missing metadata key qwen3.context_length"):
        g.count("context_length")
    h = loader_core.ConfigReader({"rms_norm_eps": -1.0, "x": None}, "dir")
    with pytest.raises(ModelLoadError, match="dir: config.json 'rms_norm_eps' must be a finite"):
        h.positive("rms_norm_eps")
    with pytest.raises(ModelLoadError, match="dir: config.json has no 'x'"):
        h.get("x")
    assert h.count("x", 7) == 7  # null is absent


def test_unsupported_lists_are_the_registry():
    """The refusal of either format names exactly the architectures that load."""
    with pytest.raises(UnsupportedModelError) as info:
        architectures.for_gguf({"general.architecture": "gptneox"}, "f.gguf")
    assert str(info.value).endswith(f"supported: {architectures.supported_gguf_archs()}")
    for arch in architectures.supported_gguf_archs():
        assert architectures.for_gguf({"general.architecture": arch}, "f").gguf_archs
    with pytest.raises(UnsupportedModelError) as info:
        architectures.for_hf({"architectures": ["GPTNeoXForCausalLM"]}, "d")
    assert str(info.value).endswith(f"supported: {architectures.supported_hf_classes()}")
    for name in architectures.supported_hf_classes():
        assert architectures.for_hf({"architectures": [name]}, "d")[1] == name
    assert "gemma3" in architectures.supported_gguf_archs()
    assert "Gemma3ForCausalLM" in architectures.supported_hf_classes()


# ---------------------------------------------------------------------------
# Families against transformers (tiny random checkpoints: scripts/make_family_references.py)

import dataclasses  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from paths import DATA
from ties import assert_same_tokens_up_to_ties  # noqa: E402

from jaxsample import (  # noqa: E402
    SamplingParams,
    engine,
    loading,
)
from jaxsample import bridge as bridge_lib  # noqa: E402
from jaxsample import weight_cache as cache_lib  # noqa: E402
from jaxsample.models.families import common, families  # noqa: E402

FAMILIES = ["tiny_qwen3", "tiny_gemma2", "tiny_phi3"]
GGUF_FAMILIES = FAMILIES
REL = 1e-4  # float32 logits against transformers' float32, relative to the row's largest


def _load(path):
    """`jaxsample.load` without its per-process cache (which would evict SmolLM2), as test_gemma3."""
    return loading._load_uncached(str(pathlib.Path(path).resolve()), 0, "float32", None, None)


@functools.cache
def _model(name: str, fmt: str):
    return _load(DATA / name if fmt == "hf" else DATA / name / "model.gguf")


@functools.cache
def _ref(name: str):
    return dict(np.load(DATA / name / "reference.npz"))


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def _gguf_as_hf(name):
    """The GGUF model; for Gemma 2 with the HF query_pre_attn_scalar, which no GGUF carries
    (llama.cpp uses the head dim, asserted here)."""
    lm = _model(name, "gguf")
    hf = _model(name, "hf").config
    if lm.config.arch == "gemma2":
        assert lm.config.query_pre_attn_scalar == lm.config.head_dim != hf.query_pre_attn_scalar
        lm = dataclasses.replace(lm, config=lm.config.replace(
            query_pre_attn_scalar=hf.query_pre_attn_scalar))
    changes = {"norm_eps": hf.norm_eps}  # eps and LongRoPE's numbers are float32 in a GGUF
    if getattr(hf, "long_rope", None) is not None:
        a, b = lm.config.long_rope, hf.long_rope
        for f in ("short_factor", "long_factor", "attention_factor"):
            np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=1e-6)
        changes["long_rope"] = b
    assert lm.config.replace(**changes) == hf
    return lm


def _short(lm):
    """The model as transformers runs a call within LongRoPE's original context (short
    factors: see `models.families.llama.LongRope`); other families unchanged."""
    lr = getattr(lm.config, "long_rope", None)
    if lr is None:
        return lm
    return dataclasses.replace(lm, config=lm.config.replace(
        max_seq_len=lr.original_max_position_embeddings))


@pytest.mark.parametrize("name, fmt", [(n, "hf") for n in FAMILIES]
                         + [(n, "gguf") for n in GGUF_FAMILIES])
def test_logits_match_transformers(name, fmt):
    lm = _model(name, "hf") if fmt == "hf" else _gguf_as_hf(name)
    ref = _ref(name)
    assert np.abs(ref["long_last"]).max() > 1.0  # the random model is not trivially flat
    long = np.asarray(lm.forward(ref["long"][None]))[0]
    short = np.asarray(_short(lm).forward(ref["short"][None]))[0]
    assert _rel(long[-1], ref["long_last"]) <= REL  # 300 tokens: RoPE and windows at length
    assert _rel(short[-1], ref["short_last"]) <= REL
    assert _rel(long[ref["inner"]], ref["long_inner"]) <= REL


def test_family_configs():
    q = _model("tiny_qwen3", "hf").config
    assert (q.arch, q.family, q.qk_norm, q.qkv_bias, q.tie_embeddings) == (
        "qwen3", "llama", True, False, False)
    assert q.head_dim * q.n_heads != q.dim  # head_dim independent of hidden / heads
    g = _model("tiny_gemma2", "hf").config
    assert families.module_for(g).__name__.endswith("gemma3") and not g.qk_norm
    assert g.layer_windows == (8, None, 8, None)  # local first, alternating
    assert (g.attn_logit_softcapping, g.final_logit_softcapping) == (5.0, 3.0)
    assert g.attention_scale == common.SoftCappedScale(24 ** -0.5, 5.0)
    assert g.rope_local_theta == g.rope_theta
    p = _model("tiny_phi3", "hf").config
    assert (p.arch, p.rotary_dim, p.head_dim, p.max_seq_len) == ("phi3", 8, 16, 448)  # window cap
    lr = p.long_rope
    assert lr.original_max_position_embeddings == 64 and lr.long_factor == (1.5, 2.8, 6.0, 11.0)
    assert lr.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / 64) / math.log(64)))


def test_phi3_partial_rotary_and_longrope_matter():
    """Controls: the factor set and the rotated-dims count each change the tiny Phi-3's logits."""
    lm, ref = _model("tiny_phi3", "hf"), _ref("tiny_phi3")
    long_on_short = np.asarray(lm.forward(ref["short"][None]))[0, -1]
    assert _rel(long_on_short, ref["short_last"]) > 1e-2
    full = dataclasses.replace(lm, config=lm.config.replace(rotary_dim=None, long_rope=None))
    assert _rel(np.asarray(full.forward(ref["long"][None]))[0, -1], ref["long_last"]) > 1e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_weight_cache_round_trips_the_config(name):
    """Large GGUF files go through the weight cache, which stores the config as JSON."""
    for fmt in ("hf", "gguf"):
        cfg = _model(name, fmt).config
        assert cache_lib._config_from_json(cache_lib._config_to_json(cfg)) == cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(name):
    """The engine's greedy decode (cached) gives transformers' tokens, up to float ties."""
    lm, ref = _short(_model(name, "hf")), _ref(name)
    g = engine.generate(lm, [ref["short"].tolist()], SamplingParams(
        n=1, temperature=0.0, max_new_tokens=len(ref["greedy"]), stop_token_ids=[],
        ignore_eos=True))
    got = g.tokens[0, 0, :int(g.lengths[0, 0])]
    assert len(got) == len(ref["greedy"])
    for t, (a, b) in enumerate(zip(got, ref["greedy"])):
        if a != b:  # only where transformers' top two were within float noise
            assert ref["greedy_margins"][t] <= 1e-4, (t, a, b, ref["greedy_margins"][t])
            break
    assert (got[:2] == ref["greedy"][:2]).all() or min(ref["greedy_margins"][:2]) <= 1e-4


def _forward_logprobs(lm, prompt, gen, width):
    seq = list(prompt) + list(gen)
    row = np.zeros((1, width), np.int32)
    row[0, :len(seq)] = seq
    logits = np.asarray(lm.forward(row))[0, len(prompt) - 1:len(seq) - 1, :lm.vocab_limit]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_cached_decode_equals_full_forward(name):
    """Prompts past the window of 8 and tails of 24: the cached logprobs equal a full forward's."""
    lm, ref = _model(name, "hf"), _ref(name)
    prompts = [ref["long"][:40].tolist(), ref["short"].tolist()]
    g = engine.generate(lm, prompts, SamplingParams(n=3, max_new_tokens=24, seed=3,
                                                    stop_token_ids=[], ignore_eos=True))
    checked = 0
    for b in range(2):
        for n in range(3):
            L = int(g.lengths[b, n])
            want = _forward_logprobs(lm, g.prompt_tokens[b], g.tokens[b, n, :L], 72)
            np.testing.assert_allclose(g.logprobs[b, n, :L], want[np.arange(L), g.tokens[b, n, :L]],
                                       atol=1e-4, rtol=0, err_msg=f"{name} row {b} branch {n}")
            checked += L
    assert checked == 2 * 3 * 24


PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 8, 250, 31], [7, 7, 200]]


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("name", FAMILIES)
def test_shared_equals_naive_and_sharded(name):
    lm = _model(name, "hf")
    params = SamplingParams(n=4, max_new_tokens=16, seed=5, top_p=0.9, stop_token_ids=[])
    ref = engine.generate(lm, PROMPTS, params)
    assert_same_tokens_up_to_ties(lm, ref, naive_generate(lm, PROMPTS, params))
    if jax.device_count() < 4:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh((1, 4), ("data", "branch"))
    assert_same_tokens_up_to_ties(lm, ref, engine.generate(lm, PROMPTS, params, mesh=mesh))


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_bridge_and_shared_prefix(name):
    """A zero-init Bridge leaves the tokens as they are; a shared prefix equals the
    concatenated prompts (context across the window of 8 for Gemma 2)."""
    lm = _model(name, "hf")
    params = SamplingParams(n=3, max_new_tokens=12, seed=7, stop_token_ids=[])
    ref = engine.generate(lm, PROMPTS, params)
    bridge = bridge_lib.init(lm, bridge_lib.BridgeConfig(dim=8, n_heads=2))
    assert_same_tokens_up_to_ties(lm, ref, engine.generate(lm, PROMPTS, params, bridge=bridge))
    context = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111]
    got = engine.generate(lm, PROMPTS, params, shared_prefix=context)
    want = engine.generate(lm, [context + p for p in PROMPTS], params)
    assert got.prompt_tokens == want.prompt_tokens
    assert_same_tokens_up_to_ties(lm, want, got)


def _softcapped_attention_oracle(q, k, v, scale, cap, window):
    """float64 numpy: causal (windowed) attention with scores cap * tanh(q.k * scale / cap)."""
    S, H, D = q.shape
    K = k.shape[1]
    out = np.zeros((S, H, D))
    for h in range(H):
        kh = h // (H // K)
        s = (q[:, h] * scale) @ k[:, kh].T
        s = cap * np.tanh(s / cap)
        i, j = np.arange(S)[:, None], np.arange(S)[None, :]
        ok = (j <= i) & ((window is None) | (j > i - (window or 0)))
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, kh]
    return out


@pytest.mark.parametrize("impl", ["dense", "blockwise"])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_softcap_in_both_kernels(impl, window):
    """Gemma 2's score soft-cap, carried by the scale, in the dense and the blockwise kernel."""
    rng = np.random.default_rng(0)
    S, H, K, D = 40, 4, 2, 8
    q, k, v = (rng.normal(size=s).astype(np.float32) * 2 for s in ((S, H, D), (S, K, D), (S, K, D)))
    scale = common.SoftCappedScale(D ** -0.5, 2.0)
    got = common.causal_attend(window=window, scale=scale, impl=impl)(q, k, v)
    want = _softcapped_attention_oracle(q.astype(np.float64), k, v, D ** -0.5, 2.0, window)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    plain = common.causal_attend(window=window, scale=D ** -0.5, impl=impl)(q, k, v)
    assert np.abs(np.asarray(plain) - want).max() > 1e-2  # the cap matters at these scores


@pytest.mark.slow
def test_gemma2_softcaps_and_window_matter():
    """Controls: without either soft-cap or the window the tiny Gemma 2's logits change."""
    lm, ref = _model("tiny_gemma2", "hf"), _ref("tiny_gemma2")
    cfg = lm.config
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                   {"layer_windows": (None,) * cfg.n_layers}):
        other = dataclasses.replace(lm, config=cfg.replace(**change))
        got = np.asarray(other.forward(ref["long"][None]))[0, -1]
        assert _rel(got, ref["long_last"]) > 1e-2, change


def test_models_page_lists_the_registry():
    """The models page's table of architectures is the registry's list, in both columns."""
    text = (ROOT / "docs" / "how-to" / "models.md").read_text()
    section = text.split("\n## ", 1)[0]
    rows = [r.split("|") for r in section.splitlines() if r.startswith("| ") and "`" in r]
    hf = sorted(r[2].strip().strip("`") for r in rows)
    # A GGUF architecture may serve two rows (Mixtral is `llama` with experts);
    # a row without one says so with a dash.
    gg = sorted({g for r in rows for g in re.findall(r"^`([^`]+)`", r[3].strip())})
    assert hf == architectures.supported_hf_classes()
    assert gg == architectures.supported_gguf_archs()


def _hf(name, **changes):
    import json

    hf = json.loads((DATA / name / "config.json").read_text())
    hf.update(changes)
    return hf


@pytest.mark.parametrize("name, changes, error, match", [
    ("tiny_phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.5, "short_factor": [1.0] * 3,
                                       "long_factor": [1.0] * 4}},
     ModelLoadError, r"'rope_parameters'.short_factor must list rotary dims / 2 = 4"),
    ("tiny_phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.5, "short_factor": [1.0] * 4,
                                       "long_factor": [1.0, -2.0, 1.0, 1.0]}},
     ModelLoadError, "long_factor must be a finite number > 0"),
    ("tiny_phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.3125, "short_factor": [1.0] * 2,
                                       "long_factor": [1.0] * 2}},
     ModelLoadError, "partial_rotary_factor"),
    ("tiny_qwen3", {"partial_rotary_factor": 0.5}, UnsupportedModelError,
     "partial_rotary_factor is not supported for Qwen3ForCausalLM"),
    ("tiny_qwen3", {"use_sliding_window": True}, UnsupportedModelError, "use_sliding_window"),
    ("tiny_qwen3", {"attention_bias": True}, UnsupportedModelError, "attention_bias"),
    ("tiny_qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     UnsupportedModelError, "'longrope' is not supported for Qwen3ForCausalLM"),
    ("tiny_gemma2", {"attn_logit_softcapping": -1.0}, ModelLoadError, "attn_logit_softcapping"),
    ("tiny_gemma2", {"layer_types": ["full_attention"]}, ModelLoadError, "layer_types"),
])
def test_new_family_configs_are_validated(name, changes, error, match):
    from jaxsample.models.checkpoints import hf_loader

    with pytest.raises(error, match=match):
        hf_loader.config_from_hf(_hf(name, **changes), "d")


def test_gemma2_config_defaults_follow_transformers():
    from jaxsample.models.checkpoints import hf_loader

    hf = _hf("tiny_gemma2")
    for k in ("attn_logit_softcapping", "final_logit_softcapping", "layer_types",
              "query_pre_attn_scalar"):
        del hf[k]
    cfg = hf_loader.config_from_hf(hf, "d")  # Gemma2Config's defaults
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.layer_windows == (8, None, 8, None) and cfg.query_pre_attn_scalar == 256.0
    cfg = hf_loader.config_from_hf(_hf("tiny_gemma2", attn_logit_softcapping=None,
                                       final_logit_softcapping=None), "d")
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
