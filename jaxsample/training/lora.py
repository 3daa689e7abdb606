"""Low-rank adapters (LoRA) on a model's projection matrices.

A projection `W [in, out]` gets a trainable update `scale * A @ B` with
`A [in, r]`, `B [r, out]` (float32) and `scale = alpha / r`; B starts at zero,
so an untrained adapter is the base model (merged: its weights bit for bit;
unmerged: `x @ W` plus an exact zero).
Only A and B are trained; the base weights never change.

Two ways to run the adapted model, one per use:

* training (`apply`): each targeted weight becomes a `LoraWeight`, whose
  `x @ w` is `x @ W + scale * (x @ A) @ B` (the families multiply weights
  with `@`, so they need no change). The gradient then never forms the
  `[in, out]` gradient of W: differentiating through a merged matrix would.
* sampling (`merge`): `W + scale * A @ B` in W's dtype, the plain parameter
  pytree the engine serves.

Parameters follow the base's layout: in the list layout (`jaxsample.load`),
`{"layers": [{target: {"a", "b"}} for each layer]}`; in the stacked layout
(leaves `[L, ...]`), `{"layers": {target: {"a" [L, in, r], "b" [L, r, out]}}}`.

Reference: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models" (arXiv 2106.09685); A is drawn as Hugging Face PEFT does (uniform
in +-1/sqrt(in), its `kaiming_uniform_(a=sqrt(5))`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.errors import InputError
from jaxsample.models.quantization import quant

__all__ = ["LoraConfig", "LoraWeight", "init", "apply", "merge", "num_params"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Which projections get adapters, and their rank.

    Attributes:
      rank: r, an int >= 1.
      alpha: the update's scale is `alpha / rank` (a finite number > 0).
      targets: per-layer projection names, a non-empty subset of
        `models.quantization.quant.PROJECTIONS` (wq, wk, wv, wo, w_gate, w_up, w_down).
    Raises:
      InputError: on construction, a field outside these rules.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = quant.PROJECTIONS

    def __post_init__(self):
        r = self.rank
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) or r < 1:
            raise InputError(f"LoraConfig.rank must be an int >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (
                math.isfinite(a) and a > 0):
            raise InputError(f"LoraConfig.alpha must be a finite number > 0, got {a!r}")
        targets = tuple(self.targets) if not isinstance(self.targets, str) else (self.targets,)
        object.__setattr__(self, "targets", targets)
        bad = [t for t in targets if t not in quant.PROJECTIONS]
        if not targets or bad or len(set(targets)) != len(targets):
            raise InputError(f"LoraConfig.targets must be distinct names from "
                             f"{quant.PROJECTIONS}, got {targets!r}")

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)

    def to_dict(self) -> dict:
        return {"rank": int(self.rank), "alpha": float(self.alpha), "targets": list(self.targets)}


@jax.tree_util.register_pytree_node_class
class LoraWeight:
    """A frozen projection with a low-rank update: `x @ self` is
    `x @ w + scale * (x @ a) @ b`, in x's dtype (the update in float32).

    Attributes:
      w: `[..., in, out]` the base weight; a: `[..., in, r]`; b: `[..., r, out]`
        float32; scale: a Python float (static).
    """

    def __init__(self, w, a, b, scale: float):
        self.w, self.a, self.b, self.scale = w, a, b, float(scale)

    def tree_flatten(self):
        return (self.w, self.a, self.b), self.scale

    @classmethod
    def tree_unflatten(cls, scale, children):
        return cls(*children, scale)

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def __rmatmul__(self, x):
        y = x @ self.w
        update = (x.astype(jnp.float32) @ self.a) @ self.b
        return (y.astype(jnp.float32) + self.scale * update).astype(y.dtype)

    def __repr__(self) -> str:
        return f"LoraWeight(shape={self.w.shape}, rank={self.a.shape[-1]}, scale={self.scale})"


def _layers(params) -> tuple[list[dict], bool]:
    layers = params["layers"]
    return (list(layers), False) if isinstance(layers, (list, tuple)) else ([layers], True)


def _check_target(lp: dict, name: str, stacked: bool, layer: int):
    w = lp.get(name)
    where = "the stacked layers" if stacked else f"layer {layer}"
    if w is None:
        raise InputError(f"LoRA target {name!r} is not in {where}: the model has "
                         f"{sorted(lp)} (int8 weights fuse projections; MoE experts have none)")
    if isinstance(w, quant.QuantizedWeight):
        raise InputError(f"LoRA target {name!r} is an int8 weight: adapters need float weights "
                         "(load with weights='float32' or 'bfloat16')")
    if w.ndim != (3 if stacked else 2):
        raise InputError(f"LoRA target {name!r} in {where} has shape {tuple(w.shape)}, not one "
                         f"matrix per layer (MoE experts cannot take adapters)")
    return w


def init(params, config: LoraConfig, key: jax.Array):
    """Fresh adapters for `params`: A uniform in +-1/sqrt(in), B zero (float32).

    Raises:
      InputError: a target the layers lack, an int8 or a per-expert weight.
    """
    layers, stacked = _layers(params)
    out = []
    for l, lp in enumerate(layers):
        one = {}
        for i, name in enumerate(config.targets):
            w = _check_target(lp, name, stacked, l)
            d_in, d_out = w.shape[-2], w.shape[-1]
            lead = w.shape[:-2]
            bound = 1.0 / math.sqrt(d_in)
            k = jax.random.fold_in(jax.random.fold_in(key, l), i)
            one[name] = {"a": jax.random.uniform(k, lead + (d_in, config.rank), jnp.float32,
                                                 -bound, bound),
                         "b": jnp.zeros(lead + (config.rank, d_out), jnp.float32)}
        out.append(one)
    return {"layers": out[0] if stacked else out}


def _replace_targets(params, lora, config: LoraConfig, fn):
    layers, stacked = _layers(params)
    adapters = [lora["layers"]] if stacked else list(lora["layers"])
    if len(adapters) != len(layers):
        raise InputError(f"LoRA params have {len(adapters)} layers, the model {len(layers)}")
    new = []
    for l, (lp, ad) in enumerate(zip(layers, adapters)):
        lp = dict(lp)
        for name in config.targets:
            _check_target(lp, name, stacked, l)
            lp[name] = fn(lp[name], ad[name]["a"], ad[name]["b"])
        new.append(lp)
    out = dict(params)
    out["layers"] = new[0] if stacked else new
    return out


def apply(params, lora, config: LoraConfig):
    """`params` with every target a `LoraWeight` (the training forward; differentiable
    in `lora`, the base weights untouched)."""
    return _replace_targets(params, lora, config,
                            lambda w, a, b: LoraWeight(w, a, b, config.scale))


@functools.partial(jax.jit, static_argnums=3)
def _merged(w, a, b, scale: float):
    delta = jnp.einsum("...ir,...ro->...io", a, b)
    return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)


def merge(params, lora, config: LoraConfig):
    """`params` with every target `W + scale * A @ B` in W's dtype (what rollouts serve);
    the other leaves are `params`' own arrays (not copied). With B zero the
    targets equal W (a -0.0 entry becomes +0.0)."""
    return _replace_targets(params, lora, config,
                            lambda w, a, b: _merged(w, a, b, config.scale))


def num_params(lora: Any) -> int:
    """The adapters' trainable parameter count."""
    return int(sum(np.prod(a.shape) for a in jax.tree_util.tree_leaves(lora)))
