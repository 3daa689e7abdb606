"""The Bridge recipe (arXiv 2510.01143): the MLP control, the shared-prefix training forward,
the SFT warm-up, the coordination reward and the diagnostics, on the tiny model.

Oracles: the engine without a Bridge (zero init), the plain N-copy group forward
(`bridge_train.group_forward`) for the shared-prefix one, the uninterrupted run
for a resumed one, hand-counted rewards, and the self-only block for attention mass.
"""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BRIDGE_PROMPTS, STOPS, nonzero
from ties import assert_same_tokens_up_to_ties

from jaxsample import SamplingParams, engine
from jaxsample import bridge as bridge_lib
from jaxsample.bridge_training import common as bridge_train
from jaxsample.bridge_training import coord_tasks as bridge_coord_tasks
from jaxsample.bridge_training import diagnostics as bridge_diagnostics
from jaxsample.bridge_training import grpo as bridge_grpo
from jaxsample.bridge_training import sft as bridge_sft
from jaxsample.models.families import llama

ATT = bridge_lib.BridgeConfig(dim=8, n_heads=2)
MLP = bridge_lib.BridgeConfig(dim=8, n_heads=2, kind="mlp")
PROMPTS = BRIDGE_PROMPTS


def sp(n):
    return helpers.sp(n, max_new_tokens=10)


def sampled_batch(lm, bridge, n=4):
    batch, _, gen = bridge_grpo.rollout(lm, bridge, [bridge_train.Problem(p, "0") for p in PROMPTS],
                                        n, 3, 10, 1.0, chat=False, stop_token_ids=STOPS)
    return batch._replace(advantages=jnp.ones_like(batch.advantages)), gen


# ---------------------------------------------------------------------------
# The MLP control


def test_mlp_param_count_equals_bridge():
    class Smol:
        config = llama.LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9,
                                   n_kv_heads=3, head_dim=64, ffn_dim=1536)

    for d, layers in ((64, None), (8, (1, 3)), (24, (0,))):
        a = bridge_lib.BridgeConfig(dim=d, n_heads=2, layers=layers)
        m = bridge_lib.BridgeConfig(dim=d, n_heads=2, layers=layers, kind="mlp")
        pa = jax.eval_shape(lambda: bridge_lib.init(Smol, a).params)
        pm = jax.eval_shape(lambda: bridge_lib.init(Smol, m).params)
        ca = bridge_lib.param_count(bridge_lib.Bridge(a, pa))
        cm = bridge_lib.param_count(bridge_lib.Bridge(m, pm))
        n_sel = 30 if layers is None else len(layers)
        assert ca == cm == n_sel * (576 + 4 * 576 * d)
    with pytest.raises(ValueError, match="kind"):
        bridge_lib.BridgeConfig(kind="conv")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [ATT, MLP], ids=["bridge", "mlp"])
def test_zero_init_is_exactly_the_base_model(tiny_lm, cfg):
    base = engine.generate(tiny_lm, PROMPTS, sp(4))
    zero = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=bridge_lib.init(tiny_lm, cfg))
    np.testing.assert_array_equal(zero.tokens, base.tokens)
    np.testing.assert_array_equal(zero.logprobs, base.logprobs)
    # zeros_like_output undoes a trained-looking one
    back = engine.generate(tiny_lm, PROMPTS, sp(4),
                           bridge=bridge_lib.zeros_like_output(nonzero(tiny_lm, cfg)))
    np.testing.assert_array_equal(back.tokens, base.tokens)


@pytest.mark.slow
@pytest.mark.multidevice
def test_mlp_is_per_token_width_agnostic_and_shardable(tiny_lm):
    m = nonzero(tiny_lm, MLP)
    g4 = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=m)
    assert not np.array_equal(g4.tokens, engine.generate(tiny_lm, PROMPTS, sp(4)).tokens)
    for n in (1, 8):
        g = engine.generate(tiny_lm, PROMPTS, sp(n), bridge=m)
        assert g.tokens.shape == (2, n, 10) and np.all(np.isfinite(g.logprobs))
    sharded = engine.generate(tiny_lm, PROMPTS, sp(4), bridge=m,
                              mesh=jax.make_mesh((1, 4), ("data", "branch")))
    assert_same_tokens_up_to_ties(tiny_lm, g4, sharded)
    # No cross-branch signal: the per-branch teacher-forced logprobs of a group equal
    # those of each branch alone.
    batch, gen = sampled_batch(tiny_lm, m)
    lp = jax.vmap(lambda p, pl, c, n: bridge_train.group_logprobs(
        tiny_lm.config, tiny_lm.params, MLP, m.params, p, pl, c, n, batch.stop_ids,
        tiny_lm.vocab_limit))(batch.prompt, batch.prompt_len, batch.completions, batch.lengths)
    alone = bridge_train.group_logprobs(tiny_lm.config, tiny_lm.params, MLP, m.params,
                                        batch.prompt[0], batch.prompt_len[0],
                                        batch.completions[0, 2:3], batch.lengths[0, 2:3],
                                        batch.stop_ids, tiny_lm.vocab_limit)
    np.testing.assert_allclose(lp[0, 2:3], alone, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,)),
                                 bridge_lib.BridgeConfig(dim=8, n_heads=2, layers=(1,),
                                                         kind="mlp")], ids=["bridge", "mlp"])
def test_gradients_only_into_adapter_params(tiny_lm, cfg):
    b = bridge_lib.init(tiny_lm, cfg)
    batch, _ = sampled_batch(tiny_lm, None)
    grads = jax.grad(lambda p: bridge_train.pg_loss(p, tiny_lm.config, tiny_lm.params, cfg,
                                                    batch, tiny_lm.vocab_limit)[0])(b.params)
    assert set(grads) == set(cfg.param_names) | {"gate"}
    assert float(jnp.abs(grads[cfg.out_name][1]).max()) > 0
    for g in grads.values():
        np.testing.assert_array_equal(g[0], 0)  # unselected layer
    np.testing.assert_array_equal(grads["gate"], 0)


# ---------------------------------------------------------------------------
# The shared-prefix training forward


@pytest.mark.slow
def test_shared_prefix_forward_equals_full_group_forward(tiny_lm):
    b = nonzero(tiny_lm, ATT)
    batch, gen = sampled_batch(tiny_lm, b)
    cfg = tiny_lm.config
    for g in range(2):
        P = int(batch.prompt_len[g])
        comp, lens = batch.completions[g], batch.lengths[g]
        alive = bridge_train.completion_alive(comp, lens, batch.stop_ids)
        hp, hc = bridge_train.shared_prefix_forward(cfg, tiny_lm.params, ATT, b.params,
                                                    batch.prompt[g], batch.prompt_len[g], comp,
                                                    alive)
        N, T = comp.shape
        toks = jnp.concatenate([jnp.tile(batch.prompt[g][:P], (N, 1)), comp], axis=1)
        al = jnp.concatenate([jnp.ones((N, P), bool), alive], axis=1)
        full, _ = bridge_train.group_forward(cfg, tiny_lm.params, ATT, b.params, toks, al)
        # float32, other matmul shapes and a log-sum-exp merge against one softmax:
        # rounding ~1e-6 of the hidden states' scale (~12 here); a wrong mask or
        # position moves them by O(1).
        tol = 1e-5 * float(np.abs(full).max())
        np.testing.assert_allclose(hc, full[:, P:], atol=tol, rtol=0)
        np.testing.assert_allclose(hp[:P], full[0, :P], atol=tol, rtol=0)


# ---------------------------------------------------------------------------
# SFT warm-up


def test_filter_groups_drops_wrong_and_singletons():
    keep = np.array([[1, 0, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]], bool)
    assert bridge_sft.filter_groups(keep, 8) == [(0, [0, 2, 3]), (3, [0, 1, 2, 3])]
    assert bridge_sft.filter_groups(keep, 2) == [(0, [0, 2]), (3, [0, 1])]
    with pytest.raises(ValueError, match="max_group"):
        bridge_sft.filter_groups(keep, 1)


@pytest.mark.slow
def test_sft_collect_keeps_only_correct_groups_and_resumes(tiny_lm, tmp_path):
    problems = [bridge_train.Problem(p, "0") for p in PROMPTS * 2]
    # "Correct" = the sample's first byte is even: a deterministic, varied keep rule.
    keep_fn = lambda texts, p: [len(t) > 0 and ord(t[0]) % 2 == 0 for t in texts]
    data = bridge_sft.collect(tiny_lm, problems, n=6, max_group=4, seed=1, max_new_tokens=10,
                              temperature=1.0, stop_token_ids=STOPS, keep_fn=keep_fn)
    gen = [engine.generate(tiny_lm, [p.prompt for p in problems],
                           SamplingParams(n=6, temperature=1.0, max_new_tokens=10, seed=1,
                                          stop_token_ids=STOPS))]
    keep = np.array([keep_fn(row, None) for row in gen[0].texts])
    expect = bridge_sft.filter_groups(keep, 4)
    assert list(data.problem_index) == [g for g, _ in expect] and len(expect) >= 1
    for i, (g, idx) in enumerate(expect):
        k = len(idx)
        assert data.kept[i] == k
        np.testing.assert_array_equal(data.batch.completions[i, :k], gen[0].tokens[g][idx])
        np.testing.assert_array_equal(data.batch.lengths[i, k:], 0)  # padding: never a key
        np.testing.assert_array_equal(data.batch.advantages[i], np.arange(4) < k)
    # Train, interrupt, resume: the same as uninterrupted; gates fixed, W_O moved.
    b0 = bridge_lib.init(tiny_lm, ATT)
    kw = dict(steps=3, groups=2, learning_rate=3e-2, seed=2, log=None, save_every=100)
    full, st_full, _ = bridge_sft.train_sft(tiny_lm, b0, data, **kw)
    assert float(jnp.abs(full.params["wo"]).max()) > 0
    np.testing.assert_array_equal(full.params["gate"], b0.params["gate"])
    d = str(tmp_path / "sft")
    bridge_sft.train_sft(tiny_lm, b0, data, ckpt_dir=d, stop_after=1, **kw)
    opt = bridge_train.make_optimizer(3e-2)
    back, _ = bridge_train.restore(d, bridge_train.init_state(b0, opt), tiny_lm, ATT)
    assert int(back.step) == 1
    _, st_res, hist = bridge_sft.train_sft(tiny_lm, b0, data, ckpt_dir=d, **kw)
    assert [h["step"] for h in hist] == [2, 3]
    for a, c in zip(jax.tree_util.tree_leaves(st_full), jax.tree_util.tree_leaves(st_res)):
        np.testing.assert_array_equal(a, c)
    again = bridge_sft.load_data(str(tmp_path / "sft" / "sft_data.npz"))
    np.testing.assert_array_equal(again.batch.completions, data.batch.completions)


@pytest.mark.slow
def test_mlp_control_grpo_checkpoint_round_trip(tiny_lm, tmp_path):
    problems = [bridge_train.Problem(p, "0") for p in PROMPTS]
    kw = dict(steps=2, n=4, groups=1, max_new_tokens=10, learning_rate=3e-2, seed=5,
              chat=False, stop_token_ids=STOPS, log=None, save_every=100,
              group_reward_fn=lambda texts, p: bridge_grpo.distinct_rewards(
                  [t[:1] or None for t in texts]))
    m0 = bridge_lib.init(tiny_lm, MLP)
    full, st_full, hist = bridge_grpo.train(tiny_lm, m0, problems, **kw)
    d = str(tmp_path / "rl")
    bridge_grpo.train(tiny_lm, m0, problems, ckpt_dir=d, stop_after=1, **kw)
    _, st_res, _ = bridge_grpo.train(tiny_lm, m0, problems, ckpt_dir=d, **kw)
    for a, c in zip(jax.tree_util.tree_leaves(st_full), jax.tree_util.tree_leaves(st_res)):
        np.testing.assert_array_equal(a, c)
    with pytest.raises(ValueError, match="Bridge config"):
        bridge_train.restore(d, bridge_train.init_state(m0, bridge_train.make_optimizer(3e-2)),
                             tiny_lm, ATT)


# ---------------------------------------------------------------------------
# The coordination task and its reward


def test_distinct_rewards_and_count():
    r = bridge_grpo.distinct_rewards([frozenset("ab"), frozenset("ba"), None, frozenset("ac"),
                                      frozenset("ad")])
    np.testing.assert_array_equal(r, [0, 0, 0, 1, 1])  # {a,b} twice: both lose; None: wrong
    assert bridge_grpo.distinct_correct([frozenset("ab"), frozenset("ba"), None,
                                         frozenset("ac")]) == 2
    np.testing.assert_array_equal(bridge_grpo.distinct_rewards([None, None]), [0, 0])
    np.testing.assert_array_equal(bridge_grpo.distinct_rewards(["x"]), [1])


def test_coordination_parse_and_problems():
    p = bridge_train.Problem("…", "red,blue,green,gold")
    parse = bridge_coord_tasks.parse
    assert parse(" red and blue\nQ: more", p) == frozenset({"red", "blue"})
    assert parse(" Blue, red.", p) == parse(" red and blue", p)  # unordered, case-free
    for bad in (" red and red", " red and pink", " red", " red, blue and green", ""):
        assert parse(bad, p) is None, bad
    group = [" red and blue", " blue and red", " gold and green", " red and pink"]
    np.testing.assert_array_equal(
        bridge_grpo.distinct_rewards([parse(t, p) for t in group]), [0, 0, 1, 0])
    train = bridge_coord_tasks.make_problems("train", 40)
    test = bridge_coord_tasks.make_problems("test", 40)
    assert len({q.prompt for q in train} | {q.prompt for q in test}) == 80
    assert train == bridge_coord_tasks.make_problems("train", 40)
    for q in train:
        items = bridge_coord_tasks.options(q)
        assert len(set(items)) == len(items) >= 4 and all(i in q.prompt for i in items)


# ---------------------------------------------------------------------------
# Diagnostics


@pytest.mark.slow
def test_diagnostics_norms_and_attention_mass(tiny_lm):
    b = nonzero(tiny_lm, ATT)
    batch, _ = sampled_batch(tiny_lm, b)
    zero = bridge_diagnostics.diagnose(tiny_lm, bridge_lib.init(tiny_lm, ATT), batch)
    assert zero["rel_norm"] == [0.0, 0.0] and zero["out_max_abs"] == [0.0, 0.0]
    d = bridge_diagnostics.diagnose(tiny_lm, b, batch)
    assert all(r > 0 for r in d["rel_norm"]) and d["positions"] > 0
    assert all(0 < s < 1 for s in d["self_mass"])
    assert 0.25 <= d["uniform_self_mass"] <= 0.5  # 2 to 4 branches alive
    ablated = bridge_diagnostics.diagnose(tiny_lm, bridge_lib.self_only(b), batch)
    np.testing.assert_allclose(ablated["self_mass"], 1.0, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ablated["tv_from_uniform"], 0.0)
    assert all(0 < t < 1 for t in d["tv_from_uniform"])
    mlp = bridge_diagnostics.diagnose(tiny_lm, nonzero(tiny_lm, MLP), batch)
    assert mlp["self_mass"] == [1.0, 1.0] and all(r > 0 for r in mlp["rel_norm"])
    with pytest.raises(ValueError, match="attention"):
        bridge_lib.self_only(nonzero(tiny_lm, MLP))
    # Relative norm by hand at one layer-0 position: |gate * y| / |h|.
    x = jax.random.normal(jax.random.key(0), (3, 2, tiny_lm.config.dim))
    p0 = jax.tree_util.tree_map(lambda a: a[0], b.params)
    f = jax.vmap(lambda xx: bridge_lib.block_stats(ATT, p0, xx, True, ("branch",)),
                 axis_name="branch")
    new, rel, _, _ = f(x)
    np.testing.assert_allclose(rel, np.linalg.norm(new - x, axis=-1) / np.linalg.norm(x, axis=-1),
                               rtol=1e-5)
