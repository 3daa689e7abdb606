"""The weight cache's int8 entries (`load(weights="int8")`): a second int8 load reads the
int8 weights and their calibrated outlier channels back instead of calibrating and
quantising again; the oracle is the same load without the cache."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from jaxsample import loading, weight_cache
from jaxsample.models import outliers, quant
from test_cache import TINY_GGUF, _corruptions, _poison_entry

is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A private copy of the tiny GGUF, cached despite its size, in an empty cache dir."""
    monkeypatch.setattr(weight_cache, "WEIGHT_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(loading, "_LOADED", {})
    path = tmp_path / "model.gguf"
    shutil.copy(TINY_GGUF, path)
    return path, tmp_path / "cache"


def _load(path, base, dtype="float32"):
    loading._LOADED.clear()
    return loading.load(path, dtype=dtype, cache=base, weights="int8")


def _int8_entries(base):
    return sorted((base / "weights").glob("*-int8-*.safetensors"))


def _float_entries(base):
    return sorted(set((base / "weights").glob("*.safetensors")) - set(_int8_entries(base)))


def _assert_same(a, b):
    """The same tree (QuantizedWeight's orientation, mode and compute dtype included)
    with bit-identical leaves of the same dtypes."""
    la, ta = jax.tree_util.tree_flatten(a.params)
    lb, tb = jax.tree_util.tree_flatten(b.params)
    assert ta == tb and len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert a.config == b.config


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_int8_load_reads_the_int8_entry_bit_identical(gguf, dtype):
    path, base = gguf
    plain = loading.load(path, dtype=dtype, cache=False, weights="int8")
    first = _load(path, base, dtype)
    info = loading.load_info(first)
    assert info["quantized"] == "calibrated" and info["weights"] == "checkpoint"
    (entry,) = _int8_entries(base)
    assert info["cache_entry"] == str(entry) and len(_float_entries(base)) == 1
    second = _load(path, base, dtype)
    info = loading.load_info(second)
    assert info == {**info, "quantized": "cache", "weights": "cache", "cache_entry": str(entry)}
    assert second.params["layers"][0]["wq+wk+wv"].outliers is not None  # the channels came back
    _assert_same(plain, first)
    _assert_same(plain, second)
    # The entry is the float32 product: the other activation dtype reads it too.
    other = "bfloat16" if dtype == "float32" else "float32"
    assert loading.load_info(_load(path, base, other))["quantized"] == "cache"
    _assert_same(loading.load(path, dtype=other, cache=False, weights="int8"),
                 _load(path, base, other))
    # A float load keeps its own entry and leaves the int8 one alone.
    loading._LOADED.clear()
    assert loading.load_info(loading.load(path, cache=base))["weights"] == "cache"
    assert _int8_entries(base) == [entry] and len(_float_entries(base)) == 1


def test_int8_cache_off(gguf):
    path, base = gguf
    lm = loading.load(path, cache=False, weights="int8")
    assert loading.load_info(lm)["quantized"] == "calibrated"
    assert loading.load_info(lm)["cache_entry"] is None and not base.exists()


def _poison(entry):
    _poison_entry(entry, nbytes=512)


@pytest.mark.parametrize("corrupt", _corruptions() + [_poison], ids=lambda f: f.__name__)
def test_corrupt_int8_entry_is_ignored_and_rewritten(gguf, corrupt, caplog):
    path, base = gguf
    want = _load(path, base)
    (entry,) = _int8_entries(base)
    corrupt(entry)
    caplog.clear()
    lm = _load(path, base)
    assert loading.load_info(lm)["quantized"] == "calibrated"
    _assert_same(want, lm)
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert str(entry) in msg and "\n" not in msg
    assert loading.load_info(_load(path, base))["quantized"] == "cache"  # rewritten whole
    assert _int8_entries(base) == [entry]


def _edit_metadata(entry, edit):
    raw = entry.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header["__metadata__"])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    entry.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _drop_a_weight(meta):
    kinds = json.loads(meta["quantized"])
    kinds.pop(next(iter(kinds)))
    meta["quantized"] = json.dumps(kinds)


def _flip_orientation(meta):
    kinds = json.loads(meta["quantized"])
    kinds["embed"]["rows"] = not kinds["embed"]["rows"]
    meta["quantized"] = json.dumps(kinds)


def _other_recipe(meta):
    meta["recipe"] = "0" * 16


@pytest.mark.parametrize("edit", [_drop_a_weight, _flip_orientation, _other_recipe],
                         ids=lambda f: f.__name__)
def test_int8_entry_that_disagrees_with_itself_is_refused(gguf, edit, caplog):
    """Bytes intact (the CRC-32s pass) but the parts do not fit together, or the entry
    was written for another calibration recipe: ignored with one warning, rewritten."""
    path, base = gguf
    want = _load(path, base)
    (entry,) = _int8_entries(base)
    _edit_metadata(entry, edit)
    caplog.clear()
    lm = _load(path, base)
    assert loading.load_info(lm)["quantized"] == "calibrated"
    _assert_same(want, lm)
    assert len([r for r in caplog.records if r.name == "jaxsample.disk_cache"]) == 1


def test_a_new_calibration_recipe_replaces_the_int8_entry(gguf, monkeypatch):
    path, base = gguf
    _load(path, base)
    (old,) = _int8_entries(base)
    (flt,) = _float_entries(base)
    monkeypatch.setattr(outliers, "RECIPE", "another-recipe")
    lm = _load(path, base)
    assert loading.load_info(lm)["quantized"] == "calibrated"
    (new,) = _int8_entries(base)
    assert new != old and not old.exists() and _float_entries(base) == [flt]
    assert loading.load_info(_load(path, base))["quantized"] == "cache"


def test_check_quantized_names_the_weight():
    w = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    good = quant.quantize(w, outliers=[3, 9])
    quant.check_quantized(good, "layers.0.wq")
    idx, keep, w_out = good.outliers
    bad = [
        quant.QuantizedWeight(good.q.astype(np.int16), good.scale, good.outliers),
        quant.QuantizedWeight(good.q, good.scale[:-1], good.outliers),
        quant.QuantizedWeight(good.q, good.scale, (idx[::-1].copy(), keep, w_out)),
        quant.QuantizedWeight(good.q, good.scale, (idx, np.ones_like(keep), w_out)),
        quant.QuantizedWeight(good.q, good.scale, (idx, keep, w_out[:1])),
        quant.QuantizedWeight(good.q, good.scale, (idx + 62, keep, w_out)),
    ]
    for w_bad in bad:
        with pytest.raises(ValueError, match=r"^layers\.0\.wq: "):
            quant.check_quantized(w_bad, "layers.0.wq")


def test_the_loaded_line_says_where_int8_weights_came_from(gguf):
    """`jaxsample run`'s "loaded ... (how)" line, from `load_info` of real loads."""
    from jaxsample.cli.app import _load_how

    path, base = gguf
    assert _load_how(loading.load_info(_load(path, base))) == \
        "calibrated and quantised to int8; cached for the next run"
    assert _load_how(loading.load_info(_load(path, base))) == "int8 weights from the cache"
    loading._LOADED.clear()  # the process memo would answer the cached model
    assert _load_how(loading.load_info(loading.load(path, cache=False, weights="int8"))) == \
        "calibrated and quantised to int8"
    loading._LOADED.clear()
    assert _load_how(loading.load_info(loading.load(path, cache=base))) == \
        "dequantised weights from the cache"
