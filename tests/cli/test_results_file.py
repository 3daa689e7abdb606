"""The results file of a many-request run (jaxsample/cli/results_file.py): strict JSON
lines, fsynced, resume by id, a torn last line cut and redone, one writer per file
(a second process refused with the holder's pid), a failed write cut back off."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from helpers import results_file_held, sigint_raises_keyboard_interrupt

from jaxsample.cli.console import dumps
from jaxsample.cli.results_file import ResultsFile
from jaxsample.errors import InputError


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
    # Without resume a file holding lines is refused, never truncated.
    before = path.read_bytes()
    with pytest.raises(InputError, match="already holds results"):
        ResultsFile(path)
    assert path.read_bytes() == before


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

    real = f._write_all

    def halves(data):  # the line written in two halves with Ctrl-C between
        real(data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGINT)
        real(data[len(data) // 2:])

    f._write_all = halves
    with sigint_raises_keyboard_interrupt(), pytest.raises(KeyboardInterrupt):
        f.write({"id": "b", "text": "x" * 1000})
        time.sleep(1)  # (not reached: the interrupt comes as the write returns)
    assert f.done == {"a", "b"}
    f.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"] and path.read_text().endswith("\n")
    with ResultsFile(path, resume=True) as again:
        assert again.done == {"a", "b"} and again.torn is None


def test_resume_skips_a_byte_order_mark_and_blank_lines(tmp_path):
    """An editor's BOM and blank lines (a trailing "\\n\\n") are skipped, as the prompt-file
    reader skips blank lines; a torn line after them is still cut at the right byte."""
    path = tmp_path / "out.jsonl"
    head = b'\xef\xbb\xbf{"id": "a"}\n\n  \n{"id": "b"}\r\n\n'
    path.write_bytes(head + b'{"id": "c", "te')
    with ResultsFile(path, resume=True) as out:
        assert out.done == {"a", "b"} and out.torn.startswith('{"id": "c"')
        out.write({"id": "c"})
    assert path.read_bytes() == head + b'{"id": "c"}\n'
    with ResultsFile(path, resume=True) as out:
        assert out.done == {"a", "b", "c"} and out.torn is None


def test_a_line_the_check_refuses_names_the_line_and_leaves_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    text = b'{"id": "a", "ok": 1}\n{"id": "b"}\n'
    path.write_bytes(text)

    def check(obj):
        if "ok" not in obj:
            raise ValueError("missing 'ok'")

    with pytest.raises(InputError, match=r"line 2 \(id 'b'\): missing 'ok'"):
        ResultsFile(path, resume=True, check=check)
    assert path.read_bytes() == text


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    """A real second process holds the file: opening it (with or without resume, by
    another path to it) is refused at once naming the holder's pid, and the file is left
    byte for byte; once the holder ends, the file opens."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b", "to')  # a torn last line: not cut by a refusal
    with results_file_held(path, write=True) as pid:
        before = path.read_bytes()
        link = tmp_path / "link.jsonl"
        link.symlink_to(path)
        for target, resume in ((path, True), (path, False), (link, True)):
            with pytest.raises(InputError, match=rf"being written by another run \(pid {pid}\)"):
                ResultsFile(target, resume=resume)
            assert path.read_bytes() == before
    with ResultsFile(path, resume=True) as out:  # the lock went with its holder
        assert out.done == {"a", "held"}


def test_a_failed_write_is_cut_back_and_names_the_file(tmp_path, monkeypatch):
    """A full disk mid-line: the part written is cut off again (every line whole), and
    the OSError names the file; /dev/full's ENOSPC names it too."""
    import errno

    path = tmp_path / "out.jsonl"
    out = ResultsFile(path)
    out.write({"id": "a"})
    real = os.write

    def half_then_full(fd, data):
        if fd != out._fd:
            return real(fd, data)
        if len(data) > 4:
            return real(fd, bytes(data[:4]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as e:
        out.write({"id": "b", "text": "x" * 100})
    assert e.value.filename == str(path) and e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == b'{"id": "a"}\n' and out.done == {"a"}
    out.close()
    if os.path.exists("/dev/full"):
        with ResultsFile("/dev/full") as full:
            with pytest.raises(OSError) as e:
                full.write({"id": "a"})
            assert e.value.filename == "/dev/full" and e.value.errno == errno.ENOSPC


def test_a_file_created_and_never_written_is_removed_on_failure(tmp_path):
    """A run that created the file and failed before its first line (its load failed)
    leaves nothing; one that ends well keeps its (possibly empty) file, and a file that
    was there stays."""
    path = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError):
        with ResultsFile(path):
            raise RuntimeError("the load failed")
    assert not path.exists()
    ResultsFile(path).close()  # an empty share: its empty part stays
    assert path.read_bytes() == b""
    ResultsFile(path).close(failed=True)
    assert path.exists()
