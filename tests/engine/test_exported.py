"""Exported programs: a second process reads the engine's programs
already traced (`jaxsample.engine.exported`), with the same results bit for bit; a
corrupt or stale entry is ignored with one warning and rewritten.

In-process: a "second process" is this one after `engine.PROGRAMS.clear()` and
`jax.clear_caches()`, so nothing traced before is kept in memory. Every test points
the exported programs at its own temporary directory and puts the session's
setting back afterwards.
"""

import io
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import COMPILATION_CACHE_DIR

from jaxsample import SamplingParams, cache_paths, disk_cache, engine
from jaxsample.engine import exported
from jaxsample.engine import round as round_mod
from jaxsample.engine.loop import Programs
from jaxsample.engine.state import PrefixCache
from jaxsample.progress import PREFIX, Progress

# jax.export's serialization needs flatbuffers (a dependency of jaxsample; without
# it the exported programs are off and there is nothing to test here).
pytestmark = pytest.mark.skipif(not exported.available(), reason="flatbuffers is not installed")


@pytest.fixture
def exported_dir(tmp_path):
    """Exported programs in tmp_path/exported, every program written to the
    compilation cache (min 0 s: so a read entry is also a compilation cache hit);
    the session's settings restored after."""
    d = tmp_path / "exported"
    disk_cache.enable_compilation_cache(COMPILATION_CACHE_DIR, min_compile_time_s=0.0,
                                        exported=d)
    _fresh()
    yield d
    disk_cache.enable_compilation_cache(COMPILATION_CACHE_DIR, min_compile_time_s=0.5)
    _fresh()


def _fresh():
    """Forget every program traced or compiled in memory (a new process, as far as
    the engine's lookups go)."""
    engine.PROGRAMS.clear()
    jax.clear_caches()


PARAMS = SamplingParams(n=4, max_new_tokens=10, temperature=1.0, seed=5, logprobs=2)
PROMPTS = ["hello there", "abc"]


def _run(lm, **kw):
    g = engine.generate(lm, PROMPTS, PARAMS, **kw)
    return g.tokens, g.logprobs, g.top_logprobs, g.top_ids if hasattr(g, "top_ids") else None


def _same(a, b):
    for x, y in zip(a, b):
        if x is None:
            assert y is None
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_exported_programs_give_the_same_tokens_and_skip_tracing(tiny_lm, exported_dir,
                                                                 monkeypatch):
    monkeypatch.setenv(disk_cache.ENV_NO_EXPORTED, "1")
    assert disk_cache.exported_dir() is None
    plain = _run(tiny_lm)  # the plain jit path
    assert not exported_dir.exists()
    monkeypatch.delenv(disk_cache.ENV_NO_EXPORTED)
    assert disk_cache.exported_dir() == exported_dir
    _fresh()
    traced = []
    real = round_mod.decode_chunk
    monkeypatch.setattr(round_mod, "decode_chunk",
                        lambda *a, **k: traced.append(1) or real(*a, **k))
    written = _run(tiny_lm)  # traced, exported, written, compiled from the export
    names = sorted(p.name.split("-")[0] for p in exported_dir.iterdir())
    assert names == ["decode", "init", "new_columns", "prefill"] and traced == [1]
    _fresh()
    built, hits, reads = (engine.PROGRAMS.compilations, engine.PROGRAMS.from_cache,
                          engine.PROGRAMS.from_exported)
    read = _run(tiny_lm)  # read back: the model is never traced
    assert traced == [1]
    assert engine.PROGRAMS.compilations - built == 4
    assert engine.PROGRAMS.from_exported - reads == 4  # every lookup read its entry
    assert engine.PROGRAMS.from_cache - hits == 4  # and the compilation cache served it
    _same(plain, written)
    _same(plain, read)


@pytest.mark.slow
@pytest.mark.kernels
def test_int8_programs_calling_the_cpu_kernels_round_trip(tiny_lm, exported_dir, monkeypatch):
    """An int8 (W8A8) model's programs hold the kernels' custom calls: exported past
    jax.export's check of custom-call targets, read back, the same tokens as the plain
    jit path."""
    from helpers import int8_lm

    from jaxsample.models.cpu_kernels import cpu_kernels

    qlm = int8_lm(tiny_lm)
    monkeypatch.setenv(disk_cache.ENV_NO_EXPORTED, "1")
    plain = _run(qlm)
    monkeypatch.delenv(disk_cache.ENV_NO_EXPORTED)
    _fresh()
    written = _run(qlm)
    if cpu_kernels.active():
        assert any(b"jaxsample_w8a8_dot" in p.read_bytes() for p in exported_dir.iterdir())
    _fresh()
    reads = engine.PROGRAMS.from_exported
    read = _run(qlm)
    assert engine.PROGRAMS.from_exported - reads == 4
    _same(plain, written)
    _same(plain, read)


@pytest.mark.slow
def test_the_progress_line_says_loaded_from_cache(tiny_lm, exported_dir):
    _run(tiny_lm)
    _fresh()
    err = io.StringIO()
    _run(tiny_lm, progress=Progress(err, terminal=False, slow_after=0))
    lines = err.getvalue().splitlines()
    for name in ("prefill", "decode"):
        assert any(ln.startswith(f"{PREFIX}loaded {name} from cache in") for ln in lines), lines
    assert not any("compiled" in ln or "compiling" in ln for ln in lines), lines


def _toy(calls, size=64):
    def f(state, x):
        calls.append(1)
        return PrefixCache((state.k[0] + x,), (state.v[0] * 2,), state.lengths), {"s": x.sum()}
    state = PrefixCache((jnp.ones((size,)),), (jnp.ones((size,)),), jnp.zeros((2,), jnp.int32))
    return f, (state, jnp.arange(float(size)))


def _one_entry(d):
    (entry,) = [p for p in d.iterdir() if p.suffix == exported.SUFFIX]
    return entry


def _corrupt_truncate(p):
    p.write_bytes(p.read_bytes()[:-100])


def _corrupt_flip(p):
    data = bytearray(p.read_bytes())
    data[-50] ^= 0xFF
    p.write_bytes(bytes(data))


def _corrupt_garbage(p):
    p.write_bytes(b"not an entry at all")


def _stale(p):
    """The same file with another key text in its header (a rewrite of the header)."""
    data = p.read_bytes()
    m = len(exported.MAGIC)
    n = int.from_bytes(data[m:m + 8], "little")
    header = data[m + 8:m + 8 + n].replace(b'\\"jax\\": \\"', b'\\"jax\\": \\"0.0.0-')
    assert header != data[m + 8:m + 8 + n]
    p.write_bytes(exported.MAGIC + len(header).to_bytes(8, "little") + header
                  + data[m + 8 + n:])


@pytest.mark.parametrize("spoil", [_corrupt_truncate, _corrupt_flip, _corrupt_garbage, _stale])
def test_a_corrupt_or_stale_entry_is_ignored_and_rewritten(exported_dir, spoil, caplog):
    calls = []
    f, args = _toy(calls)
    want = jax.jit(f)(*args)
    prog, _ = Programs().get(("toy",), f, args)
    entry = _one_entry(exported_dir)
    spoil(entry)
    spoiled = entry.read_bytes()
    _fresh()
    with caplog.at_level(logging.WARNING, logger="jaxsample.disk_cache"):
        programs = Programs()
        prog, _ = programs.get(("toy",), f, args)
    (record,) = caplog.records  # one line
    assert "exported program" in record.getMessage() and "ignored" in record.getMessage()
    assert not programs.last_exported and calls == [1, 1, 1]  # jit, first export, again
    assert _one_entry(exported_dir).read_bytes() != spoiled  # rewritten
    jax.tree_util.tree_map(np.testing.assert_array_equal, prog(*args), want)
    caplog.clear()
    _fresh()
    programs = Programs()
    prog, _ = programs.get(("toy",), f, args)
    assert programs.last_exported and calls == [1, 1, 1] and not caplog.records
    jax.tree_util.tree_map(np.testing.assert_array_equal, prog(*args), want)


def test_a_directory_at_an_entry_path_is_named_and_left_alone(exported_dir, caplog):
    """A directory with a file in it where an entry goes is not ours to delete: one
    line says so (not "rewriting"), the program runs, the directory stays; once it is
    empty it is removed and the entry written."""
    calls = []
    f, args = _toy(calls)
    want = jax.jit(f)(*args)
    Programs().get(("toy",), f, args)
    entry = _one_entry(exported_dir)
    entry.unlink()
    entry.mkdir()
    (entry / "keep.txt").write_text("the user's")
    for _ in range(2):  # every run says the same one line
        _fresh()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxsample.disk_cache"):
            prog, _ = Programs().get(("toy",), f, args)
        (record,) = caplog.records
        assert "is a directory" in record.getMessage() and "not rewritten" in record.getMessage()
        jax.tree_util.tree_map(np.testing.assert_array_equal, prog(*args), want)
    assert (entry / "keep.txt").read_text() == "the user's"
    (entry / "keep.txt").unlink()
    _fresh()
    Programs().get(("toy",), f, args)
    assert entry.is_file()


def test_an_exported_dir_that_cannot_be_written_is_said_once(tmp_path, caplog):
    """`exported/` under a file: no entry (not "unusable"), the program runs, and one
    line per process says the programs are not written."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    disk_cache.enable_compilation_cache(COMPILATION_CACHE_DIR, min_compile_time_s=0.0,
                                        exported=blocker / "exported")
    try:
        calls = []
        f, args = _toy(calls)
        want = jax.jit(f)(*args)
        with caplog.at_level(logging.WARNING, logger="jaxsample.disk_cache"):
            for _ in range(2):
                _fresh()
                prog, _ = Programs().get(("toy",), f, args)
                jax.tree_util.tree_map(np.testing.assert_array_equal, prog(*args), want)
        (record,) = caplog.records
        assert "not written" in record.getMessage() and "unusable" not in record.getMessage()
    finally:
        disk_cache.enable_compilation_cache(COMPILATION_CACHE_DIR, min_compile_time_s=0.5)
        _fresh()


def test_donation_survives_and_a_new_signature_is_a_new_entry(exported_dir):
    calls = []
    f, args = _toy(calls)
    Programs().get(("toy",), f, args, donate=(0,))
    _fresh()
    programs = Programs()
    prog, _ = programs.get(("toy",), f, args, donate=(0,))
    assert programs.last_exported
    state, x = args
    prog(state, x)
    assert all(a.is_deleted() for a in jax.tree_util.tree_leaves(state))  # donated
    assert not x.is_deleted()
    assert "input_output_alias" in prog.compiled.as_text()
    _, args2 = _toy(calls)
    programs.get(("toy",), f, _toy(calls, 32)[1], donate=(0,))  # another shape
    programs.get(("toy", 2), f, args2, donate=(0,))  # another static key
    assert len(list(exported_dir.iterdir())) == 3 and not programs.last_exported


def test_unstable_keys_and_unknown_nodes_are_not_written(exported_dir):
    calls = []
    f, args = _toy(calls)
    programs = Programs()
    programs.get(("toy", object()), f, args)  # its repr names an address
    assert not exported_dir.exists() or not list(exported_dir.iterdir())
    with pytest.raises(exported.Unsupported):
        exported.encode_tree(jax.tree_util.tree_structure(jax.tree_util.Partial(f)))
    with pytest.raises(exported.Unsupported):
        exported.entry_key(("toy", object()), args, ())


def test_result_trees_round_trip():
    _, args = _toy([])
    for tree in (args, (None, [1, {"a": 2, "b": (3,)}]), 1, None, {"k": None}):
        t = jax.tree_util.tree_structure(tree)
        assert exported.decode_tree(exported.encode_tree(t)) == t
    with pytest.raises(ValueError):
        exported.decode_tree(["namedtuple", "os", "stat_result", []])


def test_the_key_changes_with_what_changes_the_program(monkeypatch):
    from jaxsample.models.families import flash

    _, args = _toy([])
    base = exported.entry_key(("toy",), args, ())
    assert exported.entry_key(("toy",), args, ()) == base
    assert exported.entry_key(("toy",), args, (0,)) != base
    assert exported.entry_key(("toy",), (args[0], args[1].astype(jnp.bfloat16)), ()) != base
    assert exported.entry_key(("toy",), (args[0], args[1][:32]), ()) != base
    monkeypatch.setattr(flash, "BLOCKWISE_FROM", (("cpu", 7),))  # read while tracing: in the key
    assert exported.entry_key(("toy",), args, ()) != base
    monkeypatch.setattr(exported, "_DIGEST", ["another source"])  # a code change
    assert exported.entry_key(("toy",), args, ()) != base
    monkeypatch.undo()
    assert exported.entry_key(("toy",), args, ()) == base


def test_off_with_the_caches_off_or_its_own_switch(exported_dir, monkeypatch):
    assert disk_cache.exported_dir() == exported_dir
    for var in (cache_paths.ENV_OFF, disk_cache.ENV_NO_EXPORTED):
        monkeypatch.setenv(var, "1")
        assert disk_cache.exported_dir() is None
        monkeypatch.delenv(var)
    assert disk_cache.exported_dir() == exported_dir
    calls = []
    f, args = _toy(calls)
    monkeypatch.setenv(cache_paths.ENV_OFF, "1")
    Programs().get(("toy",), f, args)
    assert not exported_dir.exists()


@pytest.mark.slow
@pytest.mark.multidevice
def test_on_a_mesh_the_same_tokens_with_and_without(tiny_lm, exported_dir, monkeypatch):
    if jax.device_count() < 2:
        pytest.skip("needs --xla_force_host_platform_device_count (tests/conftest.py)")
    mesh = jax.make_mesh((1, 2), ("data", "branch"))
    params = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, seed=2, logprobs=1)

    def run():
        g = engine.generate(tiny_lm, PROMPTS, params, mesh=mesh)
        return g.tokens, g.logprobs, g.top_logprobs

    monkeypatch.setenv(disk_cache.ENV_NO_EXPORTED, "1")
    plain = run()
    monkeypatch.delenv(disk_cache.ENV_NO_EXPORTED)
    _fresh()
    _same(plain, run())  # exported and written
    _fresh()
    reads = engine.PROGRAMS.from_exported
    _same(plain, run())  # read back
    assert engine.PROGRAMS.from_exported - reads == 4
