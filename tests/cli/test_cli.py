"""Tests of the command line (jaxsample/cli.py), in-process through `main(argv)`."""

import io
import json
import os

import pytest
from helpers import main_captured as _main_captured

from jaxsample import cli, cost
from jaxsample.cli.config import DEFAULT_SAMPLING

QUESTION = "What is 3 + 4? Answer with a number."
from paths import TINY_GGUF

# In-process runs never change this process's JAX config (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_calls")


def _one_line_error(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and "error:" in err
    return err


# ---------------------------------------------------------------------------
# Errors that need no model


@pytest.mark.parametrize("argv,needle", [
    (["run", "--prompt", "x", "--n", "0"], "--n"),
    (["run", "--prompt", "x", "--top-p", "1.5"], "top_p"),
    (["run", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["run", "--prompt", "x", "--min-p", "2"], "min_p"),
    (["run", "--prompt", "x", "--seed", "-3"], "seed"),
    (["run", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
    (["run", "--prompt", "x", "--n", "abc"], "--n"),
    (["run", "--prompt", "x", "--reduce", "mean"], "--reduce"),
    (["run", "--prompt", "   \n"], "prompt is empty"),
    (["run", "--prompt-file", "/no/such/prompt.txt"], "no such file"),
    (["run", "--prompt", "x", "--config", "/no/such/config.yaml"], "config file not found"),
    (["run", "--prompt", "x", "--config", "no_such_named_config"], "config file not found"),
    (["run", "--prompt", "x", "--prompt-file", "f"], "not allowed"),
    (["run"], "required"),
    ([], "required"),
    (["frobnicate"], "invalid choice"),
    (["price", "--n", "0,4"], ">= 1"),
    (["price", "--n", "1,x"], "comma-separated"),
    (["price", "--prompt-tokens", "-5"], ">= 0"),
    (["price", "--model", "tiny", "--prompt-tokens", str(10**32)], "prompt_tokens"),
    (["price", "--model", "tiny", "--new-tokens", str(2**40)], "new_tokens"),
    (["price", "--model", "tiny", "--n", f"1,{10**20}"], "n must be"),
    (["run", "--prompt", "x", "--top-k", str(2**31)], "top_k"),
    (["run", "--prompt", "x", "--max-new-tokens", str(2**40)], "max_new_tokens"),
    (["price", "--model", "no-such-model-xyz"], "no-such-model-xyz"),
    (["price", "--model", "tiny", "--plot", "/no/such/dir/p.png"], "does not exist"),
    # List and number flags: empty items, non-integers, values out of range, empty names.
    (["price", "--model", "tiny", "--n", "1,,4"], "item 2 of '1,,4' is empty"),
    (["price", "--model", "tiny", "--n", "1,"], "is empty"),
    (["price", "--model", "tiny", "--n", ",4"], "item 1"),
    (["price", "--model", "tiny", "--n", ""], "is empty"),
    (["price", "--model", "tiny", "--n", "1,1.5"], "'1.5', not an integer"),
    (["price", "--model", "tiny", "--n", "4,-2"], ">= 1"),
    (["price", "--model", "tiny", "--n", "1e3"], "not an integer"),
    (["price", "--model", "tiny", "--prompt-tokens", "-1"], "--prompt-tokens: expected an integer >= 0"),
    (["price", "--model", "tiny", "--new-tokens", "-1"], "--new-tokens: expected an integer >= 0"),
    (["price", "--model", "tiny", "--new-tokens", "1e3"], "--new-tokens: expected an integer"),
    (["price", "--model", ""], "--model: expected a non-empty value"),
    (["price", "--model", "tiny", "--plot", ""], "--plot: expected a non-empty value"),
    (["run", "--prompt", "x", "--n", "1e3"], "--n: expected an integer"),
    (["run", "--prompt", "x", "--max-new-tokens", "1.5"], "--max-new-tokens: expected an integer"),
    (["run", "--prompt", "x", "--stop", ""], "--stop"),
    (["run", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["run", "--prompt", "x", "--config", ""], "--config: expected a non-empty value"),
    (["run", "--prompt", "x", "--model", ""], "--model: expected a non-empty value"),
    (["run", "--prompt-file", ""], "--prompt-file: expected a non-empty value"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    err = _one_line_error(capsys, argv)
    assert needle in err


def test_overflow_error_is_one_line_and_exit_2(capsys, monkeypatch):
    def boom(args):
        raise OverflowError("Python int too large to convert to C long")
    monkeypatch.setattr(cli.app, "price_command", boom)
    err = _one_line_error(capsys, ["price"])
    assert "too large" in err


def test_bad_config_file(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling: {top_p: 7}\n")
    err = _one_line_error(capsys, ["run", "--prompt", "x", "--config", str(bad)])
    assert str(bad) in err and "top_p" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("reducer: [unclosed\n")
    err = _one_line_error(capsys, ["run", "--prompt", "x", "--config", str(broken)])
    assert "invalid YAML" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "empty" in _one_line_error(capsys, ["run", "--prompt-file", str(empty)])


def test_price_n_drops_repeats_and_keeps_order(capsys):
    assert cli.main(["price", "--model", "tiny", "--n", "4,1,4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["n"] for r in out["rows"]] == [4, 1]


# ---------------------------------------------------------------------------
# --prompt-file: any readable file, pipes and stdin


def _prompt_of(argv):
    return cli.requests._read_prompt(cli.build_parser().parse_args(argv))


needs_dev_fd = pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="needs /dev/fd (Linux)")


@needs_dev_fd
def test_prompt_file_reads_pipes_and_stdin(tmp_path, monkeypatch):
    r, w = os.pipe()  # what `<(echo hi)` hands over: /dev/fd/N, a pipe, not a regular file
    os.write(w, "what is 3 + 4? é\n".encode())
    os.close(w)
    try:
        assert _prompt_of(["run", "--prompt-file", f"/dev/fd/{r}"]) == "what is 3 + 4? é\n"
    finally:
        os.close(r)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    import threading

    writer = threading.Thread(target=lambda: fifo.write_text("from a fifo"))
    writer.start()
    assert _prompt_of(["run", "--prompt-file", str(fifo)]) == "from a fifo"
    writer.join()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("über stdin".encode())))
    assert _prompt_of(["run", "--prompt-file", "-"]) == "über stdin"
    monkeypatch.setattr("sys.stdin", io.StringIO("text stdin"))
    assert _prompt_of(["run", "--prompt-file", "-"]) == "text stdin"


@needs_dev_fd
def test_prompt_file_errors_say_what_is_wrong(capsys, tmp_path, monkeypatch):
    err = _one_line_error(capsys, ["run", "--prompt-file", str(tmp_path)])
    assert "is a directory" in err and "no such file" not in err
    err = _one_line_error(capsys, ["run", "--prompt-file", "/dev/null"])
    assert "prompt is empty (/dev/null)" in err
    r, w = os.pipe()
    os.write(w, b"  \n\t")
    os.close(w)
    try:
        assert "prompt is empty" in _one_line_error(capsys, ["run", "--prompt-file", f"/dev/fd/{r}"])
    finally:
        os.close(r)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert "prompt is empty (stdin)" in _one_line_error(capsys, ["run", "--prompt-file", "-"])
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    assert "not UTF-8" in _one_line_error(capsys, ["run", "--prompt-file", str(latin)])
    monkeypatch.setattr(cli.requests, "PROMPT_FILE_LIMIT", 8)
    big = tmp_path / "big.txt"
    big.write_text("x" * 9)
    assert "larger than" in _one_line_error(capsys, ["run", "--prompt-file", str(big)])
    if os.geteuid() != 0:  # root reads anything
        secret = tmp_path / "secret.txt"
        secret.write_text("x")
        secret.chmod(0)
        assert "permission denied" in _one_line_error(capsys, ["run", "--prompt-file", str(secret)])


# ---------------------------------------------------------------------------
# Broken checkpoints: one line, exit 2, naming the file and the key


@pytest.fixture(scope="module")
def broken_gguf(tmp_path_factory):
    import gguf
    from checkpoint_files import rewrite_gguf

    d = tmp_path_factory.mktemp("broken")
    return {
        "heads": rewrite_gguf(TINY_GGUF, d / "heads0.gguf", set_kv={
            "llama.attention.head_count": (0, gguf.GGUFValueType.UINT32)}),
        "theta": rewrite_gguf(TINY_GGUF, d / "theta.gguf", set_kv={
            "llama.rope.freq_base": (float("nan"), gguf.GGUFValueType.FLOAT32)}),
        "eps": rewrite_gguf(TINY_GGUF, d / "eps.gguf", set_kv={
            "llama.attention.layer_norm_rms_epsilon": (-1.0, gguf.GGUFValueType.FLOAT32)}),
    }


@pytest.mark.parametrize("which,key", [("heads", "llama.attention.head_count"),
                                       ("theta", "llama.rope.freq_base"),
                                       ("eps", "llama.attention.layer_norm_rms_epsilon")])
@pytest.mark.parametrize("command", ["price", "run"])
def test_broken_gguf_is_one_line_and_exit_2(capsys, broken_gguf, which, key, command):
    path = str(broken_gguf[which])
    argv = (["price", "--model", path] if command == "price"
            else ["run", "--prompt", "x", "--model", path, "--n", "2", "--max-new-tokens", "4"])
    err = _one_line_error(capsys, argv)
    assert path in err and key in err
    assert "price also knows the presets" not in err  # the file exists: presets are no answer


@pytest.mark.parametrize("error", [
    "ZeroDivisionError", "TypeError", "KeyError", "AttributeError", "IndexError"])
def test_any_loader_failure_is_one_line_and_exit_2(capsys, broken_gguf, monkeypatch, error):
    """Whatever a loader raises on a bad file reaches the user as one line, exit 2."""
    import builtins

    from jaxsample.models.checkpoints import gguf_loader

    def boom(*args, **kwargs):
        raise getattr(builtins, error)("deep inside the loader")

    monkeypatch.setattr(gguf_loader, "config_from_metadata", boom)
    path = str(broken_gguf["heads"])
    for argv in (["price", "--model", path], ["run", "--prompt", "x", "--model", path]):
        err = _one_line_error(capsys, argv)
        assert path in err and error in err


def test_numerical_error_is_one_line_and_exit_2(capsys, monkeypatch):
    from jaxsample.errors import NumericalError

    def nan(args):
        raise NumericalError("the model gave no valid distribution (every logit NaN or -inf)")
    monkeypatch.setattr(cli.app, "price_command", nan)
    assert "no valid distribution" in _one_line_error(capsys, ["price"])


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert cli.main(["price", "--help"]) == 0
    assert "--prompt-tokens" in capsys.readouterr().out


def test_flags_override_config():
    args = cli.build_parser().parse_args(
        ["run", "--prompt", "x", "--config", "best_of_n", "--n", "3", "--no-chat",
         "--extract", "boxed", "--dtype", "bfloat16", "--stop", "\n\n"])
    cfg = cli.resolve_run_config(args)
    assert cfg.sampling.n == 3  # flag
    assert cfg.sampling.temperature == 0.7  # from configs/best_of_n.yaml
    assert cfg.sampling.stop == ("\n\n",)
    assert cfg.reducer.kind == "best" and cfg.reducer.extract == "boxed"
    assert cfg.chat is False and cfg.model.dtype == "bfloat16"
    # No config: the documented defaults (embedded model, chat on, vote on numbers).
    cfg = cli.resolve_run_config(cli.build_parser().parse_args(["run", "--prompt", "x"]))
    assert cfg.model.name is None and cfg.chat is True
    assert cfg.reducer.kind == "vote" and cfg.reducer.extract == "number"
    assert {k: getattr(cfg.sampling, k) for k in DEFAULT_SAMPLING} == DEFAULT_SAMPLING


# ---------------------------------------------------------------------------
# price


def test_price_table(capsys):
    assert cli.main(["price", "--model", "smollm2-135m", "--prompt-tokens", "4096",
                     "--new-tokens", "256", "--n", "1,4,16,64"]) == 0
    out = capsys.readouterr().out
    assert "134.5M parameters" in out
    rows = [line.split() for line in out.splitlines()
            if line.split() and line.split()[0] in ("1", "4", "16", "64")]
    assert [r[0] for r in rows] == ["1", "4", "16", "64"]
    # N = 16: prefill once (1.45 TFLOP) vs 16 times; KV saving (16 * 4352) / (4096 + 16 * 256).
    assert rows[2][1] == "1.45T" and rows[2][2] == "23.20T" and rows[2][-1] == "8.5x"
    assert rows[0][1] == rows[0][2] and rows[0][-1] == "1.0x"
    assert "decode FLOPs are the same" in " ".join(out.split())


def test_price_json_matches_cost_model(capsys):
    assert cli.main(["price", "--model", "smollm2-135m", "--prompt-tokens", "4096",
                     "--new-tokens", "256", "--n", "1,16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_params"] == 134_515_008 and out["kv_bytes_per_token"] == 46080
    assert [r["n"] for r in out["rows"]] == [1, 16]
    cfg, _ = cli.resolve_model_config("smollm2-135m")
    want = cost.table(cfg, 4096, 256, [1, 16])
    assert out["rows"] == json.loads(json.dumps(want))
    r1, r16 = out["rows"]
    assert r1["kv_bytes_shared"] == r1["kv_bytes_separate"]
    assert r16["kv_bytes_shared"] < r16["kv_bytes_separate"]
    assert r16["decode_flops"] == 16 * r1["decode_flops"]
    assert out["estimates"][1]["decode_flops_shared"] == out["estimates"][1]["decode_flops_separate"]


def test_price_bfloat16_and_plot(capsys, tmp_path):
    png = tmp_path / "price.png"
    assert cli.main(["price", "--model", "tiny", "--prompt-tokens", "64", "--new-tokens", "16",
                     "--n", "1,2,8", "--dtype", "bfloat16", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype_bytes"] == 2 and out["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------
# run (the embedded model and the engine)

RUN = ["run", "--prompt", QUESTION, "--n", "4", "--max-new-tokens", "8", "--seed", "0"]




@pytest.fixture(scope="module")
def run_json():
    pytest.importorskip("jaxsample.engine")
    code, out, err = _main_captured(RUN + ["--json"])
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_run_json(run_json):
    d = run_json
    assert set(d) == {"model", "dtype", "weights", "prompt", "params", "branches", "result",
                      "bill", "timings"}
    assert d["dtype"] == "float32" and d["weights"] is None
    assert d["prompt"] == QUESTION and d["params"]["n"] == 4 and d["params"]["seed"] == 0
    assert len(d["branches"]) == 4
    for b in d["branches"]:
        assert set(b) == {"text", "answer", "tokens", "mean_logprob", "finish_reason"}
        assert 1 <= b["tokens"] <= 8 and b["finish_reason"] in ("stop", "length")
        assert isinstance(b["text"], str)
    assert {"answer", "share", "branch"} <= set(d["result"])
    bill = d["bill"]
    assert bill["decoded_tokens_total"] == sum(b["tokens"] for b in d["branches"])
    assert bill["kv_bytes_held"] < bill["kv_bytes_if_separate"]
    assert bill["prompt_tokens_if_separate"] == 4 * bill["prompt_tokens_prefilled"]
    assert bill["decode_flops_shared"] == bill["decode_flops_if_separate"]
    assert set(d["timings"]) == {"load", "compile", "prefill", "decode", "total"}
    assert all(v >= 0 for v in d["timings"].values())


@pytest.mark.slow
def test_run_is_deterministic_and_table(run_json):
    # Same shapes: no recompilation; same seed: same branches.
    code, out, _ = _main_captured(RUN + ["--json"])
    assert code == 0
    again = json.loads(out)
    assert [b["text"] for b in again["branches"]] == [b["text"] for b in run_json["branches"]]
    code, out, err = _main_captured(RUN)
    assert code == 0, err
    assert "branches" in out and "vote" in out and "bill" in out
    assert "never saves per-branch decode" in " ".join(out.split())
    assert "compile (first call)" in out


@pytest.mark.slow
def test_run_best_and_none(run_json):
    code, out, err = _main_captured(RUN + ["--reduce", "best", "--json"])
    assert code == 0, err
    d = json.loads(out)
    best = max(range(4), key=lambda i: (d["branches"][i]["mean_logprob"], -i))
    assert d["result"]["branch"] == best and d["result"]["share"] is None
    code, out, err = _main_captured(["run", "--prompt", QUESTION, "--config", "sample",
                                     "--n", "4", "--max-new-tokens", "8", "--json"])
    assert code == 0, err
    d = json.loads(out)
    assert d["params"]["reducer"]["kind"] == "none" and d["result"]["branch"] is None


@pytest.mark.slow
def test_run_prompt_too_long(capsys, run_json):
    err = _one_line_error(capsys, ["run", "--prompt", "word " * 9000, "--n", "2",
                                   "--max-new-tokens", "8"])
    assert "context" in err


@pytest.mark.slow
def test_run_unknown_model(capsys):
    pytest.importorskip("jaxsample.engine")
    err = _one_line_error(capsys, ["run", "--prompt", "x", "--model", "no-such-model-xyz"])
    assert "no-such-model-xyz" in err and "known names" in err


@pytest.mark.slow
@pytest.mark.multidevice
def test_run_on_a_branch_mesh(tmp_path, run_json):
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest sets 8 CPU devices)")
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text("mesh: {data: 1, branch: 2}\n")
    code, out, err = _main_captured(RUN + ["--config", str(mesh), "--json"])
    assert code == 0, err
    d = json.loads(out)
    # Sharded == unsharded token for token is checked in tests/engine/test_generate.py with the
    # float-tie oracle (tests/ties.py); the JSON has no per-token logprobs to do it here.
    assert len(d["branches"]) == 4 and d["bill"]["decoded_tokens_total"] == sum(
        b["tokens"] for b in d["branches"])
    code, _, err = _main_captured(RUN + ["--config", str(mesh), "--n", "3"])
    assert code == 2 and "multiple of mesh.branch" in err


@pytest.mark.slow
def test_run_adaptive_json_and_table(run_json):
    # 16 new tokens: the assertions are about the adaptive record, not the answers (the
    # default 256 made this the suite's slowest test).
    short = RUN[:-4] + ["--max-new-tokens", "16"]
    code, out, err = _main_captured(short + ["--adaptive", "beta", "--max-n", "8", "--window",
                                             "4", "--seed", "0", "--json"])
    assert code == 0, err
    d = json.loads(out)
    r = d["result"]
    assert r["adaptive"] == "beta" and r["n_used"] in (4, 8) and len(d["branches"]) == r["n_used"]
    assert "saving" not in r  # the bill's adaptive part holds it
    saving = d["bill"]["adaptive"]
    assert saving["branches_drawn"] == r["n_used"] and saving["max_n"] == 8
    assert d["bill"]["decoded_tokens_total"] == sum(b["tokens"] for b in d["branches"])
    assert 0.0 <= saving["token_saving"] < 1.0 and d["bill"]["pool"] is None
    code, out, err = _main_captured(short + ["--adaptive", "esc", "--max-n", "8", "--window",
                                             "4"])
    assert code == 0, err
    assert "adaptive (esc)" in out and "at a fixed n=8" in " ".join(out.split())
    for bad, msg in ((["--window", "3", "--max-n", "2"], "window"),
                     (["--reduce", "best"], "--adaptive votes")):
        code, _, err = _main_captured(short + ["--adaptive", "esc"] + bad)
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_best_of_n_prefers_complete_branches():
    """A branch cut at max_new_tokens never beats a complete one, whatever its score."""
    import numpy as np

    from jaxsample import cli
    from jaxsample.cli.config import ReducerConfig
    from jaxsample.generation import Generation

    def gen(reasons):
        N = len(reasons)
        return Generation(
            tokens=np.zeros((1, N, 4), np.int32),
            logprobs=np.array([[[-0.1] * 4, [-2.0] * 4, [-1.0] * 4][:N]], np.float32),
            lengths=np.full((1, N), 4, np.int32), finish_reason=[reasons],
            texts=[["so 3", "answer 5", "answer 7"][:N]], prompt_tokens=[[1]], prompts=[None],
            params=None, bill=None, timings={}, pad_id=0)

    reducer = ReducerConfig(kind="best", extract="number", score="mean_logprob")
    result, _ = cli.batches.reduce_one(gen(["length", "stop", "stop"]), reducer)
    assert result["branch"] == 2 and result["answer"] == "7"  # best complete branch
    result, _ = cli.batches.reduce_one(gen(["length", "length", "length"]), reducer)
    assert result["branch"] == 0  # no complete branch: all are candidates


# ---------------------------------------------------------------------------
# --version, progress on stderr, caches


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxsample 0.1.0 (jax ") and "jaxlib" in out


TINY_RUN = ["run", "--model", TINY_GGUF, "--prompt", "hi", "--n", "3", "--max-new-tokens", "6",
            "--seed", "0"]


@pytest.mark.slow
def test_progress_goes_to_stderr_and_json_stays_clean(compilation_cache_calls):
    code, out, err = _main_captured(TINY_RUN + ["--json"])
    assert code == 0, err
    json.loads(out)  # stdout is exactly one JSON object
    lines = err.splitlines()
    assert lines and all(line.startswith("jaxsample: ") and "error:" not in line
                         for line in lines), err
    assert any(line.startswith("jaxsample: loading ") for line in lines)
    assert any("loaded tiny_llama in" in line for line in lines)
    assert "decoded" in lines[-1]
    assert len(compilation_cache_calls) == 1  # the compile cache is turned on
    code, out, err = _main_captured(TINY_RUN + ["--json", "--quiet", "--no-cache"])
    assert code == 0 and err == "" and json.loads(out)["params"]["n"] == 3
    assert len(compilation_cache_calls) == 1  # --no-cache: not again


# ---------------------------------------------------------------------------
# --prompt-file requests.jsonl


@pytest.mark.slow
def test_jsonl_batch(tmp_path):
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text("\n".join([
        json.dumps({"prompt": "What is 2 + 2?", "id": "a"}),
        json.dumps({"prompt": "What is 3 + 3?"}),
        "",  # blank lines are skipped
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Hi"}],
                    "n": 2, "max_tokens": 5, "temperature": 0.5, "id": 7}),
    ]) + "\n")
    argv = ["run", "--model", TINY_GGUF, "--prompt-file", str(reqs), "--n", "3",
            "--max-new-tokens", "6", "--seed", "0"]
    code, out, err = _main_captured(argv + ["--json"])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["index"] for d in lines] == [0, 1, 2] and [d["id"] for d in lines] == ["a", None, 7]
    a, b, c = lines
    assert a["prompt"] == "What is 2 + 2?" and "messages" not in a
    assert c["prompt"] is None and c["messages"][1] == {"role": "user", "content": "Hi"}
    assert len(a["branches"]) == 3 and len(c["branches"]) == 2
    assert c["params"]["max_new_tokens"] == 5 and c["params"]["temperature"] == 0.5
    assert all(br["tokens"] <= 5 for br in c["branches"])
    # Equal settings share one call (one prefill of both prompts); the third has its own.
    assert a["batch"] == b["batch"] == {"index": 0, "requests": [0, 1]}
    assert c["batch"] == {"index": 1, "requests": [2]}
    assert a["bill"]["num_prompts"] == 2 and c["bill"]["num_prompts"] == 1
    for d in lines:
        assert d["usage"]["decoded_tokens"] == sum(br["tokens"] for br in d["branches"])
    # The same request alone, at the same index, draws the same branches (keys follow
    # the request's index, not its batch).
    alone = tmp_path / "alone.jsonl"
    alone.write_text(reqs.read_text().splitlines()[0] + "\n")
    code, out, err = _main_captured(["run", "--model", TINY_GGUF, "--prompt-file", str(alone),
                                     "--n", "3", "--max-new-tokens", "6", "--seed", "0",
                                     "--json"])
    assert code == 0, err
    assert [br["text"] for br in json.loads(out)["branches"]] == [br["text"] for br in
                                                                  a["branches"]]
    # Text mode: one table per request, the bill once per call.
    code, out, err = _main_captured(argv)
    assert code == 0, err
    assert "request 0 (a)" in out and "request 1:" in out and "request 2 (7)" in out
    assert out.count("bill (requests 0-1, one call)") == 1 and "bill (request 2)" in out


@pytest.mark.parametrize("line,needle", [
    ("not json", "line 1: not JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"prompt": "x", "messages": []}', "exactly one of"),
    ('{"id": 3}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": 5}', "non-empty string"),
    ('{"messages": [{"role": "user"}]}', "\"messages\" must be"),
    ('{"messages": "hi"}', "\"messages\" must be"),
    ('{"prompt": "x", "temprature": 0.5}', "unknown key 'temprature'"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "n": 0}', "SamplingParams.n"),
    ('{"prompt": "x", "max_tokens": 3, "max_new_tokens": 4}', "repeats"),
    ('{"prompt": "x", "id": [1]}', "\"id\" must be"),
    ("", "no requests"),
])
def test_jsonl_errors_name_the_line(capsys, tmp_path, line, needle):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n" if line else "\n\n")
    err = _one_line_error(capsys, ["run", "--prompt-file", str(f)])
    assert needle.replace("line 1", "line 2") in err
    if line:
        assert f"{f} line 2" in err


def test_prompt_format_forces_the_reading(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text('{"prompt": "x"}\n')
    args = cli.build_parser().parse_args(["run", "--prompt-file", str(f)])
    cfg = cli.resolve_run_config(args)
    assert cli.read_requests(args, cfg)[0].prompt == '{"prompt": "x"}\n'  # text: as is
    args = cli.build_parser().parse_args(["run", "--prompt-file", str(f), "--prompt-format",
                                          "jsonl"])
    assert cli.read_requests(args, cfg)[0].prompt == "x"


def test_int8_switch_flags_reach_the_model_config(tmp_path):
    """--prefix-kv-dtype and --cpu-kernels set `ModelConfig`'s fields over a config
    file's; other values are refused by the parser, naming the choices."""
    f = tmp_path / "c.yaml"
    f.write_text("model: {weights: int8, prefix_kv_dtype: model}\n")
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--config", str(f),
                                          "--cpu-kernels", "off"])
    m = cli.resolve_run_config(args).model
    assert (m.weights, m.prefix_kv_dtype, m.cpu_kernels) == ("int8", "model", "off")
    args = cli.build_parser().parse_args(["run", "--prompt", "x", "--prefix-kv-dtype", "model"])
    m = cli.resolve_run_config(args).model
    assert (m.weights, m.prefix_kv_dtype, m.cpu_kernels) == (None, "model", "auto")
    code, out, err = _main_captured(["run", "--prompt", "x", "--cpu-kernels", "avx2"])
    assert code == 2 and "--cpu-kernels" in err and "'auto', 'off'" in err


# ---------------------------------------------------------------------------
# Checks made from the model's metadata, before its weights load


def _no_load(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(cli.app, "_load_model", boom)
    from jaxsample import loading
    monkeypatch.setattr(loading, "load", boom)


def test_context_is_checked_before_loading(capsys, monkeypatch, tmp_path):
    _no_load(monkeypatch)
    err = _one_line_error(capsys, ["run", "--model", TINY_GGUF, "--prompt", "x",
                                   "--max-new-tokens", "100000"])
    assert "context of 512 tokens" in err and "--max-new-tokens" in err
    err = _one_line_error(capsys, ["run", "--prompt", "x", "--max-new-tokens", "100000"])
    assert "context of 8192 tokens" in err  # the embedded model, from its metadata
    err = _one_line_error(capsys, ["run", "--model", TINY_GGUF, "--prompt", "word " * 400,
                                   "--max-new-tokens", "8"])
    assert "the prompt has" in err and "context of 512" in err
    f = tmp_path / "r.jsonl"
    f.write_text('{"prompt": "x"}\n{"prompt": "y", "max_tokens": 600}\n')
    err = _one_line_error(capsys, ["run", "--model", TINY_GGUF, "--prompt-file", str(f)])
    assert f"{f} line 2" in err and "max_new_tokens=600" in err
    err = _one_line_error(capsys, ["run", "--model", TINY_GGUF, "--prompt", "x", "--adaptive",
                                   "esc", "--window", "9", "--max-n", "4"])
    assert "window" in err


# ---------------------------------------------------------------------------
# The branch table at 80 columns


def test_branch_table_fits_80_columns():
    from rich.console import Console

    branches = [{"text": "The answer is " + "very long text " * 20, "answer": "12345678901234567",
                 "tokens": 128, "mean_logprob": -0.123456, "finish_reason": "length"},
                {"text": "\n\n  7\x05 done", "answer": None, "tokens": 3, "mean_logprob": None,
                 "finish_reason": "stop"}]
    title = "smollm2-135m-instruct: 2 branches (temperature 0.8, top-p 0.95, top-k 0, " \
            "min-p 0.0, seed 0)"
    for width in (80, 60, 44, 120):
        buf = io.StringIO()
        Console(file=buf, width=width, highlight=False).print(
            cli.branch_table(title, branches, 0, width))
        lines = buf.getvalue().splitlines()
        assert max(len(line) for line in lines) <= width, width
        table = "\n".join(lines)
        assert "The answer is" in table and "…" in table and "7  done" in table
        assert ("finish" in table) == (width >= 60) and ("logprob" in table) == (width >= 48)
        assert ("mean logprob" in table) == (width >= 72)


def test_run_output_fits_columns_80(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = _main_captured(TINY_RUN + ["--stop", "e"])
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "first line" in out and "bill" in out


# ---------------------------------------------------------------------------
# price --plot: the path it reports is the file it writes


@pytest.mark.slow
def test_plot_writes_exactly_the_path_it_reports(capsys, tmp_path):
    base = ["price", "--model", "tiny", "--n", "1,4", "--json", "--plot"]
    for given, written in (("noext", "noext.png"), ("fig.svg", "fig.svg"),
                           ("fig.PDF", "fig.PDF"), ("x.y.png", "x.y.png")):
        assert cli.main(base + [str(tmp_path / given)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["plot"] == str(tmp_path / written) and (tmp_path / written).is_file()
    assert not (tmp_path / "noext").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["noext.png", "fig.svg", "fig.PDF", "x.y.png"])
    assert "is a directory" in _one_line_error(capsys, base + [str(tmp_path)])
    assert "is a directory" in _one_line_error(capsys, base + [str(tmp_path / "sub") + "/"])
    assert "cannot write '.frob'" in _one_line_error(capsys, base + [str(tmp_path / "a.frob")])
    # The path on one line, however long (a wrapped path cannot be copied back).
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    assert cli.main(["price", "--model", "tiny", "--n", "4", "--plot",
                     str(deep / "t")]) == 0
    assert f"plot written to {deep / 't.png'}\n" in capsys.readouterr().out


def test_plot_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    err = _one_line_error(capsys, ["price", "--model", "tiny", "--plot", str(tmp_path / "p")])
    assert "needs matplotlib" in err and "pip install 'jaxsample[plot]'" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.subprocess
def test_python_dash_m_jaxsample_cli_runs_the_command_line():
    """`python -m jaxsample.cli` is the command line too (it printed nothing and exited 0)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "jaxsample.cli", "run", "--prompt", "x",
                        "--shared-prefix", " "], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--shared-prefix: the shared prefix is empty" in r.stderr


def test_adaptive_result_support_is_the_winners_votes():
    """Regression: `--adaptive` reported support = the number of answering
    branches ("support 32 of 32" next to share 0.41), not the winner's votes."""
    import types

    import numpy as np

    from jaxsample.reduce import adaptive_rules as stopping

    answers = ["7", "5", "7", None, "7", "5", "3", "7"]
    counted = [a is not None for a in answers]
    winner, support, share = stopping.tally(answers)
    bill = types.SimpleNamespace(to_dict=lambda: {})
    res = types.SimpleNamespace(winner=[winner], share=np.array([share], np.float32),
                                support=np.array([support], np.float32), answers=[answers],
                                counted=[counted], n_used=np.array([8]),
                                terminated=np.array([0]), bill=bill)
    result, got = cli.batches.adaptive_result(res, 0, types.SimpleNamespace(adaptive="esc"))
    assert result["answer"] == "7" and result["support"] == 4.0 and result["branch"] == 0
    assert result["share"] == pytest.approx(4 / 7) and got == answers


# ---------------------------------------------------------------------------
# One name table for every command (models/checkpoints/registry.py)


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2", "smollm2-135m-instruct"])
def test_every_command_takes_the_same_names(capsys, monkeypatch, name):
    """A short name is an alias in `run` as in `price`: the same model, the same
    record name; `run` resolves it before any weight is read (refused here by the
    model's own context, from its metadata)."""
    from jaxsample import loading

    def boom(*a, **k):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(cli.app, "_load_model", boom)
    assert loading.model_name(name) == "smollm2-135m-instruct"
    err = _one_line_error(capsys, ["run", "--model", name, "--prompt", "hi",
                                   "--max-new-tokens", "100000"])
    assert "exceeds the model's context of 8192 tokens" in err, err
    assert cli.main(["price", "--model", name, "--json", "--n", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "smollm2-135m-instruct" and out["config"]["dim"] == 576


def test_a_name_price_alone_knows_is_refused_by_run_naming_the_table(capsys):
    err = _one_line_error(capsys, ["run", "--model", "llama-3.1-8b", "--prompt", "hi"])
    assert "'llama-3.1-8b': a published shape for `jaxsample price`" in err, err
    assert "smollm2-135m-instruct (or smollm2, smollm2-135m)" in err, err
    assert cli.main(["price", "--model", "llama-3.1-8b", "--json", "--n", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["dim"] == 4096
    err = _one_line_error(capsys, ["run", "--model", "no-such-name", "--prompt", "hi"])
    assert "not a known model name; known names: gemma3-270m (or gemma3), smollm2-135m" in err
