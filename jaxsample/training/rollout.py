"""Group rollouts from given weights, and the log-probabilities of what they sampled.

A rollout samples N branches of each of B prompts (a GRPO group per prompt;
the branches share the prompt's KV cache) with the weights being trained,
and returns them as one typed `Batch` of device arrays in group layout
(`[B, P]` prompts, `[B, N, T]` completions) with the behaviour policy's
log-probability of every sampled token, beside the texts the rewards read.

`rollout` is the one place where the training code calls the engine: with a
`jaxsample.LLM` it hands the engine the new weights (`LLM.update_weights`: no
reload, no recompilation, the engine's mesh and KV budget kept) and samples
through it; with a bare `LanguageModel` it runs `jaxsample.generate` on the
model with its parameters replaced. Either way the compiled programs take the
weights as an argument, so new weights do not recompile.

The behaviour log-probabilities are those of the distribution the tokens
were drawn from, softmax(logits / temperature), reported by the sampler
itself: the raw distribution at temperature 1, `SamplingParams(logprobs_mode=
"processed_logprobs")` at another temperature. The training forward's
`completion_logprobs` computes the same numbers to float32 rounding (the
importance ratio is 1 to that on the first update). Filters (top-k, top-p,
min-p), penalties and logit bias would make the sampling distribution
another than the one the loss differentiates, so a rollout refuses them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.api import generate, run_generate
from jaxsample.engine.buckets import bucket
from jaxsample.engine.sampling import pad_stop_ids
from jaxsample.engine.state import MAX_STOP_IDS
from jaxsample.errors import InputError
from jaxsample.generation import Generation
from jaxsample.llm import LLM
from jaxsample.sampling_params import SamplingParams
from jaxsample.training.logprobs import check_temperature, group_token_logprobs, language_model

__all__ = ["Batch", "Rollout", "rollout", "pad_prompts", "stop_array", "pack",
           "completion_logprobs", "completion_mask"]


class Batch(NamedTuple):
    """B groups (prompts) of N sampled completions, padded to common shapes.

    prompt: `[B, P]` int32 right-padded prompt ids; prompt_len: `[B]` int32 (>= 1);
    completions: `[B, N, T]` int32 sampled ids (positions >= lengths are padding);
    lengths: `[B, N]` int32 tokens per branch, the stop token included;
    advantages: `[B, N]` float32 (0 until the rewards are in);
    stop_ids: `[MAX_STOP_IDS]` int32 stop ids, -1 padded;
    behaviour: `[B, N, T]` float32 log-probability of each completion token
      under the policy that sampled it (0 at padding), or None;
    reference: `[B, N, T]` float32 the same under a reference policy (the KL
      term's), or None.
    """

    prompt: jax.Array
    prompt_len: jax.Array
    completions: jax.Array
    lengths: jax.Array
    advantages: jax.Array
    stop_ids: jax.Array
    behaviour: jax.Array | None = None
    reference: jax.Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Rollout:
    """One rollout: `batch` (device arrays, advantages 0), `texts` (B lists of N
    completion texts, what rewards read) and the engine's `generation` (bill,
    finish reasons, timings)."""

    batch: Batch
    texts: list[list[str]]
    generation: Generation


def pad_prompts(prompt_tokens: Sequence[Sequence[int]], cap: int = 0):
    """Right-pad prompts to a bucketed common length: (`[B, P]` int32, lengths `[B]` int32).

    P is `engine.buckets.bucket` of the longest (at least `cap`), so batches of
    similar prompts share one compiled training step.
    """
    P = max(cap, bucket(max(len(t) for t in prompt_tokens)))
    out = np.zeros((len(prompt_tokens), P), np.int32)
    for i, t in enumerate(prompt_tokens):
        out[i, :len(t)] = t
    return out, np.asarray([len(t) for t in prompt_tokens], np.int32)


def stop_array(lm, stop_token_ids=()) -> np.ndarray:
    """`[MAX_STOP_IDS]` int32: the tokenizer's end ids and `stop_token_ids`, sorted, -1 padded."""
    return pad_stop_ids(sorted(set(lm.tokenizer.eos_token_ids) | set(stop_token_ids)),
                        size=MAX_STOP_IDS)


def completion_mask(batch: Batch) -> jax.Array:
    """`[B, N, T]` bool: position t of branch n is a sampled token (t < lengths)."""
    T = batch.completions.shape[-1]
    return jnp.arange(T) < batch.lengths[..., None]


def pack(prompt: jax.Array, prompt_len: jax.Array, completions: jax.Array,
         lengths: jax.Array) -> jax.Array:
    """Each branch as one sequence: its prompt, then its completion right after it.

    Args:
      prompt: `[B, P]` int32 right-padded; prompt_len: `[B]` int32;
      completions: `[B, N, T]` int32; lengths: `[B, N]` int32.
    Returns:
      `[B, N, P + T]` int32: position j holds prompt token j for j < prompt_len,
      completion token j - prompt_len below prompt_len + lengths, 0 after
      (padding that no earlier position sees).
    """
    B, P = prompt.shape
    T = completions.shape[-1]
    j = jnp.arange(P + T)
    pl = prompt_len[:, None, None]
    t = j[None, None] - pl  # [B, 1, S] completion index of position j
    comp = jnp.take_along_axis(completions, jnp.broadcast_to(jnp.clip(t, 0, T - 1),
                                                             completions.shape[:2] + j.shape), -1)
    comp = jnp.where((t >= 0) & (t < lengths[..., None]), comp, 0)
    prm = jnp.pad(prompt, ((0, 0), (0, T)))[:, None, :]
    return jnp.where(j < pl, prm, comp)


def completion_logprobs(model, params, batch: Batch, temperature: float = 1.0,
                        chunk_size: int | None = None) -> jax.Array:
    """`[B, N, T]` float32 log-probabilities of the completions under `params`, 0 at
    padding: `group_token_logprobs` (each prompt run once for its N branches), the
    numbers `token_logprobs` gives for the `pack`ed sequences. A pure function of
    `params`, differentiable."""
    mask = completion_mask(batch)
    comp = jnp.where(mask, batch.completions, 0)  # padding ids need not be in the vocabulary
    lp = group_token_logprobs(model, params, batch.prompt, batch.prompt_len, comp,
                              temperature=temperature, chunk_size=chunk_size)
    return jnp.where(mask, lp, 0.0)


_FILTERS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": ()}


def check_sampling(sampling_params: SamplingParams) -> SamplingParams:
    """The rollout's SamplingParams, or an InputError naming what it cannot report.

    The behaviour log-probabilities must be those of the sampling
    distribution: temperature > 0, no filters, penalties or logit bias.
    """
    if not isinstance(sampling_params, SamplingParams):
        raise InputError(f"sampling_params must be a SamplingParams, got "
                         f"{type(sampling_params).__name__}")
    check_temperature(sampling_params.temperature, "sampling_params.temperature")
    changed = [f"{k}={getattr(sampling_params, k)!r}" for k, v in _FILTERS.items()
               if getattr(sampling_params, k) != v]
    if changed:
        raise InputError(f"rollout: sampling_params sets {', '.join(changed)}; the behaviour "
                         "log-probabilities are softmax(logits / temperature) only, so filters, "
                         "penalties and logit bias are refused")
    return sampling_params


def rollout(engine: Any, params, prompts, group_size: int, sampling_params: SamplingParams, *,
            chat: bool = False, prompt_index_offset: int = 0, bridge=None,
            prompt_cap: int = 0) -> Rollout:
    """Sample `group_size` branches of each prompt with `params` (a GRPO group each).

    Args:
      engine: a `jaxsample.LanguageModel` or an engine holding one in `.lm`
        (and its device mesh in `.mesh`, as `jaxsample.LLM`); its weights are
        replaced by `params` for this call (not reloaded).
      params: the weights to sample with (the model's pytree layout).
      prompts: B prompts, as `jaxsample.generate` takes them.
      group_size: N, branches per prompt (an int >= 1).
      sampling_params: temperature, max_tokens, seed, stop ids and strings;
        `n` is set to `group_size`. No filters or penalties (see the module
        docstring).
      chat: render the prompts through the chat template.
      prompt_index_offset: the first prompt's global index (keys, as `generate`).
      bridge: optional `jaxsample.bridge.Bridge` (cross-branch layers).
      prompt_cap: the least prompt width P of the batch.
    Returns:
      A `Rollout`: `batch.behaviour` holds the behaviour log-probabilities,
      `batch.advantages` zeros.
    Raises:
      InputError: a bad group_size or sampling_params, and whatever
        `jaxsample.generate` refuses, before any compute.
    """
    lm = language_model(engine)
    sp = check_sampling(sampling_params)
    if isinstance(group_size, (bool, np.bool_)) or not isinstance(
            group_size, (int, np.integer)) or group_size < 1:
        raise InputError(f"group_size must be an int >= 1 (branches per prompt), "
                         f"got {group_size!r}")
    mode = "raw_logprobs" if sp.temperature == 1.0 else "processed_logprobs"
    sp = sp.replace(n=int(group_size), logprobs_mode=mode)
    if isinstance(engine, LLM):
        if params is not engine.params:
            engine.update_weights(params)
        gen = run_generate(engine.lm, prompts, sp, chat=chat, mesh=engine.mesh, bridge=bridge,
                           prompt_index_offset=prompt_index_offset,
                           max_kv_bytes=engine.max_kv_bytes, attention=engine.attention)
    else:
        model = lm if params is lm.params else dataclasses.replace(lm, params=params)
        gen = generate(model, prompts, sp, chat=chat, prompt_index_offset=prompt_index_offset,
                       bridge=bridge, mesh=getattr(engine, "mesh", None))
    prompt, prompt_len = pad_prompts(gen.prompt_tokens, prompt_cap)
    batch = Batch(prompt=jnp.asarray(prompt), prompt_len=jnp.asarray(prompt_len),
                  completions=jnp.asarray(gen.tokens), lengths=jnp.asarray(gen.lengths),
                  advantages=jnp.zeros(gen.lengths.shape, jnp.float32),
                  stop_ids=jnp.asarray(stop_array(lm, sp.stop_token_ids)),
                  behaviour=jnp.asarray(gen.logprobs, jnp.float32))
    return Rollout(batch=batch, texts=gen.texts, generation=gen)
