"""A tiny random Llama-family model with a byte tokenizer, for tests and quick benchmark runs.

`TINY`: vocab 264 (258 real ids: bytes 0-255, end-of-text 256, padding 257; the
rest are padding logits rows, never sampled), E = 32, L = 2, H = 4, K = 2,
D = 8, F = 64, context 512. Weights are `llama.init_params` draws, so nothing
is read from disk. `make_tiny_lm` wraps them in a `LanguageModel` (the tests'
`tiny_lm` fixture, `--model tiny` of the benchmarks and scripts), outside
`jaxsample.models`, which never builds a `LanguageModel`.
"""

from __future__ import annotations

import jax

from jaxsample.lm import LanguageModel
from jaxsample.models.checkpoints.tokenizer import ByteTokenizer
from jaxsample.models.families import llama


def byte_tokenizer() -> ByteTokenizer:
    """Ids 0-255 are bytes, 256 is end-of-text (the stop id), 257 is padding; the
    tiny model has more logits rows than this (padding rows are never sampled)."""
    return ByteTokenizer(vocab_size=258, eos_token_ids=(256,), pad_token_id=257)


TINY = llama.LlamaConfig(vocab_size=264, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=64, rope_theta=10000.0, max_seq_len=512)


def make_tiny_lm(cfg=TINY, seed=0, scale=0.3) -> LanguageModel:
    """A random tiny model with a peaked enough distribution to make sampling interesting.

    Args:
      cfg: a `LlamaConfig` (default `TINY`).
      seed: the `jax.random.key` seed of the weights.
      scale: the standard deviation of the weight draws (0 gives all-zero weights:
        uniform logits).
    """
    return LanguageModel(config=cfg, params=llama.init_params(cfg, jax.random.key(seed), scale),
                         tokenizer=byte_tokenizer(), name="tiny", source="random")
