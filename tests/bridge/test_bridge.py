"""Bridge layers (arXiv 2510.01143): exactness at init, symmetry, masking, widths,
sharding, the teacher-forced training forward against decode, and training.

Every property runs on the plain Bridge and on the centred one
(`BridgeConfig(center=True)`: cross-branch attention on the branches' deviations
from the group mean), parametrised by `cfg`; what centring adds has its own tests
below: a branch alone is exactly the per-token path (no NaN from RMSNorm(0)), and
the attention weights do not see a component the branches share.

Oracles: the engine without a Bridge (zero-init Bridge), the block itself on
permuted inputs (equivariance), the self-only block with the same params (N = 1,
all others dead), the same prompt alone (row isolation), the unsharded run
(sharding), the engine's own decode logprobs (teacher-forced group forward), the
prefill (full-width forward over identical copies), and the block on inputs
without the shared offset.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BRIDGE_PROMPTS as PROMPTS
from helpers import STOPS, block_fn, layer_params, nonzero, sp, stop_array
from ties import assert_same_tokens_up_to_ties, rows

from jaxsample import bridge as bridge_lib
from jaxsample import engine
from jaxsample.bridge_training import common as bridge_train
from jaxsample.bridge_training import grpo as bridge_grpo
from jaxsample.models.families import llama

BCFG = bridge_lib.BridgeConfig(dim=8, n_heads=2)
CCFG = bridge_lib.BridgeConfig(dim=8, n_heads=2, center=True)
SELF = dataclasses.replace(BCFG, cross_branch=False)  # the self-only control of both
BOTH = pytest.mark.parametrize("cfg", [BCFG, CCFG], ids=["plain", "center"], indirect=True)
CENTER = pytest.mark.parametrize("cfg", [CCFG], ids=["center"], indirect=True)


@pytest.fixture(scope="module")
def cfg(request):
    """The Bridge config under test: BCFG unless a test is parametrised (BOTH, CENTER)."""
    return getattr(request, "param", BCFG)


@pytest.fixture(scope="module")
def bridge(tiny_lm, cfg):
    return nonzero(tiny_lm, cfg)


@pytest.fixture(scope="module")
def coupled(tiny_lm, bridge):
    return engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge)


# ---------------------------------------------------------------------------
# Block level


@pytest.mark.slow
@BOTH
def test_block_permutation_equivariant(tiny_lm, cfg, bridge):
    f = block_fn(cfg, layer_params(bridge))
    g = block_fn(SELF, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (6, 5, tiny_lm.config.dim))
    for alive in (jnp.array([1, 0, 1, 1, 0, 1], bool),
                  jax.random.bernoulli(jax.random.key(2), 0.6, (6, 5))):  # per position
        out = f(x, alive)
        if cfg.center:
            assert not np.allclose(out, g(x, alive), atol=1e-3)  # it uses the other branches
        else:
            assert not np.allclose(out, x, atol=1e-3)  # it does mix
        perm = np.array([3, 0, 5, 1, 4, 2])
        np.testing.assert_allclose(f(x[perm], alive[perm]), out[perm],
                                   atol=1e-5 if cfg.center else 1e-6, rtol=0)


@BOTH
def test_dead_branch_has_no_influence_and_no_nan(tiny_lm, cfg, bridge):
    """Nor through the group mean (centred); all dead: each query sees only itself."""
    f = block_fn(cfg, layer_params(bridge))
    x = jax.random.normal(jax.random.key(0), (4, 3, tiny_lm.config.dim))
    alive = jnp.array([True, False, True, True])
    out = np.asarray(f(x, alive))
    x2 = x.at[1].set(100.0 * jax.random.normal(jax.random.key(9), x[1].shape))
    out2 = np.asarray(f(x2, alive))
    np.testing.assert_array_equal(out2[[0, 2, 3]], out[[0, 2, 3]])
    # All dead: each query sees only itself, equal to the self-only (control) block.
    dead = np.asarray(f(x, jnp.zeros(4, bool)))
    ctrl = block_fn(SELF, layer_params(bridge))(x, jnp.ones(4, bool))
    assert np.all(np.isfinite(dead))
    np.testing.assert_allclose(dead, ctrl, atol=1e-6, rtol=0)


def test_unselected_layer_is_exact_noop(tiny_lm):
    cfg = bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,))
    b = nonzero(tiny_lm, cfg)
    x = jax.random.normal(jax.random.key(0), (4, 3, tiny_lm.config.dim))
    alive = jnp.ones(4, bool)
    np.testing.assert_array_equal(block_fn(cfg, layer_params(b, 0))(x, alive), x)
    assert not np.allclose(block_fn(cfg, layer_params(b, 1))(x, alive), x)
    assert bridge_lib.param_count(b) == bridge_lib.param_count(nonzero(tiny_lm, BCFG)) // 2
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


@pytest.mark.slow
@BOTH
def test_zero_init_is_exactly_the_base_model(tiny_lm, cfg, bridge):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    zero = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge_lib.init(tiny_lm, cfg))
    np.testing.assert_array_equal(zero.tokens, base.tokens)
    np.testing.assert_array_equal(zero.lengths, base.lengths)
    np.testing.assert_array_equal(zero.logprobs, base.logprobs)
    if cfg.center:  # and zeroing W_O of a nonzero centred Bridge gives the base model again
        again = engine.generate(tiny_lm, PROMPTS, sp(4),
                                bridge=bridge_lib.zeros_like_output(bridge))
        np.testing.assert_array_equal(again.tokens, base.tokens)


@pytest.mark.slow
def test_nonzero_bridge_couples_branches(tiny_lm, coupled):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    assert not np.array_equal(coupled.tokens, base.tokens)
    assert np.all(np.isfinite(coupled.logprobs))
    stopped = [r == "stop" for row in coupled.finish_reason for r in row]
    assert any(stopped) and not all(stopped)  # masking of finished branches is exercised


@pytest.mark.slow
def test_rows_never_see_other_prompts(tiny_lm, bridge, coupled):
    alone = engine.generate(tiny_lm, PROMPTS[1:], sp(4), bridge=bridge)
    # Global prompt index differs (1 vs 0), so compare with a batch where it is first.
    pair = engine.generate(tiny_lm, [PROMPTS[1], PROMPTS[0]], sp(4), bridge=bridge)
    assert_same_tokens_up_to_ties(tiny_lm, rows(alone, 0, 1), rows(pair, 0, 1))


@pytest.mark.slow
@BOTH
@pytest.mark.parametrize("n", [1, 2, 8])
def test_any_width_with_the_same_params(tiny_lm, cfg, bridge, coupled, n):
    g = engine.generate(tiny_lm, PROMPTS, sp(n), bridge=bridge)
    assert g.tokens.shape == (2, n, 12) and np.all(np.isfinite(g.logprobs))
    if n == 1:  # alone, a branch only sees itself: the self-only control
        ctrl = bridge_lib.Bridge(SELF, bridge.params)
        ref = engine.generate(tiny_lm, PROMPTS, sp(1), bridge=ctrl)
        assert_same_tokens_up_to_ties(tiny_lm, ref, g)
        if cfg.center:  # the ablation is that control: one compiled program with nocross
            assert bridge_lib.self_only(bridge).config == SELF
    elif n == 8 and cfg.center:  # centring changes what the branches decode
        uncentred = bridge_lib.Bridge(dataclasses.replace(cfg, center=False), bridge.params)
        assert not np.array_equal(
            coupled.tokens, engine.generate(tiny_lm, PROMPTS, sp(4), bridge=uncentred).tokens)


@pytest.mark.slow
@pytest.mark.multidevice
@BOTH
def test_sharded_equals_unsharded(tiny_lm, cfg, bridge, coupled):
    mesh = jax.make_mesh((1, 4), ("data", "branch"))
    sharded = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge, mesh=mesh)
    assert_same_tokens_up_to_ties(tiny_lm, coupled, sharded)


@pytest.mark.slow
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


@pytest.mark.slow
@BOTH
def test_teacher_forced_group_forward_equals_decode(tiny_lm, cfg, bridge, coupled):
    g = coupled
    assert any(r == "stop" for row in g.finish_reason for r in row)  # masking exercised
    for b in range(len(PROMPTS)):
        prompt = np.asarray(g.prompt_tokens[b], np.int32)
        padded = np.zeros(32, np.int32)
        padded[:len(prompt)] = prompt
        lp = bridge_train.group_logprobs(
            tiny_lm.config, tiny_lm.params, cfg, bridge.params, jnp.asarray(padded),
            jnp.int32(len(prompt)), jnp.asarray(g.tokens[b]), jnp.asarray(g.lengths[b]),
            stop_array(tiny_lm), tiny_lm.vocab_limit)
        np.testing.assert_allclose(lp, g.logprobs[b], atol=1e-4, rtol=0)


def supervised_batch(lm, g, width=32):
    """A training Batch of Generation g's branches, every advantage 1 (the SFT loss);
    prompts right-padded to `width`."""
    prompt = np.zeros((len(g.prompt_tokens), width), np.int32)
    for i, t in enumerate(g.prompt_tokens):
        prompt[i, :len(t)] = t
    return bridge_train.Batch(jnp.asarray(prompt), jnp.asarray([len(t) for t in g.prompt_tokens]),
                              jnp.asarray(g.tokens), jnp.asarray(g.lengths),
                              jnp.ones(g.lengths.shape, jnp.float32), stop_array(lm))


@pytest.mark.slow
def test_gradients_reach_only_trainable_bridge_params_and_sft_loss_decreases(tiny_lm):
    cfg = bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,))
    b = bridge_lib.init(tiny_lm, cfg)
    batch = supervised_batch(tiny_lm, engine.generate(tiny_lm, PROMPTS, sp(4)))
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

@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------
# What centring adds (BridgeConfig(center=True))


def test_config_round_trip_and_eps():
    assert bridge_lib.BridgeConfig.from_dict(CCFG.to_dict()) == CCFG
    old = {k: v for k, v in CCFG.to_dict().items() if k != "center"}  # a checkpoint before it
    assert bridge_lib.BridgeConfig.from_dict(old).center is False
    with pytest.raises(ValueError, match="norm_eps"):
        bridge_lib.BridgeConfig(center=True, norm_eps=0.0)


@pytest.mark.slow
@CENTER
def test_alone_or_identical_is_the_per_token_path_with_finite_gradients(tiny_lm, cfg, bridge):
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


@CENTER
def test_attention_ignores_a_shared_component(tiny_lm, cfg, bridge):
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


@pytest.mark.slow
@CENTER
def test_gradients_only_into_bridge_params_and_checkpoint(tiny_lm, cfg, coupled, tmp_path):
    one = dataclasses.replace(cfg, layers=(1,))  # the centred Bridge on layer 1 only
    b = nonzero(tiny_lm, one, scale=0.05)
    batch = supervised_batch(tiny_lm, coupled)
    grads = jax.grad(lambda p: bridge_train.pg_loss(p, tiny_lm.config, tiny_lm.params, one,
                                                    batch, tiny_lm.vocab_limit)[0])(b.params)
    for name in ("wq", "wk", "wv", "wo", "norm"):
        assert float(jnp.abs(grads[name][1]).max()) > 0, name  # q/k trained through centring
        np.testing.assert_array_equal(grads[name][0], 0)  # the unselected layer
    np.testing.assert_array_equal(grads["gate"], 0)
    # Checkpoint round trip keeps the option, and refuses the uncentred config.
    opt = bridge_train.make_optimizer(1e-3)
    state = bridge_train.init_state(b, opt)
    d = str(tmp_path / "ckpt")
    bridge_train.save(d, state, tiny_lm, one)
    back, meta = bridge_train.restore(d, bridge_train.init_state(b, opt), tiny_lm, one)
    assert meta["bridge_config"]["center"] is True
    for a, c in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="Bridge config"):
        bridge_train.restore(d, bridge_train.init_state(b, opt), tiny_lm,
                             dataclasses.replace(one, center=False))


@pytest.mark.slow
@CENTER
def test_diagnostics_run_on_a_centred_bridge(tiny_lm, cfg, bridge):
    from jaxsample.bridge_training import diagnostics as bridge_diagnostics
    from jaxsample.bridge_training import grpo as bridge_grpo

    batch, _, _ = bridge_grpo.rollout(tiny_lm, bridge, [bridge_train.Problem(p, "0") for p in PROMPTS],
                                      4, 3, 10, 1.0, chat=False, stop_token_ids=STOPS)
    d = bridge_diagnostics.diagnose(tiny_lm, bridge, batch)
    assert all(r > 0 for r in d["rel_norm"]) and all(0 < s < 1 for s in d["self_mass"])
    assert all(t > 0.01 for t in d["tv_from_uniform"])
    ablated = bridge_diagnostics.diagnose(tiny_lm, bridge_lib.self_only(bridge), batch)
    np.testing.assert_array_equal(ablated["tv_from_uniform"], 0.0)
