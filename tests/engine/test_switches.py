"""A model's two switches, `LanguageModel.prefix_kv_dtype` and `LanguageModel.cpu_kernels`:
validated where they are set (the model, `load`, `LLM`, the engine), carried to the
traced code (the int8 weights' static `QuantizedWeight.kernels`, the prefill's static
argument), programs keyed apart on them, and `JAXSAMPLE_CPU_KERNELS` reported by
`load_info` and one log line when it overrides the field.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import int8_lm
from paths import DATA

from jaxsample import LLM, SamplingParams, engine, loading
from jaxsample.engine import exported, state
from jaxsample.engine import session as session_mod
from jaxsample.errors import ConfigError, InputError
from jaxsample.models.cpu_kernels import cpu_kernels
from jaxsample.models.families import families
from jaxsample.models.quantization import quant

PROMPTS = ["The capital of France is", "1 + 1 ="]
PARAMS = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=3)


@pytest.fixture(scope="module")
def qlm(tiny_lm):
    return int8_lm(tiny_lm)  # W8A8, fields "auto"


def _weights(params):
    is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731
    return [a for a in jax.tree_util.tree_leaves(params, is_leaf=is_q) if is_q(a)]


def test_each_field_is_validated_where_it_is_set(tiny_lm, tmp_path):
    with pytest.raises(ConfigError, match="prefix_kv_dtype must be one of 'auto', 'model', "
                                          "got 'float16'"):
        dataclasses.replace(tiny_lm, prefix_kv_dtype="float16")
    with pytest.raises(ConfigError, match="cpu_kernels must be one of 'auto', 'off', got 'on'"):
        dataclasses.replace(tiny_lm, cpu_kernels="on")
    missing = tmp_path / "absent.gguf"  # a ConfigError, not a ModelLoadError: before any read
    with pytest.raises(ConfigError, match="prefix_kv_dtype must be one of 'auto', 'model'"):
        loading.load(missing, prefix_kv_dtype="fp8")
    with pytest.raises(ConfigError, match="cpu_kernels must be one of 'auto', 'off', got 0"):
        loading.load(missing, cpu_kernels=0)
    with pytest.raises(InputError, match=r"LLM\(prefix_kv_dtype=\.\.\.\) must be None or one of "
                                         "'auto', 'model'"):
        LLM(tiny_lm, prefix_kv_dtype="half", compilation_cache=False)
    with pytest.raises(InputError, match=r"LLM\(cpu_kernels=\.\.\.\) must be None or one of "
                                         "'auto', 'off'"):
        LLM(tiny_lm, cpu_kernels="avx2", compilation_cache=False)
    with pytest.raises(InputError, match="prefix_kv_dtype='auto'"):  # vLLM's name: ours named
        LLM(tiny_lm, kv_cache_dtype="fp8", compilation_cache=False)
    with pytest.raises(ConfigError, match="prefix_kv_dtype must be one of"):
        state.prefix_kv_dtype(tiny_lm.config, tiny_lm.params, "float32")


def test_llm_sets_the_fields_of_a_loaded_model(tiny_lm):
    llm = LLM(tiny_lm, prefix_kv_dtype="model", cpu_kernels="off", compilation_cache=False)
    assert (llm.lm.prefix_kv_dtype, llm.lm.cpu_kernels) == ("model", "off")
    assert LLM(tiny_lm, compilation_cache=False).lm is tiny_lm  # None: the model's own


def test_the_int8_weights_carry_cpu_kernels_and_key_programs_apart(qlm):
    """"off" sets every int8 weight's static `kernels` False (its arrays shared), so the
    parameters' pytree structure, and with it every program's key (the engine's
    in-process cache and the exported entries'), differs from "auto"'s."""
    off = dataclasses.replace(qlm, cpu_kernels="off")
    assert all(w.kernels for w in _weights(qlm.params))
    assert not any(w.kernels for w in _weights(off.params))
    assert all(a.q is b.q for a, b in zip(_weights(qlm.params), _weights(off.params)))
    assert not quant.uses_cpu_kernels(off.params)
    again = dataclasses.replace(off, cpu_kernels="auto")
    assert jax.tree_util.tree_structure(again.params) == jax.tree_util.tree_structure(qlm.params)
    assert (jax.tree_util.tree_structure(off.params)
            != jax.tree_util.tree_structure(qlm.params))
    key = ("decode",)
    assert exported.entry_key(key, (off.params,), ()) != exported.entry_key(key, (qlm.params,), ())


def _custom_calls(lm, ids):
    fam = families.module_for(lm.config)
    text = jax.jit(lambda p: fam.forward(lm.config, p, ids)).lower(lm.params).as_text()
    return sum(text.count(f"@{t}(") for t in cpu_kernels.TARGETS)  # StableHLO's custom calls


@pytest.mark.slow
def test_cpu_kernels_off_is_xlas_path_in_its_own_programs(qlm, monkeypatch):
    """A model with cpu_kernels="off" traces no custom call of the kernels, and its
    tokens and logprobs are those of the same model traced with the kernels off in the
    process (bit for bit: the same XLA programs); its programs are built apart from
    "auto"'s, never read from them."""
    off = dataclasses.replace(qlm, cpu_kernels="off")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, qlm.vocab_limit, (2, 9)), jnp.int32)
    assert _custom_calls(off, ids) == 0
    if cpu_kernels.active():
        assert _custom_calls(qlm, ids) > 0
    auto = engine.generate(qlm, PROMPTS, PARAMS)
    built = engine.PROGRAMS.compilations
    engine.generate(qlm, PROMPTS, PARAMS)
    assert engine.PROGRAMS.compilations == built  # the same model: nothing new
    got = engine.generate(off, PROMPTS, PARAMS)
    assert engine.PROGRAMS.compilations > built  # keyed apart from "auto"'s programs
    assert auto.tokens.shape == got.tokens.shape

    # The oracle: "auto" traced afresh while the process has the kernels off.
    monkeypatch.setitem(cpu_kernels._STATE, "status", "off for this test")
    monkeypatch.setattr(session_mod, "PROGRAMS", type(engine.PROGRAMS)())
    quant._w8a8_fn.cache_clear()
    want = engine.generate(qlm, PROMPTS, PARAMS)
    quant._w8a8_fn.cache_clear()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


@pytest.mark.slow
def test_prefix_kv_dtype_model_keeps_the_float32_prefix(qlm, monkeypatch):
    """"model" stores a W8A8 model's prefix float32 (where "auto" stores float16 on the
    CPU kernels), giving the tokens and logprobs of a run whose prefix dtype rule
    answers the model's dtype everywhere (what a float32 prefix always meant)."""
    model = dataclasses.replace(qlm, prefix_kv_dtype="model")
    s = session_mod.Session(model, PROMPTS[:1], PARAMS)
    assert s.prefix_dtype == np.float32
    if quant.uses_cpu_kernels(qlm.params):
        assert session_mod.Session(qlm, PROMPTS[:1], PARAMS).prefix_dtype == np.float16
    got = engine.generate(model, PROMPTS, PARAMS)

    never = lambda cfg, params, choice="auto": None  # noqa: E731
    monkeypatch.setattr(state, "prefix_kv_dtype", never)  # read by the prefill
    monkeypatch.setattr(session_mod, "prefix_kv_dtype", never)  # the programs' key
    want = engine.generate(qlm, PROMPTS, PARAMS)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_prefix_kv_dtype_keys_the_prefill_apart(tiny_lm):
    """Two models differing only in prefix_kv_dtype never share a prefill program, even
    where both store the model's dtype (a float model)."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=0)
    model = dataclasses.replace(tiny_lm, prefix_kv_dtype="model")
    engine.generate(tiny_lm, PROMPTS[:1], params)
    built = engine.PROGRAMS.compilations
    engine.generate(tiny_lm, PROMPTS[:1], params)
    assert engine.PROGRAMS.compilations == built
    engine.generate(model, PROMPTS[:1], params)
    assert engine.PROGRAMS.compilations > built


@pytest.mark.slow
def test_the_environment_override_is_reported(tmp_path, monkeypatch, caplog):
    """`JAXSAMPLE_CPU_KERNELS=0` in a process whose kernels were not built yet turns them
    off for an int8 model whose field is "auto": `load_info` says so, naming the
    variable, and one warning line does; a model whose field is "off" overrides
    nothing. The same weights' arrays serve both."""
    monkeypatch.setattr(cpu_kernels, "_STATE", {})  # this process's kernels: not built yet
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    monkeypatch.setattr(loading, "_LOADED", {})
    gguf = DATA / "tiny_llama.gguf"
    with caplog.at_level(logging.WARNING, logger="jaxsample.cpu_kernels"):
        lm = loading.load(gguf, weights="int8", cache=False)
    info = loading.load_info(lm)
    assert info["cpu_kernels"] == "off"
    assert info["cpu_kernels_override"].startswith(
        "JAXSAMPLE_CPU_KERNELS=0 overrides cpu_kernels='auto'")
    lines = [r.getMessage() for r in caplog.records if cpu_kernels.ENV in r.getMessage()]
    assert len(lines) == 1 and "model tiny_llama" in lines[0], lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxsample.cpu_kernels"):
        off = loading.load(gguf, weights="int8", cache=False, cpu_kernels="off")
    assert off.cpu_kernels == "off" and not caplog.records
    info = loading.load_info(off)
    assert info["cpu_kernels"] == "off" and "cpu_kernels_override" not in info
    assert info["quantized"] == loading.load_info(lm)["quantized"]
    assert all(a.q is b.q for a, b in zip(_weights(lm.params), _weights(off.params)))
    assert loading.load(gguf, weights="int8", cache=False) is lm  # one model per switches
    assert cpu_kernels.override("off") is None
    assert "cpu_kernels" not in loading.load_info(loading.load(gguf, cache=False))  # float
