"""The raw logits of one distribution, the logits processors before temperature, stop ids.

`prepare` masks padding rows and NaN and tempers; `process_logits` applies
logit bias, min-tokens and the repetition / frequency / presence penalties in
vLLM's order (the table of `jaxsample.engine.sampling`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def first_argmax(x: jax.Array) -> jax.Array:
    """int32 index of the first maximum of x [V].

    Two plain reductions (max, then min index) instead of `jnp.argmax`'s
    variadic reduce: XLA CPU vectorises them, and they measure faster than
    `jnp.argmax` when fused with the Gumbel noise. An all-NaN row gives 0.
    """
    v = x.shape[0]
    idx = jnp.min(jnp.where(x == jnp.max(x), jnp.arange(v, dtype=jnp.int32), v))
    return (idx % v).astype(jnp.int32)


def prepare(logits: jax.Array, temperature: jax.Array, vocab_limit: int):
    """Raw masked logits, tempered logits and the greedy token.

    Returns:
      raw: [V] float32, padding rows and NaN at -inf, +inf at the largest
        finite float32.
      z: [V] float32, (raw - max raw) / temperature (temperature 0 -> 1),
        so the max is 0 and nothing overflows; -inf where raw is -inf (all
        of z is -inf for a row without a distribution, never NaN).
      greedy_tok: int32 scalar, argmax of raw (first index on ties); 0 for a
        row without a distribution.
    """
    logits = jnp.asarray(logits, jnp.float32)
    if logits.ndim != 1:
        raise ValueError(f"logits must be [V], got shape {logits.shape}; vmap over "
                         "branches instead")
    v = logits.shape[0]
    if not 1 <= vocab_limit <= v:
        raise ValueError(f"vocab_limit must be in [1, V={v}], got {vocab_limit}")
    valid = (jnp.arange(v) < vocab_limit) & ~jnp.isnan(logits)
    raw = jnp.where(valid, jnp.minimum(logits, jnp.finfo(jnp.float32).max), -jnp.inf)
    greedy_tok = first_argmax(raw)
    m = raw[greedy_tok]
    temperature = jnp.asarray(temperature, jnp.float32)
    t = jnp.where(temperature > 0, temperature, 1.0)
    z = jnp.where(raw > -jnp.inf, (raw - m) / t, -jnp.inf)
    return raw, z, greedy_tok


def process_logits(logits: jax.Array, *, t: jax.Array, bias: jax.Array, stop_mask: jax.Array,
                   min_tokens: jax.Array, counts: jax.Array | None = None,
                   prompt_mask: jax.Array | None = None,
                   repetition_penalty: jax.Array = 1.0, frequency_penalty: jax.Array = 0.0,
                   presence_penalty: jax.Array = 0.0) -> jax.Array:
    """The logits processors before temperature, for one distribution.

    The one place where they are applied: logit bias, min-tokens, then the
    repetition, frequency and presence penalties, as the rows of the table of
    `jaxsample.engine.sampling` say (vLLM's `LogitBiasLogitsProcessor`,
    `MinTokensLogitsProcessor`, `apply_penalties`; Hugging Face's
    `RepetitionPenaltyLogitsProcessor`); `choose_token(..., processed=...)`
    then tempers, filters and samples the result. Every setting is traced.

    Args:
      logits: `[V]` raw logits (any float dtype; computed in float32).
      t: `[]` int32, tokens this branch has generated so far.
      bias: `[V]` float32 logit bias (0 where none).
      stop_mask: `[V]` bool, the ids masked until `min_tokens` (every stop id).
      min_tokens: `[]` int32.
      counts: `[V]` int32, how often the branch generated each token (its
        generated tokens only); None skips steps 3-5.
      prompt_mask: `[V]` bool, tokens of the prompt (for step 3 only).
      repetition_penalty, frequency_penalty, presence_penalty: `[]` float32.

    Returns:
      `[V]` float32 processed logits. NaN stays NaN and -inf stays -inf
      (`choose_token` counts both as -inf).
    """
    x = jnp.asarray(logits, jnp.float32) + bias
    x = jnp.where(stop_mask & (t < min_tokens), -jnp.inf, x)
    if counts is not None:
        seen = counts > 0
        rp = jnp.asarray(repetition_penalty, jnp.float32)
        x = jnp.where(seen | prompt_mask, jnp.where(x > 0, x / rp, x * rp), x)
        x = x - jnp.asarray(frequency_penalty, jnp.float32) * counts.astype(jnp.float32)
        x = x - jnp.asarray(presence_penalty, jnp.float32) * seen.astype(jnp.float32)
    return x


def pad_stop_ids(ids: Sequence[int], size: int | None = None) -> np.ndarray:
    """Stop ids as the fixed-size int32 array `is_stop` expects.

    Args:
      ids: token ids >= 0 (duplicates are removed, order kept).
      size: the array length (static across requests to avoid recompiling);
        default len(unique ids), at least 1.

    Returns:
      [size] int32, the ids followed by -1 padding.

    Raises:
      ValueError: an id is negative or there are more ids than `size`.
    """
    uniq = list(dict.fromkeys(int(i) for i in ids))
    if any(i < 0 for i in uniq):
        raise ValueError(f"stop ids must be >= 0, got {uniq}")
    size = max(len(uniq), 1) if size is None else size
    if len(uniq) > size:
        raise ValueError(f"{len(uniq)} stop ids do not fit in size {size}")
    out = np.full((size,), -1, np.int32)
    out[:len(uniq)] = uniq
    return out


def is_stop(token: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether `token` is one of `stop_ids`.

    Args:
      token: int32 scalar (>= 0).
      stop_ids: [S] int32 stop ids padded with -1 (see `pad_stop_ids`).

    Returns:
      bool scalar. Padding (-1) never matches a real token.
    """
    token = jnp.asarray(token, jnp.int32)
    stop_ids = jnp.asarray(stop_ids, jnp.int32)
    return jnp.any((stop_ids == token) & (stop_ids >= 0))
