"""Bridge: optional cross-branch layers that let N parallel generations talk.

From "Generalized Parallel Scaling with Interdependent Generations" (Dong et
al., arXiv 2510.01143). After a transformer block's feed-forward, a residual
block mixes the hidden states of the N branches of the same prompt at the
same token position:

    h <- h + gate_l * W_O . Attn_over_branches(RMSNorm(h))

Letters as in models/families/llama.py; Bridge-only letters:

    d  the Bridge's inner width (`BridgeConfig.dim`)
    h  Bridge heads (`BridgeConfig.n_heads`), c = d / h the Bridge head dim

Properties (each is tested in tests/bridge/test_bridge.py):

- Attention runs over the branches only, at one position (an N x N attention
  per position): no KV cache, no position encoding on the branch axis, so the
  block is permutation-equivariant in the branches and runs at any width N.
- Finished branches are masked as keys (a branch stops influencing the others
  once it has emitted its stop token). A query always sees itself, so the
  softmax is never empty and never produces NaN.
- Other prompts' branches are never in the attention: prompts are an outer
  `vmap` and the gather (`jaxsample.sharding.gather_branches`) runs over the
  branch axes only.
- `W_O` starts at zero, so an untrained Bridge is exactly the base model.
- Layers that are not selected by `BridgeConfig.layers` are exact no-ops: each
  layer carries a 0/1 `gate` (not trained: it sits behind `stop_gradient`),
  and an unselected layer adds `0 * y` (y is always finite) to h. The block
  is still computed there (one body for all layers); if you select few
  layers and care about that compute, use a narrow `dim`.

Parameters (`Bridge.params`, every leaf stacked over L; `models.families.llama.run_layers`
takes layer l's slice, in its scan or its unrolled loop; float32 whatever the
model dtype):

    norm [L, E]   wq, wk, wv [L, E, d]   wo [L, d, E] (zeros at init)   gate [L]

`BridgeConfig(center=True)` (not in the paper): q, k and the attended values
come from `RMSNorm(h - mean over the live branches of h)` at that position,
and the per-token path `W_V RMSNorm(h)` is added to the attended values:

    y = W_O (W_V n(h) + sum_m softmax_m(q_n . k_m / sqrt(c)) W_V n(h_m - mean h))

with `q_n = W_Q n(h_n - mean h)`, `k_m = W_K n(h_m - mean h)`, n = the block's
RMSNorm (same gain). Same parameters, same count. A branch alone (N = 1,
prefill) has deviation 0 and the block reduces to the per-token path; so do
`cross_branch=False` and `self_only` with these params.

Two controls, both without any cross-branch signal:

- `BridgeConfig(cross_branch=False)`: the same block and parameters with
  attention restricted to the branch itself (the block becomes the linear
  per-token adapter `h + W_O W_V norm(h)`). The same params under this config
  are also the ablation "trained Bridge, cross-branch attention masked to self".
- `BridgeConfig(kind="mlp")`: the paper's equal-parameter control, a per-token
  MLP adapter in the same places, `h + gate * W_2 silu(W_1 RMSNorm(h))` with
  params `norm [L, E]`, `w1 [L, E, 2d]`, `w2 [L, 2d, E]` (zeros at init). Per
  selected layer the Bridge has `E + 3Ed + dE = E + 4Ed` parameters
  (norm, W_Q, W_K, W_V, W_O) and the MLP `E + E(2d) + (2d)E = E + 4Ed`:
  an inner width of 2d makes the counts equal exactly (`param_count`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsample.models.families import llama
from jaxsample.sharding import branch_index, gather_branches

__all__ = ["BridgeConfig", "Bridge", "init", "apply_block", "block_stats", "param_count",
           "param_fraction", "zeros_like_output", "self_only", "KINDS"]

KINDS = ("attention", "mlp")
_MASKED = -1e30  # score of a masked key: exp(_MASKED - max) is exactly 0 in float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """Shape of the Bridge blocks (frozen and hashable: part of the compiled program's key).

    Attributes:
      dim: d, the inner width of the cross-branch attention (q/k/v width).
      n_heads: h, heads of the cross-branch attention; must divide `dim`.
      layers: indices of the blocks followed by a Bridge block; None = every
        block (the paper's default). Unselected layers are exact no-ops.
      cross_branch: True attends over the branches; False restricts each branch
        to itself (the control with the same parameters and no communication).
      norm_eps: epsilon of the block's RMSNorm.
      kind: "attention" (the Bridge block) or "mlp" (the equal-parameter
        per-token MLP control, inner width 2 * dim; `n_heads`,
        `cross_branch` and `center` are then unused).
      center: False is the paper's block. True (this library's variant, no new
        parameters) computes the queries, keys and attended values from
        `RMSNorm(h - mean of h over the live branches at that position)`, and
        adds the per-token path `W_V RMSNorm(h)`: `y = W_O (W_V RMSNorm(h) +
        Attn(centred))`. The attention then compares what the branches did
        differently, not their shared prompt/position state (on which the
        uncentred attention is uniform: docs/benchmarks.md, "Bridge").
        A branch alone (N = 1, prefill, all others finished) has deviation 0,
        RMSNorm(0) = 0 (`norm_eps` > 0), so the block is the per-token path,
        i.e. `cross_branch=False` with the same params (`self_only`).
    """

    dim: int = 64
    n_heads: int = 2
    layers: tuple[int, ...] | None = None
    cross_branch: bool = True
    norm_eps: float = 1e-5
    kind: str = "attention"
    center: bool = False

    def __post_init__(self):
        if not self.norm_eps > 0:
            raise ValueError(f"BridgeConfig.norm_eps must be > 0 (RMSNorm of a zero vector), "
                             f"got {self.norm_eps!r}")
        if self.kind not in KINDS:
            raise ValueError(f"BridgeConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.dim, (int, np.integer)) or self.dim < 1:
            raise ValueError(f"BridgeConfig.dim must be a positive integer, got {self.dim!r}")
        if not isinstance(self.n_heads, (int, np.integer)) or self.n_heads < 1 or self.dim % self.n_heads:
            raise ValueError(f"BridgeConfig.n_heads ({self.n_heads!r}) must be a positive "
                             f"divisor of dim ({self.dim})")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted({int(i) for i in self.layers})))

    def gates(self, n_layers: int) -> np.ndarray:
        """`[L]` float32: 1 at selected layers, 0 elsewhere.

        Raises:
          ValueError: a selected layer index outside [0, n_layers).
        """
        if self.layers is None:
            return np.ones((n_layers,), np.float32)
        bad = [i for i in self.layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"BridgeConfig.layers {bad} out of range for a {n_layers}-layer model")
        g = np.zeros((n_layers,), np.float32)
        g[list(self.layers)] = 1.0
        return g

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for checkpoints)."""
        d = dataclasses.asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BridgeConfig":
        d = dict(d)
        if d.get("layers") is not None:
            d["layers"] = tuple(d["layers"])
        return cls(**d)

    @property
    def out_name(self) -> str:
        """The zero-initialised output projection: "wo" (attention) or "w2" (mlp)."""
        return "wo" if self.kind == "attention" else "w2"

    @property
    def param_names(self) -> tuple[str, ...]:
        """The trained parameters of one layer (the gate is not trained)."""
        return ("norm", "wq", "wk", "wv", "wo") if self.kind == "attention" else ("norm", "w1", "w2")


@struct.dataclass
class Bridge:
    """A Bridge: its config (static) and its parameters (a pytree, leaves `[L, ...]`).

    Pass it to `jaxsample.engine.generate(..., bridge=bridge)`.
    """

    config: BridgeConfig = struct.field(pytree_node=False)
    params: dict[str, jax.Array]

    def replace_params(self, params) -> "Bridge":
        return Bridge(config=self.config, params=params)


def init(lm, config: BridgeConfig | None = None, key: jax.Array | None = None) -> Bridge:
    """Fresh Bridge parameters for a model: exactly the base model until trained.

    Args:
      lm: a `LanguageModel` (or anything with a `.config` `LlamaConfig`).
      config: the `BridgeConfig` (default `BridgeConfig()`).
      key: PRNG key for wq/wk/wv (normal, std 1/sqrt(E)); default key(0).
    Returns:
      A `Bridge` with float32 params `norm [L, E]` (ones), `wq, wk, wv [L, E, d]`,
      `wo [L, d, E]` (zeros) and `gate [L]` (0/1); for `kind="mlp"`: `norm`,
      `w1 [L, E, 2d]` (normal, std 1/sqrt(E)), `w2 [L, 2d, E]` (zeros), `gate`.
    Raises:
      ValueError: a selected layer outside the model.
    """
    config = BridgeConfig() if config is None else config
    key = jax.random.key(0) if key is None else key
    cfg: llama.LlamaConfig = lm.config
    L, E, d = cfg.n_layers, cfg.dim, config.dim
    kq, kk, kv = jax.random.split(key, 3)
    std = 1.0 / math.sqrt(E)
    if config.kind == "mlp":
        params = {
            "norm": jnp.ones((L, E), jnp.float32),
            "w1": std * jax.random.normal(kq, (L, E, 2 * d), jnp.float32),
            "w2": jnp.zeros((L, 2 * d, E), jnp.float32),
            "gate": jnp.asarray(config.gates(L)),
        }
        return Bridge(config=config, params=params)
    params = {
        "norm": jnp.ones((L, E), jnp.float32),
        "wq": std * jax.random.normal(kq, (L, E, d), jnp.float32),
        "wk": std * jax.random.normal(kk, (L, E, d), jnp.float32),
        "wv": std * jax.random.normal(kv, (L, E, d), jnp.float32),
        "wo": jnp.zeros((L, d, E), jnp.float32),
        "gate": jnp.asarray(config.gates(L)),
    }
    return Bridge(config=config, params=params)


def _group_mean(xf: jax.Array, al: jax.Array, axes: Sequence[str]) -> jax.Array:
    """`[S, E]` float32: the mean of `xf` over the live branches at each position.

    `al` is the gathered alive mask `[N, S]`. Every branch reduces the same gathered
    array in the same order, so all branches get the same mean bit for bit. Where no
    branch is alive the branch's own `xf` is returned (a group of one: deviation 0).
    """
    xs = gather_branches(xf, axes)  # [N, S, E]
    cnt = jnp.sum(al, axis=0).astype(jnp.float32)  # [S]
    total = jnp.einsum("ns,nse->se", al.astype(jnp.float32), xs)
    return jnp.where(cnt[:, None] > 0, total / jnp.maximum(cnt, 1.0)[:, None], xf)


def _block(config: BridgeConfig, p_l, x: jax.Array, alive, axes: Sequence[str]):
    """The block's residual update for one branch: (y `[S, E]` float32 before the gate,
    self weight `[S]` float32: attention mass on the branch itself, and `[S]` float32
    total-variation distance of the attention weights from uniform over the visible
    branches, both mean over heads)."""
    S, E = x.shape
    xf = x.astype(jnp.float32)
    h = llama.rms_norm(xf, p_l["norm"], config.norm_eps)
    if config.kind == "mlp":
        return (jax.nn.silu(h @ p_l["w1"]) @ p_l["w2"], jnp.ones((S,), jnp.float32),
                jnp.zeros((S,), jnp.float32))
    hb, d = config.n_heads, config.dim
    c = d // hb
    v = (h @ p_l["wv"]).reshape(S, hb, c)
    if config.cross_branch and axes:
        al = gather_branches(jnp.broadcast_to(jnp.asarray(alive, bool), (S,)), axes)  # [N, S]
        N = al.shape[0]
        me = jnp.arange(N) == branch_index(axes)  # [N]
        visible = (al | me[:, None]).T  # [S, N]
        if config.center:
            # q, k and the attended values from this branch's deviation from the group.
            hc = llama.rms_norm(xf - _group_mean(xf, al, axes), p_l["norm"], config.norm_eps)
            src, vc = hc, (hc @ p_l["wv"]).reshape(S, hb, c)
        else:
            src, vc = h, v
        q = (src @ p_l["wq"]).reshape(S, hb, c)
        k = (src @ p_l["wk"]).reshape(S, hb, c)
        ks = gather_branches(k, axes)  # [N, S, h, c]
        vs = gather_branches(vc, axes)
        scores = jnp.einsum("shc,nshc->shn", q, ks) * (1.0 / math.sqrt(c))
        scores = jnp.where(visible[:, None, :], scores, _MASKED)
        w = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("shn,nshc->shc", w, vs)
        if config.center:
            out = v + out  # the per-token path W_V norm(h), plus what the others did differently
        self_w = jnp.mean(jnp.sum(jnp.where(me[None, None, :], w, 0.0), -1), -1)
        unif = visible / jnp.sum(visible, -1, keepdims=True)  # [S, N]
        tv = jnp.mean(0.5 * jnp.sum(jnp.abs(w - unif[:, None, :]), -1), -1)
    else:
        # One visible key (the branch itself): softmax weight 1, output = v.
        # With all branches identical (prefill), attention over N copies equals this
        # (centred: every deviation is 0, RMSNorm(0) = 0, so the attended part is 0).
        out = v
        self_w = jnp.ones((S,), jnp.float32)
        tv = jnp.zeros((S,), jnp.float32)
    return out.reshape(S, d) @ p_l["wo"], self_w, tv


def apply_block(config: BridgeConfig, p_l, x: jax.Array, alive, axes: Sequence[str]) -> jax.Array:
    """One Bridge block after one transformer block, for one branch.

    Called by the engine (`_Static.post_layer`) and by the training forward
    (`jaxsample.bridge_training.common.group_forward`) inside the branch vmap.

    Args:
      config: the `BridgeConfig`.
      p_l: one layer's slice of `Bridge.params` (`norm [E]`, `wq/wk/wv [E, d]`,
        `wo [d, E]`, `gate []`; or `norm`, `w1 [E, 2d]`, `w2 [2d, E]`, `gate`).
      x: `[S, E]` this branch's hidden states (model dtype).
      alive: bool `[]` or `[S]`: this branch is not finished (per position in
        teacher-forced training). Dead branches are masked as keys; a query
        always sees its own branch.
      axes: branch axis names, innermost first: `()` = this branch alone
        (prefill: all branches are identical there), `("branch",)` unsharded,
        `("branch_local", "branch")` under shard_map.
    Returns:
      `[S, E]`, same dtype as x: `x + gate * W_O . Attn_over_branches(RMSNorm(x))`
      (or `x + gate * W_2 silu(W_1 RMSNorm(x))` for `kind="mlp"`; for
      `center=True` the form in `BridgeConfig.center`).
    """
    y, _, _ = _block(config, p_l, x, alive, axes)
    gate = jax.lax.stop_gradient(p_l["gate"])
    return x + (gate * y).astype(x.dtype)


def block_stats(config: BridgeConfig, p_l, x: jax.Array, alive, axes: Sequence[str]):
    """`apply_block` plus what it did (for `jaxsample.bridge_training.diagnostics`).

    Returns:
      (new x `[S, E]`, relative norm `[S]` float32 = |gate * y| / |x| per position
      (y the block's residual update), self weight `[S]` float32 = attention mass
      the branch puts on itself, mean over Bridge heads (1 for the controls and
      for a branch alone), spread `[S]` float32 = total-variation distance
      `0.5 sum_n |w_n - 1/n_visible|` of the attention weights from uniform over
      the visible branches, mean over heads (0 = mean pooling; 0 for the controls)).
    """
    y, self_w, tv = _block(config, p_l, x, alive, axes)
    gate = jax.lax.stop_gradient(p_l["gate"])
    upd = gate * y
    rel = jnp.linalg.norm(upd, axis=-1) / jnp.maximum(
        jnp.linalg.norm(x.astype(jnp.float32), axis=-1), 1e-30)
    return x + upd.astype(x.dtype), rel, self_w, tv


def param_count(bridge: Bridge) -> int:
    """New trainable parameters of the selected layers (gates excluded).

    Attention: `E + 4Ed` per layer (norm, wq, wk, wv, wo); mlp: `E + 2E(2d) = E + 4Ed`
    (norm, w1, w2): equal for the same `dim`.
    """
    p = bridge.params
    n_sel = int(bridge.config.gates(p["norm"].shape[0]).sum())  # works on abstract shapes too
    per_layer = sum(int(np.prod(p[name].shape[1:])) for name in bridge.config.param_names)
    return n_sel * per_layer


def param_fraction(bridge: Bridge, base_params) -> float:
    """`param_count(bridge)` / the number of parameters of the base model."""
    base = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(base_params))
    return param_count(bridge) / base


def zeros_like_output(bridge: Bridge) -> Bridge:
    """The same Bridge with W_O (W_2 for the MLP) zeroed: exactly the base model again."""
    name = bridge.config.out_name
    return bridge.replace_params(dict(bridge.params, **{name: jnp.zeros_like(bridge.params[name])}))


def self_only(bridge: Bridge) -> Bridge:
    """The ablation: the same params with cross-branch attention masked to the branch itself.

    For a `center=True` Bridge this is its per-token path `W_O W_V RMSNorm(h)` (what a
    branch alone computes), under the config `cross_branch=False, center=False`.

    Raises:
      ValueError: `bridge` is an MLP control (it has no cross-branch attention).
    """
    if bridge.config.kind != "attention":
        raise ValueError(f"self_only needs an attention Bridge, got kind={bridge.config.kind!r}")
    # Without cross-branch attention centring is moot (the block is W_O W_V RMSNorm(h)
    # either way); dropping it makes the config equal to the no-cross control's, so
    # both share one compiled program.
    return Bridge(config=dataclasses.replace(bridge.config, cross_branch=False, center=False),
                  params=bridge.params)
