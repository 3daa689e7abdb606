"""Two processes joined by jax.distributed on loopback give the unsharded tokens."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "distributed_demo.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
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
    for o in outs:
        assert o["tokens"] == ref["tokens"]
