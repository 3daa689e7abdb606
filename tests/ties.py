"""Token comparisons that hold on any machine.

Two computation paths of the same request (shared prefix vs naive copies,
sharded vs unsharded, chunked vs one call, a row alone vs in a batch) compile
to different programs, whose float32 roundings differ by ~1e-6 relative. A
sampled token is `argmax(z + gumbel)` over the kept set: where the two best
perturbed scores are closer than that rounding, another CPU (or XLA version)
may pick the other token, and the branches diverge from there on. Asserting
exact token equality would then fail on a machine we never ran.

`assert_same_tokens_up_to_ties` compares two Generations branch by branch. At
the first position where a branch differs it recomputes the perturbed scores
of both tokens from their recorded raw logprobs (z_a - z_b = logprob_a -
logprob_b) and the Gumbel noise of the branch's documented key
(`fold_in(fold_in(fold_in(key(seed), prompt_index), branch_index), t)`); the
difference is allowed only if those scores are within `tol / temperature` (a
float tie), and at most `max_ties` branches may differ at all. Tokens before the divergence must be equal, and
their logprobs close. Any other difference fails with the position and the
margin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def branch_key(seed: int, prompt_index: int, branch_index: int, t: int):
    """The engine's key for token t of one branch (README, "keys")."""
    key = jax.random.fold_in(jax.random.key(np.uint32(seed)), prompt_index)
    key = jax.random.fold_in(jax.random.fold_in(key, branch_index), t)
    return key


def _gumbel(lm, key) -> np.ndarray:
    """[V] the Gumbel noise `sampling.choose_token` draws with `key`."""
    return np.asarray(jax.random.gumbel(key, (lm.config.vocab_size,), jnp.float32), np.float64)


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    diff = np.nonzero(np.asarray(a) != np.asarray(b))[0]
    return int(diff[0]) if diff.size else None


def assert_same_tokens_up_to_ties(lm, ref, got, *, prompt_index_offset: int = 0,
                                  branch_index_offset: int = 0, tol: float = 1e-4, max_ties: int = 1,
                                  logprob_atol: float = 1e-5, logprob_rtol: float = 2e-6) -> int:
    """Assert two Generations of one request agree except at float ties.

    Args:
      lm: the model both were generated with (its logits rows size the noise).
      ref, got: Generations (or `rows` views) with the same shapes, prompts and params.
      prompt_index_offset, branch_index_offset: global index of the first
        compared row and branch (for the keys).
      tol: allowed gap in raw-logit units between the two tokens' scores
        (float32 differences between two programs are ~1e-6 on the tiny
        model and ~1e-5 on SmolLM2; 1e-4 is the cached-vs-forward tolerance).
      max_ties: how many branches may diverge at a tie.
      logprob_atol, logprob_rtol: tolerance on logprobs where the tokens agree,
        `atol + rtol * |logprob|`. The relative part is float32's: two programs
        of different shapes (a pool's 4 slots against 8, a mesh's shards) pick
        different CPU dot kernels, whose summation orders differ, and a
        logprob's rounding grows with its magnitude (on the tiny model, near
        log V = 5.6, 2e-6 relative = 1.0e-5, ~21 ulps after 12 steps, measured
        on an AVX-512 Xeon, where the absolute 1e-5 alone failed the pool on a
        mesh; AVX2 machines stayed below it).

    Returns:
      The number of branches that diverged at a tie.
    """
    assert ref.tokens.shape == got.tokens.shape, (ref.tokens.shape, got.tokens.shape)
    params = ref.params
    ties = 0
    B, N, _ = ref.tokens.shape
    for b in range(B):
        for n in range(N):
            ta, tb = ref.tokens[b, n], got.tokens[b, n]
            t = first_difference(ta, tb)
            agree = len(ta) if t is None else t
            np.testing.assert_allclose(got.logprobs[b, n, :agree], ref.logprobs[b, n, :agree],
                                       atol=logprob_atol, rtol=logprob_rtol,
                                       err_msg=f"row {b} branch {n}")
            if t is None:
                assert ref.lengths[b, n] == got.lengths[b, n], (b, n)
                continue
            # Both tokens' tempered logits differ by the difference of their raw
            # logprobs (the log-sum-exp cancels), so the perturbed scores need no
            # forward pass: z_a + g_a vs z_b + g_b.
            a, c = int(ta[t]), int(tb[t])
            dz = float(ref.logprobs[b, n, t]) - float(got.logprobs[b, n, t])
            if params.temperature == 0:
                gap, scale = abs(dz), 1.0
            else:
                g = _gumbel(lm, branch_key(params.seed, prompt_index_offset + b,
                                            branch_index_offset + n, t))
                gap, scale = abs(dz / params.temperature + g[a] - g[c]), params.temperature
            assert gap <= tol / scale, (
                f"row {b} branch {n} differs at token {t} ({a} vs {c}) "
                f"with a score gap of {gap:.3g} > {tol / scale:.3g}: not a float tie")
            ties += 1
    assert ties <= max_ties, f"{ties} branches diverged at float ties (at most {max_ties})"
    return ties


def rows(gen, start: int = 0, stop: int | None = None, branches: slice = slice(None)):
    """A view of rows [start, stop) (and some branches) of a Generation, with the
    fields the comparison reads."""
    import types

    sl = slice(start, stop)
    return types.SimpleNamespace(tokens=gen.tokens[sl, branches],
                                 logprobs=gen.logprobs[sl, branches],
                                 lengths=gen.lengths[sl, branches],
                                 prompt_tokens=gen.prompt_tokens[sl], params=gen.params)
