"""The on-disk caches (jaxsample/cache.py): the weight cache of GGUF files and JAX's
persistent compilation cache (AOT programs included)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest

from jaxsample import cache, loading

DATA = pathlib.Path(__file__).parent / "data"
TINY_GGUF = DATA / "tiny_llama.gguf"
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A private copy of the tiny GGUF, cached despite its size, in an empty cache dir."""
    monkeypatch.setattr(cache, "WEIGHT_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(loading, "_LOADED", {})  # no in-process memo between loads
    path = tmp_path / "model.gguf"
    shutil.copy(TINY_GGUF, path)
    return path, tmp_path / "cache"


def _load(path, base, dtype="float32"):
    loading._LOADED.clear()
    return loading.load(path, dtype=dtype, cache=base)


def _leaves(lm):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(lm.params)]


def _entries(base):
    return sorted((base / "weights").glob("*.safetensors"))


# ---------------------------------------------------------------------------
# where


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_OFF, raising=False)
    monkeypatch.delenv(cache.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "jaxsample"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignore relative paths
    assert cache.cache_dir() == pathlib.Path.home() / ".cache" / "jaxsample"
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"
    for off in ("1", "yes", "true"):
        monkeypatch.setenv(cache.ENV_OFF, off)
        assert cache.cache_dir() is None and cache.cache_disabled()
    for on in ("", "0", "no", "off"):
        monkeypatch.setenv(cache.ENV_OFF, on)
        assert cache.cache_dir() == tmp_path / "mine"


# ---------------------------------------------------------------------------
# weights


def test_second_load_reads_the_cache_bit_identical(gguf):
    path, base = gguf
    plain = loading.load(path, cache=False)
    assert loading.load_info(plain)["weights"] == "checkpoint" and not base.exists()
    first = _load(path, base)
    info = loading.load_info(first)
    assert info["weights"] == "checkpoint" and pathlib.Path(info["cache_entry"]).is_file()
    second = _load(path, base)
    assert loading.load_info(second)["weights"] == "cache" and second is not first
    assert second.config == first.config == plain.config
    for a, b, c in zip(_leaves(first), _leaves(second), _leaves(plain)):
        assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c)
    t1, t2 = first.tokenizer, second.tokenizer
    for text in ("Hello, world! 3 + 4 = 7", "café ünïcode ✓", "<|im_start|>user\nhi<|im_end|>"):
        assert t1.encode(text) == t2.encode(text)
    ids = t1.encode("café ünïcode ✓ and more")
    assert t1.decode(ids) == t2.decode(ids)
    assert (t1.vocab_size, t1.bos_token_id, t1.eos_token_ids, t1.pad_token_id, t1.add_bos,
            t1.chat_template) == (t2.vocab_size, t2.bos_token_id, t2.eos_token_ids,
                                  t2.pad_token_id, t2.add_bos, t2.chat_template)
    # bfloat16: the same cast of the same float32 weights
    b1, b2 = loading.load(path, dtype="bfloat16", cache=False), _load(path, base, "bfloat16")
    assert loading.load_info(b2)["weights"] == "cache"
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16))
               for a, b in zip(_leaves(b1), _leaves(b2)))
    # read_config / read_model answer from the entry without touching the tensors
    assert loading.read_config(path, cache=base) == first.config
    cfg, tok = loading.read_model(path, cache=base)
    assert cfg == first.config and tok.encode("abc") == t1.encode("abc")


def _corruptions():
    def truncate(p):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    def garbage(p):
        p.write_bytes(b"\x00" * 8 + b"not a safetensors file")

    def empty(p):
        p.write_bytes(b"")

    def header_json(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        p.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])

    def wrong_shape(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [1] + header[name]["shape"]
        header[name]["data_offsets"] = header[name]["data_offsets"]  # now inconsistent
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    def bad_tokenizer(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header["__metadata__"]["tokenizer"] = "{not json"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    return [truncate, garbage, empty, header_json, wrong_shape, bad_tokenizer]


@pytest.mark.parametrize("corrupt", _corruptions(), ids=lambda f: f.__name__)
def test_corrupt_entry_is_ignored_and_rewritten(gguf, corrupt):
    path, base = gguf
    want = _leaves(_load(path, base))
    (entry,) = _entries(base)
    corrupt(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a corrupt entry is silently replaced
        lm = _load(path, base)
    assert loading.load_info(lm)["weights"] == "checkpoint"
    assert all(np.array_equal(a, b) for a, b in zip(want, _leaves(lm)))
    assert loading.load_info(_load(path, base))["weights"] == "cache"  # rewritten whole
    assert _entries(base) == [entry]


def test_stale_entry_is_replaced_when_the_file_changes(gguf):
    path, base = gguf
    _load(path, base)
    (old,) = _entries(base)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # a new modification time: a new key
    lm = _load(path, base)
    assert loading.load_info(lm)["weights"] == "checkpoint"
    (new,) = _entries(base)  # the old entry of the same file is gone
    assert new != old
    assert loading.load_info(_load(path, base))["weights"] == "cache"


def test_unwritable_cache_dir_only_warns(gguf, tmp_path):
    path, _ = gguf
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="weight cache not written"):
        lm = _load(path, blocker / "cache")
    assert loading.load_info(lm)["weights"] == "checkpoint"


def test_small_files_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "_LOADED", {})
    path = tmp_path / "model.gguf"
    shutil.copy(TINY_GGUF, path)
    lm = loading.load(path, cache=tmp_path / "cache")
    assert loading.load_info(lm)["cache_entry"] is None and not (tmp_path / "cache").exists()


def test_entry_is_a_safetensors_file(gguf):
    safetensors = pytest.importorskip("safetensors")
    path, base = gguf
    lm = _load(path, base)
    (entry,) = _entries(base)
    with safetensors.safe_open(str(entry), "np") as f:
        meta = f.metadata()
        assert meta["format"] == cache.FORMAT and meta["source"] == str(path)
        assert np.array_equal(f.get_tensor("embed"), np.asarray(lm.params["embed"]))


# ---------------------------------------------------------------------------
# JAX's persistent compilation cache


_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    import jaxsample, jaxsample.cli, jaxsample.engine   # importing changes no JAX setting
    before = jax.config.jax_compilation_cache_dir
    from jaxsample import cache
    used = cache.enable_compilation_cache(sys.argv[1])
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    import jax.numpy as jnp
    f = lambda x: jnp.tanh(x @ x.T).sum()
    from jaxsample.engine.loop import Programs
    compiled, seconds = Programs().get(("test",), f, (jnp.ones((16, 16)),))
    print(json.dumps({"before": before, "dir": str(used), "hits": len(hits)}))
""")


def test_aot_programs_hit_the_persistent_cache(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop(cache.ENV_OFF, None)

    def child():
        out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "xla")], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = child()
    assert first["before"] is None  # no import sets the cache
    assert first["dir"] == str(tmp_path / "xla") and first["hits"] == 0
    files = sorted(p.name for p in (tmp_path / "xla").iterdir())
    assert any(name.startswith("jit_") for name in files)
    second = child()  # a fresh process: the AOT compile is read back, nothing new written
    assert second["hits"] >= 1
    assert sorted(p.name for p in (tmp_path / "xla").iterdir()) == files


def test_enable_compilation_cache_off_and_unwritable(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.ENV_OFF, "1")
    assert cache.enable_compilation_cache() is None  # nothing changed
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.warns(UserWarning, match="compilation cache off"):
        assert cache.enable_compilation_cache(blocker / "xla") is None
