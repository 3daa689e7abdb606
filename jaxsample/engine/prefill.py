"""Prefill: each prompt's KV cache, computed once and stored once (no branch axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsample.engine import sampling, state
from jaxsample.engine.state import PrefixCache, PromptLogprobs
from jaxsample.models.families import families

PROMPT_LOGPROB_BLOCK = 64  # positions whose [block, V] logits exist at once (per row)


def stored_prefix(cfg, params, k, v, prefix_kv_dtype: str = "auto"):
    """k, v (L x `[..., K, P_l, D]`) in `state.prefix_kv_dtype(cfg, params,
    prefix_kv_dtype)` (the model's `LanguageModel.prefix_kv_dtype`). Into float16,
    values beyond its range saturate at +-65504 (never an inf that would turn every
    score of the row into NaN); a NaN stays NaN."""
    dtype = state.prefix_kv_dtype(cfg, params, prefix_kv_dtype)
    if dtype is None:
        return tuple(k), tuple(v)
    top = float(jnp.finfo(dtype).max)
    store = lambda a: jnp.clip(a, -top, top).astype(dtype)  # noqa: E731
    return tuple(map(store, k)), tuple(map(store, v))


def prefill(cfg, params, tokens: jax.Array, lengths: jax.Array, post_layer=None,
            bridge_params=None, prompt_logprobs: int = -1, vocab_limit: int | None = None,
            prefix_kv_dtype: str = "auto"):
    """Prefill R right-padded prompts, once each.

    With a Bridge, every branch holds the same hidden state at prompt
    positions, and attention over N identical copies equals attention over
    one, so the prompt is still run once, with each Bridge block attending to
    this single copy (`post_layer` built with no branch axes).

    Args:
      cfg: the model config (any family: `models.families.families.module_for`); local
        (sliding-window) layers attend within their window.
      params: the model parameters (either layout, see `llama.run_layers`).
      tokens: `[R, P]` int32, right-padded; lengths: `[R]` int32, each >= 1.
      post_layer, bridge_params: the optional Bridge hook and its `[L, ...]` params.
      prompt_logprobs: static; -1 (default): none, the prefill computes only
        the last position's logits. k in [0, 20]: also the logprob and rank of
        every prompt token given its prefix and the top k there
        (`SamplingParams.prompt_logprobs`), from the hidden states the
        prefill already has, in blocks of `PROMPT_LOGPROB_BLOCK` positions
        so that at most `[R, block, V]` float32 logits exist at once.
      vocab_limit: static, rows >= it are padding (needed with prompt_logprobs).
      prefix_kv_dtype: static, the model's `LanguageModel.prefix_kv_dtype` ("auto" or
        "model"), which `state.prefix_kv_dtype` resolves to the stored dtype.
    Returns:
      (PrefixCache with k, v L x `[R, K, P_l, D]` (in `state.prefix_kv_dtype`),
      last-position logits `[R, V]` float32): P_l = P on global layers,
      `window_extent(P, w)` on a local layer of window w (its last positions, see
      `keep_window`); plus a `PromptLogprobs` (`[R, P]`, `[R, P, k]`) when
      prompt_logprobs >= 0.
    """
    k_prompt = prompt_logprobs
    fam = families.module_for(cfg)

    def one(toks, length):
        positions = jnp.arange(toks.shape[0], dtype=jnp.int32)
        x = fam.embed(params, toks)
        x, (k, v) = fam.run_causal(cfg, params, x, positions, length, post_layer=post_layer,
                                   post_xs=bridge_params)
        last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
        k = [keep_window(a, length, w) for a, w in zip(k, cfg.layer_windows)]
        v = [keep_window(a, length, w) for a, w in zip(v, cfg.layer_windows)]
        # L x [P_l, K, D] -> L x [K, P_l, D], once per prompt.
        out = (fam.logits(cfg, params, last), tuple(a.swapaxes(0, 1) for a in k),
               tuple(a.swapaxes(0, 1) for a in v))
        return out + ((prompt_logprobs_of(cfg, params, x, toks, k_prompt, vocab_limit),)
                      if k_prompt >= 0 else ())

    if k_prompt >= 0 and vocab_limit is None:
        raise ValueError("prompt_logprobs needs vocab_limit")
    out = jax.vmap(one)(tokens, lengths)
    logits, (k, v) = out[0], stored_prefix(cfg, params, *out[1:3], prefix_kv_dtype)
    return (PrefixCache(k, v, lengths), logits) + tuple(out[3:])


def prompt_logprobs_of(cfg, params, x: jax.Array, toks: jax.Array, k: int,
                       vocab_limit: int) -> PromptLogprobs:
    """Prompt logprobs of one row from its hidden states, in blocks of
    `PROMPT_LOGPROB_BLOCK` positions (at most `[block, V]` float32 logits at once).

    Args:
      x: `[P, E]` the last layer's hidden states; toks: `[P]` int32 the row's tokens.
      k, vocab_limit: static, as `prefill`.
    Returns:
      `PromptLogprobs` of `[P]` / `[P, k]`: entry i is about token i + 1 (the
      last entry, whose target is padding, is ignored by the callers).
    """
    fam = families.module_for(cfg)
    P = x.shape[0]
    blk = min(P, PROMPT_LOGPROB_BLOCK)
    nb = -(-P // blk)
    xs = jnp.pad(x, ((0, nb * blk - P), (0, 0))).reshape(nb, blk, x.shape[-1])
    targets = jnp.pad(toks[1:], (0, nb * blk - P + 1)).reshape(nb, blk)

    def block(args):
        xb, tb = args
        return sampling.position_logprobs(fam.logits(cfg, params, xb), tb, k, vocab_limit)

    out = jax.lax.map(block, (xs, targets))
    return PromptLogprobs(*(a.reshape((nb * blk,) + a.shape[2:])[:P] for a in out))


def window_extent(size: int, window: int | None) -> int:
    """Cache slots a layer needs for `size` positions: all of them on a global layer,
    at most w - 1 on a local layer of window w (the token being fed is the w-th key).

    The same rule sizes a local layer's tail, then a ring buffer written at slot
    t mod extent: it holds exactly the w - 1 most recent tail positions.
    """
    return size if window is None else max(min(size, window - 1), 1)


def prefix_start(length, extent: int, window: int | None):
    """Position of slot 0 of a layer's stored prefix (`[]` int32): 0 on a global layer,
    max(length - extent, 0) on a local one (its last `extent` positions)."""
    return 0 if window is None else jnp.maximum(length - extent, 0)


def keep_window(a: jax.Array, length, window: int | None) -> jax.Array:
    """`[P, K, D]` keys or values -> `[P_l, K, D]`: a local layer keeps the last
    `window_extent(P, w)` positions before `length` (decode never looks further back)."""
    extent = window_extent(a.shape[0], window)
    if extent == a.shape[0]:
        return a
    return jax.lax.dynamic_slice_in_dim(a, prefix_start(length, extent, window), extent, axis=0)


def take_rows(prefix: PrefixCache, last_logits: jax.Array, rows: jax.Array):
    """The prefix cache and last logits of some rows (a gather: one copy of those rows).

    Args:
      rows: `[R']` int32 row indices (repeats allowed: padding rows).
    """
    take = lambda a: jnp.take(a, rows, axis=0)
    return (PrefixCache(tuple(map(take, prefix.k)), tuple(map(take, prefix.v)),
                        take(prefix.lengths)), take(last_logits))
