"""GRPO on the engine (`jaxsample.training`): rollouts, LoRA, the loss, the loop, resume.

Oracles: numpy's float64 log-softmax of the plain forward for the behaviour
log-probabilities at a temperature; the base model for an untrained adapter
(bit for bit) and the merged weights for the unmerged LoRA forward; the
formula written out in numpy for the loss; the uninterrupted run for a
resumed one; the first-order change of the objective for one update; the
engine's count of built programs for new weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import next_token_logprobs as reference
from paths import ROOT

import jaxsample
from jaxsample import SamplingParams, engine
from jaxsample.errors import InputError
from jaxsample.models.families import common
from jaxsample.training import checkpoints, grpo, lora
from jaxsample.training import rollout as ro

PROMPTS = ["Hello there, branch!", "ab", "xyz 123"]
LORA = lora.LoraConfig(rank=4, alpha=8.0, targets=("wq", "wv", "w_down"))


def nonzero_adapters(lm, cfg=LORA, seed=0):
    ad = lora.init(lm.params, cfg, jax.random.key(seed))
    return jax.tree_util.tree_map(
        lambda a: a + 0.05 * jax.random.normal(jax.random.key(seed + 1), a.shape), ad)


# ---------------------------------------------------------------------------
# LoRA


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["stacked", "list"])
def test_untrained_adapter_is_the_base_and_apply_equals_merge(tiny_lm, layout):
    lm = tiny_lm if layout == "stacked" else dataclasses.replace(
        tiny_lm, params=common.unstack_layers(tiny_lm.params))
    toks = np.random.RandomState(0).randint(0, 258, (2, 24)).astype(np.int32)
    base = jaxsample.token_logprobs(lm, lm.params, toks)
    zero = lora.init(lm.params, LORA, jax.random.key(0))
    for a, b in zip(jax.tree_util.tree_leaves(lora.merge(lm.params, zero, LORA)),
                    jax.tree_util.tree_leaves(lm.params)):
        np.testing.assert_array_equal(a, b)
    # Unmerged: x @ W plus an exact zero, in another program (XLA may round x @ W differently).
    np.testing.assert_allclose(
        jaxsample.token_logprobs(lm, lora.apply(lm.params, zero, LORA), toks), base, atol=1e-5)
    ad = nonzero_adapters(lm)
    merged = jaxsample.token_logprobs(lm, lora.merge(lm.params, ad, LORA), toks)
    unmerged = jaxsample.token_logprobs(lm, lora.apply(lm.params, ad, LORA), toks)
    assert np.abs(np.asarray(merged) - np.asarray(base)).max() > 1e-2  # the adapter acts
    np.testing.assert_allclose(unmerged, merged, atol=1e-5, rtol=0)
    assert lora.num_params(ad) == 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))


@pytest.mark.slow
def test_lora_gradients_reach_only_the_adapters(tiny_lm):
    toks = np.random.RandomState(1).randint(0, 258, (2, 16)).astype(np.int32)
    zero = lora.init(tiny_lm.params, LORA, jax.random.key(0))
    g = jax.grad(lambda ad: jaxsample.token_logprobs(
        tiny_lm, lora.apply(tiny_lm.params, ad, LORA), toks).sum())(zero)
    layers = g["layers"]
    assert set(layers) == set(LORA.targets)
    for name in LORA.targets:  # B = 0: A gets no gradient yet, B does
        np.testing.assert_array_equal(layers[name]["a"], 0.0)
        assert np.abs(np.asarray(layers[name]["b"])).max() > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank"), (dict(alpha=0.0), "alpha"), (dict(targets=("wz",)), "targets"),
    (dict(targets=()), "targets"), (dict(targets=("wq", "wq")), "targets")])
def test_lora_config_errors(kwargs, match):
    with pytest.raises(InputError, match=match):
        lora.LoraConfig(**kwargs)


@pytest.mark.slow
def test_lora_refuses_expert_weights():
    from jaxsample.models.families import llama

    cfg = llama.LlamaConfig(vocab_size=64, dim=8, n_layers=1, n_heads=2, n_kv_heads=1,
                            head_dim=4, ffn_dim=8, n_experts=4, n_experts_per_tok=2)
    params = llama.init_params(cfg, jax.random.key(0))
    with pytest.raises(InputError, match="MoE experts"):
        lora.init(params, lora.LoraConfig(targets=("w_up",)), jax.random.key(0))
    lora.init(params, lora.LoraConfig(targets=("wq", "wo")), jax.random.key(0))


# ---------------------------------------------------------------------------
# Rollouts


def test_pack_places_each_completion_after_its_prompt():
    prompt = jnp.asarray([[5, 6, 7, 0], [8, 0, 0, 0]], jnp.int32)
    comp = jnp.asarray([[[1, 2, 3], [4, 9, 9]], [[7, 7, 7], [2, 3, 9]]], jnp.int32)
    got = ro.pack(prompt, jnp.asarray([3, 1]), comp, jnp.asarray([[3, 1], [0, 2]]))
    want = [[[5, 6, 7, 1, 2, 3, 0], [5, 6, 7, 4, 0, 0, 0]],
            [[8, 0, 0, 0, 0, 0, 0], [8, 2, 3, 0, 0, 0, 0]]]
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_behaviour_logprobs_are_the_sampling_distributions(tiny_lm, temperature):
    sp = SamplingParams(temperature=temperature, max_tokens=12, seed=4)
    r = ro.rollout(tiny_lm, tiny_lm.params, PROMPTS, 3, sp)
    b, gen = r.batch, r.generation
    assert b.completions.shape[:2] == (3, 3) and r.texts == gen.texts
    np.testing.assert_array_equal(b.prompt_len, [len(t) for t in gen.prompt_tokens])
    mask = np.asarray(ro.completion_mask(b))
    if temperature == 1.0:  # the sampler's own numbers
        np.testing.assert_array_equal(b.behaviour, gen.logprobs)
    for i in range(3):
        for n in range(3):
            L = int(gen.lengths[i, n])
            seq = np.asarray(list(gen.prompt_tokens[i]) + list(gen.tokens[i, n, :L]))[None]
            want = reference(tiny_lm, seq, temperature)[0, len(gen.prompt_tokens[i]):]
            np.testing.assert_allclose(np.asarray(b.behaviour)[i, n, :L], want, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(b.behaviour)[~mask], 0.0)


@pytest.mark.slow
def test_rollout_with_new_weights_builds_no_program(tiny_lm):
    sp = SamplingParams(max_tokens=8, seed=0)
    ro.rollout(tiny_lm, tiny_lm.params, PROMPTS[:2], 2, sp)
    built = engine.PROGRAMS.compilations
    other = jax.tree_util.tree_map(lambda a: a * 1.01, tiny_lm.params)
    r = ro.rollout(tiny_lm, other, PROMPTS[:2], 2, sp)
    assert engine.PROGRAMS.compilations == built
    again = jaxsample.generate(dataclasses.replace(tiny_lm, params=other), PROMPTS[:2],
                               sp.replace(n=2))
    np.testing.assert_array_equal(r.batch.completions, again.tokens)


@pytest.mark.slow
def test_rollout_through_the_engine_object_takes_new_weights_in_place(tiny_lm):
    """An `LLM` engine: the rollout hands it the weights (`update_weights`), builds no
    program, and samples what the bare model with those weights samples."""
    llm = jaxsample.LLM(tiny_lm, compilation_cache=False)
    sp = SamplingParams(max_tokens=8, seed=0, temperature=0.7)
    ro.rollout(llm, tiny_lm.params, PROMPTS[:2], 2, sp)
    built = engine.PROGRAMS.compilations
    other = jax.tree_util.tree_map(lambda a: a * 1.01, tiny_lm.params)
    r = ro.rollout(llm, other, PROMPTS[:2], 2, sp)
    assert engine.PROGRAMS.compilations == built and llm.params is other
    bare = ro.rollout(tiny_lm, other, PROMPTS[:2], 2, sp)
    np.testing.assert_array_equal(r.batch.completions, bare.batch.completions)
    np.testing.assert_array_equal(r.batch.behaviour, bare.batch.behaviour)


@pytest.mark.parametrize("changes, match", [
    (dict(top_k=5), "top_k=5"), (dict(top_p=0.9), "top_p"), (dict(min_p=0.1), "min_p"),
    (dict(repetition_penalty=1.2), "repetition_penalty"), (dict(temperature=0.0), "temperature")])
def test_rollout_refuses_what_its_logprobs_cannot_report(tiny_lm, changes, match):
    with pytest.raises(InputError, match=match):
        ro.rollout(tiny_lm, tiny_lm.params, PROMPTS, 2, SamplingParams(**changes))
    with pytest.raises(InputError, match="group_size"):
        ro.rollout(tiny_lm, tiny_lm.params, PROMPTS, 0, SamplingParams())


# ---------------------------------------------------------------------------
# Advantages and the loss


def test_group_advantages():
    r = np.asarray([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 3]], np.float32)
    a = grpo.group_advantages(r)
    np.testing.assert_allclose(a[0], [1, -1, 1, -1], rtol=1e-5)
    np.testing.assert_array_equal(a[1], 0.0)
    np.testing.assert_allclose(a[2], np.array([-1, -1, -1, 3]) / np.sqrt(3), rtol=1e-5)
    np.testing.assert_allclose(grpo.group_advantages(r, scale=False)[2], [-.75, -.75, -.75, 2.25])
    with pytest.raises(InputError, match=r"\[B, N\]"):
        grpo.group_advantages(r[0])


def _loss_batch(seed=0):
    rng = np.random.RandomState(seed)
    B, N, T = 2, 3, 5
    lengths = rng.randint(1, T + 1, (B, N)).astype(np.int32)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    batch = ro.Batch(prompt=jnp.zeros((B, 4), jnp.int32), prompt_len=jnp.ones((B,), jnp.int32),
                     completions=jnp.zeros((B, N, T), jnp.int32), lengths=jnp.asarray(lengths),
                     advantages=f(B, N), stop_ids=jnp.full((4,), -1, jnp.int32),
                     behaviour=f(B, N, T) * 0.3 - 2, reference=f(B, N, T) * 0.3 - 2)
    return batch, f(B, N, T) * 0.3 - 2


@pytest.mark.slow
def test_grpo_loss_is_the_formula():
    batch, lp = _loss_batch()
    eps, beta = 0.2, 0.05
    loss, m = grpo.grpo_loss(lp, batch, clip_eps=eps, kl_coef=beta)
    x = {k: np.asarray(getattr(batch, k), np.float64) for k in ("advantages", "behaviour",
                                                                "reference")}
    lpn = np.asarray(lp, np.float64)
    mask = np.arange(5) < np.asarray(batch.lengths)[..., None]
    ratio = np.exp(lpn - x["behaviour"])
    A = x["advantages"][..., None]
    obj = np.minimum(ratio * A, np.clip(ratio, 1 - eps, 1 + eps) * A)
    d = x["reference"] - lpn
    want = (-(obj * mask).sum() + beta * ((np.exp(d) - d - 1) * mask).sum()) / mask.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert int(m["tokens"]) == mask.sum()
    np.testing.assert_allclose(float(m["clip_fraction"]),
                               ((np.abs(ratio - 1) > eps) & mask).sum() / mask.sum())
    # Ratio exactly 1: -sum A lp / tokens, the gradient of the clipped loss at lp = behaviour.
    on, _ = grpo.grpo_loss(lp, batch, importance_ratio=False)
    np.testing.assert_allclose(float(on), -(A * lpn * mask).sum() / mask.sum(), rtol=1e-5)
    at = batch._replace(behaviour=lp)
    g_clip = jax.grad(lambda q: grpo.grpo_loss(q, at)[0])(lp)
    g_one = jax.grad(lambda q: grpo.grpo_loss(q, at, importance_ratio=False)[0])(lp)
    np.testing.assert_allclose(g_clip, g_one, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=-1), "steps"), (dict(group_size=0), "group_size"),
    (dict(temperature=0.0), "temperature"), (dict(clip_eps=0.0), "clip_eps"),
    (dict(kl_coef=-1.0), "kl_coef"), (dict(learning_rate=float("inf")), "learning_rate"),
    (dict(importance_ratio=False, updates_per_batch=2), "updates_per_batch")])
def test_config_errors(kwargs, match):
    with pytest.raises(InputError, match=match):
        grpo.GRPOConfig(**{"steps": 1, **kwargs})


# ---------------------------------------------------------------------------
# The loop


def _reward(problem, text):  # prefers completions holding "e": some groups vary
    return float("e" in text)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_one_update_raises_the_rewarded_completions(tiny_lm, kind):
    """Adam's first step moves every parameter by about -lr * sign(gradient), so the
    objective sum A * log pi changes by about lr * sum |gradient| > 0."""
    policy = (grpo.lora_policy(tiny_lm, LORA) if kind == "lora" else grpo.full_policy(tiny_lm))
    r = policy.sample(policy.params, PROMPTS, 4, SamplingParams(max_tokens=10, seed=2), False)
    adv = np.tile(np.asarray([1.0, -1.0, 0.5, -0.5], np.float32), (len(PROMPTS), 1))
    batch = r.batch._replace(advantages=jnp.asarray(adv))
    opt = grpo.make_optimizer(1e-3)
    state = checkpoints.TrainState(jnp.zeros((), jnp.int32), policy.params,
                                   opt.init(policy.params))

    def objective(params):
        lp = policy.logprobs(params, policy.frozen, batch, 1.0)
        return float(jnp.sum(batch.advantages[..., None] * lp))

    new, m = grpo.update(policy, opt, state, batch)
    assert int(new.step) == 1 and float(m["max_abs_log_ratio"]) < 1e-4  # on-policy: ratio ~ 1
    assert objective(new.params) > objective(policy.params)


@pytest.mark.slow
def test_lora_grpo_resumes_as_the_uninterrupted_run(tiny_lm, tmp_path):
    """Three steps with a temperature (behaviour recomputed), the KL term and two updates
    per batch; interrupted after step 1 and resumed: the same state bit for bit."""
    config = grpo.GRPOConfig(steps=3, prompts_per_step=2, group_size=4, max_tokens=10,
                             temperature=0.8, learning_rate=3e-3, kl_coef=0.1,
                             updates_per_batch=2, seed=7, save_every=100, prompt_cap=32)
    run = lambda **kw: grpo.train(grpo.lora_policy(tiny_lm, LORA), PROMPTS, config,  # noqa
                                  reward=_reward, log=None, **kw)
    params, st_full, hist = run()
    assert int(st_full.step) == 3 and [h["step"] for h in hist] == [1, 2, 3]
    assert any(not h["skipped"] for h in hist)
    assert all(h["rollout_s"] > 0 and h["update_s"] >= 0 for h in hist)
    d = str(tmp_path / "ckpt")
    _, st_half, _ = run(ckpt_dir=d, stop_after=1)
    assert checkpoints.latest_step(d) == 1
    _, st_res, hist_res = run(ckpt_dir=d)
    assert [h["step"] for h in hist_res] == [2, 3]
    assert [h["loss"] for h in hist_res] == [h["loss"] for h in hist[1:]]
    for a, b in zip(jax.tree_util.tree_leaves(st_full), jax.tree_util.tree_leaves(st_res)):
        np.testing.assert_array_equal(a, b)
    other = lora.LoraConfig(rank=2, targets=("wq",))
    with pytest.raises(ValueError, match="adapter"):
        grpo.train(grpo.lora_policy(tiny_lm, other), PROMPTS, config, reward=_reward, log=None,
                   ckpt_dir=d)


def test_train_argument_errors(tiny_lm):
    config = grpo.GRPOConfig(steps=1, prompts_per_step=2)
    policy = grpo.full_policy(tiny_lm)
    with pytest.raises(InputError, match="exactly one"):
        grpo.train(policy, PROMPTS, config, log=None)
    with pytest.raises(InputError, match="prompts_per_step"):
        grpo.train(policy, PROMPTS[:1], config, reward=_reward, log=None)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_benchmark_runs_at_tiny_sizes(tmp_path):
    """`python -m benchmarks.grpo --tiny`: two steps, both evaluations, the rollout
    comparison, the JSON and the reward curve."""
    import json
    import subprocess
    import sys

    out = tmp_path / "grpo.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.grpo", "--tiny", "--out", str(out)],
                         cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [h["step"] for h in report["history"]] == [1, 2]
    assert {"rollout_s", "logprobs_s", "update_s", "reward"} <= set(report["history"][0])
    assert 0 <= report["before"]["pass@1"] <= 1 and 0 <= report["after"]["pass@1"] <= 1
    assert len(report["before"]["per_problem"]) == 8
    assert [r["G"] for r in report["rollout_compare"]] == [4, 4]
    assert (tmp_path / "grpo_reward.png").stat().st_size > 0
