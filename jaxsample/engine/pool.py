"""The decode pool's size: a KV budget, what one row and one slot cost, and the
requests that can never run.

The decode state is R rows (one prompt's prefix cache each) x S slots (one
branch's tail each; `session.Round` refills them as branches finish). Its
size comes from a byte budget (`generate(max_kv_bytes=...)`):

    held = B x row + [R < B] R x row + R x S x slot  (+ the common context once)

`row` is one prompt's prefix KV (k and v over every layer, a local layer's
last `window - 1` positions only) plus its last logits and prompt mask; `slot`
is one branch's tail KV plus its decode buffers (logits `[V]`, tokens and
logprobs `[T]`, top logprobs, ranks, penalty counts, signals). Every prompt is
prefilled when the request starts (its prefix cache is held until the end:
the B x row term); the pool's rows are a copy of some of them when R < B.
The shape picked is every branch of a prompt in one row (S = n, full sharing)
with as many rows as fit, else one row with as many slots as fit.

Default budget: `DEFAULT_KV_FRACTION` of the device's memory
(`memory_stats()["bytes_limit"]`), or of the host's RAM on CPU (where the
device has no memory statistics).

Refused before any compute (InputError, a ValueError, one line with the
numbers): a budget that cannot hold the prompts' prefixes plus one branch's
tail, and results too large for host memory (`n` x T tokens with their
logprobs are returned, not streamed: `n = 2147483647` asks for terabytes).

Sources: vLLM's scheduler sizes its KV blocks from `gpu_memory_utilization`
(a fraction of device memory, 0.9 by default there); JetStream's fixed number
of decode slots.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import jax
import numpy as np

from jaxsample.engine.prefill import window_extent
from jaxsample.errors import InputError

DEFAULT_KV_FRACTION = 0.5  # of device memory (host RAM on CPU) for the KV cache and decode state
HOST_RESULTS_FRACTION = 0.5  # of host RAM the returned results may take


def host_memory_bytes() -> int:
    """Physical RAM of this host in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 8 GiB
        return 8 << 30


def device_memory_bytes(device=None) -> int:
    """The device's memory in bytes (`memory_stats()["bytes_limit"]`), or host RAM
    where the device reports none (CPU)."""
    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (backends without statistics)
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory_bytes()


def default_kv_budget() -> int:
    """`DEFAULT_KV_FRACTION` of the first device's memory, in bytes."""
    return int(DEFAULT_KV_FRACTION * device_memory_bytes())


def _kv(cfg, size: int) -> int:
    """Bytes of k and v over every layer for `size` positions (local layers: their window)."""
    item = np.dtype(cfg.jnp_dtype).itemsize
    return sum(2 * cfg.n_kv_heads * window_extent(size, w) * cfg.head_dim * item
               for w in cfg.layer_windows)


def row_bytes(cfg, p_cap: int, penalties: bool = False) -> int:
    """Bytes one pool row holds: the prefix KV for `p_cap` positions, its last
    logits `[V]` float32 and (penalties) its prompt mask `[V]` bool."""
    V = cfg.vocab_size
    return _kv(cfg, p_cap) + 4 * V + (V if penalties else 0)


def slot_bytes(cfg, t_cap: int, top_logprobs: int = 0, token_ranks: bool = False,
               penalties: bool = False, signals: bool = False) -> int:
    """Bytes one pool slot holds: the tail KV for `t_cap` positions and the decode
    buffers of `DecodeState` (logits, tokens, logprobs, top-k, ranks, counts, signals)."""
    V, T, k = cfg.vocab_size, t_cap, top_logprobs
    buffers = 4 * V + 8 * T + 8 * T * k + (4 * T if token_ranks else 0)
    buffers += (4 * V if penalties else 0) + (12 * T if signals else 0)
    return _kv(cfg, t_cap) + buffers


def result_bytes(B: int, n: int, T: int, top_logprobs: int = 0, token_ranks: bool = False,
                 signals: bool = False) -> int:
    """Host bytes of the results of B x n branches of T tokens (the round's host
    arrays and the Generation's copy: twice the per-token arrays)."""
    per_token = 8 + 8 * top_logprobs + (4 if token_ranks else 0) + (12 if signals else 0)
    return 2 * B * n * T * per_token


def check_results_fit(B: int, n: int, T: int, top_logprobs: int = 0, token_ranks: bool = False,
                      signals: bool = False, host_bytes: int | None = None) -> None:
    """InputError naming `n` when the returned results cannot fit in
    `HOST_RESULTS_FRACTION` of host memory."""
    need = result_bytes(B, n, T, top_logprobs, token_ranks, signals)
    have = int(HOST_RESULTS_FRACTION * (host_memory_bytes() if host_bytes is None
                                        else host_bytes))
    if need > have:
        raise InputError(
            f"n={n} x max_new_tokens={T} x {B} prompt(s) returns {need:,} bytes of tokens and "
            f"logprobs, more than {have:,} bytes ({HOST_RESULTS_FRACTION:.0%} of host memory); "
            f"lower n or max_new_tokens")


def plan(cfg, *, B: int, n: int, p_cap: int, t_cap: int, budget: int, context_bytes: int = 0,
         nd: int = 1, nb: int = 1, **buffers) -> tuple[int, int]:
    """(rows, slots) of the largest pool the budget holds (see the module docstring).

    Args:
      B, n: prompts and branches per prompt of the request.
      p_cap, t_cap: prefix and tail buckets.
      budget: bytes for every prefix, the pool and the context (`max_kv_bytes`).
      nd, nb: the mesh's data and branch axis sizes (rows and slots are split
        over them: bytes are per device, so the budget is per device too).
      buffers: `slot_bytes`'s flags (top_logprobs, token_ranks, penalties, signals).
    Raises:
      InputError: naming `max_kv_bytes`, with the numbers, when not even one
        row with one slot fits.
    """
    penalties = bool(buffers.get("penalties", False))
    row = row_bytes(cfg, p_cap, penalties)
    slot = slot_bytes(cfg, t_cap, **buffers)
    held = -(-B // nd) * row + context_bytes  # every prompt's prefix, per device
    if B * n <= 0:
        return max(B, 1), max(n, 1)
    full = held + -(-B // nd) * -(-n // nb) * slot
    if full <= budget:  # everything at once (the plain call)
        return B, n
    room = budget - held
    per_row_full = row + -(-n // nb) * slot
    if room >= per_row_full:
        rows = min(B, max(1, (room // per_row_full)) * nd)
        return int(rows), n
    if room < row + slot:
        raise InputError(
            f"max_kv_bytes={budget:,} cannot hold the prompts' prefixes ({held:,} bytes: "
            f"{B} x {row:,}, all prefilled at the start) plus one row ({row:,}) and one "
            f"branch's tail and buffers ({slot:,} bytes at max_new_tokens bucket {t_cap}); "
            f"raise max_kv_bytes or lower max_new_tokens")
    slots = min(n, int((room - row) // slot) * nb)
    return nd, max(slots, nb)


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
    """

    id: str
    prompt: Any = None
    messages: Any = None
    params: Any = None


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """What `run_requests` yields for one request.

    Attributes:
      id: the request's id.
      output: its `RequestOutput` (`request_id` = id).
      generation: a one-prompt `Generation` (tokens `[1, n, T]`, texts, bill:
        its decoded tokens are its own; `decode_steps`, `branch_steps` and the
        KV bytes are the pool's, up to the chunk it completed in).
      index: the request's position in the input.
    """

    id: str
    output: Any
    generation: Any
    index: int


def _check_requests(requests) -> list[Request]:
    from jaxsample.sampling import SamplingParams

    out, seen = [], set()
    for i, r in enumerate(requests):
        if isinstance(r, dict):
            unknown = set(r) - {"id", "prompt", "messages", "params"}
            if unknown:
                raise InputError(f"request {i}: unknown fields {sorted(unknown)} (allowed: id, "
                                 f"prompt, messages, params)")
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
                 mesh=None) -> RequestRun:
    """Run many requests through the decode pool; yield each result as it completes.

    Consecutive requests with the same SamplingParams and kind (prompt or
    messages) share one pool (`generate` with the budget's rows x slots);
    within it a request is yielded at the first chunk boundary after all its
    branches are done (continuous batching: vLLM's LLMEngine.step outputs,
    JetStream's generate loop). Request i's keys are those of prompt index i
    (`prompt_index_offset`), so its tokens equal `generate` on it alone with
    `prompt_index_offset=i` and the same seed (up to float ties).

    Args:
      lm: a loaded `LanguageModel`.
      requests: an iterable of `Request`s (or dicts with its fields; `id`
        defaults to the position).
      max_kv_bytes, chunk_size, mesh: as `jaxsample.generate`.
    Returns:
      A `RequestRun`: iterate it for `RequestResult`s in completion order;
      its `bill` (a `RunBill`) grows as groups end.
    Raises:
      InputError: a malformed request (naming its position and id), here,
        before any compute; then as `generate` for each group, before that
        group's compute.
    """
    from jaxsample.engine import inputs
    from jaxsample.sampling import SamplingParams

    reqs = _check_requests(requests)
    groups: list = []  # ((params, chat), [request positions])
    for i, r in enumerate(reqs):
        key = (r.params or SamplingParams(), r.messages is not None)
        if groups and groups[-1][0] == key:
            groups[-1][1].append(i)
        else:
            groups.append((key, [i]))
    for i, r in enumerate(reqs):  # every prompt encoded before the first compute
        chat = r.messages is not None
        try:
            inputs.encode_prompts(lm, [r.messages if chat else r.prompt], chat)
        except InputError as e:
            raise InputError(f"request {i} ({r.id!r}): {e}") from None
    bill = RunBill()
    return RequestRun(_run_groups(lm, reqs, groups, bill, max_kv_bytes, chunk_size, mesh), bill)


def _run_groups(lm, reqs, groups, bill, max_kv_bytes, chunk_size, mesh):
    import time

    from jaxsample.engine import api

    t0 = time.perf_counter()
    for (params, chat), idx in groups:
        prompts = [reqs[i].messages if chat else reqs[i].prompt for i in idx]
        session, rnd, chunk, observer = api.start(
            lm, prompts, params, chat=chat, mesh=mesh, bridge=None, prompt_index_offset=idx[0],
            naive=False, chunk_size=chunk_size if chunk_size is not None else api.STOP_CHUNK,
            progress=False, max_kv_bytes=max_kv_bytes)
        shape = rnd.col_of.shape
        sent = np.zeros(len(idx), bool)
        for _, more in api.chunks(session, rnd, chunk, False, observer):
            settled = ~sent & rnd.done.all(axis=1)
            for j in np.nonzero(settled)[0]:
                sent[j] = True
                gen = finish_one(session, rnd, int(j))
                out = dataclasses.replace(gen.outputs()[0], request_id=reqs[idx[j]].id)
                bill.requests += 1
                bill.seconds = time.perf_counter() - t0
                yield RequestResult(id=reqs[idx[j]].id, output=out, generation=gen,
                                    index=idx[j])
        bill.decoded_tokens += int(rnd.lengths.sum())
        bill.branch_steps += int(session.branch_steps)
        bill.prefill_tokens += len(session.context_ids) + sum(len(x) for x in session.ids)
        bill.batch_branch_steps += batch_branch_steps(rnd.lengths, *shape)
        bill.seconds = time.perf_counter() - t0


def finish_one(session, rnd, row: int):
    """The one-prompt Generation of round row `row` (`api.finish` on a view)."""
    import copy
    import types

    from jaxsample.engine import api

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
