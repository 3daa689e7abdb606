"""Pricing ("price it properly"): what N branches over one shared prompt cost.

Two things live here:

* `estimate` / `table`: an analytic model from a `models.llama.LlamaConfig`
  and (P prompt tokens, T new tokens, N branches), comparing the shared-prefix
  engine against N separate retries.
* `make_bill`: the `Bill` the engine attaches to every `Generation`, with the
  counts actually measured (prompt tokens prefilled, tokens decoded per branch,
  the `nbytes` of the KV-cache arrays allocated) and the analytic estimate
  beside them.

Prefix sharing saves prefill work (the prompt is prefilled once, not N times)
and prefix memory (its KV cache is held and read once per decode step, not N
times). It never saves the per-branch decode: every branch still runs its own
forward pass for each of its tokens, so decode FLOPs are identical for both.
Every report here shows exactly that.

Counting conventions (letters as in `models/llama.py`):

* One multiply-accumulate is 2 FLOPs. Norms, RoPE, softmax, SiLU, residual
  adds and biases are not counted (O(E) per token against O(E^2)).
* Linear FLOPs per token: `2 * linear_params`, where per layer
  `linear_params = E*H*D (wq) + 2*E*K*D (wk, wv) + H*D*E (wo) + 3*E*F (SwiGLU)`.
  The embedding lookup is free; the output projection (logits) is `2*E*V`
  per position whose logits are computed.
* Attention counts only the visible (unmasked) query-key pairs, i.e. the work
  of an ideal causal kernel: per pair and layer, `2*H*D` for `q k^T` and
  `2*H*D` for `p v` (GQA shares K/V heads but every query head still does
  its own dot products). Causal prefill of P tokens has `P(P+1)/2` pairs, so
  `attention = 2*L*H*D*P*(P+1)`. A dense kernel that computes the full
  `P x P` square and masks does about twice that.
* Prefill computes logits at the last prompt position only (that is where the
  first new token is sampled from).
* Decode: each of the T new tokens of a branch is one forward pass of one
  position (the engine feeds each sampled token back in); new token t
  (t = 0 .. T-1) attends to `P + t + 1` keys (the prompt, the t tokens before
  it, itself) and computes one row of logits. Summed over a branch:
  `T * (2*linear) + 4*L*H*D*(T*P + T(T+1)/2) + T * 2*E*V`.
* Bytes: weights are `n_params * dtype_bytes` (every parameter, the whole
  embedding table included: tied models read it for the logits). KV cache:
  `2*L*K*D*dtype_bytes` per token (keys and values). Activations are ignored.
* Bytes read by one decode step at context `P + t` (weights once per step in
  every batched engine):
    - shared prefix: `weights + P*kv + N*t*kv` (the prefix is read once for
      all N branches, each branch reads its own tail);
    - separate retries batched together (the main comparison, what
      `num_return_sequences=N` does): `weights + N*(P + t)*kv`, the weights
      are still read once per step but each of the N rows reads its own copy
      of the prefix;
    - separate retries run one after another: `N*(weights + (P + t)*kv)`.
* KV memory held at the end: shared `(P + N*T)*kv` against `N*(P + T)*kv`,
  where a local (sliding-window) layer of window w holds at most w - 1
  positions of each segment (`kv_bytes`); the last decode step's bytes use
  the same rule. FLOPs and the bytes summed over all steps count every
  layer as global (an upper bound for models with local layers).

Sparse mixture of experts (`config.n_experts` = X > 0, k =
`n_experts_per_tok`; `models.moe`): a layer holds X SwiGLU experts and a
router `[E, X]`; a token runs k of them, so the linear FLOPs per token count
`3*E*F*k + E*X` for the FFN (an ideal sparse kernel; the CPU "loop" kernel
runs a touched expert on all the call's tokens). A decode step reads the
weights of the experts its tokens touched, not all X: with R tokens per step
(B*N slots in the shared and batched engines, 1 per retry run alone) and
uniform routing, the expected distinct experts per layer are
`X * (1 - (1 - k/X)^R)` (`expected_experts_touched`), and the step's weight
bytes are `weight_bytes - L * (X - touched) * 3*E*F*dtype_bytes`
(`step_weight_bytes`). That is what parallel sampling costs on an MoE:
N = 1 reads k experts per layer, N = 64 reads nearly all X.

References: Kaplan et al. 2020, "Scaling Laws for Neural Language Models"
(2 FLOPs per parameter per token); Juravsky et al. 2024, "Hydragen"
(shared-prefix attention reads the prefix once); Pope et al. 2022,
"Efficiently Scaling Transformer Inference" (decode is memory-bound: bytes
read per step).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------
# Per-model constants


def _dtype_bytes(config, dtype_bytes: int | None) -> int:
    if dtype_bytes is None:
        return _DTYPE_BYTES[getattr(config, "dtype", "float32")]
    if not isinstance(dtype_bytes, (int, np.integer)) or isinstance(dtype_bytes, bool) \
            or dtype_bytes < 1:
        raise ValueError(f"dtype_bytes must be a positive integer, got {dtype_bytes!r}")
    return int(dtype_bytes)


def param_count(config) -> int:
    """Every parameter of the model (embedding, norms, layers, untied head), in elements."""
    L, E, F, V = config.n_layers, config.dim, config.ffn_dim, config.vocab_size
    HD, KD = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    per_layer = 2 * E + E * HD + 2 * E * KD + HD * E + 3 * E * F
    X = getattr(config, "n_experts", 0)
    if X:  # X experts and the router instead of one MLP
        per_layer += 3 * E * F * (X - 1) + E * X
    if config.qkv_bias:
        per_layer += HD + 2 * KD
    total = V * E + E + L * per_layer
    if not config.tie_embeddings:
        total += E * V
    return int(total)


def linear_params_per_layer(config) -> int:
    """Weights of one decoder block's matmuls one token runs through:
    `E*H*D + 2*E*K*D + H*D*E + 3*E*F` (with X experts, top k: `3*E*F*k + E*X`
    for the FFN, the router included)."""
    E, F = config.dim, config.ffn_dim
    HD, KD = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    X = getattr(config, "n_experts", 0)
    ffn = 3 * E * F * config.n_experts_per_tok + E * X if X else 3 * E * F
    return int(E * HD + 2 * E * KD + HD * E + ffn)


def expected_experts_touched(config, tokens) -> float:
    """Expected distinct experts per layer hit by `tokens` tokens in one call,
    under uniform routing: `X * (1 - (1 - k/X)^tokens)` (0 for a dense model).

    Each token picks k of the X experts uniformly without replacement, so it
    misses a given expert with probability 1 - k/X. Real routers are not
    uniform (the bill's measured count, `measure_experts_touched`, is the fact).
    """
    X = getattr(config, "n_experts", 0)
    if not X:
        return 0.0
    return float(X * (1.0 - (1.0 - config.n_experts_per_tok / X) ** float(tokens)))


def expert_bytes(config, dtype_bytes: int | None = None) -> int:
    """Bytes of one expert of one layer, `3*E*F*dtype_bytes` (0 for a dense model)."""
    if not getattr(config, "n_experts", 0):
        return 0
    return 3 * config.dim * config.ffn_dim * _dtype_bytes(config, dtype_bytes)


def step_weight_bytes(config, tokens, dtype_bytes: int | None = None) -> int:
    """Weight bytes one model call over `tokens` tokens reads: every weight for a
    dense model; for an MoE, all but the experts no token is expected to touch
    (`expected_experts_touched`), rounded to bytes."""
    W = weight_bytes(config, dtype_bytes)
    X = getattr(config, "n_experts", 0)
    if not X:
        return W
    untouched = X - expected_experts_touched(config, tokens)
    return int(round(W - config.n_layers * untouched * expert_bytes(config, dtype_bytes)))


def linear_flops_per_token(config) -> int:
    """FLOPs of the L decoder blocks' matmuls for one position: `2 * L * linear_params`."""
    return 2 * config.n_layers * linear_params_per_layer(config)


def logits_flops_per_token(config) -> int:
    """FLOPs of the output projection for one position: `2 * E * V`."""
    return 2 * config.dim * config.vocab_size


def attention_flops_per_pair(config) -> int:
    """FLOPs of one visible query-key pair over all layers: `4 * L * H * D` (q k^T and p v)."""
    return 4 * config.n_layers * config.n_heads * config.head_dim


def kv_bytes_per_token(config, dtype_bytes: int | None = None) -> int:
    """KV-cache bytes per token of one sequence: `2 * L * K * D * dtype_bytes`."""
    b = _dtype_bytes(config, dtype_bytes)
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * b


def kv_bytes(config, positions: int, dtype_bytes: int | None = None) -> int:
    """KV-cache bytes of `positions` positions of one sequence, as the engine stores them:
    every position on a global layer, at most w - 1 on a local (sliding-window) layer
    of window w (`engine.prefill.window_extent`). Equals positions x
    `kv_bytes_per_token` for a model without local layers."""
    b = _dtype_bytes(config, dtype_bytes)
    per = 2 * config.n_kv_heads * config.head_dim * b
    windows = getattr(config, "layer_windows", (None,) * config.n_layers)
    if not positions:
        return 0
    return per * sum(positions if w is None else max(min(positions, w - 1), 1) for w in windows)


def weight_bytes(config, dtype_bytes: int | None = None) -> int:
    """Bytes of all parameters: `param_count * dtype_bytes`."""
    return param_count(config) * _dtype_bytes(config, dtype_bytes)


def prefill_flops(config, prompt_tokens: int) -> int:
    """FLOPs to prefill one prompt of P tokens (causal, logits at the last position).

    `2*L*linear_params*P + 2*L*H*D*P*(P+1) + 2*E*V` (0 for an empty prompt).
    """
    P = int(prompt_tokens)
    if P == 0:
        return 0
    attn = attention_flops_per_pair(config) * P * (P + 1) // 2
    return linear_flops_per_token(config) * P + attn + logits_flops_per_token(config)


def suffix_prefill_flops(config, context_tokens: int, suffix_tokens: int) -> int:
    """FLOPs to prefill a prompt's own S tokens after a C-token context already cached.

    `2*L*linear_params*S + 2*L*H*D*(2*S*C + S*(S+1)) + 2*E*V`: suffix token j
    attends to the C context positions and to suffix tokens 0..j (0 for an
    empty suffix). `prefill_flops(C) + suffix_prefill_flops(C, S)` equals
    `prefill_flops(C + S)` plus the context's one row of logits.
    """
    C, S = int(context_tokens), int(suffix_tokens)
    if S == 0:
        return 0
    pairs = S * C + S * (S + 1) // 2
    return (linear_flops_per_token(config) * S + attention_flops_per_pair(config) * pairs
            + logits_flops_per_token(config))


def decode_flops(config, prompt_tokens, new_tokens):
    """FLOPs to decode T new tokens of one branch after a P-token prompt.

    `T*(linear + logits) + 4*L*H*D*(T*P + T(T+1)/2)`: token t attends to P + t + 1 keys.
    Works elementwise on integer arrays (e.g. `P [B, 1]`, `T [B, N]`).
    """
    P = np.asarray(prompt_tokens, dtype=np.int64)
    T = np.asarray(new_tokens, dtype=np.int64)
    pairs = T * P + T * (T + 1) // 2
    out = (linear_flops_per_token(config) + logits_flops_per_token(config)) * T \
        + attention_flops_per_pair(config) * pairs
    return int(out) if out.ndim == 0 else out


# ---------------------------------------------------------------------------
# The analytic estimate


@dataclasses.dataclass(frozen=True, kw_only=True)
class CostEstimate:
    """Analytic cost of N branches of T new tokens over one P-token prompt
    (or B prompts of P own tokens after a C-token context common to all).

    "shared" is this library's engine (prefix prefilled, held and read once;
    with a context, three levels: the context once, each prompt's own P
    tokens once, each branch's tail); "separate" is B x N independent retries
    batched together (B x N prefills of C + P tokens, as many prefix copies);
    "sequential" is those retries run one after another; "two_level" (with a
    context) prefixes the context to each of the B prompts, whose branches
    share it. FLOPs are counted as in the module docstring; bytes are bytes.
    With C = 0 and B = 1 (the defaults) every field is that of one prompt.

    Attributes:
      prompt_tokens, new_tokens, n: P (each prompt's own tokens), T, N.
      context_tokens, num_prompts: C and B.
      dtype_bytes: bytes per weight and per KV element.
      n_params: parameters of the model (elements).
      weight_bytes: bytes of all parameters.
      kv_bytes_per_token: `2*L*K*D*dtype_bytes`.
      prefill_flops_shared: one prefill of P tokens.
      prefill_flops_separate: N prefills of P tokens.
      decode_flops_per_token: mean FLOPs of one decode forward (one branch, one token).
      decode_flops_last_token: FLOPs of the last one (context P + T).
      decode_flops_shared, decode_flops_separate: N*T decode forwards; always equal.
      decode_step_bytes_shared: bytes read by the last decode step (context P + T).
      decode_step_bytes_separate: same step, N retries batched (weights once, N prefixes).
      decode_step_bytes_sequential: same step, N retries one after another.
      decode_bytes_shared, decode_bytes_separate: bytes read over all T decode steps.
      kv_bytes_shared: KV held at the end, `(C + B*P + B*N*T) * kv_bytes_per_token`.
      kv_bytes_separate: `B * N * (C + P + T) * kv_bytes_per_token`.
      prefill_flops_two_level: B prefills of C + P tokens (the context per prompt).
      kv_bytes_two_level: `(B*(C + P) + B*N*T) * kv_bytes_per_token`.
      experts, experts_per_token: X and k of a sparse MoE (0 for a dense model).
      experts_touched_per_step: expected distinct experts per layer in one
        decode step of the B*N branches (uniform routing,
        `expected_experts_touched`); the decode step bytes count only those.
      experts_touched_sequential: the same for one retry alone (k).
    """

    prompt_tokens: int
    new_tokens: int
    n: int
    context_tokens: int
    num_prompts: int
    dtype_bytes: int
    n_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    prefill_flops_shared: int
    prefill_flops_separate: int
    decode_flops_per_token: float
    decode_flops_last_token: int
    decode_flops_shared: int
    decode_flops_separate: int
    decode_step_bytes_shared: int
    decode_step_bytes_separate: int
    decode_step_bytes_sequential: int
    decode_bytes_shared: int
    decode_bytes_separate: int
    kv_bytes_shared: int
    kv_bytes_separate: int
    prefill_flops_two_level: int
    kv_bytes_two_level: int
    experts: int = 0
    experts_per_token: int = 0
    experts_touched_per_step: float = 0.0
    experts_touched_sequential: float = 0.0

    @property
    def total_flops_shared(self) -> int:
        return self.prefill_flops_shared + self.decode_flops_shared

    @property
    def total_flops_separate(self) -> int:
        return self.prefill_flops_separate + self.decode_flops_separate

    @property
    def kv_saving(self) -> float:
        """Separate over shared KV memory (>= 1; 1 at N = 1, and 1 when P = T = 0:
        nothing is held either way)."""
        if self.kv_bytes_shared == 0:
            return 1.0
        return self.kv_bytes_separate / self.kv_bytes_shared

    @property
    def decode_step_intensity_shared(self) -> float:
        """FLOPs per byte read by the last decode step, shared prefix (B*N tokens per step)."""
        return (self.num_prompts * self.n * self.decode_flops_last_token
                / max(self.decode_step_bytes_shared, 1))

    @property
    def decode_step_intensity_separate(self) -> float:
        """FLOPs per byte read by the last decode step, B*N retries batched."""
        return (self.num_prompts * self.n * self.decode_flops_last_token
                / max(self.decode_step_bytes_separate, 1))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields plus the derived totals."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(total_flops_shared=self.total_flops_shared,
                 total_flops_separate=self.total_flops_separate,
                 kv_saving=self.kv_saving,
                 decode_step_intensity_shared=self.decode_step_intensity_shared,
                 decode_step_intensity_separate=self.decode_step_intensity_separate)
        return d


MAX_COUNT = 2**40
"""Upper bound (exclusive) on every token and branch count this module prices.

Far beyond any real request (about 10**12 tokens), and small enough that
every derived count, ratio and float conversion stays finite and exact."""


def _check_count(name: str, value, minimum: int, maximum: int = MAX_COUNT,
                 maximum_text: str = "2**40") -> int:
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
            or not minimum <= value < maximum):
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum_text}), got {value!r}")
    return int(value)


def estimate(config, prompt_tokens: int, new_tokens: int, n: int,
             dtype_bytes: int | None = None, *, context_tokens: int = 0,
             num_prompts: int = 1) -> CostEstimate:
    """Analytic cost of N branches over a shared prompt against separate retries.

    Args:
      config: a `models.llama.LlamaConfig`.
      prompt_tokens: P, tokens in the prompt (each prompt's own, after the
        context), an int in [0, 2**40) (`MAX_COUNT`).
      new_tokens: T, tokens decoded per branch, an int in [0, 2**40).
      n: N, branches per prompt, an int in [1, 2**40).
      dtype_bytes: bytes per weight and per KV element; default from `config.dtype`
        (4 for float32, 2 for bfloat16).
      context_tokens: C, tokens of a context common to all prompts
        (`generate(shared_prefix=...)`), an int in [0, 2**40); 0: none.
      num_prompts: B, prompts sharing the context, an int in [1, 2**40).
    Returns:
      A `CostEstimate` (see the module docstring for the counting conventions).
    Raises:
      ValueError: a token count outside [0, 2**40), n or num_prompts outside
        [1, 2**40), a non-integer count, or a bad dtype_bytes.
    """
    P = _check_count("prompt_tokens", prompt_tokens, 0)
    T = _check_count("new_tokens", new_tokens, 0)
    N = _check_count("n", n, 1)
    C = _check_count("context_tokens", context_tokens, 0)
    B = _check_count("num_prompts", num_prompts, 1)
    b = _dtype_bytes(config, dtype_bytes)
    R = B * N  # branches in all
    W = step_weight_bytes(config, R, b)  # weights one decode step of R tokens reads
    W1 = step_weight_bytes(config, 1, b)  # ... of one retry run alone
    kv = kv_bytes_per_token(config, b)
    pf = prefill_flops(config, C + P)  # one prompt with the context before it
    shared_pf = (prefill_flops(config, C) + B * suffix_prefill_flops(config, C, P) if C
                 else B * pf)
    df = decode_flops(config, C + P, T)
    last = (linear_flops_per_token(config) + logits_flops_per_token(config)
            + attention_flops_per_pair(config) * (C + P + T)) if T else 0
    tail_sum = T * (T + 1) // 2  # tail tokens read, summed over steps t = 0 .. T-1
    shared_kv = kv_bytes(config, C, b) + B * kv_bytes(config, P, b)
    return CostEstimate(
        prompt_tokens=P, new_tokens=T, n=N, context_tokens=C, num_prompts=B, dtype_bytes=b,
        n_params=param_count(config), weight_bytes=weight_bytes(config, b),
        kv_bytes_per_token=kv,
        prefill_flops_shared=shared_pf, prefill_flops_separate=R * pf,
        decode_flops_per_token=df / T if T else 0.0,
        decode_flops_last_token=int(last),
        decode_flops_shared=R * df, decode_flops_separate=R * df,
        decode_step_bytes_shared=W + shared_kv + R * kv_bytes(config, T, b),
        decode_step_bytes_separate=W + R * kv_bytes(config, C + P + T, b),
        decode_step_bytes_sequential=R * (W1 + kv_bytes(config, C + P + T, b)),
        decode_bytes_shared=T * (W + (C + B * P) * kv) + R * tail_sum * kv,
        decode_bytes_separate=T * W + R * (T * (C + P) + tail_sum) * kv,
        kv_bytes_shared=shared_kv + R * kv_bytes(config, T, b),
        kv_bytes_separate=R * kv_bytes(config, C + P + T, b),
        prefill_flops_two_level=B * pf,
        kv_bytes_two_level=B * kv_bytes(config, C + P, b) + R * kv_bytes(config, T, b),
        experts=getattr(config, "n_experts", 0),
        experts_per_token=getattr(config, "n_experts_per_tok", 0),
        experts_touched_per_step=expected_experts_touched(config, R),
        experts_touched_sequential=expected_experts_touched(config, 1),
    )


def table(config, prompt_tokens: int, new_tokens: int, ns: Sequence[int],
          dtype_bytes: int | None = None, *, context_tokens: int = 0,
          num_prompts: int = 1) -> list[dict[str, Any]]:
    """One row per N of the shared-prefix against separate-retries comparison.

    Args:
      config: a `LlamaConfig`; prompt_tokens: P; new_tokens: T.
      ns: the branch counts to price (each >= 1).
      context_tokens, num_prompts: C and B, as `estimate` (with C > 0 the rows
        also carry `prefill_flops_two_level` and `kv_bytes_two_level`).
    Returns:
      A list of dicts, one per N, with keys `n`, `prefill_flops_shared`,
      `prefill_flops_separate`, `decode_flops` (the same for both),
      `step_bytes_shared`, `step_bytes_separate` (bytes read by the last decode
      step), `kv_bytes_shared`, `kv_bytes_separate`, `kv_saving` (ratio),
      `total_flops_shared`, `total_flops_separate`.
    Raises:
      ValueError: as `estimate`, or an empty `ns`.
    """
    if not ns:
        raise ValueError("ns must list at least one branch count")
    rows = []
    for n in ns:
        e = estimate(config, prompt_tokens, new_tokens, n, dtype_bytes,
                     context_tokens=context_tokens, num_prompts=num_prompts)
        extra = (dict(prefill_flops_two_level=e.prefill_flops_two_level,
                      kv_bytes_two_level=e.kv_bytes_two_level) if e.context_tokens else {})
        rows.append(dict(
            n=e.n,
            prefill_flops_shared=e.prefill_flops_shared,
            prefill_flops_separate=e.prefill_flops_separate,
            decode_flops=e.decode_flops_shared,
            step_bytes_shared=e.decode_step_bytes_shared,
            step_bytes_separate=e.decode_step_bytes_separate,
            kv_bytes_shared=e.kv_bytes_shared,
            kv_bytes_separate=e.kv_bytes_separate,
            kv_saving=e.kv_saving,
            total_flops_shared=e.total_flops_shared,
            total_flops_separate=e.total_flops_separate,
        ) | extra)
    return rows


# ---------------------------------------------------------------------------
# The bill of one request


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bill:
    """What one `generate` call cost: measured counts and the analytic estimate.

    Measured (from the engine):
      num_prompts: B.
      n: N, branches per prompt.
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

    @property
    def tokens_discarded(self) -> int:
        """Tokens decoded after a stop string and dropped: decoded - kept (>= 0)."""
        return self.decoded_tokens_total - self.kept_tokens_total

    @property
    def kv_saving(self) -> float:
        """kv_bytes_if_separate / kv_bytes_held (>= 1; 1 at N = 1)."""
        return self.kv_bytes_if_separate / max(self.kv_bytes_held, 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (plain ints, floats and lists)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("decoded_tokens_per_branch", "kept_tokens_per_branch"):
            d[name] = [list(map(int, row)) for row in getattr(self, name)]
        d["kv_saving"] = self.kv_saving
        d["tokens_discarded"] = self.tokens_discarded
        return d

    def summary(self) -> str:
        """A few lines for people: what was shared, what was not."""
        N = self.n
        context = []
        if self.shared_context_tokens:
            context = [
                f"shared context: {self.shared_context_tokens} tokens prefilled and stored once "
                f"for {self.num_prompts} prompts x {N} branches "
                f"({format_bytes(self.kv_bytes_shared_context)} of KV); prefixed to every "
                f"prompt it would prefill {self.prompt_tokens_if_context_per_prompt} tokens "
                f"({format_flops(self.prefill_flops_if_context_per_prompt)})"]
        lines = context + [
            f"prefill: {self.prompt_tokens_prefilled} prompt tokens once "
            f"({format_flops(self.prefill_flops_shared)}); {N} separate retries would "
            f"prefill {self.prompt_tokens_if_separate} "
            f"({format_flops(self.prefill_flops_if_separate)})",
            f"decode: {self.decoded_tokens_total} tokens over {self.num_prompts * N} branches "
            f"in {self.decode_steps} steps ({self.branch_steps} branch-steps computed; "
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
        return "\n".join(lines)


def make_bill(config, *, prompt_lengths: Sequence[int], branch_lengths,
              n: int, prefix_cache_bytes: int, tail_cache_bytes: int,
              decode_steps: int, dtype_bytes: int | None = None,
              prefix_copies: int = 1, kept_lengths=None, devices: int = 1,
              kv_bytes_per_device: int | None = None,
              kv_bytes_allocated: int | None = None, branch_steps: int | None = None,
              context_length: int = 0, context_cache_bytes: int = 0) -> Bill:
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
    Returns:
      A `Bill`.
    Raises:
      ValueError: branch_lengths or kept_lengths not `[B, N]`, negative counts,
        kept_lengths above branch_lengths, prefix_copies outside [1, N], or a
        context with prefix_copies > 1.
    """
    try:
        prompts = np.asarray(list(prompt_lengths), dtype=np.int64).reshape(-1)
        lengths = np.asarray(branch_lengths, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as e:
        raise ValueError("prompt_lengths and branch_lengths must be integers in "
                         f"[0, 2**40) ({e})") from None
    if (prompts >= MAX_COUNT).any() or (lengths >= MAX_COUNT).any():
        raise ValueError("prompt_lengths and branch_lengths must be integers in [0, 2**40)")
    N = _check_count("n", n, 1)
    B = prompts.shape[0]
    if lengths.shape != (B, N):
        raise ValueError(f"branch_lengths must have shape [B, N] = [{B}, {N}], "
                         f"got {list(lengths.shape)}")
    if (prompts < 0).any() or (lengths < 0).any():
        raise ValueError("prompt_lengths and branch_lengths must be >= 0")
    prefix_bytes = _check_count("prefix_cache_bytes", prefix_cache_bytes, 0, 2**62, "2**62")
    tail_bytes = _check_count("tail_cache_bytes", tail_cache_bytes, 0, 2**62, "2**62")
    steps = _check_count("decode_steps", decode_steps, 0)
    copies = _check_count("prefix_copies", prefix_copies, 1)
    if copies > N:
        raise ValueError(f"prefix_copies must be in [1, n={N}], got {copies}")
    kept = lengths if kept_lengths is None else np.asarray(kept_lengths, dtype=np.int64)
    if kept.shape != lengths.shape or (kept < 0).any() or (kept > lengths).any():
        raise ValueError("kept_lengths must be [B, N] ints in [0, branch_lengths], "
                         f"got {kept.tolist()!r:.200}")
    C = _check_count("context_length", context_length, 0)
    ctx_bytes = _check_count("context_cache_bytes", context_cache_bytes, 0, 2**62, "2**62")
    if C and copies > 1:
        raise ValueError("a shared context is priced for the shared engine only (prefix_copies=1)")
    devices = _check_count("devices", devices, 1)
    branch_steps = steps * B * N if branch_steps is None else _check_count(
        "branch_steps", branch_steps, 0)
    held = ctx_bytes + prefix_bytes + tail_bytes
    per_device = held if kv_bytes_per_device is None else _check_count(
        "kv_bytes_per_device", kv_bytes_per_device, 0, 2**62, "2**62")
    allocated = held if kv_bytes_allocated is None else _check_count(
        "kv_bytes_allocated", kv_bytes_allocated, 0, 2**62, "2**62")

    b = _dtype_bytes(config, dtype_bytes)
    slots = branch_steps / steps if steps else 0.0
    W = step_weight_bytes(config, slots, b) if steps else weight_bytes(config, b)
    kv = kv_bytes_per_token(config, b)
    full = prompts + C  # the tokens before the first new one, context included
    prefill = sum(prefill_flops(config, int(p)) for p in full)  # each prompt alone
    prefill_shared = (copies * prefill if not C else prefill_flops(config, C) + sum(
        suffix_prefill_flops(config, C, int(p)) for p in prompts))
    decode = int(np.sum(decode_flops(config, full[:, None], lengths)))

    # Bytes read over the decode steps: at step s, branch (b, n) reads the
    # min(s + 1, length) tail tokens it has; the prefix is read once per
    # step (shared) or once per branch (separate, batched).
    s = np.arange(steps, dtype=np.int64)[:, None, None]
    tail_tokens = int(np.minimum(s + 1, lengths[None]).sum()) if steps else 0
    prefix_tokens = int(prompts.sum())
    read_shared = steps * (W + (C + copies * prefix_tokens) * kv) + tail_tokens * kv
    read_separate = steps * (W + N * (B * C + prefix_tokens) * kv) + tail_tokens * kv

    return Bill(
        num_prompts=B, n=N, decode_steps=steps, branch_steps=branch_steps,
        prompt_tokens_prefilled=C + copies * prefix_tokens,
        prompt_tokens_if_separate=N * (B * C + prefix_tokens),
        decoded_tokens_per_branch=lengths.tolist(),
        decoded_tokens_total=int(lengths.sum()),
        kept_tokens_per_branch=kept.tolist(),
        kept_tokens_total=int(kept.sum()),
        kv_bytes_held=held,
        kv_bytes_shared_prefix=prefix_bytes,
        kv_bytes_tails=tail_bytes,
        kv_bytes_if_separate=N * (B * ctx_bytes + prefix_bytes // copies) + tail_bytes,
        prefill_flops_shared=int(prefill_shared),
        prefill_flops_if_separate=N * int(prefill),
        decode_flops_shared=decode,
        decode_flops_if_separate=decode,
        decode_bytes_read_shared=int(read_shared),
        decode_bytes_read_if_separate=int(read_separate),
        weight_bytes=weight_bytes(config, b),
        kv_bytes_per_token=kv,
        devices=devices, kv_bytes_per_device=per_device, kv_bytes_allocated=allocated,
        shared_context_tokens=C, kv_bytes_shared_context=ctx_bytes,
        prompt_tokens_if_context_per_prompt=int(full.sum()),
        prefill_flops_if_context_per_prompt=int(prefill),
        experts=getattr(config, "n_experts", 0),
        experts_per_token=getattr(config, "n_experts_per_tok", 0),
        slots_per_step=float(slots) if getattr(config, "n_experts", 0) else 0.0,
        experts_touched_per_step=expected_experts_touched(config, slots) if steps else 0.0,
    )


def measure_experts_touched(lm, generation) -> float:
    """The distinct experts per layer the router really chose per decode step, averaged.

    Replays the request teacher-forced (each branch's prompt + decoded tokens
    through `models.llama.router_choices`, which routes exactly as the
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

    from jaxsample.models import llama

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


# ---------------------------------------------------------------------------
# Formatting


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary prefixes)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """2.5e12 -> '2.50 TFLOP' (decimal prefixes)."""
    n = float(n)
    if n == 0:
        return "0 FLOP"
    exp = min(int(math.log10(abs(n)) // 3), 5)
    if exp <= 0:
        return f"{n:.0f} FLOP"
    prefix = "kMGTP"[exp - 1]
    return f"{n / 10 ** (3 * exp):.2f} {prefix}FLOP"
