"""The decode pool's size: a KV budget, what one row and one slot cost, and the
requests that can never run.

The decode state is R rows (one prompt's prefix cache each) x S slots (one
branch's tail each; `round.Round` refills them as branches finish). Its
size comes from a byte budget (`generate(max_kv_bytes=...)`):

    at once:  held = B x row + B x n x slot            (+ the common context once)
    a pool:   held = R x 2 row + R x S x slot          (+ the common context once)

`row` is one prompt's prefix KV (k and v over every layer, a local layer's
last `window - 1` positions only; at the model's dtype, so a W8A8 model's float16
prefix, `state.prefix_kv_dtype`, is priced at twice its bytes: the command line
checks a budget before the weights, and whether the CPU kernels run, are known)
plus its last logits and prompt mask; `slot`
is one branch's tail KV plus its decode buffers (logits `[V]`, tokens and
logprobs `[T]`, top logprobs, ranks, penalty counts, signals) plus what its
decode step needs while it runs (`step_bytes`: XLA's temporaries, the token
choice's `[V]` arrays and one layer's activations, which on a CPU are host
memory as much as the state is). At once, every
prompt is prefilled when the request starts. In a pool, a prompt is prefilled
when a row takes it (`Session(lazy_prefill=...)`, `Session.prefill_rows`):
only the pool's rows hold prefix caches, and a row's fresh prefill is held
beside the pool while it is copied in (the 2 x row).

The shape: when everything fits, every prompt in one row of n slots (the
plain call). Otherwise a pool of R rows x S slots, with S from `pool_slots`:
the fewest slots per row whose tails outweigh the row's copy of the prefix
`SHARING_RATIO` times (powers of two, at most n), and as many rows as fit. A
prompt may occupy several rows at once (`round.Round`: a row that frees up
takes the next branches of a prompt already in the pool before a new
prompt), so small rows cost prefix copies, not parallelism: short prompts get
small rows (a finished branch's slot is refilled sooner, and a row waits for
fewer slow branches before it frees), long prompts get n slots (one prefix
read for all of them). With `lockstep` (Bridge) S = n always.

Default budget: `DEFAULT_KV_FRACTION` of the device's memory
(`memory_stats()["bytes_limit"]`), or of the host's RAM on CPU (where the
device has no memory statistics).

Refused before any compute (InputError, a ValueError, one line with the
numbers): a budget that cannot hold the prompts' prefixes plus one branch's
tail, and results too large for host memory (`n` x T tokens with their
logprobs are returned, not streamed). A returned branch keeps, besides its
arrays, Python objects on the host (`HOST_BRANCH_BYTES`, `HOST_TOKEN_BYTES`
per token, `HOST_LOGPROB_BYTES` and `HOST_TOP_BYTES` per token with
logprobs: its text, its output record, token ids as Python ints, Logprob
dicts), so `result_bytes` counts those as well.

The per-slot and per-branch constants are upper bounds of measurements (XLA
CPU's `memory_analysis()` of the decode program at two slot counts; tracemalloc
and VmHWM of `run_requests` at two branch counts), checked by
tests/pool/test_host_memory.py, which bounds a real process's peak resident memory
by what `plan` and `result_bytes` count.

Sources: vLLM's scheduler sizes its KV blocks from `gpu_memory_utilization`
(a fraction of device memory, 0.9 by default there); JetStream's fixed number
of decode slots.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxsample.engine.prefill import window_extent
from jaxsample.errors import InputError

DEFAULT_KV_FRACTION = 0.5  # of device memory (host RAM on CPU) for the KV cache and decode state
SHARING_RATIO = 4  # a pool row's slots hold at least this many times its prefix copy's bytes
HOST_RESULTS_FRACTION = 0.5  # of host RAM the returned results may take
# One decode step's temporaries per slot: bytes per vocabulary entry (the token
# choice's [V] logits, masks and noise in float32), per element of one layer's
# activations (E + F + H x D, by k experts' F in a mixture of experts), and a floor.
STEP_BYTES_PER_VOCAB = 36
STEP_BYTES_PER_ACTIVATION = 12
STEP_BYTES_FLOOR = 8192
# Host bytes a returned branch keeps besides its arrays (`result_bytes`): its text,
# finish reason and output record; per kept token (its id as a Python int in the
# outputs' lists, its text); per token with logprobs (the position's Logprob dict);
# per top-logprob entry.
HOST_BRANCH_BYTES = 1024
HOST_TOKEN_BYTES = 96
HOST_LOGPROB_BYTES = 512
HOST_TOP_BYTES = 256


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


def kv_size(cfg, size: int) -> int:
    """Bytes of k and v over every layer for `size` positions (local layers: their window)."""
    item = np.dtype(cfg.jnp_dtype).itemsize
    return sum(2 * cfg.n_kv_heads * window_extent(size, w) * cfg.head_dim * item
               for w in cfg.layer_windows)


def row_bytes(cfg, p_cap: int, penalties: bool = False) -> int:
    """Bytes one pool row holds: the prefix KV for `p_cap` positions, its last
    logits `[V]` float32 and (penalties) its prompt mask `[V]` bool."""
    V = cfg.vocab_size
    return kv_size(cfg, p_cap) + 4 * V + (V if penalties else 0)


def step_bytes(cfg) -> int:
    """Bytes one slot's decode step needs while it runs, beyond the state: XLA's
    temporaries (the token choice's `[V]` float32 arrays, one layer's activations),
    an upper bound of `memory_analysis().temp_size_in_bytes` per slot of the compiled
    decode program (`STEP_BYTES_*`); independent of T."""
    k = max(1, int(getattr(cfg, "n_experts_per_tok", 0) or 1))
    act = cfg.dim + k * cfg.ffn_dim + cfg.n_heads * cfg.head_dim
    return (STEP_BYTES_PER_VOCAB * cfg.vocab_size + STEP_BYTES_PER_ACTIVATION * act
            + STEP_BYTES_FLOOR)


def slot_bytes(cfg, t_cap: int, top_logprobs: int = 0, token_ranks: bool = False,
               penalties: bool = False, signals: bool = False) -> int:
    """Bytes one pool slot takes: the tail KV for `t_cap` positions, the decode
    buffers of `DecodeState` (logits, tokens, logprobs, top-k, ranks, counts, signals)
    and its step's temporaries (`step_bytes`)."""
    V, T, k = cfg.vocab_size, t_cap, top_logprobs
    buffers = 4 * V + 8 * T + 8 * T * k + (4 * T if token_ranks else 0)
    buffers += (4 * V if penalties else 0) + (12 * T if signals else 0)
    return kv_size(cfg, t_cap) + buffers + step_bytes(cfg)


def result_bytes(B: int, n: int, T: int, top_logprobs: int = 0, token_ranks: bool = False,
                 signals: bool = False) -> int:
    """Host bytes of the results of B x n branches of up to T tokens: the per-token
    arrays twice (the round's host arrays and the Generation's copy) and each
    branch's Python objects (`HOST_*_BYTES`; with logprobs, `token_ranks` on, the
    outputs' Logprob dicts of 1 + `top_logprobs` entries per token)."""
    per_token = 2 * (8 + 8 * top_logprobs + (4 if token_ranks else 0) + (12 if signals else 0))
    per_token += HOST_TOKEN_BYTES
    if token_ranks:
        per_token += HOST_LOGPROB_BYTES + HOST_TOP_BYTES * top_logprobs
    return B * n * (HOST_BRANCH_BYTES + T * per_token)


def check_results_fit(B: int, n: int, T: int, top_logprobs: int = 0, token_ranks: bool = False,
                      signals: bool = False, host_bytes: int | None = None) -> None:
    """InputError naming `n` when the returned results cannot fit in
    `HOST_RESULTS_FRACTION` of host memory, with the numbers (bytes per branch,
    total, the limit)."""
    need = result_bytes(B, n, T, top_logprobs, token_ranks, signals)
    have = int(HOST_RESULTS_FRACTION * (host_memory_bytes() if host_bytes is None
                                        else host_bytes))
    if need > have:
        per = result_bytes(1, 1, T, top_logprobs, token_ranks, signals)
        raise InputError(
            f"n={n} x {B} prompt(s) of up to max_new_tokens={T} tokens keep about {need:,} "
            f"bytes on the host ({per:,} per branch: its tokens, logprobs, text and Python "
            f"objects), more than {have:,} bytes ({HOST_RESULTS_FRACTION:.0%} of host "
            f"memory); lower n or max_new_tokens")


def pool_slots(n: int, row: int, slot: int, nb: int = 1) -> int:
    """Slots per pool row: the smallest `nb * 2^j` with `slots * slot >=
    SHARING_RATIO * row` (the prefix copy at most 1/SHARING_RATIO of the
    tails it serves), capped at n rounded up to a multiple of nb.

    Args:
      n: branches per prompt; row, slot: bytes (`row_bytes`, `slot_bytes`),
        per device; nb: the mesh's branch axis size.
    """
    cap = -(-n // nb) * nb
    size = nb
    while size < cap and (size // nb) * slot < SHARING_RATIO * row:
        size *= 2
    return min(size, cap)


def mixed_slots(ns, row: int, slot: int, nb: int = 1) -> int:
    """Slots per row for prompts with different n: of the `nb * 2^j` up to the
    largest n (rounded up to nb), the one that holds every branch in the fewest
    bytes, `sum_b ceil(n_b / S) * (row + S * slot)` (each prompt in as many
    rows of S slots as its branches need; idle slots and prefix copies both
    count), the larger S on ties.

    Args:
      ns: each prompt's n; row, slot: bytes (`row_bytes`, `slot_bytes`);
        nb: the mesh's branch axis size.
    """
    cap = -(-max(ns) // nb) * nb
    best, size = None, nb
    while True:
        S = min(size, cap)
        cost = sum(-(-n // S) * (row + -(-S // nb) * slot) for n in ns)
        if best is None or cost <= best[0]:
            best = (cost, S)
        if S >= cap:
            return best[1]
        size *= 2


def plan(cfg, *, B: int, n, p_cap: int, t_cap: int, budget: int, context_bytes: int = 0,
         nd: int = 1, nb: int = 1, lockstep: bool = False, **buffers) -> tuple[int, int]:
    """(rows, slots) of the largest pool the budget holds (see the module docstring).

    Args:
      B, n: prompts and branches per prompt of the request (an int, or B ints:
        prompts with different n share rows of `mixed_slots` slots, each prompt
        in as many rows as its branches need).
      p_cap, t_cap: prefix and tail buckets.
      budget: bytes for every prefix, the pool and the context (`max_kv_bytes`).
      nd, nb: the mesh's data and branch axis sizes (rows and slots are split
        over them: bytes are per device, so the budget is per device too).
      lockstep: every branch of a prompt in one row (Bridge): slots = n.
      buffers: `slot_bytes`'s flags (top_logprobs, token_ranks, penalties, signals).
    Raises:
      InputError: naming `max_kv_bytes`, with the numbers, when not even one
        row with one slot fits.
    """
    penalties = bool(buffers.get("penalties", False))
    row = row_bytes(cfg, p_cap, penalties)
    slot = slot_bytes(cfg, t_cap, **buffers)
    if not isinstance(n, (int, np.integer)):
        ns = [int(x) for x in n]
        if len(set(ns)) > 1:
            return _plan_mixed(ns, row, slot, budget, context_bytes, nd, nb, t_cap)
        n = ns[0]
    if B * n <= 0:
        return max(B, 1), max(n, 1)
    full = context_bytes + -(-B // nd) * (row + -(-n // nb) * slot)  # per device
    if full <= budget:  # everything at once (the plain call)
        return B, n
    room = budget - context_bytes
    S = n if lockstep else pool_slots(n, row, slot, nb)
    per_row = 2 * row + -(-S // nb) * slot
    if room >= per_row:
        # At most every branch at once: B prompts x ceil(n / S) rows each.
        rows = min(B * -(-n // S), max(1, room // per_row) * nd)
        return int(rows), S
    if room < 2 * row + slot:
        raise InputError(
            f"max_kv_bytes={budget:,} cannot hold one pool row (a prompt's prefix at the "
            f"model's dtype, {row:,} bytes, held twice while it is prefilled and copied in"
            + (f", beside the common context's {context_bytes:,}" if context_bytes else "")
            + f") and one branch's tail and buffers ({slot:,} bytes at max_new_tokens "
            f"bucket {t_cap}); raise max_kv_bytes or lower max_new_tokens")
    slots = min(n, int((room - 2 * row) // slot) * nb)
    return nd, max(slots, nb)


def _plan_mixed(ns, row, slot, budget, context_bytes, nd, nb, t_cap) -> tuple[int, int]:
    """`plan` for prompts with different n: rows of `mixed_slots` slots, as many
    as hold every branch at once, or as fit the budget (a pool). Raises InputError
    as `plan`."""
    S = mixed_slots(ns, row, slot, nb)
    rows = sum(-(-n // S) for n in ns)
    room = budget - context_bytes
    if -(-rows // nd) * (row + -(-S // nb) * slot) <= room:
        return rows, S
    per_row = lambda S: 2 * row + -(-S // nb) * slot  # a pool row: its prefill held beside it
    while S > nb and room < per_row(S):  # narrower rows before refusing
        S = max(nb, S // 2)
    if room < per_row(S):
        raise InputError(
            f"max_kv_bytes={budget:,} cannot hold one pool row (a prompt's prefix at the "
            f"model's dtype, {row:,} bytes, held twice while it is prefilled and copied in"
            + (f", beside the common context's {context_bytes:,}" if context_bytes else "")
            + f") and its {S} slots ({slot:,} bytes each at max_new_tokens bucket {t_cap}); "
            f"raise max_kv_bytes or lower max_new_tokens")
    rows = sum(-(-n // S) for n in ns)
    return int(min(rows, (room // per_row(S)) * nd)), S


def plan_params(cfg, params, *, B: int, p_cap: int, budget: int, context_bytes: int = 0,
                nd: int = 1, nb: int = 1, lockstep: bool = False) -> tuple[int, int]:
    """`plan` for B prompts sampled with `params` (a SamplingParams): the tail
    bucket and the buffers' flags read from it, as `Session` sizes its pool.
    The up-front check of requests whose pools start later (`run_requests`,
    the command line's `--kv-budget`). Raises InputError as `plan`."""
    from jaxsample.engine.buckets import bucket

    return plan(cfg, B=B, n=params.n, p_cap=p_cap, t_cap=bucket(params.max_new_tokens),
                budget=budget, context_bytes=context_bytes, nd=nd, nb=nb, lockstep=lockstep,
                top_logprobs=params.logprobs or 0, token_ranks=params.logprobs is not None,
                penalties=params.penalties, signals=params.signals)
