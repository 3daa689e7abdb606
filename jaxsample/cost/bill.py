"""The one `Bill` type: what a run cost, measured, beside the analytic estimate.

Every `Generation` carries one (`generate`, each request of a pool, the
branches of an adaptive run); a `run_pool` run carries one for the whole pool.
The counts actually measured (prompt tokens prefilled, tokens decoded per
branch, branch-steps computed, the `nbytes` of the KV-cache arrays allocated)
and the analytic estimate of `model.py` beside them. Prefix sharing saves
prefill work and prefix memory, never the per-branch decode.

Parts that apply to some runs only are optional, None elsewhere:
`Bill.adaptive` (`AdaptiveSaving`: an adaptive run against the same request at
a fixed max_n) and `Bill.pool` (`PoolRun`: a pool run's requests, wall time
and batch-by-batch baseline).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import numpy as np

from jaxsample.cost.formatting import format_bytes, format_flops
from jaxsample.cost.model import (
    MAX_COUNT,
    check_count,
    decode_flops,
    expected_experts_touched,
    kv_bytes_per_token,
    prefill_flops,
    resolve_dtype_bytes,
    step_weight_bytes,
    suffix_prefill_flops,
    weight_bytes,
)

PARTS = ("adaptive", "pool")  # the optional parts of a `Bill`, None where they do not apply


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaptiveSaving:
    """An adaptive run (`adaptive_self_consistency`) against the same request at a fixed
    `max_n`: the `adaptive` part of its `Bill`.

    The run's own counts are the bill's (`decoded_tokens_total`, `branch_steps`,
    `decode_flops_shared`, `prompt_tokens_prefilled`: each prompt prefilled
    once across all rounds).

    Attributes:
      max_n: the fixed budget of branches per prompt.
      rounds: windows drawn (the longest prompt's count).
      branches_drawn: branches decoded in all (the sum of `n_used`).
      fixed_decoded_tokens, fixed_decode_flops: estimated for the fixed run
        (`generate(n=max_n)` decodes every branch to its end; branches not
        drawn, and the rest of terminated ones, are estimated at the mean
        length of the prompt's complete branches).
      token_saving: 1 - decoded tokens / fixed_decoded_tokens (0: nothing saved).
      flop_saving: 1 - decode FLOPs / fixed_decode_flops.
    """

    max_n: int
    rounds: int
    branches_drawn: int
    fixed_decoded_tokens: int
    fixed_decode_flops: int
    token_saving: float
    flop_saving: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (plain ints and floats)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolRun:
    """A `run_pool` run of many requests through one decode pool: the `pool` part of the
    run's `Bill` (whose counts are the whole pool's).

    Attributes:
      requests: requests completed.
      seconds: wall time of the run, in seconds.
      batch_branch_steps: slots x steps the same requests would have cost batch
        by batch at the pool's shape (`engine.requests.batch_branch_steps`):
        the baseline of the bill's `branch_steps`.
    """

    requests: int
    seconds: float
    batch_branch_steps: int

    @property
    def requests_per_second(self) -> float:
        """requests / seconds (0.0 for a run of no time)."""
        return self.requests / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (plain ints and floats), `requests_per_second` included."""
        return {**dataclasses.asdict(self), "requests_per_second": self.requests_per_second}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bill:
    """What a run cost: measured counts and the analytic estimate.

    Measured (from the engine):
      num_prompts: B.
      n: N, branches per prompt (where prompts ask for different n, the most:
        the others' per-branch lists are padded with zeros and the
        `*_if_separate` figures count N for every prompt).
      decode_steps: decode-loop iterations run (all B*N branches advance together).
      branch_steps: branch slots x steps actually computed (padding and
        finished slots included, after compaction): what the decode paid for.
      prompt_tokens_prefilled: sum of the B prompt lengths, each prefilled once.
      prompt_tokens_if_separate: N times that (N retries prefill the prompt N times).
      decoded_tokens_per_branch: B lists of N ints, tokens the device decoded
        per branch (the stop token included): what was paid for.
      decoded_tokens_total: their sum. The same with or without prefix sharing.
      kept_tokens_per_branch: B lists of N ints, tokens each branch keeps,
        equal to `Generation.lengths`; a branch cut by a stop string keeps
        fewer than it decoded (the tokens after the stop string are
        discarded, see `tokens_discarded`); otherwise kept == decoded.
      kept_tokens_total: their sum.
      kv_bytes_shared_prefix: `nbytes` of one copy of the prefix cache of the
        request's prompts (padded to the length bucket; the padding rows that
        fill a data axis are not counted).
      kv_bytes_tails: `nbytes` of the request's branch tails (padded to the bucket).
      kv_bytes_held: the two together.
      kv_bytes_if_separate: N full copies at the same padded sizes,
        `N * kv_bytes_shared_prefix + kv_bytes_tails` (like for like).
      devices: devices the request ran on (1 without a mesh).
      kv_bytes_per_device: KV cache allocated on one device (its shard of the
        prefix, replicated over the "branch" mesh axis, plus its tails).
      kv_bytes_allocated: KV cache allocated on all devices together: on a mesh
        with a "branch" axis of size b the prefix is stored b times, so this
        exceeds `kv_bytes_held`; padding rows included (they are allocated).

    Analytic (see the module docstring; from the unpadded lengths):
      prefill_flops_shared / prefill_flops_if_separate: 1x against Nx prefill.
      decode_flops_shared / decode_flops_if_separate: equal, always.
      decode_bytes_read_shared / decode_bytes_read_if_separate: weights, prefix
        and tails read over the decode steps (separate = batched retries: weights
        once per step, N prefix copies).
      weight_bytes, kv_bytes_per_token: the model constants used.

    Three levels (`generate(shared_prefix=...)`; all 0 / equal to the two-level
    fields without one):
      shared_context_tokens: C, tokens of the context common to all B prompts,
        prefilled and stored once; `prompt_tokens_prefilled` is then
        C + the B prompts' own tokens, and `prompt_tokens_if_separate`
        N x sum(C + own).
      kv_bytes_shared_context: `nbytes` of its one cache (padded to its bucket),
        included in `kv_bytes_held` (context once + prompts' own once each +
        tails); `kv_bytes_if_separate` counts B x N context copies.
      prompt_tokens_if_context_per_prompt, prefill_flops_if_context_per_prompt:
        what the context prefixed to every prompt would prefill (B contexts,
        branches still sharing each prompt: `generate` without shared_prefix).

    Sparse mixture of experts (0 / None for a dense model):
      experts, experts_per_token: X and k.
      slots_per_step: branch slots computed per decode step, averaged
        (`branch_steps / decode_steps`): the tokens of one MoE call.
      experts_touched_per_step: expected distinct experts per layer per decode
        step at that many tokens under uniform routing
        (`expected_experts_touched`); k at N = 1, near X at large N.
        `decode_bytes_read_*` count the experts' weights at this rate.
      experts_touched_measured: the count the router really gave, per layer
        and decode step, averaged; None until `measure_experts_touched`
        replays the request (`dataclasses.replace` a bill with it).

    Optional parts (None where they do not apply):
      adaptive: an `AdaptiveSaving`, on the bill of an adaptive run's
        `Generation` (`adaptive_self_consistency`): the run against the same
        request at a fixed max_n.
      pool: a `PoolRun`, on the bill of a whole `run_pool` run (its
        `RequestRun.bill`): requests, seconds and the batch-by-batch baseline.
    """

    num_prompts: int
    n: int
    decode_steps: int
    branch_steps: int
    prompt_tokens_prefilled: int
    prompt_tokens_if_separate: int
    decoded_tokens_per_branch: list[list[int]]
    decoded_tokens_total: int
    kept_tokens_per_branch: list[list[int]]
    kept_tokens_total: int
    kv_bytes_held: int
    kv_bytes_shared_prefix: int
    kv_bytes_tails: int
    kv_bytes_if_separate: int
    prefill_flops_shared: int
    prefill_flops_if_separate: int
    decode_flops_shared: int
    decode_flops_if_separate: int
    decode_bytes_read_shared: int
    decode_bytes_read_if_separate: int
    weight_bytes: int
    kv_bytes_per_token: int
    devices: int = 1
    kv_bytes_per_device: int = 0
    kv_bytes_allocated: int = 0
    shared_context_tokens: int = 0
    kv_bytes_shared_context: int = 0
    prompt_tokens_if_context_per_prompt: int = 0
    prefill_flops_if_context_per_prompt: int = 0
    experts: int = 0
    experts_per_token: int = 0
    slots_per_step: float = 0.0
    experts_touched_per_step: float = 0.0
    experts_touched_measured: float | None = None
    adaptive: AdaptiveSaving | None = None
    pool: PoolRun | None = None

    @property
    def tokens_discarded(self) -> int:
        """Tokens decoded after a stop string and dropped: decoded - kept (>= 0)."""
        return self.decoded_tokens_total - self.kept_tokens_total

    @property
    def kv_saving(self) -> float:
        """kv_bytes_if_separate / kv_bytes_held (>= 1; 1 at N = 1)."""
        return self.kv_bytes_if_separate / max(self.kv_bytes_held, 1)

    @property
    def slot_utilisation(self) -> float:
        """decoded_tokens_total / branch_steps: the share of the slot-steps computed that
        decoded a token (1.0: no slot ever idle; 0.0 when nothing was computed)."""
        return self.decoded_tokens_total / self.branch_steps if self.branch_steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (plain ints, floats and lists; each part a dict or None), with
        `kv_saving`, `tokens_discarded` and `slot_utilisation`."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("decoded_tokens_per_branch", "kept_tokens_per_branch"):
            d[name] = [list(map(int, row)) for row in getattr(self, name)]
        for name in PARTS:
            part = getattr(self, name)
            d[name] = None if part is None else part.to_dict()
        d["kv_saving"] = self.kv_saving
        d["tokens_discarded"] = self.tokens_discarded
        d["slot_utilisation"] = self.slot_utilisation
        return d

    def summary(self) -> str:
        """A few lines for people: what was shared, what was not, and a line per part."""
        lines = self._context_lines() + self._request_lines()
        if self.experts:
            measured = ("" if self.experts_touched_measured is None else
                        f", measured {self.experts_touched_measured:.2f}")
            lines.append(
                f"mixture of experts: {self.experts_per_token} of {self.experts} experts per "
                f"token; {self.slots_per_step:.1f} tokens per decode step touch "
                f"{self.experts_touched_per_step:.2f} distinct experts per layer under "
                f"uniform routing{measured} (one branch alone: {self.experts_per_token})")
        if self.devices > 1:
            lines.append(
                f"on {self.devices} devices: {format_bytes(self.kv_bytes_per_device)} of KV "
                f"cache per device, {format_bytes(self.kv_bytes_allocated)} allocated in all "
                f"(the prefix is replicated on every device of the branch axis)")
        if self.adaptive is not None:
            lines.append(self._adaptive_line())
        if self.pool is not None:
            lines.append(self._pool_line())
        return "\n".join(lines)

    def _context_lines(self) -> list[str]:
        if not self.shared_context_tokens:
            return []
        return [f"shared context: {self.shared_context_tokens} tokens prefilled and stored once "
                f"for {self.num_prompts} prompts x {self.n} branches "
                f"({format_bytes(self.kv_bytes_shared_context)} of KV); prefixed to every "
                f"prompt it would prefill {self.prompt_tokens_if_context_per_prompt} tokens "
                f"({format_flops(self.prefill_flops_if_context_per_prompt)})"]

    def _request_lines(self) -> list[str]:
        """Prefill, decode, KV cache held and decode reads, against separate retries."""
        N = self.n
        return [
            f"prefill: {self.prompt_tokens_prefilled} prompt tokens once "
            f"({format_flops(self.prefill_flops_shared)}); {N} separate retries would "
            f"prefill {self.prompt_tokens_if_separate} "
            f"({format_flops(self.prefill_flops_if_separate)})",
            f"decode: {self.decoded_tokens_total} tokens over {self.num_prompts * N} branches "
            f"in {self.decode_steps} step{'s' if self.decode_steps != 1 else ''} "
            f"({self.branch_steps} branch-steps computed; "
            f"{format_flops(self.decode_flops_shared)}); "
            f"the same for separate retries: sharing never saves per-branch decode"
            + (f"; {self.tokens_discarded} of them decoded after a stop string and dropped"
               if self.tokens_discarded else ""),
            f"KV cache held: {format_bytes(self.kv_bytes_held)} "
            + (f"(shared context {format_bytes(self.kv_bytes_shared_context)} once + "
               if self.shared_context_tokens else "(")
            + f"shared prefix {format_bytes(self.kv_bytes_shared_prefix)} once + tails "
            f"{format_bytes(self.kv_bytes_tails)}); separate retries: "
            f"{format_bytes(self.kv_bytes_if_separate)} ({self.kv_saving:.2f}x as much)",
            f"decode reads: {format_bytes(self.decode_bytes_read_shared)} against "
            f"{format_bytes(self.decode_bytes_read_if_separate)} for batched retries "
            f"(weights {format_bytes(self.weight_bytes)} read once per step in both)",
        ]

    def _adaptive_line(self) -> str:
        a = self.adaptive
        return (f"adaptive: {a.branches_drawn} of {self.num_prompts * a.max_n} branches "
                f"drawn in {a.rounds} round{'s' if a.rounds != 1 else ''} over one prefill "
                f"({self.prompt_tokens_prefilled} prompt tokens); decoded "
                f"{self.decoded_tokens_total} tokens ({self.branch_steps} branch-steps, "
                f"{format_flops(self.decode_flops_shared)}) against about "
                f"{a.fixed_decoded_tokens} ({format_flops(a.fixed_decode_flops)}) "
                f"at a fixed n={a.max_n}: saved {100 * a.token_saving:.0f}% of the decoded "
                f"tokens and {100 * a.flop_saving:.0f}% of the decode FLOPs")

    def _pool_line(self) -> str:
        p = self.pool
        batch = (f"{self.decoded_tokens_total / p.batch_branch_steps:.0%}"
                 if p.batch_branch_steps else "n/a")
        return (f"pool: {p.requests} requests in {p.seconds:.1f} s "
                f"({p.requests_per_second:.2f} requests/s); slot utilisation "
                f"{self.slot_utilisation:.0%} of {self.branch_steps} branch-steps; batch by "
                f"batch {p.batch_branch_steps} branch-steps ({batch})")


class _Counts(NamedTuple):
    """`make_bill`'s measured inputs, checked: token counts as int64 arrays, the rest ints."""

    prompts: np.ndarray  # [B] each prompt's own tokens
    lengths: np.ndarray  # [B, N] tokens decoded per branch
    kept: np.ndarray  # [B, N] tokens kept per branch
    N: int
    steps: int
    branch_steps: int
    copies: int
    C: int
    prefix_bytes: int
    tail_bytes: int
    ctx_bytes: int
    devices: int
    per_device: int
    allocated: int


def make_bill(config, *, prompt_lengths: Sequence[int], branch_lengths,
              n: int, prefix_cache_bytes: int, tail_cache_bytes: int,
              decode_steps: int, dtype_bytes: int | None = None,
              prefix_copies: int = 1, kept_lengths=None, devices: int = 1,
              kv_bytes_per_device: int | None = None,
              kv_bytes_allocated: int | None = None, branch_steps: int | None = None,
              context_length: int = 0, context_cache_bytes: int = 0,
              weights_bytes: int | None = None,
              prefix_dtype_bytes: int | None = None) -> Bill:
    """The bill of one `generate` call (called by the engine).

    Args:
      config: the model's `LlamaConfig`.
      prompt_lengths: B ints, tokens of each prompt (each prefilled once).
      branch_lengths: `[B, N]` ints, tokens decoded per branch, stop token included.
      n: N, branches per prompt.
      prefix_cache_bytes: `nbytes` of the prefix KV arrays allocated (k and v,
        padded buckets included).
      tail_cache_bytes: `nbytes` of the tail KV arrays allocated (k and v, padded).
      decode_steps: decode-loop iterations run.
      dtype_bytes: bytes per element for the analytic part; default from `config.dtype`.
      prefix_copies: how many times each prompt was prefilled and stored: 1 for
        the shared-prefix engine, N for the naive baseline that copies each
        prompt N times (then `prefix_cache_bytes` holds all the copies and the
        "shared" fields report what the baseline actually did).
      kept_lengths: `[B, N]` ints, tokens each branch keeps (`Generation.lengths`),
        each <= its branch_lengths; default: equal to branch_lengths.
      devices: devices the request ran on.
      kv_bytes_per_device, kv_bytes_allocated: KV bytes allocated on one device
        and on all of them; default (one device): prefix + tail bytes.
      branch_steps: slots x steps computed; default decode_steps x B x N.
      context_length: C, tokens of a context common to all prompts
        (`shared_prefix=`), prefilled once before them; `prompt_lengths` are
        then each prompt's own tokens after it.
      context_cache_bytes: `nbytes` of the context's KV arrays (k and v, padded).
      weights_bytes: bytes of the parameters as stored, when not every one is in
        the dtype (int8 weights and their float32 scales: `load(weights="int8")`);
        default: every parameter at `dtype_bytes`. An MoE's experts stay in the
        dtype, so the untouched experts a step skips are subtracted at `dtype_bytes`.
      prefix_dtype_bytes: bytes per element of the prompts' stored KV (2: a quantised
        model's float16 prefix, `engine.state.prefix_kv_dtype`); default `dtype_bytes`.
        The context and the tails stay at `dtype_bytes`.
    Returns:
      A `Bill` (no optional part).
    Raises:
      ValueError: branch_lengths or kept_lengths not `[B, N]`, negative counts,
        kept_lengths above branch_lengths, prefix_copies outside [1, N], or a
        context with prefix_copies > 1.
    """
    prompts, lengths, N = _check_lengths(prompt_lengths, branch_lengths, n)
    c = _check_run(prompts, lengths, N, prefix_cache_bytes=prefix_cache_bytes,
                   tail_cache_bytes=tail_cache_bytes, decode_steps=decode_steps,
                   prefix_copies=prefix_copies, kept_lengths=kept_lengths,
                   context_length=context_length, context_cache_bytes=context_cache_bytes,
                   devices=devices, branch_steps=branch_steps,
                   kv_bytes_per_device=kv_bytes_per_device,
                   kv_bytes_allocated=kv_bytes_allocated)
    return Bill(**_measured(c), **_analytic(config, c, dtype_bytes, weights_bytes,
                                            prefix_dtype_bytes))


def _check_lengths(prompt_lengths, branch_lengths, n) -> tuple[np.ndarray, np.ndarray, int]:
    """(prompts [B], branch lengths [B, N], N) as int64 arrays and an int; ValueError
    for counts outside [0, 2**40) or lengths not `[B, N]`."""
    try:
        prompts = np.asarray(list(prompt_lengths), dtype=np.int64).reshape(-1)
        lengths = np.asarray(branch_lengths, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError("prompt_lengths and branch_lengths must be integers in "
                         f"[0, 2**40) ({e})") from None
    if (prompts >= MAX_COUNT).any() or (lengths >= MAX_COUNT).any():
        raise ValueError("prompt_lengths and branch_lengths must be integers in [0, 2**40)")
    N = check_count("n", n, 1)
    B = prompts.shape[0]
    if lengths.shape != (B, N):
        raise ValueError(f"branch_lengths must have shape [B, N] = [{B}, {N}], "
                         f"got {list(lengths.shape)}")
    if (prompts < 0).any() or (lengths < 0).any():
        raise ValueError("prompt_lengths and branch_lengths must be >= 0")
    return prompts, lengths, N


def _check_run(prompts, lengths, N: int, *, prefix_cache_bytes, tail_cache_bytes, decode_steps,
               prefix_copies, kept_lengths, context_length, context_cache_bytes, devices,
               branch_steps, kv_bytes_per_device, kv_bytes_allocated) -> _Counts:
    """The rest of `make_bill`'s measured inputs checked (its Raises), defaults filled in."""
    prefix_bytes = check_count("prefix_cache_bytes", prefix_cache_bytes, 0, 2**62, "2**62")
    tail_bytes = check_count("tail_cache_bytes", tail_cache_bytes, 0, 2**62, "2**62")
    steps = check_count("decode_steps", decode_steps, 0)
    copies = check_count("prefix_copies", prefix_copies, 1)
    if copies > N:
        raise ValueError(f"prefix_copies must be in [1, n={N}], got {copies}")
    kept = lengths if kept_lengths is None else np.asarray(kept_lengths, dtype=np.int64)
    if kept.shape != lengths.shape or (kept < 0).any() or (kept > lengths).any():
        raise ValueError("kept_lengths must be [B, N] ints in [0, branch_lengths], "
                         f"got {kept.tolist()!r:.200}")
    C = check_count("context_length", context_length, 0)
    ctx_bytes = check_count("context_cache_bytes", context_cache_bytes, 0, 2**62, "2**62")
    if C and copies > 1:
        raise ValueError("a shared context is priced for the shared engine only (prefix_copies=1)")
    devices = check_count("devices", devices, 1)
    branch_steps = steps * prompts.shape[0] * N if branch_steps is None else check_count(
        "branch_steps", branch_steps, 0)
    held = ctx_bytes + prefix_bytes + tail_bytes
    per_device = held if kv_bytes_per_device is None else check_count(
        "kv_bytes_per_device", kv_bytes_per_device, 0, 2**62, "2**62")
    allocated = held if kv_bytes_allocated is None else check_count(
        "kv_bytes_allocated", kv_bytes_allocated, 0, 2**62, "2**62")
    return _Counts(prompts=prompts, lengths=lengths, kept=kept, N=N, steps=steps,
                   branch_steps=branch_steps, copies=copies, C=C, prefix_bytes=prefix_bytes,
                   tail_bytes=tail_bytes, ctx_bytes=ctx_bytes, devices=devices,
                   per_device=per_device, allocated=allocated)


def _measured(c: _Counts) -> dict[str, Any]:
    """The bill's measured fields: token counts and the KV bytes allocated."""
    B, N, prefix_tokens = c.prompts.shape[0], c.N, int(c.prompts.sum())
    return dict(
        num_prompts=B, n=N, decode_steps=c.steps, branch_steps=c.branch_steps,
        prompt_tokens_prefilled=c.C + c.copies * prefix_tokens,
        prompt_tokens_if_separate=N * (B * c.C + prefix_tokens),
        decoded_tokens_per_branch=c.lengths.tolist(),
        decoded_tokens_total=int(c.lengths.sum()),
        kept_tokens_per_branch=c.kept.tolist(),
        kept_tokens_total=int(c.kept.sum()),
        kv_bytes_held=c.ctx_bytes + c.prefix_bytes + c.tail_bytes,
        kv_bytes_shared_prefix=c.prefix_bytes,
        kv_bytes_tails=c.tail_bytes,
        kv_bytes_if_separate=N * (B * c.ctx_bytes + c.prefix_bytes // c.copies) + c.tail_bytes,
        devices=c.devices, kv_bytes_per_device=c.per_device, kv_bytes_allocated=c.allocated,
        shared_context_tokens=c.C, kv_bytes_shared_context=c.ctx_bytes,
        prompt_tokens_if_context_per_prompt=int((c.prompts + c.C).sum()))


def _analytic(config, c: _Counts, dtype_bytes, weights_bytes, prefix_dtype_bytes
              ) -> dict[str, Any]:
    """The bill's analytic fields: FLOPs, bytes read by the decode steps, the model's
    constants and the mixture of experts' figures."""
    b = resolve_dtype_bytes(config, dtype_bytes)
    slots = c.branch_steps / c.steps if c.steps else 0.0
    W_all = weight_bytes(config, b) if weights_bytes is None else check_count(
        "weights_bytes", weights_bytes, 0, 2**62, "2**62")
    W = step_weight_bytes(config, slots, b) - weight_bytes(config, b) + W_all if c.steps else W_all
    kv = kv_bytes_per_token(config, b)
    kv_prefix = kv if prefix_dtype_bytes is None else kv_bytes_per_token(
        config, resolve_dtype_bytes(config, prefix_dtype_bytes, "prefix_dtype_bytes"))
    full = c.prompts + c.C  # the tokens before the first new one, context included
    prefill = sum(prefill_flops(config, int(p)) for p in full)  # each prompt alone
    prefill_shared = (c.copies * prefill if not c.C else prefill_flops(config, c.C) + sum(
        suffix_prefill_flops(config, c.C, int(p)) for p in c.prompts))
    decode = int(np.sum(decode_flops(config, full[:, None], c.lengths)))
    read_shared, read_separate = _decode_reads(c, W, kv, kv_prefix)
    experts = getattr(config, "n_experts", 0)
    return dict(
        prefill_flops_shared=int(prefill_shared),
        prefill_flops_if_separate=c.N * int(prefill),
        decode_flops_shared=decode,
        decode_flops_if_separate=decode,
        decode_bytes_read_shared=int(read_shared),
        decode_bytes_read_if_separate=int(read_separate),
        weight_bytes=W_all,
        kv_bytes_per_token=kv,
        prefill_flops_if_context_per_prompt=int(prefill),
        experts=experts,
        experts_per_token=getattr(config, "n_experts_per_tok", 0),
        slots_per_step=float(slots) if experts else 0.0,
        experts_touched_per_step=expected_experts_touched(config, slots) if c.steps else 0.0)


def _decode_reads(c: _Counts, W: int, kv: int, kv_prefix: int) -> tuple[int, int]:
    """Bytes the decode steps read, shared and as batched separate retries.

    At step s branch (b, n) reads the min(s + 1, length) tail tokens it has;
    weights are read once per step in both; the context and the prefix once
    per step (shared) or once per branch (separate)."""
    B, N, steps = c.prompts.shape[0], c.N, c.steps
    # sum over s < steps of min(s + 1, L) = m (m + 1) / 2 + (steps - m) L, m = min(L, steps)
    m = np.minimum(c.lengths, steps).astype(object)  # Python ints: exact at any size
    tail_tokens = int((m * (m + 1) // 2 + (steps - m) * c.lengths.astype(object)).sum())
    prefix_tokens = int(c.prompts.sum())
    shared = steps * (W + c.C * kv + c.copies * prefix_tokens * kv_prefix) + tail_tokens * kv
    separate = (steps * (W + N * (B * c.C * kv + prefix_tokens * kv_prefix))
                + tail_tokens * kv)
    return shared, separate


def measure_experts_touched(lm, generation) -> float:
    """The distinct experts per layer the router really chose per decode step, averaged.

    Replays the request teacher-forced (each branch's prompt + decoded tokens
    through `models.families.llama.router_choices`, which routes exactly as the
    forward does): decode step t chooses token t of every branch and feeds it
    (position P + t) through the model; the tokens counted at step t are
    those of the branches with t < their decoded length; the count is the number of distinct experts among their k
    choices at each layer, averaged over layers and steps. Finished slots
    the engine still computes (pad tokens) are not counted.

    Args:
      lm: the MoE `LanguageModel` that generated; generation: its `Generation`
        (two-level requests: `shared_prefix` is not replayed).
    Returns:
      The mean count, a float in [k, X].
    Raises:
      ValueError: the model has no experts.
    """
    import jax
    import jax.numpy as jnp

    from jaxsample.models.families import llama

    cfg = lm.config
    if not getattr(cfg, "n_experts", 0):
        raise ValueError("measure_experts_touched: the model has no experts (n_experts = 0)")
    prompts = generation.prompt_tokens
    lengths = np.asarray(generation.bill.decoded_tokens_per_branch)
    B, N = lengths.shape
    T = int(lengths.max()) if lengths.size else 0
    if T == 0:
        return 0.0
    choose = jax.jit(lambda toks: jax.vmap(lambda t: llama.router_choices(cfg, lm.params, t))(
        toks))
    hits = np.zeros((T, cfg.n_layers, cfg.n_experts), bool)
    for b in range(B):
        prompt = list(map(int, prompts[b]))
        P = len(prompt)
        seqs = np.full((N, P + T), 0, np.int32)
        for n in range(N):
            seqs[n, :P] = prompt
            seqs[n, P:P + lengths[b, n]] = generation.tokens[b, n, :lengths[b, n]]
        idx = np.asarray(choose(jnp.asarray(seqs)))  # [N, L, P + T, k]
        for n in range(N):
            for t in range(int(lengths[b, n])):
                # step t feeds token t (position P + t) through the layers.
                hits[t, np.arange(cfg.n_layers)[:, None], idx[n, :, P + t]] = True
    return float(hits.sum(-1).mean())
