"""`generate`: the public entry point of the engine, its host loop (shared with
`stream`), and the Generation it returns."""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxsample import cost
from jaxsample import progress as progress_lib
from jaxsample.engine import sampling
from jaxsample.engine import stops as stops_lib
from jaxsample.engine.inputs import check_int
from jaxsample.engine.round import Round
from jaxsample.engine.session import Session
from jaxsample.errors import InputError
from jaxsample.generation import Generation
from jaxsample.lm import LanguageModel
from jaxsample.models.quantization import quant
from jaxsample.sampling_params import SamplingParams, refuse_foreign_keywords

STOP_CHUNK = 8  # decode steps between stop-string checks when stop strings are given


@refuse_foreign_keywords("jaxsample.generate")
def generate(lm: LanguageModel, prompts, params: SamplingParams | None = None, *,
             chat: bool = False, mesh=None, bridge=None, prompt_index_offset: int = 0,
             chunk_size: int | None = None,
             compact: bool | None = None, progress=False, shared_prefix=None,
             max_rows: int | None = None, max_slots: int | None = None,
             max_kv_bytes: int | None = None, attention: str = "auto") -> Generation:
    """Sample `params.n` continuations of each prompt, sharing each prompt's KV cache.

    The prompts are prefilled once; the N branches are decoded together, in
    chunks of `chunk_size` steps (one compiled program whatever the chunk
    size: chunked and single-call runs give the same tokens). Between chunks
    the host marks branches whose text holds a stop string as done, and, with
    `compact=True`, gathers the live branches into smaller buckets.
    `jaxsample.stream` runs the same loop and yields the text as it comes.

    Args:
      lm: a loaded `LanguageModel`.
      prompts: a string, a list of B strings, or a list of B token-id lists;
        with `chat=True`, a list of B chat prompts, each a string (one user
        turn) or a list of `{"role": ..., "content": ...}` messages (system and
        assistant turns included); one conversation alone is also accepted.
      params: `SamplingParams` (default: `SamplingParams()`).
      chat: render each prompt through the model's chat template
        (`lm.tokenizer.apply_chat_template`, with the generation prompt).
      mesh: optional `jax.sharding.Mesh` with a "branch" axis (branches split across
        devices; weights and prefix cache replicated) and optionally a "data" axis
        (prompts split). Same seed, same tokens as the unsharded run.
      bridge: optional `jaxsample.bridge.Bridge` (config + params): cross-branch
        layers after every block (arXiv 2510.01143). A zero-initialised Bridge
        gives exactly the tokens of `bridge=None`.
      prompt_index_offset: the global index of the first prompt, for the keys
        (`fold_in(key(seed), prompt_index)`): a data set split into calls with
        one seed passes each call's start, so prompts of different calls draw
        independent streams, whatever the batching.
      chunk_size: decode steps per device call, in [1, 2**31 - 1]; default: the
        whole budget in one call, or `STOP_CHUNK` (8) when `params.stop` is set
        (a stop string is then seen at most 7 tokens late, and decoding of that
        branch stops there) or progress is shown (the bar moves once per chunk).
      compact: gather live branches (and rows) into power-of-two buckets when
        those hold at most 3/4 of the slots (`scheduler.COMPACT_FRACTION`): later
        steps cost what the live branches need, each new bucket compiles once.
        None (default): on when max_rows, max_slots or max_kv_bytes make a pool.
      progress: True to report compiling and decoding on stderr (a bar on a
        terminal, else a line every 5 s: steps, live branches, tokens/s, time
        left; `jaxsample.progress`), or a `Progress` to choose stream and pace.
      shared_prefix: a context common to all B prompts (a few-shot block, a
        document, a system prompt): a string or token ids; with `chat=True` the
        conversations' common first turns (messages, or a string: one system
        turn). Three levels of sharing (Hydragen, arXiv 2402.05099;
        `engine/context.py`): the C context tokens prefilled and stored once
        (KV L x `[K, C, D]`, no prompt or branch axis), each prompt's own tokens
        once (positions from C on), each branch's tail per branch. The tokens
        equal `generate`'s on `context ids + prompt ids` without it (a string
        prompt is tokenised without a BOS: the BOS, if any, starts the
        context); `Generation.prompt_tokens` and prompt logprobs cover both.
      max_rows, max_slots: the decode pool's rows (prompts held at once) and
        slots per row (branches decoded at once), ints >= 1; default all at
        once. Fewer make the decode a pool (`engine.round.Round`, continuous
        batching: vLLM's scheduler, JetStream's prefill / insert / generate, a
        row's slots sharing its prefix): at each chunk boundary a finished slot
        takes its prompt's next branch, a settled row the next prompt. The
        tokens are the full call's, branch by branch (keys by prompt and branch
        index; up to float ties, `tests/ties.py`); default chunk `STOP_CHUNK`.
        With a Bridge only rows are refilled (a prompt's branches run in
        lockstep): max_slots must hold n.
      max_kv_bytes: byte budget (int >= 1) of the prefix caches and the decode
        pool (KV and decode buffers, per device; `engine.budget`); default
        `budget.DEFAULT_KV_FRACTION` of the device's memory (host RAM on CPU).
        A request that does not fit runs in the largest pool (rows x slots,
        unless max_rows / max_slots are given) the budget holds.
      attention: the decode step's attention: "auto" (default: the Pallas
        kernels of `jaxsample.kernels` on GPU and TPU, XLA on CPU), "xla" or
        "pallas" (on CPU in Pallas's interpreter: slow, for tests). The same
        tokens either way, up to float ties.

    Returns:
      `Generation` with tokens/logprobs `[B, N, T]` (T = max_new_tokens), lengths
      `[B, N]`, finish reasons, texts, the bill, with `params.logprobs = k`
      top_logprobs / top_token_ids `[B, N, T, k]` and token_ranks `[B, N, T]`,
      with `params.prompt_logprobs = k` the prompt tokens' logprobs, ranks and
      top k, with `params.signals` the per-token entropy, self-certainty and
      top-2 margin `[B, N, T]`; vLLM's `RequestOutput`s: `Generation.outputs()`.

    Raises:
      InputError: before any compute, in one line with the numbers: an empty
        prompt, a malformed chat prompt, prompt + max_new_tokens beyond the
        context (shared_prefix included), an empty or malformed shared_prefix,
        bad token ids, `logit_bias` ids outside the vocabulary, a bad
        chunk_size, progress or attention, a mesh that does not fit the
        request, bad max_rows / max_slots / max_kv_bytes, a budget that cannot
        hold the prompts' prefixes plus one branch's tail, or results (n x
        max_new_tokens tokens and logprobs) too large for host memory.
      NumericalError: a sampled token's logits were all NaN or -inf (no distribution;
        see `sampling.check_logprobs`). Raised after decoding, before returning.
    """
    return run_generate(lm, prompts, params, chat=chat, mesh=mesh, bridge=bridge,
                        prompt_index_offset=prompt_index_offset,
                        chunk_size=chunk_size, compact=compact, progress=progress,
                        shared_prefix=shared_prefix, max_rows=max_rows, max_slots=max_slots,
                        max_kv_bytes=max_kv_bytes, attention=attention)


def run_generate(lm, prompts, params, *, chat=False, mesh=None, bridge=None,
                 prompt_index_offset: int = 0, naive: bool = False, chunk_size=None,
                 compact=None, progress=False, shared_prefix=None, max_rows=None,
                 max_slots=None, max_kv_bytes=None, attention: str = "auto",
                 **session_kw) -> Generation:
    """`generate`'s body, also `LLM.sample`'s and `naive.naive_generate`'s:
    `session_kw` are `Session`'s seed, request_seeds and max_model_len."""
    check_compact(compact)
    session, rnd, chunk_size, observer = start(
        lm, prompts, params, chat=chat, mesh=mesh, bridge=bridge,
        prompt_index_offset=prompt_index_offset, naive=naive, chunk_size=chunk_size,
        progress=progress, shared_prefix=shared_prefix, max_rows=max_rows, max_slots=max_slots,
        max_kv_bytes=max_kv_bytes, attention=attention, **session_kw)
    for _ in chunks(session, rnd, chunk_size, compact, observer):
        pass
    return finish(session, [rnd])


def check_compact(compact) -> None:
    """`compact` is True, False or None (InputError otherwise: "no" is not False)."""
    if compact is not None and not isinstance(compact, (bool, np.bool_)):
        raise InputError(f"compact must be True, False or None (on for a pool), got {compact!r}")


def start(lm, prompts, params, *, chat, mesh, bridge, prompt_index_offset, naive, chunk_size,
          progress, default_chunk: int | None = None, shared_prefix=None,
          max_rows: int | None = None, max_slots: int | None = None,
          max_kv_bytes: int | None = None, attention: str = "auto", **session_kw):
    """Validate, prefill and open the one round of `generate` / `stream`.

    Args:
      params: one SamplingParams, or one per prompt (`Session`).
      session_kw: `Session`'s seed, request_seeds, encoded, max_model_len.
    Returns:
      (session, round with all branches, chunk size, progress observer or None).
    Raises:
      InputError: as `generate`, before any compute.
    """
    observer = progress_lib.resolve(progress)
    for name, v in (("max_rows", max_rows), ("max_slots", max_slots)):
        if v is not None:
            check_int(name, v, 1, 2**31 - 1)
    if naive and (max_rows is not None or max_slots is not None):
        raise InputError("naive=True is the baseline of one state per copy; pass "
                         "max_rows=None and max_slots=None")
    n_req = max((p.n for p in params), default=1) if isinstance(params, (list, tuple)) else \
        getattr(params if params is not None else SamplingParams(), "n", 1)
    if bridge is not None and max_slots is not None and max_slots < n_req:
        raise InputError(f"a Bridge runs a prompt's branches in lockstep: max_slots must be "
                         f">= n = {n_req}, got {max_slots}")
    session = Session(lm, prompts, params, chat=chat, mesh=mesh, bridge=bridge,
                      prompt_index_offset=prompt_index_offset, naive=naive, observer=observer,
                      shared_prefix=shared_prefix, max_kv_bytes=max_kv_bytes,
                      lazy_prefill=max_rows is not None or max_slots is not None,
                      attention=attention, **session_kw)
    rnd, chunk_size = open_round(session, max_rows=max_rows, max_slots=max_slots,
                                 chunk_size=chunk_size, default_chunk=default_chunk,
                                 lockstep=bridge is not None)
    return session, rnd, chunk_size, observer


def open_round(session: Session, *, max_rows: int | None = None, max_slots: int | None = None,
               chunk_size: int | None = None, default_chunk: int | None = None,
               lockstep: bool = False) -> tuple[Round, int]:
    """The one round over every branch of a session's prompts, and its chunk size.

    The device state is the session's `pool_shape` unless `max_rows` / `max_slots`
    narrow it (then a pool); a prompt's branches beyond its n are never drawn.
    Default chunk: `default_chunk`, else `STOP_CHUNK` with stop strings, progress or
    a pool, else the whole budget in one call. Raises InputError for a bad chunk_size.
    """
    naive = session.naive
    if not naive:
        max_rows = session.pool_shape[0] if max_rows is None else max_rows
        max_slots = session.pool_shape[1] if max_slots is None else max_slots
    B, N = session.B, session.N
    pooled = (max_rows is not None and max_rows < B) or (max_slots is not None and max_slots < N)
    if chunk_size is None:
        stops = any(p.stop for p in session.prompt_params)
        chunk_size = (default_chunk if default_chunk is not None
                      else STOP_CHUNK if stops or session.observer is not None or pooled
                      else session.T)
    chunk_size = check_int("chunk_size", chunk_size, 1, 2**31 - 1)
    if naive:  # rows are (prompt, branch) copies, one branch each
        rnd = session.round(range(B * N), np.arange(B * N, dtype=np.int32)[:, None] % N)
    else:
        n = np.asarray(session.n_of)[:, None]
        cols = np.arange(N, dtype=np.int32)[None, :]
        rnd = session.round(range(B), np.where(cols < n, cols, -1).astype(np.int32),
                            max_rows=max_rows, max_slots=max_slots, lockstep=lockstep)
    return rnd, chunk_size


def chunks(session: Session, rnd: Round, chunk_size: int, compact: bool | None,
           observer=None):
    """The host loop of `generate` and `stream`: decode `rnd` chunk by chunk.

    After each chunk: branches whose new text holds a stop string are marked
    done, the observer is told the progress, then this yields `(t0, more)`
    (the chunk decoded tokens `[t0, rnd.t)`; `more` is False after the last
    chunk), and, with `compact` (None: when `rnd` is a pool), the live
    branches are gathered.
    """
    compact = rnd.pooled if compact is None else compact
    # One stop-string watcher per prompt that has stop strings (its own strings,
    # min_tokens and tokenizer), fed each branch's new tokens.
    watches = {}
    for b in range(session.B):
        p = session.prompt_params[b]
        if p.stop:
            watches[b] = stops_lib.StopWatch(text_tokenizer(session, b), p.stop, p.min_tokens)
    c0 = session.timings["compile"]
    if observer is not None:
        observer.decode_start(session.T, session.B, session.N)
    ok = False
    try:
        t0 = 0
        while True:
            more = rnd.run(chunk_size)
            if more and watches:
                hit = np.zeros(rnd.done.shape, bool)
                for r, c, new in rnd.new_tokens(t0):
                    watch = watches.get(session.row_prompt[rnd.rows[r]])
                    if watch is not None:
                        hit[r, c] = watch.feed((r, c), new)
                rnd.finish_slots(hit)
            if observer is not None:
                observer.decode_update(rnd.t, int((~rnd.done).sum()) if more else 0,
                                       int(rnd.lengths.sum()),
                                       session.timings["compile"] - c0)
            yield t0, more
            if not more:
                break
            t0 = rnd.t
            if compact:
                rnd.compact()
        ok = True
    finally:
        if observer is not None:
            if ok:
                observer.decode_end(int(rnd.lengths.sum()), session.timings["compile"] - c0)
            else:
                observer.close()


def text_tokenizer(session: Session, b: int = 0):
    """What prompt b's branch text is decoded with: the model's tokenizer, keeping
    special tokens' text when its `skip_special_tokens` is False."""
    return stops_lib.text_tokenizer(session.lm.tokenizer,
                                    session.prompt_params[b].skip_special_tokens)


def _stored_bytes(params) -> int | None:
    """Bytes of quantised parameters as stored (int8 and scales), for the bill; None for
    float parameters (the bill's analytic count at the dtype is then exact)."""
    if not quant.is_quantized(params):
        return None
    return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(params))


def _prefix_dtype_bytes(s: Session) -> int | None:
    """Bytes per element of the prefix KV the session stored (`state.prefix_kv_dtype`
    when it prefilled), None before any prefill (the model's dtype)."""
    return None if s.prefix_dtype is None else s.prefix_dtype.itemsize


def final_text(session: Session, b: int, tokens, length, stopped):
    """(text, kept tokens or None, stop string or None) of one branch of prompt b
    exactly as `Generation.texts` holds it: the one function `finish`, `stream`
    and `adaptive_self_consistency` call, so the text a vote reads and the text
    returned cannot differ (the prompt's stop strings, `min_tokens`,
    `include_stop_str_in_output` and `skip_special_tokens` applied)."""
    p = session.prompt_params[b]
    L = int(length)
    body = [int(t) for t in (tokens[:L - 1] if stopped else tokens[:L])]
    return stops_lib.cut_at(text_tokenizer(session, b), body, p.stop, p.min_tokens,
                            p.include_stop_str_in_output)


def session_bill(s: Session, tail_bytes, decoded, kept) -> cost.Bill:
    """The `Bill` of what a session computed (`cost.make_bill` with its figures): its
    prompts, decode steps, branch-steps and KV bytes (context, prefix, the tails).

    Args:
      s: the session.
      tail_bytes: each round's `tail_bytes`, (bytes held, per device, allocated);
        the largest of each counts.
      decoded: `[B, W]` ints, tokens the device decoded per branch (W: the most
        branches of any prompt; 0 for a branch the prompt has not).
      kept: `[B, W]` ints, tokens each branch keeps after stop strings.
    """
    prefix_bytes, prefix_dev, prefix_all = s.prefix_bytes
    ctx_bytes, ctx_dev, ctx_all = s.context_bytes
    return cost.make_bill(s.cfg, prompt_lengths=[len(x) for x in s.ids], branch_lengths=decoded,
                          n=np.shape(decoded)[1], prefix_cache_bytes=prefix_bytes,
                          tail_cache_bytes=max(t[0] for t in tail_bytes),
                          decode_steps=s.decode_steps, kept_lengths=kept,
                          prefix_copies=s.N if s.naive else 1, branch_steps=s.branch_steps,
                          context_length=len(s.context_ids), context_cache_bytes=ctx_bytes,
                          weights_bytes=_stored_bytes(s.lm.params),
                          prefix_dtype_bytes=_prefix_dtype_bytes(s),
                          devices=1 if s.mesh is None else s.mesh.size,
                          kv_bytes_per_device=prefix_dev + max(t[1] for t in tail_bytes) + ctx_dev,
                          kv_bytes_allocated=prefix_all + max(t[2] for t in tail_bytes) + ctx_all)


def finish(session: Session, rounds: list[Round], reasons_override=None) -> Generation:
    """Host-side assembly of one Generation from a session's rounds.

    Rounds cover disjoint branches of the session's rows; their outputs are
    placed at (prompt, branch index). Stop strings are cut here exactly (the
    tokens kept are the fewest whose text holds the stop string).

    Args:
      reasons_override: optional `{(prompt, branch): reason}` for branches the
        caller ended ("terminated").
    """
    s, lm = session, session.lm
    B = s.B
    width = max(int(r.branch_ids.max()) + 1 for r in rounds) if not s.naive else s.N
    T, k = s.T, s.st.top_logprobs
    pad = s.st.pad_id
    tok = np.full((B, width, T), pad, np.int32)
    lp = np.zeros((B, width, T), np.float32)
    top_lp = np.zeros((B, width, T, k), np.float32)
    top_id = np.full((B, width, T, k), pad, np.int32)
    ranks = np.zeros((B, width, T if s.st.token_ranks else 0), np.int32)
    sig = np.zeros((B, width, T, 3), np.float32) if s.st.signals else None
    lens = np.zeros((B, width), np.int32)
    stopped = np.zeros((B, width), bool)
    drawn = np.zeros((B, width), bool)
    for rnd in rounds:
        for i, row in enumerate(rnd.rows):
            b = s.row_prompt[row]
            for c in range(rnd.N):
                n = int(rnd.branch_ids[i, c])
                if n < 0:
                    continue
                tok[b, n], lp[b, n], lens[b, n] = rnd.tokens[i, c], rnd.logprobs[i, c], rnd.lengths[i, c]
                top_lp[b, n], top_id[b, n] = rnd.top_logprobs[i, c], rnd.top_ids[i, c]
                ranks[b, n] = rnd.token_ranks[i, c]
                if sig is not None:
                    sig[b, n] = rnd.signals[i, c]
                stopped[b, n], drawn[b, n] = rnd.stopped[i, c], True
    sampling.check_logprobs(lp)  # NumericalError if a token had no distribution (NaN logits)
    decoded = lens.copy()  # what the device decoded: the bill counts it
    reasons = [["stop" if stopped[b, n] else "length" if drawn[b, n] else "not_drawn"
                for n in range(width)] for b in range(B)]
    for (b, n), why in (reasons_override or {}).items():
        reasons[b][n] = why
    texts = []
    why = [[None] * width for _ in range(B)]
    eos = set(int(i) for i in getattr(lm.tokenizer, "eos_token_ids", ()) or ())
    for b in range(B):
        row = []
        for n in range(width):
            pb = s.prompt_params[b]
            text, keep, stop_str = final_text(s, b, tok[b, n], lens[b, n], stopped[b, n])
            # vLLM's stop_reason: the stop string, else the stop token id when the
            # branch ended on one of stop_token_ids (not on the model's end id,
            # unless ignore_eos), else None (length, the model's end id).
            last = int(tok[b, n, lens[b, n] - 1]) if stopped[b, n] else None
            why[b][n] = (stop_str if stop_str is not None
                         else last if last is not None and last in pb.stop_token_ids
                         and (pb.ignore_eos or last not in eos) else None)
            if keep is not None:
                tok[b, n, keep:], lp[b, n, keep:], lens[b, n] = pad, 0.0, keep
                top_lp[b, n, keep:], top_id[b, n, keep:] = 0.0, pad
                ranks[b, n, keep:] = 0
                if sig is not None:
                    sig[b, n, keep:] = 0.0
                reasons[b][n] = "stop"
            row.append(text)
        texts.append(row)
    bill = session_bill(s, [r.tail_bytes for r in rounds], decoded, lens)
    s.timings["total"] = time.perf_counter() - s.t_start
    plp = s.prompt_logprobs
    return Generation(tokens=tok, logprobs=lp, lengths=lens, finish_reason=reasons,
                      texts=texts, prompt_tokens=s.prompt_ids, prompts=s.texts, params=s.params,
                      bill=bill, timings=s.timings, pad_id=pad,
                      top_logprobs=top_lp if k else None, top_token_ids=top_id if k else None,
                      token_ranks=ranks if s.st.token_ranks else None,
                      prompt_token_logprobs=None if plp is None else [p.logprobs for p in plp],
                      prompt_token_ranks=None if plp is None else [p.ranks for p in plp],
                      prompt_top_logprobs=None if plp is None else [p.top_logprobs for p in plp],
                      prompt_top_token_ids=None if plp is None else [p.top_ids for p in plp],
                      tokenizer=lm.tokenizer, stop_reason=why,
                      **({} if sig is None else dict(token_entropy=sig[..., 0],
                                                     self_certainty=sig[..., 1],
                                                     top2_margin=sig[..., 2])))
