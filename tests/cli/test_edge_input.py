"""The command line's JSON, flags and exits on edge input.

Strict JSON (no NaN / Infinity anywhere), `.jsonl` ids, float32 values at float32
precision, `--max-tokens` and `--logprobs K`, logit_bias keys on a request line, and
a reader that leaves early (`| head -1`).
"""

import json
import os
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from helpers import main_captured as _main
from hypothesis import given, settings
from hypothesis import strategies as st
from paths import ROOT, TINY_GGUF

from jaxsample import cli

TINY_RUN = ["run", "--model", TINY_GGUF, "--n", "3", "--max-new-tokens", "7", "--seed", "0",
            "--quiet"]


# In-process runs never change this process's JAX config (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_calls")


def _strict_loads(text):
    """json.loads that refuses NaN, Infinity and -Infinity (Python's json accepts them)."""
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------------------
# float32 values: the shortest decimal that rounds back to the float32


def _rounds_to_f32(q: Fraction, x: np.float32) -> bool:
    """Exact oracle: does the rational q round to the float32 x (round half to even)?"""
    lo = np.nextafter(x, np.float32(-np.inf))
    hi = np.nextafter(x, np.float32(np.inf))
    fx = Fraction(float(x))
    below = (fx + Fraction(float(lo))) / 2 if np.isfinite(lo) else None
    above = ((fx + Fraction(float(hi))) / 2 if np.isfinite(hi)
             else fx + (fx - Fraction(float(lo))) / 2)  # the largest float32: overflow bound
    if below is None:
        below = fx - (Fraction(float(hi)) - fx) / 2
    even = int(np.asarray(x).view(np.uint32)) % 2 == 0
    if below < q < above:
        return True
    return even and q in (below, above)


def _significant_digits(token: str) -> str:
    mantissa = token.lstrip("-").lower().split("e")[0].replace(".", "")
    return mantissa.strip("0") or "0"


def _shorter_one_exists(x: np.float32, k: int) -> bool:
    """Does a decimal of k - 1 significant digits round to x? (The two nearest such
    decimals, below and above x, are the only candidates: the set that rounds to x
    is an interval around x.)"""
    if k <= 1:
        return False
    fx = Fraction(float(x))
    e = Decimal(float(x)).adjusted()  # x = d.ddd * 10**e
    scale = Fraction(10) ** (e - (k - 2))
    low = (fx / scale).__floor__() * scale
    return _rounds_to_f32(low, x) or _rounds_to_f32(low + scale, x)


@pytest.mark.slow
@settings(max_examples=3000)
@given(st.integers(0, 2**32 - 1))
def test_f32_is_the_shortest_decimal_that_round_trips(bits):
    x = np.array(bits, np.uint32).view(np.float32)[()]
    value = cli.console._f32(x)
    if not np.isfinite(x):
        assert value is None
        return
    token = cli.dumps(value)  # what the JSON output holds
    assert _rounds_to_f32(Fraction(token), x), (x, token)
    assert np.float32(json.loads(token)) == x
    digits = _significant_digits(token)
    assert len(digits) <= 9 and not _shorter_one_exists(x, len(digits)), (x, token)


def test_f32_examples():
    assert cli.dumps(cli.console._f32(np.float32(0.5333333611488342))) == "0.53333336"
    assert cli.dumps(cli.console._f32(np.float32(-1.195))) == "-1.195"
    assert cli.dumps(cli.console._f32(np.float32(0.1))) == "0.1"
    assert cli.dumps(cli.console._f32(np.float32(1e-45))) == "1e-45"  # the smallest subnormal
    assert cli.dumps(cli.console._f32_list(np.array([[0.25, np.nan]], np.float32))) == "[[0.25, null]]"


def test_dumps_is_strict_json():
    assert cli.dumps({"a": float("nan"), "b": [float("inf"), 1.5], "c": "é"}) == (
        '{"a": null, "b": [null, 1.5], "c": "é"}')
    # The one JSON writer: no other json.dumps in the command line's package.
    import pathlib

    counts = {f.name: f.read_text(encoding="utf-8").count("json.dumps(")
              for f in pathlib.Path(cli.__file__).parent.glob("*.py")}
    assert counts.pop("console.py") == 1 and not any(counts.values()), counts


# ---------------------------------------------------------------------------
# .jsonl ids and request-line errors


@pytest.mark.parametrize("line,needle", [
    ('{"prompt": "x", "id": 1e400}', '"id" must be'),
    ('{"prompt": "x", "id": -1e400}', '"id" must be'),
    ('{"prompt": "x", "id": NaN}', '"id" must be'),
    ('{"prompt": "x", "id": Infinity}', '"id" must be'),
    ('{"prompt": "x", "id": true}', '"id" must be'),
    ('{"prompt": "x", "logit_bias": {"\u00b2": 1}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"++5": 1}}', "'++5'"),
    ('{"prompt": "x", "logprobs": 21}', "logprobs"),
    ('{"prompt": "x", "temperature": 0.1, "temperature": 2}', "'temperature' appears twice"),
    # vLLM / Hugging Face names get the jaxsample equivalent, as in SamplingParams
    ('{"prompt": "x", "num_return_sequences": 4}', "num_return_sequences: use n"),
    ('{"prompt": "x", "max_length": 4}', "max_length: use max_new_tokens"),
    ('{"prompt": "x", "use_beam_search": true}', "beam search is not supported"),
])
def test_bad_request_lines_name_the_line(capsys, tmp_path, line, needle):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n", encoding="utf-8")
    # (A model that does not exist: the line must be refused before the model is looked at.)
    code = cli.main(["run", "--prompt-file", str(f), "--model", str(tmp_path / "none.gguf")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"{f} line 2" in err and needle in err and "invalid literal" not in err


def test_bad_flags_are_one_line(capsys):
    for argv, needle in ((["--logprobs", "21"], "--logprobs"), (["--logprobs", "-1"], "--logprobs"),
                         (["--max-tokens", "0"], "max_new_tokens"),
                         (["--max-tokens", "1.5"], "--max-tokens: expected an integer")):
        code = cli.main(["run", "--prompt", "x"] + argv)
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and needle in err, (argv, err)


@pytest.mark.slow
def test_jsonl_ids_are_echoed_and_the_output_is_strict_json(tmp_path):
    f = tmp_path / "r.jsonl"
    ids = ["q1", 7, 2.5, None, -0.0, 10**30, "é"]
    f.write_text("\n".join(json.dumps({"prompt": "hi", "id": i}) for i in ids) + "\n",
                 encoding="utf-8")
    code, out, err = _main(TINY_RUN[:1] + ["--prompt-file", str(f)] + TINY_RUN[1:] + ["--json"])
    assert code == 0, err
    records = [_strict_loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == ids
    assert all(type(r["id"]) is type(i) for r, i in zip(records, ids))


# ---------------------------------------------------------------------------
# --max-tokens, --logprobs K


@pytest.fixture(scope="module")
def logprobs_run():
    pytest.importorskip("jaxsample.engine")
    code, out, err = _main(["run", "--model", TINY_GGUF, "--prompt", "hi", "--n", "3",
                            "--max-tokens", "7", "--logprobs", "3", "--json", "--quiet",
                            "--seed", "0", "--temperature", "1.0"])
    assert code == 0, err
    return out


@pytest.mark.slow
def test_max_tokens_is_max_new_tokens(logprobs_run):
    d = _strict_loads(logprobs_run)
    assert d["params"]["max_new_tokens"] == 7 == d["params"]["max_tokens"]
    assert all(b["tokens"] <= 7 for b in d["branches"])


@pytest.mark.slow
def test_logprobs_in_json_match_a_full_forward_pass(logprobs_run):
    import jax
    import jax.numpy as jnp

    import jaxsample
    from jaxsample import SamplingParams

    d = _strict_loads(logprobs_run)
    assert d["params"]["logprobs"] == 3
    lm = jaxsample.load(TINY_GGUF, cache=False)
    # The prompt ids the engine used (same rendering as the command line: chat on).
    rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    prompt_ids = list(jaxsample.generate(lm, [rendered], SamplingParams(
        n=1, max_new_tokens=1, seed=0)).prompt_tokens[0])
    for b in d["branches"]:
        L = b["tokens"]
        assert len(b["token_ids"]) == len(b["token_logprobs"]) == L
        assert np.shape(b["top_token_ids"]) == np.shape(b["top_logprobs"]) == (L, 3)
        seq = prompt_ids + b["token_ids"]
        width = 1 << (len(seq) - 1).bit_length()
        row = np.zeros((1, width), np.int32)
        row[0, :len(seq)] = seq
        logits = np.asarray(lm.forward(row))[0, len(prompt_ids) - 1:len(seq) - 1]
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(
            logits[:, :lm.vocab_limit], jnp.float32), axis=-1), np.float64)
        for t in range(L):
            tok = b["token_ids"][t]
            assert abs(b["token_logprobs"][t] - ref[t, tok]) < 1e-4
            # The top 3 by value (robust to ties between ids): the reference's 3 largest.
            np.testing.assert_allclose(b["top_logprobs"][t], np.sort(ref[t])[::-1][:3],
                                       atol=1e-4)
            for i, lp in zip(b["top_token_ids"][t], b["top_logprobs"][t]):
                assert abs(ref[t, i] - lp) < 1e-4
    # Every float32-derived figure is written at float32 precision (<= 9 digits).
    raw = json.loads(logprobs_run, parse_float=str)
    tokens = [raw["result"].get("share"), raw["result"].get("support")]
    for b in raw["branches"]:
        tokens += [b["mean_logprob"]] + b["token_logprobs"] + sum(b["top_logprobs"], [])
    for token in filter(None, tokens):
        x = np.float32(float(token))
        assert _rounds_to_f32(Fraction(token), x)
        assert not _shorter_one_exists(x, len(_significant_digits(token))), token


@pytest.mark.slow
def test_a_request_lines_logprobs_reach_the_output(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"prompt": "hi", "logprobs": 3}\n{"prompt": "hi", "logprobs": 0}\n'
                 '{"prompt": "hi"}\n')
    code, out, err = _main(TINY_RUN[:1] + ["--prompt-file", str(f)] + TINY_RUN[1:] + ["--json"])
    assert code == 0, err
    two, zero, none = [_strict_loads(line) for line in out.splitlines()]
    for b in two["branches"]:
        assert len(b["token_ids"]) == b["tokens"] and np.shape(b["top_token_ids"]) == (
            b["tokens"], 3)
        assert all(x >= y for x, y in zip(b["top_logprobs"][0], b["top_logprobs"][0][1:]))
    for b in zero["branches"]:  # 0: the sampled tokens' logprobs alone (vLLM)
        assert len(b["token_logprobs"]) == b["tokens"] and "top_token_ids" not in b
    for b in none["branches"]:  # not asked: the keys of before
        assert set(b) == {"text", "answer", "tokens", "mean_logprob", "finish_reason"}


# ---------------------------------------------------------------------------
# A reader that leaves early: `jaxsample ... | head -1`


def _closed_early(argv, tmp_path):
    """Run the command line with its stdout's read end closed at once (the child is still
    importing): every write to stdout then fails with EPIPE."""
    env = {**os.environ, "JAXSAMPLE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "100"}
    p = subprocess.Popen([sys.executable, "-m", "jaxsample"] + argv, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    return p.wait(timeout=300), err


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "table"])
def test_a_broken_pipe_exits_quietly(tmp_path, json_flag):
    code, err = _closed_early(["price", "--model", "tiny", "--n", "1,4"] + json_flag, tmp_path)
    assert code == 141 and err == "", err


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "table"])
def test_a_broken_pipe_during_run_exits_quietly(tmp_path, json_flag):
    code, err = _closed_early(TINY_RUN[:1] + ["--prompt", "hi"] + TINY_RUN[1:-1] + json_flag,
                              tmp_path)
    assert code == 141, err
    assert "error" not in err and "Broken pipe" not in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------
# The porting guide's claims (docs/how-to/porting.md)


def test_porting_guide_vllm_row_is_true():
    import re

    from jaxsample import SamplingParams

    page = ROOT / "docs" / "how-to" / "porting.md"
    row = next(line for line in page.read_text(encoding="utf-8").splitlines()
               if line.startswith("| `SamplingParams("))
    call = re.match(r"\| `(SamplingParams\(.*?\))` \|", row).group(1)
    p = eval(call, {"SamplingParams": SamplingParams})  # noqa: S307 - our own docs
    assert p.top_k == 0 and p.max_new_tokens == p.max_tokens == 128  # vLLM's values accepted
    assert "refused" not in row and "max_tokens" in row.split("|")[2]
    # The command line takes vLLM's name too.
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--max-tokens", "9"])
    assert cli.resolve_run_config(args).sampling.max_new_tokens == 9
