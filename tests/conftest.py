"""Shared fixtures: the embedded model (loaded once per session) and a tiny random model.

The caches live in a temporary directory for the session (`TEST_CACHE_DIR`).

Mesh tests need several CPU devices, and the suite compiles at XLA's lowest back-end
optimisation level (tests/xla_flags.py): XLA_FLAGS is set here, before JAX is
imported by any test module, never in library code. A value already set is kept.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from xla_flags import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Every cache the library writes (weights, compiled programs, the assembled Gemma
# GGUF) goes to one temporary directory for the session, set before anything
# imports jaxsample; subprocesses inherit it through os.environ. The user's
# ~/.cache is never touched. JAXSAMPLE_TEST_CACHE_DIR keeps a cache across runs on
# purpose (a directory of your choice, never the default).
# This module may be imported twice in one process (as `conftest` by pytest and as
# `tests.conftest` by a test module): the second import reuses the first's directory
# (a marker naming this process), so the environment never moves under a test.
# pytest-xdist's workers inherit the marker of the process that started them and
# share its directory: a program one worker compiled, or a weights file it
# converted, is read by the other (every cache file is written whole, then renamed).
# The starting process removes the directory when it exits, after its workers.
_MARK = "_JAXSAMPLE_TESTS_CACHE_OF_PID"
_pid, _, _dir = os.environ.get(_MARK, "").partition(":")
if os.environ.get("JAXSAMPLE_TEST_CACHE_DIR"):
    TEST_CACHE_DIR = os.environ["JAXSAMPLE_TEST_CACHE_DIR"]
elif _dir and (_pid == str(os.getpid()) or os.environ.get("PYTEST_XDIST_WORKER")):
    TEST_CACHE_DIR = _dir
else:
    TEST_CACHE_DIR = tempfile.mkdtemp(prefix="jaxsample-tests-cache-")
    atexit.register(shutil.rmtree, TEST_CACHE_DIR, ignore_errors=True)
    os.environ[_MARK] = f"{os.getpid()}:{TEST_CACHE_DIR}"
os.environ["JAXSAMPLE_CACHE_DIR"] = os.path.join(TEST_CACHE_DIR, "jaxsample")
os.environ["XDG_CACHE_HOME"] = TEST_CACHE_DIR
os.environ.pop("JAXSAMPLE_NO_CACHE", None)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every machine and every run (a CI
# failure is then reproducible, not a lottery); HYPOTHESIS_PROFILE=explore
# searches afresh.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import gc  # noqa: E402

from jaxsample import disk_cache as _cache_lib

# JAX's persistent compilation cache, in the session's temporary directory: the
# place `jaxsample run` uses too (cache_dir() / "xla"), so a command-line
# subprocess finds the programs this process compiled, and a test module reuses
# those an earlier module compiled (each module's in-memory programs are freed
# when it ends, below). Programs that compile in under half a second are not
# written. Served programs are the same XLA executables, so no result changes.
COMPILATION_CACHE_DIR = _cache_lib.enable_compilation_cache(min_compile_time_s=0.5)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Free each test module's compiled programs when it ends. Every XLA CPU
    executable holds memory mappings; kept for the whole suite they passed the
    kernel's vm.max_map_count (65,530) three quarters of the way through, and
    the next compile crashed the process (a segfault or an abort in
    backend_compile)."""
    yield
    from jaxsample import engine

    engine.PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def compilation_cache_calls(monkeypatch):
    """`jaxsample run` turns on JAX's persistent compilation cache for its process;
    in-process command-line tests record the calls instead of changing this test
    process's JAX config (tests/load/test_caches.py runs the real thing in subprocesses).
    Returns the list of recorded (args, kwargs)."""
    from jaxsample import cli

    calls = []
    monkeypatch.setattr(cli.app.cache_lib, "enable_compilation_cache",
                        lambda *a, **k: calls.append((a, k)))
    return calls


from jaxsample.lm import LanguageModel  # noqa: E402
from jaxsample.tiny import TINY, byte_tokenizer, make_tiny_lm  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_lm() -> LanguageModel:
    return make_tiny_lm()


@pytest.fixture(scope="session")
def lm():
    """The embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from jaxsample.loading import load

    return load()


def pytest_terminal_summary(terminalreporter):
    """One line on what the session compiled (where the suite's time goes)."""
    import sys

    engine = sys.modules.get("jaxsample.engine.loop")
    if engine is not None:
        p = engine.PROGRAMS
        terminalreporter.write_line(
            f"jaxsample: {p.compilations} engine programs built, {p.from_cache} of them from "
            f"the persistent compilation cache, {p.from_exported} read exported (not traced)")
