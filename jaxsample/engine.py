"""Shared-prefix parallel decode: prefill once, N branches on a named axis.

Data flow of one request (letters: see models/llama.py):

    prompts --tokenizer--> tokens [B, P] (right-padded to a bucket) + lengths [B]
      --prefill (jit, once per prompt)--> PrefixCache k, v L x [B, K, P, D]
                                          last-position logits [B, V]
      --decode (jit, one lax.while_loop)--> per step, the one-branch step is
            vmapped over the N branches (axis_name="branch") with the prefix
            cache passed with in_axes=None: XLA turns the prefix half of the
            attention into one batched matmul that reads the prefix K/V once
            for all branches. Each branch owns its tail: TailCache k, v
            L x [B, N, K, T, D]. Prefix and tail partial attentions are merged
            by log-sum-exp (Hydragen, arXiv 2402.05099; FlashInfer cascade).
      --> Generation (host): tokens/logprobs [B, N, T], lengths [B, N], texts, bill.

Keys follow levanter's discipline: branch key =
fold_in(fold_in(key(seed), prompt_index), branch_index), and each step folds
in the token index t, so a branch's output does not depend on the batch it
was in nor on how branches are sharded over devices.

The naive engine (`naive=True`) is the same code run on N materialised copies
of each prompt (what Hugging Face's `num_return_sequences` does: N prefills,
N prefix caches, N prefix reads per step). It exists only as the baseline of
benchmarks and the oracle of tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
import weakref
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import cost, sampling
from jaxsample.errors import InputError
from jaxsample.generation import Generation
from jaxsample.lm import LanguageModel
from jaxsample.sampling import SamplingParams
from jaxsample.sharding import BRANCH_AXIS, DATA_AXIS, LOCAL_BRANCH_AXIS
from models import llama
MAX_STOP_IDS = 16  # stop ids are a fixed-size traced array (padded with -1)


# ---------------------------------------------------------------------------
# Typed state


class PrefixCache(NamedTuple):
    """The prompts' KV cache, stored once (no branch axis).

    k, v: tuples of L arrays `[B, K, P, D]` in the model dtype (per layer, so
      the unrolled layer loop reads each layer's cache without a slice copy;
      kv-head-major, the layout the attention matmuls read without a
      transpose); positions `>= lengths[b]` are padding.
    lengths: `[B]` int32 prompt lengths.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


class DecodeState(NamedTuple):
    """Carry of the decode `lax.while_loop` (donated to the decode call).

    t: `[]` int32, index of the next token to sample.
    logits: `[B, N, V]` float32, each branch's distribution for token t.
    tokens: `[B, N, T]` int32; logprobs: `[B, N, T]` float32.
    lengths: `[B, N]` int32 tokens generated so far (stop token included).
    done: `[B, N]` bool; stopped: `[B, N]` bool (ended by a stop token).
    tail_k, tail_v: tuples of L arrays `[B, N, K, T, D]`, the branches' own KV
      (TailCache).
    """

    t: jax.Array
    logits: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    stopped: jax.Array
    tail_k: jax.Array
    tail_v: jax.Array


class Knobs(NamedTuple):
    """Traced request settings: changing them never recompiles."""

    temperature: jax.Array  # [] float32
    top_k: jax.Array  # [] int32
    top_p: jax.Array  # [] float32
    min_p: jax.Array  # [] float32
    seed: jax.Array  # [] uint32
    max_new_tokens: jax.Array  # [] int32
    stop_ids: jax.Array  # [MAX_STOP_IDS] int32, -1 padded


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that changes shapes or code, hence the compiled program."""

    cfg: llama.LlamaConfig
    n: int  # branches per row held by one device
    t_cap: int  # tail buffer length (a bucket >= max_new_tokens)
    vocab_limit: int
    pad_id: int
    axes: tuple[str, ...] = ()  # mesh axes to reduce "all done" over
    branch_axis: str = BRANCH_AXIS  # the vmap axis of the branches
    branch_axes: tuple[str, ...] = (BRANCH_AXIS,)  # all branch axes, innermost first
    bridge: Any = None  # a jaxsample.bridge.BridgeConfig, or None

    def post_layer(self, alive, axes):
        """The Bridge hook for `llama.run_layers` (None without a Bridge)."""
        if self.bridge is None:
            return None
        from jaxsample import bridge as bridge_lib

        return lambda x, p_l: bridge_lib.apply_block(self.bridge, p_l, x, alive, axes)


# ---------------------------------------------------------------------------
# Buckets


def bucket(length: int, minimum: int = 16) -> int:
    """Round a length up to 2^k or 1.5 * 2^(k-1) (at least `minimum`).

    Few distinct shapes (so new lengths rarely recompile) and < 50% padding.
    """
    length = max(int(length), minimum)
    size = 1 << (length - 1).bit_length()  # next power of two >= length
    three_quarters = size * 3 // 4
    return three_quarters if size >= 32 and three_quarters >= length else size


# ---------------------------------------------------------------------------
# Prefill


def prefill(cfg: llama.LlamaConfig, params, tokens: jax.Array, lengths: jax.Array,
            post_layer=None, bridge_params=None):
    """Prefill B right-padded prompts, once each.

    With a Bridge, every branch holds the same hidden state at prompt
    positions, and attention over N identical copies equals attention over
    one, so the prompt is still run once, with each Bridge block attending to
    this single copy (`post_layer` built with no branch axes).

    Args:
      tokens: `[B, P]` int32, right-padded; lengths: `[B]` int32, each >= 1.
      post_layer, bridge_params: the optional Bridge hook and its `[L, ...]` params.
    Returns:
      (PrefixCache with k, v L x `[B, K, P, D]`, last-position logits `[B, V]` float32).
    """

    def one(toks, length):
        positions = jnp.arange(toks.shape[0], dtype=jnp.int32)
        x = llama.embed(params, toks)
        x, (k, v) = llama.run_layers(cfg, params, x, positions,
                                     lambda _: llama.causal_attend(length),
                                     post_layer=post_layer, post_xs=bridge_params)
        last = jax.lax.dynamic_index_in_dim(x, length - 1, axis=0, keepdims=False)
        # L x [P, K, D] -> L x [K, P, D], once per prompt.
        return (llama.logits(cfg, params, last), tuple(a.swapaxes(0, 1) for a in k),
                tuple(a.swapaxes(0, 1) for a in v))

    logits, k, v = jax.vmap(one)(tokens, lengths)
    return PrefixCache(k, v, lengths), logits


# ---------------------------------------------------------------------------
# Decode


def _branch_step(cfg, params, token, position, t, pk, pv, prefix_len, tk, tv, post_layer=None,
                 bridge_params=None):
    """One decode step of one branch (vmapped over branches and prompts).

    Args:
      token: `[]` int32 the token to feed; position: `[]` int32 its position.
      t: `[]` int32 its index in the tail (tail slots `< t` are valid).
      pk, pv: L x `[K, P, D]` the shared prefix (unbatched over branches).
      prefix_len: `[]` int32 valid prefix positions.
      tk, tv: L x `[K, T, D]` this branch's tail.
      post_layer, bridge_params: the optional Bridge hook (collectives over the
        branch axes) and its `[L, ...]` params.
    Returns:
      (logits `[V]` float32, new k L x `[K, D]`, new v L x `[K, D]`).
    """
    P, T = pk[0].shape[1], tk[0].shape[1]
    prefix_mask = (jnp.arange(P) < prefix_len)[None, :]
    tail_mask = (jnp.arange(T) < t)[None, :]
    self_mask = jnp.ones((1, 1), bool)

    def attend_for_layer(xs):
        lpk, lpv, ltk, ltv = xs

        def attend(q, k, v):
            out = llama.merge_attention([
                llama.partial_attention(q, lpk, lpv, prefix_mask),
                llama.partial_attention(q, ltk, ltv, tail_mask),
                llama.partial_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1), self_mask),
            ])
            return out.astype(q.dtype)

        return attend

    x = llama.embed(params, token[None])
    x, (k, v) = llama.run_layers(cfg, params, x, position[None], attend_for_layer,
                                 list(zip(pk, pv, tk, tv)), post_layer, bridge_params)
    return llama.logits(cfg, params, x[0]), [a[0] for a in k], [a[0] for a in v]


def _decode_loop(st: _Static, params, prefix: PrefixCache, state: DecodeState, knobs: Knobs,
                 prompt_index: jax.Array, branch_base: jax.Array,
                 bridge_params=None) -> DecodeState:
    """Run the decode `lax.while_loop` until every branch is done or the budget is spent.

    Args:
      params: model parameters in the list layout (`llama.unstack_layers`).
      prefix: the rows' PrefixCache (L x `[R, K, P, D]`).
      state: the initial DecodeState (`[R, N, ...]`).
      prompt_index: `[R]` int32 global prompt index of each row (for keys).
      branch_base: `[R]` int32 global index of each row's first branch.
      bridge_params: `[L, ...]` Bridge parameters when `st.bridge` is set.
    """
    cfg, N = st.cfg, st.n
    base = jax.random.key(knobs.seed)
    row_keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(prompt_index)  # [R]
    branch_ids = branch_base[:, None] + jnp.arange(N, dtype=jnp.int32)[None, :]  # [R, N]
    branch_keys = jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (0, 0))(row_keys, branch_ids)

    def choose(logits, key):
        return sampling.choose_token(logits, key, knobs.temperature, knobs.top_k, knobs.top_p,
                                     knobs.min_p, st.vocab_limit)

    # Row-level vmap: prefix per row (in_axes 0); branch-level vmap: prefix unbatched.
    def one_branch(tok, pos, t, pk, pv, plen, tk, tv, alive):
        return _branch_step(cfg, params, tok, pos, t, pk, pv, plen, tk, tv,
                            st.post_layer(alive, st.branch_axes), bridge_params)

    step_branches = jax.vmap(one_branch, in_axes=(0, None, None, None, None, None, 0, 0, 0),
                             axis_name=st.branch_axis)
    step_rows = jax.vmap(step_branches, in_axes=(0, 0, None, 0, 0, 0, 0, 0, 0))

    def all_done(done):
        flag = jnp.all(done).astype(jnp.int32)
        for ax in st.axes:
            flag = jax.lax.pmin(flag, ax)
        return flag.astype(bool)

    def cond(s: DecodeState):
        return (s.t < knobs.max_new_tokens) & ~all_done(s.done)

    def body(s: DecodeState) -> DecodeState:
        keys = jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, s.t)))(branch_keys)
        tok, lp = jax.vmap(jax.vmap(choose))(s.logits, keys)
        live = ~s.done
        tok = jnp.where(live, tok, st.pad_id)
        lp = jnp.where(live, lp, 0.0)
        hit_stop = live & jax.vmap(jax.vmap(sampling.is_stop, (0, None)), (0, None))(
            tok, knobs.stop_ids)
        lengths = s.lengths + live.astype(jnp.int32)
        done = s.done | hit_stop | (s.t + 1 >= knobs.max_new_tokens)
        tokens = jax.lax.dynamic_update_index_in_dim(s.tokens, tok, s.t, axis=2)
        logprobs = jax.lax.dynamic_update_index_in_dim(s.logprobs, lp, s.t, axis=2)

        def forward(_):
            positions = prefix.lengths + s.t  # [R]
            # A branch that just stopped no longer influences the others (Bridge).
            return step_rows(tok, positions, s.t, prefix.k, prefix.v, prefix.lengths,
                             s.tail_k, s.tail_v, ~done)

        def skip(_):
            zeros = [jnp.zeros(c.shape[:3] + c.shape[4:], c.dtype) for c in s.tail_k]
            return s.logits, zeros, zeros

        # The cond returns only the new K/V: tails updated inside a cond branch
        # would be copied whole every step (a branch cannot update its operand
        # in place). Slot t is written unconditionally; a skipped step's slot is
        # never read. k, v: L x [R, N, K, D]; t < t_cap is guaranteed by the host.
        logits, k, v = jax.lax.cond(all_done(done), skip, forward, None)
        tail_k = tuple(jax.lax.dynamic_update_index_in_dim(c, a, s.t, axis=3)
                       for c, a in zip(s.tail_k, k))
        tail_v = tuple(jax.lax.dynamic_update_index_in_dim(c, a, s.t, axis=3)
                       for c, a in zip(s.tail_v, v))
        return DecodeState(s.t + 1, logits, tokens, logprobs, lengths, done,
                           s.stopped | hit_stop, tail_k, tail_v)

    return jax.lax.while_loop(cond, body, state)


def init_state(st: _Static, last_logits: jax.Array) -> DecodeState:
    """Fresh decode buffers for R rows of N branches; last_logits `[R, V]`."""
    cfg = st.cfg
    R, N, T = last_logits.shape[0], st.n, st.t_cap
    tail = tuple(jnp.zeros((R, N, cfg.n_kv_heads, T, cfg.head_dim), cfg.jnp_dtype)
                 for _ in range(cfg.n_layers))
    return DecodeState(
        t=jnp.zeros((), jnp.int32),
        logits=jnp.broadcast_to(last_logits[:, None], (R, N, last_logits.shape[-1])),
        tokens=jnp.full((R, N, T), st.pad_id, jnp.int32),
        logprobs=jnp.zeros((R, N, T), jnp.float32),
        lengths=jnp.zeros((R, N), jnp.int32),
        done=jnp.zeros((R, N), bool),
        stopped=jnp.zeros((R, N), bool),
        tail_k=tail, tail_v=tail)


# ---------------------------------------------------------------------------
# Compiled programs (cached by static settings and shapes)


class _Programs:
    """AOT-compiled prefill/decode programs, so compile time is measured apart."""

    def __init__(self):
        self._cache: dict[Any, Any] = {}
        self.compilations = 0

    def get(self, key, fn, args, donate=()):
        """Returns (compiled, seconds spent compiling now)."""
        full_key = (key, tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)),
                    jax.tree_util.tree_structure(args))
        hit = self._cache.get(full_key)
        if hit is not None:
            return hit, 0.0
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        self._cache[full_key] = compiled
        self.compilations += 1
        return compiled, time.perf_counter() - t0


PROGRAMS = _Programs()


def _mesh_programs(st: _Static, mesh, data_axis: str | None):
    """Prefill+init and decode wrapped in shard_map over (data, branch)."""
    from jax.sharding import PartitionSpec as Ps

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map  # type: ignore
    d = data_axis
    row_spec = Ps(d)
    prefix_spec = PrefixCache(Ps(d), Ps(d), Ps(d))
    state_spec = DecodeState(
        t=Ps(), logits=Ps(d, BRANCH_AXIS), tokens=Ps(d, BRANCH_AXIS),
        logprobs=Ps(d, BRANCH_AXIS), lengths=Ps(d, BRANCH_AXIS), done=Ps(d, BRANCH_AXIS),
        stopped=Ps(d, BRANCH_AXIS), tail_k=Ps(d, BRANCH_AXIS), tail_v=Ps(d, BRANCH_AXIS))
    knob_spec = Knobs(*([Ps()] * len(Knobs._fields)))

    def run(params, tokens, lengths, knobs, prompt_index, branch_base, bridge_params):
        prefix, last = prefill(st.cfg, params, tokens, lengths, st.post_layer(True, ()),
                               bridge_params)
        state = init_state(st, last)
        base = branch_base + jax.lax.axis_index(BRANCH_AXIS) * st.n
        return _decode_loop(st, params, prefix, state, knobs, prompt_index, base,
                            bridge_params), prefix

    kwargs = dict(mesh=mesh, in_specs=(Ps(), row_spec, row_spec, knob_spec, row_spec, row_spec,
                                       Ps()),
                  out_specs=(state_spec, prefix_spec))
    try:
        return shard_map(run, check_vma=False, **kwargs)
    except TypeError:  # older signature
        return shard_map(run, check_rep=False, **kwargs)


# ---------------------------------------------------------------------------
# Host API


_SERVING: "weakref.WeakKeyDictionary[LanguageModel, Any]" = weakref.WeakKeyDictionary()


def serving_params(lm: LanguageModel):
    """The model's parameters in the list layout (one dict per layer), made once per model.

    `jaxsample.load` already returns this layout; stacked parameters (random
    test models) are split once here and cached for the model's lifetime.
    """
    if isinstance(lm.params["layers"], (list, tuple)):
        return lm.params
    if lm not in _SERVING:
        _SERVING[lm] = llama.unstack_layers(lm.params)
    return _SERVING[lm]


_ON_MESH: "weakref.WeakKeyDictionary[LanguageModel, dict]" = weakref.WeakKeyDictionary()


def _params_on_mesh(lm: LanguageModel, mesh):
    """The serving params replicated over `mesh`, placed once per (model, mesh).

    Placing them goes through host memory (`_put`), so doing it on every
    `generate` call would copy all the weights each time.
    """
    per_mesh = _ON_MESH.setdefault(lm, {})
    if mesh not in per_mesh:
        from jax.sharding import NamedSharding, PartitionSpec as Ps

        per_mesh[mesh] = _put(serving_params(lm), NamedSharding(mesh, Ps()))
    return per_mesh[mesh]


def _token_ids(lm: LanguageModel, p, i: int) -> list[int]:
    """One prompt given as token ids -> list of ints in [0, vocab_limit), or InputError."""
    arr = np.asarray(p, dtype=object) if not isinstance(p, np.ndarray) else p
    if arr.ndim != 1:
        raise InputError(f"prompt {i}: token ids must be a flat sequence of ints, "
                         f"got shape {arr.shape}")
    bad = [t for t in arr.tolist() if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise InputError(f"prompt {i}: token ids must be ints, got {bad[:3]!r}")
    toks = [int(t) for t in arr.tolist()]
    limit = lm.vocab_limit
    out = [t for t in toks if not 0 <= t < limit]
    if out:
        raise InputError(f"prompt {i} has token ids outside the vocabulary [0, {limit}): {out[:5]}")
    return toks


def _encode_prompts(lm: LanguageModel, prompts, chat: bool):
    """Prompts -> (B token-id lists, B rendered texts or None). Raises InputError."""
    if isinstance(prompts, np.ndarray):
        if prompts.ndim not in (1, 2):
            raise InputError(f"prompts as an array must be [S] or [B, S] token ids, "
                             f"got shape {prompts.shape}")
        prompts = [prompts] if prompts.ndim == 1 else list(prompts)
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
        prompts = [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise InputError("prompts must be a non-empty string, list of strings or list of "
                         f"token-id lists, got {type(prompts).__name__} {prompts!r:.80}")
    ids, texts = [], []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise InputError(f"prompt {i} is empty")
            text = (lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                    if chat else p)
            toks = list(lm.tokenizer.encode(text))
            texts.append(text)
        elif isinstance(p, (list, tuple, np.ndarray)):
            if chat:
                raise InputError(f"prompt {i}: chat=True needs text prompts, got token ids")
            toks = _token_ids(lm, p, i)
            texts.append(None)
        else:
            raise InputError(f"prompt {i} must be a string or a list of token ids, "
                             f"got {type(p).__name__}")
        if not toks:
            raise InputError(f"prompt {i} is empty (0 tokens)")
        ids.append(toks)
    return ids, texts


def _resolve_mesh(mesh, N: int):
    if mesh is None:
        return None, None, 1, 1
    if not isinstance(mesh, jax.sharding.Mesh):
        raise InputError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if BRANCH_AXIS not in names:
        raise InputError(f"mesh must have a {BRANCH_AXIS!r} axis, got axes {names}")
    extra = [a for a in names if a not in (BRANCH_AXIS, DATA_AXIS)]
    if extra:
        raise InputError(f"mesh axes must be among ({DATA_AXIS!r}, {BRANCH_AXIS!r}), got {names}")
    nb = mesh.shape[BRANCH_AXIS]
    nd = mesh.shape[DATA_AXIS] if DATA_AXIS in names else 1
    if N % nb:
        raise InputError(f"params.n ({N}) must be a multiple of the mesh's {BRANCH_AXIS!r} "
                         f"axis size ({nb})")
    return mesh, (DATA_AXIS if DATA_AXIS in names else None), nb, nd


def generate(lm: LanguageModel, prompts, params: SamplingParams | None = None, *,
             chat: bool = False, mesh=None, bridge=None, prompt_index_offset: int = 0,
             naive: bool = False) -> Generation:
    """Sample `params.n` continuations of each prompt, sharing each prompt's KV cache.

    Args:
      lm: a loaded `LanguageModel`.
      prompts: a string, a list of B strings, or a list of B token-id lists.
      params: `SamplingParams` (default: `SamplingParams()`).
      chat: render each text prompt as a user turn through the model's chat template.
      mesh: optional `jax.sharding.Mesh` with a "branch" axis (branches split across
        devices; weights and prefix cache replicated) and optionally a "data" axis
        (prompts split). Same seed, same tokens as the unsharded run.
      bridge: optional `jaxsample.bridge.Bridge` (config + params): cross-branch
        layers after every block (arXiv 2510.01143). A zero-initialised Bridge
        gives exactly the tokens of `bridge=None`.
      prompt_index_offset: the global index of the first prompt, for the keys
        (`fold_in(key(seed), prompt_index)`): when a data set is split into
        several calls with one seed, pass each call's start so that prompts of
        different calls draw independent streams (and a prompt's samples do not
        depend on how the data set was batched).
      naive: baseline only: copy each prompt N times (N prefills, N prefix caches).
    Returns:
      `Generation` with tokens/logprobs `[B, N, T]` (T = max_new_tokens), lengths
      `[B, N]`, finish reasons, texts and the bill.
    Raises:
      InputError: empty prompt, prompt + max_new_tokens beyond the context, bad token
        ids, or a mesh that does not fit the request. Raised before any compute.
      NumericalError: a sampled token's logits were all NaN or -inf (no distribution;
        see `sampling.check_logprobs`). Raised after decoding, before returning.
    """
    t_start = time.perf_counter()
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.seed is None:
        params = params.replace(seed=secrets.randbits(31))
    cfg = lm.config
    model_params = serving_params(lm)
    ids, texts = _encode_prompts(lm, prompts, chat)
    B, N, T = len(ids), params.n, params.max_new_tokens
    for i, toks in enumerate(ids):
        if len(toks) + T > cfg.max_seq_len:
            raise InputError(
                f"prompt {i} has {len(toks)} tokens; with max_new_tokens={T} that is "
                f"{len(toks) + T} > the model's context of {cfg.max_seq_len} tokens")
    stop_ids = sorted(set(lm.tokenizer.eos_token_ids) | set(params.stop_token_ids))
    if len(stop_ids) > MAX_STOP_IDS:
        raise InputError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {len(stop_ids)}")
    mesh, data_axis, nb, nd = _resolve_mesh(mesh, N)
    if isinstance(prompt_index_offset, bool) or not isinstance(
            prompt_index_offset, (int, np.integer)) or not 0 <= prompt_index_offset < 2**31 - B:
        raise InputError(f"prompt_index_offset must be an int in [0, 2**31 - B), "
                         f"got {prompt_index_offset!r}")
    if naive and (mesh is not None or bridge is not None):
        raise InputError("naive=True is a single-device baseline without Bridge; "
                         "pass mesh=None and bridge=None")
    bridge_cfg = None if bridge is None else bridge.config
    bridge_params = None if bridge is None else bridge.params

    # Rows: one per prompt (shared) or one per (prompt, branch) copy (naive).
    rows = [r for r in range(B) for _ in range(N)] if naive else list(range(B))
    n_row = 1 if naive else N
    R = len(rows)
    R_pad = -(-R // nd) * nd  # data axis must divide the rows
    p_cap = bucket(max(len(ids[r]) for r in rows))
    tokens = np.zeros((R_pad, p_cap), np.int32)
    lengths = np.ones((R_pad,), np.int32)
    for j, r in enumerate(rows):
        tokens[j, :len(ids[r])] = ids[r]
        lengths[j] = len(ids[r])
    prompt_index = np.array([prompt_index_offset + r for r in rows] + [0] * (R_pad - R), np.int32)
    branch_base = np.array([j % N if naive else 0 for j in range(R)] + [0] * (R_pad - R), np.int32)

    st = _Static(cfg=cfg, n=n_row // nb, t_cap=bucket(T), vocab_limit=lm.vocab_limit,
                 pad_id=int(lm.tokenizer.pad_token_id),
                 axes=((BRANCH_AXIS,) + ((data_axis,) if data_axis else ())) if mesh else (),
                 branch_axis=LOCAL_BRANCH_AXIS if mesh else BRANCH_AXIS,
                 branch_axes=(LOCAL_BRANCH_AXIS, BRANCH_AXIS) if mesh else (BRANCH_AXIS,),
                 bridge=bridge_cfg)
    assert T <= st.t_cap  # tail writes stay in range: dynamic_update_slice would clamp
    knobs = Knobs(
        temperature=jnp.float32(params.temperature),
        top_k=jnp.int32(min(params.top_k, lm.vocab_limit)),  # k >= V is off either way
        top_p=jnp.float32(params.top_p), min_p=jnp.float32(params.min_p),
        seed=jnp.uint32(params.seed), max_new_tokens=jnp.int32(T),
        stop_ids=jnp.asarray(stop_ids + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32))
    timings = {"compile": 0.0}

    if mesh is None:
        args_p = (model_params, jnp.asarray(tokens), jnp.asarray(lengths), bridge_params)
        prog, dt = PROGRAMS.get(
            ("prefill", cfg, bridge_cfg),
            lambda p, t, n, b: prefill(cfg, p, t, n, st.post_layer(True, ()), b), args_p)
        timings["compile"] += dt
        t0 = time.perf_counter()
        prefix, last = jax.block_until_ready(prog(*args_p))
        timings["prefill"] = time.perf_counter() - t0
        init, dt = PROGRAMS.get(("init", st), functools.partial(init_state, st), (last,))
        timings["compile"] += dt
        state = init(last)
        args_d = (model_params, prefix, state, knobs, jnp.asarray(prompt_index),
                  jnp.asarray(branch_base), bridge_params)
        prog, dt = PROGRAMS.get(("decode", st), functools.partial(_decode_loop, st), args_d,
                                donate=(2,))
        timings["compile"] += dt
        t0 = time.perf_counter()
        state = jax.block_until_ready(prog(*args_d))
        timings["decode"] = time.perf_counter() - t0
    else:
        fn = _mesh_programs(st, mesh, data_axis)
        from jax.sharding import NamedSharding, PartitionSpec as Ps

        rows_sh, rep = NamedSharding(mesh, Ps(data_axis)), NamedSharding(mesh, Ps())
        args = (_params_on_mesh(lm, mesh), _put(tokens, rows_sh), _put(lengths, rows_sh),
                _put(knobs, rep), _put(prompt_index, rows_sh), _put(branch_base, rows_sh),
                _put(bridge_params, rep))
        prog, dt = PROGRAMS.get(("mesh", st, mesh, data_axis), fn, args)
        timings["compile"] += dt
        t0 = time.perf_counter()
        state, prefix = jax.block_until_ready(prog(*args))
        timings["prefill"] = 0.0  # fused with decode in one sharded program
        timings["decode"] = time.perf_counter() - t0

    steps = int(_host(state.t))
    tok = _host(state.tokens)[:R, :, :T]
    lp = _host(state.logprobs)[:R, :, :T]
    lens = _host(state.lengths)[:R]
    stopped = _host(state.stopped)[:R]
    prefix_bytes = sum(int(a.nbytes) for a in prefix.k + prefix.v)
    tail_bytes = sum(int(a.nbytes) for a in state.tail_k + state.tail_v)
    del state, prefix
    if naive:  # rows were (prompt, branch) copies
        tok, lp = tok.reshape(B, N, T), lp.reshape(B, N, T)
        lens, stopped = lens.reshape(B, N), stopped.reshape(B, N)
    sampling.check_logprobs(lp)  # NumericalError if a token had no distribution (NaN logits)
    return _finish(lm, params, ids, texts, tok, lp, lens, stopped, timings, t_start,
                   prefix_bytes, tail_bytes, steps, st.pad_id, prefix_copies=N if naive else 1)


def _put(tree, sharding):
    """Host values -> global arrays on a mesh (works across processes: each
    process passes the same values and provides its own devices' shards)."""

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree_util.tree_map(one, tree)


def _host(x) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _finish(lm, params, ids, texts, tok, lp, lens, stopped, timings, t_start, prefix_bytes,
            tail_bytes, steps, pad_id, prefix_copies=1) -> Generation:
    """Host-side post-processing: stop strings, detokenisation, bill."""
    B, N, T = tok.shape
    decoded = lens.copy()  # what the device decoded: the bill counts it, stop strings or not
    tok, lp, lens = tok.copy(), lp.copy(), lens.copy()
    reasons = [["stop" if stopped[b, n] else "length" for n in range(N)] for b in range(B)]
    out_texts = []
    for b in range(B):
        row = []
        for n in range(N):
            L = int(lens[b, n])
            body = [int(t) for t in (tok[b, n, :L - 1] if stopped[b, n] else tok[b, n, :L])]
            text = lm.tokenizer.decode(body)
            if params.stop and _first_stop(text, params.stop) is not None:
                keep = _tokens_covering(lm, body, params.stop)
                text = lm.tokenizer.decode(body[:keep])  # the same tokens the arrays keep
                text = text[:_first_stop(text, params.stop)]
                tok[b, n, keep:] = pad_id
                lp[b, n, keep:] = 0.0
                lens[b, n] = keep
                reasons[b][n] = "stop"
            row.append(text)
        out_texts.append(row)
    bill = cost.make_bill(lm.config, prompt_lengths=[len(x) for x in ids],
                          branch_lengths=decoded, n=N, prefix_cache_bytes=prefix_bytes,
                          tail_cache_bytes=tail_bytes, decode_steps=steps,
                          prefix_copies=prefix_copies)
    timings["total"] = time.perf_counter() - t_start
    return Generation(tokens=tok, logprobs=lp, lengths=lens, finish_reason=reasons,
                      texts=out_texts, prompt_tokens=ids, prompts=texts, params=params,
                      bill=bill, timings=timings, pad_id=pad_id)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _tokens_covering(lm, toks: list[int], stops) -> int:
    """Fewest leading tokens whose decoded text contains a stop string.

    Bisection (O(log T) decodes): containment only grows with the prefix, up to
    a multi-byte character split across tokens, which is why the caller
    re-decodes exactly the tokens it keeps.
    """
    lo, hi = 1, len(toks)  # decode(toks[:hi]) contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_stop(lm.tokenizer.decode(toks[:mid]), stops) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi
