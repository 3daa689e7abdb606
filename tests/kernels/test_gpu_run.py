"""The prepared accelerator run (benchmarks/gpu_run.sh, benchmarks/accel.py) at its CPU
smoke sizes, so the script cannot rot between the rare calls on a GPU.

Oracles: the plan each worker announces (every planned cell must come back as a
row, measured or with its error), the engine's own constants (the step loop's trip
count is `loop.STEPS_PER_CHECK`), and the options this checkout has (an engine
without `attention=` must give error rows naming it, not crash).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time

import pytest
from paths import ROOT
from xla_flags import xla_flags

from jaxsample import engine
from jaxsample.engine import loop


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_worker_past_its_timeout_is_killed():
    sys.path.insert(0, str(ROOT))
    from benchmarks import common

    rows = []
    t0 = time.perf_counter()
    ran = common.spawn("time:sleep", 60, timeout=5, on_row=rows.append)
    assert ran.returncode == "timeout" and "timeout after 5 s" in ran.stderr
    assert time.perf_counter() - t0 < 30 and rows == []
    ran = common.spawn("builtins:list", [{"a": 1}, {"b": 2}], timeout=60, on_row=rows.append)
    assert ran.returncode == 0 and rows == ran.rows == [{"a": 1}, {"b": 2}]


def test_a_failing_engine_option_makes_the_later_parts_use_xlas_defaults():
    sys.path.insert(0, str(ROOT))
    from benchmarks import accel

    def rows(**errors):
        return [dict(part="fixed", cell=c, **({"error": errors[k]} if k in errors else {}))
                for k, c in (("xla", "narrow/xla_default/N=1"), ("engine", "narrow/engine/N=1"),
                             ("engine64", "narrow/engine/N=64"))]

    assert not accel.engine_options_failed(rows())
    assert accel.engine_options_failed(rows(engine64="not run: worker -11"))
    assert not accel.engine_options_failed(rows(xla="XlaRuntimeError", engine="XlaRuntimeError"))
    assert not accel.engine_options_failed([])  # no fixed part in this call


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_smoke_run_measures_every_planned_cell(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = xla_flags(1)  # one CPU device, as the run sees a machine
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "benchmarks/gpu_run.sh", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_run.json").read_text())
    assert (tmp_path / "gpu_run.log").exists() and doc["smoke"] and wall < 600
    rows = doc["rows"]
    cells = {(r["part"], r["cell"]): r for r in rows if r.get("kind") == "cell"}
    assert {part for part, _ in cells} == {"fixed", "1b", "hf", "8b"}
    has_attention = "attention" in inspect.signature(engine.generate).parameters
    for (part, name), r in cells.items():
        err = r.get("error", "")
        assert "not run" not in err and "skipped: past" not in err, (part, name, err)
        if part == "hf":
            continue  # measured, or its error where torch is absent
        if name.startswith("attention=") and not has_attention:
            assert "attention" in err, (name, err)
            continue
        assert not err, (part, name, err)
        if name.startswith(("grid/", "int8-wo/P=", "narrow/", "wide/")) and "/N=" in name:
            assert r["decode_step_s"] > 0 and 0 < r["roofline_fraction"], name
            assert r["all_branches_full"] and r["T"] == 8 and r["compile_s"] < 1.0, name
        if name.endswith("/control"):
            assert r["step_loop_trip_counts"] == [loop.STEPS_PER_CHECK], name
    assert any(name.startswith("int8-wo/P=") for _, name in cells)
    assert {r["kernel"] for (_, name), r in cells.items() if name.startswith("prefill=")} == {
        "dense", "blockwise"}
    setups = doc["summary"]["setup_s"]
    assert {"1b/setup", "8b/setup", "1b/int8-wo/setup"} <= set(setups)
    assert all(0 < s < 120 for s in setups.values())
    s = doc["summary"]
    assert set(s["fixed_cost"]) == {"xla_default", "engine", "engine_unroll"}
    assert s["bandwidth_bytes_per_s"] > 0 and set(s["1b"]["roofline_fraction"]) == {
        "P=64/N=1", "P=64/N=4"}
    assert s["1b"]["int8_wo_over_bf16_step"] and s["1b"]["blockwise_from_measured"] > 0
