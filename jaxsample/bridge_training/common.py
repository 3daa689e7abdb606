"""Training Bridge layers, the shared pieces: teacher-forced group forward, loss, state, checkpoints.

Recipe (Dong et al., "Generalized Parallel Scaling with Interdependent
Generations", arXiv 2510.01143; GRPO: Shao et al. 2024, arXiv 2402.03300),
data flow by module:

1. `jaxsample.bridge_training.sft`: supervised warm-up of the Bridge parameters only,
   on groups of correct samples the base model drew for the same problem
   (wrong ones dropped, groups with at most one correct sample dropped), the
   whole group teacher-forced together so the cross-branch attention is
   trained;
2. `jaxsample.bridge_training.grpo`: RL: per problem, sample N Bridge-coupled branches
   with `jaxsample.engine.generate(..., bridge=...)`, score them (per sample,
   or per group for coordination tasks), group-relative advantage
   A_n = (r_n - mean(r)) / (std(r) + eps), token-level normalised
   policy-gradient loss

       loss = - sum_{g,n,t} A_{g,n} log pi(c_{g,n,t}) / sum_{g,n,t} 1[t < len_{g,n}]

   (`pg_loss`; with A = 1 on kept samples and 0 on padding it is the SFT loss).

This module: the teacher-forced forward both phases differentiate, the loss,
the optimizer step and orbax checkpoints. The base weights are never updated:
gradients are taken with respect to the Bridge (or MLP-control) parameters
only, and `gate` sits behind `stop_gradient`.

Teacher-forced group forward: for one prompt and N completions, the model
runs over prompt + completion for the N branches, vmapped with
`axis_name="branch"`, Bridge blocks coupling branches at the same position,
exactly like decode: at completion position t branch n is a key for the
others iff t < len_n and c_{n,t} is not a stop token (decode marks a branch
done right after it samples its stop token). At prompt positions every branch
holds the same state, so `group_logprobs` runs the prompt once
(`shared_prefix_forward`: the prefill's decomposition, prompt keys/values
shared by the N completions and merged by log-sum-exp); `group_forward`, the
plain N-copy forward, is its test oracle.

Checkpoints (orbax `CheckpointManager`): Bridge params, optimizer state, step
(`state`), and JSON metadata (`meta`): the base model's name and parameter
fingerprint, and the Bridge config. The training loops resume from the
latest step in their `ckpt_dir`; rollout keys and problem order depend only
on (seed, step), so an interrupted-and-resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.sharding import BRANCH_AXIS
from jaxsample.models import llama

__all__ = ["Problem", "TrainState", "Batch", "group_forward", "shared_prefix_forward",
           "group_logprobs", "pg_loss", "make_optimizer", "init_state", "update", "fingerprint",
           "save", "restore", "latest_step", "pad_prompts", "stop_array", "completion_alive"]

@dataclasses.dataclass(frozen=True)
class Problem:
    """A verifiable problem: the prompt text and the reference answer (task-defined)."""

    prompt: str
    answer: str


# ---------------------------------------------------------------------------
# Teacher-forced group forward


def group_forward(cfg: llama.LlamaConfig, base_params, bconfig: bridge_lib.BridgeConfig,
                  bparams, tokens: jax.Array, alive: jax.Array):
    """Causal forward of N branches of one prompt, coupled by Bridge blocks.

    Args:
      tokens: `[N, S]` int32, each branch's prompt + completion (same prompt, so
        position s is the same position in every branch).
      alive: `[N, S]` bool, branch n is a Bridge key for the others at position s.
      bparams: Bridge params (leaves `[L, ...]`), or None for the base model.
    Returns:
      (hidden `[N, S, E]` after the last block, before the final norm: apply
      `models.llama.logits` to the positions you need; (k, v) `[N, L, S, K, D]` each).
    """
    S = tokens.shape[1]
    positions = jnp.arange(S, dtype=jnp.int32)

    def one(toks, al):
        x = llama.embed(base_params, toks)
        post = None
        if bparams is not None:
            post = lambda h, p_l: bridge_lib.apply_block(bconfig, p_l, h, al, (BRANCH_AXIS,))
        x, kv = llama.run_layers(cfg, base_params, x, positions, lambda _: llama.causal_attend(),
                                 post_layer=post, post_xs=bparams)
        return x, kv

    return jax.vmap(one, axis_name=BRANCH_AXIS)(tokens, alive)


def tail_attend(kp, vp, prompt_len, scale):
    """Attention of T completion queries over the shared prompt (keys < prompt_len)
    and their own causal tail, merged by log-sum-exp (as in the engine's decode)."""

    def attend(q, k, v):
        T, P = q.shape[0], kp.shape[0]
        pre_mask = jnp.broadcast_to(jnp.arange(P)[None, :] < prompt_len, (T, P))
        pre = llama.partial_attention(q, kp.transpose(1, 0, 2), vp.transpose(1, 0, 2), pre_mask,
                                      scale)
        pos = jnp.arange(T)
        own = llama.partial_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2),
                                      pos[None, :] <= pos[:, None], scale)
        return llama.merge_attention([pre, own]).astype(q.dtype)

    return attend


def shared_prefix_forward(cfg: llama.LlamaConfig, base_params, bconfig, bparams, prompt: jax.Array,
                          prompt_len: jax.Array, completions: jax.Array, alive: jax.Array,
                          post_maker=None):
    """`group_forward` with the prompt run once: the same numbers at about 1/N the prompt cost.

    The prompt runs alone with each Bridge block seeing only its own copy
    (attention over N identical copies equals attention over one, as in the
    engine's prefill); the completions attend to its keys/values (shared, not
    copied) and to their own, and their Bridge blocks couple the branches.

    Args:
      prompt: `[P]` int32 right-padded prompt; prompt_len: `[]` int32 (>= 1).
      completions: `[N, T]` int32 tokens after the prompt (completion position t
        sits at absolute position prompt_len + t).
      alive: `[N, T]` bool, branch n is a Bridge key for the others at completion position t.
      bparams: Bridge params (leaves `[L, ...]`), or None for the base model.
      post_maker: optional `f(alive, axes) -> post_layer` replacing the Bridge hook
        (`jaxsample.bridge_training.diagnostics` records statistics through it).
    Returns:
      (prompt hidden `[P, E]`, completion hidden `[N, T, E]`), after the last block,
      before the final norm.
    """
    P, T = prompt.shape[0], completions.shape[1]
    scale = cfg.attention_scale

    def make_post(al, axes):
        if bparams is None:
            return None
        if post_maker is not None:
            return post_maker(al, axes)
        return lambda h, p_l: bridge_lib.apply_block(bconfig, p_l, h, al, axes)

    xp = llama.embed(base_params, prompt)
    hp, (kp, vp) = llama.run_layers(cfg, base_params, xp, jnp.arange(P, dtype=jnp.int32),
                                    lambda _: llama.causal_attend(prompt_len, scale=scale),
                                    post_layer=make_post(True, ()), post_xs=bparams)
    layer_kv = list(zip(kp, vp)) if isinstance(kp, (list, tuple)) else (kp, vp)
    positions = prompt_len + jnp.arange(T, dtype=jnp.int32)

    def one(toks, al):
        x = llama.embed(base_params, toks)
        x, _ = llama.run_layers(cfg, base_params, x, positions,
                                lambda lx: tail_attend(lx[0], lx[1], prompt_len, scale),
                                layer_xs=layer_kv, post_layer=make_post(al, (BRANCH_AXIS,)),
                                post_xs=bparams)
        return x

    return hp, jax.vmap(one, axis_name=BRANCH_AXIS)(completions, alive)


def completion_alive(completions: jax.Array, lengths: jax.Array, stop_ids: jax.Array):
    """`[N, T]` bool: branch n is a Bridge key at completion position t (t < len, not a stop)."""
    t = jnp.arange(completions.shape[1])
    is_stop = jnp.any(completions[..., None] == stop_ids[None, None, :], axis=-1)  # [N, T]
    return (t[None] < lengths[:, None]) & ~is_stop


def group_logprobs(cfg: llama.LlamaConfig, base_params, bconfig, bparams, prompt: jax.Array,
                   prompt_len: jax.Array, completions: jax.Array, lengths: jax.Array,
                   stop_ids: jax.Array, vocab_limit: int, temperature: float = 1.0):
    """Per-token logprobs of N completions of one prompt under the Bridge-coupled model.

    Args:
      prompt: `[P]` int32 prompt ids, right-padded; prompt_len: `[]` int32 (>= 1).
      completions: `[N, T]` int32 sampled ids (as `Generation.tokens[b]`).
      lengths: `[N]` int32 tokens generated per branch (stop token included).
      stop_ids: `[M]` int32 stop ids (-1 padded).
      vocab_limit: static, logits rows >= it are excluded (as in sampling).
      temperature: the policy is softmax(logits / temperature); 1.0 matches the
        engine's reported logprobs.
    Returns:
      `[N, T]` float32 log pi(c_{n,t} | prompt, c_{n,<t}, other branches), 0 at t >= len_n.
    """
    T = completions.shape[1]
    alive = completion_alive(completions, lengths, stop_ids)
    hp, hc = shared_prefix_forward(cfg, base_params, bconfig, bparams, prompt, prompt_len,
                                   completions, alive)
    # Position prompt_len - 1 predicts completion token 0; completion position t - 1 token t.
    first = jnp.broadcast_to(hp[prompt_len - 1], (hc.shape[0], 1, hc.shape[-1]))
    hidden = jnp.concatenate([first, hc[:, :T - 1]], axis=1)  # [N, T, E]
    lg = llama.logits(cfg, base_params, hidden)[..., :vocab_limit]
    lp = jax.nn.log_softmax(lg / temperature, axis=-1)
    lp = jnp.take_along_axis(lp, completions[..., None], axis=-1)[..., 0]
    t = jnp.arange(T)
    return jnp.where(t[None] < lengths[:, None], lp, 0.0)


# ---------------------------------------------------------------------------
# Loss, optimizer, state


class Batch(NamedTuple):
    """G groups (problems) of N sampled completions, padded to common shapes.

    prompt: `[G, P]` int32; prompt_len: `[G]` int32; completions: `[G, N, T]` int32;
    lengths: `[G, N]` int32; advantages: `[G, N]` float32; stop_ids: `[M]` int32.
    """

    prompt: jax.Array
    prompt_len: jax.Array
    completions: jax.Array
    lengths: jax.Array
    advantages: jax.Array
    stop_ids: jax.Array


def pad_prompts(prompt_tokens: Sequence[Sequence[int]], cap: int = 0):
    """Right-pad prompts to a bucketed common length: (`[G, P]` int32, lengths `[G]` int32)."""
    P = max(cap, engine.bucket(max(len(t) for t in prompt_tokens)))
    out = np.zeros((len(prompt_tokens), P), np.int32)
    for i, t in enumerate(prompt_tokens):
        out[i, :len(t)] = t
    return out, np.asarray([len(t) for t in prompt_tokens], np.int32)


def stop_array(lm, stop_token_ids=()) -> np.ndarray:
    """`[engine.MAX_STOP_IDS]` int32: the tokenizer's end ids and `stop_token_ids`, -1 padded."""
    stop = sorted(set(lm.tokenizer.eos_token_ids) | set(stop_token_ids))
    return np.asarray(stop + [-1] * (engine.MAX_STOP_IDS - len(stop)), np.int32)


class TrainState(NamedTuple):
    """step: `[]` int32; params: Bridge params; opt_state: optax state."""

    step: jax.Array
    params: Any
    opt_state: Any


def pg_loss(bparams, cfg, base_params, bconfig, batch: Batch, vocab_limit: int,
            temperature: float = 1.0):
    """Token-level normalised policy-gradient loss (GRPO with ratio 1, no KL).

    With all advantages 1 this is the supervised (SFT) loss on the completions.

    Returns:
      (loss `[]` float32, number of completion tokens `[]`).
    """
    lp = jax.vmap(lambda p, pl, c, n: group_logprobs(
        cfg, base_params, bconfig, bparams, p, pl, c, n, batch.stop_ids, vocab_limit,
        temperature))(batch.prompt, batch.prompt_len, batch.completions, batch.lengths)
    mask = jnp.arange(lp.shape[-1])[None, None] < batch.lengths[..., None]
    n_tok = jnp.maximum(jnp.sum(mask), 1)
    loss = -jnp.sum(batch.advantages[..., None] * lp * mask) / n_tok
    return loss, n_tok


@functools.lru_cache(maxsize=16)
def make_optimizer(learning_rate: float = 1e-3, clip_norm: float = 1.0):
    """Adam with global-norm clipping (cached: the same settings give the same object,
    so `update` compiles once). No weight decay: the frozen gates get zero gradients,
    hence zero Adam updates."""
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adam(learning_rate))


def init_state(bridge: bridge_lib.Bridge, optimizer) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), bridge.params, optimizer.init(bridge.params))


def _update(optimizer, cfg, bconfig, vocab_limit, temperature, base_params, state: TrainState,
            batch: Batch):
    (loss, n_tok), grads = jax.value_and_grad(pg_loss, has_aux=True)(
        state.params, cfg, base_params, bconfig, batch, vocab_limit, temperature)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(state.step + 1, params, opt_state), {
        "loss": loss, "tokens": n_tok, "grad_norm": optax.tree.norm(grads)}


_UPDATE_CACHE: dict[Any, Callable] = {}


def update(optimizer, lm, bconfig, state: TrainState, batch: Batch, temperature: float = 1.0):
    """One jitted optimizer step on a batch; returns (new state, metrics dict).

    The optimizer must be the same object across calls for the compile cache to hit.
    """
    key = (id(optimizer), lm.config, bconfig, lm.vocab_limit, float(temperature))
    fn = _UPDATE_CACHE.get(key)
    if fn is None:
        fn = jax.jit(lambda bp, s, b: _update(optimizer, lm.config, bconfig, lm.vocab_limit,
                                              temperature, bp, s, b))
        _UPDATE_CACHE[key] = fn
    return fn(lm.params, state, batch)


# ---------------------------------------------------------------------------
# Checkpoints (orbax)


def fingerprint(params) -> str:
    """A cheap, order-sensitive fingerprint of a parameter pytree (hex sha256).

    Hashes every leaf's path, shape, dtype, float64 sum, sum of squares and
    first 8 values: any reload of different weights changes it.
    """
    h = hashlib.sha256()
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(a)
        af = a.astype(np.float64).ravel()
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}|".encode())
        h.update(np.array([af.sum(), np.square(af).sum()]).tobytes())
        h.update(af[:8].tobytes())
    return h.hexdigest()


def _manager(ckpt_dir: str, max_to_keep: int = 3):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save(ckpt_dir: str, state: TrainState, lm, bconfig: bridge_lib.BridgeConfig,
         extra: dict | None = None, base_fingerprint: str | None = None) -> int:
    """Save `state` at step `int(state.step)`; returns that step.

    Layout: `<ckpt_dir>/<step>/state` (orbax StandardSave of params, opt_state,
    step) and `<ckpt_dir>/<step>/meta` (JSON: base model name and fingerprint,
    Bridge config, `extra`).
    """
    import orbax.checkpoint as ocp

    step = int(state.step)
    meta = {"base_model": lm.name, "base_fingerprint": base_fingerprint or fingerprint(lm.params),
            "bridge_config": bconfig.to_dict(), "step": step, "extra": extra or {}}
    mgr = _manager(ckpt_dir)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state._asdict()),
                                           meta=ocp.args.JsonSave(meta)), force=True)
    mgr.wait_until_finished()
    mgr.close()
    return step


def latest_step(ckpt_dir: str) -> int | None:
    """The latest saved step in `ckpt_dir`, or None."""
    if not os.path.isdir(ckpt_dir):
        return None
    mgr = _manager(ckpt_dir)
    step = mgr.latest_step()
    mgr.close()
    return step


def restore(ckpt_dir: str, target: TrainState, lm, bconfig: bridge_lib.BridgeConfig,
            step: int | None = None, base_fingerprint: str | None = None):
    """Restore a TrainState shaped like `target` (latest step by default).

    Returns:
      (TrainState, meta dict).
    Raises:
      FileNotFoundError: no checkpoint there.
      ValueError: the checkpoint was trained on another base model (fingerprint)
        or with another Bridge config.
    """
    import orbax.checkpoint as ocp

    mgr = _manager(ckpt_dir)
    step = mgr.latest_step() if step is None else step
    if step is None:
        mgr.close()
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
    tree = target._asdict()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                    meta=ocp.args.JsonRestore()))
    mgr.close()
    meta = got["meta"]
    want_fp = base_fingerprint or fingerprint(lm.params)
    if meta["base_fingerprint"] != want_fp:
        raise ValueError(f"{ckpt_dir} step {step}: trained on base model {meta['base_model']!r} "
                         f"with fingerprint {meta['base_fingerprint'][:12]}, this model "
                         f"({lm.name!r}) has {want_fp[:12]}")
    if bridge_lib.BridgeConfig.from_dict(meta["bridge_config"]) != bconfig:
        raise ValueError(f"{ckpt_dir} step {step}: Bridge config {meta['bridge_config']} "
                         f"differs from {bconfig.to_dict()}")
    # Re-impose the target's tree structure (optax NamedTuples come back as tuples).
    leaves = jax.tree_util.tree_leaves(got["state"])
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)
    return TrainState(**state), meta


