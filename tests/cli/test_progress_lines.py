"""Progress that says what happened: "compiled" only when XLA
compiled, one load figure, a line every interval while a phase runs, and the rounds
of adaptive self-consistency."""

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import main_captured as _main
from paths import TINY_GGUF

import jaxsample
from jaxsample import SamplingParams
from jaxsample.progress import PREFIX, Progress

# In-process runs never change this process's JAX config (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_calls")


def test_a_long_phase_prints_a_line_every_interval():
    err = io.StringIO()
    prog = Progress(err, terminal=False, interval=0.1)
    with prog.phase("loading x", "loaded x in {s:.1f} s"):
        time.sleep(1.5)
    lines = err.getvalue().splitlines()
    assert lines[0] == PREFIX + "loading x ..." and lines[-1].startswith(PREFIX + "loaded x in")
    assert any(re.fullmatch(re.escape(PREFIX) + r"loading x: \d+ s so far", ln) for ln in lines)
    err = io.StringIO()
    with Progress(err, terminal=False, interval=0).phase("loading y"):
        time.sleep(0.3)  # interval 0: no repeats (decode lines come one per chunk instead)
    assert len(err.getvalue().splitlines()) == 2


def test_a_program_from_the_cache_is_not_called_compiled():
    err = io.StringIO()
    prog = Progress(err, terminal=False, slow_after=0)
    with prog.compiling("prefill") as handle:
        handle.from_cache()
    with prog.compiling("decode"):
        pass
    with prog.compiling("init") as handle:
        handle.from_exported()
    assert err.getvalue().splitlines() == [
        PREFIX + "preparing prefill ...",
        PREFIX + "loaded prefill from the compilation cache in 0.0 s",
        PREFIX + "preparing decode ...", PREFIX + "compiled decode in 0.0 s",
        PREFIX + "preparing init ...", PREFIX + "loaded init from cache in 0.0 s"]


_TWICE = r"""
import sys
from jaxsample import load, generate, SamplingParams
from jaxsample import disk_cache as cache
from jaxsample.progress import Progress
cache.enable_compilation_cache(sys.argv[1])
lm = load(sys.argv[2], cache=False)
generate(lm, ["hi"], SamplingParams(n=2, max_new_tokens=5, seed=0),
         progress=Progress(sys.stderr, terminal=False, slow_after=0))
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_compile_lines_say_compiled_only_when_xla_compiled(tmp_path):
    """Two fresh processes over one persistent compilation cache and one directory of
    exported programs: the first traces and compiles prefill and decode, the second
    reads them exported (no trace) and fetches them, and must say "loaded ... from
    cache", never that it compiled."""
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("JAXSAMPLE_NO_EXPORTED", None)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _TWICE, str(tmp_path / "xla"), TINY_GGUF],
                           capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append([ln for ln in p.stderr.splitlines() if ln.startswith(PREFIX)])
    first, second = runs
    assert not any("compiling" in ln for ln in first + second)
    exported = importlib.util.find_spec("flatbuffers") is not None  # jax.export can serialize
    cached = "from cache in" if exported else "from the compilation cache in"
    for name in ("prefill", "decode"):
        assert any(ln.startswith(f"{PREFIX}compiled {name} in") for ln in first), first
        assert not any(f"compiled {name}" in ln for ln in second), second
        assert any(ln.startswith(f"{PREFIX}loaded {name} {cached}") for ln in second), second
    if exported:  # prefill, init, decode, new_columns (the host's copy of a chunk)
        assert len(list((tmp_path / "cache" / "exported").iterdir())) == 4


@pytest.mark.slow
def test_the_load_time_is_one_figure():
    code, out, err = _main(["run", "--model", TINY_GGUF, "--prompt", "hi", "--n", "2",
                            "--max-new-tokens", "4", "--seed", "0", "--json"])
    assert code == 0, err
    said = re.search(r"loaded tiny_llama in (\d+\.\d\d) s", err)
    assert said, err
    assert said.group(1) == f"{json.loads(out)['timings']['load']:.2f}"


@pytest.mark.slow
def test_adaptive_reports_rounds(tiny_lm):
    err = io.StringIO()
    res = jaxsample.adaptive_self_consistency(
        tiny_lm, ["ab", "cd"], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0),
        max_n=8, window=4, rule="esc", extract="text",
        progress=Progress(err, terminal=False, interval=0, slow_after=0))
    lines = err.getvalue().splitlines()
    assert all(ln.startswith(PREFIX) and "error:" not in ln for ln in lines)
    rounds = [ln for ln in lines if ln.startswith(PREFIX + "adaptive: round ")]
    assert rounds and any("preparing" in ln for ln in lines)
    drawn = int(res.n_used.sum())
    assert re.search(rf"round \d, {drawn} branches drawn, 2/2 prompts settled", rounds[-1])
    # The same result as without progress.
    ref = jaxsample.adaptive_self_consistency(
        tiny_lm, ["ab", "cd"], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0),
        max_n=8, window=4, rule="esc", extract="text")
    assert ref.winner == res.winner and (ref.n_used == res.n_used).all()


@pytest.mark.slow
def test_run_adaptive_reports_rounds_off_a_terminal():
    code, out, err = _main(["run", "--model", TINY_GGUF, "--prompt", "hi", "--adaptive", "esc",
                            "--max-n", "8", "--window", "4", "--max-new-tokens", "4",
                            "--extract", "text", "--json"])
    assert code == 0, err
    assert re.search(r"adaptive: round 1, \d+ branch(es)? drawn, [01]/1 prompt settled", err), err
    assert json.loads(out)["result"]["adaptive"] == "esc"


@pytest.mark.slow
def test_adaptive_progress_on_a_terminal_draws_without_error(tiny_lm):
    err = io.StringIO()
    prog = Progress(err, terminal=True, interval=0, slow_after=0)
    res = jaxsample.adaptive_self_consistency(
        tiny_lm, ["ab"], SamplingParams(temperature=1.0, max_new_tokens=6, seed=0),
        max_n=8, window=4, rule="esc", extract="text", progress=prog)
    assert "adaptive: round" in err.getvalue() and prog._live is None  # the bar is gone
    assert int(res.n_used[0]) in (4, 8)
