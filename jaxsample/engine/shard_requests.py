"""One process's share of many requests under `jax.distributed` (multi-host).

Every process of the job reads the same request list, validates all of it
(so a bad line fails on every process, before any compute) and takes one
contiguous block by position: with R requests and C processes, process p
takes positions `[p * R // C, (p + 1) * R // C)` (block sizes differ by at
most one; a process may get none when R < C). It runs its block with
`run_requests(..., index_offset=start)`, so request i keeps prompt index i:
its keys `fold_in(fold_in(key(seed), i), branch)` and therefore its tokens
are those of a single-process run of the whole list (up to float ties: other
pool shapes), and `RequestResult.index` is its global position. Each process
writes its own part of the output (`jaxsample.cli.merge.part_path`), and
`jaxsample merge --out out.jsonl` joins the parts in request order.

Contiguous blocks rather than request i on process i % C: `run_requests`
takes one index offset per call (a strided share would need a prompt index
per request in the engine), consecutive requests with equal params still
share one pool, and the command line's batches (`prompt_index_offset` =
the batch's first index) stay correct. A list sorted by cost gives one
process the expensive end: shuffle it beforehand (ids travel with the
requests, keys with their positions) if that matters.

Sources: the per-host data split of JAX's multi-host guide
(`jax.process_index()` / `jax.process_count()`); levanter's global keys.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxsample.engine import requests as requests_lib
from jaxsample.errors import InputError


@dataclasses.dataclass(frozen=True)
class Share:
    """One process's block of a request list.

    Attributes:
      requests: its `Request`s, in input order (dicts converted; a dict
        without an id gets its global position as id, as in a single run).
      start, stop: its global positions `[start, stop)`.
      process_index, process_count: the process and the job's process count.
      total: the whole list's length.
    """

    requests: list
    start: int
    stop: int
    process_index: int
    process_count: int
    total: int


def share_bounds(total: int, process_index: int, process_count: int) -> tuple[int, int]:
    """`[start, stop)` of process `process_index`'s block of `total` requests."""
    return (process_index * total // process_count, (process_index + 1) * total // process_count)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def process_share(requests, process_index: int | None = None,
                  process_count: int | None = None) -> Share:
    """This process's contiguous block of `requests` (module docstring).

    Args:
      requests: the whole list, the same on every process (`Request`s or
        dicts with its fields, as `run_requests` takes them).
      process_index, process_count: default `jax.process_index()` and
        `jax.process_count()` (call `jax.distributed.initialize` first).
    Returns:
      A `Share`; run it with `run_share` (or `run_requests(lm,
      share.requests, index_offset=share.start)`).
    Raises:
      InputError: a malformed request anywhere in the list (naming its global
        position and id; ids must be unique over the whole list), or a
        process index outside `[0, process_count)`.
    """
    count = jax.process_count() if process_count is None else process_count
    index = jax.process_index() if process_index is None else process_index
    _check_int("process_count", count, 1)
    _check_int("process_index", index, 0)
    if index >= count:
        raise InputError(f"process_index must be below process_count ({count}), got {index}")
    reqs = requests_lib.check_requests(list(requests))  # the whole list, on every process
    start, stop = share_bounds(len(reqs), index, count)
    return Share(requests=reqs[start:stop], start=start, stop=stop, process_index=index,
                 process_count=count, total=len(reqs))


def run_share(lm, share: Share, **kwargs) -> requests_lib.RequestRun:
    """`run_requests` over a share with its global positions (`index_offset=share.start`).

    Args:
      lm: a loaded `LanguageModel`.
      share: from `process_share`.
      kwargs: `max_kv_bytes`, `chunk_size`, `mesh` (a mesh over this process's
        own devices: the processes run independently).
    """
    return requests_lib.run_pool(lm, share.requests, index_offset=share.start, **kwargs)
