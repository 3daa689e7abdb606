"""`BridgeConfig(center=True)`: cross-branch attention on the branches' deviations from
the group mean. Every Bridge property again (zero-init identity, permutation
equivariance, any width, sharded == unsharded, dead branches masked, gradients only
into Bridge params, checkpoint round trip), plus what centring adds: a branch alone is
exactly the per-token path (no NaN from RMSNorm(0)), and the attention weights do
not see a component the branches share.

Oracles: the engine without a Bridge, the block on permuted inputs, the self-only
block with the same params (N = 1, all others dead, prefill), the unsharded run, the
engine's decode logprobs (teacher-forced forward), the block on inputs without the
shared offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.bridge_training import common as bridge_train
from jaxsample import SamplingParams
from ties import assert_same_tokens_up_to_ties

CCFG = bridge_lib.BridgeConfig(dim=8, n_heads=2, center=True)
SELF = dataclasses.replace(CCFG, cross_branch=False, center=False)
PROMPTS = ["Hello there, branch!", "ab"]
STOPS = tuple(range(0, 256, 20))


def nonzero(lm, cfg=CCFG, seed=1, scale=0.5):
    b = bridge_lib.init(lm, cfg, jax.random.key(seed))
    wo = scale * jax.random.normal(jax.random.key(seed + 100), b.params["wo"].shape)
    return b.replace_params(dict(b.params, wo=wo))


def sp(n):
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=12, seed=3, stop_token_ids=STOPS)


def layer_params(b, l=0):
    return jax.tree_util.tree_map(lambda a: a[l], b.params)


def block_fn(cfg, p_l, stats=False):
    fn = bridge_lib.block_stats if stats else bridge_lib.apply_block
    return jax.jit(jax.vmap(lambda x, a: fn(cfg, p_l, x, a, ("branch",)), axis_name="branch"))


@pytest.fixture(scope="module")
def bridge(tiny_lm):
    return nonzero(tiny_lm)


@pytest.fixture(scope="module")
def coupled(tiny_lm, bridge):
    return engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge)


def test_config_round_trip_and_eps():
    assert bridge_lib.BridgeConfig.from_dict(CCFG.to_dict()) == CCFG
    old = {k: v for k, v in CCFG.to_dict().items() if k != "center"}  # a checkpoint before it
    assert bridge_lib.BridgeConfig.from_dict(old).center is False
    with pytest.raises(ValueError, match="norm_eps"):
        bridge_lib.BridgeConfig(center=True, norm_eps=0.0)


def test_block_permutation_equivariant_and_mixes(tiny_lm, bridge):
    f = block_fn(CCFG, layer_params(bridge))
    g = block_fn(SELF, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (6, 5, tiny_lm.config.dim))
    for alive in (jnp.array([1, 0, 1, 1, 0, 1], bool),
                  jax.random.bernoulli(jax.random.key(2), 0.6, (6, 5))):
        out = f(x, alive)
        assert not np.allclose(out, g(x, alive), atol=1e-3)  # it uses the other branches
        perm = np.array([3, 0, 5, 1, 4, 2])
        np.testing.assert_allclose(f(x[perm], alive[perm]), out[perm], atol=1e-5, rtol=0)


def test_dead_branch_has_no_influence_and_all_dead_is_per_token(tiny_lm, bridge):
    f = block_fn(CCFG, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (4, 3, tiny_lm.config.dim))
    alive = jnp.array([True, False, True, True])
    out = np.asarray(f(x, alive))
    x2 = x.at[1].set(100.0 * jax.random.normal(jax.random.key(9), x[1].shape))
    out2 = np.asarray(f(x2, alive))
    np.testing.assert_array_equal(out2[[0, 2, 3]], out[[0, 2, 3]])  # nor through the mean
    ctrl = np.asarray(block_fn(SELF, layer_params(bridge))(x, jnp.ones(4, bool)))
    dead = np.asarray(f(x, jnp.zeros(4, bool)))
    assert np.all(np.isfinite(dead))
    np.testing.assert_allclose(dead, ctrl, atol=1e-6, rtol=0)


def test_alone_or_identical_is_the_per_token_path_with_finite_gradients(tiny_lm, bridge):
    """N = 1 and N identical copies: deviation exactly 0, RMSNorm(0) = 0 (eps > 0)."""
    p = layer_params(bridge)
    x = jax.random.normal(jax.random.key(0), (1, 3, tiny_lm.config.dim))
    ctrl = block_fn(SELF, p)(x, jnp.ones(1, bool))
    np.testing.assert_allclose(block_fn(CCFG, p)(x, jnp.ones(1, bool)), ctrl, atol=1e-6, rtol=0)
    copies = jnp.tile(x, (4, 1, 1))
    np.testing.assert_allclose(block_fn(CCFG, p)(copies, jnp.ones(4, bool)),
                               jnp.tile(ctrl, (4, 1, 1)), atol=1e-6, rtol=0)
    for xs in (x, copies):
        loss = lambda p_l: jnp.sum(block_fn(CCFG, p_l)(xs, jnp.ones(xs.shape[0], bool)) ** 2)
        grads = jax.grad(loss)(p)
        for name, gr in grads.items():
            assert np.all(np.isfinite(gr)), name


def test_attention_ignores_a_shared_component(tiny_lm, bridge):
    """Adding one large vector to every branch moves the uncentred attention to 1/N but
    leaves the centred attention weights where they were (the issue-15 diagnosis)."""
    p = layer_params(bridge)
    E = tiny_lm.config.dim
    x = jax.random.normal(jax.random.key(0), (4, 3, E))
    shared = 300.0 * jax.random.normal(jax.random.key(5), (1, 1, E))
    alive = jnp.ones(4, bool)
    _, _, sw, tv = block_fn(CCFG, p, stats=True)(x, alive)
    _, _, sw_shift, tv_shift = block_fn(CCFG, p, stats=True)(x + shared, alive)
    np.testing.assert_allclose(sw_shift, sw, atol=1e-4, rtol=0)
    np.testing.assert_allclose(tv_shift, tv, atol=1e-4, rtol=0)
    assert np.mean(tv) > 0.05  # not mean pooling at init
    plain = dataclasses.replace(CCFG, center=False)
    _, _, sw_plain, tv_plain = block_fn(plain, p, stats=True)(x + shared, alive)
    assert np.max(tv_plain) < 0.01 and np.max(np.abs(np.asarray(sw_plain) - 0.25)) < 0.01


def test_zero_init_is_exactly_the_base_model(tiny_lm):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    zero = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge_lib.init(tiny_lm, CCFG))
    np.testing.assert_array_equal(zero.tokens, base.tokens)
    np.testing.assert_array_equal(zero.logprobs, base.logprobs)
    # and zeroing W_O of a nonzero centred Bridge gives the base model again
    again = engine.generate(tiny_lm, PROMPTS, sp(4),
                            bridge=bridge_lib.zeros_like_output(nonzero(tiny_lm)))
    np.testing.assert_array_equal(again.tokens, base.tokens)


@pytest.mark.parametrize("n", [1, 8])
def test_any_width_and_alone_equals_self_only(tiny_lm, bridge, coupled, n):
    g = engine.generate(tiny_lm, PROMPTS, sp(n), bridge=bridge)
    assert g.tokens.shape == (2, n, 12) and np.all(np.isfinite(g.logprobs))
    if n == 1:
        ref = engine.generate(tiny_lm, PROMPTS, sp(1), bridge=bridge_lib.self_only(bridge))
        assert_same_tokens_up_to_ties(tiny_lm, ref, g)
        assert bridge_lib.self_only(bridge).config == SELF  # one compiled program with nocross
        return
    uncentred = bridge_lib.Bridge(dataclasses.replace(CCFG, center=False), bridge.params)
    assert not np.array_equal(
        coupled.tokens, engine.generate(tiny_lm, PROMPTS, sp(4), bridge=uncentred).tokens)


def test_sharded_equals_unsharded(tiny_lm, bridge, coupled):
    mesh = jax.make_mesh((1, 4), ("data", "branch"))
    sharded = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge, mesh=mesh)
    assert_same_tokens_up_to_ties(tiny_lm, coupled, sharded)


def stop_array(lm):
    s = sorted(set(lm.tokenizer.eos_token_ids) | set(STOPS))
    return jnp.asarray(s + [-1] * (engine.MAX_STOP_IDS - len(s)), jnp.int32)


def test_teacher_forced_forward_equals_decode(tiny_lm, bridge, coupled):
    g = coupled
    assert any(r == "stop" for row in g.finish_reason for r in row)  # masking exercised
    for b in range(len(PROMPTS)):
        prompt = np.asarray(g.prompt_tokens[b], np.int32)
        padded = np.zeros(32, np.int32)
        padded[:len(prompt)] = prompt
        lp = bridge_train.group_logprobs(
            tiny_lm.config, tiny_lm.params, CCFG, bridge.params, jnp.asarray(padded),
            jnp.int32(len(prompt)), jnp.asarray(g.tokens[b]), jnp.asarray(g.lengths[b]),
            stop_array(tiny_lm), tiny_lm.vocab_limit)
        np.testing.assert_allclose(lp, g.logprobs[b], atol=1e-4, rtol=0)


def test_gradients_only_into_bridge_params_and_checkpoint(tiny_lm, coupled, tmp_path):
    cfg = dataclasses.replace(CCFG, layers=(1,))
    b = nonzero(tiny_lm, cfg, scale=0.05)
    g = coupled
    P = 32
    prompt = np.zeros((2, P), np.int32)
    for i, t in enumerate(g.prompt_tokens):
        prompt[i, :len(t)] = t
    batch = bridge_train.Batch(jnp.asarray(prompt), jnp.asarray([len(t) for t in g.prompt_tokens]),
                               jnp.asarray(g.tokens), jnp.asarray(g.lengths),
                               jnp.ones((2, 4), jnp.float32), stop_array(tiny_lm))
    grads = jax.grad(lambda p: bridge_train.pg_loss(p, tiny_lm.config, tiny_lm.params, cfg,
                                                    batch, tiny_lm.vocab_limit)[0])(b.params)
    for name in ("wq", "wk", "wv", "wo", "norm"):
        assert float(jnp.abs(grads[name][1]).max()) > 0, name  # q/k trained through centring
        np.testing.assert_array_equal(grads[name][0], 0)  # the unselected layer
    np.testing.assert_array_equal(grads["gate"], 0)
    # Checkpoint round trip keeps the option, and refuses the uncentred config.
    opt = bridge_train.make_optimizer(1e-3)
    state = bridge_train.init_state(b, opt)
    d = str(tmp_path / "ckpt")
    bridge_train.save(d, state, tiny_lm, cfg)
    back, meta = bridge_train.restore(d, bridge_train.init_state(b, opt), tiny_lm, cfg)
    assert meta["bridge_config"]["center"] is True
    for a, c in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="Bridge config"):
        bridge_train.restore(d, bridge_train.init_state(b, opt), tiny_lm,
                             dataclasses.replace(cfg, center=False))


def test_diagnostics_run_on_a_centred_bridge(tiny_lm, bridge):
    from jaxsample.bridge_training import diagnostics as bridge_diagnostics
    from jaxsample.bridge_training import grpo as bridge_grpo

    batch, _, _ = bridge_grpo.rollout(tiny_lm, bridge, [bridge_train.Problem(p, "0") for p in PROMPTS],
                                      4, 3, 10, 1.0, chat=False, stop_token_ids=STOPS)
    d = bridge_diagnostics.diagnose(tiny_lm, bridge, batch)
    assert all(r > 0 for r in d["rel_norm"]) and all(0 < s < 1 for s in d["self_mass"])
    assert all(t > 0.01 for t in d["tv_from_uniform"])
    ablated = bridge_diagnostics.diagnose(tiny_lm, bridge_lib.self_only(bridge), batch)
    np.testing.assert_array_equal(ablated["tv_from_uniform"], 0.0)
