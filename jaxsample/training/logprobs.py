"""`token_logprobs`: per-token log-probabilities of given sequences, differentiable in the weights.

The training-side twin of the sampler. The sampler reports, for every token it
draws, `log_softmax` of the raw logits at that token (padding rows excluded);
`token_logprobs` recomputes the same numbers for whole sequences with one plain
causal forward (the family's `embed`, `run_causal` and `logits`, as the prefill
runs them), as a pure function of the parameters: `jax.jit` and `jax.grad` go
through it (GRPO, PPO, distillation).

The vocabulary projection is the memory hazard of such a function: the logits
of B sequences of S positions are `[B, S, V]` float32 (32 sequences of 96
tokens over SmolLM2's 49,152 rows: 604 MB, and as much again for their
gradient). Here they exist one chunk of C positions at a time: the final
hidden states `[B, S, E]` are split into `ceil((S - 1) / C)` chunks, a
`lax.map` computes each chunk's logits, log-normaliser and target entry, and
`jax.checkpoint` makes the backward pass recompute a chunk's logits instead
of keeping them. The peak of logits-sized memory is therefore one chunk's
`[B, C, V]` float32 and its cotangent, `2 * 4 * B * C * V` bytes, whatever S
is (tests/training/test_token_logprobs.py bounds XLA's temporary bytes by it).

The arithmetic of one position is the sampler's (`engine.sampling.prepare`
and `choose_token`): rows `>= vocab_limit` at -inf, the maximum subtracted,
then `shifted[token] - log(sum(exp(shifted)))`; with a temperature the
logits are divided by it first (the policy softmax(logits / temperature)).
The numbers agree with the sampler's to float32 rounding, not bit for bit:
the prefill and the decode step reduce in another order than one causal
forward (another matmul shape per position, attention merged by log-sum-exp
over prefix and tail); benchmarks/token_logprobs_agreement.py measures the gap.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.errors import InputError
from jaxsample.lm import LanguageModel
from jaxsample.models.families import common, families

# The default chunk: the largest C whose [B, C, V] float32 logits fit in this many bytes.
LOGITS_CHUNK_BYTES = 64 << 20


def language_model(model: Any) -> LanguageModel:
    """The `LanguageModel` behind `model`: itself, or an engine's `.lm`.

    Raises:
      InputError: neither.
    """
    if isinstance(model, LanguageModel):
        return model
    lm = getattr(model, "lm", None)
    if isinstance(lm, LanguageModel):
        return lm
    raise InputError(f"model must be a jaxsample.LanguageModel or an engine holding one in "
                     f".lm (jaxsample.LLM), got {type(model).__name__}")


def check_temperature(temperature: Any, name: str = "temperature") -> float:
    """`temperature` as a Python float, finite and > 0, or an InputError naming `name`."""
    if isinstance(temperature, (jax.Array, np.ndarray)) and temperature.ndim == 0:
        if isinstance(temperature, jax.core.Tracer):
            raise InputError(f"{name} must be a concrete number (it selects the policy "
                             "softmax(logits / temperature)), got a traced value")
        temperature = temperature.item()
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(
            temperature, (int, float, np.integer, np.floating)):
        raise InputError(f"{name} must be a number > 0, got {type(temperature).__name__} "
                         f"{temperature!r:.40}")
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise InputError(f"{name} must be a finite number > 0 (the policy is "
                         f"softmax(logits / {name}); greedy decoding has no log-probabilities), "
                         f"got {temperature!r}")
    return t


def check_tokens(tokens: Any, lm: LanguageModel, name: str = "tokens"):
    """`tokens` as a `[B, S]` int32 array (numpy, or the jax array / tracer as given).

    Shapes and dtypes are checked always; the ids (in `[0, vocab_limit)`) when
    the values are concrete and on this process.

    Raises:
      InputError: not 2-D with B, S >= 1, not an integer dtype, S beyond the
        model's context, or an id outside the vocabulary.
    """
    traced = isinstance(tokens, jax.core.Tracer)
    if not isinstance(tokens, (jax.Array, np.ndarray)):
        try:
            tokens = np.asarray(tokens)
        except (TypeError, ValueError) as e:
            raise InputError(f"{name} must be a [B, S] integer array, got "
                             f"{type(tokens).__name__} ({e})") from None
    if tokens.ndim != 2 or 0 in tokens.shape:
        raise InputError(f"{name} must have shape [B, S] with B, S >= 1, got {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"{name} must be an integer array (token ids), got dtype {tokens.dtype}")
    S, context = tokens.shape[1], lm.config.max_seq_len
    if S > context:
        raise InputError(f"{name} has {S} positions, more than the model's context ({context})")
    limit = lm.vocab_limit
    if not traced and getattr(tokens, "is_fully_addressable", True):
        host = np.asarray(tokens)
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= limit:
            raise InputError(f"{name} must be token ids in [0, {limit}) (the vocabulary), got "
                             f"values in [{lo}, {hi}]")
    if tokens.dtype != jnp.int32:
        tokens = tokens.astype(np.int32) if isinstance(tokens, np.ndarray) else tokens.astype(
            jnp.int32)
    return tokens


def chunk_positions(chunk_size, rows: int, positions: int, V: int) -> int:
    """C, positions per chunk: `chunk_size` (at most `positions`), or by default the
    largest C whose `[rows, C, V]` float32 logits fit in `LOGITS_CHUNK_BYTES`, at
    least 1 and at most `positions`.

    Raises:
      InputError: chunk_size neither None nor an int >= 1.
    """
    if chunk_size is None:
        return max(1, min(positions, LOGITS_CHUNK_BYTES // (4 * rows * V)))
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(
            chunk_size, (int, np.integer)) or chunk_size < 1:
        raise InputError(f"chunk_size must be an int >= 1 (positions per chunk), "
                         f"got {chunk_size!r}")
    return int(min(chunk_size, positions))


def token_logprobs(model, params, tokens, *, temperature: float = 1.0,
                   chunk_size: int | None = None) -> jax.Array:
    """Per-token log-probabilities of `tokens` under `params`, differentiable in `params`.

    Entry `[b, i]` is `log p(tokens[b, i] | tokens[b, :i])` under
    `softmax(logits / temperature)` over the model's vocabulary (rows `>=
    vocab_limit` excluded, as the sampler does); entry `[b, 0]` is 0 (no
    context). At temperature 1 these are the sampler's raw logprobs
    (`Generation.logprobs`) to float32 rounding.

    A pure function of `params`: `jax.jit`, `jax.grad` and `jax.vjp` go
    through it, and B needs no `jax.vmap`. On a mesh, place `params` (for
    example replicated) and `tokens` (for example split over a data axis on
    B) with `jax.device_put`; the computation follows the placement and the
    result is split like `tokens`.

    Memory: the logits exist one chunk of C positions at a time, `[B, C, V]`
    float32, and the backward pass recomputes each chunk (`jax.checkpoint`);
    logits-sized memory peaks at `2 * 4 * B * C * V` bytes (the chunk's
    logits and their cotangent), never `[B, S, V]`.

    Args:
      model: a `jaxsample.LanguageModel`, or an engine with one in `.lm`
        (`jaxsample.LLM`); only its config and tokenizer's vocabulary are
        used, never its weights.
      params: the parameter pytree (the family's `param_shapes`, stacked or
        the list-of-layers layout; leaves may also be objects the families
        multiply with `@`, such as `models.quantization.quant.QuantizedWeight` or
        `jaxsample.training.lora` adapters).
      tokens: `[B, S]` integer token ids (cast to int32), S <= the context.
      temperature: a finite number > 0 (a Python number: it is the policy).
      chunk_size: C, positions per chunk (an int >= 1); default the largest C
        with `4 * B * C * V <= LOGITS_CHUNK_BYTES` (64 MiB).
    Returns:
      `[B, S]` float32.
    Raises:
      InputError: a model that is not one, a temperature that is not a finite
        number > 0, tokens that are not `[B, S]` integers within the
        vocabulary and the context, a chunk_size that is not an int >= 1.
    """
    lm = language_model(model)
    t = check_temperature(temperature)
    tokens = check_tokens(tokens, lm)
    B, S = tokens.shape
    chunk = chunk_positions(chunk_size, B, max(S - 1, 1), lm.config.vocab_size)
    return _token_logprobs(lm.config, lm.vocab_limit, chunk, params, tokens, np.float32(t))


def chunked_logprobs(cfg, vocab_limit: int, chunk: int, params, hidden: jax.Array,
                     targets: jax.Array, temperature) -> jax.Array:
    """Log-probabilities of `targets` from final hidden states, C positions at a time.

    Args:
      cfg: the model config; vocab_limit: static, rows >= it are excluded.
      chunk: static C.
      hidden: `[B, M, E]` the last layer's output (before the final norm) at
        the M positions that predict `targets`.
      targets: `[B, M]` int32.
      temperature: `[]` float32 > 0.
    Returns:
      `[B, M]` float32; logits-sized memory `2 * 4 * B * C * V` bytes at most.
    """
    fam = families.module_for(cfg)
    B, M, E = hidden.shape
    n = -(-M // chunk)
    pad = n * chunk - M
    xs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, E).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        x, tgt = args  # [B, C, E], [B, C]
        z = fam.logits(cfg, params, x)  # [B, C, V] float32
        z = z / temperature
        z = jnp.where(jnp.arange(z.shape[-1]) < vocab_limit, z, -jnp.inf)
        shifted = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
        picked = jnp.take_along_axis(shifted, tgt[..., None], axis=-1)[..., 0]
        return picked - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))

    out = jax.lax.map(one, (xs, ts))  # [n, B, C]
    return out.swapaxes(0, 1).reshape(B, n * chunk)[:, :M]


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _token_logprobs(cfg, vocab_limit: int, chunk: int, params, tokens, temperature):
    fam = families.module_for(cfg)
    B, S = tokens.shape
    positions = jnp.arange(S, dtype=jnp.int32)

    def hidden(toks):
        x, _ = fam.run_causal(cfg, params, fam.embed(params, toks), positions)
        return x

    if S == 1:
        return jnp.zeros((B, 1), jnp.float32)
    h = jax.vmap(hidden)(tokens)  # [B, S, E]
    lp = chunked_logprobs(cfg, vocab_limit, chunk, params, h[:, :-1], tokens[:, 1:], temperature)
    return jnp.concatenate([jnp.zeros((B, 1), jnp.float32), lp], axis=1)


def group_token_logprobs(model, params, prompt, prompt_len, completions, *,
                         temperature: float = 1.0, chunk_size: int | None = None) -> jax.Array:
    """`token_logprobs` of N completions of each of B prompts, each prompt run once.

    Entry `[b, n, t]` is `log p(completions[b, n, t] | prompt[b, :prompt_len[b]],
    completions[b, n, :t])` under softmax(logits / temperature): the numbers
    `token_logprobs` gives for the sequence prompt + completion at its
    completion positions (to float32 rounding), at the cost of one prompt
    per group instead of N. The prompt runs once with causal attention (the
    prefill); each completion attends to the prompt's keys and values
    (shared, not copied) and to its own, the two partial softmaxes merged by
    log-sum-exp (`models.families.common.merge_attention`), sliding windows included.
    A pure function of `params`, differentiable; padding after a branch's
    end is scored too (the caller masks it).

    Args:
      model, params, temperature, chunk_size: as `token_logprobs` (C chunks the
        T completion positions).
      prompt: `[B, P]` int32 right-padded prompt ids; prompt_len: `[B]` int32 in [1, P].
      completions: `[B, N, T]` int32 ids.
    Returns:
      `[B, N, T]` float32.
    Raises:
      InputError: as `token_logprobs`, for shapes and ids of prompt and
        completions (P + T within the context).
    """
    lm = language_model(model)
    t = check_temperature(temperature)
    prompt = check_tokens(prompt, lm, "prompt")
    if not isinstance(completions, (jax.Array, np.ndarray)):
        completions = np.asarray(completions)
    if completions.ndim != 3 or completions.shape[0] != prompt.shape[0]:
        raise InputError(f"completions must have shape [B, N, T] with B = {prompt.shape[0]} "
                         f"(the prompts), got {tuple(completions.shape)}")
    B, N, T = completions.shape
    comp = check_tokens(completions.reshape(B * N, T), lm, "completions").reshape(B, N, T)
    if prompt.shape[1] + T > lm.config.max_seq_len:
        raise InputError(f"prompt ({prompt.shape[1]}) + completions ({T}) positions exceed the "
                         f"model's context ({lm.config.max_seq_len})")
    if not isinstance(prompt_len, jax.core.Tracer):
        pl = np.asarray(prompt_len)
        if pl.shape != (B,) or not np.issubdtype(pl.dtype, np.integer) or (
                pl.size and (pl.min() < 1 or pl.max() > prompt.shape[1])):
            raise InputError(f"prompt_len must be [B] = [{B}] ints in [1, {prompt.shape[1]}], "
                             f"got {pl.dtype} {pl.shape}")
    chunk = chunk_positions(chunk_size, B * N, T, lm.config.vocab_size)
    return _group_token_logprobs(lm.config, lm.vocab_limit, chunk, params, prompt,
                                 jnp.asarray(prompt_len, jnp.int32), comp, np.float32(t))


def _tail_attend(kp, vp, window, prompt_len, scale):
    """Attention of T completion queries (absolute positions prompt_len + t) over the
    prompt's keys `< prompt_len` and their own causal tail, within `window`."""

    def attend(q, k, v):
        T, P = q.shape[0], kp.shape[0]
        q_pos = prompt_len + jnp.arange(T)
        pre = (jnp.arange(P)[None, :] < prompt_len) & common.window_mask(q_pos, jnp.arange(P),
                                                                          window)
        own = (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]) & common.window_mask(
            q_pos, q_pos, window)
        a = common.partial_attention(q, kp.swapaxes(0, 1), vp.swapaxes(0, 1), pre, scale)
        b = common.partial_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1), own, scale)
        return common.merge_attention([a, b]).astype(q.dtype)

    return attend


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _group_token_logprobs(cfg, vocab_limit: int, chunk: int, params, prompt, prompt_len,
                          completions, temperature):
    fam = families.module_for(cfg)
    B, N, T = completions.shape
    P = prompt.shape[1]
    stacked = not isinstance(params["layers"], (list, tuple))
    windows = (jnp.asarray([common.NO_WINDOW if w is None else w for w in cfg.layer_windows],
                           jnp.int32) if stacked else list(cfg.layer_windows))
    scale = cfg.attention_scale

    def group(toks, pl, comp):
        hp, (kp, vp) = fam.run_causal(cfg, params, fam.embed(params, toks),
                                      jnp.arange(P, dtype=jnp.int32), pl)
        xs = (kp, vp, windows) if stacked else list(zip(kp, vp, windows))
        positions = pl + jnp.arange(T, dtype=jnp.int32)

        def branch(c):
            x, _ = fam.run_layers(cfg, params, fam.embed(params, c), positions,
                                  lambda lx: _tail_attend(*lx, pl, scale), layer_xs=xs)
            return x

        hc = jax.vmap(branch)(comp)  # [N, T, E]
        first = jnp.broadcast_to(jax.lax.dynamic_index_in_dim(hp, pl - 1, 0, keepdims=False),
                                 (N, 1, hp.shape[-1]))
        return jnp.concatenate([first, hc[:, :T - 1]], axis=1)  # position t predicts token t

    hidden = jax.vmap(group)(prompt, prompt_len, completions)  # [B, N, T, E]
    lp = chunked_logprobs(cfg, vocab_limit, chunk, params, hidden.reshape(B * N, T, -1),
                          completions.reshape(B * N, T), temperature)
    return lp.reshape(B, N, T)
