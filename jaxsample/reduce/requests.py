"""Many requests in, each result out with its vote: `run_requests` over the
decode pool, each request's self-consistency vote, and adaptive rules per
request.

`engine.run_requests` streams each request's `RequestOutput` as its branches
finish; this adds, per request, the vote over its branches' answers (Wang et
al. 2022, arXiv 2203.11171: `self_consistency`) and runs a request with an
`adaptive` rule through `adaptive_self_consistency` (ESC, Beta, Dirichlet,
DeepConf; `jaxsample.reduce.adaptive`). vLLM's offline `LLM.generate` has no
vote; its per-request `RequestOutput` is `RequestResult.output` here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from jaxsample.engine.requests import (RequestResult, check_budgets, check_prompts,
                                       check_requests, param_groups)
from jaxsample.engine.requests import run_requests as run_pool
from jaxsample.errors import ExtractError, InputError, short_repr
from jaxsample.floats import shortest_float32
from jaxsample.reduce import adaptive as adaptive_lib
from jaxsample.reduce.self_consistency import self_consistency
from jaxsample.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestVote:
    """A request's self-consistency vote.

    Attributes:
      answer: the winning answer (a normalised string), None when no branch
        gave one.
      share: the winner's fraction of the counted votes (or weight), in [0, 1]: the
        float32 vote's value as the shortest decimal that reads back as it
        (`floats.shortest_float32`: 0.15873016, what the command line writes).
      support: the winner's votes (DeepConf: their summed confidence weight), the
        same way.
      answers: each branch's answer (None: none extracted), branch order; for
        an adaptive request only the branches drawn.
      n: branches drawn (`params.n`, or the adaptive rule's `n_used`).
    """

    answer: str | None
    share: float
    support: float
    answers: list
    n: int


def _check(reqs) -> None:
    """Every request's adaptive options, extractor and prompt, before any compute."""
    for i, r in enumerate(reqs):
        where = f"request {i} ({r.id!r})"
        try:
            adaptive_lib.extractor(r.extract)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if r.adaptive is None:
            continue
        if not isinstance(r.adaptive, Mapping):
            raise InputError(f"{where}: adaptive must be a dict of "
                             f"{', '.join(adaptive_lib.OPTIONS)}, got {type(r.adaptive).__name__}")
        unknown = sorted(set(r.adaptive) - set(adaptive_lib.OPTIONS))
        if unknown:
            raise InputError(f"{where}: adaptive has unknown options {unknown} (allowed: "
                             f"{', '.join(adaptive_lib.OPTIONS)})")
        try:
            adaptive_lib.check_options(**r.adaptive)
        except InputError as e:
            raise InputError(f"{where}: adaptive {e}") from None


def _groups(reqs):
    """Consecutive stretches: ("pool", [positions]) of plain requests, and
    ("adaptive", [positions]) of adaptive requests with equal settings."""
    out = []
    for i, r in enumerate(reqs):
        if r.adaptive is None:
            key = ("pool",)
        else:
            key = ("adaptive", r.params or SamplingParams(), r.messages is not None,
                   tuple(sorted(r.adaptive.items())), r.extract)
        if out and out[-1][0] == key:
            out[-1][1].append(i)
        else:
            out.append((key, [i]))
    return out


def run_requests(lm, requests, *, max_kv_bytes: int | None = None,
                 chunk_size: int | None = None, mesh=None,
                 index_offset: int = 0) -> Iterator[RequestResult]:
    """Run many requests; yield each one's result, with its vote, as it completes.

    Plain requests (no `adaptive`) run through `engine.run_requests` (the
    decode pool; consecutive plain requests form one stretch, one pool per
    run of equal SamplingParams) and are yielded as their branches finish,
    each with `vote` = the majority vote of its branches' answers
    (`self_consistency(extract=request.extract)`). Consecutive adaptive
    requests with equal params, kind and options run as one
    `adaptive_self_consistency` call (its own pool of `window` slots per
    prompt) and are yielded together when it ends, each with its vote (the
    rule's winner, DeepConf-weighted with `confidence`) and the group's
    `AdaptiveResult`. Request i's keys are those of prompt index
    `index_offset + i` in both cases, so its tokens equal a run of it alone
    at that index (up to float ties).

    Args:
      lm: a loaded `LanguageModel`.
      requests: `Request`s or dicts of their fields (`engine.requests.Request`:
        id, prompt or messages, params, adaptive, extract).
      max_kv_bytes, chunk_size, mesh: as `jaxsample.generate`, for the plain
        requests (an adaptive request's chunk size is its `adaptive`
        option "chunk_size"; it takes no KV budget).
      index_offset: the global position of the first request (an int >= 0;
        `engine.shard_requests.process_share`).
    Yields:
      `RequestResult`s (`output`, `vote`, `adaptive`, `index`, `generation`)
      in completion order.
    Raises:
      InputError: a malformed request, a bad adaptive option or extractor, a
        prompt the tokenizer refuses, or plain requests whose pool the KV
        budget cannot hold, naming the request, before any compute; then as
        `adaptive_self_consistency` per adaptive stretch, before its compute.
    """
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise InputError(f"index_offset must be an int >= 0, got {index_offset!r}")
    reqs = check_requests(requests)
    _check(reqs)
    lengths = check_prompts(lm, reqs)  # every prompt encoded before the first compute
    for key, idx in _groups(reqs):  # and every plain stretch's pools against the KV budget
        if key[0] == "pool":
            check_budgets(lm, reqs, param_groups(reqs, idx), lengths, max_kv_bytes, mesh)
    return _run(lm, reqs, max_kv_bytes, chunk_size, mesh, index_offset)


def _run(lm, reqs, max_kv_bytes, chunk_size, mesh, index_offset):
    for key, idx in _groups(reqs):
        start = idx[0]
        if key[0] == "pool":
            for res in run_pool(lm, [reqs[i] for i in idx], max_kv_bytes=max_kv_bytes, chunk_size=chunk_size,
                                mesh=mesh, index_offset=index_offset + start):
                r = reqs[res.index - index_offset]
                try:
                    sc = self_consistency(res.generation, extract=r.extract)
                except ExtractError as e:
                    raise ExtractError(f"request {r.id!r} (index {res.index}): {e}") from e
                vote = RequestVote(answer=sc.winner[0], share=shortest_float32(sc.share[0]),
                                   support=shortest_float32(sc.support[0]),
                                   answers=list(sc.answers[0]),
                                   n=len(sc.answers[0]))
                yield dataclasses.replace(res, vote=vote)
            continue
        _, params, chat, options, extract = key
        prompts = [reqs[i].messages if chat else reqs[i].prompt for i in idx]
        try:
            result = adaptive_lib.adaptive_self_consistency(
                lm, prompts, params, chat=chat, mesh=mesh, extract=extract,
                prompt_index_offset=index_offset + start, **dict(options))
        except ExtractError as e:
            ids = [reqs[i].id for i in idx]
            raise ExtractError(f"requests {short_repr(ids)} (one adaptive call): {e}") from e
        outputs = result.generation.outputs()
        for b, i in enumerate(idx):
            vote = RequestVote(answer=result.winner[b], share=shortest_float32(result.share[b]),
                               support=shortest_float32(result.support[b]),
                               answers=list(result.answers[b]),
                               n=int(result.n_used[b]))
            # Its branches drawn only (the group's Generation pads to the longest n_used).
            out = dataclasses.replace(outputs[b], request_id=reqs[i].id,
                                      outputs=outputs[b].outputs[:vote.n])
            yield RequestResult(id=reqs[i].id, output=out, generation=result.generation,
                                index=index_offset + i, vote=vote, adaptive=result)
