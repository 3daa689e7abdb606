"""Training Bridge layers: frozen base model, GRPO-style RL with verifiable rewards.

Recipe (Dong et al., "Generalized Parallel Scaling with Interdependent
Generations", arXiv 2510.01143; GRPO: Shao et al. 2024, arXiv 2402.03300):

1. (optional) supervised warm-up on groups of correct samples;
2. RL: per problem, sample N Bridge-coupled branches with
   `jaxsample.engine.generate(..., bridge=...)`; reward 1 if the extracted
   final answer equals the reference, else 0; group-relative advantage
   A_n = (r_n - mean(r)) / (std(r) + eps); token-level normalised
   policy-gradient loss

       loss = - sum_{g,n,t} A_{g,n} log pi(c_{g,n,t}) / sum_{g,n,t} 1[t < len_{g,n}]

   One gradient step per batch of fresh samples (on-policy), so the
   importance ratio is exactly 1 and needs no clipping, and we add no KL term
   (the base model is frozen and the Bridge starts as an exact no-op).
   A batch in which no group has any reward variance has all advantages 0,
   hence zero gradient; by default (`skip_no_signal`) such a step leaves the
   params and the optimizer state untouched. Otherwise Adam would keep
   moving the params along its momentum on a zero gradient (after one real
   update at lr, the next ~10 zero-gradient steps move every entry by about
   4 x lr more, in the same direction).

The base weights are never updated: gradients are taken with respect to the
Bridge parameters only (and `gate` sits behind `stop_gradient`).

Teacher-forced group forward (`group_forward`): for one prompt and N
completions, the model runs over prompt + completion for the N branches,
vmapped with `axis_name="branch"`, Bridge blocks coupling branches at the
same position, exactly like decode: at completion position t branch n is a
key for the others iff t < len_n and c_{n,t} is not a stop token (decode
marks a branch done right after it samples its stop token). At prompt
positions every branch holds the same state, as in the prefill (tested).

Checkpoints (orbax `CheckpointManager`): Bridge params, optimizer state, step
(`state`), and JSON metadata (`meta`): the base model's name and parameter
fingerprint, and the Bridge config. `train` resumes from the latest step in
`ckpt_dir`; rollout keys and problem order depend only on (seed, step), so
an interrupted-and-resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.sampling import SamplingParams
from jaxsample.sharding import BRANCH_AXIS
from jaxsample.models import llama

__all__ = ["Problem", "TrainState", "Batch", "group_forward", "group_logprobs", "pg_loss",
           "make_optimizer", "init_state", "update", "rollout", "reward", "train",
           "fingerprint", "save", "restore", "latest_step"]


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
    P, T = prompt.shape[0], completions.shape[1]
    S = P + T
    s = jnp.arange(S)
    rel = s - prompt_len  # completion index at position s
    in_prompt = s < prompt_len
    comp = completions[:, jnp.clip(rel, 0, T - 1)]  # [N, S]
    tokens = jnp.where(in_prompt[None], prompt[jnp.clip(s, 0, P - 1)][None], comp)
    t = jnp.arange(T)
    is_stop = jnp.any(completions[..., None] == stop_ids[None, None, :], axis=-1)  # [N, T]
    comp_alive = (t[None] < lengths[:, None]) & ~is_stop  # [N, T]
    alive = jnp.where(in_prompt[None], True,
                      comp_alive[:, jnp.clip(rel, 0, T - 1)] & (rel < T)[None])
    hidden, _ = group_forward(cfg, base_params, bconfig, bparams, tokens, alive)
    # Position prompt_len - 1 + t predicts completion token t.
    hidden = jax.lax.dynamic_slice_in_dim(hidden, prompt_len - 1, T, axis=1)  # [N, T, E]
    lg = llama.logits(cfg, base_params, hidden)[..., :vocab_limit]
    lp = jax.nn.log_softmax(lg / temperature, axis=-1)
    lp = jnp.take_along_axis(lp, completions[..., None], axis=-1)[..., 0]
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
# Rollouts with verifiable rewards


@dataclasses.dataclass(frozen=True)
class Problem:
    """A verifiable problem: the prompt text (a user turn) and the reference answer."""

    prompt: str
    answer: str


_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def reward(text: str, answer: str) -> float:
    """1.0 if the final number in `text` equals `answer`, else 0.0.

    Uses `jaxsample.answers.extract(text, "number")` and `normalize` (last
    number in the text; GSM8K / "the answer is" conventions handled there).
    """
    try:
        from jaxsample import answers
        got = answers.extract(text, "number")
        return float(got is not None and got == answers.normalize(answer))
    except ImportError:  # pragma: no cover - answers is part of the package
        nums = _NUM_RE.findall(text)
        return float(bool(nums) and nums[-1] == answer)


def _pad_to(x: np.ndarray, size: int, axis: int, value) -> np.ndarray:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad, constant_values=value)


def rollout(lm, bridge, problems: Sequence[Problem], n: int, seed: int, max_new_tokens: int,
            temperature: float = 1.0, chat: bool = True, eps: float = 1e-6, prompt_cap: int = 0,
            reward_fn: Callable[[str, Problem], float] | None = None, stop_token_ids=()):
    """Sample n coupled branches per problem and score them.

    Args:
      reward_fn: `f(text, problem) -> float`; default `reward(text, problem.answer)`.
      stop_token_ids: extra stop ids (besides the tokenizer's end-of-text ids).

    Returns:
      (Batch with group-normalised advantages, rewards `[G, N]` float32, Generation).
    """
    gen = engine.generate(lm, [p.prompt for p in problems],
                          SamplingParams(n=n, temperature=temperature,
                                         max_new_tokens=max_new_tokens, seed=seed,
                                         stop_token_ids=tuple(stop_token_ids)),
                          chat=chat, bridge=bridge)
    reward_fn = reward_fn or (lambda text, p: reward(text, p.answer))
    rewards = np.array([[reward_fn(t, p) for t in row]
                        for row, p in zip(gen.texts, problems)], np.float32)
    adv = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + eps)
    P = max(prompt_cap, engine.bucket(max(len(t) for t in gen.prompt_tokens)))
    prompt = np.stack([_pad_to(np.asarray(t, np.int32), P, 0, 0) for t in gen.prompt_tokens])
    stop = sorted(set(lm.tokenizer.eos_token_ids) | set(stop_token_ids))
    stop_ids = np.asarray(stop + [-1] * (engine.MAX_STOP_IDS - len(stop)), np.int32)
    batch = Batch(prompt=jnp.asarray(prompt),
                  prompt_len=jnp.asarray([len(t) for t in gen.prompt_tokens], jnp.int32),
                  completions=jnp.asarray(gen.tokens), lengths=jnp.asarray(gen.lengths),
                  advantages=jnp.asarray(adv), stop_ids=jnp.asarray(stop_ids))
    return batch, rewards, gen


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


# ---------------------------------------------------------------------------
# The loop


def train(lm, bridge: bridge_lib.Bridge, problems: Sequence[Problem], *, steps: int,
          n: int = 4, groups: int = 2, max_new_tokens: int = 16, temperature: float = 1.0,
          learning_rate: float = 1e-3, seed: int = 0, ckpt_dir: str | None = None,
          save_every: int = 10, sft_steps: int = 0, log: Callable[[str], None] | None = print,
          stop_after: int | None = None, chat: bool = True,
          reward_fn: Callable[[str, Problem], float] | None = None, stop_token_ids=(),
          skip_no_signal: bool = True):
    """GRPO-style training of the Bridge (base frozen), resumable from `ckpt_dir`.

    Step s uses problems chosen by `fold_in(key(seed), s)` and rollout seed
    `seed * 1_000_003 + s`, so the run is a function of (seed, step): resuming
    from a checkpoint at step s continues exactly as the uninterrupted run.
    Steps `< sft_steps` are the supervised warm-up: advantage 1 on the correct
    samples of each group, 0 on the others (groups without a correct sample
    contribute nothing).

    Args:
      problems: the training problems.
      steps: total optimizer steps (including the warm-up).
      n: branches per problem; groups: problems per step.
      ckpt_dir: orbax checkpoint directory; resumes from its latest step.
      save_every: checkpoint period in steps (and at the end).
      stop_after: stop (after saving) once this step is reached: simulates an
        interruption in tests.
      chat, reward_fn, stop_token_ids: passed to `rollout`.
      skip_no_signal: a step whose advantages are all 0 (no group with reward
        variance; in the warm-up: no correct sample) only advances the step
        counter: params and optimizer state are unchanged (no Adam momentum
        step on a zero gradient). False applies the optimizer anyway (the
        behaviour before this option existed).
    Returns:
      (Bridge with the trained params, TrainState, history: list of per-step dicts
      with step, loss, mean reward, tokens, grad_norm, seconds, phase, the number
      of groups with a nonzero advantage (`signal_groups`) and `skipped`).
    """
    optimizer = make_optimizer(learning_rate)
    state = init_state(bridge, optimizer)
    base_fp = fingerprint(lm.params) if ckpt_dir else None
    if ckpt_dir and latest_step(ckpt_dir) is not None:
        state, meta = restore(ckpt_dir, state, lm, bridge.config, base_fingerprint=base_fp)
        if log:
            log(f"resumed from {ckpt_dir} at step {int(state.step)}")
    history = []
    key = jax.random.key(seed)
    while int(state.step) < steps:
        s = int(state.step)
        t0 = time.perf_counter()
        idx = np.asarray(jax.random.choice(jax.random.fold_in(key, s), len(problems), (groups,),
                                           replace=False))
        chosen = [problems[i] for i in idx]
        current = bridge.replace_params(state.params)
        batch, rewards, _ = rollout(lm, current, chosen, n, seed * 1_000_003 + s,
                                    max_new_tokens, temperature, chat=chat, reward_fn=reward_fn,
                                    stop_token_ids=stop_token_ids)
        if s < sft_steps:
            batch = batch._replace(advantages=jnp.asarray(rewards))
        signal = int(np.sum(np.any(np.asarray(batch.advantages) != 0, axis=1)))
        skipped = skip_no_signal and signal == 0
        if skipped:
            state = state._replace(step=state.step + 1)
            m = {"loss": 0.0, "tokens": int(np.asarray(batch.lengths).sum()), "grad_norm": 0.0}
        else:
            state, m = update(optimizer, lm, bridge.config, state, batch, temperature)
        rec = {"step": s + 1, "loss": float(m["loss"]), "reward": float(rewards.mean()),
               "tokens": int(m["tokens"]), "grad_norm": float(m["grad_norm"]),
               "seconds": time.perf_counter() - t0, "phase": "sft" if s < sft_steps else "rl",
               "signal_groups": signal, "skipped": bool(skipped)}
        history.append(rec)
        if log:
            log(json.dumps(rec))
        done = int(state.step)
        if ckpt_dir and (done % save_every == 0 or done == steps or done == stop_after):
            save(ckpt_dir, state, lm, bridge.config, base_fingerprint=base_fp)
        if stop_after is not None and done >= stop_after:
            break
    return bridge.replace_params(state.params), state, history
