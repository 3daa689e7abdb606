"""The host side of one request: prefill once, then rounds of branches decoded in chunks.

A `Session` validates and encodes the prompts, prefills them once and keeps
their prefix cache on the device. Each `Round` is one decode state over some
of the session's rows and a set of global branch indices: it runs in chunks
of steps (`Round.run`), between which the host may mark branches done
(`Round.finish_slots`: a stop string, a low confidence) and gather the live
branches into smaller buckets (`Round.compact`). `generate` is one round with
all branches; adaptive self-consistency runs several rounds over the same
prefix cache. The outputs are copied to host arrays indexed by (prompt row,
branch) as each chunk ends, so compaction never loses or moves them.
"""

from __future__ import annotations

import contextlib
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine import inputs
from jaxsample.engine import pool as pool_lib
from jaxsample.engine.context import prefill_context, prefill_suffix
from jaxsample.engine.loop import (PROGRAMS, compact, decode_chunk, init_state, insert_rows,
                                  refill)
from jaxsample.engine.placement import (to_host, kv_bytes, MeshLayout, params_on_mesh, place,
                                        serving_params)
from jaxsample.engine.prefill import prefill, take_rows
from jaxsample.engine.state import (MAX_LOGPROBS, MAX_STOP_IDS, Knobs, PromptLogprobs, Static,
                                    bucket, slot_bucket)
from jaxsample.errors import InputError
from jaxsample.lm import LanguageModel
from jaxsample.sampling import SamplingParams
from jaxsample.sharding import BRANCH_AXIS, LOCAL_BRANCH_AXIS

# ---------------------------------------------------------------------------
# Session


class Session:
    """One request: validated inputs, the prefill, and the rounds decoded over it.

    Args:
      lm, prompts, params, chat, mesh, bridge, prompt_index_offset, naive,
        shared_prefix: as `jaxsample.generate`.
      top_logprobs: k of the top-k log-probabilities to record per token (0: none).
      observer: optional `jaxsample.progress.Progress` (anything with a
        `compiling(name)` context manager): told around every program lookup,
        so a long compile can be shown.
      max_kv_bytes: the byte budget of the prefix caches and the decode pool
        (`engine.pool.plan`; default `pool.default_kv_budget()`); sets
        `pool_shape`, the (rows, slots) a pool of this request may use.

    Raises:
      InputError: as `jaxsample.generate`, before any compute; also a budget
        that cannot hold one row and one slot, or results larger than host
        memory allows (`engine.pool`).
    """

    def __init__(self, lm: LanguageModel, prompts, params: SamplingParams | None = None, *,
                 chat: bool = False, mesh=None, bridge=None, prompt_index_offset: int = 0,
                 naive: bool = False, top_logprobs: int | None = None, observer=None,
                 shared_prefix=None, max_kv_bytes: int | None = None):
        self.t_start = time.perf_counter()
        self.observer = observer
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.seed is None:
            params = params.replace(seed=secrets.randbits(31))
        self.lm, self.params, self.cfg = lm, params, lm.config
        if shared_prefix is None:
            self.context_ids: list[int] = []
            self.ids, self.texts = inputs.encode_prompts(lm, prompts, chat)
        else:
            if naive:
                raise InputError("naive=True is the baseline without sharing; pass "
                                 "shared_prefix=None and put the context in every prompt")
            self.context_ids, self.ids, self.texts = inputs.encode_shared(
                lm, shared_prefix, prompts, chat)
        # self.ids: each prompt's own tokens (after the context, if any); prompt_ids: all
        # the tokens the model saw before the first new one.
        self.prompt_ids = [self.context_ids + x for x in self.ids]
        B, N, T = len(self.ids), params.n, params.max_new_tokens
        self.B, self.N, self.T = B, N, T
        C = len(self.context_ids)
        for i, toks in enumerate(self.ids):
            if C + len(toks) + T > self.cfg.max_seq_len:
                head = f"shared_prefix ({C} tokens) + " if C else ""
                raise InputError(
                    f"{head}prompt {i} has {C + len(toks)} tokens; with max_new_tokens={T} "
                    f"that is {C + len(toks) + T} > the model's context of "
                    f"{self.cfg.max_seq_len} tokens")
        # Stop ids: the model's end ids (unless ignore_eos) and stop_token_ids; min_tokens
        # masks all of them, end ids included even with ignore_eos (vLLM's all_stop_token_ids).
        all_stop_ids = sorted(set(lm.tokenizer.eos_token_ids) | set(params.stop_token_ids))
        stop_ids = (sorted(set(params.stop_token_ids)) if params.ignore_eos else all_stop_ids)
        if len(all_stop_ids) > MAX_STOP_IDS:
            raise InputError(f"at most {MAX_STOP_IDS} stop token ids (the model's end ids and "
                             f"stop_token_ids) are supported, got {len(all_stop_ids)}")
        bad_bias = [i for i, _ in params.logit_bias if i >= lm.vocab_limit]
        if bad_bias:
            raise InputError(f"SamplingParams.logit_bias has token ids outside the vocabulary "
                             f"[0, {lm.vocab_limit}): {bad_bias[:5]}")
        mesh, data_axis, self.nb, self.nd = inputs.resolve_mesh(mesh, N)
        if isinstance(prompt_index_offset, bool) or not isinstance(
                prompt_index_offset, (int, np.integer)) or not 0 <= prompt_index_offset < 2**31 - B:
            raise InputError(f"prompt_index_offset must be an int in [0, 2**31 - B), "
                             f"got {prompt_index_offset!r}")
        if naive and (mesh is not None or bridge is not None):
            raise InputError("naive=True is a single-device baseline without Bridge; "
                             "pass mesh=None and bridge=None")
        k = params.logprobs if top_logprobs is None else top_logprobs
        k = inputs.check_int("top_logprobs", k or 0, 0, MAX_LOGPROBS)
        self.mesh, self.naive, self.offset = mesh, naive, int(prompt_index_offset)
        self.m = None if mesh is None else MeshLayout(mesh, data_axis)
        self.bridge_cfg = None if bridge is None else bridge.config
        self.bridge_params = None if bridge is None else bridge.params
        self.model_params = serving_params(lm) if mesh is None else params_on_mesh(lm, mesh)
        self.bridge_dev = (self.bridge_params if mesh is None or bridge is None
                           else place(self.bridge_params, self.m.rep))
        self.timings = {"compile": 0.0, "prefill": 0.0, "decode": 0.0, "host": 0.0}
        if C:
            self.timings["prefill_context"] = 0.0  # part of "prefill"
        self.st = Static(cfg=self.cfg, n=1, t_cap=bucket(T), vocab_limit=lm.vocab_limit,
                         pad_id=int(lm.tokenizer.pad_token_id), top_logprobs=k,
                         axes=((BRANCH_AXIS,) + ((data_axis,) if data_axis else ())) if mesh else (),
                         branch_axis=LOCAL_BRANCH_AXIS if mesh else BRANCH_AXIS,
                         branch_axes=(LOCAL_BRANCH_AXIS, BRANCH_AXIS) if mesh else (BRANCH_AXIS,),
                         bridge=self.bridge_cfg, processors=params.logits_processors,
                         penalties=params.penalties, token_ranks=params.logprobs is not None,
                         signals=params.signals)
        self.prompt_k = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        pad_ids = lambda ids: np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)
        assert T <= self.st.t_cap  # tail writes stay in range: dynamic_update_slice would clamp
        self.knobs = Knobs(
            temperature=np.float32(params.temperature),
            top_k=np.int32(min(params.top_k, lm.vocab_limit)),  # k >= V is off either way
            top_p=np.float32(params.top_p), min_p=np.float32(params.min_p),
            seed=np.uint32(params.seed), max_new_tokens=np.int32(T),
            stop_ids=pad_ids(stop_ids), t_stop=np.int32(T),
            logit_bias=params.bias_vector(self.cfg.vocab_size if self.st.processors else 0),
            min_tokens=np.int32(params.min_tokens), min_stop_ids=pad_ids(all_stop_ids),
            repetition_penalty=np.float32(params.repetition_penalty),
            frequency_penalty=np.float32(params.frequency_penalty),
            presence_penalty=np.float32(params.presence_penalty))
        # Rows: one per prompt (shared) or one per (prompt, branch) copy (naive).
        self.row_prompt = [r for r in range(B) for _ in range(N)] if naive else list(range(B))
        self.decode_steps = 0
        self.branch_steps = 0
        self._plan(max_kv_bytes)
        self._prefill()

    def _plan(self, max_kv_bytes):
        """Refuse requests that can never run, and size the pool (before any compute)."""
        st = self.st
        flags = dict(top_logprobs=st.top_logprobs, token_ranks=st.token_ranks,
                     signals=st.signals)
        pool_lib.check_results_fit(self.B, self.N, self.T, **flags)
        if max_kv_bytes is not None:
            max_kv_bytes = inputs.check_int("max_kv_bytes", max_kv_bytes, 1, 2**62)
        budget = pool_lib.default_kv_budget() if max_kv_bytes is None else max_kv_bytes
        self.kv_budget = budget
        if self.naive:
            self.pool_shape = (len(self.row_prompt), 1)
            return
        C = len(self.context_ids)
        p_cap = bucket(max(len(x) for x in self.ids))
        rows, slots = pool_lib.plan(
            self.cfg, B=self.B, n=self.N, p_cap=p_cap, t_cap=st.t_cap, budget=budget,
            context_bytes=pool_lib._kv(self.cfg, bucket(C)) if C else 0, nd=self.nd,
            nb=self.nb, penalties=st.penalties, **flags)
        if self.bridge_cfg is not None and slots < self.N:
            raise InputError(f"max_kv_bytes={budget:,} holds {slots} branch(es) per row; a "
                             f"Bridge needs all n={self.N} of a prompt at once")
        self.pool_shape = (rows, slots)

    # -- prefill ------------------------------------------------------------

    def _prefill(self):
        self.context = None
        self.context_bytes = (0, 0, 0)
        ctx_lp = None
        if self.context_ids:
            ctx_lp = self._prefill_context()
        rows = self.row_prompt
        R = len(rows)
        R_pad = -(-R // self.nd) * self.nd  # a data axis must divide the rows
        p_cap = bucket(max(len(self.ids[r]) for r in rows))
        tokens = np.zeros((R_pad, p_cap), np.int32)
        lengths = np.ones((R_pad,), np.int32)
        for j, r in enumerate(rows):
            tokens[j, :len(self.ids[r])] = self.ids[r]
            lengths[j] = len(self.ids[r])
        cfg, st, pk, vl = self.cfg, self.st, self.prompt_k, self.st.vocab_limit
        if self.context is None:
            fn = lambda p, t, n, b: prefill(cfg, p, t, n, st.post_layer(True, ()), b,
                                            prompt_logprobs=pk, vocab_limit=vl)
            extra_args, extra_specs = (), ()
            name = "prefill"
        else:  # the suffixes after the common context
            fn = lambda p, t, n, b, c, cl: prefill_suffix(
                cfg, p, c, t, n, st.post_layer(True, ()), b, prompt_logprobs=pk,
                vocab_limit=vl, ctx_logits=cl)
            extra_args = (self.context, self.context_last)
            extra_specs = () if self.m is None else (self.m.context_spec, self.m.Ps())
            name = "prefill_suffix"
        if self.m is None:
            args = (self.model_params, jnp.asarray(tokens), jnp.asarray(lengths),
                    self.bridge_params) + extra_args
        else:
            m = self.m
            extra = (PromptLogprobs(*([m.Ps(m.d)] * 4)),) if pk >= 0 else ()
            fn = m.shard_map(fn, (m.Ps(), m.Ps(m.d), m.Ps(m.d), m.Ps()) + tuple(extra_specs),
                             (m.prefix_spec, m.Ps(m.d)) + extra)
            args = (self.model_params, place(tokens, m.rows), place(lengths, m.rows),
                    self.bridge_dev) + extra_args
        prog = self.program((name, cfg, self.bridge_cfg, self.mesh, pk, vl), fn, args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(prog(*args))
        self.prefix, self.last = out[:2]
        self.timings["prefill"] += time.perf_counter() - t0
        self.prompt_logprobs = None
        if pk >= 0:  # host arrays per prompt: entry j is about prompt token j + 1
            lp = PromptLogprobs(*map(to_host, out[2]))
            first = {}  # the first row of each prompt (naive rows are copies)
            for j, r in enumerate(rows):
                first.setdefault(r, j)
            if ctx_lp is None:
                self.prompt_logprobs = [
                    PromptLogprobs(*(a[first[b], :len(self.ids[b]) - 1] for a in lp))
                    for b in range(self.B)]
            else:  # the context's C - 1 entries, then the row's: entry 0 is about its token 0
                C = len(self.context_ids)
                self.prompt_logprobs = [
                    PromptLogprobs(*(np.concatenate([c[:C - 1], a[first[b], :len(self.ids[b])]])
                                     for c, a in zip(ctx_lp, lp)))
                    for b in range(self.B)]
        self.rows_alloc = R_pad
        self.prefix_bytes = kv_bytes(self.prefix.k + self.prefix.v, R, R_pad)

    def _prefill_context(self):
        """Prefill the common context once (replicated on a mesh); returns its
        host PromptLogprobs (`[C]`) with prompt logprobs, else None."""
        ids = self.context_ids
        c_cap = bucket(len(ids))
        tokens = np.zeros((c_cap,), np.int32)
        tokens[:len(ids)] = ids
        length = np.int32(len(ids))
        cfg, st, pk, vl = self.cfg, self.st, self.prompt_k, self.st.vocab_limit
        fn = lambda p, t, n, b: prefill_context(cfg, p, t, n, st.post_layer(True, ()), b,
                                                prompt_logprobs=pk, vocab_limit=vl)
        if self.m is None:
            args = (self.model_params, jnp.asarray(tokens), jnp.asarray(length),
                    self.bridge_params)
        else:
            m = self.m
            extra = (PromptLogprobs(*([m.Ps()] * 4)),) if pk >= 0 else ()
            fn = m.shard_map(fn, (m.Ps(),) * 4, (m.context_spec, m.Ps()) + extra)
            args = (self.model_params, place(tokens, m.rep), place(length, m.rep),
                    self.bridge_dev)
        prog = self.program(("prefill_context", cfg, self.bridge_cfg, self.mesh, pk, vl), fn,
                            args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(prog(*args))
        dt = time.perf_counter() - t0
        self.timings["prefill"] += dt
        self.timings["prefill_context"] += dt
        self.context, self.context_last = out[:2]
        self.context_bytes = kv_bytes(self.context.k + self.context.v, 1, 1)
        return PromptLogprobs(*map(to_host, out[2])) if pk >= 0 else None

    # -- rounds ---------------------------------------------------------------

    def round(self, rows, branch_ids, max_rows: int | None = None,
              max_slots: int | None = None, lockstep: bool = False) -> "Round":
        """A fresh decode state over some prefilled rows.

        Args:
          rows: R' row indices into the session's rows (prompts; prompt copies
            when naive).
          branch_ids: `[R', N']` global branch index of each slot (-1: a
            padding slot that starts done).
          max_rows, max_slots: the device state's rows and slots per row
            (default: R' x N', all admitted at once); fewer make the round a
            pool that refills slots and rows as branches finish (`Round`).
          lockstep: never refill a slot inside a row (Bridge).
        """
        return Round(self, list(rows), np.asarray(branch_ids, np.int32), max_rows, max_slots,
                     lockstep)

    def program(self, key, fn, args, **kwargs):
        """`PROGRAMS.get(key, fn, args, **kwargs)`: the compiled program; the
        seconds spent compiling are added to `timings["compile"]`, and the
        observer (if any) is told while it compiles (`key[0]` names it; a
        handle with `cancel()` may come back: called when nothing compiled,
        and `from_cache()` if it has one: called when JAX's persistent
        compilation cache served the program)."""
        ctx = (self.observer.compiling(str(key[0])) if self.observer is not None
               else contextlib.nullcontext())
        with ctx as handle:
            prog, dt = PROGRAMS.get(key, fn, args, **kwargs)
            if dt == 0.0 and handle is not None:
                handle.cancel()  # found compiled: nothing to report
            elif PROGRAMS.last_from_cache and hasattr(handle, "from_cache"):
                handle.from_cache()  # fetched, not compiled: say so
        self.timings["compile"] += dt
        return prog

    @property
    def state_spec(self):
        """The DecodeState's partition specs on the mesh (with or without signals)."""
        return self.m.state_spec_signals if self.st.signals else self.m.state_spec

    def knob_args(self, t_stop: int):
        knobs = self.knobs._replace(t_stop=np.int32(t_stop))
        return knobs if self.m is None else place(knobs, self.m.rep)

    def put(self, x, kind: str):
        """A host array placed as the engine's programs expect ("rows", "slots", "rep")."""
        if self.m is None:
            return jnp.asarray(x)
        return place(x, getattr(self.m, kind))

    def gather(self, name: str, fn, args, out_specs):
        """Run a row/slot gather (`take_rows`, `compact`) and place its outputs.

        On a mesh the operands are first replicated (a gather across shards
        has no unambiguous output sharding), then the outputs are placed with
        the specs the decode programs expect: a compaction moves data across
        devices once, which is what makes later steps cheaper.
        """
        if self.m is None:
            return self.program((name,), fn, args)(*args)
        rep = jax.tree_util.tree_map(lambda a: jax.device_put(a, self.m.rep), args)
        out = self.program((name, self.mesh), fn, rep)(*rep)
        return jax.tree_util.tree_map(
            lambda spec, sub: jax.tree_util.tree_map(
                lambda a: jax.device_put(a, self.m.NamedSharding(self.mesh, spec)), sub),
            out_specs, out, is_leaf=lambda x: isinstance(x, self.m.Ps))


class Round:
    """One decode state: rows x slots, decoded in chunks (see the module docstring).

    The device state holds `R_dev` rows x `N_dev` slots; by default every
    round row and every branch column has its own (`generate`: all admitted
    at once). Given fewer (`rows=`, `slots=`), the round is a pool
    (continuous batching, vLLM; JetStream's prefill / insert / generate, with
    the prefix shared by the row's slots instead of copied into each): before
    each chunk the host gives every finished slot the next waiting branch of
    its row's prompt (`loop.refill`), frees a row whose prompt has no branch
    left to run, and inserts the next waiting prompt into it
    (`loop.insert_rows`, from the session's prefill). Slots run at their own
    token index, keys come from (prompt index, branch id), so a branch's
    tokens depend neither on the pool's size, its slot, nor its neighbours.
    With `lockstep=True` (Bridge: a prompt's branches attend to each other at
    the same position) slots are never refilled inside a row: a prompt enters
    with all its branches, rows are refilled only.

    Host-side outputs (indexed by the round's own rows and branch columns):
      tokens `[R, N, T]` int32, logprobs `[R, N, T]` float32, top_logprobs and
      top_ids `[R, N, T, k]`, token_ranks `[R, N, T]` int32 (`[R, N, 0]`
      without `SamplingParams.logprobs`), lengths `[R, N]` int32, stopped `[R, N]` bool
      (ended by a stop token), done `[R, N]` bool, signals `[R, N, T, 3]`
      float32 (entropy, self-certainty, top-2 margin) with
      `SamplingParams.signals`, else None.

    Raises:
      ValueError: `slots` smaller than a prompt's branches with `lockstep`, or
        `branch_ids` not `[R, N]`.
    """

    def __init__(self, session: Session, rows: list[int], branch_ids: np.ndarray,
                 max_rows: int | None = None, max_slots: int | None = None,
                 lockstep: bool = False):
        s = session
        self.s = s
        R, N = len(rows), branch_ids.shape[1]
        if branch_ids.shape[0] != R:
            raise ValueError(f"branch_ids must be [{R}, N], got {branch_ids.shape}")
        T, k = s.T, s.st.top_logprobs
        self.R, self.N = R, N
        self.branch_ids = branch_ids
        self.tokens = np.full((R, N, T), s.st.pad_id, np.int32)
        self.logprobs = np.zeros((R, N, T), np.float32)
        self.top_logprobs = np.zeros((R, N, T, k), np.float32)
        self.top_ids = np.full((R, N, T, k), s.st.pad_id, np.int32)
        self.token_ranks = np.zeros((R, N, T if s.st.token_ranks else 0), np.int32)
        self.signals = np.zeros((R, N, T, 3), np.float32) if s.st.signals else None
        self.lengths = np.zeros((R, N), np.int32)
        self.prev = self.lengths.copy()  # lengths before the last chunk
        self.stopped = np.zeros((R, N), bool)
        self.done = branch_ids < 0
        self.t = 0  # the clock: steps this round has run
        self.lockstep = bool(lockstep)
        # Device slots: a bucket of rows (a multiple of the data axis) x slots
        # (a multiple of the branch axis); slot (i, j) holds round row
        # row_of[i], column col_of[i, j] (-1: empty).
        R_dev = -(-min(R, max_rows or R) // s.nd) * s.nd
        N_dev = -(-min(N, max_slots or N) // s.nb) * s.nb
        valid = branch_ids >= 0
        if self.lockstep and int(valid.sum(axis=1).max(initial=0)) > N_dev:
            raise ValueError(f"lockstep (Bridge) rows need every branch of a prompt at once: "
                             f"{int(valid.sum(axis=1).max())} branches > {N_dev} slots")
        placed = min(R, R_dev)
        self.row_of = np.array(list(range(placed)) + [0] * (R_dev - placed), np.int64)
        self.row_placed = np.arange(R_dev) < placed
        self.col_of = np.full((R_dev, N_dev), -1, np.int64)
        self.waiting: dict[int, list[int]] = {}  # round row -> its branch columns not yet run
        for i in range(placed):
            cols = np.nonzero(valid[i])[0]
            if N_dev >= N:  # every column in its own slot (the layout of a plain round)
                self.col_of[i, :N] = np.where(valid[i], np.arange(N), -1)
            else:
                self.col_of[i, :min(cols.size, N_dev)] = cols[:N_dev]
                self.waiting[i] = [int(c) for c in cols[N_dev:]]
        self.queue = list(range(placed, R))  # round rows not yet in the pool
        # Per round row: only branch columns < admit[r] may take a slot (the host
        # raises it: DeepConf's warm-up must finish before later branches start).
        self.admit = np.full(R, N, np.int64)
        prefix_rows = np.array([rows[i] for i in self.row_of[:placed]], np.int32)
        # Padding rows: the session's own padding rows when the round takes every
        # prompt (no gather), else repeats of the first row.
        fill = (np.arange(R, R_dev) if list(rows) == list(range(R)) and R_dev == s.rows_alloc
                else np.full(R_dev - placed, prefix_rows[0]))
        prefix_rows = np.concatenate([prefix_rows, fill]).astype(np.int32)
        self.live_rows_alloc = R_dev
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        ids = np.where(self.col_of >= 0, branch_ids[rr, np.maximum(self.col_of, 0)],
                       0).astype(np.int32)
        pidx = np.array([s.offset + s.row_prompt[r] if r < len(s.row_prompt) else 0
                         for r in prefix_rows], np.int32)
        live = self.col_of >= 0
        live[~self.row_placed] = False
        self.rows = rows
        self._start(prefix_rows, pidx, ids, live)

    # -- device programs ------------------------------------------------------

    def _static(self, n_dev: int) -> Static:
        import dataclasses

        return dataclasses.replace(self.s.st, n=n_dev // self.s.nb)

    def _mask(self, session_rows) -> np.ndarray:
        """`[M, V]` bool the prompt tokens of some session rows (repetition penalty;
        `[M, 0]` without penalties)."""
        s = self.s
        V = s.cfg.vocab_size if s.st.penalties else 0
        mask = np.zeros((len(session_rows), V), bool)
        if s.st.penalties:
            for j, r in enumerate(session_rows):
                if 0 <= r < len(s.row_prompt):
                    mask[j, s.prompt_ids[s.row_prompt[r]]] = True
        return mask

    def _start(self, prefix_rows, pidx, ids, live):
        s = self.s
        if np.array_equal(prefix_rows, np.arange(s.rows_alloc)):
            prefix, last = s.prefix, s.last
        else:
            out_specs = None if s.m is None else (s.m.prefix_spec, s.m.Ps(s.m.d))
            prefix, last = s.gather("take_rows", take_rows, (s.prefix, s.last,
                                                             jnp.asarray(prefix_rows)), out_specs)
        st = self._static(ids.shape[1])
        # The prompts' tokens as a [R, V] mask (repetition penalty), built on the host.
        mask = self._mask(prefix_rows)
        fn = lambda l, p, b, v, pm: init_state(st, l, p, b, v, pm)
        args = (last, s.put(pidx, "rows"), s.put(ids, "slots"), s.put(live, "slots"),
                s.put(mask, "rows"))
        if s.m is not None:
            m = s.m
            fn = m.shard_map(fn, (m.Ps(m.d), m.Ps(m.d), m.Ps(m.d, BRANCH_AXIS),
                                  m.Ps(m.d, BRANCH_AXIS), m.Ps(m.d)), s.state_spec)
        prog = s.program(("init", st, s.mesh), fn, args)
        self.prefix, self.last, self.state = prefix, last, prog(*args)
        # The tails as first allocated (the largest they get: compaction shrinks them).
        self.tail_bytes = kv_bytes(self.state.tail_k + self.state.tail_v, self.R,
                                    ids.shape[0])

    @property
    def waiting_branches(self) -> int:
        """Branches not yet given a slot (in rows in the pool, and in waiting rows)."""
        queued = sum(int(((self.branch_ids[r] >= 0) & ~self.done[r]).sum())
                     for r in self.queue)
        return sum(len(w) for w in self.waiting.values()) + queued

    def _schedule(self):
        """Before a chunk: refill finished slots with their row's waiting branches,
        free settled rows, and insert waiting prompts into free rows."""
        if not self.queue and not any(self.waiting.values()):
            return
        s = self.s
        R_dev, N_dev = self.col_of.shape
        reset = np.zeros((R_dev, N_dev), bool)
        new_ids = np.zeros((R_dev, N_dev), np.int32)
        live = np.zeros((R_dev, N_dev), bool)
        free_rows = []
        for i in range(R_dev):
            if not self.row_placed[i]:
                free_rows.append(i)
                continue
            r = int(self.row_of[i])
            cols = self.col_of[i]
            free = (cols < 0) | self.done[r, np.maximum(cols, 0)]
            w = [c for c in self.waiting.get(r, []) if not self.done[r, c]]
            if not self.lockstep:
                for j in np.nonzero(free)[0]:
                    if not w or w[0] >= self.admit[r]:
                        break
                    c = w.pop(0)
                    self.col_of[i, j] = c
                    reset[i, j] = live[i, j] = True
                    new_ids[i, j] = self.branch_ids[r, c]
                    free[j] = False
            self.waiting[r] = w
            if free.all() and not w:  # the prompt is settled: the row is free
                self.waiting.pop(r, None)
                self.row_placed[i] = False
                self.col_of[i] = -1
                free_rows.append(i)
        inserted = []
        for i in free_rows:
            if not self.queue:
                break
            r = self.queue.pop(0)
            cols = np.nonzero((self.branch_ids[r] >= 0) & ~self.done[r])[0]
            if cols.size == 0:
                continue
            first = cols[cols < self.admit[r]][:N_dev]
            rest = [int(c) for c in cols if c not in set(first.tolist())]
            cols = np.concatenate([first, np.array(rest, np.int64)]).astype(np.int64)
            self.row_of[i], self.row_placed[i] = r, True
            self.col_of[i] = -1
            m = first.size
            self.col_of[i, :m] = first
            self.waiting[r] = rest
            reset[i] = True
            live[i, :m] = True
            new_ids[i, :m] = self.branch_ids[r, first]
            inserted.append((i, r))
        if inserted:
            self._insert(inserted)
        if reset.any():
            self._refill(reset, new_ids, live)

    def _insert(self, inserted):
        s = self.s
        R_dev = self.col_of.shape[0]
        M = slot_bucket(len(inserted))
        dest = np.full((M,), R_dev, np.int32)  # R_dev: dropped (padding)
        src = np.zeros((M,), np.int32)
        for j, (i, r) in enumerate(inserted):
            dest[j], src[j] = i, self.rows[r]
        pidx = np.array([s.offset + s.row_prompt[r] for r in src], np.int32)
        mask = self._mask(src)
        args = (self.prefix, self.last, self.state.prompt_index, self.state.prompt_mask,
                s.prefix, s.last, jnp.asarray(src), jnp.asarray(dest), jnp.asarray(pidx),
                jnp.asarray(mask))
        out_specs = (None if s.m is None
                     else (s.m.prefix_spec, s.m.Ps(s.m.d), s.m.Ps(s.m.d), s.m.Ps(s.m.d)))
        t0, c0 = time.perf_counter(), s.timings["compile"]
        self.prefix, self.last, pi, pm = jax.block_until_ready(
            s.gather("insert_rows", insert_rows, args, out_specs))
        self.state = self.state._replace(prompt_index=pi, prompt_mask=pm)
        s.timings["decode"] += time.perf_counter() - t0 - (s.timings["compile"] - c0)

    def _refill(self, reset, new_ids, live):
        s = self.s
        fn = refill
        args = (self.state, self.last, s.put(reset, "slots"), s.put(new_ids, "slots"),
                s.put(live, "slots"))
        if s.m is not None:
            m = s.m
            sl = m.Ps(m.d, BRANCH_AXIS)
            fn = m.shard_map(fn, (s.state_spec, m.Ps(m.d), sl, sl, sl), s.state_spec)
        prog = s.program(("refill", self._static(self.col_of.shape[1]), s.mesh), fn, args,
                         donate=(0,))
        self.state = prog(*args)

    def run(self, steps: int) -> bool:
        """Refill the pool (`_schedule`), decode up to `steps` more steps, and copy
        the new tokens to the host arrays.

        Returns:
          True while some branch is live or waiting.
        """
        s = self.s
        self._schedule()
        if self.waiting_branches and not self._live_slots().any():
            raise RuntimeError("the pool has waiting branches but no live slot: a row's "
                               "admit limit was never raised")
        t0 = self.t
        t_stop = t0 + max(int(steps), 1)
        st = self._static(self.col_of.shape[1])
        fn = lambda p, pre, state, kn, bp, c: decode_chunk(st, p, pre, state, kn, bp, c)
        args = (s.model_params, self.prefix, self.state, s.knob_args(t_stop), s.bridge_dev,
                s.context)
        if s.m is not None:
            m = s.m
            fn = m.shard_map(fn, (m.Ps(), m.prefix_spec, s.state_spec, m.knob_spec, m.Ps(),
                                  m.context_spec), s.state_spec)
        prog = s.program(("decode", st, s.mesh), fn, args, donate=(2,))
        t_run = time.perf_counter()
        self.state = jax.block_until_ready(prog(*args))
        s.timings["decode"] += time.perf_counter() - t_run
        t_host = time.perf_counter()
        t1 = int(to_host(self.state.t))
        ran = t1 - t0
        s.decode_steps += ran
        s.branch_steps += ran * self.col_of.size
        self.t = t1
        self._collect()
        s.timings["host"] += time.perf_counter() - t_host
        return bool((~self.done).any())

    def _live_slots(self) -> np.ndarray:
        """`[R_dev, N_dev]` bool: slots holding a branch the host has not seen finish."""
        real = self.col_of >= 0
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        live = np.zeros(self.col_of.shape, bool)
        live[real] = ~self.done[rr[real], self.col_of[real]]
        return live

    def _collect(self):
        """Copy each slot's new tokens (its columns from the host's length to the
        device's) and every slot's flags to the host arrays."""
        st = self.state
        done = to_host(st.done)
        lengths = to_host(st.lengths)
        stopped = to_host(st.stopped)
        real = self.col_of >= 0
        ri = np.broadcast_to(self.row_of[:, None], self.col_of.shape)[real]
        ci = self.col_of[real]
        self.prev = self.lengths.copy()
        l0, l1 = self.lengths[ri, ci], lengths[real]
        grew = l1 > l0
        if grew.any():
            a, b = int(l0[grew].min()), int(l1[grew].max())
            j = np.arange(a, b)
            si, wi = np.nonzero((j[None] >= l0[:, None]) & (j[None] < l1[:, None]))
            dst = (ri[si], ci[si], a + wi)
            sl = (slice(None), slice(None), slice(a, b))
            take = lambda x: to_host(x[sl])[real][si, wi]
            self.tokens[dst] = take(st.tokens)
            self.logprobs[dst] = take(st.logprobs)
            if self.s.st.top_logprobs:
                self.top_logprobs[dst] = take(st.top_logprobs)
                self.top_ids[dst] = take(st.top_ids)
            if self.s.st.token_ranks:
                self.token_ranks[dst] = take(st.token_ranks)
            if self.s.st.signals:
                self.signals[dst] = take(st.signals)
        self.lengths[ri, ci] = l1
        self.stopped[ri, ci] = stopped[real]
        self.done[ri, ci] = done[real] | self.done[ri, ci]

    def new_tokens(self, t0=None):
        """(row, column, new tokens excluding a final stop token) of every branch
        that decoded something in the last chunk (`t0`, the old global start
        token, is ignored: slots of a pool run at their own positions)."""
        out = []
        for r, c in zip(*np.nonzero(self.lengths > self.prev)):
            L = int(self.lengths[r, c])
            p = int(self.prev[r, c])
            end = L - 1 if self.stopped[r, c] else L
            out.append((int(r), int(c), self.tokens[r, c, p:max(end, p)]))
        return out

    def finish_slots(self, mask: np.ndarray):
        """Mark branches done from the host (`mask [R, N]` bool, round rows x
        columns); a branch not yet in a slot is then never run."""
        mask = np.asarray(mask, bool) & ~self.done
        if not mask.any():
            return
        self.done |= mask
        real = self.col_of >= 0
        dev = np.zeros(self.col_of.shape, bool)
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        dev[real] = mask[rr[real], self.col_of[real]]
        if dev.any():
            done = to_host(self.state.done) | dev
            self.state = self.state._replace(done=self.s.put(done, "slots"))

    def compact(self) -> bool:
        """Gather the live branches into smaller buckets when that halves a dimension
        (only once nothing waits for a slot: a pool refills instead).

        Returns:
          True if the state was compacted.
        """
        s = self.s
        if self.waiting_branches:
            return False
        real = self.col_of >= 0
        rr = np.broadcast_to(self.row_of[:, None], self.col_of.shape)
        live = np.zeros(self.col_of.shape, bool)
        live[real] = ~self.done[rr[real], self.col_of[real]]
        per_row = live.sum(axis=1)
        rows_live = np.nonzero(per_row)[0]
        if rows_live.size == 0:
            return False
        R_dev, N_dev = self.col_of.shape
        N_new = min(slot_bucket(int(per_row.max()), s.nb), N_dev)
        R_new = min(slot_bucket(rows_live.size, s.nd), R_dev)
        if N_new * 2 > N_dev and R_new * 2 > R_dev:
            return False
        src_rows = np.concatenate([rows_live, np.repeat(rows_live[:1], R_new - rows_live.size)])
        slots = np.zeros((R_new, N_new), np.int32)
        new_live = np.zeros((R_new, N_new), bool)
        col_of = np.full((R_new, N_new), -1, np.int64)
        for i, r in enumerate(src_rows):
            if i >= rows_live.size:
                slots[i] = 0
                continue
            cols = np.nonzero(live[r])[0]
            slots[i, :cols.size] = cols
            slots[i, cols.size:] = cols[0]
            new_live[i, :cols.size] = True
            col_of[i, :cols.size] = self.col_of[r, cols]
        t0, c0 = time.perf_counter(), s.timings["compile"]
        args = (self.prefix, self.state, jnp.asarray(src_rows, jnp.int32), jnp.asarray(slots),
                jnp.asarray(new_live))
        out_specs = None if s.m is None else (s.m.prefix_spec, s.state_spec)
        self.prefix, self.state = jax.block_until_ready(s.gather("compact", compact, args,
                                                                 out_specs))
        s.timings["decode"] += time.perf_counter() - t0 - (s.timings["compile"] - c0)
        self.row_of = self.row_of[src_rows]
        self.row_placed = np.arange(R_new) < rows_live.size
        self.last = None  # no refill after a compaction (nothing waits)
        self.col_of = col_of
        return True
