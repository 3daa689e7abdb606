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
from paths import DATA

from jaxsample import cache_paths, file_hashes, loading, weight_cache
from jaxsample import disk_cache as cache

TINY_GGUF = DATA / "tiny_llama.gguf"
from checkpoint_files import corruptions, poison_entry, rewrite_gguf, rewrite_in_place
from paths import ROOT


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A private copy of the tiny GGUF, cached despite its size, in an empty cache dir."""
    monkeypatch.setattr(weight_cache, "WEIGHT_CACHE_MIN_BYTES", 0)
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
    monkeypatch.delenv(cache_paths.ENV_OFF, raising=False)
    monkeypatch.delenv(cache_paths.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_paths.cache_dir() == tmp_path / "xdg" / "jaxsample"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: ignore relative paths
    assert cache_paths.cache_dir() == pathlib.Path.home() / ".cache" / "jaxsample"
    monkeypatch.setenv(cache_paths.ENV_DIR, str(tmp_path / "mine"))
    assert cache_paths.cache_dir() == tmp_path / "mine"
    for off in ("1", "yes", "true"):
        monkeypatch.setenv(cache_paths.ENV_OFF, off)
        assert cache_paths.cache_dir() is None and cache_paths.cache_disabled()
    for on in ("", "0", "no", "off"):
        monkeypatch.setenv(cache_paths.ENV_OFF, on)
        assert cache_paths.cache_dir() == tmp_path / "mine"


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



@pytest.mark.parametrize("corrupt", corruptions(), ids=lambda f: f.__name__)
def test_corrupt_entry_is_ignored_and_rewritten(gguf, corrupt, caplog):
    path, base = gguf
    want = _leaves(_load(path, base))
    (entry,) = _entries(base)
    corrupt(entry)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no Python warning: one log line
        lm = _load(path, base)
    assert loading.load_info(lm)["weights"] == "checkpoint"
    assert all(np.array_equal(a, b) for a, b in zip(want, _leaves(lm)))
    (record,) = [r for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert record.levelname == "WARNING" and str(entry) in record.getMessage()
    assert "\n" not in record.getMessage()
    assert loading.load_info(_load(path, base))["weights"] == "cache"  # rewritten whole
    assert _entries(base) == [entry]


def _tensor_offsets(path, name="output_norm.weight"):
    import gguf as gguf_py

    t = next(t for t in gguf_py.GGUFReader(path).tensors if t.name == name)
    assert t.tensor_type == gguf_py.GGMLQuantizationType.F32
    return int(t.data_offset), int(t.n_bytes)



def _double_output_norm(path):
    lo, n = _tensor_offsets(path)
    old = np.fromfile(path, np.float32, n // 4, offset=lo)
    rewrite_in_place(path, lo, (2 * old + 1).astype(np.float32).tobytes())


def test_new_content_at_the_same_path_replaces_its_entry(gguf):
    path, base = gguf
    _load(path, base)
    (old,) = _entries(base)
    _double_output_norm(path)
    lm = _load(path, base)
    assert loading.load_info(lm)["weights"] == "checkpoint"
    (new,) = _entries(base)  # the old entry of the same file is gone: one entry per path
    assert new != old
    assert loading.load_info(_load(path, base))["weights"] == "cache"
    want = loading.load(path, cache=False)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(want), _leaves(lm)))


def test_same_content_with_a_new_mtime_is_the_same_entry(gguf):
    """Re-assembling or re-copying a file (a new mtime, the same bytes) neither
    dequantises again nor adds an entry."""
    path, base = gguf
    _load(path, base)
    (entry,) = _entries(base)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    info = loading.load_info(_load(path, base))
    assert (info["weights"], info["cache_entry"]) == ("cache", str(entry))
    shutil.copy(path, path.with_name("x.gguf"))
    os.replace(path.with_name("x.gguf"), path)  # a new file (inode) with the same bytes
    info = loading.load_info(_load(path, base))
    assert (info["weights"], info["cache_entry"]) == ("cache", str(entry))
    assert _entries(base) == [entry]


def test_content_changed_past_16_mib_with_size_and_mtime_kept(tmp_path, monkeypatch):
    """the key covers the whole file. Tensor bytes past the first 16 MiB
    change, size and mtime are kept: the new weights load, not the old entry's."""
    import gguf as gguf_py

    monkeypatch.setattr(loading, "_LOADED", {})
    path = rewrite_gguf(TINY_GGUF, tmp_path / "big.gguf", kv={
        "general.description": ("x" * (17 * 2**20), gguf_py.GGUFValueType.STRING)})
    assert _tensor_offsets(path)[0] > 16 * 2**20 <= path.stat().st_size
    base = tmp_path / "cache"
    before = np.array(_load(path, base).params["final_norm"])  # a copy: the load may alias
    _double_output_norm(path)
    second = _load(path, base)
    assert loading.load_info(second)["weights"] == "checkpoint"
    want = loading.load(path, cache=False).params["final_norm"]
    assert np.array_equal(np.asarray(second.params["final_norm"]), np.asarray(want))
    assert not np.array_equal(before, np.asarray(want))
    assert len(_entries(base)) == 1
    third = _load(path, base)
    assert loading.load_info(third)["weights"] == "cache"
    assert np.array_equal(np.asarray(third.params["final_norm"]), np.asarray(want))
    # in one process too: load()'s own memo is keyed by the file's stat (ctime included)
    rewrite_in_place(path, _tensor_offsets(path)[0], np.asarray(before).tobytes())
    fourth = loading.load(path, cache=base)
    assert fourth is not third and np.array_equal(np.asarray(fourth.params["final_norm"]), before)


def test_the_full_hash_is_remembered_by_stat(gguf, monkeypatch):
    """The whole-file SHA-256 is computed once per (device, inode, size, mtime, ctime):
    a second process reads it from the index; a rewrite (a new ctime) hashes again."""
    path, base = gguf
    monkeypatch.setattr(file_hashes, "RACY_NS", 0)
    monkeypatch.setattr(file_hashes, "_HASHES", {})
    calls = []
    real = file_hashes.file_sha256
    monkeypatch.setattr(file_hashes, "file_sha256", lambda p: calls.append(p) or real(p))
    import hashlib

    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert file_hashes.source_sha256(path, base) == (want, False) and len(calls) == 1
    assert file_hashes.source_sha256(path, base) == (want, True) and len(calls) == 1
    file_hashes.forget()  # a new process: the index on disk answers
    assert file_hashes.source_sha256(path, base) == (want, True) and len(calls) == 1
    index = json.loads((base / "weights" / file_hashes.HASH_INDEX).read_text())
    assert [v["sha256"] for v in index.values()] == [want]
    rewrite_in_place(path, 0, path.read_bytes()[:4])  # same bytes, but ctime moves on
    file_hashes.forget()
    assert file_hashes.source_sha256(path, base) == (want, False) and len(calls) == 2
    index = json.loads((base / "weights" / file_hashes.HASH_INDEX).read_text())
    assert len(index) == 1  # one hash per path


def test_a_file_changed_just_now_is_hashed_again(gguf, monkeypatch):
    """'Racy git': a change within one timestamp tick would keep the stat id, so a
    hash of a file younger than RACY_NS is not remembered."""
    path, base = gguf
    monkeypatch.setattr(file_hashes, "_HASHES", {})
    monkeypatch.setattr(file_hashes, "RACY_NS", 3600 * 10**9)
    assert file_hashes.source_sha256(path, base)[1] is False
    assert file_hashes.source_sha256(path, base)[1] is False
    assert not (base / "weights" / file_hashes.HASH_INDEX).exists()



def test_poisoned_tensor_bytes_are_caught_warned_and_rewritten(gguf, caplog):
    """the entry's tensors carry a CRC-32, checked on load."""
    path, base = gguf
    want = _leaves(_load(path, base))
    (entry,) = _entries(base)
    poison_entry(entry)
    caplog.clear()
    lm = _load(path, base)
    info = loading.load_info(lm)
    assert info["weights"] == "checkpoint" and info["cache_entry"] == str(entry)
    assert all(np.isfinite(a).all() for a in _leaves(lm))
    assert all(np.array_equal(a, b) for a, b in zip(want, _leaves(lm)))
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert "weight cache" in msg and str(entry) in msg and "CRC-32" in msg
    again = _load(path, base)  # rewritten: read from the cache, finite, no new warning
    assert loading.load_info(again)["weights"] == "cache"
    assert all(np.array_equal(a, b) for a, b in zip(want, _leaves(again)))
    assert len([r for r in caplog.records if r.name == "jaxsample.disk_cache"]) == 1
    assert b"\xff" * 4096 not in entry.read_bytes()


_POISONED_RUN = textwrap.dedent("""
    import sys
    from jaxsample import weight_cache
    from jaxsample import cli
    weight_cache.WEIGHT_CACHE_MIN_BYTES = 0
    sys.exit(cli.main(["run", "--model", sys.argv[1], "--prompt", "hi", "--n", "2",
                       "--max-new-tokens", "2", "--chat" if False else "--no-chat",
                       "--reduce", "none", "--json", "-q"]))
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_warns_once_about_a_poisoned_entry_and_runs(gguf, tmp_path):
    """The command line after a poisoned entry: one stderr line naming the cache entry,
    then a normal run (not "the weights hold NaN"), and the entry is rewritten."""
    path, base = gguf
    _load(path, base)
    (entry,) = _entries(base)
    poison_entry(entry)
    env = {**os.environ, cache_paths.ENV_DIR: str(base), "JAX_PLATFORMS": "cpu"}

    def run():
        return subprocess.run([sys.executable, "-c", _POISONED_RUN, str(path)], env=env,
                              capture_output=True, text=True, timeout=600, cwd=ROOT)

    out = run()
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "weight cache" in ln]
    assert len(lines) == 1 and str(entry) in lines[0] and lines[0].startswith("jaxsample: ")
    assert json.loads(out.stdout)["branches"]
    out = run()
    assert out.returncode == 0 and "weight cache" not in out.stderr, out.stderr


_WRITER = textwrap.dedent("""
    import sys
    from jaxsample import loading
    from jaxsample import weight_cache
    weight_cache.WEIGHT_CACHE_MIN_BYTES = 0
    lm = loading.load(sys.argv[1], cache=sys.argv[2])
    print(loading.load_info(lm)["weights"])
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_concurrent_writers_leave_one_good_entry(gguf):
    path, base = gguf
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(base)], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    (entry,) = _entries(base)
    assert [f.name for f in (base / "weights").iterdir() if f.name.endswith(".tmp")] == []
    key = weight_cache.WeightKey.of(path, base)
    cfg, params, _ = weight_cache.load_weights(entry, key)  # verifies every CRC-32
    lm = _load(path, base)
    assert loading.load_info(lm)["weights"] == "cache"
    want = loading.load(path, cache=False)
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(want), _leaves(lm)))


def test_unwritable_cache_dir_only_warns(gguf, tmp_path, caplog):
    path, _ = gguf
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    lm = _load(path, blocker / "cache")
    assert loading.load_info(lm)["weights"] == "checkpoint"
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
    assert "weight cache not written" in msg and "\n" not in msg


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
        assert meta["format"] == weight_cache.FORMAT and meta["source"] == str(path)
        assert np.array_equal(f.get_tensor("embed"), np.asarray(lm.params["embed"]))


# ---------------------------------------------------------------------------
# JAX's persistent compilation cache


_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    import jaxsample, jaxsample.cli, jaxsample.engine   # importing changes no JAX setting
    before = jax.config.jax_compilation_cache_dir
    from jaxsample import disk_cache as cache
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


@pytest.mark.slow
@pytest.mark.subprocess
def test_aot_programs_hit_the_persistent_cache(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop(cache_paths.ENV_OFF, None)

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


def test_enable_compilation_cache_off_and_unwritable(monkeypatch, tmp_path, caplog):
    """Off, a path that cannot be created and a directory that cannot be written: one
    warning line each and the cache left off (JAX would warn twice per program)."""
    monkeypatch.setenv(cache_paths.ENV_OFF, "1")
    assert cache.enable_compilation_cache() is None  # nothing changed
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cache.enable_compilation_cache(blocker / "xla") is None
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    monkeypatch.setattr(cache.tempfile, "TemporaryFile",
                        lambda dir: (_ for _ in ()).throw(PermissionError(13, "denied", dir)))
    before = jax.config.jax_compilation_cache_dir
    try:  # a filled cache on a read-only disk is still read (root may write anywhere)
        assert cache.enable_compilation_cache(read_only, exported=False) == read_only
        assert jax.config.jax_compilation_cache_dir == str(read_only)
    finally:
        msgs = [r.getMessage() for r in caplog.records if r.name == "jaxsample.disk_cache"]
        monkeypatch.undo()
        cache.enable_compilation_cache(before, min_compile_time_s=0.5)  # as tests/conftest.py
    assert len(msgs) == 2 and all("\n" not in m for m in msgs)
    assert "compilation cache off" in msgs[0] and "read-only" in msgs[1]


def test_compilation_cache_rewrites_only_what_it_read_and_could_not_use(tmp_path, caplog,
                                                                        monkeypatch):
    """The wrapper of JAX's LRUCache (installed by tests/conftest.py's
    enable_compilation_cache): a key read here and written again (JAX compiled it: the
    file was unusable) is replaced atomically, with one line; a key another process
    wrote after this one found nothing is left as JAX leaves it, without a word; a
    directory with files at an entry's path is a miss, named and left alone; a new
    key's entry is written to a temporary file and renamed (another process reads all
    of it or nothing), where JAX writes the file in place."""
    from jax._src import lru_cache

    from jaxsample import xla_cache

    c = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    with monkeypatch.context() as m:  # JAX's in-place write is not taken
        m.setattr(pathlib.Path, "write_bytes", lambda *a: pytest.fail("written in place"))
        c.put("new", b"whole")
    assert (tmp_path / "new-cache").read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new-cache"]  # no temporary left
    with monkeypatch.context() as m:  # no temporary file: JAX's own write (and warning)
        m.setattr(xla_cache, "atomic_write", lambda *a: False)
        c.put("fallback", b"in place")
    assert (tmp_path / "fallback-cache").read_bytes() == b"in place"
    assert c.get("raced") is None
    (tmp_path / "raced-cache").write_bytes(b"another process's")
    c.put("raced", b"ours")
    assert (tmp_path / "raced-cache").read_bytes() == b"another process's" and not caplog.records
    (tmp_path / "bad-cache").write_bytes(b"corrupt")
    assert c.get("bad") == b"corrupt"
    c.put("bad", b"fresh")
    assert (tmp_path / "bad-cache").read_bytes() == b"fresh"
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "bad-cache was unusable; rewritten" in msg
    caplog.clear()
    (tmp_path / "squat-cache").mkdir()
    (tmp_path / "squat-cache" / "keep.txt").write_text("the user's")
    assert c.get("squat") is None
    c.put("squat", b"x")
    assert (tmp_path / "squat-cache" / "keep.txt").read_text() == "the user's"
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "is a directory" in msg


_CORRUPT_CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    from jaxsample import disk_cache as cache
    cache.enable_compilation_cache(sys.argv[1])
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum()).lower(jnp.ones((16, 16))).compile()
    print(json.dumps({"hits": len(hits)}))
""")


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_corrupt_compilation_cache_entry_is_rewritten(tmp_path):
    """JAX skips writing a key whose file exists, so an entry it cannot read was
    compiled again in every process; now the fresh executable replaces it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop(cache_paths.ENV_OFF, None)
    xla = tmp_path / "xla"

    def child():
        out = subprocess.run([sys.executable, "-c", _CORRUPT_CHILD, str(xla)], env=env,
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])["hits"], out.stderr

    assert child()[0] == 0
    entries = [p for p in xla.iterdir() if p.name.startswith("jit_")]
    assert entries
    good = {p: p.read_bytes() for p in entries}
    for p in entries:
        p.write_bytes(b"not an executable")
    hits, err = child()  # unreadable: compiled again, and the entry rewritten
    assert hits == 0 and "compilation cache entry" in err and "rewritten" in err
    assert "Error reading" not in err  # JAX's own warning: ours replaces it
    assert all(p.read_bytes() != b"not an executable" and len(p.read_bytes()) > 100
               for p in entries)
    assert child()[0] >= 1  # and read back by the next process
    assert {p.name for p in good} == {p.name for p in xla.iterdir() if p.name.startswith("jit_")}


def test_a_cache_dir_naming_an_unknown_home_is_a_config_error(monkeypatch):
    from jaxsample.errors import ConfigError

    monkeypatch.setenv(cache_paths.ENV_DIR, "~no-such-user-jaxsample/x")
    with pytest.raises(ConfigError, match="JAXSAMPLE_CACHE_DIR"):
        cache_paths.cache_root()
    monkeypatch.setenv(cache_paths.ENV_DIR, os.environ["XDG_CACHE_HOME"])
    with pytest.raises(ConfigError, match=r"enable_compilation_cache\(path=...\)"):
        cache.enable_compilation_cache("~no-such-user-jaxsample/xla")


# ---------------------------------------------------------------------------
# Where everything is written


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_suite_uses_a_temporary_cache():
    """tests/conftest.py points every cache at a session directory before jaxsample is
    imported; subprocesses inherit it; the user's ~/.cache is never the cache."""
    import conftest

    user = pathlib.Path.home() / ".cache"
    d = cache_paths.cache_dir()
    assert d == pathlib.Path(conftest.TEST_CACHE_DIR) / "jaxsample"
    assert d != user / "jaxsample" and user not in d.parents
    assert os.environ["XDG_CACHE_HOME"] == conftest.TEST_CACHE_DIR
    assert cache_paths.models_dir() == d / "models"
    out = subprocess.run([sys.executable, "-c", "from jaxsample import cache_paths; "
                          "print(cache_paths.cache_dir()); print(cache_paths.models_dir())"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.split() == [str(d), str(d / "models")], out.stderr


@pytest.fixture
def fake_assembled(monkeypatch, tmp_path):
    """An AssembledModel whose module writes the tiny GGUF in place, as the Gemma
    package's assemble(output_path, overwrite) does; calls are recorded."""
    import types

    from jaxsample.models.checkpoints import registry

    calls = []

    def assemble(output_path=None, overwrite=False):
        target = pathlib.Path(output_path) if output_path is not None else \
            tmp_path / "package-default" / "fake.gguf"
        calls.append((target, overwrite))
        if target.exists() and not overwrite:
            if target.read_bytes() != TINY_GGUF.read_bytes():
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(TINY_GGUF.read_bytes())
        return target

    monkeypatch.setitem(sys.modules, "fake_assembler", types.SimpleNamespace(assemble=assemble))
    entry = registry.AssembledModel(name="fake-assembled", distributions=(), version="0",
                                    module="fake_assembler", function="assemble",
                                    filename="fake.gguf", description="test")
    monkeypatch.setitem(registry.EMBEDDED_MODELS, "fake-assembled", entry)
    registry._assembled_path.cache_clear()
    yield calls
    registry._assembled_path.cache_clear()


def test_assembled_models_go_under_the_cache_dir(fake_assembled, monkeypatch, tmp_path):
    from jaxsample.models.checkpoints import registry

    monkeypatch.delenv(cache_paths.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    want = tmp_path / "xdg" / "jaxsample" / "models" / "fake.gguf"
    assert registry.embedded_path("fake-assembled") == want
    assert want.read_bytes() == TINY_GGUF.read_bytes()
    assert not (tmp_path / "package-default").exists()
    assert [f.name for f in want.parent.iterdir()] == ["fake.gguf"]  # no temporary left
    monkeypatch.setenv(cache_paths.ENV_DIR, str(tmp_path / "mine"))
    monkeypatch.setenv(cache_paths.ENV_OFF, "1")  # caches off: the checkpoint is still written
    mine = tmp_path / "mine" / "models" / "fake.gguf"
    assert registry.embedded_path("fake-assembled") == mine and mine.is_file()
    n = len(fake_assembled)
    assert registry.embedded_path("fake-assembled") == mine and len(fake_assembled) == n
    mine.unlink()  # `jaxsample cache clear`: assembled again on the next call
    assert registry.embedded_path("fake-assembled") == mine and mine.is_file()
    registry._assembled_path.cache_clear()
    mine.write_bytes(b"GGUF broken")  # a wrong file is replaced, atomically
    assert registry.embedded_path("fake-assembled") == mine
    assert mine.read_bytes() == TINY_GGUF.read_bytes()
    assert sorted(f.name for f in mine.parent.iterdir()) == ["fake.gguf"]
    monkeypatch.delenv(cache_paths.ENV_OFF)
    monkeypatch.setattr(loading, "_LOADED", {})
    assert loading.load("fake-assembled").source == str(mine)


def _fill(base, path):
    """One weights entry (of `path`), three compiled programs, two exported programs,
    one assembled model."""
    _load(path, base)
    xla = base / "xla"
    xla.mkdir()
    for i in range(3):
        (xla / f"jit_f{i}-{i:040d}-cache").write_bytes(b"x" * (1000 + i))
        (xla / f"jit_f{i}-{i:040d}-atime").write_bytes(b"t" * 8)
    (base / "models").mkdir()
    (base / "models" / "m.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (base / "exported").mkdir()
    for i in range(2):
        (base / "exported" / f"decode-{i:032d}.jaxexport").write_bytes(b"e" * (500 + i))


def _strict_json(text):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def _du(base):
    return sum(f.stat().st_size for f in base.rglob("*") if f.is_file())


def test_clear_leaves_files_it_did_not_write(tmp_path):
    """A cache directory shared with other files (JAXSAMPLE_CACHE_DIR=~): only the files
    the caches write go, the user's stay with their folders."""
    for part in ("weights", "exported", "models", "xla"):
        (tmp_path / part).mkdir()
        (tmp_path / part / "notes.txt").write_text("the user's")
    (tmp_path / "models" / "my-llama").mkdir()
    (tmp_path / "models" / "my-llama" / "model.safetensors").write_text("the user's")
    (tmp_path / "xla" / "jit_g-0-cache").write_bytes(b"x")
    (tmp_path / "exported" / "decode-0.jaxexport").write_bytes(b"xy")
    (tmp_path / "models" / "m.gguf").write_bytes(b"xyz")
    (tmp_path / "weights" / file_hashes.HASH_INDEX).write_bytes(b"{}")
    assert cache.clear(base=tmp_path) == 1 + 2 + 3 + 2
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert kept == ["exported/notes.txt", "models/my-llama/model.safetensors",
                    "models/notes.txt", "weights/notes.txt", "xla/notes.txt"]


def test_cache_info_and_clear_from_the_command_line(gguf, monkeypatch, capsys):
    from jaxsample import cli

    path, base = gguf
    monkeypatch.setenv(cache_paths.ENV_DIR, str(base))
    _fill(base, path)
    (entry,) = _entries(base)
    assert cli.main(["cache", "info", "--json"]) == 0
    info = _strict_json(capsys.readouterr().out)
    assert info["dir"] == str(base) and info["exists"] and not info["disabled"]
    (w,) = info["weights"]
    assert (w["file"], w["source"], w["bytes"]) == (str(entry), str(path), entry.stat().st_size)
    assert w["format"] == weight_cache.FORMAT and 0 <= w["age_s"] < 600
    assert info["compiled_programs"] == 3 and info["compiled_bytes"] == 1000 + 1001 + 1002 + 24
    assert info["exported_programs"] == 2 and info["exported_bytes"] == 500 + 501
    assert [m["bytes"] for m in info["models"]] == [64] and info["total_bytes"] == _du(base)
    assert cli.main(["cache", "info"]) == 0
    table = capsys.readouterr().out
    for text in (str(base), entry.name, str(path), "compiled programs: 3",
                 "exported programs: 2, ", "total:"):
        assert text in table, table

    assert cli.main(["cache", "clear", "--compiled", "--json"]) == 0
    assert _strict_json(capsys.readouterr().out) == {
        "dir": str(base), "cleared": ["compiled"], "freed_bytes": 3027}
    assert not (base / "xla").exists() and _entries(base) == [entry]
    assert cli.main(["cache", "clear", "--exported", "--json"]) == 0
    assert _strict_json(capsys.readouterr().out) == {
        "dir": str(base), "cleared": ["exported"], "freed_bytes": 1001}
    assert not (base / "exported").exists() and _entries(base) == [entry]
    assert cli.main(["cache", "clear", "--weights"]) == 0
    assert "weights" in capsys.readouterr().out
    assert not (base / "weights").exists() and (base / "models" / "m.gguf").is_file()
    monkeypatch.setenv(cache_paths.ENV_OFF, "1")  # off: info still says what is there
    assert cli.main(["cache", "info", "--json"]) == 0
    info = _strict_json(capsys.readouterr().out)
    assert info["disabled"] and info["dir"] == str(base) and info["models_bytes"] == 64
    assert cli.main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "info", "--json"]) == 0
    info = _strict_json(capsys.readouterr().out)
    assert (info["weights"], info["compiled_programs"], info["exported_programs"],
            info["models"]) == ([], 0, 0, [])


@pytest.mark.parametrize("argv", [["cache"], ["cache", "clear", "--bogus"],
                                  ["cache", "info", "extra"], ["cache", "purge"]])
def test_cache_command_bad_input_is_one_line(capsys, argv):
    from jaxsample import cli

    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "error:" in err and "Traceback" not in err


def test_an_assembled_file_with_a_remembered_hash_is_not_read_again(fake_assembled,
                                                                     monkeypatch):
    """The package's EXPECTED_SHA256 against the remembered whole-file hash: a second
    process neither calls assemble() (which hashes the file) nor hashes it itself."""
    import hashlib

    from jaxsample.models.checkpoints import registry

    monkeypatch.setattr(sys.modules["fake_assembler"], "EXPECTED_SHA256",
                        hashlib.sha256(TINY_GGUF.read_bytes()).hexdigest(), raising=False)
    monkeypatch.setattr(file_hashes, "RACY_NS", 0)
    monkeypatch.setattr(file_hashes, "_HASHES", {})
    path = registry.embedded_path("fake-assembled")
    assert len(fake_assembled) == 1
    registry._assembled_path.cache_clear()  # a second process: hashes once, remembers
    assert registry.embedded_path("fake-assembled") == path and len(fake_assembled) == 1
    monkeypatch.setattr(file_hashes, "file_sha256", lambda p: pytest.fail(f"hashed {p} again"))
    for _ in range(2):  # later processes: nothing in memory, the index on disk answers
        registry._assembled_path.cache_clear()
        file_hashes.forget()
        assert registry.embedded_path("fake-assembled") == path
    assert len(fake_assembled) == 1
    path.write_bytes(b"GGUF changed")  # a new ctime: hashed again, found wrong, re-assembled
    registry._assembled_path.cache_clear()
    monkeypatch.setattr(file_hashes, "file_sha256", lambda p: hashlib.sha256(
        pathlib.Path(p).read_bytes()).hexdigest())
    assert registry.embedded_path("fake-assembled") == path
    assert path.read_bytes() == TINY_GGUF.read_bytes() and len(fake_assembled) == 3
