"""What a Bridge does to a group: per-layer output size and where its attention goes.

For teacher-forced groups (a `jaxsample.bridge_training.common.Batch`, e.g. rollouts of
`jaxsample.bridge_training.grpo.rollout` or the warm-up data of `jaxsample.bridge_training.sft`),
`diagnose` runs the model exactly as `common.group_logprobs` does (the
prompt once, the N completions coupled at the same positions) and records at
every completion position where the branch is alive and at least one other
branch is alive too:

- `rel_norm[l]`: mean of |gate_l * y_l| / |h_l|, the Bridge block's residual
  update relative to the residual stream it is added to (0 for an untrained
  Bridge: W_O = 0);
- `self_mass[l]`: mean attention weight a branch puts on itself (mean over
  Bridge heads); `uniform_self_mass` is the same mean for uniform attention
  over the visible branches (1 / number of alive branches), so
  `self_mass < 1` means the branches read each other, and `self_mass` near
  `uniform_self_mass` means they read everyone alike (mean pooling);
- `tv_from_uniform[l]`: mean total-variation distance of the attention weights
  from uniform over the visible branches (0 = every branch reads everyone
  alike; self mass near uniform can hide a branch that reads one other branch
  and not the rest, this cannot);
- `out_max_abs[l]`: max |W_O| (|W_2| for the MLP control) of layer l.

For the MLP control and the self-only ablation `self_mass` is 1 by
construction. Llama family only (as the training forward).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import bridge as bridge_lib
from jaxsample.bridge_training import common as bt
from jaxsample.bridge_training.common import Batch
from jaxsample.models.families import llama
from jaxsample.sharding import BRANCH_AXIS

__all__ = ["group_stats", "diagnose"]


def group_stats(cfg: llama.LlamaConfig, base_params, bconfig: bridge_lib.BridgeConfig, bparams,
                prompt, prompt_len, completions, lengths, stop_ids):
    """Per-layer, per-position statistics of one group.

    Args: as `common.group_logprobs` (`base_params` in the list layout or stacked).
    Returns:
      (rel `[N, L, T]` float32, self weight `[N, L, T]` float32, alive `[N, T]` bool,
      spread `[N, L, T]` float32: distance of the attention from uniform).
    """
    base_params = llama.unstack_layers(base_params)
    layers = base_params["layers"]
    P, T = prompt.shape[0], completions.shape[1]
    scale = cfg.attention_scale
    alive = bt.completion_alive(completions, lengths, stop_ids)
    pre = lambda h, p_l: bridge_lib.apply_block(bconfig, p_l, h, True, ())
    xp = llama.embed(base_params, prompt)
    _, (kp, vp) = llama.run_layers(cfg, base_params, xp, jnp.arange(P, dtype=jnp.int32),
                                   lambda _: llama.causal_attend(prompt_len, scale=scale),
                                   post_layer=pre, post_xs=bparams)
    positions = prompt_len + jnp.arange(T, dtype=jnp.int32)

    def one(toks, al):
        x = llama.embed(base_params, toks)
        rels, selfs, tvs = [], [], []
        for l, lp in enumerate(layers):
            x, _ = llama.layer(cfg, lp, x, positions, bt.tail_attend(kp[l], vp[l], prompt_len,
                                                                        scale))
            p_l = jax.tree_util.tree_map(lambda a: a[l], bparams)
            x, rel, sw, tv = bridge_lib.block_stats(bconfig, p_l, x, al, (BRANCH_AXIS,))
            rels.append(rel)
            selfs.append(sw)
            tvs.append(tv)
        return jnp.stack(rels), jnp.stack(selfs), jnp.stack(tvs)

    rel, sw, tv = jax.vmap(one, axis_name=BRANCH_AXIS)(completions, alive)
    return rel, sw, alive, tv


def diagnose(lm, bridge: bridge_lib.Bridge, batch: Batch) -> dict[str, Any]:
    """Mean per-layer statistics of a Bridge over a batch of groups (see the module docstring).

    Args:
      lm: the base `LanguageModel` (Llama family).
      bridge: a `Bridge` (attention or MLP control, any config).
      batch: `Batch` of G groups `[G, N, T]` (advantages unused).
    Returns:
      dict with `rel_norm`, `self_mass`, `tv_from_uniform`, `out_max_abs` (lists of L floats),
      `uniform_self_mass` (float) and `positions` (int: the positions averaged).
    Raises:
      ValueError: no position with two or more alive branches (nothing to measure).
    """
    cfg, cfgb = lm.config, bridge.config
    fn = jax.jit(lambda bp, pp, p, pl, c, n, s: group_stats(cfg, pp, cfgb, bp, p, pl, c, n, s))
    rel_sum = self_sum = tv_sum = unif_sum = 0.0
    count = 0
    for g in range(batch.prompt.shape[0]):
        rel, sw, alive, tv = fn(bridge.params, lm.params, batch.prompt[g], batch.prompt_len[g],
                            batch.completions[g], batch.lengths[g], batch.stop_ids)
        alive = np.asarray(alive)
        n_alive = alive.sum(0)  # [T]
        use = alive & (n_alive >= 2)[None]  # [N, T]
        rel_sum = rel_sum + np.asarray(rel).transpose(1, 0, 2)[:, use].sum(-1)
        self_sum = self_sum + np.asarray(sw).transpose(1, 0, 2)[:, use].sum(-1)
        tv_sum = tv_sum + np.asarray(tv).transpose(1, 0, 2)[:, use].sum(-1)
        unif_sum += float((1.0 / np.maximum(n_alive, 1))[None].repeat(alive.shape[0], 0)[use].sum())
        count += int(use.sum())
    if count == 0:
        raise ValueError("no completion position with two or more alive branches")
    out = np.asarray(bridge.params[cfgb.out_name])
    gates = np.asarray(bridge.params["gate"])
    return {"rel_norm": [float(x) for x in rel_sum / count],
            "self_mass": [float(x) for x in self_sum / count],
            "uniform_self_mass": unif_sum / count,
            "tv_from_uniform": [float(x) for x in tv_sum / count],
            "out_max_abs": [float(np.abs(o).max() * g) for o, g in zip(out, gates)],
            "positions": count}
