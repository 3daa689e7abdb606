"""The documented examples run as tests, so the docs cannot drift from the code.

A fenced ```python block of README.md or of a page under docs/ runs when the
line just before its fence is one of these HTML comments (invisible on the
rendered page):

    <!-- test -->            run on the tiny random model, in the fast tier
    <!-- test: slow -->      run on the tiny random model, marked slow (a page
                             whose calls compile many programs)
    <!-- test: embedded -->  run as written, on the embedded model (marked slow)

The runnable blocks of one file run in order in one namespace, as a reader
would run the page: a later block may use what an earlier one defined. What
they print is not compared: the values the pages show in comments are what
the embedded model prints, which the tiny model does not. A block fails the
test by raising.

The one substitution on the tiny model: `jaxsample.loading.load`, behind
`jaxsample.load()` and `LLM("smollm2-135m-instruct")`, returns the tiny model
(`jaxsample.tiny.make_tiny_lm`: random weights, a byte tokenizer with a
chat template) for the embedded model's names; any other name loads as
usual. A page of such blocks therefore runs every call it shows, with the
same arguments, without loading SmolLM2; int8 weights need the real model
(`<!-- test: embedded -->`).
"""

from __future__ import annotations

import pathlib
import re

import pytest
from paths import ROOT

PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
MARK = re.compile(r"^<!-- test(?::\s*(\w+))? -->$")
FENCE = re.compile(r"^(`{3,})(\S*)")
EMBEDDED = (None, "smollm2-135m-instruct", "smollm2-135m")


def blocks(path: pathlib.Path) -> list[tuple[str | None, int, str]]:
    """The marked blocks of a page: (mode, line number, code); mode None is fast.

    Raises AssertionError for a marker not followed by a ```python fence, or an
    unknown mode: a mistyped marker must not silently skip its block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = MARK.match(lines[i].strip())
        if not m:
            i += 1
            continue
        mode = m.group(1)
        assert mode in (None, "slow", "embedded"), \
            f"{path.name}:{i + 1}: unknown test mode {mode!r}"
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert fence and fence.group(2) == "python", \
            f"{path.name}:{i + 1}: a test marker must be followed by a ```python fence"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith(fence.group(1)))
        out.append((mode, i + 3, "\n".join(lines[i + 2:end]) + "\n"))
        i = end + 1
    return out


def marked(mode):
    return [p for p in PAGES if any(m == mode for m, _, _ in blocks(p))]


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def run_page(path: pathlib.Path, mode) -> None:
    """Run the page's blocks of `mode` in order in one namespace; a failure names
    the page and the block's first line."""
    ns: dict = {"__name__": f"docs_example_{path.stem}"}
    for m, line, code in blocks(path):
        if m != mode:
            continue
        try:
            exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), ns)  # noqa: S102
        except Exception as e:
            raise AssertionError(f"{path.relative_to(ROOT)}, the block at line {line}: "
                                 f"{type(e).__name__}: {e}") from e


@pytest.fixture
def tiny_model(monkeypatch, tiny_lm):
    """`jaxsample.loading.load` gives the tiny model for the embedded model's names."""
    from jaxsample import loading

    real = loading.load

    def load(name_or_path=None, *args, **kwargs):
        if name_or_path in EMBEDDED:
            assert not args and kwargs.get("weights") is None, \
                "a block on the tiny model asked for int8 weights: mark it <!-- test: embedded -->"
            return tiny_lm
        return real(name_or_path, *args, **kwargs)

    monkeypatch.setattr(loading, "load", load)


@pytest.mark.slow
@pytest.mark.parametrize("page", marked(None), ids=_ids(marked(None)))
def test_documented_examples_run_on_the_tiny_model(page, tiny_model, capsys):
    run_page(page, None)


@pytest.mark.slow
@pytest.mark.parametrize("page", marked("slow"), ids=_ids(marked("slow")))
def test_slow_documented_examples_run_on_the_tiny_model(page, tiny_model, capsys):
    run_page(page, "slow")


@pytest.mark.slow
@pytest.mark.parametrize("page", marked("embedded"), ids=_ids(marked("embedded")))
def test_documented_examples_run_on_the_embedded_model(page, capsys):
    run_page(page, "embedded")


def test_markers_are_well_formed():
    """Every page parses (a marker always precedes a ```python fence), and the pages
    that show the engine object have runnable examples."""
    found = {p.relative_to(ROOT).as_posix(): blocks(p) for p in PAGES}
    for page in ("README.md", "docs/index.md", "docs/how-to/python.md",
                 "docs/concepts/keys.md"):
        assert found[page], f"{page} has no runnable example"


def test_readme_quick_start_is_the_benchmarked_block():
    """README's Python block is `benchmarks/startup.py --python`'s QUICKSTART, so the
    start-up it measures is the one a reader runs."""
    import ast

    tree = ast.parse((ROOT / "benchmarks" / "startup.py").read_text(encoding="utf-8"))
    [QUICKSTART] = [ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign)
                    and [getattr(t, "id", None) for t in node.targets] == ["QUICKSTART"]]
    [(mode, _, code)] = [b for b in blocks(ROOT / "README.md")]
    assert mode is None
    assert code.strip() == QUICKSTART.strip()
    index = [c for _, _, c in blocks(ROOT / "docs" / "index.md")]
    assert index[0].strip() == QUICKSTART.strip()


def _fenced(path: pathlib.Path, info: str) -> list[list[str]]:
    """The lines of every ```info block of a page."""
    out, block = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if block is None and line.strip() == "```" + info:
            block = []
        elif block is not None and line.strip() == "```":
            out.append(block)
            block = None
        elif block is not None:
            block.append(line)
    return out


@pytest.mark.slow
def test_readme_command_prints_what_the_readme_shows(monkeypatch, compilation_cache_calls):
    """README's `jaxsample run` command, run as written (in process, 100 columns), prints
    the README's expected output: the same heading, table header, one row per branch,
    vote and bill lines, and the bill's prefill line word for word (it depends only on
    the tokenizer and the config). The branches' texts are not compared: another
    CPU's rounding may flip a sampled token."""
    import shlex

    from helpers import main_captured

    readme = ROOT / "README.md"
    [command] = [line for block in _fenced(readme, "bash") for line in block
                 if "jaxsample run" in line]
    argv = shlex.split(command.split("jaxsample run", 1)[1])
    expected = [line.rstrip() for line in _fenced(readme, "text")[0]]
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = main_captured(["run"] + argv)
    assert code == 0, err
    got = [line.rstrip() for line in out.splitlines()]

    shown = [line for line in expected if not line.startswith("jaxsample: ")]
    assert got[0] == shown[0]  # "smollm2-135m-instruct: 8 branches (temperature ...)"
    header = next(line for line in shown if line.lstrip().startswith("#"))
    assert header in got
    row = re.compile(r"^ +\d+ +\S+ +\d+ +(stop|length) +-?\d+\.\d{3} +\S.*$")
    assert sum(bool(row.match(line)) for line in got) == \
        sum(bool(row.match(line)) for line in shown) == 8
    vote = re.compile(r"^vote: \S+  share \d\.\d\d  support \d+ of \d+ answering branches "
                      r"\(8 sampled; first given by branch \d+\)$")
    assert any(vote.match(line) for line in got) and any(vote.match(line) for line in shown)
    prefill = next(line for line in shown if line.startswith("prefill: "))
    assert prefill in got
    for start in ("bill", "decode: ", "KV cache held: ", "decode reads: ", "timings: "):
        assert any(line.startswith(start) for line in got), start
        assert any(line.startswith(start) for line in shown), start
    # stderr: the progress lines the README keeps, numbers aside.
    assert "jaxsample: decoding 8 branches of 1 prompt, up to 32 tokens each" in err
    assert "jaxsample: decoding 8 branches of 1 prompt, up to 32 tokens each" in expected
    assert re.search(r"jaxsample: decoded \d+ tokens in ", err)
