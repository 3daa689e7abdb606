"""Tests of the YAML run configurations (jaxsample/config.py, configs/)."""

import json

import pytest
from paths import ROOT

from jaxsample import SamplingParams
from jaxsample.cli import config
from jaxsample.errors import ConfigError

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


NAMED = ("vote", "best_of_n", "sample", "gpu_1b")  # the names the README's commands use


def test_configs_dir_has_the_named_files(monkeypatch, tmp_path):
    """Each named config is a file in configs/, and a bare name (with or without
    `.yaml`), from any working directory, resolves to that file and loads as it does."""
    assert set(NAMED) <= {p.stem for p in CONFIGS}
    monkeypatch.chdir(tmp_path)  # no configs/ here: the names must come from the repository's
    for name in NAMED:
        path = config.CONFIG_DIR / f"{name}.yaml"
        assert path in CONFIGS
        assert config.resolve_path(name) == path == config.resolve_path(f"{name}.yaml")
        assert config.load_config(name) == config.load_config(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = config.load_config(path)
    assert isinstance(cfg, config.RunConfig)
    assert isinstance(cfg.sampling, SamplingParams)
    assert cfg.sampling.n % cfg.mesh.branch == 0
    # to_dict round-trips through JSON and from_dict.
    d = cfg.to_dict()
    assert config.from_dict(json.loads(json.dumps(d))) == cfg


def test_named_configs():
    vote = config.load_config("vote")
    assert vote.reducer.kind == "vote" and vote.sampling.n == 16
    best = config.load_config("best_of_n.yaml")
    assert best.reducer.kind == "best" and best.reducer.score == "mean_logprob"
    assert config.load_config("sample").reducer.kind == "none"
    gpu = config.load_config("gpu_1b")
    assert gpu.model.dtype == "bfloat16" and gpu.mesh.branch > 1 and gpu.sampling.n >= 32


def test_the_model_switches(tmp_path):
    """model.prefix_kv_dtype and model.cpu_kernels: "auto" by default, read from a file,
    round-tripped by to_dict."""
    assert (config.RunConfig().model.prefix_kv_dtype, config.RunConfig().model.cpu_kernels) == (
        "auto", "auto")
    f = tmp_path / "switches.yaml"
    f.write_text("model: {weights: int8, prefix_kv_dtype: model, cpu_kernels: 'off'}\n")
    cfg = config.load_config(f)
    assert (cfg.model.weights, cfg.model.prefix_kv_dtype, cfg.model.cpu_kernels) == (
        "int8", "model", "off")
    assert config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_defaults_and_partial_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    cfg = config.load_config(empty)
    assert cfg == config.RunConfig()
    assert cfg.sampling == SamplingParams(**config.DEFAULT_SAMPLING)
    assert cfg.chat is True and cfg.reducer.kind == "vote" and cfg.mesh.devices == 1
    part = tmp_path / "part.yaml"
    part.write_text('sampling: {n: 3, stop: ["\\n\\n"]}\nchat: false\n')
    cfg = config.load_config(part)
    assert cfg.sampling.n == 3 and cfg.sampling.stop == ("\n\n",)
    assert cfg.sampling.temperature == config.DEFAULT_SAMPLING["temperature"]
    assert cfg.chat is False


@pytest.mark.parametrize("text,needles", [
    ("modle: {}", ["unknown key 'modle'", "model, sampling"]),
    ("model: {nmae: x}", ["model.nmae", "name, dtype"]),
    ("model: {dtype: float16}", ["model.dtype", "float32, bfloat16", "float16"]),
    ("model: {prefix_kv_dtype: float16}", ["model.prefix_kv_dtype", "auto, model", "float16"]),
    ("model: {cpu_kernels: avx2}", ["model.cpu_kernels", "auto, off", "avx2"]),
    ("model: {cpu_kernels: off}", ["model.cpu_kernels", "auto, off", "False", "write 'off'"]),
    ("sampling: {temprature: 1}", ["sampling.temprature", "temperature"]),
    ("sampling: {num_return_sequences: 4}", ["sampling.num_return_sequences", "use n"]),
    ("sampling: {do_sample: false}", ["sampling.do_sample", "temperature=0"]),
    ("sampling: {top_p: 1.5}", ["top_p", "(0, 1]", "1.5"]),
    ("sampling: {n: 0}", ["n must be", "[1, 2**31 - 1]", "got 0"]),
    ("sampling: {n: sixteen}", ["SamplingParams.n", "sixteen"]),
    ("sampling: {temperature: -1}", ["temperature", ">= 0"]),
    ("reducer: {kind: mean}", ["reducer.kind", "vote, best, none", "mean"]),
    ("reducer: {extract: words}", ["reducer.extract", "number, boxed"]),
    ("reducer: {weights: uniform}", ["reducer.weights", "null, mean_logprob"]),
    ("reducer: {score: max}", ["reducer.score", "sum_logprob"]),
    ("mesh: {branch: 0}", ["mesh.branch", ">= 1"]),
    ("mesh: {data: true}", ["mesh.data"]),
    ("mesh: {devices: 8}", ["mesh.devices", "data, branch"]),
    ("chat: maybe", ["chat", "true or false"]),
    ("sampling: 16", ["sampling must be a mapping"]),
    ("- a\n- b", ["top level must be a mapping"]),
    ("model: {name: [unclosed", ["invalid YAML", "line"]),
    # A repeated key, at any depth, is an error naming the key and both lines (PyYAML keeps
    # the last value silently).
    ("chat: true\nmodel: {}\nchat: false\n", ["duplicate key 'chat'", "line 3", "line 1"]),
    ("sampling:\n  n: 3\n  temperature: 0.5\n  n: 4\n",
     ["duplicate key 'sampling.n'", "line 4", "first defined at line 2"]),
    ("sampling: {n: 1, n: 2}", ["duplicate key 'sampling.n'", "line 1, column 18",
                                "column 12"]),
    ("reducer:\n  kind: vote\n  extract: number\n  kind: best\n",
     ["duplicate key 'reducer.kind'", "line 4"]),
    ("sampling:\n  stop: [{a: 1, a: 2}]\n", ["duplicate key 'sampling.stop[0].a'", "line 2"]),
    ("mesh: {data: 1, 0x1: 2, 1: 3}", ["duplicate key 'mesh.1'"]),  # equal once constructed
])
def test_bad_files_name_the_file_and_key(tmp_path, text, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config.load_config(path)
    msg = str(info.value)
    assert str(path) in msg
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(ConfigError, match="not found.*named configs: .*vote"):
        config.load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not found"):
        config.load_config("no_such_config_name")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ConfigError, match="bin.yaml"):
        config.load_config(binary)
    with pytest.raises(ConfigError, match="cannot read"):
        config.load_config(tmp_path)  # a directory


def test_dataclasses_are_frozen_and_validate():
    cfg = config.RunConfig()
    with pytest.raises(Exception):
        cfg.chat = False  # type: ignore[misc]
    with pytest.raises(ConfigError):
        config.ReducerConfig(kind="vote", extract="auto", weights="x")
    assert config.MeshConfig(data=2, branch=4).devices == 8
    assert cfg.replace(chat=False).chat is False


def test_yaml_merge_keys_may_be_overridden():
    """`<<: *base` then a key of base is an override, which is what merges are for."""
    import yaml

    text = "base: &b {n: 2, seed: 1}\nsampling:\n  <<: *b\n  n: 5\n"
    assert yaml.load(text, Loader=config.StrictSafeLoader) == {
        "base": {"n": 2, "seed": 1}, "sampling": {"n": 5, "seed": 1}}
    with pytest.raises(config.DuplicateKeyError) as info:
        yaml.load("a: 1\nb: {c: 1}\na: 2\n", Loader=config.StrictSafeLoader)
    assert (info.value.key, info.value.line, info.value.first_line) == ("a", 3, 1)


# ---------------------------------------------------------------------------
# Nested aliases ("billion laughs") and bounded error messages


def _laughs(levels: int, wrap: str = "model") -> str:
    """A tiny config whose `wrap` value is a list of anchors, each alias nine times
    the one before: 9**levels strings once expanded."""
    anchors = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        anchors.append(f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return f"{wrap}: [" + ", ".join(anchors) + "]\n"


@pytest.mark.slow
@pytest.mark.subprocess
def test_billion_laughs_is_refused_quickly_with_a_short_message(tmp_path):
    import subprocess
    import sys
    import time

    f = tmp_path / "laughs.yaml"
    f.write_text(_laughs(7))  # 9**7 = 4.8 million strings expanded
    assert f.stat().st_size < 401
    # In a fresh process, so that its peak memory is this load's alone.
    # Peak RSS from VmHWM (this process image's own high-water mark: ru_maxrss would
    # carry the forking pytest process's peak across exec on Linux).
    script = ("import re, sys\nfrom jaxsample.cli import config\n"
              "try:\n    config.load_config(sys.argv[1])\nexcept config.ConfigError as e:\n"
              "    try:\n        status = open('/proc/self/status').read()\n"
              "        hwm = int(re.search(r'VmHWM:\\s+(\\d+) kB', status).group(1))\n"
              "    except (OSError, AttributeError):\n        hwm = 0  # no /proc: not measured\n"
              "    print(len(str(e)), hwm)\n    print(str(e)[:400])\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script, str(f)], capture_output=True,
                         text=True, timeout=120)
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    length, rss_kib = map(int, out.stdout.split("\n")[0].split())
    message = out.stdout.split("\n", 1)[1]
    assert length < 500, message  # e492f07: tens of megabytes
    assert "aliases" in message and str(f) in message and "line 1" in message
    assert rss_kib < 400 * 1024  # e492f07: over a gigabyte with 9 levels
    assert seconds < 60  # generous: the refusal itself takes milliseconds


def test_aliases_and_merges_within_the_bound_still_work(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text("sampling: {<<: &base {n: 4, temperature: 0.5}, max_new_tokens: &t 12, "
                 "min_tokens: *t, stop: &s [\"\\n\\n\"]}\n")
    cfg = config.load_config(f)
    assert cfg.sampling.n == 4 and cfg.sampling.min_tokens == 12 == cfg.sampling.max_new_tokens
    assert cfg.sampling.stop == ("\n\n",)
    f.write_text("sampling: &r {n: *r}\n")  # an alias inside its own anchor
    with pytest.raises(ConfigError, match="recursive"):
        config.load_config(f)
    f.write_text("sampling: {n: " + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=str(f)):
        config.load_config(f)


@pytest.mark.parametrize("wrap", ["model", "reducer", "chat", "mesh"])
def test_error_messages_quote_at_most_about_200_characters(wrap):
    big = ["lol"] * 9
    for _ in range(5):  # shared references: 9**6 strings when printed in full
        big = [big] * 9
    with pytest.raises(ConfigError) as e:
        config.from_dict({wrap: big}, source="cfg.yaml")
    assert len(str(e.value)) < 500 and "cfg.yaml" in str(e.value)
    with pytest.raises(ConfigError) as e:
        config.from_dict({"reducer": {"kind": big}})
    assert len(str(e.value)) < 500 and "reducer.kind" in str(e.value)
    with pytest.raises(ConfigError) as e:
        SamplingParams(stop=big)
    assert len(str(e.value)) < 500 and "stop" in str(e.value)


# ---------------------------------------------------------------------------
# logit_bias keys


@pytest.mark.parametrize("key", ["²", "++5", "+5", "-5", " 5", "٣", "5 ", "", "1e3", "0x1"])
def test_logit_bias_string_keys_must_be_ascii_digits(tmp_path, key):
    with pytest.raises(ConfigError) as e:
        SamplingParams(logit_bias={key: 1.0})
    assert "logit_bias" in str(e.value) and repr(key) in str(e.value)
    f = tmp_path / "bias.yaml"
    f.write_text("sampling:\n  logit_bias: " + json.dumps({key: 1.0}) + "\n")
    with pytest.raises(ConfigError) as e:
        config.load_config(f)
    assert "logit_bias" in str(e.value) and str(f) in str(e.value)


def test_logit_bias_digit_keys_are_converted():
    assert SamplingParams(logit_bias={"13": 2.0, "0007": -1.0, 5: 0.5}).logit_bias == (
        (5, 0.5), (7, -1.0), (13, 2.0))
    with pytest.raises(ConfigError, match="bad id"):
        SamplingParams(logit_bias={"9" * 5000: 1.0})  # past int()'s 4300-digit limit
