"""Many requests in, each result out as soon as it completes: `run_pool` (the
plain requests of `jaxsample.run_requests`, the one public entry) over one decode
pool (`engine.round.Round`) whatever their settings, with the `Bill` of the run
(its `pool` part: requests, seconds, the batch-by-batch baseline).

Every request carries its own SamplingParams into the one pool: n and
max_tokens per prompt row, the sampling values per row (`state.Knobs`,
traced), stop strings per prompt on the host; what changes the step's code
(penalties, top logprobs, signals, processed logprobs) is the union of the
requests' (`session.Session`). Keys follow vLLM's rule: a request with its own
seed draws from (seed, branch) alone; one without from the run's seed and its
position (`index_offset + i`).

Sources: vLLM's offline `LLM.generate` over its continuous-batching scheduler;
JetStream's prefill / insert / generate.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import types
from typing import Any

import numpy as np

from jaxsample import progress as progress_lib
from jaxsample.cost import Bill, PoolRun
from jaxsample.engine import api, budget, inputs
from jaxsample.engine.session import Session
from jaxsample.errors import InputError
from jaxsample.sampling_params import SamplingParams

# ---------------------------------------------------------------------------
# Many requests in, each result out as soon as its prompt settles


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of `jaxsample.run_requests` (and `LLM.run`).

    Attributes:
      id: a string naming it (unique in a call); results are tagged with it.
      prompt: a string or token ids (no chat template), or None with `messages`.
      messages: a chat conversation (a list of `{"role", "content"}` dicts, or
        a string: one user turn), rendered with the model's chat template.
      params: its `SamplingParams` (default `SamplingParams()`).
      adaptive: None, or a dict of `adaptive_self_consistency`'s rule options
        (`jaxsample.reduce.adaptive.OPTIONS`: max_n, window, rule, ...): the
        request is then adaptive self-consistency, run by
        `jaxsample.run_requests` (`reduce.requests`); `engine.run_pool`
        refuses it.
      extract: how `jaxsample.run_requests` maps a branch's text to the answer
        it votes for (an `answers.extract` kind or a callable).
    """

    id: str
    prompt: Any = None
    messages: Any = None
    params: Any = None
    adaptive: Any = None
    extract: Any = "auto"


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """What `jaxsample.run_requests` yields for one request.

    Attributes:
      id: the request's id.
      output: its `RequestOutput` (`request_id` = id).
      generation: a one-prompt `Generation` (tokens `[1, n, T]`, texts, bill:
        its decoded tokens are its own; `decode_steps`, `branch_steps` and the
        KV bytes are the pool's, up to the chunk it completed in).
      index: the request's position in the input (plus `run_pool`'s
        `index_offset`: its global position).
      vote: None from `engine.run_pool`; from `jaxsample.run_requests` a
        `reduce.requests.RequestVote` (the self-consistency vote).
      adaptive: None, or (an adaptive request of `jaxsample.run_requests`) the
        `AdaptiveResult` of its group (consecutive adaptive requests with equal
        settings run as one call; `generation` is then that group's).
    """

    id: str
    output: Any
    generation: Any
    index: int
    vote: Any = None
    adaptive: Any = None


def check_requests(requests) -> list[Request]:
    """`run_requests`' checks of a request list (dicts converted, `id` defaulting to
    the position; ids unique), before any compute. Raises InputError naming the position."""
    out, seen = [], set()
    for i, r in enumerate(requests):
        if isinstance(r, dict):
            unknown = set(r) - {"id", "prompt", "messages", "params", "adaptive", "extract"}
            if unknown:
                raise InputError(f"request {i}: unknown fields {sorted(unknown)} (allowed: id, "
                                 f"prompt, messages, params, adaptive, extract)")
            r = Request(**{"id": str(i), **r})
        if not isinstance(r, Request):
            raise InputError(f"request {i} must be a Request or a dict, got {type(r).__name__}")
        if not isinstance(r.id, str) or not r.id:
            raise InputError(f"request {i}: id must be a non-empty string, got {r.id!r}")
        if r.id in seen:
            raise InputError(f"request {i}: id {r.id!r} repeats an earlier request's id")
        seen.add(r.id)
        if (r.prompt is None) == (r.messages is None):
            raise InputError(f"request {i} ({r.id!r}): give exactly one of prompt and messages")
        if r.params is not None and not isinstance(r.params, SamplingParams):
            raise InputError(f"request {i} ({r.id!r}): params must be a SamplingParams, got "
                             f"{type(r.params).__name__}")
        out.append(r)
    return out


def encode_requests(lm, reqs) -> tuple[list[list[int]], list]:
    """Every request's prompt or messages encoded once (the tokenizer's and the chat
    template's checks), its length with `max_tokens` against the model's context and
    its results against host memory (`budget.check_results_fit`), before the first
    compute. Raises InputError naming the request.

    Returns:
      (each request's prompt token ids, each one's rendered text or None).
    """
    ids, texts = [], []
    for i, r in enumerate(reqs):
        chat = r.messages is not None
        try:
            if not chat and not isinstance(r.prompt, (str, list, tuple, np.ndarray)):
                raise InputError(f"prompt must be a string or a list of token ids, got "
                                 f"{type(r.prompt).__name__}")
            one, text = inputs.encode_prompts(lm, [r.messages if chat else r.prompt], chat)
            p = r.params or SamplingParams()
            n_tok = len(one[0]) + p.max_new_tokens
            if n_tok > lm.config.max_seq_len:
                raise InputError(f"{len(one[0])} prompt tokens + max_tokens={p.max_new_tokens} "
                                 f"= {n_tok} > the model's context of {lm.config.max_seq_len}")
            budget.check_results_fit(1, p.n, p.max_new_tokens, p.logprobs or 0,
                                     p.logprobs is not None, p.signals)
        except InputError as e:
            raise InputError(f"request {i} ({r.id!r}): {e}") from None
        ids.append(one[0])
        texts.append(text[0])
    return ids, texts


def batch_branch_steps(lengths, rows: int, slots: int) -> int:
    """Slots x steps of the batch-by-batch loop at the pool's shape.

    Prompts in input order are cut into batches of `rows`, each prompt's
    branches into rounds of `slots`; every (batch, round) decodes until its
    longest branch ends and pays rows x slots per step (today's `generate` on
    consecutive batches, whose finished slots idle until the slowest ends).

    Args:
      lengths: `[B, n]` tokens each branch decoded.
      rows, slots: the pool's rows and slots per row (>= 1).
    """
    lengths = np.asarray(lengths)
    B, n = lengths.shape
    total = 0
    for b0 in range(0, B, rows):
        for c0 in range(0, n, slots):
            block = lengths[b0:b0 + rows, c0:c0 + slots]
            total += int(block.max(initial=0)) * rows * slots
    return total


class RequestRun:
    """The iterator `run_pool` returns: `RequestResult`s in completion order.

    Attributes:
      bill: None until the last result is out; then the run's `cost.Bill`: the
        whole pool's counts (its prompts, decode steps, branch-steps, KV
        bytes, each branch's decoded and kept tokens, padded with zeros to the
        most branches of any request) with its `pool` part (`cost.PoolRun`:
        requests, seconds, the batch-by-batch baseline).
    """

    def __init__(self, session, reqs, **kwargs):
        self.bill: Bill | None = None
        self._it = _run(self, session, reqs, **kwargs)

    def __iter__(self):
        return self

    def __next__(self) -> "RequestResult":
        return next(self._it)


def run_pool(lm, requests, *, max_kv_bytes: int | None = None, chunk_size: int | None = None,
                 mesh=None, index_offset: int = 0, progress=False, seed: int | None = None,
                 max_rows: int | None = None, max_slots: int | None = None) -> RequestRun:
    """Run many requests through one decode pool; yield each result as it completes.

    The requests share one pool (one `Session`, one decode program) whatever
    their SamplingParams: each prompt row decodes with its own n, max_tokens,
    temperature, top-k/p, min-p, penalties, stop ids and strings, and seed. A
    request is yielded at the first chunk boundary after all its branches are
    done (continuous batching: vLLM's LLMEngine.step outputs, JetStream's
    generate loop). Keys: a request with its own `SamplingParams.seed` draws
    from (that seed, branch) alone, wherever it stands; a request without one
    from (`seed`, its position `index_offset + i`, branch), so one process's
    contiguous share of a larger list (`engine.shard_requests.process_share`)
    draws what a single run of the whole list draws. Either way its tokens equal
    `generate` on it alone with the same key (up to float ties).

    Args:
      lm: a loaded `LanguageModel`.
      requests: an iterable of `Request`s (or dicts with its fields; `id`
        defaults to the position). Their `adaptive` and `extract` fields are
        read by `jaxsample.run_requests` (`reduce.requests`), which calls this
        for the plain requests.
      max_kv_bytes, chunk_size, mesh, progress, max_rows, max_slots: as
        `jaxsample.generate`.
      index_offset: the global position of the first request (an int >= 0):
        request i is `RequestResult.index` `index_offset + i` (and, without its
        own seed, draws that key index).
      seed: the seed of requests without their own (an int in [0, 2**32));
        None draws a random one.
    Returns:
      A `RequestRun`: iterate it for `RequestResult`s in completion order;
      its `bill` is the run's `Bill` (with its `pool` part) once the last is out.
    Raises:
      InputError: a malformed request (naming its position and id), a prompt
        the tokenizer refuses, or a pool the KV budget cannot hold, here,
        before any compute.
    """
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise InputError(f"index_offset must be an int >= 0, got {index_offset!r}")
    reqs = check_requests(requests)
    for i, r in enumerate(reqs):
        if r.adaptive is not None:
            raise InputError(f"request {i} ({r.id!r}): an adaptive request runs in "
                             f"jaxsample.run_requests (jaxsample.reduce.requests), not "
                             f"engine.run_pool")
    session = open_pool(lm, reqs, encode_requests(lm, reqs), max_kv_bytes=max_kv_bytes,
                        mesh=mesh, index_offset=index_offset, progress=progress, seed=seed)
    return pool_results(session, reqs, chunk_size=chunk_size, index_offset=index_offset,
                        max_rows=max_rows, max_slots=max_slots)


def open_pool(lm, reqs, encoded, *, max_kv_bytes=None, mesh=None, index_offset: int = 0,
              progress=False, seed=None, max_model_len: int | None = None,
              attention: str = "auto") -> Session:
    """The `Session` of checked requests (`check_requests`) with their prompts encoded
    (`encode_requests`): every check and the pool's size against the KV budget, no
    compute (its rows are prefilled as the pool takes them). Raises InputError."""
    observer = progress_lib.resolve(progress)
    return Session(lm, None, [r.params or SamplingParams() for r in reqs], mesh=mesh,
                   prompt_index_offset=index_offset, observer=observer,
                   max_kv_bytes=max_kv_bytes, lazy_prefill=True, seed=seed,
                   request_seeds=True, encoded=encoded, max_model_len=max_model_len,
                   attention=attention)


def pool_results(session, reqs, *, chunk_size=None, index_offset: int = 0, max_rows=None,
                 max_slots=None) -> "RequestRun":
    """Run an `open_pool` session; a `RequestRun` over its requests' results."""
    for name, v in (("max_rows", max_rows), ("max_slots", max_slots)):
        if v is not None:
            inputs.check_int(name, v, 1, 2**31 - 1)
    if chunk_size is not None:
        inputs.check_int("chunk_size", chunk_size, 1, 2**31 - 1)
    return RequestRun(session, reqs, chunk_size=chunk_size, index_offset=index_offset,
                      max_rows=max_rows, max_slots=max_slots)


def _run(run: RequestRun, session, reqs, *, chunk_size, index_offset, max_rows, max_slots):
    """Yield each request's result as its branches are done; at the end set `run.bill`."""
    t0 = time.perf_counter()
    rnd, chunk = api.open_round(session, max_rows=max_rows, max_slots=max_slots,
                                chunk_size=chunk_size)
    shape = rnd.col_of.shape
    sent = np.zeros(len(reqs), bool)
    decoded = np.zeros((len(reqs), session.N), np.int64)  # per request, as its bill says
    kept = np.zeros_like(decoded)
    for _, more in api.chunks(session, rnd, chunk, None, session.observer):
        settled = ~sent & rnd.done.all(axis=1)
        for j in np.nonzero(settled)[0]:
            sent[j] = True
            gen = finish_one(session, rnd, int(j))
            n = len(gen.bill.decoded_tokens_per_branch[0])
            decoded[j, :n], kept[j, :n] = gen.bill.decoded_tokens_per_branch[0], gen.lengths[0]
            out = dataclasses.replace(gen.outputs()[0], request_id=reqs[j].id)
            yield RequestResult(id=reqs[j].id, output=out, generation=gen,
                                index=index_offset + int(j))
    pool = PoolRun(requests=int(sent.sum()), seconds=time.perf_counter() - t0,
                   batch_branch_steps=batch_branch_steps(rnd.lengths, *shape))
    bill = api.session_bill(session, [rnd.tail_bytes], decoded, kept)
    run.bill = dataclasses.replace(bill, pool=pool)


def finish_one(session, rnd, row: int):
    """The one-prompt Generation of round row `row` (`api.finish` on a view), shaped as
    `generate` on that request alone: tokens `[1, n, T]` with its own n and
    max_tokens, its own top-k, ranks and signals only where it asked for them."""
    s = session
    b = s.row_prompt[rnd.rows[row]]
    p = s.prompt_params[b]
    n, T, k = s.n_of[b], s.T_of[b], s.k_of[b]
    sub = copy.copy(s)
    sub.B, sub.ids, sub.prompt_ids, sub.texts = 1, [s.ids[b]], [s.prompt_ids[b]], [s.texts[b]]
    sub.prompt_params, sub.n_of, sub.T_of, sub.k_of = [p], [n], [T], [k]
    sub.N, sub.T, sub.params = n, T, s.params_of(b)
    sub.st = dataclasses.replace(s.st, top_logprobs=k, token_ranks=p.logprobs is not None,
                                 signals=p.signals)
    own_k = -1 if p.prompt_logprobs is None else p.prompt_logprobs
    sub.prompt_logprobs = (None if s.prompt_logprobs is None or own_k < 0 else
                           [_top(s.prompt_logprobs[b], own_k)])
    sub.row_prompt = [0]
    sub.timings = dict(s.timings)
    sl = (slice(row, row + 1), slice(0, n), slice(0, T))
    view = types.SimpleNamespace(
        rows=[0], N=n, branch_ids=rnd.branch_ids[sl[:2]], tokens=rnd.tokens[sl],
        logprobs=rnd.logprobs[sl], lengths=rnd.lengths[sl[:2]],
        top_logprobs=rnd.top_logprobs[sl][..., :k], top_ids=rnd.top_ids[sl][..., :k],
        token_ranks=rnd.token_ranks[sl] if p.logprobs is not None else rnd.token_ranks[sl][..., :0],
        signals=None if rnd.signals is None or not p.signals else rnd.signals[sl],
        stopped=rnd.stopped[sl[:2]], tail_bytes=rnd.tail_bytes)
    return api.finish(sub, [view])


def _top(plp, k: int):
    """A prompt's `PromptLogprobs` with its top-k alternatives cut to k."""
    return plp._replace(top_logprobs=plp.top_logprobs[..., :k], top_ids=plp.top_ids[..., :k])
