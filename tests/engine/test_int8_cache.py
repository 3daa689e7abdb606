"""The weight cache's int8 entries (`load(weights="int8")`): a second int8 load reads the
int8 weights and their calibrated outlier channels back instead of calibrating and
quantising again; the oracle is the same load without the cache."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from checkpoint_files import corruptions, poison_entry
from paths import TINY_GGUF

from jaxsample import loading, weight_cache
from jaxsample.models.quantization import outliers, quant

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


def test_weight_only_int8_shares_the_entry_and_runs_weight_only(gguf):
    """`weights="int8-weight-only"`: the same int8 weights (one cache entry for both
    values), every QuantizedWeight in the weight-only mode; "int8" is W8A8."""
    path, base = gguf
    w8a8 = _load(path, base)
    loading._LOADED.clear()
    wo = loading.load(path, cache=base, weights="int8-weight-only")
    assert loading.load_info(wo)["quantized"] == "cache" and len(_int8_entries(base)) == 1
    modes = lambda lm: {a.mode for a in jax.tree_util.tree_leaves(lm.params, is_leaf=is_q)  # noqa: E731
                        if is_q(a)}
    assert modes(w8a8) == {"w8a8"} and modes(wo) == {"weight_only"}
    _assert_same(w8a8, dataclasses.replace(wo, params=quant.with_mode(wo.params, "w8a8")))


def test_int8_cache_off(gguf):
    path, base = gguf
    lm = loading.load(path, cache=False, weights="int8")
    assert loading.load_info(lm)["quantized"] == "calibrated"
    assert loading.load_info(lm)["cache_entry"] is None and not base.exists()


def _poison(entry):
    poison_entry(entry, nbytes=512)


@pytest.mark.parametrize("corrupt", corruptions() + [_poison], ids=lambda f: f.__name__)
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


def _edit_metadata(entry, edit, rehash=True):
    """Edit the entry's metadata; with `rehash`, as a writer would that stored it so
    (its meta_sha256 recomputed: the layout checks must catch it), else as a bit flip."""
    raw = entry.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header["__metadata__"])
    if rehash:
        header["__metadata__"]["meta_sha256"] = weight_cache.meta_digest(header["__metadata__"])
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


def _square_projection_unrotated(meta):
    """wo is square here: only the orientation check can tell [in, out] from [out, in]."""
    kinds = json.loads(meta["quantized"])
    kinds["layers.0.wo"] = {"rows": False, "transposed": False}
    meta["quantized"] = json.dumps(kinds)


def _not_a_bool(meta):
    kinds = json.loads(meta["quantized"])
    kinds["layers.0.wo"]["transposed"] = "no"
    meta["quantized"] = json.dumps(kinds)


def _config_bit_flip(meta):  # the tensors' CRC-32s do not cover the header
    meta["config"] = meta["config"].replace('"rope_theta": 10000.0', '"rope_theta": 11000.0')
    assert "11000.0" in meta["config"]


EDITS = [(_drop_a_weight, True), (_flip_orientation, True), (_other_recipe, True),
         (_square_projection_unrotated, True), (_not_a_bool, True), (_config_bit_flip, False)]


@pytest.mark.parametrize("edit,rehash", EDITS, ids=[f.__name__ for f, _ in EDITS])
def test_int8_entry_that_disagrees_with_itself_is_refused(gguf, edit, rehash, caplog):
    """Bytes intact (the CRC-32s pass) but the parts do not fit together, the entry was
    written for another calibration recipe, or its header changed after it was
    written: ignored with one warning, rewritten."""
    path, base = gguf
    want = _load(path, base)
    (entry,) = _int8_entries(base)
    _edit_metadata(entry, edit, rehash)
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


def test_an_int8_entry_that_cannot_be_written_is_not_claimed(gguf, caplog):
    """A float32 entry written and the int8 one not (a directory with a file in it
    squats its path, never ours to delete): one line says so, the model says it has no
    entry and the loaded line does not say "cached". An empty directory there is
    removed and the entry written."""
    from jaxsample.cli.app import _load_how

    path, base = gguf
    loading.load(path, cache=base)  # the float32 entry
    key = weight_cache.WeightKey.of(path, base)
    squat = weight_cache.int8_entry(base, key)
    squat.mkdir(parents=True)
    (squat / "keep.txt").write_text("the user's")
    lm = _load(path, base)
    info = loading.load_info(lm)
    assert info["quantized"] == "calibrated" and info["cache_entry"] is None
    assert _load_how(info) == "calibrated and quantised to int8"
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert "is a directory" in msg and "not rewritten" in msg
    assert (squat / "keep.txt").read_text() == "the user's"
    (squat / "keep.txt").unlink()
    caplog.clear()
    lm = _load(path, base)
    assert loading.load_info(lm)["cache_entry"] == str(squat) and squat.is_file()
    assert [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"
            if "rewriting" not in r.getMessage()] == []


def test_a_file_where_the_cache_dir_would_be_is_no_entry(tmp_path, monkeypatch, caplog):
    """ENOTDIR on reading is an absent entry (no "unusable entry" line), on writing a
    warning; the model loads as without a cache."""
    monkeypatch.setattr(weight_cache, "WEIGHT_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(loading, "_LOADED", {})
    path = tmp_path / "model.gguf"
    shutil.copy(TINY_GGUF, path)
    blocker = tmp_path / "cache"
    blocker.write_text("not a directory")
    lm = loading.load(path, cache=blocker / "inner", weights="int8")
    msgs = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert msgs and all("weight cache not written" in m for m in msgs)
    _assert_same(loading.load(path, cache=False, weights="int8"), lm)
