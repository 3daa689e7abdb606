"""Many requests in, each result out as soon as it completes: `run_requests`
over the decode pool (`engine.round.Round`), with the bill of the run.

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

from jaxsample.engine import api, budget, inputs
from jaxsample.engine.state import bucket
from jaxsample.errors import InputError
from jaxsample.sampling_params import SamplingParams

# ---------------------------------------------------------------------------
# Many requests in, each result out as soon as its prompt settles


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of `run_requests`.

    Attributes:
      id: a string naming it (unique in a call); results are tagged with it.
      prompt: a string or token ids (no chat template), or None with `messages`.
      messages: a chat conversation (a list of `{"role", "content"}` dicts, or
        a string: one user turn), rendered with the model's chat template.
      params: its `SamplingParams` (default `SamplingParams()`).
      adaptive: None, or a dict of `adaptive_self_consistency`'s rule options
        (`jaxsample.reduce.adaptive.OPTIONS`: max_n, window, rule, ...): the
        request is then adaptive self-consistency, run by
        `jaxsample.run_requests` (`reduce.requests`); `engine.run_requests`
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
    """What `run_requests` yields for one request.

    Attributes:
      id: the request's id.
      output: its `RequestOutput` (`request_id` = id).
      generation: a one-prompt `Generation` (tokens `[1, n, T]`, texts, bill:
        its decoded tokens are its own; `decode_steps`, `branch_steps` and the
        KV bytes are the pool's, up to the chunk it completed in).
      index: the request's position in the input (plus `run_requests`'s
        `index_offset`: its global position).
      vote: None from `engine.run_requests`; from `jaxsample.run_requests` a
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


def check_prompts(lm, reqs) -> list[int]:
    """Every request's prompt or messages encoded (the tokenizer's and the chat
    template's checks), its length with `max_tokens` against the model's context and
    its results against host memory (`budget.check_results_fit`), before the first
    compute. Raises InputError naming the request.

    Returns:
      Each request's prompt length in tokens (the KV budget's check: `check_budgets`).
    """
    lengths = []
    for i, r in enumerate(reqs):
        chat = r.messages is not None
        try:
            if not chat and not isinstance(r.prompt, (str, list, tuple, np.ndarray)):
                raise InputError(f"prompt must be a string or a list of token ids, got "
                                 f"{type(r.prompt).__name__}")
            ids, _ = inputs.encode_prompts(lm, [r.messages if chat else r.prompt], chat)
            p = r.params or SamplingParams()
            n_tok = len(ids[0]) + p.max_new_tokens
            if n_tok > lm.config.max_seq_len:
                raise InputError(f"{len(ids[0])} prompt tokens + max_tokens={p.max_new_tokens} "
                                 f"= {n_tok} > the model's context of {lm.config.max_seq_len}")
            budget.check_results_fit(1, p.n, p.max_new_tokens, p.logprobs or 0,
                                     p.logprobs is not None, p.signals)
        except InputError as e:
            raise InputError(f"request {i} ({r.id!r}): {e}") from None
        lengths.append(len(ids[0]))
    return lengths


def param_groups(reqs, positions=None) -> list:
    """Runs of consecutive requests with equal SamplingParams and kind (prompt or
    messages): one pool each. Returns [((params, chat), [positions])] over
    `positions` (default: all)."""
    groups: list = []
    for i in range(len(reqs)) if positions is None else positions:
        r = reqs[i]
        key = (r.params or SamplingParams(), r.messages is not None)
        if groups and groups[-1][0] == key and groups[-1][1][-1] == i - 1:
            groups[-1][1].append(i)
        else:
            groups.append((key, [i]))
    return groups


def check_budgets(lm, reqs, groups, lengths, max_kv_bytes, mesh) -> None:
    """Each group's pool against the KV budget (`budget.plan_params`, as its
    `Session` will size it), before the first group runs: a later group that
    can never run is refused before an earlier one computes anything.
    Raises InputError naming the group's first request."""
    if max_kv_bytes is not None:
        max_kv_bytes = inputs.check_int("max_kv_bytes", max_kv_bytes, 1, 2**62)
    kv = budget.default_kv_budget() if max_kv_bytes is None else max_kv_bytes
    for (params, _), idx in groups:
        _, _, nb, nd = inputs.resolve_mesh(mesh, params.n)
        try:
            budget.plan_params(lm.config, params, B=len(idx),
                               p_cap=bucket(max(lengths[i] for i in idx)), budget=kv, nd=nd,
                               nb=nb)
        except InputError as e:
            first = reqs[idx[0]]
            raise InputError(f"requests {idx[0]}-{idx[-1]} (from {first.id!r}, their pool): "
                             f"{e}") from None


@dataclasses.dataclass
class RunBill:
    """What a `run_requests` run computed (updated as each group of requests ends).

    Attributes:
      requests: requests completed.
      decoded_tokens: tokens the device decoded (every branch, stop tokens
        included, text cut by stop strings afterwards not subtracted).
      branch_steps: slots x decode steps computed (what the pool paid for).
      prefill_tokens: tokens prefilled (a common context once, each prompt once).
      seconds: wall time of the run so far.
      batch_branch_steps: slots x steps the same requests would have cost batch
        by batch at the pool's shape (`batch_branch_steps`): the baseline.
    """

    requests: int = 0
    decoded_tokens: int = 0
    branch_steps: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0
    batch_branch_steps: int = 0

    @property
    def slot_utilisation(self) -> float:
        """decoded_tokens / branch_steps (1.0: no slot ever idle)."""
        return self.decoded_tokens / self.branch_steps if self.branch_steps else 0.0

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def batch_slot_utilisation(self) -> float:
        """decoded_tokens / batch_branch_steps: the batch-by-batch loop's utilisation."""
        return self.decoded_tokens / self.batch_branch_steps if self.batch_branch_steps else 0.0


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
    """The iterator `run_requests` returns; `bill` is the `RunBill` so far."""

    def __init__(self, it, bill: RunBill):
        self._it, self.bill = it, bill

    def __iter__(self):
        return self

    def __next__(self) -> "RequestResult":
        return next(self._it)


def run_requests(lm, requests, *, max_kv_bytes: int | None = None, chunk_size: int | None = None,
                 mesh=None, index_offset: int = 0, progress=False) -> RequestRun:
    """Run many requests through the decode pool; yield each result as it completes.

    Consecutive requests with the same SamplingParams and kind (prompt or
    messages) share one pool (`generate` with the budget's rows x slots);
    within it a request is yielded at the first chunk boundary after all its
    branches are done (continuous batching: vLLM's LLMEngine.step outputs,
    JetStream's generate loop). Request i's keys are those of prompt index i
    (`prompt_index_offset`), so its tokens equal `generate` on it alone with
    `prompt_index_offset=i` and the same seed (up to float ties). With
    `index_offset=k`, request i is at global position k + i (its keys and
    `RequestResult.index`): one process's contiguous share of a larger list
    (`engine.shard_requests.process_share`) then draws what a single run of
    the whole list draws.

    Args:
      lm: a loaded `LanguageModel`.
      requests: an iterable of `Request`s (or dicts with its fields; `id`
        defaults to the position).
      max_kv_bytes, chunk_size, mesh: as `jaxsample.generate`.
      index_offset: the global position of the first request (an int >= 0):
        request i draws the keys of prompt index `index_offset + i` and is
        `RequestResult.index` `index_offset + i` (one process's share; a
        resumed run's remaining requests at their positions in the whole run).
      progress: as `generate`'s, reported for each group's pool.
    Returns:
      A `RequestRun`: iterate it for `RequestResult`s in completion order;
      its `bill` (a `RunBill`) grows as groups end.
    Raises:
      InputError: a malformed request (naming its position and id), or a
        group of requests whose pool the KV budget cannot hold (naming its
        first request), here, before any compute.
    """
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise InputError(f"index_offset must be an int >= 0, got {index_offset!r}")
    reqs = check_requests(requests)
    for i, r in enumerate(reqs):
        if r.adaptive is not None:
            raise InputError(f"request {i} ({r.id!r}): an adaptive request runs in "
                             f"jaxsample.run_requests (jaxsample.reduce.requests), not "
                             f"engine.run_requests")
    groups = param_groups(reqs)
    check_budgets(lm, reqs, groups, check_prompts(lm, reqs), max_kv_bytes, mesh)
    bill = RunBill()
    return RequestRun(_run_groups(lm, reqs, groups, bill, max_kv_bytes, chunk_size, mesh,
                                  index_offset, progress), bill)


def _run_groups(lm, reqs, groups, bill, max_kv_bytes, chunk_size, mesh, index_offset,
                progress=False):
    t0 = time.perf_counter()
    for (params, chat), idx in groups:
        prompts = [reqs[i].messages if chat else reqs[i].prompt for i in idx]
        session, rnd, chunk, observer = api.start(
            lm, prompts, params, chat=chat, mesh=mesh, bridge=None,
            prompt_index_offset=index_offset + idx[0], naive=False,
            chunk_size=chunk_size if chunk_size is not None else api.STOP_CHUNK,
            progress=progress, max_kv_bytes=max_kv_bytes)
        shape = rnd.col_of.shape
        sent = np.zeros(len(idx), bool)
        for _, more in api.chunks(session, rnd, chunk, None, observer):
            settled = ~sent & rnd.done.all(axis=1)
            for j in np.nonzero(settled)[0]:
                sent[j] = True
                gen = finish_one(session, rnd, int(j))
                out = dataclasses.replace(gen.outputs()[0], request_id=reqs[idx[j]].id)
                bill.requests += 1
                bill.seconds = time.perf_counter() - t0
                yield RequestResult(id=reqs[idx[j]].id, output=out, generation=gen,
                                    index=index_offset + idx[j])
        bill.decoded_tokens += int(rnd.lengths.sum())
        bill.branch_steps += int(session.branch_steps)
        bill.prefill_tokens += len(session.context_ids) + sum(len(x) for x in session.ids)
        bill.batch_branch_steps += batch_branch_steps(rnd.lengths, *shape)
        bill.seconds = time.perf_counter() - t0


def finish_one(session, rnd, row: int):
    """The one-prompt Generation of round row `row` (`api.finish` on a view)."""
    s = session
    b = s.row_prompt[rnd.rows[row]]
    sub = copy.copy(s)
    sub.B, sub.ids, sub.prompt_ids, sub.texts = 1, [s.ids[b]], [s.prompt_ids[b]], [s.texts[b]]
    sub.prompt_logprobs = None if s.prompt_logprobs is None else [s.prompt_logprobs[b]]
    sub.row_prompt = [0]
    sub.timings = dict(s.timings)
    sl = slice(row, row + 1)
    view = types.SimpleNamespace(
        rows=[0], N=rnd.N, branch_ids=rnd.branch_ids[sl], tokens=rnd.tokens[sl],
        logprobs=rnd.logprobs[sl], lengths=rnd.lengths[sl], top_logprobs=rnd.top_logprobs[sl],
        top_ids=rnd.top_ids[sl], token_ranks=rnd.token_ranks[sl],
        signals=None if rnd.signals is None else rnd.signals[sl], stopped=rnd.stopped[sl],
        tail_bytes=rnd.tail_bytes)
    return api.finish(sub, [view])
