"""Three levels of sharing: a context common to all B prompts, prefilled and stored once.

`generate(..., shared_prefix=...)` (Hydragen's inter-request prefix, Juravsky
et al. 2024, arXiv 2402.05099) splits every prompt into

    context  [C]      common to all B prompts: prefilled once, KV L x [K, C, D]
                      (no prompt axis, no branch axis)             `prefill_context`
    suffix   [R, P]   each prompt's own tokens at positions C + j: prefilled once
                      per prompt, attending to the context and causally to
                      itself; KV L x [R, K, P, D] (the `PrefixCache`)  `prefill_suffix`
    tails    [R, N, T] each branch's own tokens (the decode state)

and every attention over them is partial softmaxes merged by log-sum-exp
(`models.families.common.partial_attention` / `merge_attention`): context + suffix in
the suffix prefill; context + suffix + tail + the current token in the decode
step (`step.branch_step`). The context is passed unbatched (in_axes None) to
both the row and the branch vmap, so each step reads it once for all B x N
branches. A local (sliding-window) layer keeps the last `window - 1` context
positions and masks keys outside `(p - window, p]` across both boundaries.

Letters as in `state.py`; C is the common context's bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsample.engine import sampling
from jaxsample.engine.prefill import keep_window, prefix_start, prompt_logprobs_of, stored_prefix
from jaxsample.engine.state import ContextCache, PrefixCache, PromptLogprobs
from jaxsample.models.families import common, families


def prefill_context(cfg, params, tokens: jax.Array, length: jax.Array, post_layer=None,
                    bridge_params=None, prompt_logprobs: int = -1,
                    vocab_limit: int | None = None):
    """Prefill the common context once: one causal sequence, no prompt axis.

    Args:
      cfg, params, post_layer, bridge_params: as `prefill.prefill` (a Bridge
        block sees the single copy: every branch of every prompt holds the same
        hidden state at a context position).
      tokens: `[C]` int32, right-padded; length: `[]` int32 >= 1.
      prompt_logprobs, vocab_limit: static, as `prefill.prefill`.
    Returns:
      (ContextCache k, v L x `[K, C_l, D]`, logits `[V]` float32 at position
      length - 1 (they predict each prompt's first own token)); plus the
      context's `PromptLogprobs` (`[C]`, `[C, k]`; entry i is about context
      token i + 1, entries `>= length - 1` padding) when prompt_logprobs >= 0.
    """
    fam = families.module_for(cfg)
    if prompt_logprobs >= 0 and vocab_limit is None:
        raise ValueError("prompt_logprobs needs vocab_limit")
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    x = fam.embed(params, tokens)
    x, (k, v) = fam.run_causal(cfg, params, x, positions, length, post_layer=post_layer,
                               post_xs=bridge_params)
    last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
    ck = tuple(keep_window(a, length, w).swapaxes(0, 1) for a, w in zip(k, cfg.layer_windows))
    cv = tuple(keep_window(a, length, w).swapaxes(0, 1) for a, w in zip(v, cfg.layer_windows))
    out = (ContextCache(ck, cv, length), fam.logits(cfg, params, last))
    if prompt_logprobs >= 0:
        out += (prompt_logprobs_of(cfg, params, x, tokens, prompt_logprobs, vocab_limit),)
    return out


def suffix_attend(ctx_len, length, positions, ck, cv, window, scale):
    """Attention of one row's suffix queries over [the context, the suffix causally].

    Args:
      ctx_len: `[]` int32 C; length: `[]` int32 the suffix's valid length;
      positions: `[S]` int32 absolute positions (C + j) of the suffix slots.
      ck, cv: `[K, C_l, D]` one layer's context cache; window: the layer's
        window (None: global).
    Returns:
      attend(q `[S, H, D]`, k `[S, K, D]`, v `[S, K, D]`) -> `[S, H, D]`.
    """
    S = positions.shape[0]
    j = jnp.arange(S)
    c_pos = prefix_start(ctx_len, ck.shape[1], window) + jnp.arange(ck.shape[1])
    c_mask = jnp.broadcast_to((c_pos < ctx_len)[None, :], (S, ck.shape[1]))
    s_mask = (j[None, :] <= j[:, None]) & (j[None, :] < length)
    if window is not None:
        c_mask = c_mask & common.window_mask(positions, c_pos, window)
        s_mask = s_mask & common.window_mask(j, j, window)

    def attend(q, k, v):
        out = common.merge_attention([
            common.partial_attention(q, ck, cv, c_mask, scale),
            common.partial_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1), s_mask, scale),
        ])
        return out.astype(q.dtype)

    return attend


def prefill_suffix(cfg, params, ctx: ContextCache, tokens: jax.Array, lengths: jax.Array,
                   post_layer=None, bridge_params=None, prompt_logprobs: int = -1,
                   vocab_limit: int | None = None, ctx_logits: jax.Array | None = None,
                   prefix_kv_dtype: str = "auto"):
    """Prefill each prompt's own suffix once, after the common context.

    Row r's token j sits at position C + j and attends to every valid context
    position (within the window on local layers) and causally to its own
    suffix: two partial attentions merged by log-sum-exp, the context passed
    unbatched over the rows.

    Args:
      ctx: the `ContextCache` of `prefill_context`.
      tokens: `[R, P]` int32 right-padded suffixes; lengths: `[R]` int32 >= 1.
      params (list layout), post_layer, bridge_params, prompt_logprobs,
        vocab_limit, prefix_kv_dtype: as `prefill.prefill`.
      ctx_logits: `[V]` float32, the context's last-position logits (needed
        with prompt_logprobs: they score each suffix's first token).
    Returns:
      (PrefixCache of the suffixes k, v L x `[R, K, P_l, D]` (in
      `state.prefix_kv_dtype`) with their lengths,
      last-position logits `[R, V]` float32); plus, when prompt_logprobs >= 0,
      `PromptLogprobs` `[R, P + 1]` (`[R, P + 1, k]`): entry 0 is about suffix
      token 0 given the context, entry j + 1 about suffix token j + 1.
    """
    fam = families.module_for(cfg)
    scale = cfg.attention_scale
    if prompt_logprobs >= 0 and (vocab_limit is None or ctx_logits is None):
        raise ValueError("prompt_logprobs needs vocab_limit and ctx_logits")

    def one(toks, length):
        positions = ctx.length + jnp.arange(toks.shape[0], dtype=jnp.int32)
        x = fam.embed(params, toks)
        x, (k, v) = fam.run_layers(
            cfg, params, x, positions,
            lambda xs: suffix_attend(ctx.length, length, positions, *xs, scale),
            list(zip(ctx.k, ctx.v, cfg.layer_windows)), post_layer, bridge_params)
        last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
        k = tuple(keep_window(a, length, w).swapaxes(0, 1) for a, w in zip(k, cfg.layer_windows))
        v = tuple(keep_window(a, length, w).swapaxes(0, 1) for a, w in zip(v, cfg.layer_windows))
        out = (fam.logits(cfg, params, last), k, v)
        if prompt_logprobs >= 0:
            first = sampling.position_logprobs(ctx_logits[None], toks[:1], prompt_logprobs,
                                               vocab_limit)
            rest = prompt_logprobs_of(cfg, params, x, toks, prompt_logprobs, vocab_limit)
            out += (PromptLogprobs(*(jnp.concatenate([a, b]) for a, b in zip(first, rest))),)
        return out

    out = jax.vmap(one)(tokens, lengths)
    logits, (k, v) = out[0], stored_prefix(cfg, params, *out[1:3], prefix_kv_dtype)
    return (PrefixCache(k, v, lengths), logits) + tuple(out[3:])
