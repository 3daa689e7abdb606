"""The engine's typed state: the prefix cache, the decode state, the traced knobs.

Letters (see `models/families/llama.py`): R decode rows (prompts, or prompt copies in
the naive baseline), N branch slots per row, P prefix bucket, T tail bucket,
C common-context bucket (`generate(shared_prefix=...)`), L layers, K kv
heads, D head dim, V logits rows, k top logprobs per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxsample.lm import PREFIX_KV_DTYPES, check_switch
from jaxsample.models.quantization import quant
from jaxsample.sharding import BRANCH_AXIS

MAX_STOP_IDS = 16  # stop ids are a fixed-size traced array (padded with -1)


class PrefixCache(NamedTuple):
    """The prompts' KV cache, stored once (no branch axis).

    k, v: tuples of L arrays `[R, K, P_l, D]` in the model dtype, or float16 for a
      W8A8 model whose `LanguageModel.prefix_kv_dtype` is "auto" (`prefix_kv_dtype`); P_l = P, or the last min(P, w - 1)
      positions on a local layer of window w (per layer, so
      the unrolled layer loop reads each layer's cache without a slice copy;
      kv-head-major, the layout the attention matmuls read without a
      transpose); positions `>= lengths[r]` are padding.
    lengths: `[R]` int32 prompt lengths.
    """

    k: Any
    v: Any
    lengths: jax.Array


def prefix_kv_dtype(cfg, params, choice: str = "auto"):
    """The dtype the prefix KV cache is stored in, for a model whose
    `LanguageModel.prefix_kv_dtype` is `choice`: with "auto", float16 for a W8A8
    float32 model (`weights="int8"`, every quantised weight in mode "w8a8") whose
    decode step reads the prefix through `cpu_kernels.segment_attention`
    (`quant.uses_cpu_kernels(params)`: its weights allow the kernels and
    `cpu_kernels.active()`; every layer global, D a multiple of 8, no score soft-cap),
    else None (the model's dtype); with "model", always None.

    The step of a one-branch decode streams the whole prefix once per step: 47 MB in
    float32 for SmolLM2 at P = 1024, a third of its int8 weights' bytes; float16 halves
    it (as llama.cpp's default F16 KV cache), the kernel widening each element exactly
    as it reads it; the tails stay float32. The rounding to float16 (relative 2^-11;
    beyond +-65504 saturated, `prefill.stored_prefix`) moves W8A8's results about as
    much as any last-bit change does (W8A8 amplifies those: docs/benchmarks.md,
    "Int8 weights"), so it is tied to W8A8, the speed mode: weight-only int8
    (`"int8-weight-only"`), which reproduces to float32 rounding across meshes and
    batches, and float32 models keep their dtype. "model" keeps a W8A8 model's prefix
    float32 too (the exact oracle of its cached decode, the benchmarks' A/B).

    Raises:
      ConfigError: `choice` not one of `lm.PREFIX_KV_DTYPES`.
    """
    check_switch("prefix_kv_dtype", choice, PREFIX_KV_DTYPES)
    windows = getattr(cfg, "layer_windows", ())
    if (choice == "auto" and jnp.dtype(cfg.jnp_dtype) == jnp.float32
            and all(w is None for w in windows) and cfg.head_dim % 8 == 0
            and getattr(cfg.attention_scale, "softcap", None) is None
            and quant.modes(params) == {"w8a8"} and quant.uses_cpu_kernels(params)):
        return jnp.float16
    return None


class ContextCache(NamedTuple):
    """The KV cache of a context common to every prompt (`shared_prefix=`), stored
    once: neither a prompt (row) nor a branch axis (Hydragen's inter-request prefix).

    k, v: tuples of L arrays `[K, C_l, D]` in the model dtype (C_l = C, the
      context bucket, or the last min(C, w - 1) positions on a local layer of
      window w, as `PrefixCache`); positions `>= length` are padding.
    length: `[]` int32, the context's length in tokens. The rows' own
      prompts (`PrefixCache`) start at position `length`.
    """

    k: Any
    v: Any
    length: jax.Array


class PromptLogprobs(NamedTuple):
    """Prompt logprobs from the prefill (`SamplingParams.prompt_logprobs`).

    Entry i of a row is about prompt token i + 1 under the distribution that
    follows tokens 0..i (the raw logits at position i); entries `>= length - 1`
    are padding.

    logprobs: `[R, P]` float32; ranks: `[R, P]` int32 (vLLM's rank: tokens at
      least as likely); top_logprobs: `[R, P, k]` float32 and top_ids
      `[R, P, k]` int32, the k most likely tokens there.
    """

    logprobs: jax.Array
    ranks: jax.Array
    top_logprobs: jax.Array
    top_ids: jax.Array


class Outputs(NamedTuple):
    """What every slot records per token: `[R, N, T, ...]` (device) or, on the host,
    the same fields indexed by (round row, branch column, token).

    Every per-token output is a field here and nowhere else: compaction,
    slot moves, the host's copy of each chunk and the reset of a branch are
    `tree_map`s over it (`loop`, `round`), so a new output is one field, the
    step's write and the `Generation`'s read.

    tokens: `[R, N, T]` int32; logprobs: `[R, N, T]` float32 (the sampled
      token's, raw or processed: `SamplingParams.logprobs_mode`).
    top_logprobs: `[R, N, T, k]` float32 and top_ids `[R, N, T, k]` int32: the
      k most likely tokens of the raw distribution at each step (k = 0: empty).
    token_ranks: `[R, N, T]` int32 rank of each sampled token under the raw
      distribution (vLLM's `Logprob.rank`), with `Static.token_ranks`; else
      `[R, N, 0]`.
    signals: `[R, N, T, 3]` float32 per-token selection signals of the raw
      distribution (entropy, self-certainty, top-2 margin:
      `sampling.token_signals`; 0 after a slot is done), with
      `Static.signals`; else None, which is no pytree leaf at all, so the
      compiled programs without the option are those from before it existed.
    """

    tokens: Any
    logprobs: Any
    top_logprobs: Any
    top_ids: Any
    token_ranks: Any
    signals: Any = None

    def fill(self, pad_id: int) -> "Outputs":
        """The value of each field where nothing was written: the pad id for token
        ids, 0 elsewhere (the same structure, scalars at the leaves)."""
        return Outputs(pad_id, 0.0, 0.0, pad_id, 0, None if self.signals is None else 0.0)


class DecodeState(NamedTuple):
    """The resumable decode state: it lives across device calls (chunks).

    Each slot runs at its own token index, `lengths[r, n]` (per-slot
    positions: the pool refills a finished slot with a new branch between
    chunks, `loop.refill`, while the others continue; same shapes, so no
    recompilation). Its tail KV, its output columns, its penalty counts and
    min-tokens all follow that index, and its key folds it in. The host may
    mark slots done between chunks, refill them, gather the live slots into
    a smaller state (compaction) or start a new state over the same prefix
    cache (another round of branches).

    Every field but `t` and the row fields (`ROW_FIELDS`) has the slot axes
    `[R, N]` first (`SLOT_FIELDS`): gathering or moving slots maps one
    function over them.

    t: `[]` int32, the clock: steps this state has run (`knobs.t_stop` ends a
      chunk). When every slot started together, it is every live slot's
      token index.
    logits: `[R, N, V]` float32, each slot's distribution for its next token.
    out: the per-token `Outputs`, `[R, N, T, ...]`.
    lengths: `[R, N]` int32 tokens generated so far (stop token included): a
      live slot's next token index.
    done: `[R, N]` bool; stopped: `[R, N]` bool (ended by a stop token).
    prompt_index: `[R]` int32 key index of each row (for the keys).
    branch_ids: `[R, N]` int32 global branch index of each slot (for the keys):
      compaction moves a branch to another slot but keeps its key.
    tail_k, tail_v: tuples of L arrays `[R, N, K, T_l, D]`, the branches' own KV:
      T_l = T on global layers; on a local layer of window w a ring of
      min(T, w - 1) slots written at lengths mod T_l (`prefill.window_extent`).
    counts: `[R, N, V]` int32, how often each slot generated each token (for
      the frequency, presence and repetition penalties), with
      `Static.penalties`; else `[R, N, 0]`. Updated by one scatter per step;
      the size of the `logits` buffer the state already holds.
    prompt_mask: `[R, V]` bool, the tokens of each row's prompt (repetition
      penalty), shared by the row's slots (never copied N times), with
      `Static.penalties`; else `[R, 0]`.
    """

    t: jax.Array
    logits: jax.Array
    out: Outputs
    lengths: jax.Array
    done: jax.Array
    stopped: jax.Array
    prompt_index: jax.Array
    branch_ids: jax.Array
    tail_k: Any
    tail_v: Any
    counts: jax.Array
    prompt_mask: jax.Array


ROW_FIELDS = ("prompt_index", "prompt_mask")  # `[R, ...]`: one entry per row
SLOT_FIELDS = tuple(f for f in DecodeState._fields if f not in ROW_FIELDS + ("t",))
"""The `DecodeState` fields with the slot axes `[R, N]` first (every field but the
clock and the row fields)."""


class Knobs(NamedTuple):
    """Traced request settings, one entry per row: changing them never recompiles.

    Every field but `t_stop` has a leading row axis R (the rows of the decode
    state: each row holds one prompt, so each request carries its own
    settings into the one compiled program). The logits processors' settings
    (`sampling.process_logits`) are read only with `Static.processors`;
    `logit_bias` is then `[R, V]` (else `[R, 0]`).
    """

    temperature: jax.Array  # [R] float32
    top_k: jax.Array  # [R] int32
    top_p: jax.Array  # [R] float32
    min_p: jax.Array  # [R] float32
    seed: jax.Array  # [R] uint32: the key's seed (`step.branch_keys`)
    max_new_tokens: jax.Array  # [R] int32
    stop_ids: jax.Array  # [R, MAX_STOP_IDS] int32, -1 padded
    t_stop: jax.Array  # [] int32: this chunk ends when the clock DecodeState.t reaches it
    logit_bias: jax.Array  # [R, V] float32 (0 where none), or [R, 0] without processors
    min_tokens: jax.Array  # [R] int32
    min_stop_ids: jax.Array  # [R, MAX_STOP_IDS] int32, -1 padded: masked until min_tokens
    repetition_penalty: jax.Array  # [R] float32
    frequency_penalty: jax.Array  # [R] float32
    presence_penalty: jax.Array  # [R] float32
    processed_logprobs: jax.Array  # [R] bool: report the processed logprob (logprobs_mode)


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything that changes shapes or code, hence the compiled program."""

    cfg: Any  # the model config (models.families.llama.LlamaConfig)
    n: int  # branch slots per row held by one device
    t_cap: int  # tail buffer length (a bucket >= max_new_tokens)
    vocab_limit: int
    pad_id: int
    top_logprobs: int = 0  # k of SamplingParams.logprobs (0: none)
    axes: tuple[str, ...] = ()  # mesh axes to reduce "all done" over
    branch_axis: str = BRANCH_AXIS  # the vmap axis of the branches
    branch_axes: tuple[str, ...] = (BRANCH_AXIS,)  # all branch axes, innermost first
    bridge: Any = None  # a jaxsample.bridge.BridgeConfig, or None
    processors: bool = False  # run sampling.process_logits (bias, min-tokens, penalties)
    penalties: bool = False  # keep DecodeState.counts / prompt_mask (implies processors)
    token_ranks: bool = False  # record DecodeState.token_ranks (SamplingParams.logprobs set)
    signals: bool = False  # record DecodeState.signals (SamplingParams.signals)
    processed_logprobs: bool = False  # compute processed logprobs (some row's logprobs_mode)
    attention: str = "xla"  # the step's attention: "xla" or "pallas" (kernels.resolve_attention)

    def post_layer(self, alive, axes):
        """The Bridge hook for `llama.run_layers` (None without a Bridge)."""
        if self.bridge is None:
            return None
        from jaxsample import bridge as bridge_lib

        return lambda x, p_l: bridge_lib.apply_block(self.bridge, p_l, x, alive, axes)
