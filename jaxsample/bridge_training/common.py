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

This module: the teacher-forced forward both phases differentiate, and the
Bridge as a policy of the GRPO loop (`bridge_policy`; the loop, its loss,
optimizer step and orbax checkpoints are `jaxsample.training`'s). The base
weights are never updated:
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

import jax
import jax.numpy as jnp

from jaxsample import bridge as bridge_lib
from jaxsample.models.families import llama
from jaxsample.sharding import BRANCH_AXIS
from jaxsample.training import checkpoints, grpo
from jaxsample.training.checkpoints import TrainState, fingerprint, latest_step
from jaxsample.training.grpo import make_optimizer
from jaxsample.training.rollout import Batch, pad_prompts, rollout, stop_array

__all__ = ["Problem", "TrainState", "Batch", "group_forward", "shared_prefix_forward",
           "group_logprobs", "batch_logprobs", "pg_loss", "bridge_policy", "make_optimizer",
           "init_state", "update", "fingerprint", "save", "restore", "latest_step", "pad_prompts",
           "stop_array", "completion_alive"]

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
      `models.families.llama.logits` to the positions you need; (k, v) `[N, L, S, K, D]` each).
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
# Loss, optimizer, state: the GRPO loop's (`jaxsample.training`) with the Bridge's policy


def batch_logprobs(cfg: llama.LlamaConfig, vocab_limit: int, bconfig, bparams, base_params,
                   batch: Batch, temperature: float = 1.0) -> jax.Array:
    """`[G, N, T]` float32 `group_logprobs` of every group of `batch` (0 at padding)."""
    return jax.vmap(lambda p, pl, c, n: group_logprobs(
        cfg, base_params, bconfig, bparams, p, pl, c, n, batch.stop_ids, vocab_limit,
        temperature))(batch.prompt, batch.prompt_len, batch.completions, batch.lengths)


def pg_loss(bparams, cfg, base_params, bconfig, batch: Batch, vocab_limit: int,
            temperature: float = 1.0):
    """Token-level normalised policy-gradient loss (GRPO with ratio 1, no KL:
    `training.grpo.grpo_loss(..., importance_ratio=False)`).

    With all advantages 1 this is the supervised (SFT) loss on the completions.

    Returns:
      (loss `[]` float32, number of completion tokens `[]`).
    """
    lp = batch_logprobs(cfg, vocab_limit, bconfig, bparams, base_params, batch, temperature)
    loss, metrics = grpo.grpo_loss(lp, batch, importance_ratio=False)
    return loss, metrics["tokens"]


def bridge_policy(lm, bridge: bridge_lib.Bridge) -> grpo.Policy:
    """The Bridge (or MLP-control) parameters of `bridge` as the GRPO loop's policy,
    the base model frozen: rollouts sample with the Bridge coupling the branches,
    log-probabilities come from `group_logprobs`."""
    bconfig = bridge.config

    def logprobs(bparams, base_params, batch, temperature):
        return batch_logprobs(lm.config, lm.vocab_limit, bconfig, bparams, base_params, batch,
                              temperature)

    def sample(bparams, prompts, group_size, sp, chat):
        return rollout(lm, lm.params, prompts, group_size, sp, chat=chat,
                       bridge=bridge.replace_params(bparams))

    return grpo.Policy(params=bridge.params, frozen=lm.params, logprobs=logprobs, sample=sample,
                       key=("bridge", lm.config, lm.vocab_limit, bconfig),
                       meta=lambda: _meta(lm, bconfig))


def init_state(bridge: bridge_lib.Bridge, optimizer) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), bridge.params, optimizer.init(bridge.params))


def update(optimizer, lm, bconfig, state: TrainState, batch: Batch, temperature: float = 1.0):
    """One jitted optimizer step of `pg_loss` on a batch; returns (new state, metrics dict
    with loss, tokens, grad_norm). Pass the same optimizer object on every call."""
    policy = bridge_policy(lm, bridge_lib.Bridge(bconfig, state.params))
    return grpo.update(policy, optimizer, state, batch, temperature=temperature,
                       importance_ratio=False)


# ---------------------------------------------------------------------------
# Checkpoints (orbax, `training.checkpoints`)


def _meta(lm, bconfig, extra: dict | None = None, base_fingerprint: str | None = None) -> dict:
    return {"base_model": lm.name, "base_fingerprint": base_fingerprint or fingerprint(lm.params),
            "bridge_config": bconfig.to_dict(), "extra": extra or {}}


def save(ckpt_dir: str, state: TrainState, lm, bconfig: bridge_lib.BridgeConfig,
         extra: dict | None = None, base_fingerprint: str | None = None) -> int:
    """Save `state` at step `int(state.step)`; returns that step.

    Layout: `<ckpt_dir>/<step>/state` (orbax StandardSave of params, opt_state,
    step) and `<ckpt_dir>/<step>/meta` (JSON: base model name and fingerprint,
    Bridge config, `extra`, step).
    """
    return checkpoints.save(ckpt_dir, state, _meta(lm, bconfig, extra, base_fingerprint))


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
    state, meta = checkpoints.restore(ckpt_dir, target, step)
    step = meta["step"]
    want_fp = base_fingerprint or fingerprint(lm.params)
    if meta["base_fingerprint"] != want_fp:
        raise ValueError(f"{ckpt_dir} step {step}: trained on base model {meta['base_model']!r} "
                         f"with fingerprint {meta['base_fingerprint'][:12]}, this model "
                         f"({lm.name!r}) has {want_fp[:12]}")
    if bridge_lib.BridgeConfig.from_dict(meta["bridge_config"]) != bconfig:
        raise ValueError(f"{ckpt_dir} step {step}: Bridge config {meta['bridge_config']} "
                         f"differs from {bconfig.to_dict()}")
    return state, meta
