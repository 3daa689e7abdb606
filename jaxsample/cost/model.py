"""Pricing ("price it properly"): what N branches over one shared prompt cost.

`estimate` / `table`: an analytic model from a `models.families.llama.LlamaConfig`
and (P prompt tokens, T new tokens, N branches), comparing the shared-prefix
engine against N separate retries (`bill.py` holds what one request measured).

Prefix sharing saves prefill work (the prompt is prefilled once, not N times)
and prefix memory (its KV cache is held and read once per decode step, not N
times). It never saves the per-branch decode: every branch still runs its own
forward pass for each of its tokens, so decode FLOPs are identical for both.
Every report here shows exactly that.

Counting conventions (letters as in `models/families/llama.py`):

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
`n_experts_per_tok`; `models.families.moe`): a layer holds X SwiGLU experts and a
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
from typing import Any, Sequence

import numpy as np

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---------------------------------------------------------------------------
# Per-model constants


def resolve_dtype_bytes(config, dtype_bytes: int | None, name: str = "dtype_bytes") -> int:
    if dtype_bytes is None:
        return DTYPE_BYTES[getattr(config, "dtype", "float32")]
    if not isinstance(dtype_bytes, (int, np.integer)) or isinstance(dtype_bytes, bool) \
            or dtype_bytes < 1:
        raise ValueError(f"{name} must be a positive integer, got {dtype_bytes!r}")
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
    return 3 * config.dim * config.ffn_dim * resolve_dtype_bytes(config, dtype_bytes)


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
    b = resolve_dtype_bytes(config, dtype_bytes)
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * b


def kv_bytes(config, positions: int, dtype_bytes: int | None = None) -> int:
    """KV-cache bytes of `positions` positions of one sequence, as the engine stores them:
    every position on a global layer, at most w - 1 on a local (sliding-window) layer
    of window w (`engine.prefill.window_extent`). Equals positions x
    `kv_bytes_per_token` for a model without local layers."""
    b = resolve_dtype_bytes(config, dtype_bytes)
    per = 2 * config.n_kv_heads * config.head_dim * b
    windows = getattr(config, "layer_windows", (None,) * config.n_layers)
    if not positions:
        return 0
    return per * sum(positions if w is None else max(min(positions, w - 1), 1) for w in windows)


def weight_bytes(config, dtype_bytes: int | None = None) -> int:
    """Bytes of all parameters: `param_count * dtype_bytes`."""
    return param_count(config) * resolve_dtype_bytes(config, dtype_bytes)


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


def check_count(name: str, value, minimum: int, maximum: int = MAX_COUNT,
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
      config: a `models.families.llama.LlamaConfig`.
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
    P = check_count("prompt_tokens", prompt_tokens, 0)
    T = check_count("new_tokens", new_tokens, 0)
    N = check_count("n", n, 1)
    C = check_count("context_tokens", context_tokens, 0)
    B = check_count("num_prompts", num_prompts, 1)
    b = resolve_dtype_bytes(config, dtype_bytes)
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
