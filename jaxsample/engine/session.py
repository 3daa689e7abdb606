"""The host side of one request: validate, encode and prefill the prompts once.

A `Session` validates and encodes the prompts, prefills them once and keeps
their prefix cache on the device (sized by `budget.py`); `Session.round`
starts a `Round` (round.py), one decode state over some of its rows, run in
chunks: `generate` is one round with every branch admitted, adaptive
self-consistency one pool of `window` slots per prompt.
"""

from __future__ import annotations

import contextlib
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import kernels
from jaxsample.engine import budget as budget_lib
from jaxsample.engine import inputs
from jaxsample.engine.buckets import bucket
from jaxsample.engine.context import prefill_context, prefill_suffix
from jaxsample.engine.loop import PROGRAMS
from jaxsample.engine.placement import (
    MeshLayout,
    kv_bytes,
    params_on_mesh,
    place,
    serving_params,
    to_host,
)
from jaxsample.engine.prefill import prefill
from jaxsample.engine.round import Round
from jaxsample.engine.state import (
    MAX_STOP_IDS,
    Knobs,
    PrefixCache,
    PromptLogprobs,
    Static,
    prefix_kv_dtype,
)
from jaxsample.errors import InputError
from jaxsample.lm import LanguageModel
from jaxsample.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxsample.sharding import BRANCH_AXIS, LOCAL_BRANCH_AXIS

# ---------------------------------------------------------------------------
# Session


class Session:
    """Requests sharing one decode state: validated inputs, the prefill, the rounds.

    Each prompt carries its own `SamplingParams` (one for all, or one per
    prompt): n, max_tokens, the sampling values, stop ids and strings and the
    seed are per prompt (traced per row, `Knobs`), so a list of mixed requests
    runs in one pool with one decode program. What changes the step's code
    (`Static`: logits processors, penalties, top logprobs, ranks, signals,
    processed logprobs) is the union of what the prompts ask for.

    Keys (`step.branch_keys`): branch n of prompt b draws from
    fold_in(fold_in(key(seed), key index), n), folded with the token index.
    By default the prompts are one batch: `SamplingParams.seed` (one for all)
    is the batch's seed, and prompt b's key index is its position
    `prompt_index_offset + b`, so a data set split over calls keeps its draws
    (`jaxsample.generate`). With `request_seeds` each prompt is a request
    (vLLM's rule, `jaxsample.LLM`): a prompt whose params carry a seed draws
    from (that seed, key index 0) alone, wherever it stands; a prompt without
    one from (`seed`, its position).

    Args:
      lm, prompts, chat, mesh, bridge, prompt_index_offset, naive,
        shared_prefix, attention: as `jaxsample.generate`; `chat` may also be one bool
        per prompt.
      params: one `SamplingParams` for every prompt, a list of B (one per
        prompt), or None (`SamplingParams()`).
      seed: the seed of prompts whose params have none (with `request_seeds`),
        or the batch's seed instead of `SamplingParams.seed`; an int in
        [0, 2**32), None for the params' seed or, without one, a random one
        (`engine_seed` records it).
      request_seeds: each prompt's `SamplingParams.seed` is its own (above).
      encoded: optional (B token-id lists, B rendered texts or None), the
        prompts already encoded (`inputs.encode_prompts`): not encoded again.
      top_logprobs: k of the top-k log-probabilities to record per token
        (default: the largest `logprobs` of the prompts; 0: none).
      observer: optional `jaxsample.progress.Progress` (anything with a
        `compiling(name)` context manager): told around every program lookup,
        so a long compile can be shown.
      max_kv_bytes: the byte budget of the prefix caches and the decode pool
        (`engine.budget.plan`; default `budget.default_kv_budget()`); sets
        `pool_shape`, the (rows, slots) a pool of this request may use.
      lazy_prefill: prefill each prompt when a pool row takes it
        (`prefill_rows`, called by `round.Round`) instead of every prompt
        here; also when the budget's plan is a pool (then only the pool's
        rows hold prefix caches). Never with `naive`.

    Raises:
      InputError: as `jaxsample.generate`, before any compute; also a budget
        that cannot hold one row and one slot, or results larger than host
        memory allows (`engine.budget`).
    """

    def __init__(self, lm: LanguageModel, prompts, params=None, *,
                 chat=False, mesh=None, bridge=None, prompt_index_offset: int = 0,
                 naive: bool = False, top_logprobs: int | None = None, observer=None,
                 shared_prefix=None, max_kv_bytes: int | None = None,
                 lazy_prefill: bool = False, seed: int | None = None,
                 request_seeds: bool = False, encoded=None, max_model_len: int | None = None,
                 attention: str = "auto"):
        self.t_start = time.perf_counter()
        attention = kernels.resolve_attention(attention, lm.config)
        self.observer = observer
        self.lm, self.cfg = lm, lm.config
        self._encode(prompts, chat, naive, shared_prefix, encoded)
        pp = self._settle_params(params, seed, request_seeds, prompt_index_offset)
        self._check_lengths(max_model_len)
        stop_ids, all_stop_ids = self._stop_ids(pp)
        mesh, data_axis = self._check_layout(mesh, bridge, naive)
        k = max((p.logprobs or 0) for p in pp) if top_logprobs is None else top_logprobs
        k = inputs.check_int("top_logprobs", k or 0, 0, MAX_LOGPROBS)
        self.k_of = [min(p.logprobs or 0, k) for p in pp]
        self._place(mesh, data_axis, bridge, naive)
        self.timings = {"compile": 0.0, "prefill": 0.0, "decode": 0.0, "host": 0.0}
        if self.context_ids:
            self.timings["prefill_context"] = 0.0  # part of "prefill"
        self.st = self._static(pp, k, data_axis, attention)
        self.prompt_k = max(-1 if p.prompt_logprobs is None else p.prompt_logprobs for p in pp)
        assert self.T <= self.st.t_cap  # tail writes in range: dynamic_update_slice would clamp
        self.prompt_knobs = self._knobs(pp, stop_ids, all_stop_ids)
        # Rows: one per prompt (shared) or one per (prompt, branch) copy (naive).
        B, N = self.B, self.N
        self.row_prompt = [r for r in range(B) for _ in range(N)] if naive else list(range(B))
        self.decode_steps = 0
        self.branch_steps = 0
        # The prefix bucket of every prompt (the budget's row; rows prefilled lazily
        # at a shorter bucket are padded to it in the pool).
        self.p_cap = bucket(max(len(x) for x in self.ids))
        self._plan(max_kv_bytes)
        self.lazy = not naive and (bool(lazy_prefill) or self.pool_shape != (B, N))
        self._prefill()

    def _encode(self, prompts, chat, naive: bool, shared_prefix, encoded) -> None:
        """The prompts as token ids: `ids` (each prompt's own, after the context),
        `texts`, `context_ids` (the shared prefix's, or none) and `prompt_ids` (all
        the tokens the model sees before the first new one)."""
        lm = self.lm
        if encoded is not None:
            self.context_ids: list[int] = []
            self.ids, self.texts = [list(x) for x in encoded[0]], list(encoded[1])
        elif shared_prefix is None:
            self.context_ids = []
            if isinstance(chat, (list, tuple)):
                encs = [inputs.encode_prompts(lm, [p], bool(c)) for p, c in zip(prompts, chat)]
                self.ids, self.texts = [e[0][0] for e in encs], [e[1][0] for e in encs]
            else:
                self.ids, self.texts = inputs.encode_prompts(lm, prompts, chat)
        else:
            if naive:
                raise InputError("naive=True is the baseline without sharing; pass "
                                 "shared_prefix=None and put the context in every prompt")
            self.context_ids, self.ids, self.texts = inputs.encode_shared(
                lm, shared_prefix, prompts, chat)
        self.prompt_ids = [self.context_ids + x for x in self.ids]

    def _settle_params(self, params, seed, request_seeds: bool,
                       prompt_index_offset) -> list[SamplingParams]:
        """Each prompt's SamplingParams, the engine's seed and each prompt's key (seed,
        key index), n and max_new_tokens; B, N (the most n), T (the most tokens)."""
        B = len(self.ids)
        pp = _per_prompt(params, B)
        if not request_seeds:  # one batch: the params' one seed is the batch's
            batch = {p.seed for p in pp}
            if len(batch) > 1:
                raise InputError(f"params: the prompts of one batch share one seed, got "
                                 f"{sorted(batch, key=str)}")
            seed = pp[0].seed if seed is None else seed
            pp = [p if p.seed is None else p.replace(seed=None) for p in pp]
        if seed is None:
            seed = secrets.randbits(31)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
                or not 0 <= seed < 2**32:
            raise InputError(f"seed must be an int in [0, 2**32), got {seed!r}")
        self.engine_seed = int(seed)
        self.prompt_params = pp
        if isinstance(prompt_index_offset, bool) or not isinstance(
                prompt_index_offset, (int, np.integer)) or not 0 <= prompt_index_offset < 2**31 - B:
            raise InputError(f"prompt_index_offset must be an int in [0, 2**31 - B), "
                             f"got {prompt_index_offset!r}")
        self.offset = int(prompt_index_offset)
        # The one params of a uniform session (what `Generation.params` records, the seed
        # filled in), else None: per-prompt settings are read through `params_of(b)`.
        self.params = self.params_of(0) if all(p == pp[0] for p in pp) else None
        self.seeds = np.array([self.engine_seed if p.seed is None else p.seed for p in pp],
                              np.uint32)
        self.key_index = np.array([self.offset + b if p.seed is None else 0
                                   for b, p in enumerate(pp)], np.int32)
        self.n_of = [p.n for p in pp]
        self.T_of = [p.max_new_tokens for p in pp]
        self.B, self.N, self.T = B, max(self.n_of), max(self.T_of)
        return pp

    def _check_lengths(self, max_model_len) -> None:
        """Each prompt (context included) + its max_new_tokens within the model's context
        (or `max_model_len`, when smaller)."""
        C = len(self.context_ids)
        limit, what = self.cfg.max_seq_len, "the model's context"
        if max_model_len is not None and max_model_len < limit:
            limit, what = int(max_model_len), "max_model_len"
        for i, toks in enumerate(self.ids):
            if C + len(toks) + self.T_of[i] > limit:
                head = f"shared_prefix ({C} tokens) + " if C else ""
                raise InputError(
                    f"{head}prompt {i} has {C + len(toks)} tokens; with max_new_tokens="
                    f"{self.T_of[i]} that is {C + len(toks) + self.T_of[i]} > {what} of "
                    f"{limit} tokens")

    def _stop_ids(self, pp) -> tuple[list[list[int]], list[list[int]]]:
        """(stop ids, the ids min_tokens masks) per prompt, checked with the logit bias.

        Stop ids: the model's end ids (unless ignore_eos) and stop_token_ids; min_tokens
        masks all of them, end ids included even with ignore_eos (vLLM's
        all_stop_token_ids)."""
        lm = self.lm
        eos = set(lm.tokenizer.eos_token_ids)
        stop_ids, all_stop_ids = [], []
        for i, p in enumerate(pp):
            every = sorted(eos | set(p.stop_token_ids))
            if len(every) > MAX_STOP_IDS:
                raise InputError(f"prompt {i}: at most {MAX_STOP_IDS} stop token ids (the "
                                 f"model's end ids and stop_token_ids) are supported, got "
                                 f"{len(every)}")
            all_stop_ids.append(every)
            stop_ids.append(sorted(set(p.stop_token_ids)) if p.ignore_eos else every)
            bad_bias = [t for t, _ in p.logit_bias if t >= lm.vocab_limit]
            if bad_bias:
                raise InputError(f"SamplingParams.logit_bias has token ids outside the "
                                 f"vocabulary [0, {lm.vocab_limit}): {bad_bias[:5]}")
        return stop_ids, all_stop_ids

    def _check_layout(self, mesh, bridge, naive: bool):
        """(the mesh resolved, its data axis or None), `nb` and `nd` (its branch and data
        sizes), with the checks of n against the branch axis, the naive baseline's
        limits and a Bridge's one SamplingParams."""
        mesh, data_axis, self.nb, self.nd = inputs.resolve_mesh(mesh, self.N)
        for i, n in enumerate(self.n_of):
            if n % self.nb:
                raise InputError(f"prompt {i}: params.n ({n}) must be a multiple of the mesh's "
                                 f"{BRANCH_AXIS!r} axis size ({self.nb})")
        if naive and (mesh is not None or bridge is not None):
            raise InputError("naive=True is a single-device baseline without Bridge; "
                             "pass mesh=None and bridge=None")
        if naive and len(set(self.n_of)) > 1:
            raise InputError("naive=True copies every prompt n times: give every prompt the "
                             "same n")
        if bridge is not None and self.params is None:
            raise InputError("a Bridge runs one SamplingParams for every prompt (its branches "
                             "attend to each other in lockstep)")
        return mesh, data_axis

    def _place(self, mesh, data_axis, bridge, naive: bool) -> None:
        """The model's (and the Bridge's) parameters placed for serving, on the mesh if any."""
        lm = self.lm
        self.mesh, self.naive = mesh, naive
        self.m = None if mesh is None else MeshLayout(mesh, data_axis)
        self.bridge_cfg = None if bridge is None else bridge.config
        self.bridge_params = None if bridge is None else bridge.params
        self.model_params = serving_params(lm) if mesh is None else params_on_mesh(lm, mesh)
        self.bridge_dev = (self.bridge_params if mesh is None or bridge is None
                           else place(self.bridge_params, self.m.rep))

    def _static(self, pp, k: int, data_axis, attention: str) -> Static:
        """The step's static settings: what changes its code (the union of the prompts'
        features: processors, penalties, top-k logprobs, ranks, signals), the mesh axes."""
        lm, mesh = self.lm, self.mesh
        return Static(cfg=self.cfg, n=1, t_cap=bucket(self.T), vocab_limit=lm.vocab_limit,
                      pad_id=int(lm.tokenizer.pad_token_id), top_logprobs=k,
                      axes=((BRANCH_AXIS,) + ((data_axis,) if data_axis else ())) if mesh else (),
                      branch_axis=LOCAL_BRANCH_AXIS if mesh else BRANCH_AXIS,
                      branch_axes=(LOCAL_BRANCH_AXIS, BRANCH_AXIS) if mesh else (BRANCH_AXIS,),
                      bridge=self.bridge_cfg, processors=any(p.logits_processors for p in pp),
                      penalties=any(p.penalties for p in pp),
                      token_ranks=any(p.logprobs is not None for p in pp),
                      signals=any(p.signals for p in pp),
                      processed_logprobs=any(p.logprobs_mode == "processed_logprobs"
                                             for p in pp),
                      attention=attention)

    def _knobs(self, pp, stop_ids, all_stop_ids) -> Knobs:
        """Each prompt's traced settings as host arrays with a leading prompt axis [B]; a
        chunk's knobs take the rows' prompts (`knob_args`)."""
        vocab_limit = self.lm.vocab_limit
        V = self.cfg.vocab_size if self.st.processors else 0
        pad_ids = lambda ids: np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)
        return Knobs(
            temperature=np.array([p.temperature for p in pp], np.float32),
            top_k=np.array([min(p.top_k, vocab_limit) for p in pp], np.int32),
            top_p=np.array([p.top_p for p in pp], np.float32),
            min_p=np.array([p.min_p for p in pp], np.float32),
            seed=self.seeds, max_new_tokens=np.array(self.T_of, np.int32),
            stop_ids=np.stack([pad_ids(x) for x in stop_ids]), t_stop=np.int32(self.T),
            logit_bias=np.stack([p.bias_vector(V) for p in pp]),
            min_tokens=np.array([p.min_tokens for p in pp], np.int32),
            min_stop_ids=np.stack([pad_ids(x) for x in all_stop_ids]),
            repetition_penalty=np.array([p.repetition_penalty for p in pp], np.float32),
            frequency_penalty=np.array([p.frequency_penalty for p in pp], np.float32),
            presence_penalty=np.array([p.presence_penalty for p in pp], np.float32),
            processed_logprobs=np.array([p.logprobs_mode == "processed_logprobs" for p in pp]))

    def params_of(self, b: int) -> SamplingParams:
        """Prompt b's SamplingParams, its seed filled in when it had none (the engine's)."""
        p = self.prompt_params[b]
        return p if p.seed is not None else p.replace(seed=self.engine_seed)

    def key_of_row(self, r: int) -> int:
        """The key index (`DecodeState.prompt_index`) of session row r."""
        return int(self.key_index[self.row_prompt[r]]) if 0 <= r < len(self.row_prompt) else 0

    def _plan(self, max_kv_bytes):
        """Refuse requests that can never run, and size the pool (before any compute)."""
        st = self.st
        flags = dict(top_logprobs=st.top_logprobs, token_ranks=st.token_ranks,
                     signals=st.signals)
        budget_lib.check_results_fit(self.B, self.N, self.T, **flags)
        if max_kv_bytes is not None:
            max_kv_bytes = inputs.check_int("max_kv_bytes", max_kv_bytes, 1, 2**62)
        budget = budget_lib.default_kv_budget() if max_kv_bytes is None else max_kv_bytes
        self.kv_budget = budget
        if self.naive:
            self.pool_shape = (len(self.row_prompt), 1)
            return
        C = len(self.context_ids)
        rows, slots = budget_lib.plan(
            self.cfg, B=self.B, n=self.n_of, p_cap=self.p_cap, t_cap=st.t_cap, budget=budget,
            context_bytes=budget_lib.kv_size(self.cfg, bucket(C)) if C else 0, nd=self.nd,
            nb=self.nb, lockstep=self.bridge_cfg is not None, penalties=st.penalties, **flags)
        if self.bridge_cfg is not None and slots < self.N:
            raise InputError(f"max_kv_bytes={budget:,} holds {slots} branch(es) per row; a "
                             f"Bridge needs all n={self.N} of a prompt at once")
        self.pool_shape = (rows, slots)

    # -- prefill ------------------------------------------------------------

    def _prefill(self):
        """The common context (if any), then every prompt's prefix, unless lazy."""
        self.context = None
        self.context_bytes = (0, 0, 0)
        self.ctx_lp = None
        if self.context_ids:
            self.ctx_lp = self._prefill_context()
        self.prompt_logprobs = None if self.prompt_k < 0 else [None] * self.B
        self.prefilled_rows = 0  # session rows prefilled so far (`prefill_rows`)
        self.prefix_dtype = None  # the stored prefix KV's numpy dtype, once prefilled
        if self.lazy:  # the pool prefills its rows (`prefill_rows`) and holds them
            self.prefix = self.last = None
            self.rows_alloc = 0
            self.prefix_bytes = (0, 0, 0)
            return
        R = len(self.row_prompt)  # session rows: prompts, or (prompt, branch) copies if naive
        self.prefix, self.last = self.prefill_rows(range(R))
        self.rows_alloc = -(-R // self.nd) * self.nd
        self.prefix_bytes = kv_bytes(self.prefix.k + self.prefix.v, R, self.rows_alloc)

    def prefill_rows(self, rows, own_bucket: bool = False) -> tuple[PrefixCache, jax.Array]:
        """Prefill some session rows (one forward pass over all of them).

        Args:
          rows: M session row indices (repeats allowed).
          own_bucket: P is the bucket of these rows' longest prompt, not the
            session's (`loop.insert_rows` pads it to the pool's).
        Returns:
          (PrefixCache L x `[M', K, P, D]`, last logits `[M', V]` float32), M'
          = M rounded up to the data axis (padding rows: one-token dummies), P
          the session's prefix bucket (`self.p_cap`), or with `own_bucket` these
          rows' own.
          With prompt logprobs, each prompt's are kept on the host.
        """
        rows = [int(r) for r in rows]
        R = len(rows)
        R_pad = -(-R // self.nd) * self.nd  # a data axis must divide the rows
        P = (bucket(max(len(self.ids[self.row_prompt[r]]) for r in rows)) if own_bucket
             else self.p_cap)
        tokens = np.zeros((R_pad, P), np.int32)
        lengths = np.ones((R_pad,), np.int32)
        for j, r in enumerate(rows):
            ids = self.ids[self.row_prompt[r]]
            tokens[j, :len(ids)] = ids
            lengths[j] = len(ids)
        cfg, st, pk, vl = self.cfg, self.st, self.prompt_k, self.st.vocab_limit
        kvd = self.lm.prefix_kv_dtype
        if self.context is None:
            fn = lambda p, t, n, b: prefill(cfg, p, t, n, st.post_layer(True, ()), b,
                                            prompt_logprobs=pk, vocab_limit=vl,
                                            prefix_kv_dtype=kvd)
            extra_args, extra_specs = (), ()
            name = "prefill"
        else:  # the suffixes after the common context
            fn = lambda p, t, n, b, c, cl: prefill_suffix(
                cfg, p, c, t, n, st.post_layer(True, ()), b, prompt_logprobs=pk,
                vocab_limit=vl, ctx_logits=cl, prefix_kv_dtype=kvd)
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
        # The model's field and what it resolves to (the CPU kernels' state included).
        kv = (kvd, str(prefix_kv_dtype(cfg, self.model_params, kvd)))
        prog = self.program((name, cfg, self.bridge_cfg, self.mesh, pk, vl, kv), fn, args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(prog(*args))
        self.timings["prefill"] += time.perf_counter() - t0
        self.prefilled_rows += R
        self.prefix_dtype = np.dtype(out[0].k[0].dtype)  # W8A8: float16 (the bill's)
        if pk >= 0:  # host arrays per prompt: entry j is about prompt token j + 1
            lp = PromptLogprobs(*map(to_host, out[2]))
            C = len(self.context_ids)
            for j, r in enumerate(rows):
                b = self.row_prompt[r]
                if self.prompt_logprobs[b] is not None:
                    continue  # naive rows are copies of their prompt: its first row
                n_own = len(self.ids[b]) - (1 if self.ctx_lp is None else 0)
                own = [a[j, :n_own] for a in lp]
                if self.ctx_lp is not None:  # the context's C - 1 entries, then the row's
                    own = [np.concatenate([c[:C - 1], a]) for c, a in zip(self.ctx_lp, own)]
                self.prompt_logprobs[b] = PromptLogprobs(*own)
        return out[0], out[1]

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
        compilation cache served the program; `from_exported()` instead when
        the program was also read from its exported entry, not traced)."""
        ctx = (self.observer.compiling(str(key[0])) if self.observer is not None
               else contextlib.nullcontext())
        with ctx as handle:
            prog, dt = PROGRAMS.get(key, fn, args, **kwargs)
            if dt == 0.0 and handle is not None:
                handle.cancel()  # found compiled: nothing to report
            elif PROGRAMS.last_from_cache and PROGRAMS.last_exported and hasattr(
                    handle, "from_exported"):
                handle.from_exported()  # read exported and fetched: neither traced nor compiled
            elif PROGRAMS.last_from_cache and hasattr(handle, "from_cache"):
                handle.from_cache()  # fetched, not compiled: say so
        self.timings["compile"] += dt
        return prog

    @property
    def state_spec(self):
        """The DecodeState's partition specs on the mesh (with or without signals)."""
        return self.m.state_spec_signals if self.st.signals else self.m.state_spec

    def knob_args(self, t_stop: int, rows):
        """The chunk's `Knobs`: the settings of each device row's prompt (`rows`: the
        session rows the device rows hold), and the clock's stop `t_stop`."""
        idx = np.asarray([self.row_prompt[r] if 0 <= r < len(self.row_prompt) else 0
                          for r in rows], np.int64)
        knobs = Knobs(*(np.int32(t_stop) if f == "t_stop" else np.asarray(a)[idx]
                        for f, a in zip(Knobs._fields, self.prompt_knobs)))
        if self.m is None:
            return knobs
        return self.m.place_knobs(knobs)

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


def _per_prompt(params, B: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from one, a list of B, or None. Raises InputError."""
    if params is None:
        return [SamplingParams()] * B
    if isinstance(params, SamplingParams):
        return [params] * B
    if isinstance(params, (list, tuple)):
        if len(params) != B:
            raise InputError(f"params: {len(params)} SamplingParams given for {B} prompts "
                             f"(give one, or one per prompt)")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InputError(f"params[{i}] must be a SamplingParams, got "
                                 f"{type(p).__name__}")
        return list(params)
    raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
