""""Read once" from the compiled program, and the batched prefix attention it relies on.

`jaxsample.engine.step_cost` compiles one decode step with abstract inputs and reads
XLA's cost analysis. On a tiny config whose prefix (P = 2048) is ~5x the
weights, a step that silently broadcast the prefix to its N = 8 branches would
access at least N - 1 more prefix copies than the ideal; the bounds below
leave room for XLA's own overheads (scores, sampling passes) and nothing near
that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample.engine import step_cost
from jaxsample.engine.prefix_attention import prefix_attention
from jaxsample.models.families import common, llama

# One head of D = 64: the softmax's passes over the scores [N*H, P] (XLA CPU does
# not fuse them into the matmuls) stay small beside the prefix K/V [P, D], so the
# bytes separate "prefix once" from "prefix N times".
CFG = llama.LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=1, n_kv_heads=1,
                        head_dim=64, ffn_dim=128, max_seq_len=4096)
P, N, T = 2048, 8, 16


@pytest.fixture(scope="module")
def costs():
    return (step_cost.decode_step_cost(CFG, P, N, T),
            step_cost.decode_step_cost(CFG, P, N, T, naive=True))


def test_ideal_parts():
    ideal = step_cost.ideal_step_bytes(CFG, P, N, T)
    kv = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * 4  # bytes per position
    assert ideal["prefix"] == P * kv
    assert ideal["tails"] == N * T * kv
    assert ideal["logits"] == N * CFG.vocab_size * 4
    assert ideal["prefix"] > 2.5 * ideal["weights"]  # the prefix dominates the weights
    assert ideal["total"] == sum(ideal[k] for k in ("weights", "prefix", "tails", "logits"))


@pytest.mark.slow
def test_shared_step_reads_the_prefix_once(costs):
    shared, naive = costs
    ideal = shared.ideal_bytes
    broadcast = ideal + (N - 1) * shared.prefix_bytes  # the least a broadcast prefix costs
    assert shared.bytes_accessed < 2.5 * ideal, shared.to_dict()  # measured 1.76
    assert shared.bytes_accessed < 0.4 * broadcast, shared.to_dict()
    # The oracle: the naive engine's step really reads its N prefix copies.
    assert naive.bytes_accessed > broadcast, naive.to_dict()
    assert naive.bytes_accessed > 3 * shared.bytes_accessed
    # Same arithmetic either way (prefix sharing never saves the per-branch FLOPs).
    assert shared.flops == pytest.approx(naive.flops, rel=0.05)


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt_tokens"):
        step_cost.decode_step_cost(CFG, 0, N, T)
    with pytest.raises(ValueError, match="n must"):
        step_cost.compile_decode_step(CFG, P, True, T)


def _plain(q, k, v, mask):
    return common.partial_attention(q, k, v, mask[None], 0.3)


def _batched(q, k, v, mask):
    return prefix_attention(q, k, v, mask, 0.3)


@pytest.mark.parametrize("rows_batch_prefix", [False, True])
def test_prefix_attention_matches_plain_vmap(rows_batch_prefix):
    """The custom batching rule against the plain vmap: branches over one prefix
    (the rule's case), nested in a row vmap whose prefix is batched (the engine's
    shape), with masked keys and one row that sees no key (lse -inf)."""
    R, Nb, S, K, G, M, D = 3, 5, 1, 2, 3, 37, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((R, Nb, S, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((R, K, M, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((R, K, M, D)), jnp.float32)
    mask = jnp.asarray(np.arange(M)[None] < np.array([M, 11, 0])[:, None])

    def run(f):
        inner = jax.vmap(f, in_axes=(0, None, None, None))  # branches: prefix unbatched
        if rows_batch_prefix:
            return jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, 0)))(q, k, v, mask)
        return jax.jit(lambda q: inner(q[0], k[0], v[0], mask[0]))(q)

    (o1, l1), (o2, l2) = run(_plain), run(_batched)
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isinf(np.asarray(l2)), np.isinf(np.asarray(l1)))
    fin = np.isfinite(np.asarray(l1))
    np.testing.assert_allclose(np.asarray(l2)[fin], np.asarray(l1)[fin], rtol=1e-5, atol=1e-6)


def test_prefix_attention_batched_prefix_is_plain_vmap():
    """A prefix batched with the queries (the naive engine's rows) takes the plain path."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((4, 1, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 2, 9, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 2, 9, 8)), jnp.float32)
    mask = jnp.ones((4, 9), bool)
    o1, l1 = jax.vmap(_plain)(q, k, v, mask)
    o2, l2 = jax.vmap(_batched)(q, k, v, mask)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
    np.testing.assert_array_equal(np.asarray(l2), np.asarray(l1))
