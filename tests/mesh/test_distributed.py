"""Two processes joined by jax.distributed on loopback give the unsharded tokens."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import types

import numpy as np
import pytest
from paths import ROOT
from ties import assert_same_tokens_up_to_ties

SCRIPT = ROOT / "scripts" / "distributed_demo.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def _as_generation(d: dict):
    """The demo's JSON as the fields `assert_same_tokens_up_to_ties` reads."""
    import types

    params = types.SimpleNamespace(seed=d["seed"], temperature=d["temperature"])
    return types.SimpleNamespace(
        tokens=np.array(d["tokens"], np.int32), logprobs=np.array(d["logprobs"], np.float32),
        lengths=np.array(d["lengths"], np.int32), prompt_tokens=d["prompt_tokens"],
        params=params)


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_process_run_equals_single_process():
    single = subprocess.run([sys.executable, str(SCRIPT), "--single"], capture_output=True,
                            text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--process-id", str(i),
                               "--num-processes", "2", "--port", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-2000:]
        outs.append(_last_json(out))
    ref = _last_json(single.stdout)
    assert [o["devices"] for o in outs] == [4, 4]  # 2 processes x 2 local CPU devices
    lm = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=ref["vocab_size"]))
    assert outs[0]["tokens"] == outs[1]["tokens"]  # every process holds the whole result
    assert_same_tokens_up_to_ties(lm, _as_generation(ref), _as_generation(outs[0]))
