"""Many requests in, each result out with its vote: `run_requests` over the
decode pool, each request's self-consistency vote, and adaptive rules per
request.

`engine.run_pool` streams each request's `RequestOutput` as its branches
finish; this adds, per request, the vote over its branches' answers (Wang et
al. 2022, arXiv 2203.11171: `self_consistency`) and runs a request with an
`adaptive` rule through `adaptive_self_consistency` (ESC, Beta, Dirichlet,
DeepConf; `jaxsample.reduce.adaptive`). vLLM's offline `LLM.generate` has no
vote; its per-request `RequestOutput` is `RequestResult.output` here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from jaxsample.engine.requests import (
    RequestResult,
    check_requests,
    encode_requests,
    open_pool,
    pool_results,
)
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
                 chunk_size: int | None = None, mesh=None, index_offset: int = 0,
                 seed: int | None = None, progress=False,
                 max_model_len: int | None = None,
                 attention: str = "auto") -> Iterator[RequestResult]:
    """Run many requests; yield each one's result, with its vote, as it completes.

    Plain requests (no `adaptive`) run through the decode pool
    (`engine.requests`: consecutive plain requests form one stretch, one pool
    whatever their SamplingParams) and are yielded as their branches finish,
    each with `vote` = the majority vote of its branches' answers
    (`self_consistency(extract=request.extract)`). Consecutive adaptive
    requests with equal params, kind and options run as one
    `adaptive_self_consistency` call (its own pool of `window` slots per
    prompt) and are yielded together when it ends, each with its vote (the
    rule's winner, DeepConf-weighted with `confidence`) and the group's
    `AdaptiveResult`. Keys: a plain request with its own seed draws from
    (seed, branch) alone; any other request from (`seed`, its position
    `index_offset + i`), adaptive groups with their params' seed as the
    group's (`adaptive_self_consistency`).

    Args:
      lm: a loaded `LanguageModel`.
      requests: `Request`s or dicts of their fields (`engine.requests.Request`:
        id, prompt or messages, params, adaptive, extract).
      max_kv_bytes, chunk_size, mesh, progress: as `jaxsample.generate`, for the
        plain requests (an adaptive request's chunk size is its `adaptive`
        option "chunk_size"; it takes no KV budget).
      index_offset: the global position of the first request (an int >= 0;
        `engine.shard_requests.process_share`).
      seed: the seed of plain requests without their own (None: random).
      max_model_len: the longest prompt + max_tokens a plain request may have
        (default the model's context).
      attention: the decode step's attention for the plain requests, as
        `jaxsample.generate`'s.

    Yields:
      `RequestResult`s (`output`, `vote`, `adaptive`, `index`, `generation`)
      in completion order.

    Raises:
      InputError: a malformed request, a bad adaptive option or extractor, a
        prompt the tokenizer refuses, or a stretch of plain requests whose pool
        the KV budget cannot hold, naming the request, before any compute; then
        as `adaptive_self_consistency` per adaptive stretch, before its compute.
    """
    if isinstance(index_offset, bool) or not isinstance(index_offset, int) or index_offset < 0:
        raise InputError(f"index_offset must be an int >= 0, got {index_offset!r}")
    reqs = check_requests(requests)
    _check(reqs)
    ids, texts = encode_requests(lm, reqs)  # every prompt encoded before the first compute
    pools = {}  # every plain stretch's pool against the KV budget, before any compute
    for key, idx in _groups(reqs):
        if key[0] == "pool":
            try:
                pools[idx[0]] = open_pool(
                    lm, [reqs[i] for i in idx], ([ids[i] for i in idx], [texts[i] for i in idx]),
                    max_kv_bytes=max_kv_bytes, mesh=mesh, index_offset=index_offset + idx[0],
                    progress=progress, seed=seed, max_model_len=max_model_len,
                    attention=attention)
            except InputError as e:
                raise InputError(f"requests {idx[0]}-{idx[-1]} (from {reqs[idx[0]].id!r}, their "
                                 f"pool): {e}") from None
    return _run(lm, reqs, pools, chunk_size, mesh, index_offset, seed)


def _run(lm, reqs, pools, chunk_size, mesh, index_offset, seed):
    for key, idx in _groups(reqs):
        start = idx[0]
        if key[0] == "pool":
            for res in pool_results(pools.pop(start), [reqs[i] for i in idx],
                                    chunk_size=chunk_size, index_offset=index_offset + start):
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
        if params.seed is None and seed is not None:
            params = params.replace(seed=seed)
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
