"""Sparse mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE).

Letters as in `models/families/llama.py`, plus X (experts per layer) and k (experts
used per token, `n_experts_per_tok`). One layer's parameters:

    router [E, X]          the gate (`block_sparse_moe.gate` / `mlp.gate`), x @ W
    w_gate [X, E, F]       expert x's SwiGLU gate projection (`w1` / `gate_proj`)
    w_up   [X, E, F]       its up projection (`w3` / `up_proj`)
    w_down [X, F, E]       its down projection (`w2` / `down_proj`)

Routing (`route`), as transformers' `MixtralTopKRouter` and
`Qwen3MoeTopKRouter`: router logits in float32, a softmax over all X
experts, the top k probabilities and their experts, renormalised to sum to 1
when `norm_topk` (Mixtral always; Qwen3-MoE when `norm_topk_prob`). Mixtral's
paper writes the gate as "softmax over the top-k logits": the same numbers,
since softmax(l)_i / sum_{j in top k} softmax(l)_j = exp(l_i) / sum_{j in top k}
exp(l_j) (tests/models/test_moe.py checks both forms). Ties between router logits
go to the lower expert index (`lax.top_k`).

Expert compute (`expert_mix`): four implementations of the same sum
`y_t = sum_{j<k} w_tj * SwiGLU_{idx_tj}(h_t)`, chosen at trace time
(`choose_impl`, which may look at the call's token count T):

* "loop" (the default): a `fori_loop` over the X experts, each behind a
  `lax.cond` on "some token chose it": a touched expert runs on all T
  tokens (gate weight 0 for the tokens that did not choose it), an
  untouched one costs nothing. Reads each touched expert once; T x touched
  expert rows of FLOPs (at most the dense count).
* "gather": each token gathers its k experts' matrices and runs them alone.
  Reads T*k expert matrices (repeats included): the least work for one token.
* "sorted": the T*k (token, expert) assignments sorted by expert, every
  expert's tokens one group of `lax.ragged_dot` (a grouped matmul), the
  results scattered back with their gate weights. Reads each touched expert
  once.
* "dense": every token through all X experts (one-hot gate weights, zeros
  off the top k): X/k times the FLOPs, every expert read, no gather or sort.

The choice is measured by benchmarks/moe_paths.py (docs/benchmarks.md,
"Mixture of experts"): "loop" is the fastest at T = 1, 16 and 64 on CPU.
A grouped kernel running each expert on its own tokens only ("sorted" on an
accelerator whose `ragged_dot` is native) is not measured.

Batching (`moe_ffn`): the decode step is written per branch and vmapped over
the N branches and the R rows (`engine/step.py`); the plain vmap of a
per-token gather would gather N*k expert matrices per step and never share
one expert's weight read between branches. `moe_ffn` carries a
`jax.custom_batching.custom_vmap` rule (as `engine/prefix_attention.py`
does for the prefix): when the activations are batched and the weights are
not, the batch axis is folded into the token axis and the function called
again, so nested vmaps (branches, rows, prompts) end in one call over all
their tokens: each expert's weights are read once per step for all of
them. Reverse-mode differentiation (Bridge
training through an MoE base model) goes through a `custom_vjp` whose
backward pass is the plain "dense" formula's VJP.

References: Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088);
Hugging Face `modeling_mixtral.py`, `modeling_qwen3_moe.py`; the grouped
matmul of MegaBlocks (Gale et al. 2022, arXiv 2211.15841).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import custom_batching

IMPLS = ("auto", "gather", "sorted", "dense", "loop")


def choose_impl(tokens: int, n_experts: int, k: int) -> str:
    """The expert-compute implementation for a call of `tokens` tokens (static).

    "loop" at every token count: on XLA CPU it is the fastest of the four at
    T = 1, 16 and 64 (benchmarks/moe_paths.py; docs/benchmarks.md, "Mixture
    of experts"): it reads each touched expert's weights once, contiguously,
    and skips the others; `lax.ragged_dot` ("sorted") is lowered on CPU to
    more work than the dense einsum, and "gather" copies T*k expert matrices.
    """
    del tokens, n_experts, k
    return "loop"


def route(logits: jax.Array, k: int, norm_topk: bool):
    """Top-k softmax gating.

    Args:
      logits: `[T, X]` router logits (cast to float32).
      k: experts per token, 1 <= k <= X.
      norm_topk: renormalise the k chosen probabilities to sum to 1.
    Returns:
      (weights `[T, k]` float32, experts `[T, k]` int32), the experts in
      descending order of probability (ties: lower index first).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    if norm_topk:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w, idx.astype(jnp.int32)


def expert_mix(h, w, idx, wg, wu, wd, impl: str = "auto"):
    """`y_t = sum_j w[t, j] * SwiGLU_{idx[t, j]}(h_t)`.

    Args:
      h: `[T, E]` normed activations (model dtype).
      w: `[T, k]` float32 gate weights; idx: `[T, k]` int32 experts.
      wg, wu: `[X, E, F]` the experts' gate and up projections; wd: `[X, F, E]`.
      impl: one of `IMPLS` ("auto": `choose_impl(T, X, k)`).
    Returns:
      `[T, E]` in h's dtype (accumulated in float32).
    """
    w_gate, w_up, w_down = wg, wu, wd
    T, E = h.shape
    X, k = w_gate.shape[0], idx.shape[1]
    if impl == "auto":
        impl = choose_impl(T, X, k)
    if impl == "gather":
        a = jax.nn.silu(jnp.einsum("te,tkef->tkf", h, w_gate[idx])) * jnp.einsum(
            "te,tkef->tkf", h, w_up[idx])
        y = jnp.einsum("tkf,tkfe->tke", a, w_down[idx], preferred_element_type=jnp.float32)
        return jnp.einsum("tke,tk->te", y, w).astype(h.dtype)
    if impl == "loop":
        return _loop(h, dense_gates(w, idx, X), w_gate, w_up, w_down).astype(h.dtype)
    if impl == "dense":
        gates = jnp.zeros((T, X), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)
        a = jax.nn.silu(jnp.einsum("te,xef->txf", h, w_gate)) * jnp.einsum(
            "te,xef->txf", h, w_up)
        y = jnp.einsum("txf,xfe->txe", a, w_down, preferred_element_type=jnp.float32)
        return jnp.einsum("txe,tx->te", y, gates).astype(h.dtype)
    if impl == "sorted":
        A = T * k
        expert = idx.reshape(A)
        order = jnp.argsort(expert, stable=True)
        token = order // k  # assignment a = t * k + j
        xs = h[token]  # [A, E], grouped by expert
        sizes = jnp.bincount(expert, length=X).astype(jnp.int32)
        a = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes)) * jax.lax.ragged_dot(
            xs, w_up, sizes)
        y = jax.lax.ragged_dot(a, w_down, sizes, preferred_element_type=jnp.float32)
        y = y * w.reshape(A)[order][:, None]
        return jnp.zeros((T, E), jnp.float32).at[token].add(y).astype(h.dtype)
    raise ValueError(f"expert_mix: impl must be one of {IMPLS}, got {impl!r}")


def dense_gates(w, idx, n_experts: int) -> jax.Array:
    """`[T, X]` float32: token t's weight for expert x (0 where x is not among its top k)."""
    T = idx.shape[0]
    return jnp.zeros((T, n_experts), jnp.float32).at[jnp.arange(T)[:, None], idx].add(w)


def _loop(h, gates, w_gate, w_up, w_down):
    """`sum_x gates[:, x] * SwiGLU_x(h)` over the experts some token chose, float32 `[T, E]`.

    A `fori_loop` over the experts, each behind a `lax.cond` (untouched
    experts are skipped, so their weights are never read).
    """
    T, E = h.shape
    hit = jnp.any(gates > 0, axis=0)  # [X]

    def one(x, acc):
        def run(acc):
            wg, wu, wd = (jax.lax.dynamic_index_in_dim(a, x, keepdims=False)
                          for a in (w_gate, w_up, w_down))
            y = jnp.dot(jax.nn.silu(h @ wg) * (h @ wu), wd, preferred_element_type=jnp.float32)
            return acc + y * gates[:, x, None]
        return jax.lax.cond(hit[x], run, lambda acc: acc, acc)

    return jax.lax.fori_loop(0, w_gate.shape[0], one, jnp.zeros((T, E), jnp.float32))


def expert_parallel_ffn(mesh, expert_axis: str, *, k: int, norm_topk: bool,
                        token_axis: str | None = None):
    """The MoE FFN with the experts split over a mesh axis (expert parallelism).

    Each device of `expert_axis` holds X / n consecutive experts (`w_gate`,
    `w_up`, `w_down` sharded on their expert axis; the router replicated),
    routes its tokens over all X experts, runs its own experts on the
    tokens that chose them (`_loop`: the others are skipped) and the partial
    outputs are summed with one `psum` over `expert_axis`. Tokens are
    replicated over `expert_axis` and, with `token_axis`, split over it (a
    (data, expert) mesh). Same numbers as `moe_ffn` up to the order of the
    float32 sum over experts.

    Args:
      mesh: a `jax.sharding.Mesh`; expert_axis: the axis the experts are
        split over (its size must divide X); token_axis: None or an axis
        the tokens are split over (must divide T).
      k, norm_topk: as `moe_ffn`.
    Returns:
      `f(lp, h [T, E]) -> [T, E]`, jitted, with lp holding `router [E, X]`,
      `w_gate [X, E, F]`, `w_up [X, E, F]`, `w_down [X, F, E]`.
    Raises:
      ValueError: (when called) X not a multiple of the expert axis size.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as Ps

    n = mesh.shape[expert_axis]
    tok = Ps(token_axis, None)
    ex = Ps(expert_axis, None, None)

    def local(router, wg, wu, wd, h):
        w, idx = route(h @ router, k, norm_topk)
        gates = dense_gates(w, idx, router.shape[1])  # [T, X] over all experts
        X_local = wg.shape[0]
        mine = jax.lax.dynamic_slice_in_dim(gates, jax.lax.axis_index(expert_axis) * X_local,
                                            X_local, axis=1)
        return jax.lax.psum(_loop(h, mine, wg, wu, wd), expert_axis).astype(h.dtype)

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map  # type: ignore
    kwargs = dict(mesh=mesh, in_specs=(Ps(), ex, ex, ex, tok), out_specs=tok)
    try:  # the loop's cond mixes per-device and replicated values: no vma check
        fn = shard_map(local, check_vma=False, **kwargs)
    except TypeError:  # older jax
        fn = shard_map(local, check_rep=False, **kwargs)

    f = jax.jit(fn)

    def checked(lp, h):
        X = lp["w_gate"].shape[0]
        if X % n:
            raise ValueError(f"expert_parallel_ffn: {X} experts do not split over the "
                             f"{expert_axis!r} axis of size {n}")
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        return f(put(lp["router"], Ps()), put(lp["w_gate"], ex), put(lp["w_up"], ex),
                 put(lp["w_down"], ex), put(h, tok))

    return checked


def _moe_tokens(router, w_gate, w_up, w_down, h, *, k, norm_topk, impl):
    w, idx = route(h @ router, k, norm_topk)
    return expert_mix(h, w, idx, w_gate, w_up, w_down, impl)


@functools.lru_cache(maxsize=None)
def _batched_fn(k: int, norm_topk: bool, impl: str):
    """The custom_vmap + custom_vjp function for one (k, norm_topk, impl)."""
    body = functools.partial(_moe_tokens, k=k, norm_topk=norm_topk, impl=impl)
    dense = functools.partial(_moe_tokens, k=k, norm_topk=norm_topk, impl="dense")
    f = custom_batching.custom_vmap(body)

    @f.def_vmap
    def rule(axis_size, in_batched, router, w_gate, w_up, w_down, h):
        if in_batched[-1] and not any(in_batched[:-1]):
            # Fold the batch into the tokens; an outer vmap calls this rule again.
            lead = h.shape[:2]
            out = g(router, w_gate, w_up, w_down, h.reshape((-1,) + h.shape[2:]))
            return out.reshape(lead + out.shape[1:]), True
        axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(body, in_axes=axes, axis_size=axis_size)(
            router, w_gate, w_up, w_down, h), True

    @jax.custom_vjp
    def g(router, w_gate, w_up, w_down, h):
        return f(router, w_gate, w_up, w_down, h)

    def fwd(*args):
        return f(*args), args

    def bwd(args, ct):
        return jax.vjp(dense, *args)[1](ct)

    g.defvjp(fwd, bwd)
    return g


def moe_ffn(lp, h: jax.Array, *, k: int, norm_topk: bool, impl: str = "auto") -> jax.Array:
    """The sparse MoE feed-forward of one layer on one sequence.

    Args:
      lp: the layer's parameters with `router [E, X]`, `w_gate [X, E, F]`,
        `w_up [X, E, F]`, `w_down [X, F, E]`.
      h: `[S, E]` the normed residual stream (model dtype); under vmaps the
        batch axes are folded into S (see the module docstring).
      k: experts per token; norm_topk: renormalise the top-k weights.
      impl: one of `IMPLS`; "auto" picks by the total token count of the call.
    Returns:
      `[S, E]` in h's dtype.
    Raises:
      ValueError: impl not in `IMPLS`.
    """
    if impl not in IMPLS:
        raise ValueError(f"moe_ffn: impl must be one of {IMPLS}, got {impl!r}")
    return _batched_fn(int(k), bool(norm_topk), impl)(lp["router"], lp["w_gate"], lp["w_up"],
                                                      lp["w_down"], h)
