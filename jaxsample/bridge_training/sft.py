"""The SFT warm-up of the Bridge recipe: groups of correct base-model samples, teacher-forced together.

Dong et al., "Generalized Parallel Scaling with Interdependent Generations"
(arXiv 2510.01143), Sec. 3: before RL, train only the Bridge parameters on
groups of correct answers to the same problem: draw n samples per problem
from the base model (the paper: 8 per GSM8K problem), drop the wrong ones,
drop the problems with at most one correct answer, batch the correct answers
of a problem together as one group. The whole group is teacher-forced through
`jaxsample.bridge_training.common.pg_loss` with advantage 1 on every kept sample (the
supervised loss), so the cross-branch attention sees the other correct
answers at the same positions and is trained; the base model stays frozen.

Data flow:

    problems --engine.generate(base, n samples)--> texts, tokens [G, n, T]
      --keep (reward > 0, or a task's keep_fn)--> filter_groups: <= 1 kept -> dropped
      --> SFTData: Batch [G', W, T] (W = max_group; padding rows have length 0,
          advantage 0: never keys, never in the loss)
      --train_sft--> Bridge params (orbax-resumable; the data is saved beside the
          checkpoints so a resumed run trains on the same groups)
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.bridge_training import common as bt
from jaxsample.bridge_training.common import Batch, Problem
from jaxsample.bridge_training.grpo import score_group
from jaxsample.sampling_params import SamplingParams

__all__ = ["SFTData", "filter_groups", "collect", "train_sft", "save_data", "load_data"]


class SFTData(NamedTuple):
    """Kept groups, padded: `batch` (Batch with `[G, W, T]` completions, advantages 1 on
    kept samples, 0 on padding), `problem_index` `[G]` int32 (into the problems passed
    to `collect`), `kept` `[G]` int32 samples kept per group, and `drawn`: problems
    sampled (before the filter)."""

    batch: Batch
    problem_index: np.ndarray
    kept: np.ndarray
    drawn: int


def filter_groups(keep: np.ndarray, max_group: int) -> list[tuple[int, list[int]]]:
    """Which samples form the SFT groups.

    Args:
      keep: `[G, n]` bool, sample (g, j) is correct.
      max_group: the largest group kept (the first `max_group` correct samples).
    Returns:
      `[(g, [j, ...]), ...]` for each problem with at least 2 correct samples,
      in problem order.
    Raises:
      ValueError: keep is not 2-D, or max_group < 2.
    """
    keep = np.asarray(keep, bool)
    if keep.ndim != 2:
        raise ValueError(f"keep must be [G, n], got shape {keep.shape}")
    if max_group < 2:
        raise ValueError(f"max_group must be >= 2 (a group of one has no cross-branch signal), "
                         f"got {max_group}")
    out = []
    for g, row in enumerate(keep):
        idx = [int(j) for j in np.flatnonzero(row)]
        if len(idx) >= 2:
            out.append((g, idx[:max_group]))
    return out


def collect(lm, problems: Sequence[Problem], *, n: int = 8, max_group: int = 8, seed: int = 0,
            max_new_tokens: int = 16, temperature: float = 1.0, chat: bool = False,
            stop_token_ids=(), reward_fn=None, group_reward_fn=None,
            keep_fn: Callable[[list[str], Problem], Sequence[bool]] | None = None,
            chunk: int = 16, log: Callable[[str], None] | None = None) -> SFTData:
    """Draw n samples per problem from the base model and keep the correct groups.

    Args:
      problems: the training problems.
      n: samples per problem (the paper: 8); max_group: the widest group kept.
      seed: sampling seed (`SamplingParams.seed`; chunk c uses seed + c).
      reward_fn, group_reward_fn: as in `jaxsample.bridge_training.grpo.rollout`; a sample is
        correct when its reward is > 0.
      keep_fn: `f(texts of one group, problem) -> [n] bool` overrides the reward
        (e.g. a coordination task keeps the first copy of each distinct valid answer).
      chunk: problems per `generate` call.
    Returns:
      `SFTData`.
    Raises:
      ValueError: no problem had two or more correct samples.
    """
    rows, index, kept, prompts = [], [], [], []
    stop = bt.stop_array(lm, stop_token_ids)
    for c in range(0, len(problems), chunk):
        part = problems[c:c + chunk]
        t0 = time.perf_counter()
        gen = engine.generate(lm, [p.prompt for p in part],
                              SamplingParams(n=n, temperature=temperature, seed=seed + c,
                                             max_new_tokens=max_new_tokens,
                                             stop_token_ids=tuple(stop_token_ids)), chat=chat)
        if keep_fn is not None:
            keep = np.stack([np.asarray(keep_fn(list(row), p), bool)
                             for row, p in zip(gen.texts, part)])
        else:
            keep = np.stack([score_group(row, p, reward_fn, group_reward_fn) > 0
                             for row, p in zip(gen.texts, part)])
        groups = filter_groups(keep, max_group)
        for g, idx in groups:
            toks = np.zeros((max_group, max_new_tokens), np.int32)
            lens = np.zeros((max_group,), np.int32)
            T = min(max_new_tokens, gen.tokens.shape[-1])
            toks[:len(idx), :T] = np.asarray(gen.tokens[g])[idx, :T]
            lens[:len(idx)] = np.asarray(gen.lengths[g])[idx]
            rows.append((toks, lens))
            index.append(c + g)
            kept.append(len(idx))
            prompts.append(gen.prompt_tokens[g])
        if log:
            log(json.dumps({"sft_collect": c + len(part), "correct": int(keep.sum()),
                            "samples": int(keep.size), "groups_kept": len(groups),
                            "seconds": round(time.perf_counter() - t0, 1)}))
    if not rows:
        raise ValueError(f"no problem had >= 2 correct samples out of {n} "
                         f"({len(problems)} problems): nothing to warm up on")
    prompt, prompt_len = bt.pad_prompts(prompts)
    kept = np.asarray(kept, np.int32)
    adv = (np.arange(max_group)[None] < kept[:, None]).astype(np.float32)
    batch = Batch(prompt=jnp.asarray(prompt), prompt_len=jnp.asarray(prompt_len),
                  completions=jnp.asarray(np.stack([r[0] for r in rows])),
                  lengths=jnp.asarray(np.stack([r[1] for r in rows])),
                  advantages=jnp.asarray(adv), stop_ids=jnp.asarray(stop))
    return SFTData(batch, np.asarray(index, np.int32), kept, len(problems))


def save_data(path: str, data: SFTData) -> None:
    """Write `SFTData` to an `.npz` file."""
    b = data.batch
    np.savez(path, **{f: np.asarray(getattr(b, f)) for f in Batch._fields
                      if getattr(b, f) is not None},
             problem_index=data.problem_index, kept=data.kept, drawn=np.int64(data.drawn))


def load_data(path: str) -> SFTData:
    """Read `SFTData` written by `save_data`."""
    z = np.load(path)
    batch = Batch(**{f: jnp.asarray(z[f]) for f in Batch._fields if f in z.files})
    return SFTData(batch, z["problem_index"], z["kept"], int(z["drawn"]))


def _take(batch: Batch, idx: np.ndarray) -> Batch:
    return Batch(*(a if f == "stop_ids" or a is None else a[idx]
                   for f, a in zip(Batch._fields, batch)))


def train_sft(lm, bridge: bridge_lib.Bridge, data: SFTData, *, steps: int, groups: int = 4,
              learning_rate: float = 1e-3, seed: int = 0, ckpt_dir: str | None = None,
              save_every: int = 10, stop_after: int | None = None,
              log: Callable[[str], None] | None = print):
    """Supervised warm-up of the Bridge (base frozen), resumable from `ckpt_dir`.

    Step s trains on `groups` groups chosen by `fold_in(key(seed), s)` (without
    replacement when there are enough), so the run is a function of (seed, step)
    and a resumed run equals an uninterrupted one. The data is saved as
    `<ckpt_dir>/sft_data.npz` the first time; a resumed run reads it back.

    Args:
      data: from `collect` (for every condition of a comparison: the same groups).
      steps: optimizer steps; groups: groups per step.
      stop_after: stop (after saving) once this step is reached (tests).
    Returns:
      (Bridge with the trained params, TrainState, history: per-step dicts with
      step, loss, tokens, grad_norm, seconds, phase "sft").
    Raises:
      ValueError: the saved data in ckpt_dir differs in shape from `data`.
    """
    optimizer = bt.make_optimizer(learning_rate)
    state = bt.init_state(bridge, optimizer)
    base_fp = bt.fingerprint(lm.params) if ckpt_dir else None
    if ckpt_dir:
        os.makedirs(ckpt_dir, exist_ok=True)
        path = os.path.join(ckpt_dir, "sft_data.npz")
        if os.path.exists(path):
            saved = load_data(path)
            if saved.batch.completions.shape != data.batch.completions.shape:
                raise ValueError(f"{path} holds groups of shape {saved.batch.completions.shape}, "
                                 f"not {data.batch.completions.shape}")
            data = saved
        else:
            save_data(path, data)
        if bt.latest_step(ckpt_dir) is not None:
            state, _ = bt.restore(ckpt_dir, state, lm, bridge.config, base_fingerprint=base_fp)
            if log:
                log(f"resumed SFT from {ckpt_dir} at step {int(state.step)}")
    G = data.batch.prompt.shape[0]
    key = jax.random.key(seed)
    history = []
    while int(state.step) < steps:
        s = int(state.step)
        t0 = time.perf_counter()
        idx = np.asarray(jax.random.choice(jax.random.fold_in(key, s), G, (groups,),
                                           replace=G < groups))
        state, m = bt.update(optimizer, lm, bridge.config, state, _take(data.batch, idx))
        rec = {"step": s + 1, "loss": float(m["loss"]), "tokens": int(m["tokens"]),
               "grad_norm": float(m["grad_norm"]), "seconds": time.perf_counter() - t0,
               "phase": "sft"}
        history.append(rec)
        if log:
            log(json.dumps(rec))
        done = int(state.step)
        if ckpt_dir and (done % save_every == 0 or done == steps or done == stop_after):
            bt.save(ckpt_dir, state, lm, bridge.config, base_fingerprint=base_fp)
        if stop_after is not None and done >= stop_after:
            break
    return bridge.replace_params(state.params), state, history
