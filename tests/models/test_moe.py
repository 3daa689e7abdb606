"""Sparse mixture of experts (models/families/moe.py; Mixtral through the Llama family).

Oracles: a numpy float64 routing and expert mix; transformers' logits,
router logits and greedy tokens on the tiny random checkpoints written by
scripts/make_moe_references.py (read from tests/data, no torch here); the
full forward for the cached decode; naive == shared and sharded ==
unsharded through the tie oracle (tests/ties.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import DATA
from ties import assert_same_tokens_up_to_ties

from jaxsample import cost, engine
from jaxsample.engine.naive import naive_generate
from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.loading import load
from jaxsample.models.families import llama, moe
from jaxsample.sampling_params import SamplingParams

REF = np.load(DATA / "tiny_moe_reference.npz")
REL = 1e-4  # float32 logits against transformers, relative to the row's max |logit|


@pytest.fixture(scope="module")
def mixtral():
    return load(DATA / "tiny_mixtral")


def prompts():
    p = [int(t) for t in REF["prompt"]]
    return [p, p[3:] + [7, 8]]


# ---------------------------------------------------------------------------
# Routing against a numpy oracle


def np_route(logits, k, norm):
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    if norm:
        w = w / w.sum(-1, keepdims=True)
    return w, idx


def logits_with_margins(rng, T, X, k, margin=1e-2):
    """Random router logits whose k-th and (k+1)-th largest (and all top-k) differ by >= margin."""
    out = []
    while len(out) < T:
        row = rng.normal(size=X) * 2
        s = np.sort(row)[::-1]
        if np.min(np.diff(-s[:k + 1]), initial=np.inf) >= margin:
            out.append(row)
    return np.array(out, np.float32)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("X,k", [(8, 2), (8, 1), (6, 3), (4, 4)])
def test_route_matches_numpy(norm, X, k):
    logits = logits_with_margins(np.random.default_rng(X * 10 + k), 64, X, k)
    w, idx = moe.route(jnp.asarray(logits), k, norm)
    ref_w, ref_idx = np_route(logits, k, norm)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-6, atol=1e-7)
    if norm:
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


def test_mixtral_gate_is_softmax_over_the_top_k_logits():
    """transformers' MixtralTopKRouter (softmax over all X, top k, renormalise) equals the
    paper's softmax over the top-k logits."""
    logits = logits_with_margins(np.random.default_rng(0), 64, 8, 2)
    w, idx = moe.route(jnp.asarray(logits), 2, True)
    top = np.take_along_axis(logits.astype(np.float64), np.asarray(idx), -1)
    paper = np.exp(top - top.max(-1, keepdims=True))
    paper /= paper.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(w), paper, rtol=1e-6)


def test_qwen3_moe_gate_without_norm_is_the_raw_probabilities():
    logits = logits_with_margins(np.random.default_rng(1), 16, 8, 2)
    w, _ = moe.route(jnp.asarray(logits), 2, False)
    assert np.all(np.asarray(w).sum(-1) < 1.0)  # top 2 of 8 never hold all the mass


def test_exact_router_ties_go_to_the_lower_expert():
    w, idx = moe.route(jnp.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]), 2, True)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2], [0, 1]])
    np.testing.assert_allclose(np.asarray(w), 0.5)


# ---------------------------------------------------------------------------
# Expert compute: four implementations against a numpy oracle


def random_layer(key, E=16, F=24, X=8, scale=0.3):
    ks = jax.random.split(key, 4)
    return {"router": jax.random.normal(ks[0], (E, X)),
            "w_gate": scale * jax.random.normal(ks[1], (X, E, F)),
            "w_up": scale * jax.random.normal(ks[2], (X, E, F)),
            "w_down": scale * jax.random.normal(ks[3], (X, F, E))}


def np_moe(lp, h, k, norm):
    lp = {n: np.asarray(a, np.float64) for n, a in lp.items()}
    h = np.asarray(h, np.float64)
    w, idx = np_route(h @ lp["router"], k, norm)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            x = idx[t, j]
            g = h[t] @ lp["w_gate"][x]
            a = g / (1 + np.exp(-g)) * (h[t] @ lp["w_up"][x])
            out[t] += w[t, j] * (a @ lp["w_down"][x])
    return out


def inputs_with_router_margins(lp, T, k, seed, margin=1e-2):
    """Activations whose router logits keep the top-k set clear of float rounding."""
    rng = np.random.default_rng(seed)
    rows = []
    router = np.asarray(lp["router"], np.float64)
    while len(rows) < T:
        h = rng.normal(size=router.shape[0])
        s = np.sort(h @ router)[::-1]
        if s[k - 1] - s[k] >= margin:
            rows.append(h)
    return jnp.asarray(np.array(rows, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["loop", "gather", "sorted", "dense", "auto"])
@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("norm", [True, False])
def test_expert_mix_matches_numpy(impl, T, norm):
    lp = random_layer(jax.random.key(T))
    h = inputs_with_router_margins(lp, T, 2, seed=T)
    got = moe.moe_ffn(lp, h, k=2, norm_topk=norm, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np_moe(lp, h, 2, norm), rtol=1e-5, atol=1e-5)


def test_bad_impl_is_refused():
    lp = random_layer(jax.random.key(0))
    with pytest.raises(ValueError, match="impl must be one of"):
        moe.moe_ffn(lp, jnp.zeros((1, 16)), k=2, norm_topk=True, impl="fast")


@pytest.mark.slow
def test_vmaps_fold_into_one_call_over_all_tokens():
    """Under vmap over rows and branches (the decode step's layout) the experts run
    once on all R*N*S tokens (the custom_vmap rule), with the per-token numbers."""
    lp = random_layer(jax.random.key(1))
    R, N, S = 2, 4, 3
    h = inputs_with_router_margins(lp, R * N * S, 2, seed=7).reshape(R, N, S, -1)
    f = lambda x: moe.moe_ffn(lp, x, k=2, norm_topk=True)  # noqa: E731
    nested = jax.vmap(jax.vmap(f, axis_name="branch"))
    jaxpr = str(jax.make_jaxpr(nested)(h))
    assert f"f32[{R * N * S},16]" in jaxpr and "custom_vmap_call" in jaxpr
    ref = np_moe(lp, h.reshape(R * N * S, -1), 2, True).reshape(h.shape)
    np.testing.assert_allclose(np.asarray(jax.jit(nested)(h)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_reverse_mode_through_the_batched_ffn():
    """Bridge training differentiates through the base model: the custom_vjp's backward
    (the dense formula's) equals the gradient of the plain per-token formula."""
    lp = random_layer(jax.random.key(2))
    h = inputs_with_router_margins(lp, 12, 2, seed=3).reshape(3, 4, -1)
    batched = lambda h: jnp.sum(jnp.sin(jax.vmap(  # noqa: E731
        lambda x: moe.moe_ffn(lp, x, k=2, norm_topk=True))(h)))
    plain = lambda h: jnp.sum(jnp.sin(jax.vmap(  # noqa: E731
        lambda x: moe._moe_tokens(lp["router"], lp["w_gate"], lp["w_up"], lp["w_down"], x,
                                  k=2, norm_topk=True, impl="gather"))(h)))
    np.testing.assert_allclose(np.asarray(jax.grad(batched)(h)), np.asarray(jax.grad(plain)(h)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.multidevice
@pytest.mark.parametrize("shape,token_axis", [((1, 4), None), ((2, 2), "data")])
def test_expert_parallel_equals_unsharded(shape, token_axis):
    mesh = jax.make_mesh(shape, ("data", "expert"))
    lp = random_layer(jax.random.key(3))
    h = inputs_with_router_margins(lp, 16, 2, seed=11)
    f = moe.expert_parallel_ffn(mesh, "expert", k=2, norm_topk=True, token_axis=token_axis)
    ref = moe.moe_ffn(lp, h, k=2, norm_topk=True)
    np.testing.assert_allclose(np.asarray(f(lp, h)), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f(lp, h)), np_moe(lp, h, 2, True), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="do not split"):
        f(dict(lp, w_gate=lp["w_gate"][:5], w_up=lp["w_up"][:5], w_down=lp["w_down"][:5]), h)


# ---------------------------------------------------------------------------
# Config validation


def test_config_rules():
    base = dict(vocab_size=8, dim=4, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=4, ffn_dim=4)
    with pytest.raises(ValueError, match="n_experts_per_tok must be in"):
        llama.LlamaConfig(**base, n_experts=4, n_experts_per_tok=5)
    with pytest.raises(ValueError, match="n_experts_per_tok must be in"):
        llama.LlamaConfig(**base, n_experts=4, n_experts_per_tok=0)
    with pytest.raises(ValueError, match="needs n_experts"):
        llama.LlamaConfig(**base, n_experts_per_tok=2)
    with pytest.raises(ValueError, match="n_experts must be an integer"):
        llama.LlamaConfig(**base, n_experts=-1)


def test_hf_config_errors_name_the_key(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(DATA / "tiny_mixtral", d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(hf | {"num_experts_per_tok": 9}))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        load(d)
    (d / "config.json").write_text(json.dumps({k: v for k, v in hf.items()
                                               if k != "num_local_experts"}))
    with pytest.raises(ModelLoadError, match="num_local_experts"):
        load(d)


# ---------------------------------------------------------------------------
# Mixtral against transformers


def test_mixtral_config(mixtral):
    c = mixtral.config
    assert (c.arch, c.n_experts, c.n_experts_per_tok, c.norm_topk, c.ffn_dim) == (
        "mixtral", 8, 2, True, 48)
    assert not c.tie_embeddings


def assert_logits_close(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    err = np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)
    assert err.max() <= REL, f"max relative error {err.max():.3g} at position {err.argmax()}"


def test_mixtral_logits_match_transformers(mixtral):
    seq = REF["sequence"]
    ours = np.asarray(mixtral.forward(seq[None]))[0]
    assert_logits_close(ours, REF["tiny_mixtral/logits"])
    assert_logits_close(ours[-1:], REF["tiny_mixtral/logits"][-1:])


@pytest.mark.slow
def test_mixtral_routing_matches_transformers(mixtral):
    """Our per-layer expert choices equal the top k of transformers' router logits
    (the stored logits have a top-2 / third margin of at least 0.02)."""
    ref = REF["tiny_mixtral/router_logits"]  # [L, S, X]
    s = np.sort(ref, -1)
    assert (s[..., -2] - s[..., -3]).min() > 1e-3  # the reference has margins
    idx = np.asarray(llama.router_choices(mixtral.config, mixtral.params,
                                          jnp.asarray(REF["sequence"])))
    want = np.argsort(-ref, -1, kind="stable")[..., :2]
    np.testing.assert_array_equal(np.sort(idx, -1), np.sort(want, -1))


def greedy_matches(got, ref, margins, tol=1e-4):
    """Equal up to the first step whose reference top-1/top-2 margin is a float tie."""
    for t, (a, b) in enumerate(zip(got, ref)):
        if margins[t] < tol:
            return t
        assert a == b, f"greedy token {t}: {a} vs transformers {b} (margin {margins[t]:.3g})"
    return len(ref)


@pytest.mark.slow
def test_mixtral_greedy_matches_transformers(mixtral):
    g = engine.generate(mixtral, [[int(t) for t in REF["prompt"]]],
                        SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
    ref = REF["tiny_mixtral/greedy"]
    n = int(g.lengths[0, 0])
    assert greedy_matches(g.tokens[0, 0, :n], ref[:n], REF["tiny_mixtral/margins"]) >= min(n, 8)


@pytest.mark.slow
def test_cached_decode_equals_full_forward(mixtral):
    g = engine.generate(mixtral, prompts(), SamplingParams(n=4, max_new_tokens=12, seed=5))
    for b, p in enumerate(g.prompt_tokens):
        for n in range(4):
            L = int(g.lengths[b, n])
            seq = np.array(list(p) + list(g.tokens[b, n, :L]), np.int32)
            logp = jax.nn.log_softmax(mixtral.forward(seq[None])[0], -1)
            want = np.asarray(logp)[len(p) - 1:len(p) - 1 + L][np.arange(L), seq[len(p):]]
            np.testing.assert_allclose(g.logprobs[b, n, :L], want, atol=1e-4)


@pytest.fixture(scope="module")
def sampled(mixtral):
    return engine.generate(mixtral, prompts(), SamplingParams(n=4, max_new_tokens=12, seed=2))


@pytest.mark.slow
def test_shared_equals_naive(mixtral, sampled):
    naive = naive_generate(mixtral, prompts(), sampled.params)
    assert_same_tokens_up_to_ties(mixtral, naive, sampled)


@pytest.mark.slow
@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_sharded_equals_unsharded(mixtral, sampled, shape):
    mesh = jax.make_mesh(shape, ("data", "branch"))
    sharded = engine.generate(mixtral, prompts(), sampled.params, mesh=mesh)
    assert_same_tokens_up_to_ties(mixtral, sampled, sharded)


@pytest.mark.slow
def test_shared_prefix_equals_the_context_concatenated(mixtral):
    ctx = [int(t) for t in REF["sequence"][:20]]
    params = SamplingParams(n=3, max_new_tokens=10, seed=4)
    got = engine.generate(mixtral, prompts(), params, shared_prefix=ctx)
    ref = engine.generate(mixtral, [ctx + p for p in prompts()], params)
    assert_same_tokens_up_to_ties(mixtral, ref, got)


@pytest.mark.slow
def test_zero_bridge_is_the_base_model(mixtral, sampled):
    from jaxsample import bridge as bridge_lib

    zero = bridge_lib.init(mixtral, bridge_lib.BridgeConfig(dim=8, n_heads=2))
    got = engine.generate(mixtral, prompts(), sampled.params, bridge=zero)
    assert_same_tokens_up_to_ties(mixtral, sampled, got)


# ---------------------------------------------------------------------------
# The bill: distinct experts per step


def test_expected_experts_formula():
    cfg = llama.LlamaConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, n_kv_heads=1,
                            head_dim=4, ffn_dim=4, n_experts=8, n_experts_per_tok=2)
    for n in (1, 16, 64):
        want = 8 * (1 - (1 - 2 / 8) ** n)
        assert cost.expected_experts_touched(cfg, n) == pytest.approx(want, rel=1e-12)
        assert cost.estimate(cfg, 10, 5, n).experts_touched_per_step == pytest.approx(want)
    assert cost.expected_experts_touched(cfg, 1) == pytest.approx(2.0)
    # a Monte Carlo of uniform routing agrees with the closed form
    rng = np.random.default_rng(0)
    for n in (16, 64):
        hits = [len({int(x) for _ in range(n) for x in rng.choice(8, 2, replace=False)})
                for _ in range(2000)]
        assert abs(np.mean(hits) - cost.expected_experts_touched(cfg, n)) < 0.05
    dense = dataclasses.replace(cfg, n_experts=0, n_experts_per_tok=0)
    assert cost.expected_experts_touched(dense, 64) == 0.0
    assert cost.step_weight_bytes(dense, 64) == cost.weight_bytes(dense)


def test_moe_param_count_and_step_bytes(mixtral):
    c = mixtral.config
    n = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(mixtral.params))
    assert cost.param_count(c) == n
    eb = cost.expert_bytes(c)
    assert eb == 3 * 32 * 48 * 4
    # one token reads k experts per layer; many read (nearly) all X
    assert cost.step_weight_bytes(c, 1) == pytest.approx(cost.weight_bytes(c) - 2 * 6 * eb, abs=1)
    assert cost.step_weight_bytes(c, 10**6) == pytest.approx(cost.weight_bytes(c), abs=1)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 16, 64])
def test_bill_reports_experts_touched(mixtral, n):
    g = engine.generate(mixtral, prompts()[:1], SamplingParams(n=n, max_new_tokens=8, seed=1))
    bill = g.bill
    assert (bill.experts, bill.experts_per_token) == (8, 2)
    assert bill.experts_touched_per_step == pytest.approx(
        cost.expected_experts_touched(mixtral.config, bill.slots_per_step))
    assert bill.to_dict()["experts_touched_per_step"] == bill.experts_touched_per_step
    measured = cost.measure_experts_touched(mixtral, g)
    if n == 1:
        assert measured == 2.0  # one token picks exactly k distinct experts
    else:
        assert 2.0 < measured <= 8.0
    replaced = dataclasses.replace(bill, experts_touched_measured=measured)
    assert "distinct experts" in replaced.summary() and "measured" in replaced.summary()


def test_measure_refuses_a_dense_model(tiny_lm):
    g = engine.generate(tiny_lm, ["ab"], SamplingParams(n=2, max_new_tokens=3))
    assert g.bill.experts == 0 and g.bill.experts_touched_per_step == 0.0
    with pytest.raises(ValueError, match="no experts"):
        cost.measure_experts_touched(tiny_lm, g)


# ---------------------------------------------------------------------------
# Qwen3-MoE (QK-norm, norm_topk_prob=False), Mixtral and Qwen3-MoE from GGUF


@pytest.fixture(scope="module")
def qwen3_moe():
    return load(DATA / "tiny_qwen3_moe")


def test_qwen3_moe_config(qwen3_moe):
    c = qwen3_moe.config
    assert (c.arch, c.n_experts, c.n_experts_per_tok, c.norm_topk, c.qk_norm, c.ffn_dim,
            c.head_dim) == ("qwen3moe", 8, 2, False, True, 48, 16)


@pytest.mark.slow
def test_qwen3_moe_matches_transformers(qwen3_moe):
    ours = np.asarray(qwen3_moe.forward(REF["sequence"][None]))[0]
    assert_logits_close(ours, REF["tiny_qwen3_moe/logits"])
    ref = REF["tiny_qwen3_moe/router_logits"]
    s = np.sort(ref, -1)
    assert (s[..., -2] - s[..., -3]).min() > 1e-3
    idx = np.asarray(llama.router_choices(qwen3_moe.config, qwen3_moe.params,
                                          jnp.asarray(REF["sequence"])))
    np.testing.assert_array_equal(np.sort(idx, -1),
                                  np.sort(np.argsort(-ref, -1, kind="stable")[..., :2], -1))
    g = engine.generate(qwen3_moe, [[int(t) for t in REF["prompt"]]],
                        SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
    n = int(g.lengths[0, 0])
    assert greedy_matches(g.tokens[0, 0, :n], REF["tiny_qwen3_moe/greedy"][:n],
                          REF["tiny_qwen3_moe/margins"]) >= min(n, 5)


@pytest.mark.slow
def test_qwen3_moe_shared_equals_naive(qwen3_moe):
    params = SamplingParams(n=4, max_new_tokens=10, seed=6)
    shared = engine.generate(qwen3_moe, prompts(), params)
    naive = naive_generate(qwen3_moe, prompts(), params)
    assert_same_tokens_up_to_ties(qwen3_moe, naive, shared)


@pytest.mark.parametrize("change,needle", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
])
def test_qwen3_moe_dense_layers_are_refused(tmp_path, change, needle):
    d = tmp_path / "m"
    shutil.copytree(DATA / "tiny_qwen3_moe", d)
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(hf | change))
    with pytest.raises(UnsupportedModelError, match=needle) as e:
        load(d)
    assert "\n" not in str(e.value)


def test_mixtral_gguf_matches_transformers():
    lm = load(DATA / "tiny_mixtral.gguf")
    assert (lm.config.n_experts, lm.config.n_experts_per_tok, lm.config.norm_topk) == (8, 2, True)
    assert_logits_close(np.asarray(lm.forward(REF["sequence"][None]))[0],
                        REF["tiny_mixtral/logits"])


# llama.cpp's qwen3moe graph renormalises the top-k weights whatever norm_topk_prob was
# (src/models/qwen3moe.cpp: build_moe_ffn(..., norm_w = true)); the oracle is transformers
# on the same weights with norm_topk_prob=True (scripts/make_moe_references.py).
@pytest.mark.slow
def test_qwen3_moe_gguf_matches_transformers(qwen3_moe):
    lm = load(DATA / "tiny_qwen3_moe.gguf")
    c = lm.config
    assert (c.arch, c.n_experts, c.n_experts_per_tok, c.norm_topk, c.qk_norm, c.ffn_dim,
            c.head_dim) == ("qwen3moe", 8, 2, True, True, 48, 16)
    # the same model as the safetensors but for the renormalisation (and float32 eps)
    assert c.replace(norm_topk=False, norm_eps=1e-5) == qwen3_moe.config.replace(norm_eps=1e-5)
    ours = np.asarray(lm.forward(REF["sequence"][None]))[0]
    assert_logits_close(ours, REF["tiny_qwen3_moe_gguf/logits"])
    assert_logits_close(ours[-1:], REF["tiny_qwen3_moe_gguf/logits"][-1:])
    ref = REF["tiny_qwen3_moe_gguf/router_logits"]
    s = np.sort(ref, -1)
    assert (s[..., -2] - s[..., -3]).min() > 1e-3
    idx = np.asarray(llama.router_choices(c, lm.params, jnp.asarray(REF["sequence"])))
    np.testing.assert_array_equal(np.sort(idx, -1),
                                  np.sort(np.argsort(-ref, -1, kind="stable")[..., :2], -1))
    g = engine.generate(lm, [[int(t) for t in REF["prompt"]]],
                        SamplingParams(n=1, temperature=0.0, max_new_tokens=16))
    n = int(g.lengths[0, 0])
    assert greedy_matches(g.tokens[0, 0, :n], REF["tiny_qwen3_moe_gguf/greedy"][:n],
                          REF["tiny_qwen3_moe_gguf/margins"]) >= min(n, 5)


def _qwen3_moe_gguf_meta():
    import gguf

    reader = gguf.GGUFReader(DATA / "tiny_qwen3_moe.gguf")
    return ({k: f.contents() for k, f in reader.fields.items()},
            {t.name: t for t in reader.tensors})


def test_qwen3_moe_gguf_expert_width_falls_back_like_llama_cpp():
    """Without expert_feed_forward_length, llama.cpp takes feed_forward_length / used."""
    from jaxsample.models.checkpoints import gguf_loader

    meta, tensors = _qwen3_moe_gguf_meta()
    assert (meta["qwen3moe.expert_feed_forward_length"], meta["qwen3moe.feed_forward_length"]) \
        == (48, 64)
    del meta["qwen3moe.expert_feed_forward_length"]
    meta["qwen3moe.feed_forward_length"] = 96
    assert gguf_loader.config_from_metadata(meta, tensors, "f.gguf").ffn_dim == 48


@pytest.mark.parametrize("change,error,needle", [
    ({"qwen3moe.expert_count": None}, ModelLoadError, "f.gguf.*qwen3moe.expert_count"),
    ({"qwen3moe.expert_used_count": 9}, ModelLoadError, "qwen3moe.expert_used_count.*<="),
    ({"qwen3moe.expert_weights_scale": 2.5}, UnsupportedModelError,
     "qwen3moe.expert_weights_scale = 2.5"),
    ({"qwen3moe.expert_feed_forward_length": 0}, ModelLoadError,
     "qwen3moe.expert_feed_forward_length"),
])
def test_qwen3_moe_gguf_bad_expert_keys_are_refused(change, error, needle):
    from jaxsample.models.checkpoints import gguf_loader

    meta, tensors = _qwen3_moe_gguf_meta()
    for k, v in change.items():
        if v is None:
            del meta[k]
        else:
            meta[k] = v
    with pytest.raises(error, match=needle) as e:
        gguf_loader.config_from_metadata(meta, tensors, "f.gguf")
    assert "\n" not in str(e.value)


def test_qwen3_moe_gguf_unit_expert_scale_is_accepted():
    from jaxsample.models.checkpoints import gguf_loader

    meta, tensors = _qwen3_moe_gguf_meta()
    for scale in (0.0, 1.0):  # llama.cpp scales only for a value other than 0 and 1
        meta["qwen3moe.expert_weights_scale"] = scale
        assert gguf_loader.config_from_metadata(meta, tensors, "f.gguf").n_experts == 8
