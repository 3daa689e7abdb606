"""The loader core (`models.loader_core`, `models.architectures`) and the families added on it.

Family parity data comes from `scripts/make_family_references.py` (torch and
transformers are not needed here).
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models import architectures, loader_core
from jaxsample.models.loader_core import Tensor, TensorTable

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
