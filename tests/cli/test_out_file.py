"""`jaxsample run --prompt-file in.jsonl --out out.jsonl [--resume]`:
one strict JSON line per completed request, bad input refused before anything is
opened or loaded, --resume skipping what is done and redoing a torn last line, and a
SIGINT'd subprocess run that --resume completes to the lines of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import main_captured as _main
from helpers import results_file_held, sigint_default_in_child
from paths import TINY_GGUF
from xla_flags import xla_flags

from jaxsample import cli

FLAGS = ["--model", TINY_GGUF, "--n", "2", "--max-new-tokens", "6", "--temperature", "0.8"]

# In-process runs never change this process's JAX config (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_calls")


def _strict_lines(path):
    """The file's lines as JSON objects; refuses NaN / Infinity and a missing last newline."""
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def _write_requests(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


def _no_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(cli.app, "_load_model", boom)
    from jaxsample import loading
    monkeypatch.setattr(loading, "load", boom)


THREE = [{"prompt": "one two", "id": "a"}, {"prompt": "three four"}, {"prompt": "five", "id": 7}]


@pytest.fixture(scope="module")
def three_done(tmp_path_factory):
    """The lines (bytes, in completion order) of a finished `--out` run of THREE with FLAGS."""
    from jaxsample import cli as cli_

    tmp = tmp_path_factory.mktemp("three")
    reqs = _write_requests(tmp / "in.jsonl", THREE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_.app.cache_lib, "enable_compilation_cache", lambda *a, **k: None)
        code, _, err = _main(["run", "--prompt-file", str(reqs), "--out", str(tmp / "out.jsonl"),
                              "-q"] + FLAGS)
    assert code == 0, err
    return (tmp / "out.jsonl").read_bytes().splitlines(keepends=True)


@pytest.mark.slow
def test_out_writes_one_strict_json_line_per_request(tmp_path):
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", str(out)] + FLAGS)
    assert code == 0, err
    assert stdout == ""  # the records go to the file
    # Progress and the run's bill went to stderr.
    assert "requests: 3/3 done" in err and "slot utilisation" in err and "wrote 3 requests" in err
    lines = _strict_lines(out)
    # Ids as strings: the line's string id, a number's JSON text, else the position.
    assert sorted(r["id"] for r in lines) == ["1", "7", "a"]
    by_id = {r["id"]: r for r in lines}
    for rid, index, req in (("a", 0, THREE[0]), ("1", 1, THREE[1]), ("7", 2, THREE[2])):
        rec = by_id[rid]
        assert rec["index"] == index and rec["prompt"] == req["prompt"]
        assert len(rec["branches"]) == 2
        assert rec["usage"]["kept_tokens"] == sum(b["tokens"] for b in rec["branches"])
        assert rec["batch"] == {"index": 0, "requests": [0, 1, 2]}
    # The same record `--json` prints for a .jsonl request, field for field.
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--json", "--quiet"] + FLAGS)
    assert code == 0, err
    printed = [json.loads(line) for line in stdout.splitlines()]
    assert [set(r) for r in printed] == [set(by_id[k]) for k in ("a", "1", "7")]
    for p, rid in zip(printed, ("a", "1", "7")):
        assert p["params"] == by_id[rid]["params"] and p["usage"]["prompt_tokens"] == \
            by_id[rid]["usage"]["prompt_tokens"]
    # --resume reads these lines back: with the same settings nothing is left to run;
    # with another temperature, or another prompt under a kept id, it refuses in one
    # line naming both lines and the field, before any load, and the file stays as it was.
    text = out.read_text()
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", str(out),
                               "--resume"] + FLAGS)
    assert code == 0 and "all 3 requests are in" in err, err
    changed = _write_requests(tmp_path / "changed.jsonl",
                              [THREE[0], {"prompt": "three five"}, THREE[2]])
    assert all(r["dtype"] == "float32" and r["weights"] is None for r in lines)
    for prompts, flags, needle in ((reqs, ["--temperature", "0.5"], "temperature 0.8 -> 0.5"),
                                   (reqs, ["--weights", "int8"], "weights None -> 'int8'"),
                                   (reqs, ["--dtype", "bfloat16"], "dtype 'float32' -> 'bfloat16'"),
                                   (changed, [], "prompt 'three four' -> 'three five'")):
        code, stdout, err = _main(["run", "--prompt-file", str(prompts), "--out", str(out),
                                   "--resume"] + FLAGS + flags)
        assert code == 2 and err.count("\n") == 1 and needle in err, err
        assert "other settings" in err and "line" in err, err
        assert out.read_text() == text


@pytest.mark.parametrize("resume", [False, True])
def test_a_bad_line_3_is_one_error_and_the_out_file_is_untouched(capsys, monkeypatch,
                                                                tmp_path, resume):
    _no_load(monkeypatch)
    reqs = tmp_path / "in.jsonl"
    reqs.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", "temprature": 1}\n')
    out = tmp_path / "out.jsonl"
    before = b'{"id": "0", "kept": true}\n{"id": "1", "to' if resume else None
    if before is not None:
        out.write_bytes(before)
    argv = ["run", "--prompt-file", str(reqs), "--out", str(out), "--model", TINY_GGUF]
    code = cli.main(argv + (["--resume"] if resume else []))
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == ""
    assert err.count("\n") == 1 and "line 3" in err and "temprature" in err, err
    if before is None:
        assert not out.exists()
    else:
        assert out.read_bytes() == before  # not even the torn line was cut


@pytest.mark.parametrize("extra, needle", [
    (["--resume"], "--resume continues an --out file"),
    (["--out", "{out}", "--kv-budget", "2XB"], "--kv-budget: expected a byte size"),
    (["--out", "{out}", "--kv-budget", "0"], "at least 1 byte"),
    (["--out", "{out}", "--adaptive", "esc", "--kv-budget", "1GiB"], "--kv-budget sizes"),
    (["--out", "{in}"], "is the --prompt-file"),
    (["--out", "{out}", "--kv-budget", "100"], "--kv-budget 100 cannot hold one pool row"),
    (["--distributed"], "--distributed writes one part of --out"),
    (["--out", "{out}", "--process-id", "0"], "--process-id sets up --distributed"),
    (["--out", "{out}", "--distributed", "--process-id", "0"], "give all of --coordinator"),
    (["--out", "{out}", "--distributed", "--coordinator", "h:1", "--num-processes", "2",
      "--process-id", "2"], "--process-id must be in [0, 2)"),
    (["--out", "{out}", "--distributed", "--join-timeout", "0"], "--join-timeout must be >= 1"),
    (["--out", "{out}", "--distributed", "--coordinator", "nonsense", "--num-processes", "1",
      "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--out", "{out}", "--distributed", "--coordinator", "127.0.0.1:abc", "--num-processes",
      "1", "--process-id", "0"], "--coordinator must be HOST:PORT"),
])
def test_out_flag_errors(capsys, monkeypatch, tmp_path, extra, needle):
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    extra = [x.format(out=out, **{"in": reqs}) for x in extra]
    code = cli.main(["run", "--prompt-file", str(reqs), "--model", TINY_GGUF] + extra)
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1 and needle in err, err
    assert not out.exists() and reqs.read_text().count("\n") == 3


def test_out_refuses_a_text_prompt_duplicate_ids_and_an_existing_file(capsys, monkeypatch,
                                                                      tmp_path):
    _no_load(monkeypatch)
    out = tmp_path / "out.jsonl"
    code = cli.main(["run", "--prompt", "x", "--out", str(out), "--model", TINY_GGUF])
    assert code == 2 and "a .jsonl --prompt-file" in capsys.readouterr().err
    # Line 2 has no id (its position, "1"); line 3's id "1" repeats it.
    reqs = _write_requests(tmp_path / "in.jsonl",
                           [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c", "id": "1"}])
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--model", TINY_GGUF])
    err = capsys.readouterr().err
    assert code == 2 and "line 3" in err and "line 2" in err and "'1'" in err, err
    assert not out.exists()
    # A results file is never truncated by a run without --resume.
    out.write_text('{"id": "0"}\n')
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--model", TINY_GGUF])
    err = capsys.readouterr().err
    assert code == 2 and "pass --resume" in err and out.read_text() == '{"id": "0"}\n'
    # A directory is not an out file.
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(tmp_path), "--model",
                     TINY_GGUF])
    err = capsys.readouterr().err
    assert code == 2 and "is a directory" in err, err


@pytest.mark.slow
def test_resume_skips_the_done_ids_and_redoes_a_torn_last_line(tmp_path, three_done):
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    # "a" is done (a recomputation would have to write it again: ResultsFile refuses an
    # id twice, so the run would fail); "7"'s line is torn (a crash mid-write).
    kept = next(x for x in three_done if json.loads(x)["id"] == "a")
    out.write_bytes(kept + b'{"id": "7", "branches": [{"te')
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"]
                              + FLAGS)
    assert code == 0, err
    assert "1 of 3 requests are in" in err and "running the other 2" in err and "torn" in err
    assert "wrote 2 requests" in err
    assert out.read_bytes().startswith(kept)
    lines = _strict_lines(out)
    assert [r["id"] for r in lines[:1]] == ["a"] and sorted(r["id"] for r in lines[1:]) == ["1", "7"]
    assert all(len(r["branches"]) == 2 for r in lines[1:])
    # The keys of a remaining request are those of its position in the whole run
    # (prompt_index_offset): its record's index is that position.
    assert {r["id"]: r["index"] for r in lines[1:]} == {"1": 1, "7": 2}


def test_resume_with_every_request_done_loads_nothing(capsys, monkeypatch, tmp_path, three_done):
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    done = b"".join(three_done)
    out.write_bytes(done)
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    stdout, err = capsys.readouterr()
    assert code == 0 and stdout == "" and "all 3 requests are in" in err, err
    assert out.read_bytes() == done


@pytest.mark.slow
def test_out_with_a_shared_prefix_writes_each_call_as_it_ends(tmp_path):
    """--shared-prefix has no place in run_requests: the call-by-call loop writes the lines."""
    reqs = _write_requests(tmp_path / "in.jsonl", THREE[:2])
    out = tmp_path / "out.jsonl"
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", str(out),
                               "--shared-prefix", "Context: x y z.", "--no-chat"] + FLAGS)
    assert code == 0, err
    lines = _strict_lines(out)
    assert [r["id"] for r in lines] == ["a", "1"] and all(len(r["branches"]) == 2 for r in lines)


def test_out_with_adaptive_writes_each_call_as_it_ends(tmp_path):
    """--adaptive has no place in run_requests: the call-by-call loop writes the lines,
    the adaptive result ("n_used", "adaptive") in each."""
    reqs = _write_requests(tmp_path / "in.jsonl", THREE[:2])
    out = tmp_path / "out.jsonl"
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", str(out),
                               "--adaptive", "esc", "--max-n", "4", "--window", "2"] + FLAGS)
    assert code == 0, err
    lines = _strict_lines(out)
    assert [r["id"] for r in lines] == ["a", "1"]
    assert all(r["result"]["adaptive"] == "esc" and 2 <= r["result"]["n_used"] <= 4
               for r in lines)


# ---------------------------------------------------------------------------
# Ctrl-C: a subprocess interrupted after its first line, then resumed


def _comparable(record):
    """A record without what depends on when and in which pool it ran: the timings, and
    the bill's pool figures (decode steps, branch steps, KV bytes); each branch's own
    token counts stay."""
    rec = dict(record)
    rec.pop("timings")
    bill = rec.pop("bill")
    rec["tokens_per_branch"] = (bill["decoded_tokens_per_branch"], bill["kept_tokens_per_branch"])
    return json.dumps(rec, sort_keys=True)


def _same_results_up_to_ties(lm, got, ref, temperature):
    """Two records of one request, from pools of other shapes: every field equal but
    the branches, whose tokens agree up to float ties (tests/ties.py; the key of a
    request with its own seed: (seed, key index 0, branch)) and whose logprobs agree
    to float32 rounding (`--logprobs 0` records them)."""
    import types

    import numpy as np
    from ties import assert_same_tokens_up_to_ties

    strip = lambda r: {k: v for k, v in json.loads(_comparable(r)).items()
                       if k not in ("branches", "tokens_per_branch")}
    assert strip(got) == strip(ref)

    def view(r):
        T = max(len(b["token_ids"]) for b in r["branches"]) or 1
        toks = np.full((1, len(r["branches"]), T), -1, np.int64)
        lps = np.zeros((1, len(r["branches"]), T), np.float32)
        for n, b in enumerate(r["branches"]):
            toks[0, n, :len(b["token_ids"])] = b["token_ids"]
            lps[0, n, :len(b["token_logprobs"])] = b["token_logprobs"]
        lengths = np.array([[len(b["token_ids"]) for b in r["branches"]]])
        params = types.SimpleNamespace(seed=r["params"]["seed"], temperature=temperature)
        return types.SimpleNamespace(tokens=toks, logprobs=lps, lengths=lengths, params=params)

    return assert_same_tokens_up_to_ties(lm, view(ref), view(got), max_ties=2)


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigint_keeps_finished_lines_and_resume_completes_the_run(tmp_path):
    # 120 requests, each with its own seed (it draws from (seed, branch) wherever it
    # stands), in one pool: they complete one after another, so the first line appears
    # well before the last request ends. The resumed run's pool holds fewer requests
    # (other shapes), so its lines equal the uninterrupted run's up to float ties.
    R = 120  # about 30 ms each on the tiny model: seconds between the first line and the last
    reqs = _write_requests(tmp_path / "in.jsonl", [
        {"prompt": f"question {i}: x", "id": f"q{i}", "seed": i} for i in range(R)])
    argv = [sys.executable, "-m", "jaxsample", "run", "--prompt-file", str(reqs),
            "--model", TINY_GGUF, "--n", "2", "--max-new-tokens", "24", "--temperature", "0.8",
            "--logprobs", "0"]
    full = tmp_path / "full.jsonl"
    r = subprocess.run(argv + ["--out", str(full), "-q"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    expected = sorted(_comparable(x) for x in _strict_lines(full))
    assert len(expected) == R

    out = tmp_path / "out.jsonl"
    p = subprocess.Popen(argv + ["--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default_in_child)
    try:
        deadline = time.monotonic() + 600
        while not (out.exists() and b"\n" in out.read_bytes()):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)
        stdout, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "jaxsample: interrupted" in err and "--resume runs the rest" in err, err
    assert "Traceback" not in err, err
    text = out.read_text()
    assert text.endswith("\n")  # every written line whole (none torn: fsync per line)
    kept = _strict_lines(out)
    assert 1 <= len(kept) < R, len(kept)

    r = subprocess.run(argv + ["--out", str(out), "--resume"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"{len(kept)} of {R} requests are in" in r.stderr, r.stderr
    final = _strict_lines(out)
    assert out.read_text().startswith(text)  # the interrupted run's lines as they were
    assert sorted(x["id"] for x in final) == sorted(f"q{i}" for i in range(R))
    import jaxsample

    lm = jaxsample.load(TINY_GGUF)
    by_id = {x["id"]: x for x in _strict_lines(full)}
    ties = sum(_same_results_up_to_ties(lm, x, by_id[x["id"]], 0.8) for x in final)
    assert ties <= 2, ties


@pytest.mark.parametrize("mode", ["--json", "--out"])
def test_a_logit_bias_id_outside_the_vocabulary_is_refused_naming_the_line(capsys, monkeypatch,
                                                                           tmp_path, mode):
    """Regression: a bad `logit_bias` id on line 2 was refused by the engine
    after the weights had loaded (and line 1 had run), without naming the line."""
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", [
        {"prompt": "a b", "id": "a"}, {"prompt": "c d", "logit_bias": {"99999": 1.0}}])
    out = tmp_path / "out.jsonl"
    argv = ["--json"] if mode == "--json" else ["--out", str(out)]
    code = cli.main(["run", "--prompt-file", str(reqs)] + argv + FLAGS)
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert "line 2" in err and "logit_bias" in err and "99999" in err and "[0, 300)" in err
    assert not out.exists()


def test_kv_budget_sizes():
    from jaxsample.cli.parser import byte_size

    assert byte_size("2GiB") == 2 * 2**30 and byte_size("512 MiB") == 512 * 2**20
    assert byte_size("1e9") == 10**9 and byte_size("4GB") == 4 * 10**9 and byte_size("7") == 7
    for bad in ("", "GiB", "2 XB", "-1", "0", "nan", "1e400", "0.1"):
        with pytest.raises(Exception, match="byte"):
            byte_size(bad)


@pytest.mark.slow
@pytest.mark.subprocess
def test_distributed_parts_merged_equal_a_single_process_run(tmp_path):
    """Two CLI processes under jax.distributed (--distributed on loopback) each write
    their part; `jaxsample merge` joins them; the lines equal a one-process run's."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    R = 5  # blocks [0, 2) and [2, 5); each request its own seed: its own pool in both runs
    reqs = _write_requests(tmp_path / "in.jsonl", [
        {"prompt": f"question {i}: x", "id": f"q{i}", "seed": i} for i in range(R)])
    argv = [sys.executable, "-m", "jaxsample", "run", "--prompt-file", str(reqs), "-q",
            "--model", TINY_GGUF, "--n", "2", "--max-new-tokens", "8", "--temperature", "0.8"]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    out = tmp_path / "out.jsonl"
    procs = [subprocess.Popen(argv + ["--out", str(out), "--distributed", "--coordinator",
                                      f"127.0.0.1:{port}", "--num-processes", "2",
                                      "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    try:
        single = tmp_path / "single.jsonl"
        r = subprocess.run(argv + ["--out", str(single)], capture_output=True, text=True,
                           timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    parts = [tmp_path / f"out.jsonl.part-{k:05d}-of-00002" for k in range(2)]
    assert [sorted(x["index"] for x in _strict_lines(p)) for p in parts] == [[0, 1], [2, 3, 4]]
    done = subprocess.run([sys.executable, "-m", "jaxsample", "merge", "--out", str(out),
                           "--expect", str(R)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    merged = _strict_lines(out)
    assert [x["id"] for x in merged] == [f"q{i}" for i in range(R)]  # request order
    assert [_comparable(x) for x in merged] == sorted(
        (_comparable(x) for x in _strict_lines(single)),
        key=lambda t: json.loads(t)["index"])


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_missing_peer_is_said_not_waited_for_silently(tmp_path):
    """--num-processes 2 with one process started: it says what it waits for, and JAX
    ends it after --join-timeout (jax 0.10 aborts; no part file is written)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "jaxsample", "run", "--prompt-file", str(reqs),
                        "--out", str(out), "--model", TINY_GGUF, "--distributed",
                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                        "--process-id", "0", "--join-timeout", "2"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0
    first = r.stderr.splitlines()[0]
    assert first == (f"jaxsample: process 0 waiting for all 2 processes at 127.0.0.1:{port} "
                     "to join (JAX ends this process if they have not within --join-timeout "
                     "2 s)"), r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [reqs]


def test_a_kv_budget_that_fits_runs(tmp_path, capsys):
    """The up-front --kv-budget check (cli.requests.check_kv_budget) refuses only what
    the engine would: a budget that holds the calls runs and writes every line."""
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--kv-budget",
                     "64MiB", "-q"] + FLAGS)
    assert code == 0, capsys.readouterr().err
    assert len(_strict_lines(out)) == 3


@pytest.mark.slow
def test_without_out_each_call_is_printed_as_it_ends(tmp_path, capsys, monkeypatch):
    """`--json` on a .jsonl file: a call's lines are on stdout before the next call runs,
    so Ctrl-C during call 2 keeps call 1's (exit 130)."""
    real = cli.app.run_batch

    def second_call_interrupted(lm, cfg, args, batch, *a, **k):
        if batch[0].index > 0:
            raise KeyboardInterrupt
        return real(lm, cfg, args, batch, *a, **k)

    monkeypatch.setattr(cli.app, "run_batch", second_call_interrupted)
    reqs = _write_requests(tmp_path / "in.jsonl", [{"prompt": "a", "id": "x", "seed": 1},
                                                   {"prompt": "b", "id": "y", "seed": 2}])
    code = cli.main(["run", "--prompt-file", str(reqs), "--json", "-q"] + FLAGS)
    stdout = capsys.readouterr().out
    assert code == 130
    lines = [json.loads(x) for x in stdout.splitlines()]
    assert [x["id"] for x in lines] == ["x"]


# ---------------------------------------------------------------------------
# --resume keeps only finished results; one writer per file; editors' files; full disks


def _forged(line: bytes, how: str) -> bytes:
    """`line` (a finished result) forged or stubbed in one of many ways."""
    rec = json.loads(line)
    rid = rec["id"]
    if how == "stub":
        return (json.dumps({"id": rid}) + "\n").encode()
    if how == "partial":
        return (json.dumps({"id": rid, "branches": [{"text": "forged"}], "model": rec["model"]})
                + "\n").encode()
    field, _, action = how.partition(":")
    target, key = rec, field
    if "." in field:  # "branches.0.tokens" -> rec["branches"][0]["tokens"]
        *path, key = field.split(".")
        for p in path:
            target = target[int(p)] if p.isdigit() else target[p]
    if action == "drop":
        del target[key]
    elif action == "extra":
        target[key] = 1
    elif action == "halve":
        target[key] = target[key][: len(target[key]) // 2]
    else:
        target[key] = json.loads(action)
    return (json.dumps(rec) + "\n").encode()


FORGERIES = (["stub", "partial"]
             + [f"{f}:drop" for f in ("index", "model", "dtype", "weights", "prompt", "params",
                                      "branches", "result", "bill", "timings", "usage", "batch")]
             + ["forged:extra", "branches:halve", "branches.0.tokens:\"6\"",
                "branches.0.tokens:true", "branches.0.tokens:99", "branches.0.text:7",
                "branches.0.mean_logprob:\"x\"", "branches.0.finish_reason:null",
                "branches.1.answer:[1]", "branches.0.text:drop", "branches.0.token_ids:extra",
                "result.share:\"1\"", "result.branch:5", "result.answer:drop",
                "bill.decoded_tokens_total:drop", "bill.n:\"2\"", "bill.adaptive:1",
                "bill.pool:{\"requests\": \"x\"}", "timings.total:null",
                "usage.kept_tokens:1", "usage.prompt_tokens:-1", "batch.requests:[]",
                "result.share:1.5", "result.support:-1", "branches.0.finish_reason:\"done\"",
                "timings.load:-1", "usage.decoded_tokens:0",
                "index:5", "params.n:3", "params.seed:99", "prompt:\"other\"", "messages:extra",
                "params.extra:extra", "model:\"other\"", "weights:\"int8\""])


@pytest.mark.parametrize("how", FORGERIES)
def test_resume_refuses_a_stub_or_forged_line_naming_it(capsys, monkeypatch, tmp_path,
                                                        three_done, how):
    """A kept line must hold everything the writer writes for its request, with the
    right types and settings; otherwise --resume refuses the file naming the line,
    before any load, and leaves it as it was (never treats the line as done)."""
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    lines = list(three_done)
    lines[1] = _forged(lines[1], how)
    out.write_bytes(b"".join(lines))
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    stdout, err = capsys.readouterr()
    rid = json.loads(lines[1])["id"]
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert f"line 2 (id {rid!r})" in err and "Traceback" not in err, err
    assert out.read_bytes() == b"".join(lines)


def test_resume_checks_lines_of_ids_not_in_the_prompt_file_too(capsys, monkeypatch, tmp_path,
                                                               three_done):
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE[:2])
    out = tmp_path / "out.jsonl"
    other = next(x for x in three_done if json.loads(x)["id"] == "7")
    kept = [x for x in three_done if x != other]
    out.write_bytes(b"".join(kept) + other)  # a full line of an id the prompt file lacks: kept
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    assert code == 0 and "1 lines of ids not in the prompt file kept" in capsys.readouterr().err
    out.write_bytes(b"".join(kept) + b'{"id": "zz"}\n')  # a stub of one: refused
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    err = capsys.readouterr().err
    assert code == 2 and "line 3 (id 'zz')" in err and "missing" in err, err


def test_resume_accepts_a_byte_order_mark_and_a_trailing_blank_line(capsys, monkeypatch,
                                                                    tmp_path, three_done):
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    text = b"\xef\xbb\xbf" + b"".join(three_done) + b"\n"
    out.write_bytes(text)
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    assert code == 0 and "all 3 requests are in" in capsys.readouterr().err
    assert out.read_bytes() == text


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("resume", [False, True])
def test_a_second_run_on_a_held_out_file_is_refused_with_the_holders_pid(
        capsys, monkeypatch, tmp_path, three_done, resume):
    """Another process holds the out file (a real one, through its lock): the run is
    refused in one line naming the file and that pid, exit 2, before any load, and the
    file is untouched."""
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    text = three_done[0]
    out.write_bytes(text)
    with results_file_held(out) as pid:
        code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out)]
                        + (["--resume"] if resume else []) + FLAGS)
        stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert f"{out} is being written by another run (pid {pid})" in err, err
    assert out.read_bytes() == text


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_runs_on_one_out_file_one_writes_the_other_is_refused(tmp_path):
    """Two real `jaxsample run` processes on one --out at once (the file empty, then
    with --resume on a seeded file): one writes every line, the other exits 2 in one
    line naming the file, and the file holds each id once, every line whole."""
    R = 40
    reqs = _write_requests(tmp_path / "in.jsonl",
                           [{"id": f"m{i}", "prompt": f"request number {i}"} for i in range(R)])
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "jaxsample", "run", "--prompt-file", str(reqs), "--out",
            str(out), "-q"] + FLAGS
    for extra in ([], ["--resume"]):
        if extra:  # five lines seeded
            lines = out.read_bytes().splitlines(keepends=True)
            out.write_bytes(b"".join(lines[:5]))
        procs = [subprocess.Popen(argv + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        got = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
        codes = sorted(c for _, _, c in got)
        assert codes == [0, 2], got
        _, err, _ = next(g for g in got if g[2] == 2)
        assert err.count("\n") == 1 and str(out) in err and "Traceback" not in err, err
        assert "being written by another run (pid" in err or "already holds results" in err
        recs = _strict_lines(out)
        assert sorted(r["id"] for r in recs) == sorted(f"m{i}" for i in range(R))
    r = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_is_one_line_naming_the_out_path(tmp_path):
    reqs = _write_requests(tmp_path / "in.jsonl", THREE[:1])
    code, stdout, err = _main(["run", "--prompt-file", str(reqs), "--out", "/dev/full", "-q"]
                              + FLAGS)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("jaxsample: error: /dev/full: No space left on device"), err


@pytest.mark.parametrize("line, needle", [
    ('{"id": "a", "prompt": "hi \\udfff there"}', "prompt holds a lone surrogate ('\\udfff' at "
                                                  "character 3)"),
    ('{"id": "\\ud800", "prompt": "hi"}', "id holds a lone surrogate"),
    ('{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages[0].content holds"),
    ('{"messages": [{"role": "\\ud800x", "content": "a"}]}', "messages[0].role holds"),
    ('{"prompt": "x", "stop": ["ok", "\\udc80"]}', "stop[1] holds"),
    ('{"prompt": "x", "\\udc80": 1}', "the key '\\udc80' holds"),
])
def test_a_lone_surrogate_in_a_request_line_is_refused_with_the_line(
        capsys, monkeypatch, tmp_path, line, needle):
    """A lone surrogate (an unpaired \\u escape) anywhere in a request line is refused
    naming the line and the item, before any load, and no out file is created."""
    _no_load(monkeypatch)
    reqs = tmp_path / "in.jsonl"
    reqs.write_text('{"prompt": "fine", "id": "ok"}\n' + line + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out)] + FLAGS)
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert f"{reqs} line 2: " in err and needle in err, err
    assert not out.exists()


def test_a_lone_surrogate_in_a_flag_is_refused(capsys, monkeypatch):
    """Bytes that are not UTF-8 in an argument reach Python as lone surrogates."""
    _no_load(monkeypatch)
    for argv, needle in ((["--prompt", "hi \udcff"], "--prompt: the prompt holds a lone"),
                         (["--prompt", "hi", "--stop", "\udcff"], "--stop"),
                         (["--prompt", "hi", "--shared-prefix", "a\udcff"],
                          "--shared-prefix: the shared prefix holds")):
        code = cli.main(["run", "--model", TINY_GGUF] + argv)
        stdout, err = capsys.readouterr()
        assert code == 2 and stdout == "" and err.count("\n") == 1 and needle in err, err


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--logprobs", "2"], ["--logprobs", "0"], ["--reduce", "best"], ["--reduce", "none"],
    ["--select", "self-certainty"], ["--adaptive", "esc", "--max-n", "4", "--window", "2"],
    ["--shared-prefix", "Context: x y z.", "--no-chat"], ["--stop", "a", "--seed", "5"]])
def test_every_kind_of_line_the_writer_writes_is_kept_by_resume(capsys, tmp_path, flags):
    """The schema follows the writer: a finished file of each kind of run (logprobs,
    reducers, selection signals, adaptive, shared prefix, chat messages) resumes with
    nothing to run."""
    reqs = _write_requests(tmp_path / "in.jsonl", THREE[:2] + [
        {"messages": [{"role": "user", "content": "hello"}], "id": "chat"}])
    out = tmp_path / "out.jsonl"
    argv = ["run", "--prompt-file", str(reqs), "--out", str(out)] + FLAGS + flags
    assert cli.main(argv + ["-q"]) == 0, capsys.readouterr().err
    text = out.read_bytes()
    assert cli.main(argv + ["--resume"]) == 0
    assert "all 3 requests are in" in capsys.readouterr().err
    assert out.read_bytes() == text


def _without_bill_parts(line: bytes, saving=None) -> bytes:
    """`line` as a writer without the bill's optional parts wrote it: no "adaptive",
    "pool" nor "slot_utilisation" in the bill; an adaptive result with `saving`."""
    rec = json.loads(line)
    for key in ("adaptive", "pool", "slot_utilisation"):
        del rec["bill"][key]
    if saving is not None:
        rec["result"]["saving"] = saving
    return (json.dumps(rec) + "\n").encode()


def test_resume_keeps_lines_whose_bill_has_no_parts(capsys, monkeypatch, tmp_path, three_done):
    """Lines whose bill lacks the optional parts are finished results: --resume keeps
    them all and runs nothing (no weights read)."""
    _no_load(monkeypatch)
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    lines = [_without_bill_parts(x) for x in three_done]
    out.write_bytes(b"".join(lines))
    code = cli.main(["run", "--prompt-file", str(reqs), "--out", str(out), "--resume"] + FLAGS)
    assert code == 0 and "all 3 requests are in" in capsys.readouterr().err
    assert out.read_bytes() == b"".join(lines)


def test_resume_keeps_adaptive_lines_with_a_saving_result(capsys, monkeypatch, tmp_path):
    """An adaptive line whose result holds "saving" (the comparison with the fixed run,
    numbers) and whose bill has no parts is kept; a "saving" that is not numbers is
    refused naming the line."""
    reqs = _write_requests(tmp_path / "in.jsonl", THREE)
    out = tmp_path / "out.jsonl"
    argv = ["run", "--prompt-file", str(reqs), "--out", str(out)] + FLAGS + [
        "--adaptive", "esc", "--max-n", "4", "--window", "2"]
    assert cli.main(argv + ["-q"]) == 0, capsys.readouterr().err
    saving = {"num_prompts": 1, "max_n": 4, "rounds": 1, "prompt_tokens_prefilled": 2,
              "branches_drawn": 2, "decoded_tokens": 12, "branch_steps": 12,
              "decode_flops": 1000, "fixed_decoded_tokens": 24, "fixed_decode_flops": 2000,
              "token_saving": 0.5, "flop_saving": 0.5}
    lines = [_without_bill_parts(x, saving) for x in out.read_bytes().splitlines(keepends=True)]
    out.write_bytes(b"".join(lines))
    _no_load(monkeypatch)
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 0
    assert "all 3 requests are in" in capsys.readouterr().err
    assert out.read_bytes() == b"".join(lines)
    lines[1] = _forged(lines[1], 'result.saving:{"x": "y"}')
    out.write_bytes(b"".join(lines))
    assert cli.main(argv + ["--resume"]) == 2
    assert "line 2" in capsys.readouterr().err
