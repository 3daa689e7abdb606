"""Many requests over several processes: each its share and its part, `jaxsample merge` joins them.

The two-process test runs scripts/multihost_requests.py under jax.distributed
on loopback (as tests/mesh/test_distributed.py does) and compares the merged file
with a single-process run of the same requests, request by request, up to
float ties (tests/ties.py: the pools have other shapes).
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import results_file_held
from paths import ROOT
from ties import assert_same_tokens_up_to_ties

from jaxsample.cli.app import main
from jaxsample.cli.merge import merge_parts, part_path
from jaxsample.cli.results_file import ResultsFile
from jaxsample.engine.shard_requests import process_share, run_share, share_bounds
from jaxsample.errors import InputError

SCRIPT = ROOT / "scripts" / "multihost_requests.py"


def _script():
    spec = importlib.util.spec_from_file_location("multihost_requests", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _as_generation(line: dict):
    """One results line as the one-prompt Generation fields the tie oracle reads."""
    return types.SimpleNamespace(
        tokens=np.array([line["tokens"]], np.int32),
        logprobs=np.array([line["logprobs"]], np.float32),
        lengths=np.array([line["lengths"]], np.int32), prompt_tokens=[line["prompt_token_ids"]],
        params=types.SimpleNamespace(seed=line["seed"], temperature=line["temperature"]))


def _assert_same_results(lm, ref: list[dict], got: list[dict]) -> None:
    assert [(x["id"], x["index"]) for x in got] == [(x["id"], x["index"]) for x in ref]
    for r, g in zip(ref, got):
        assert g["prompt_token_ids"] == r["prompt_token_ids"], r["id"]
        assert_same_tokens_up_to_ties(lm, _as_generation(r), _as_generation(g),
                                      prompt_index_offset=r["index"])


# ---------------------------------------------------------------------------
# process_share


@pytest.mark.parametrize("total", [0, 1, 2, 5, 7, 12])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_request_is_in_exactly_one_share_at_its_global_position(total, count):
    reqs = [{"id": f"q{i}", "prompt": f"p{i}"} for i in range(total)]
    shares = [process_share(reqs, p, count) for p in range(count)]
    seen = [(s.start + j, r.id, r.prompt) for s in shares for j, r in enumerate(s.requests)]
    assert seen == [(i, f"q{i}", f"p{i}") for i in range(total)]  # once each, in order
    sizes = [len(s.requests) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    for p, s in enumerate(shares):
        assert (s.start, s.stop) == share_bounds(total, p, count)
        assert s.stop - s.start == len(s.requests)
        assert (s.process_index, s.process_count, s.total) == (p, count, total)


def test_share_ids_default_to_global_positions_and_are_checked_over_the_whole_list():
    share = process_share([{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}], 1, 2)
    assert [r.id for r in share.requests] == ["1", "2"]  # as a single run names them
    with pytest.raises(InputError, match=r"request 2: id 'x' repeats"):
        process_share([{"id": "x", "prompt": "a"}, {"id": "y", "prompt": "b"},
                       {"id": "x", "prompt": "c"}], 0, 2)  # the repeat is in the other share


def test_share_defaults_to_this_process():
    import jax

    share = process_share([{"prompt": "a"}, {"prompt": "b"}])
    assert (share.process_index, share.process_count) == (jax.process_index(), jax.process_count())


@pytest.mark.parametrize("index,count,match", [
    (2, 2, "below process_count"), (-1, 2, "process_index must be an int >= 0"),
    (0, 0, "process_count must be an int >= 1"), (True, 2, "process_index"),
    (0, 1.0, "process_count")])
def test_bad_process_numbers_are_refused(index, count, match):
    with pytest.raises(InputError, match=match):
        process_share([{"prompt": "a"}], index, count)


@pytest.mark.slow
def test_a_share_draws_what_the_whole_run_draws(tiny_lm):
    """Process 1 of 2 run alone keeps the single run's keys (prompt index = global
    position): its tokens equal the whole list's, up to float ties."""
    mod = _script()
    run = run_share(tiny_lm, process_share(mod.requests(), 0, 1), chunk_size=4)
    whole = {r.id: mod.result_line(r) for r in run}
    share = process_share(mod.requests(), 1, 2)
    assert share.start == 2
    got = [mod.result_line(r) for r in run_share(tiny_lm, share, chunk_size=4)]
    got.sort(key=lambda x: x["index"])
    assert [x["index"] for x in got] == [2, 3, 4]
    _assert_same_results(tiny_lm, [whole[x["id"]] for x in got], got)


# ---------------------------------------------------------------------------
# merge


def _write_part(out, k, n, lines, *, raw_tail: bytes = b""):
    path = part_path(out, k, n)
    with ResultsFile(path) as f:
        for line in lines:
            f.write(line)
    if raw_tail:
        with open(path, "ab") as f:
            f.write(raw_tail)
    return path


def test_part_names():
    assert part_path("out.jsonl", 1, 2) == "out.jsonl.part-00001-of-00002"
    with pytest.raises(InputError, match="not in"):
        part_path("out.jsonl", 2, 2)


def test_merge_orders_by_index_and_keeps_the_lines_byte_for_byte(tmp_path):
    out = tmp_path / "out.jsonl"
    # completion order inside a part is not input order; a float kept as written
    _write_part(out, 0, 3, [{"id": "b", "index": 1, "x": 0.1}, {"id": "a", "index": 0}])
    _write_part(out, 1, 3, [])  # a process with an empty share
    _write_part(out, 2, 3, [{"id": "c", "index": 2, "t": "é"}])
    parts = [part_path(out, k, 3) for k in range(3)]
    raw = {line for p in parts for line in Path(p).read_bytes().splitlines()}
    got = merge_parts(out, expect=3)  # the parts found beside out
    assert got == {"out": str(out), "parts": parts, "lines": 3}
    lines = out.read_bytes().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b", "c"]
    assert set(lines) == raw and out.read_bytes().endswith(b"\n")
    assert main(["merge", "--out", str(tmp_path / "again.jsonl"), *reversed(parts)]) == 0
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("case,match", [
    ("duplicate id",
     r"part-00001-of-00002 line 1: id 'a' is already in \S+part-00000-of-00002 line 1"),
    ("duplicate index", r"part-00001-of-00002 line 1: index 0 is already in"),
    ("torn", r"part-00001-of-00002 line 2: no newline at the end: the part is unfinished"),
    ("missing part", r"missing part \S+out.jsonl.part-00001-of-00002 \(2 parts, 1 given\)"),
    ("missing file", r"part-00001-of-00002: no such part file"),
    ("gap", r"no line has index 1 .*a part is incomplete"),
    ("expect", r"--expect 3: the parts hold 2 requests"),
    ("nan", r"part-00001-of-00002 line 1: NaN is not JSON"),
    ("repeated key", r"part-00001-of-00002 line 1: key 'index' appears twice in one object"),
    ("no index", r'line 1: "index" must be an int >= 0'),
    ("counts", r"parts of different runs: -of- counts \[2, 3\]"),
    ("not a part", r"not a part name"),
    ("none found", r"no part files"),
])
def test_merge_refuses_bad_parts_in_one_line_and_leaves_out_alone(tmp_path, capsys, case, match):
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    a = {"id": "a", "index": 0}
    if case != "none found":
        _write_part(out, 0, 2, [a])
    second = {"duplicate id": [{"id": "a", "index": 1}],
              "duplicate index": [{"id": "b", "index": 0}],
              "gap": [{"id": "c", "index": 2}], "expect": [{"id": "b", "index": 1}]}
    if case in second:
        _write_part(out, 1, 2, second[case])
    elif case == "torn":
        _write_part(out, 1, 2, [{"id": "b", "index": 1}], raw_tail=b'{"id": "c", "ind')
    elif case == "nan":
        Path(part_path(out, 1, 2)).write_text('{"id": "b", "index": 1, "x": NaN}\n')
    elif case == "repeated key":
        Path(part_path(out, 1, 2)).write_text('{"id": "b", "index": 1, "index": 0}\n')
    elif case == "no index":
        Path(part_path(out, 1, 2)).write_text('{"id": "b"}\n')
    elif case == "counts":
        _write_part(out, 1, 3, [{"id": "b", "index": 1}])
    argv = ["merge", "--out", str(out)]
    if case == "missing file":
        argv += [part_path(out, 0, 2), part_path(out, 1, 2)]
    elif case == "not a part":
        (tmp_path / "other.jsonl").write_text("")
        argv += [part_path(out, 0, 2), str(tmp_path / "other.jsonl")]
    elif case == "expect":
        argv += ["--expect", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxsample: error: "), err
    assert re.search(match, err), err
    assert out.read_text() == "kept\n"  # refused before the output is touched
    assert sorted(p.name for p in tmp_path.iterdir() if "merging" in p.name) == []


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("held", ["part", "out"])
def test_merge_refuses_while_a_run_writes_a_part_or_the_output(tmp_path, capsys, held):
    """A part still being written (its process holds the lock) would merge incomplete;
    an OUT being written would be replaced under its writer: both refused, naming the
    pid, OUT untouched."""
    out = tmp_path / "out.jsonl"
    kept = "kept\n" if held == "part" else ""  # (a run writing OUT starts it empty)
    out.write_text(kept)
    _write_part(out, 0, 2, [{"id": "a", "index": 0}])
    _write_part(out, 1, 2, [{"id": "b", "index": 1}])
    target = part_path(out, 1, 2) if held == "part" else str(out)
    with results_file_held(target, resume=held == "part") as pid:
        assert main(["merge", "--out", str(out)]) == 2
        err = capsys.readouterr().err
    assert f"{target} is being written by a run (pid {pid})" in err, err
    assert out.read_text() == kept
    if held == "part":
        assert main(["merge", "--out", str(out)]) == 0  # once its run has ended


def test_merge_refuses_the_output_as_a_part(tmp_path):
    out = tmp_path / part_path("out.jsonl", 0, 1)
    _write_part(tmp_path / "out.jsonl", 0, 1, [{"id": "a", "index": 0}])
    with pytest.raises(InputError, match="the output cannot be one of the parts"):
        merge_parts(out, [out])


# ---------------------------------------------------------------------------
# two processes under jax.distributed


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_process_parts_merged_equal_a_single_process_run(tiny_lm, tmp_path):
    out = tmp_path / "out.jsonl"
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), "--process-id",
                               str(i), "--num-processes", "2", "--port", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        # the single-process reference, here, while the two processes run
        mod = _script()
        single = tmp_path / "single.jsonl"
        single_path = mod.run(tiny_lm, str(single), 0, 1)
        assert merge_parts(single, [single_path])["lines"] == 5
        for i, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, stderr[-3000:]
            # jax.distributed joined both: process_share's defaults saw 2 processes
            assert f"process {i} of 2 wrote {part_path(out, i, 2)}" in stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    parts = [part_path(out, k, 2) for k in range(2)]
    # blocks [0, 2) and [2, 5): request 2 ran on process 1 at local position 0
    assert [sorted(r["index"] for r in _read(p)) for p in parts] == [[0, 1], [2, 3, 4]]
    # the documented command, in a fresh process
    done = subprocess.run([sys.executable, "-m", "jaxsample", "merge", "--out", str(out),
                           "--expect", "5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "merged 5 requests from 2 parts" in done.stdout
    _assert_same_results(tiny_lm, _read(single), _read(out))
