"""Bridge layers (arXiv 2510.01143): exactness at init, symmetry, masking, widths,
sharding, the teacher-forced training forward against decode, and training.

Oracles: the engine without a Bridge (zero-init Bridge), the block itself on
permuted inputs (equivariance), the same prompt alone (row isolation), the
unsharded run (sharding), the engine's own decode logprobs (teacher-forced
group forward), and the prefill (full-width forward over identical copies).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.bridge_training import common as bridge_train
from jaxsample.bridge_training import grpo as bridge_grpo
from jaxsample import SamplingParams
from jaxsample.models import llama
from ties import assert_same_tokens_up_to_ties, rows

BCFG = bridge_lib.BridgeConfig(dim=8, n_heads=2)
PROMPTS = ["Hello there, branch!", "ab"]
STOPS = tuple(range(0, 256, 20))  # frequent stops, so some branches finish early


def nonzero(lm, cfg=BCFG, seed=1, scale=0.5):
    """A Bridge with random nonzero W_O (a trained-looking Bridge)."""
    b = bridge_lib.init(lm, cfg, jax.random.key(seed))
    wo = scale * jax.random.normal(jax.random.key(seed + 100), b.params["wo"].shape)
    return b.replace_params(dict(b.params, wo=wo))


def sp(n, **kw):
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=12, seed=3,
                          stop_token_ids=STOPS, **kw)


@pytest.fixture(scope="module")
def bridge(tiny_lm):
    return nonzero(tiny_lm)


@pytest.fixture(scope="module")
def coupled(tiny_lm, bridge):
    return engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge)


def block_fn(cfg, p_l):
    return jax.jit(jax.vmap(lambda x, a: bridge_lib.apply_block(cfg, p_l, x, a, ("branch",)),
                            axis_name="branch"))


def layer_params(b, l=0):
    return jax.tree_util.tree_map(lambda a: a[l], b.params)


# ---------------------------------------------------------------------------
# Block level


def test_block_permutation_equivariant(tiny_lm, bridge):
    f = block_fn(BCFG, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (6, 5, tiny_lm.config.dim))
    for alive in (jnp.array([1, 0, 1, 1, 0, 1], bool),
                  jax.random.bernoulli(jax.random.key(2), 0.6, (6, 5))):  # per position
        out = f(x, alive)
        assert not np.allclose(out, x, atol=1e-3)  # it does mix
        perm = np.array([3, 0, 5, 1, 4, 2])
        np.testing.assert_allclose(f(x[perm], alive[perm]), out[perm], atol=1e-6, rtol=0)


def test_dead_branch_has_no_influence_and_no_nan(tiny_lm, bridge):
    f = block_fn(BCFG, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (4, 3, tiny_lm.config.dim))
    alive = jnp.array([True, False, True, True])
    out = np.asarray(f(x, alive))
    x2 = x.at[1].set(100.0 * jax.random.normal(jax.random.key(9), x[1].shape))
    out2 = np.asarray(f(x2, alive))
    np.testing.assert_array_equal(out2[[0, 2, 3]], out[[0, 2, 3]])
    # All dead: each query sees only itself, equal to the self-only (control) block.
    dead = np.asarray(f(x, jnp.zeros(4, bool)))
    ctrl = block_fn(bridge_lib.BridgeConfig(dim=8, n_heads=2, cross_branch=False),
                    layer_params(bridge))(x, jnp.ones(4, bool))
    assert np.all(np.isfinite(dead))
    np.testing.assert_allclose(dead, ctrl, atol=1e-6, rtol=0)


def test_unselected_layer_is_exact_noop(tiny_lm):
    cfg = bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,))
    b = nonzero(tiny_lm, cfg)
    x = jax.random.normal(jax.random.key(0), (4, 3, tiny_lm.config.dim))
    alive = jnp.ones(4, bool)
    np.testing.assert_array_equal(block_fn(cfg, layer_params(b, 0))(x, alive), x)
    assert not np.allclose(block_fn(cfg, layer_params(b, 1))(x, alive), x)
    assert bridge_lib.param_count(b) == bridge_lib.param_count(nonzero(tiny_lm)) // 2
    with pytest.raises(ValueError, match="out of range"):
        bridge_lib.init(tiny_lm, bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(5,)))


def test_param_count_and_fraction(tiny_lm):
    b = bridge_lib.init(tiny_lm, BCFG)
    L, E, d = tiny_lm.config.n_layers, tiny_lm.config.dim, BCFG.dim
    assert bridge_lib.param_count(b) == L * (4 * E * d + E)
    assert 0.01 < bridge_lib.param_fraction(b, tiny_lm.params) < 0.10
    # The embedded model's shapes (SmolLM2-135M), without loading it: default config.
    smol = llama.LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                             head_dim=64, ffn_dim=1536)

    class Shape:
        config = smol

    big = jax.eval_shape(lambda: bridge_lib.init(Shape, bridge_lib.BridgeConfig()).params)
    base = jax.eval_shape(lambda: llama.init_params(smol, jax.random.key(0)))
    frac = bridge_lib.param_fraction(bridge_lib.Bridge(bridge_lib.BridgeConfig(), big), base)
    assert 0.02 < frac < 0.05  # about 3.3%


# ---------------------------------------------------------------------------
# Generation


def test_zero_init_is_exactly_the_base_model(tiny_lm):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    zero = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge_lib.init(tiny_lm, BCFG))
    np.testing.assert_array_equal(zero.tokens, base.tokens)
    np.testing.assert_array_equal(zero.lengths, base.lengths)
    np.testing.assert_array_equal(zero.logprobs, base.logprobs)


def test_nonzero_bridge_couples_branches(tiny_lm, coupled):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    assert not np.array_equal(coupled.tokens, base.tokens)
    assert np.all(np.isfinite(coupled.logprobs))
    stopped = [r == "stop" for row in coupled.finish_reason for r in row]
    assert any(stopped) and not all(stopped)  # masking of finished branches is exercised


def test_rows_never_see_other_prompts(tiny_lm, bridge, coupled):
    alone = engine.generate(tiny_lm, PROMPTS[1:], sp(4), bridge=bridge)
    # Global prompt index differs (1 vs 0), so compare with a batch where it is first.
    pair = engine.generate(tiny_lm, [PROMPTS[1], PROMPTS[0]], sp(4), bridge=bridge)
    assert_same_tokens_up_to_ties(tiny_lm, rows(alone, 0, 1), rows(pair, 0, 1))


@pytest.mark.parametrize("n", [1, 2, 8])
def test_any_width_with_the_same_params(tiny_lm, bridge, n):
    g = engine.generate(tiny_lm, PROMPTS, sp(n), bridge=bridge)
    assert g.tokens.shape == (2, n, 12) and np.all(np.isfinite(g.logprobs))
    if n == 1:  # alone, a branch only sees itself: the self-only control
        ctrl = bridge_lib.Bridge(bridge_lib.BridgeConfig(dim=8, n_heads=2, cross_branch=False),
                                 bridge.params)
        ref = engine.generate(tiny_lm, PROMPTS, sp(1), bridge=ctrl)
        assert_same_tokens_up_to_ties(tiny_lm, ref, g)


def test_sharded_equals_unsharded(tiny_lm, bridge, coupled):
    mesh = jax.make_mesh((1, 4), ("data", "branch"))
    sharded = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge, mesh=mesh)
    assert_same_tokens_up_to_ties(tiny_lm, coupled, sharded)


def test_prefill_runs_prompt_once_equal_to_full_width_copies(tiny_lm, bridge):
    """The engine's prefill (axes=()) equals a coupled forward over N identical copies."""
    cfg = tiny_lm.config
    ids = np.array(tiny_lm.tokenizer.encode(PROMPTS[0]), np.int32)
    P = len(ids)
    post = lambda x, p_l: bridge_lib.apply_block(BCFG, p_l, x, True, ())
    prefix, last = engine.prefill(cfg, tiny_lm.params, jnp.asarray(ids[None]), jnp.array([P]),
                                  post, bridge.params)
    N = 4
    hidden, (k, v) = bridge_train.group_forward(cfg, tiny_lm.params, BCFG, bridge.params,
                                                jnp.tile(ids, (N, 1)), jnp.ones((N, P), bool))
    K = cfg.n_kv_heads

    def row0(a):  # the engine's prefix cache, row 0, as [L, P, K, D] whatever its layout
        a = jnp.stack(list(a)) if isinstance(a, (list, tuple)) else a
        a = a[:, 0]
        return a.swapaxes(1, 2) if a.shape[1] == K and a.shape[2] != K else a

    for n in range(N):
        np.testing.assert_allclose(k[n], row0(prefix.k), atol=1e-5, rtol=0)
        np.testing.assert_allclose(v[n], row0(prefix.v), atol=1e-5, rtol=0)
        np.testing.assert_allclose(llama.logits(cfg, tiny_lm.params, hidden[n, -1]), last[0],
                                   atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------
# Training


def stop_array(lm):
    s = sorted(set(lm.tokenizer.eos_token_ids) | set(STOPS))
    return jnp.asarray(s + [-1] * (engine.MAX_STOP_IDS - len(s)), jnp.int32)


def test_teacher_forced_group_forward_equals_decode(tiny_lm, bridge, coupled):
    g = coupled
    for b in range(len(PROMPTS)):
        prompt = np.asarray(g.prompt_tokens[b], np.int32)
        padded = np.zeros(32, np.int32)
        padded[:len(prompt)] = prompt
        lp = bridge_train.group_logprobs(
            tiny_lm.config, tiny_lm.params, BCFG, bridge.params, jnp.asarray(padded),
            jnp.int32(len(prompt)), jnp.asarray(g.tokens[b]), jnp.asarray(g.lengths[b]),
            stop_array(tiny_lm), tiny_lm.vocab_limit)
        np.testing.assert_allclose(lp, g.logprobs[b], atol=1e-4, rtol=0)


def test_gradients_reach_only_trainable_bridge_params_and_sft_loss_decreases(tiny_lm):
    cfg = bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,))
    b = bridge_lib.init(tiny_lm, cfg)
    gen = engine.generate(tiny_lm, PROMPTS, sp(4))
    P = 32
    prompt = np.zeros((2, P), np.int32)
    for i, t in enumerate(gen.prompt_tokens):
        prompt[i, :len(t)] = t
    batch = bridge_train.Batch(jnp.asarray(prompt), jnp.asarray([len(t) for t in gen.prompt_tokens]),
                               jnp.asarray(gen.tokens), jnp.asarray(gen.lengths),
                               jnp.ones((2, 4), jnp.float32), stop_array(tiny_lm))
    grads = jax.grad(lambda p: bridge_train.pg_loss(p, tiny_lm.config, tiny_lm.params, cfg, batch,
                                                    tiny_lm.vocab_limit)[0])(b.params)
    assert float(jnp.abs(grads["wo"][1]).max()) > 0  # flows into the selected layer
    for name, g in grads.items():
        np.testing.assert_array_equal(g[0], 0)  # nothing into the unselected layer
    np.testing.assert_array_equal(grads["gate"], 0)  # gates are not trained
    # The supervised (all-advantages-1) loss decreases under Adam on this batch.
    loss_and_grad = jax.jit(jax.value_and_grad(lambda p: bridge_train.pg_loss(
        p, tiny_lm.config, tiny_lm.params, cfg, batch, tiny_lm.vocab_limit)[0]))
    opt = bridge_train.make_optimizer(3e-2)
    params, opt_state, losses = b.params, opt.init(b.params), []
    for _ in range(8):
        loss, g = loss_and_grad(params)
        updates, opt_state = opt.update(g, opt_state, params)
        params = jax.tree_util.tree_map(lambda a, u: a + u, params, updates)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses
    np.testing.assert_array_equal(params["gate"], b.params["gate"])

def test_checkpoint_round_trip_and_resume(tiny_lm, tmp_path):
    problems = [bridge_train.Problem(p, "0") for p in PROMPTS]
    kw = dict(steps=3, n=4, groups=1, max_new_tokens=12, learning_rate=3e-2, seed=5,
              chat=False, stop_token_ids=STOPS, log=None, save_every=100,
              reward_fn=lambda text, p: float(len(text) > 5))
    b0 = bridge_lib.init(tiny_lm, BCFG)
    full, st_full, hist_full = bridge_grpo.train(tiny_lm, b0, problems, **kw)
    assert any(h["grad_norm"] > 0 for h in hist_full)  # rewards varied: params moved
    assert not np.array_equal(full.params["wo"], b0.params["wo"])
    d = str(tmp_path / "ckpt")
    _, st_half, _ = bridge_grpo.train(tiny_lm, b0, problems, ckpt_dir=d, stop_after=1, **kw)
    assert bridge_train.latest_step(d) == 1
    # Round trip: bit-identical params and optimizer state.
    opt = bridge_train.make_optimizer(3e-2)
    back, meta = bridge_train.restore(d, bridge_train.init_state(b0, opt), tiny_lm, BCFG)
    assert meta["base_model"] == "tiny" and meta["step"] == 1
    for a, c in zip(jax.tree_util.tree_leaves(st_half), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(a, c)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(st_half)
    # Continue from step 1: identical to the uninterrupted run.
    resumed, st_res, hist_res = bridge_grpo.train(tiny_lm, b0, problems, ckpt_dir=d, **kw)
    assert [h["step"] for h in hist_res] == [2, 3]
    for a, c in zip(jax.tree_util.tree_leaves(st_full), jax.tree_util.tree_leaves(st_res)):
        np.testing.assert_array_equal(a, c)
    # A checkpoint refuses another base model or Bridge config.
    with pytest.raises(ValueError, match="Bridge config"):
        bridge_train.restore(d, bridge_train.init_state(b0, opt), tiny_lm,
                             bridge_lib.BridgeConfig(dim=8, n_heads=4))


@pytest.mark.parametrize("skip", [True, False])
def test_zero_signal_steps_leave_params_and_adam_state_alone(tiny_lm, skip):
    """Step 1 has reward variance, steps 2-3 none: with skip_no_signal the params and
    optimizer state after 3 steps equal those after 1; without it, Adam's momentum
    keeps moving the params on the zero gradient (the failure of the first CPU run)."""
    problems = [bridge_train.Problem(p, "0") for p in PROMPTS]
    n, groups = 4, 1

    def run(steps):
        calls = [0]

        def reward_fn(text, p):  # 1, 0, 1, 0 on step 1, then constant
            calls[0] += 1
            return float(calls[0] % 2) if calls[0] <= n * groups else 1.0

        return bridge_grpo.train(tiny_lm, bridge_lib.init(tiny_lm, BCFG), problems, steps=steps,
                                  n=n, groups=groups, max_new_tokens=12, learning_rate=3e-2,
                                  seed=5, chat=False, stop_token_ids=STOPS, log=None,
                                  reward_fn=reward_fn, skip_no_signal=skip)

    _, st1, h1 = run(1)
    _, st3, h3 = run(3)
    assert h1[0]["signal_groups"] == 1 and not h1[0]["skipped"] and h1[0]["grad_norm"] > 0
    assert [h["signal_groups"] for h in h3] == [1, 0, 0]
    assert [h["skipped"] for h in h3] == [False, skip, skip]
    assert int(st3.step) == 3
    same = [np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(st1.params),
                                                 jax.tree_util.tree_leaves(st3.params))]
    if skip:
        assert all(same)
        for a, b in zip(jax.tree_util.tree_leaves(st1.opt_state),
                        jax.tree_util.tree_leaves(st3.opt_state)):
            np.testing.assert_array_equal(a, b)
    else:
        assert not np.array_equal(st1.params["wo"], st3.params["wo"])  # momentum moved them
