"""docs/from_jax.md runs as written: its Python blocks, in order, on the tiny random model
(`jaxsample.load` answers it in place of SmolLM2)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from paths import ROOT

import jaxsample

PAGE = ROOT / "docs" / "from_jax.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)


def test_the_grpo_step_is_under_40_lines():
    code = blocks()
    assert len(code) == 2
    assert "grpo_loss" in code[1] and len(code[1].strip().splitlines()) < 40


@pytest.mark.slow
def test_the_page_runs(tiny_lm, monkeypatch):
    monkeypatch.setattr(jaxsample, "load", lambda *a, **k: tiny_lm)
    ns: dict = {}
    for code in blocks():
        exec(compile(code, str(PAGE), "exec"), ns)
    assert ns["lp"].shape == ns["tokens"].shape and float(ns["lp"][0, 0]) == 0.0
    assert jax.tree_util.tree_structure(ns["grads"]) == jax.tree_util.tree_structure(
        tiny_lm.params)
    assert np.isfinite(float(ns["loss"]))
    assert ns["batch"].completions.shape[:2] == (2, 8)
    moved = [float(np.abs(np.asarray(a)).max()) for a in
             jax.tree_util.tree_leaves(ns["adapters"]["layers"]["wq"]["b"])]
    assert max(moved) > 0 or not np.any(ns["batch"].advantages)  # B left zero only without signal
