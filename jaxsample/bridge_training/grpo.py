"""GRPO-style RL for Bridge layers (base frozen), resumable with orbax.

The GRPO loop of `jaxsample.training.grpo` with the Bridge's policy
(`common.bridge_policy`): per step, sample N Bridge-coupled branches per
problem (`jaxsample.training.rollout`, `generate(..., bridge=...)`), score
them (a per-sample verifiable reward, or a per-group one for coordination
tasks: `distinct_rewards`), group-relative advantage A_n = (r_n - mean r) /
(std r + eps), one on-policy step of the token-normalised policy-gradient
loss `jaxsample.bridge_training.common.pg_loss` (ratio exactly 1, no
clipping, no KL: the base is frozen and the Bridge starts as an exact
no-op). Recipe: Dong et al., arXiv 2510.01143; GRPO: Shao et al. 2024,
arXiv 2402.03300.

A batch in which no group has any reward variance has all advantages 0,
hence zero gradient; by default (`skip_no_signal`) such a step leaves the
params and the optimizer state untouched. Otherwise Adam would keep moving
the params along its momentum on a zero gradient (after one real update at
lr, the next ~10 zero-gradient steps move every entry by about 4 x lr more,
in the same direction).
"""

from __future__ import annotations

import collections
import re
from typing import Callable, Hashable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxsample import bridge as bridge_lib
from jaxsample.bridge_training import common as bt
from jaxsample.bridge_training.common import Problem
from jaxsample.sampling_params import SamplingParams
from jaxsample.training import grpo
from jaxsample.training import rollout as rollout_lib

__all__ = ["reward", "distinct_rewards", "distinct_correct", "score_group", "rollout", "train"]


_NUM_RE = re.compile(r"-?\d+(?:\.\d+)?")


def reward(text: str, answer: str) -> float:
    """1.0 if the final number in `text` equals `answer`, else 0.0.

    Uses `jaxsample.reduce.answers.extract(text, "number")` and `normalize` (last
    number in the text; GSM8K / "the answer is" conventions handled there).
    """
    try:
        from jaxsample.reduce import answers
        got = answers.extract(text, "number")
        return float(got is not None and got == answers.normalize(answer))
    except ImportError:  # pragma: no cover - answers is part of the package
        nums = _NUM_RE.findall(text)
        return float(bool(nums) and nums[-1] == answer)


def distinct_rewards(answers: Sequence[Hashable | None]) -> np.ndarray:
    """Coordination reward for one group: 1 where an answer is valid and no other branch gave it.

    Args:
      answers: one parsed answer per branch (any hashable), None for an invalid one.
    Returns:
      `[N]` float32: 1.0 where `answers[n]` is not None and appears once in the group.
    """
    counts = collections.Counter(a for a in answers if a is not None)
    return np.asarray([float(a is not None and counts[a] == 1) for a in answers], np.float32)


def distinct_correct(answers: Sequence[Hashable | None]) -> int:
    """The number of distinct valid answers in a group (the coordination metric)."""
    return len({a for a in answers if a is not None})


def score_group(texts: Sequence[str], problem, reward_fn=None, group_reward_fn=None) -> np.ndarray:
    """`[N]` float32 rewards of one group: `group_reward_fn(texts, problem)` if given,
    else `reward_fn(text, problem)` per text (default: `reward(text, problem.answer)`)."""
    if group_reward_fn is not None:
        r = np.asarray(group_reward_fn(list(texts), problem), np.float32)
        if r.shape != (len(texts),):
            raise ValueError(f"group_reward_fn returned shape {r.shape}, want ({len(texts)},)")
        return r
    reward_fn = reward_fn or (lambda text, p: reward(text, p.answer))
    return np.asarray([reward_fn(t, problem) for t in texts], np.float32)


def rollout(lm, bridge, problems: Sequence[Problem], n: int, seed: int, max_new_tokens: int,
            temperature: float = 1.0, chat: bool = True, eps: float = 1e-6, prompt_cap: int = 0,
            reward_fn: Callable[[str, Problem], float] | None = None, stop_token_ids=(),
            group_reward_fn: Callable[[list[str], Problem], Sequence[float]] | None = None):
    """Sample n coupled branches per problem and score them.

    Args:
      reward_fn: `f(text, problem) -> float`; default `reward(text, problem.answer)`.
      stop_token_ids: extra stop ids (besides the tokenizer's end-of-text ids).
      group_reward_fn: `f(texts of one group, problem) -> [n] rewards` (coordination
        tasks, e.g. with `distinct_rewards`); replaces `reward_fn` when given.

    Returns:
      (Batch with group-normalised advantages, rewards `[G, N]` float32, Generation).
    """
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                        stop_token_ids=tuple(stop_token_ids))
    got = rollout_lib.rollout(lm, lm.params, [p.prompt for p in problems], n, sp, chat=chat,
                              bridge=bridge, prompt_cap=prompt_cap)
    rewards = np.stack([score_group(row, p, reward_fn, group_reward_fn)
                        for row, p in zip(got.texts, problems)])
    adv = grpo.group_advantages(rewards, eps=eps)
    return got.batch._replace(advantages=jnp.asarray(adv)), rewards, got.generation


# ---------------------------------------------------------------------------
# The loop


def train(lm, bridge: bridge_lib.Bridge, problems: Sequence[Problem], *, steps: int,
          n: int = 4, groups: int = 2, max_new_tokens: int = 16, temperature: float = 1.0,
          learning_rate: float = 1e-3, seed: int = 0, ckpt_dir: str | None = None,
          save_every: int = 10, sft_steps: int = 0, log: Callable[[str], None] | None = print,
          stop_after: int | None = None, chat: bool = True,
          reward_fn: Callable[[str, Problem], float] | None = None, stop_token_ids=(),
          skip_no_signal: bool = True,
          group_reward_fn: Callable[[list[str], Problem], Sequence[float]] | None = None):
    """GRPO-style training of the Bridge (base frozen), resumable from `ckpt_dir`.

    `jaxsample.training.grpo.train` with `bridge_policy` and the ratio taken as
    exactly 1 (`importance_ratio=False`). Step s uses problems chosen by
    `fold_in(key(seed), s)` and rollout seed `seed * 1_000_003 + s`, so the
    run is a function of (seed, step): resuming from a checkpoint at step s
    continues exactly as the uninterrupted run. Steps `< sft_steps` are an
    on-policy supervised warm-up: advantage 1 on the rewarded samples of each
    group, 0 on the others. (The paper's warm-up, on groups of correct samples
    drawn once from the base model, is `jaxsample.bridge_training.sft`; pass
    its Bridge here as `bridge`.)

    Args:
      problems: the training problems.
      steps: total optimizer steps (including the warm-up).
      n: branches per problem; groups: problems per step.
      ckpt_dir: orbax checkpoint directory; resumes from its latest step.
      save_every: checkpoint period in steps (and at the end).
      stop_after: stop (after saving) once this step is reached: simulates an
        interruption in tests.
      chat, reward_fn, stop_token_ids, group_reward_fn: passed to `rollout`.
      skip_no_signal: a step whose advantages are all 0 (no group with reward
        variance; in the warm-up: no correct sample) only advances the step
        counter: params and optimizer state are unchanged (no Adam momentum
        step on a zero gradient). False applies the optimizer anyway.
    Returns:
      (Bridge with the trained params, TrainState, history: list of per-step dicts
      with step, loss, mean reward, tokens, grad_norm, seconds (and their split:
      rollout_s, logprobs_s, update_s), phase, the number of groups with a
      nonzero advantage (`signal_groups`) and `skipped`).
    """
    config = grpo.GRPOConfig(steps=steps, prompts_per_step=groups, group_size=n,
                             max_tokens=max_new_tokens, temperature=temperature,
                             stop_token_ids=tuple(stop_token_ids), chat=chat,
                             learning_rate=learning_rate, importance_ratio=False, seed=seed,
                             save_every=save_every, sft_steps=sft_steps,
                             skip_no_signal=skip_no_signal)
    params, state, history = grpo.train(
        bt.bridge_policy(lm, bridge), problems, config,
        group_reward=lambda p, texts: score_group(texts, p, reward_fn, group_reward_fn),
        ckpt_dir=ckpt_dir, log=log, stop_after=stop_after)
    return bridge.replace_params(params), state, history
