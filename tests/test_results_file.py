"""The results file of a many-request run (jaxsample/cli/results_file.py): strict JSON
lines, flushed and fsynced, resume by id, a torn last line cut and redone."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from jaxsample.errors import InputError
from jaxsample.cli.console import dumps
from jaxsample.cli.results_file import ResultsFile


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f.read().splitlines()]


def test_each_line_is_strict_json_flushed_and_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    path = tmp_path / "out.jsonl"
    with ResultsFile(path) as out:
        out.write({"id": "a", "x": float("nan"), "t": "é ☕"})
        # Readable from another handle at once (flushed), before close.
        assert _lines(path) == [{"id": "a", "x": None, "t": "é ☕"}]
        out.write({"id": "b", "y": [1.5, float("inf")]})
    assert len(synced) == 2
    assert _lines(path)[1] == {"id": "b", "y": [1.5, None]}
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert dumps({"a": float("-inf")}) == '{"a": null}'


def test_resume_keeps_complete_lines_and_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultsFile(path) as out:
        out.write({"id": "a"})
        out.write({"id": "b"})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"id": "c", "text": "interrup')  # a crash in the middle of a write
    out = ResultsFile(path, resume=True)
    assert out.done == {"a", "b"} and out.torn.startswith('{"id": "c"')
    out.write({"id": "c", "text": "whole"})
    out.close()
    assert [x["id"] for x in _lines(path)] == ["a", "b", "c"]
    # A fresh (non-resume) file starts empty.
    ResultsFile(path).close()
    assert path.read_text() == ""


def test_resume_refuses_a_corrupt_middle_line_and_duplicate_ids(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="line 2"):
        ResultsFile(path, resume=True)
    path.write_text('{"id": "a"}\n{"id": "a"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="line 2.*twice"):
        ResultsFile(path, resume=True)
    path.write_text('{"id": "a", "x": NaN}\n', encoding="utf-8")
    with pytest.raises(InputError, match="line 1"):
        ResultsFile(path, resume=True)
    path.write_text('{"id": "a", "id": "b"}\n{"id": "c"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="line 1: key 'id' appears twice"):
        ResultsFile(path, resume=True)
    path.write_text('{"id": "a"}\n', encoding="utf-8")
    with ResultsFile(path, resume=True) as out:
        with pytest.raises(ValueError, match="already"):
            out.write({"id": "a"})
        with pytest.raises(ValueError, match="id"):
            out.write({"x": 1})



@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signal masks")
def test_ctrl_c_during_a_write_lands_after_the_whole_line(tmp_path):
    """SIGINT arriving while a line is being written (here: between its two halves) is
    held until the line is whole and fsynced, then arrives as KeyboardInterrupt; the old
    write let it cut the line in two."""
    path = tmp_path / "out.jsonl"
    f = ResultsFile(path)
    f.write({"id": "a"})

    class Halves:  # the file object, writing each text in two halves with Ctrl-C between
        def __init__(self, inner):
            self.inner = inner

        def write(self, text):
            self.inner.write(text[:len(text) // 2])
            os.kill(os.getpid(), signal.SIGINT)
            self.inner.write(text[len(text) // 2:])

        def __getattr__(self, name):
            return getattr(self.inner, name)

    f._f = Halves(f._f)
    with pytest.raises(KeyboardInterrupt):
        f.write({"id": "b", "text": "x" * 1000})
        time.sleep(1)  # (not reached: the interrupt comes as the write returns)
    assert f.done == {"a", "b"}
    f.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"] and path.read_text().endswith("\n")
    with ResultsFile(path, resume=True) as again:
        assert again.done == {"a", "b"} and again.torn is None
