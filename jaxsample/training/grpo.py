"""GRPO on the engine: group rollouts, verifiable rewards, the clipped policy-gradient loss.

One step, by data flow:

    problems --choice(fold_in(key(seed), step))--> B problems
      --policy.sample (rollout.rollout: generate with the current weights,
        N branches per prompt sharing its prefix)--> Batch [B, N, T] + texts
      --reward(problem, text), or group_reward(problem, texts)--> rewards [B, N]
      --group_advantages--> A = (r - mean_n r) / (std_n r + eps)
      --updates_per_batch x (policy.logprobs -> grpo_loss -> optax)--> params
      --orbax, every save_every steps--> <ckpt_dir>/<step>

The loss is token-level (every completion token of the batch weighs the
same; DAPO, arXiv 2503.14476, and the Bridge recipe):

    r_t   = exp(log pi(c_t) - log pi_behaviour(c_t))
    loss  = -sum_t min(r_t A, clip(r_t, 1 - eps, 1 + eps) A) / tokens
            + kl_coef * sum_t (exp(d_t) - d_t - 1) / tokens,  d_t = log pi_ref(c_t) - log pi(c_t)

(PPO's clipped objective, Schulman et al. 2017, arXiv 1707.06347; GRPO's
group-relative advantage and KL estimator, Shao et al. 2024, arXiv
2402.03300, eq. 3-4). The behaviour log-probabilities are the rollout's
(`rollout.Batch.behaviour`); with `importance_ratio=False` the ratio is
taken as exactly 1, `loss = -sum_t A log pi(c_t) / tokens`, the on-policy
gradient of one update per batch (the Bridge recipe's loss).

What is trained is a `Policy`: its parameters, how it samples and how it
scores tokens. `lora_policy` trains low-rank adapters on a frozen base
(`training.lora`: merged for rollouts, unmerged for the gradient),
`full_policy` every weight; `jaxsample.bridge_training.grpo.bridge_policy`
the Bridge layers. The run is a function of (seed, step): step s trains on
the problems `choice(fold_in(key(seed), s))` with rollout seed
`seed * 1_000_003 + s`, so a run resumed from a checkpoint continues
exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsample.errors import InputError
from jaxsample.sampling_params import SamplingParams
from jaxsample.training import checkpoints
from jaxsample.training import lora as lora_lib
from jaxsample.training.checkpoints import TrainState
from jaxsample.training.logprobs import check_temperature, language_model
from jaxsample.training.rollout import Batch, completion_logprobs, completion_mask, rollout

__all__ = ["GRPOConfig", "Policy", "lora_policy", "full_policy", "group_advantages",
           "grpo_loss", "make_optimizer", "update", "train"]


def _int(name, v, lo):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
        raise InputError(f"GRPOConfig.{name} must be an int >= {lo}, got {v!r}")


def _real(name, v, lo, strict):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
            v <= lo if strict else v < lo):
        raise InputError(f"GRPOConfig.{name} must be a finite number {'>' if strict else '>='} "
                         f"{lo}, got {v!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The settings of a GRPO run.

    Attributes:
      steps: rollout steps in all (a resumed run stops there too).
      prompts_per_step: B, problems per step (drawn without replacement).
      group_size: N, branches per problem (the group of the advantage).
      max_tokens, temperature, stop_token_ids, stop: the rollout's sampling
        (`SamplingParams`; temperature > 0, see `rollout.rollout`).
      chat: render prompts through the chat template.
      learning_rate: of the default optimizer (`make_optimizer`).
      clip_eps: PPO's clip range eps (> 0).
      kl_coef: weight of the KL term to the reference policy (the initial
        parameters: for LoRA, the base model); 0 skips its forward pass.
      importance_ratio: True: the clipped ratio against the behaviour
        log-probabilities; False: ratio exactly 1 (needs updates_per_batch 1).
      updates_per_batch: optimizer updates on each rollout batch (GRPO's mu).
      scale_rewards: divide the centred rewards by their group's standard
        deviation (GRPO); False keeps r - mean (Dr. GRPO, arXiv 2503.20783).
      adv_eps: added to that standard deviation.
      sft_steps: steps before this use the rewards themselves as advantages
        (an on-policy supervised warm-up on the rewarded samples).
      skip_no_signal: a step whose advantages are all 0 (no group with reward
        variance) leaves params and optimizer state alone: Adam's momentum
        would otherwise keep moving the params on a zero gradient.
      seed: the data order and the rollouts' keys.
      save_every: checkpoint period in steps (and at the end).
      prompt_cap: the least padded prompt width P (fewer compiled shapes).
    Raises:
      InputError: on construction, a field outside these rules.
    """

    steps: int
    prompts_per_step: int = 4
    group_size: int = 8
    max_tokens: int = 32
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    chat: bool = False
    learning_rate: float = 1e-4
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    importance_ratio: bool = True
    updates_per_batch: int = 1
    scale_rewards: bool = True
    adv_eps: float = 1e-6
    sft_steps: int = 0
    skip_no_signal: bool = True
    seed: int = 0
    save_every: int = 10
    prompt_cap: int = 0

    def __post_init__(self):
        for name, lo in (("steps", 0), ("prompts_per_step", 1), ("group_size", 1),
                         ("max_tokens", 1), ("updates_per_batch", 1), ("sft_steps", 0),
                         ("seed", 0), ("save_every", 1), ("prompt_cap", 0)):
            _int(name, getattr(self, name), lo)
        check_temperature(self.temperature, "GRPOConfig.temperature")
        for name, lo, strict in (("learning_rate", 0, True), ("clip_eps", 0, True),
                                 ("kl_coef", 0, False), ("adv_eps", 0, False)):
            _real(name, getattr(self, name), lo, strict)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not self.importance_ratio and self.updates_per_batch != 1:
            raise InputError("GRPOConfig: importance_ratio=False (ratio exactly 1) holds for one "
                             "update per batch only, got updates_per_batch="
                             f"{self.updates_per_batch}")

    def sampling_params(self, step: int) -> SamplingParams:
        """The rollout's SamplingParams at `step` (its seed `seed * 1_000_003 + step`)."""
        return SamplingParams(n=self.group_size, temperature=self.temperature,
                              max_new_tokens=self.max_tokens, seed=self.seed * 1_000_003 + step,
                              stop_token_ids=self.stop_token_ids, stop=self.stop)


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """What a GRPO run trains.

    Attributes:
      params: the initial trained parameters (also the KL term's reference).
      frozen: arrays the policy reads but never trains (a base model's
        weights), passed to `logprobs` as an argument (a jitted closure would
        copy them into the program), or None.
      logprobs: `f(params, frozen, batch, temperature) -> [B, N, T]` float32,
        the completions' log-probabilities (0 at padding); pure, differentiable.
      sample: `f(params, prompts, group_size, sampling_params, chat) -> Rollout`.
      key: hashable, names `logprobs` with its static settings (compiled
        programs are shared between policies with equal keys).
      meta: `f() -> dict`, JSON: what a checkpoint of it must match (base
        model fingerprint, adapter config).
    """

    params: Any
    frozen: Any
    logprobs: Callable[..., jax.Array]
    sample: Callable[..., Any]
    key: Hashable
    meta: Callable[[], dict]


def _base_meta(lm) -> dict:
    return {"base_model": lm.name, "base_fingerprint": checkpoints.fingerprint(lm.params)}


def lora_policy(model, config: lora_lib.LoraConfig, *, seed: int = 0) -> Policy:
    """Low-rank adapters on the frozen weights of `model` (a LanguageModel or an engine).

    Rollouts sample with the adapters merged into the weights; the gradient
    runs them unmerged (`training.lora`). The adapters start with B = 0:
    the first rollout is the base model's, bit for bit.
    """
    lm = language_model(model)
    if not isinstance(config, lora_lib.LoraConfig):
        raise InputError(f"config must be a LoraConfig, got {type(config).__name__}")

    def logprobs(params, frozen, batch, temperature):
        return completion_logprobs(lm, lora_lib.apply(frozen, params, config), batch, temperature)

    def sample(params, prompts, group_size, sp, chat):
        return rollout(model, lora_lib.merge(lm.params, params, config), prompts, group_size, sp,
                       chat=chat)

    return Policy(params=lora_lib.init(lm.params, config, jax.random.key(seed)), frozen=lm.params,
                  logprobs=logprobs, sample=sample,
                  key=("lora", lm.config, lm.vocab_limit, config),
                  meta=lambda: {**_base_meta(lm), "adapter": {"kind": "lora", **config.to_dict()}})


def full_policy(model) -> Policy:
    """Every weight of `model` trained (full fine-tuning)."""
    lm = language_model(model)

    def logprobs(params, frozen, batch, temperature):
        return completion_logprobs(lm, params, batch, temperature)

    def sample(params, prompts, group_size, sp, chat):
        return rollout(model, params, prompts, group_size, sp, chat=chat)

    return Policy(params=lm.params, frozen=None, logprobs=logprobs, sample=sample,
                  key=("full", lm.config, lm.vocab_limit),
                  meta=lambda: {**_base_meta(lm), "adapter": {"kind": "full"}})


# ---------------------------------------------------------------------------
# Advantages and the loss


def group_advantages(rewards, *, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """`[B, N]` float32 group-relative advantages: `(r - mean r) / (std r + eps)` over
    each row's N branches (population std), or `r - mean r` without `scale`."""
    r = np.asarray(rewards, np.float32)
    if r.ndim != 2:
        raise InputError(f"rewards must be [B, N] (groups, branches), got shape {r.shape}")
    centred = r - r.mean(1, keepdims=True)
    return centred / (r.std(1, keepdims=True) + eps) if scale else centred


def grpo_loss(lp: jax.Array, batch: Batch, *, clip_eps: float = 0.2, kl_coef: float = 0.0,
              importance_ratio: bool = True):
    """The token-level clipped policy-gradient loss (the module docstring's formula).

    Args:
      lp: `[B, N, T]` the completions' log-probabilities under the trained policy.
      batch: advantages `[B, N]`; behaviour `[B, N, T]` (with importance_ratio);
        reference `[B, N, T]` (with kl_coef > 0).
      clip_eps, kl_coef, importance_ratio: static, as `GRPOConfig`.
    Returns:
      (loss `[]` float32, metrics: tokens, and with importance_ratio the
      fraction of tokens whose ratio was clipped and the largest |log ratio|,
      with kl_coef the mean KL estimate).
    """
    mask = completion_mask(batch)
    n_tok = jnp.maximum(jnp.sum(mask), 1)
    adv = batch.advantages[..., None]
    metrics = {"tokens": n_tok}
    if importance_ratio:
        if batch.behaviour is None:
            raise InputError("grpo_loss: importance_ratio needs batch.behaviour")
        log_ratio = lp - batch.behaviour
        ratio = jnp.exp(log_ratio)
        clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        per_token = jnp.minimum(ratio * adv, clipped * adv)
        metrics["clip_fraction"] = jnp.sum((ratio != clipped) & mask) / n_tok
        metrics["max_abs_log_ratio"] = jnp.max(jnp.where(mask, jnp.abs(log_ratio), 0.0))
    else:
        per_token = adv * lp
    loss = -jnp.sum(per_token * mask) / n_tok
    if kl_coef:
        if batch.reference is None:
            raise InputError("grpo_loss: kl_coef > 0 needs batch.reference")
        d = batch.reference - lp
        kl = jnp.sum((jnp.exp(d) - d - 1.0) * mask) / n_tok
        loss = loss + kl_coef * kl
        metrics["kl"] = kl
    return loss, metrics


@functools.lru_cache(maxsize=16)
def make_optimizer(learning_rate: float = 1e-4, clip_norm: float = 1.0):
    """Adam with global-norm gradient clipping (cached: equal settings give the same
    object, so the update compiles once)."""
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adam(learning_rate))


# (policy key, optimizer id, loss settings, temperature) -> (optimizer, jitted step)
_STEPS: dict[Any, tuple[Any, Callable]] = {}
_LOGPROBS: dict[Any, Callable] = {}


def _step_fn(policy: Policy, optimizer, settings: tuple, temperature: float):
    key = (policy.key, id(optimizer), settings, temperature)
    hit = _STEPS.get(key)
    if hit is not None and hit[0] is optimizer:
        return hit[1]
    clip_eps, kl_coef, importance_ratio = settings

    def step(params, opt_state, frozen, batch):
        def loss_fn(p):
            lp = policy.logprobs(p, frozen, batch, temperature)
            return grpo_loss(lp, batch, clip_eps=clip_eps, kl_coef=kl_coef,
                             importance_ratio=importance_ratio)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics}

    fn = jax.jit(step)
    _STEPS[key] = (optimizer, fn)
    return fn


def _logprobs_fn(policy: Policy, temperature: float):
    key = (policy.key, temperature)
    if key not in _LOGPROBS:
        _LOGPROBS[key] = jax.jit(lambda p, f, b: policy.logprobs(p, f, b, temperature))
    return _LOGPROBS[key]


def update(policy: Policy, optimizer, state: TrainState, batch: Batch, *, temperature: float = 1.0,
           clip_eps: float = 0.2, kl_coef: float = 0.0, importance_ratio: bool = True):
    """One jitted optimizer update of `state` on `batch`; returns (state with step + 1, metrics).

    The program is compiled once per (policy key, optimizer object, loss settings,
    temperature); pass the same optimizer object on every call.
    """
    fn = _step_fn(policy, optimizer, (float(clip_eps), float(kl_coef), bool(importance_ratio)),
                  float(temperature))
    params, opt_state, metrics = fn(state.params, state.opt_state, policy.frozen, batch)
    return TrainState(state.step + 1, params, opt_state), metrics


# ---------------------------------------------------------------------------
# The loop


def _prompt_of(problem):
    return getattr(problem, "prompt", problem)


def score(problems: Sequence[Any], texts: Sequence[Sequence[str]], reward=None,
          group_reward=None) -> np.ndarray:
    """`[B, N]` float32 rewards: `group_reward(problem, texts of its group)` if given,
    else `reward(problem, text)` per branch.

    Raises:
      ValueError: a group reward of another shape than `[N]`.
    """
    rows = []
    for p, row in zip(problems, texts):
        if group_reward is not None:
            r = np.asarray(group_reward(p, list(row)), np.float32)
            if r.shape != (len(row),):
                raise ValueError(f"group_reward returned shape {r.shape}, want ({len(row)},)")
        else:
            r = np.asarray([reward(p, t) for t in row], np.float32)
        rows.append(r)
    return np.stack(rows)


def train(policy: Policy, problems: Sequence[Any], config: GRPOConfig, *,
          reward: Callable[[Any, str], float] | None = None,
          group_reward: Callable[[Any, list[str]], Sequence[float]] | None = None,
          optimizer=None, ckpt_dir: str | None = None,
          log: Callable[[str], None] | None = print,
          on_step: Callable[[dict, TrainState], bool | None] | None = None,
          stop_after: int | None = None):
    """GRPO training of `policy`, resumable from `ckpt_dir`.

    Args:
      policy: `lora_policy`, `full_policy` or another `Policy`.
      problems: the training problems: prompts (str, token ids, chat messages)
        or objects with a `.prompt` (e.g. `Problem(prompt, answer)`).
      config: `GRPOConfig`.
      reward: `f(problem, completion text) -> float`, the verifiable reward.
      group_reward: `f(problem, texts of its N branches) -> [N]`, instead of
        `reward` (rewards that compare branches).
      optimizer: an optax GradientTransformation (default
        `make_optimizer(config.learning_rate)`); the same object on a resume.
      ckpt_dir: orbax directory; resumes from its latest step (refusing a
        checkpoint of another base model or adapter: ValueError).
      log: gets one JSON line per step (and a line on resuming); None: quiet.
      on_step: `f(record, state)` after every step (a benchmark's writer); a true
        return value ends the run there (after the step's checkpoint, if due).
      stop_after: stop (after saving) once this step is reached (tests).
    Returns:
      (trained params, TrainState, history: one dict per step with step, loss,
      reward (mean), tokens, grad_norm, seconds, rollout_s, logprobs_s,
      update_s, phase ("sft" / "rl"), signal_groups (groups with a nonzero
      advantage), skipped, and the loss's metrics).
    Raises:
      InputError: neither or both of reward / group_reward; fewer problems
        than prompts_per_step.
    """
    if (reward is None) == (group_reward is None):
        raise InputError("train: pass exactly one of reward= and group_reward=")
    if len(problems) < config.prompts_per_step:
        raise InputError(f"train: {len(problems)} problems, fewer than prompts_per_step "
                         f"({config.prompts_per_step})")
    optimizer = optimizer or make_optimizer(config.learning_rate)
    state, meta = _start(policy, optimizer, ckpt_dir, log)
    history = []
    key = jax.random.key(config.seed)
    while int(state.step) < config.steps:
        state, rec = _train_step(policy, problems, config, optimizer, state, key, reward,
                                 group_reward)
        history.append(rec)
        if log:
            log(json.dumps(rec))
        done = int(state.step)
        stop = on_step is not None and bool(on_step(rec, state))
        if ckpt_dir and (done % config.save_every == 0 or done == config.steps
                         or done == stop_after or stop):
            checkpoints.save(ckpt_dir, state, meta)
        if stop or (stop_after is not None and done >= stop_after):
            break
    return state.params, state, history


def _start(policy: Policy, optimizer, ckpt_dir, log):
    """(the TrainState to start from: fresh, or the latest of `ckpt_dir`'s checkpoints
    after checking it is of this base model and adapter; the policy's checkpoint meta)."""
    state = TrainState(jnp.zeros((), jnp.int32), policy.params, optimizer.init(policy.params))
    meta = policy.meta() if ckpt_dir else None
    if ckpt_dir and checkpoints.latest_step(ckpt_dir) is not None:
        checkpoints.check_meta(ckpt_dir, checkpoints.read_meta(ckpt_dir), meta)
        state, _ = checkpoints.restore(ckpt_dir, state)
        if log:
            log(f"resumed from {ckpt_dir} at step {int(state.step)}")
    return state, meta


def _train_step(policy: Policy, problems, config: GRPOConfig, optimizer, state: TrainState,
                key, reward, group_reward) -> tuple[TrainState, dict]:
    """One GRPO step: draw `prompts_per_step` problems, roll out `group_size` branches of
    each, score them, take the group advantages (the rewards themselves in the SFT
    phase), the behaviour and reference logprobs the loss needs, and
    `updates_per_batch` updates (none for a batch without signal with
    `skip_no_signal`). Returns the next state and the step's record."""
    s = int(state.step)
    T = config.temperature
    t0 = time.perf_counter()
    idx = np.asarray(jax.random.choice(jax.random.fold_in(key, s), len(problems),
                                       (config.prompts_per_step,), replace=False))
    chosen = [problems[i] for i in idx]
    got = policy.sample(state.params, [_prompt_of(p) for p in chosen], config.group_size,
                        config.sampling_params(s), config.chat)
    jax.block_until_ready(got.batch)
    t1 = time.perf_counter()
    generate_s = min(got.generation.timings.get("total", t1 - t0), t1 - t0)
    rewards = score(chosen, got.texts, reward, group_reward)
    adv = (rewards if s < config.sft_steps else
           group_advantages(rewards, scale=config.scale_rewards, eps=config.adv_eps))
    batch = got.batch._replace(advantages=jnp.asarray(adv))
    signal = int(np.sum(np.any(adv != 0, axis=1)))
    skipped = config.skip_no_signal and signal == 0
    if not skipped:
        lp_fn = _logprobs_fn(policy, T)
        if config.importance_ratio and batch.behaviour is None:
            batch = batch._replace(behaviour=lp_fn(state.params, policy.frozen, batch))
        if config.kl_coef:
            batch = batch._replace(reference=lp_fn(policy.params, policy.frozen, batch))
        jax.block_until_ready(batch)
    t2 = time.perf_counter()
    m = {"loss": 0.0, "grad_norm": 0.0, "tokens": int(np.asarray(batch.lengths).sum())}
    if skipped:
        state = state._replace(step=state.step + 1)
    else:
        settings = dict(clip_eps=config.clip_eps, kl_coef=config.kl_coef,
                        importance_ratio=config.importance_ratio)
        params, opt_state = state.params, state.opt_state
        for _ in range(config.updates_per_batch):
            inner, m = update(policy, optimizer, TrainState(state.step, params, opt_state),
                              batch, temperature=T, **settings)
            params, opt_state = inner.params, inner.opt_state
        state = TrainState(state.step + 1, params, opt_state)
        m = {k: (int(v) if k == "tokens" else float(v)) for k, v in m.items()}
    t3 = time.perf_counter()
    rec = {"step": s + 1, **m, "reward": float(rewards.mean()), "seconds": t3 - t0,
           "rollout_s": generate_s, "logprobs_s": (t1 - t0 - generate_s) + (t2 - t1),
           "update_s": t3 - t2, "phase": "sft" if s < config.sft_steps else "rl",
           "signal_groups": signal, "skipped": bool(skipped)}
    return state, rec
