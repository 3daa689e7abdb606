"""What the step records of the raw distribution: logprobs, ranks, the top k, selection signals.

All of it on the raw logits (temperature 1, no processors or filters, padding
rows excluded), the arithmetic of `choose_token`'s logprob.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.engine.sampling.processors import prepare
from jaxsample.errors import NumericalError


def token_rank(logits: jax.Array, token: jax.Array, vocab_limit: int) -> jax.Array:
    """`[]` int32 rank of `token` under the raw distribution, vLLM's convention:
    the number of tokens at least as likely (1 for the most likely; ties share
    the larger rank). Padding and NaN rows never count."""
    raw, _, _ = prepare(logits, 1.0, vocab_limit)
    return jnp.sum(raw >= raw[token]).astype(jnp.int32)


def position_logprobs(logits: jax.Array, targets: jax.Array, k: int, vocab_limit: int):
    """Log-probabilities of given tokens at S positions, with their ranks and the top k.

    For prompt logprobs: row i of `logits` is the distribution that follows
    prompt token i, `targets[i]` is prompt token i + 1.

    Args:
      logits: `[S, V]` raw logits.
      targets: `[S]` int32 token ids in [0, vocab_limit).
      k: static int in [0, 20]; 0 gives empty top-k arrays.
      vocab_limit: static; rows >= vocab_limit are padding.
    Returns:
      (logprob `[S]` float32, rank `[S]` int32 (as `token_rank`),
       top values `[S, k]` float32, top ids `[S, k]` int32), the arithmetic
      of `choose_token`'s logprob and `top_logprobs`.
    """
    def one(x, tok):
        raw, _, top = prepare(x, 1.0, vocab_limit)
        shifted = raw - raw[top]
        lse = jnp.log(jnp.sum(jnp.exp(shifted)))
        lp = shifted[tok] - lse
        rank = jnp.sum(raw >= raw[tok]).astype(jnp.int32)
        if k:
            vals, ids = jax.lax.top_k(shifted, k)
        else:
            vals, ids = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
        return lp.astype(jnp.float32), rank, (vals - lse).astype(jnp.float32), ids.astype(jnp.int32)

    return jax.vmap(one)(logits, targets)


def top_logprobs(logits: jax.Array, k: int, vocab_limit: int) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of the raw distribution of one position.

    Args:
      logits: [V] raw logits (temperature 1, no filters).
      k: static int in [1, vocab_limit].
      vocab_limit: static int; rows >= vocab_limit are padding, never listed.
    Returns:
      (values [k] float32 log_softmax, decreasing; ids [k] int32), ties to the
      lower index (`lax.top_k`).
    """
    raw, _, greedy_tok = prepare(logits, 1.0, vocab_limit)  # NaN and padding at -inf
    shifted = raw - raw[greedy_tok]  # the same arithmetic as choose_token's logprob
    vals, ids = jax.lax.top_k(shifted, k)
    return (vals - jnp.log(jnp.sum(jnp.exp(shifted)))).astype(jnp.float32), ids.astype(jnp.int32)


NUM_SIGNALS = 3  # token_signals' outputs: entropy, self-certainty, top-2 margin
SIGNAL_NAMES = ("token_entropy", "self_certainty", "top2_margin")


def token_signals(logits: jax.Array, vocab_limit: int) -> jax.Array:
    """Selection signals of one raw distribution: entropy, self-certainty, top-2 margin.

    On the raw distribution p = softmax(logits) over the real vocabulary
    (temperature 1, no processors or filters, rows >= `vocab_limit` excluded:
    the arithmetic of the recorded logprobs, `prepare` then the max-shifted
    log-sum-exp), in nats:

    * entropy H(p) = -sum_v p_v log p_v, >= 0.
    * self-certainty KL(U || p) = (1/V) sum_v -log(V p_v) = -log V - mean_v
      log p_v, >= 0 (Kang et al. 2025, arXiv 2502.18581, eq. 3, "self-certainty";
      their code, `confidence_logits` in backprop07/Self-Certainty, computes
      `-1/V * sum(logprob + log V)`: the same sign, higher = more confident).
      V is `vocab_limit`, the tokens that can be sampled, not the logits rows:
      the padding rows beyond the tokenizer's vocabulary have p = 0 here (as
      for every logprob this library reports), so counting them would make
      the KL infinite. (The paper's V is the logits width of a Hugging Face
      model, whose padding rows carry finite untrained logits.) It is also
      DeepConf's token confidence -mean log p over the top k with k = V,
      minus the constant log V.
    * top-2 margin log p_(1) - log p_(2) = logit_(1) - logit_(2), >= 0: the
      log-ratio of the two most likely tokens (0 on a tie; +inf when a single
      token has all the mass, e.g. vocab_limit = 1).

    A NaN or -inf logit below `vocab_limit` counts as p = 0 (as in
    `choose_token`): the entropy ignores it, the self-certainty is then +inf.
    A row without a distribution gives NaN for all three.

    Args:
      logits: `[V]` raw logits (any float dtype; computed in float32).
      vocab_limit: static int in [1, V].
    Returns:
      `[3]` float32: (entropy, self-certainty, top-2 margin), `SIGNAL_NAMES`.
    """
    raw, _, top = prepare(logits, 1.0, vocab_limit)  # NaN and padding at -inf
    v = raw.shape[0]
    m = raw[top]
    shifted = raw - m  # <= 0; -inf where p = 0 (the same arithmetic as the logprob)
    e = jnp.exp(shifted)
    z = jnp.sum(e)
    lse = jnp.log(z)
    # H = lse - sum_v p_v shifted_v, with 0 * -inf taken as 0.
    entropy = lse - jnp.sum(jnp.where(e > 0, e * shifted, 0.0)) / z
    real = jnp.arange(v) < vocab_limit
    mean_shifted = jnp.sum(jnp.where(real, shifted, 0.0)) / vocab_limit
    certainty = lse - mean_shifted - jnp.log(jnp.float32(vocab_limit))
    second = jnp.max(jnp.where(jnp.arange(v) == top, -jnp.inf, raw))
    margin = m - second
    out = jnp.stack([entropy, certainty, margin]).astype(jnp.float32)
    return jnp.where(m > -jnp.inf, out, jnp.nan)


def check_logprobs(logprobs: Any) -> None:
    """Raise if any sampled token came from a row without a distribution.

    `choose_token` marks such a token with a NaN logprob (its logits were all
    NaN or -inf: NaN weights, or an overflow in the forward pass). The decode
    loop runs on the device and cannot raise, so the host calls this on the
    finished logprobs before returning anything.

    Args:
      logprobs: [B, N, T] float32 (host array), 0 after a branch ends.

    Raises:
      NumericalError (a RuntimeError): naming the first prompt, branch and new
        token index concerned and the count of such tokens.
    """
    lp = np.asarray(logprobs)
    bad = np.argwhere(np.isnan(lp))
    if bad.size:
        where = ", ".join(f"{name} {int(i)}" for name, i in
                          zip(("prompt", "branch", "new token")[-lp.ndim:], bad[0]))
        raise NumericalError(
            f"the model gave no valid distribution (every logit NaN or -inf) at {where} "
            f"({len(bad)} sampled token(s) in all); the weights hold NaN or the forward pass "
            "overflowed (e.g. in bfloat16)")
