"""The size guard against what a real process holds (jaxsample/engine/budget.py).

A request's peak resident memory (VmHWM of a real process, the growth over its
resident memory before the request) is bounded by what the guard counts: the
pool's state and step temporaries (`plan`, `slot_bytes` with `step_bytes`) plus
the returned results with their Python objects (`result_bytes`). A request whose
results cannot fit in host memory is refused before any compute, in one line with
the numbers, by the library and the command line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
from paths import TINY_GGUF

from jaxsample.engine import budget

ENV = dict(os.environ, JAX_PLATFORMS="cpu")

# Runs one request twice (the second with its programs compiled), and reports the
# growth of VmHWM over VmRSS before the second run (the peak reset through
# /proc/self/clear_refs) beside what the guard counts for it.
_MEASURE = r"""
import gc, json, sys
N, T, K = int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
from jaxsample import SamplingParams, loading
from jaxsample.engine import budget
from jaxsample.engine.requests import Request, run_pool
from jaxsample.engine.buckets import bucket

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

lm = loading.load(sys.argv[1], cache=False)
sp = SamplingParams(n=N, max_tokens=T, temperature=0.8, ignore_eos=True, logprobs=K)
req = [Request(id="h", prompt="ab", params=sp)]
list(run_pool(lm, req))
gc.collect()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
res = list(run_pool(lm, req))
growth = status("VmHWM") - base
p_cap = bucket(len(lm.tokenizer.encode("ab")))
rows, slots = budget.plan_params(lm.config, sp, B=1, p_cap=p_cap, budget=budget.default_kv_budget())
row = budget.row_bytes(lm.config, p_cap, sp.penalties)
slot = budget.slot_bytes(lm.config, bucket(T), K or 0, K is not None, sp.penalties, sp.signals)
state = row + N * slot if (rows, slots) == (1, N) else rows * (2 * row + slots * slot)
print(json.dumps({"growth": growth, "counted": state + budget.result_bytes(1, N, T, K or 0,
                                                                         K is not None),
                  "branches": sum(len(r.output.outputs) for r in res)}))
"""


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("n, T, logprobs", [(8192, 4, None), (2048, 32, 5)])
def test_a_requests_peak_memory_is_bounded_by_what_the_guard_counts(n, T, logprobs):
    r = subprocess.run([sys.executable, "-c", _MEASURE, TINY_GGUF, str(n), str(T),
                        json.dumps(logprobs)], capture_output=True, text=True, timeout=900,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["branches"] == n
    # An upper bound (what the guard refuses on is never less than what a run
    # takes), and a measured one (within 3x: not an arbitrary margin).
    assert got["growth"] <= got["counted"], got
    assert got["growth"] >= got["counted"] / 3, got


def _too_large_n(T: int) -> int:
    """The fewest branches whose results the guard refuses on this host."""
    have = budget.HOST_RESULTS_FRACTION * budget.host_memory_bytes()
    return math.floor(have / budget.result_bytes(1, 1, T)) + 1


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_request_too_large_for_host_memory_is_refused_before_compute():
    """Just past the guard (with T = 4 about 1.5 KB a branch: a few million branches on
    a few GiB of RAM): the library and the command line refuse it at once, in one line
    with the numbers, never starting the decode."""
    n = _too_large_n(4)
    assert n < 2**31 - 1
    lib = (f"from jaxsample import loading, SamplingParams\n"
           f"from jaxsample.engine.requests import Request, run_pool\n"
           f"lm = loading.load({TINY_GGUF!r}, cache=False)\n"
           f"run_pool(lm, [Request(id='h', prompt='ab', params=SamplingParams(n={n}, "
           f"max_tokens=4))])\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", lib], capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 1 and "InputError: request 0 ('h'): n=" in r.stderr, r.stderr[-2000:]
    assert "per branch" in r.stderr and "of host memory" in r.stderr
    cli = subprocess.run([sys.executable, "-m", "jaxsample", "run", "--model", TINY_GGUF,
                          "--prompt", "ab", "--n", str(n), "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert cli.returncode == 2 and cli.stdout == "", cli.stderr
    assert cli.stderr.count("\n") == 1 and cli.stderr.startswith(f"jaxsample: error: --n: n={n}")
    per = budget.result_bytes(1, 1, 4)
    assert f"({per:,} per branch" in cli.stderr, cli.stderr
    assert time.monotonic() - t0 < 100


def test_results_count_each_branchs_python_objects():
    """result_bytes grows by HOST_BRANCH_BYTES per branch and HOST_TOKEN_BYTES per token
    besides the arrays, and with logprobs by the Logprob dicts."""
    base = budget.result_bytes(1, 1, 0)
    assert base == budget.HOST_BRANCH_BYTES
    assert budget.result_bytes(1, 1, 10) - base == 10 * (16 + budget.HOST_TOKEN_BYTES)
    with_lp = budget.result_bytes(1, 1, 10, top_logprobs=3, token_ranks=True)
    assert with_lp - budget.result_bytes(1, 1, 10) == 10 * (
        2 * (24 + 4) + budget.HOST_LOGPROB_BYTES + 3 * budget.HOST_TOP_BYTES)
    assert budget.result_bytes(3, 5, 7) == 15 * budget.result_bytes(1, 1, 7)


@pytest.mark.slow
def test_step_bytes_bound_the_decode_programs_temporaries(tiny_lm):
    """XLA's own count of the compiled decode program's temporaries, per slot (the
    difference between two slot counts), is at most `step_bytes`."""
    from jaxsample import SamplingParams
    from jaxsample.engine import loop
    from jaxsample.engine.requests import Request, run_pool

    temps = {}
    for n in (64, 256):
        loop.PROGRAMS.clear()
        list(run_pool(tiny_lm, [Request(id="h", prompt="ab", params=SamplingParams(
            n=n, max_tokens=4, temperature=0.8, ignore_eos=True))]))
        (decode,) = [c for k, c in loop.PROGRAMS._cache.items() if k[0][0] == "decode"]
        compiled = getattr(decode, "compiled", decode)  # (an exported program's executable)
        temps[n] = compiled.memory_analysis().temp_size_in_bytes
    per_slot = (temps[256] - temps[64]) / 192
    assert 0 < per_slot <= budget.step_bytes(tiny_lm.config), (per_slot, temps)
