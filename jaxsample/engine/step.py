"""One decode step: each branch's token choice and forward pass, vmapped over slots.

The step is written for one branch and vmapped over the N slots of a row
(axis_name "branch") with the prefix cache passed with in_axes=None: XLA
turns the prefix half of the attention into one batched matmul that reads
the prefix K/V once for all branches. Each branch owns its tail. Prefix,
tail and current-token partial attentions are merged by log-sum-exp
(Hydragen, arXiv 2402.05099; FlashInfer's cascade attention). With
`Static.attention == "pallas"` the context, prefix and tail parts are the
Pallas kernels of `jaxsample.kernels.decode_attention` instead of XLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsample import kernels
from jaxsample.engine import sampling
from jaxsample.engine.prefill import prefix_start
from jaxsample.engine.prefix_attention import prefix_attention
from jaxsample.engine.state import DecodeState, Knobs, Outputs, PrefixCache, Static
from jaxsample.kernels.decode_attention import segment_attention
from jaxsample.models.families import common, families
from jaxsample.models.quantization import quant


def branch_step(cfg, params, token, position, t, pk, pv, prefix_len, tk, tv, post_layer=None,
                bridge_params=None, context=None, attention: str = "xla"):
    """One decode step of one branch (vmapped over branches and rows).

    Any model family (`models.families.families.module_for(cfg)`). On a local layer of
    window w (`cfg.layer_windows[l]`) the token at position p = C + prefix_len + t
    attends to positions in (p - w, p] only, across the context/prefix/tail
    boundaries.

    Args:
      token: `[]` int32 the token to feed; position: `[]` int32 its position.
      t: `[]` int32 its index in the tail (tail slots `< t` are valid).
      pk, pv: L x `[K, P_l, D]` the shared prefix (unbatched over branches;
        local layers hold their last positions, `prefill.keep_window`).
      prefix_len: `[]` int32 valid prefix positions.
      tk, tv: L x `[K, T_l, D]` this branch's tail (a ring on local layers).
      post_layer, bridge_params: the optional Bridge hook (collectives over the
        branch axes) and its `[L, ...]` params.
      context: None, or the `ContextCache` common to all prompts (unbatched over
        rows and branches; k, v L x `[K, C_l, D]`, length C): a fourth segment
        of the attention, and the prefix's positions start at C.
      attention: "xla" (`prefix_attention` and `common.partial_attention`) or
        "pallas" (`kernels.decode_attention.segment_attention` for the context,
        the prefix and the tail: the same visible positions, merged the same way).
    Returns:
      (logits `[V]` float32, new k L x `[K, D]`, new v L x `[K, D]`).
    """
    fam = families.module_for(cfg)
    scale = cfg.attention_scale
    self_mask = jnp.ones((1, 1), bool)

    base = 0 if context is None else context.length  # position of the prefix's slot 0
    # The int8 step's prefix attention: the CPU kernel, unless the model's
    # `cpu_kernels` is "off" (its weights say so: `QuantizedWeight.kernels`).
    kernel = quant.uses_cpu_kernels(params)
    if attention == "pallas":
        backend, interpret = kernels.kernel_backend()

    def visible(start, end, window):
        """(lo, hi): a segment whose slot j holds position start + j shows the
        slots lo <= j < hi, positions < end and (local layers) > position - window."""
        lo = 0 if window is None else jnp.maximum(position - window + 1 - start, 0)
        return lo, end - start

    def attend_for_layer(xs):
        lpk, lpv, ltk, ltv, window, lck, lcv = xs
        # A local layer stores the last P_l <= w - 1 prefix positions (slot j holds
        # position base + start + j) and a ring of T_l <= w - 1 tail slots (written at
        # t mod T_l), so every written tail slot lies within the window.
        start = prefix_start(prefix_len, lpk.shape[1], window)
        shared = []  # (k, v, (lo, hi)) segments without a branch axis
        if context is not None:  # the common context: positions [0, C), its last C_l kept
            c_start = prefix_start(base, lck.shape[1], window)
            shared.append((lck, lcv, visible(c_start, base, window)))
        shared.append((lpk, lpv, visible(base + start, base + prefix_len, window)))
        # The tail's first min(t, T_l) slots; none where a window of 1 is the token itself.
        tail_hi = jnp.minimum(t, ltk.shape[1]) if window is None or window > 1 else 0

        def mask(n_slots, lo, hi):  # [n_slots] bool
            j = jnp.arange(n_slots)
            return (j >= lo) & (j < hi)

        def attend(q, k, v):
            if attention == "pallas":
                seg = lambda a, b, lo, hi: segment_attention(  # noqa: E731
                    q, a, b, lo, hi, scale, backend=backend, interpret=interpret)
                parts = ([seg(a, b, *bounds) for a, b, bounds in shared]
                         + [seg(ltk, ltv, 0, tail_hi)])
            else:
                # The context and the prefix are unbatched over the branches: one
                # matmul per kv head for all branches (`prefix_attention`).
                parts = ([prefix_attention(q, a, b, mask(a.shape[1], *bounds), scale, kernel)
                          for a, b, bounds in shared]
                         + [common.partial_attention(q, ltk, ltv,
                                                     mask(ltk.shape[1], 0, tail_hi)[None], scale)])
            self_part = common.partial_attention(q, k.swapaxes(0, 1), v.swapaxes(0, 1), self_mask,
                                                 scale)
            return common.merge_attention(parts + [self_part]).astype(q.dtype)

        return attend

    L = len(pk)
    ck, cv = (context.k, context.v) if context is not None else ((None,) * L, (None,) * L)
    x = fam.embed(params, token[None])
    x, (k, v) = fam.run_layers(cfg, params, x, position[None], attend_for_layer,
                               list(zip(pk, pv, tk, tv, cfg.layer_windows, ck, cv)), post_layer,
                               bridge_params)
    return fam.logits(cfg, params, x[0]), [a[0] for a in k], [a[0] for a in v]


def all_done(st: Static, done: jax.Array) -> jax.Array:
    """Whether every slot is done, on every device of the mesh."""
    flag = jnp.all(done).astype(jnp.int32)
    for ax in st.axes:
        flag = jax.lax.pmin(flag, ax)
    return flag.astype(bool)


def branch_keys(knobs: Knobs, prompt_index: jax.Array, branch_ids: jax.Array) -> jax.Array:
    """`[R, N]` keys: fold_in(fold_in(key(seed[r]), prompt_index[r]), branch_index).

    levanter's discipline: a branch's tokens depend on its row's seed, its key
    index (`DecodeState.prompt_index`: the request's position, or 0 for a
    request with its own seed) and its branch index only, not on its slot,
    its batch or its device.
    """
    rows = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        knobs.seed, prompt_index)  # [R]
    return jax.vmap(jax.vmap(jax.random.fold_in, (None, 0)), (0, 0))(rows, branch_ids)


def make_step(st: Static, params, prefix: PrefixCache, knobs: Knobs, keys: jax.Array,
              bridge_params=None, context=None):
    """The loop body: choose each live slot's token t, then run its forward pass.

    With `st.processors`, each slot's logits go through
    `sampling.process_logits` (the one place of the logit bias, min-tokens and
    penalties, in vLLM's order) before `sampling.choose_token`; the recorded
    logprobs, top logprobs, ranks and signals (`st.signals`:
    `sampling.token_signals`) stay those of the raw logits. The
    penalties' token counts are updated after the choice, so token t sees
    the counts of tokens 0..t-1.

    Args:
      keys: `[R, N]` the slots' branch keys (`branch_keys`); token t folds in t.
      context: None or the `ContextCache` common to all rows (closed over: one
        copy for every row and branch, read once per step).
    Returns:
      `step(state) -> state`, advancing every slot by one token.
    """
    choose_tokens = _token_chooser(st, knobs)
    advance = _forward(st, params, prefix, bridge_params, context)

    def step(s: DecodeState) -> DecodeState:
        # Per-slot positions: a live slot's next token index is its length (tokens
        # generated so far), so slots started at different chunks (the pool's
        # refills) each run at their own index; `s.t` is only the chunk's clock.
        pos = s.lengths  # [R, N]
        step_keys = _vv(lambda k, t: jax.random.fold_in(k, t))(keys, pos)
        tok, lp = choose_tokens(s, pos, step_keys)
        live = ~s.done
        tok = jnp.where(live, tok, st.pad_id)
        lp = jnp.where(live, lp, 0.0)
        hit_stop = live & jax.vmap(jax.vmap(sampling.is_stop, (0, None)), (0, 0))(
            tok, knobs.stop_ids)
        lengths = s.lengths + live.astype(jnp.int32)
        done = s.done | hit_stop | (pos + 1 >= knobs.max_new_tokens[:, None])
        R, N = tok.shape
        ri, ni = jnp.arange(R)[:, None], jnp.arange(N)[None, :]
        out = _record(st, s, tok, lp, live, pos, ri, ni)
        counts = s.counts
        if st.penalties:  # one scatter of R x N ones (zeros for done slots)
            counts = counts.at[ri, ni, tok].add(live.astype(jnp.int32), mode="drop")
        logits, tail_k, tail_v = advance(s, tok, pos, done, ri, ni)
        return s._replace(t=s.t + 1, logits=logits, out=out, lengths=lengths, done=done,
                          stopped=s.stopped | hit_stop, tail_k=tail_k, tail_v=tail_v,
                          counts=counts)

    return step


def _vv(f):
    """`f` vmapped over rows and slots: `[R, N, ...]` arguments."""
    return jax.vmap(jax.vmap(f))


def _per_row(f, n_slot: int, n_row: int):
    """`f` vmapped over rows (every argument batched), then over a row's slots: its
    first `n_slot` arguments per slot, the next `n_row` per row (shared by its slots)."""
    return jax.vmap(jax.vmap(f, (0,) * n_slot + (None,) * n_row), (0,) * (n_slot + n_row))


def _token_chooser(st: Static, knobs: Knobs):
    """`choose_tokens(s, pos, step_keys) -> (tok, lp)`, `[R, N]` each: every slot's
    token drawn from its logits (through the logits processors with
    `st.processors`) and the logprob recorded (the processed one on rows that
    ask for it, `st.processed_logprobs`). Pad and 0.0 for done slots are the
    caller's."""
    cfg = st.cfg
    # Per-row settings; the sampler's conds test whether any row needs a path,
    # so a step whose rows all decode greedily (or none filters) skips it.
    sampling_rows = knobs.temperature > 0
    filters = ((knobs.top_k > 0) & (knobs.top_k < st.vocab_limit)) | (knobs.top_p < 1.0)
    any_sampling = jnp.any(sampling_rows)
    any_filter = jnp.any(sampling_rows & filters)
    row_knobs = (knobs.temperature, knobs.top_k, knobs.top_p, knobs.min_p)

    def choose(logits, key, temperature, top_k, top_p, min_p, processed=None):
        return sampling.choose_token(logits, key, temperature, top_k, top_p, min_p,
                                     st.vocab_limit, processed, any_sampling=any_sampling,
                                     any_filter=any_filter, with_processed=st.processed_logprobs)

    if st.processors:
        # Computed once per chunk (outside the loop body): each row's stop ids, as [R, V].
        V = cfg.vocab_size
        ids = knobs.min_stop_ids
        rr = jnp.arange(ids.shape[0])[:, None]
        stop_mask = jnp.zeros((ids.shape[0], V), bool).at[rr, jnp.where(ids >= 0, ids, V)].set(
            True, mode="drop")

        def process(logits, t, bias, stops, min_tokens, rep, freq, pres, counts=None,
                    prompt_mask=None):
            return sampling.process_logits(
                logits, t=t, bias=bias, stop_mask=stops, min_tokens=min_tokens, counts=counts,
                prompt_mask=prompt_mask, repetition_penalty=rep, frequency_penalty=freq,
                presence_penalty=pres)

        proc_rows = (knobs.logit_bias, stop_mask, knobs.min_tokens, knobs.repetition_penalty,
                     knobs.frequency_penalty, knobs.presence_penalty)

    choose_rows = _per_row(choose, 2, 4)
    choose_processed = jax.vmap(jax.vmap(choose, (0, 0, None, None, None, None, 0)), (0,) * 7)

    def choose_tokens(s: DecodeState, pos, step_keys):
        if not st.processors:
            out = choose_rows(s.logits, step_keys, *row_knobs)
        else:
            if st.penalties:
                # counts per slot; the prompt mask per row, unbatched over the slots.
                proc = jax.vmap(jax.vmap(process, (0, 0) + (None,) * 6 + (0, None)),
                                (0,) * 10)(s.logits, pos, *proc_rows, s.counts, s.prompt_mask)
            else:
                proc = _per_row(process, 2, 6)(s.logits, pos, *proc_rows)
            out = choose_processed(s.logits, step_keys, *row_knobs, proc)
        tok, lp = out[0], out[1]
        if st.processed_logprobs:  # logprobs_mode per row
            lp = jnp.where(knobs.processed_logprobs[:, None], out[2], lp)
        return tok, lp

    return choose_tokens


def _record(st: Static, s: DecodeState, tok, lp, live, pos, ri, ni) -> Outputs:
    """`s.out` with this step's per-token outputs written: each live slot's own column
    `pos` (a scatter); done slots write nothing (index T: dropped), so a finished
    branch's buffers stay as it left them. Top logprobs, ranks and signals are
    those of the raw logits; a field off keeps its buffer as is."""
    col = jnp.where(live, pos, s.out.tokens.shape[2])

    # This step's per-token outputs, [R, N, ...] (a field off: its buffer as is).
    top = (_vv(lambda x: sampling.top_logprobs(x, st.top_logprobs, st.vocab_limit))(s.logits)
           if st.top_logprobs else (None, None))
    new = Outputs(
        tokens=tok, logprobs=lp, top_logprobs=top[0], top_ids=top[1],
        token_ranks=(_vv(lambda x, k: sampling.token_rank(x, k, st.vocab_limit))(s.logits, tok)
                     if st.token_ranks else None),
        # on the raw logits, like the logprobs: [R, N, 3]
        signals=(_vv(lambda x: sampling.token_signals(x, st.vocab_limit))(s.logits)
                 if st.signals else None))

    def put(buf, val):  # buf [R, N, T, ...] <- val [R, N, ...] at column col[r, n]
        return buf if val is None else buf.at[ri, ni, col].set(val, mode="drop")

    return Outputs(*(None if b is None else put(b, v) for b, v in zip(s.out, new)))


def _forward(st: Static, params, prefix: PrefixCache, bridge_params, context):
    """`advance(s, tok, pos, done, ri, ni) -> (logits, tail_k, tail_v)`: every slot's
    forward pass on its new token (`branch_step`, vmapped over a row's slots with
    the prefix unbatched, then over rows), skipped when every slot is done, and
    its K/V written into the tails."""
    cfg = st.cfg

    # Row-level vmap: prefix per row (in_axes 0); branch-level vmap: prefix unbatched.
    def one_branch(tok, pos, t, pk, pv, plen, tk, tv, alive):
        return branch_step(cfg, params, tok, pos, t, pk, pv, plen, tk, tv,
                           st.post_layer(alive, st.branch_axes), bridge_params, context,
                           st.attention)

    step_branches = jax.vmap(one_branch, in_axes=(0, 0, 0, None, None, None, 0, 0, 0),
                             axis_name=st.branch_axis)
    step_rows = jax.vmap(step_branches, in_axes=(0, 0, 0, 0, 0, 0, 0, 0, 0))

    def advance(s: DecodeState, tok, pos, done, ri, ni):
        def forward(_):
            positions = prefix.lengths[:, None] + pos  # [R, N]
            if context is not None:
                positions = positions + context.length
            # A branch that just stopped no longer influences the others (Bridge).
            return step_rows(tok, positions, pos, prefix.k, prefix.v, prefix.lengths,
                             s.tail_k, s.tail_v, ~done)

        def skip(_):
            zeros = [jnp.zeros(c.shape[:3] + c.shape[4:], c.dtype) for c in s.tail_k]
            return s.logits, zeros, zeros

        # The cond returns only the new K/V: tails updated inside a cond branch
        # would be copied whole every step (a branch cannot update its operand
        # in place). k, v: L x [R, N, K, D]. Each slot writes tail slot pos (pos mod
        # T_l: a local layer's ring), a scatter into the loop carry; a done slot's
        # write is never read (a refilled slot rewrites slot j before reading it at
        # j + 1), and pos < t_cap holds (a slot is done at max_new_tokens <= t_cap).
        logits, k, v = jax.lax.cond(all_done(st, done), skip, forward, None)
        tail_k = tuple(c.at[ri, ni, :, pos % c.shape[3]].set(a)
                       for c, a in zip(s.tail_k, k))
        tail_v = tuple(c.at[ri, ni, :, pos % c.shape[3]].set(a)
                       for c, a in zip(s.tail_v, v))
        return logits, tail_k, tail_v

    return advance
