"""Fingerprints of the default (float) programs, to compare two checkouts.

Prints a SHA-256 prefix of the compiled HLO text of the SmolLM2 decode step
(float32 and bfloat16, P = 1024, N = 1 and 16; `engine.step_cost.compile_decode_step`)
and of the tiny model's causal forward (its StableHLO and its compiled HLO), with
the source metadata (file names, lines, stack frames) removed. Equal lines in two
checkouts mean the same XLA programs, so the same numbers (how a change that
must leave the default path alone shows it did). Run with each checkout's own
interpreter and diff the outputs:

    python scripts/hlo_fingerprint.py > after.txt
"""

from __future__ import annotations

import hashlib
import re

import jax
import jax.numpy as jnp

from jaxsample import tiny
from jaxsample.engine.step_cost import compile_decode_step
from jaxsample.loading import read_config
from jaxsample.models.families import llama


def clean(text: str) -> str:
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"stack_frame_id=\d+", "", text)
    return re.sub(r"\n\d+ [\"{][^\n]*", "", text)  # the debug tables: files, functions, frames


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main():
    cfg = read_config(None)
    for dtype in ("float32", "bfloat16"):
        for n in (1, 16):
            text = compile_decode_step(cfg.replace(dtype=dtype), 1024, n, 64).as_text()
            print(f"step {dtype} N={n}", digest(clean(text)))
    lm = tiny.make_tiny_lm()
    f = jax.jit(lambda p, t: llama.forward(lm.config, p, t))
    lowered = f.lower(lm.params, jnp.zeros((2, 40), jnp.int32))
    print("tiny forward stablehlo", digest(lowered.as_text()))
    print("tiny forward compiled", digest(clean(lowered.compile().as_text())))


if __name__ == "__main__":
    main()
