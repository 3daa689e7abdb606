"""Tests of the analytic cost model and the bill (jaxsample/cost.py)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from jaxsample import cost
from jaxsample.models.families.llama import LlamaConfig

# L=2, E=8, H=2, K=1, D=4, F=16, V=10, tied embeddings, float32.
TINY = LlamaConfig(vocab_size=10, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4,
                   ffn_dim=16, max_seq_len=64)
SMOLLM2_135M = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, ffn_dim=1536, max_seq_len=8192, rope_theta=100000.0)


def test_tiny_constants_by_hand():
    # Per layer linear weights: wq E*H*D = 8*8 = 64, wk = wv = E*K*D = 8*4 = 32 each,
    # wo H*D*E = 64, gate = up = down = E*F = 128 each: 64 + 64 + 64 + 384 = 576.
    assert cost.linear_params_per_layer(TINY) == 576
    # All parameters: embed V*E = 80, final norm 8, per layer 576 + two norms 16 -> 592 * 2.
    assert cost.param_count(TINY) == 80 + 8 + 2 * 592 == 1272
    assert cost.weight_bytes(TINY) == 1272 * 4 == 5088
    assert cost.weight_bytes(TINY, dtype_bytes=2) == 2544
    # KV per token: 2 (k, v) * L 2 * K 1 * D 4 * 4 bytes = 64.
    assert cost.kv_bytes_per_token(TINY) == 64
    # Linear FLOPs per token: 2 * L * 576 = 2304; logits 2 * E * V = 160;
    # attention per visible pair: 4 * L * H * D = 64.
    assert cost.linear_flops_per_token(TINY) == 2304
    assert cost.logits_flops_per_token(TINY) == 160
    assert cost.attention_flops_per_pair(TINY) == 64


def test_tiny_estimate_by_hand():
    P, T, N = 5, 3, 4
    e = cost.estimate(TINY, P, T, N)
    # Prefill: linear 2304 * 5 = 11520; causal pairs 5 * 6 / 2 = 15 -> 64 * 15 = 960;
    # logits at the last position 160.  11520 + 960 + 160 = 12640.
    assert e.prefill_flops_shared == 12640
    assert e.prefill_flops_separate == 4 * 12640
    # Decode of one branch: 3 tokens attending to 6, 7, 8 keys = 21 pairs -> 64 * 21 = 1344;
    # linear 3 * 2304 = 6912; logits 3 * 160 = 480.  Total 8736, times N = 4 -> 34944.
    assert e.decode_flops_shared == e.decode_flops_separate == 4 * 8736 == 34944
    assert e.decode_flops_per_token == 8736 / 3
    # Last decode token: 2304 + 160 + 64 * 8 = 2976.
    assert e.decode_flops_last_token == 2976
    # KV held: shared (5 + 4 * 3) * 64 = 1088; separate 4 * (5 + 3) * 64 = 2048.
    assert e.kv_bytes_shared == 1088
    assert e.kv_bytes_separate == 2048
    # Last decode step reads: shared 5088 + 5 * 64 + 4 * 3 * 64 = 6176;
    # batched retries 5088 + 4 * 8 * 64 = 7136; sequential 4 * (5088 + 8 * 64) = 22400.
    assert e.decode_step_bytes_shared == 6176
    assert e.decode_step_bytes_separate == 7136
    assert e.decode_step_bytes_sequential == 22400
    # Over the 3 steps: tails read 1 + 2 + 3 = 6 tokens per branch.
    # shared 3 * (5088 + 320) + 4 * 6 * 64 = 17760; separate 3 * 5088 + 4 * (15 + 6) * 64 = 20640.
    assert e.decode_bytes_shared == 17760
    assert e.decode_bytes_separate == 20640
    d = e.to_dict()
    json.dumps(d)
    assert d["total_flops_shared"] == 12640 + 34944


@pytest.mark.parametrize("P,T", [(0, 0), (1, 1), (5, 3), (4096, 256), (100, 0)])
@pytest.mark.parametrize("N", [1, 2, 16, 64])
def test_properties(P, T, N):
    e = cost.estimate(TINY, P, T, N)
    assert e.kv_bytes_shared <= e.kv_bytes_separate
    assert e.decode_step_bytes_shared <= e.decode_step_bytes_separate \
        <= e.decode_step_bytes_sequential
    assert e.decode_bytes_shared <= e.decode_bytes_separate
    assert e.prefill_flops_shared <= e.prefill_flops_separate
    # Sharing never saves the per-branch decode.
    assert e.decode_flops_shared == e.decode_flops_separate
    if N == 1:
        assert e.kv_bytes_shared == e.kv_bytes_separate
        assert e.prefill_flops_shared == e.prefill_flops_separate
        assert e.decode_step_bytes_shared == e.decode_step_bytes_separate \
            == e.decode_step_bytes_sequential
        assert e.decode_bytes_shared == e.decode_bytes_separate


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must be"):
        cost.estimate(TINY, 5, 3, 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        cost.estimate(TINY, -1, 3, 1)
    with pytest.raises(ValueError, match="dtype_bytes"):
        cost.estimate(TINY, 1, 1, 1, dtype_bytes=0)
    with pytest.raises(ValueError, match="ns"):
        cost.table(TINY, 1, 1, [])


@pytest.mark.parametrize("field", ["prompt_tokens", "new_tokens", "n"])
@pytest.mark.parametrize("value", [10**32, 2**40, 2.0, np.bool_(True)])
def test_estimate_rejects_huge_or_non_integer_counts(field, value):
    args = dict(prompt_tokens=5, new_tokens=3, n=2)
    args[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be an integer in \[\d, 2\*\*40\)"):
        cost.estimate(TINY, **args)


def test_estimate_at_the_count_bound_is_finite():
    e = cost.estimate(TINY, 2**40 - 1, 2**40 - 1, 2**40 - 1)
    d = e.to_dict()
    assert all(math.isfinite(v) for v in d.values())


def test_kv_saving_with_nothing_held_is_one():
    e = cost.estimate(TINY, 0, 0, 1)
    assert e.kv_bytes_shared == e.kv_bytes_separate == 0
    assert e.kv_saving == 1.0
    assert cost.estimate(TINY, 0, 0, 4).kv_saving == 1.0


def test_bill_rejects_huge_lengths():
    with pytest.raises(ValueError, match="branch_lengths"):
        _bill(lengths=np.full((2, 4), 10**32, dtype=object))


def test_table_rows():
    rows = cost.table(TINY, 5, 3, [1, 4])
    assert [r["n"] for r in rows] == [1, 4]
    assert rows[1]["kv_bytes_shared"] == 1088 and rows[1]["kv_bytes_separate"] == 2048
    assert rows[0]["kv_saving"] == 1.0
    json.dumps(rows)


def test_smollm2_135m_worked_example():
    # SmolLM2-135M has 134,515,008 parameters (tied embeddings).
    e = cost.estimate(SMOLLM2_135M, 4096, 256, 16)
    assert e.n_params == 134_515_008
    assert e.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert e.kv_bytes_shared == (4096 + 16 * 256) * 46080
    assert e.kv_bytes_separate == 16 * (4096 + 256) * 46080
    assert e.kv_saving == pytest.approx(8.5)


def _bill(n=4, prompt_lengths=(5, 2), lengths=None, steps=3):
    lengths = np.array([[3, 1, 2, 3], [0, 3, 3, 1]])[:, :n] if lengths is None else lengths
    kv = cost.kv_bytes_per_token(TINY)
    # Padded buckets: prefix [L, B=2, P=8, K, D] k and v; tails [B, N, L, T=4, K, D] k and v.
    prefix_bytes = 2 * 8 * kv
    tail_bytes = 2 * n * 4 * kv
    return cost.make_bill(TINY, prompt_lengths=list(prompt_lengths), branch_lengths=lengths,
                          n=n, prefix_cache_bytes=prefix_bytes, tail_cache_bytes=tail_bytes,
                          decode_steps=steps)


def test_bill_by_hand():
    b = _bill()
    kv = 64
    assert b.num_prompts == 2 and b.n == 4 and b.decode_steps == 3
    assert b.prompt_tokens_prefilled == 7
    assert b.prompt_tokens_if_separate == 28
    assert b.decoded_tokens_per_branch == [[3, 1, 2, 3], [0, 3, 3, 1]]
    assert b.decoded_tokens_total == 16
    assert b.kv_bytes_shared_prefix == 16 * kv
    assert b.kv_bytes_tails == 32 * kv
    assert b.kv_bytes_held == 48 * kv
    assert b.kv_bytes_if_separate == 4 * 16 * kv + 32 * kv
    # Prefill: prompt 5 -> 12640 (as above); prompt 2 -> 2 * 2304 + 64 * 3 + 160 = 4960.
    assert b.prefill_flops_shared == 12640 + 4960
    assert b.prefill_flops_if_separate == 4 * (12640 + 4960)
    # Decode equals the sum of per-branch closed forms, and is the same for separate.
    want = sum(cost.decode_flops(TINY, p, t)
               for p, row in zip((5, 2), b.decoded_tokens_per_branch) for t in row)
    assert b.decode_flops_shared == b.decode_flops_if_separate == want
    # Reads: tail tokens read over steps s = 0, 1, 2 are sum(min(s + 1, len)):
    # lengths 3,1,2,3,0,3,3,1 -> 6,3,5,6,0,6,6,3 = 35.
    assert b.decode_bytes_read_shared == 3 * (5088 + 7 * kv) + 35 * kv
    assert b.decode_bytes_read_if_separate == 3 * (5088 + 4 * 7 * kv) + 35 * kv
    d = b.to_dict()
    assert json.loads(json.dumps(d)) == d
    s = b.summary()
    assert "never saves" in s and len(s.splitlines()) >= 3


def test_bill_decode_reads_count_each_steps_tail_tokens():
    """At step s each branch reads min(s + 1, its length) tail tokens: the bill's count
    equals that sum taken step by step, at any number of steps."""
    lengths = np.random.default_rng(0).integers(0, 9, (2, 4))
    for steps in (0, 1, 5, 8, 12):
        b = cost.make_bill(TINY, prompt_lengths=[5, 2], branch_lengths=lengths, n=4,
                           prefix_cache_bytes=0, tail_cache_bytes=0, decode_steps=steps)
        tails = sum(int(np.minimum(s + 1, lengths).sum()) for s in range(steps))
        assert b.decode_bytes_read_shared == steps * (5088 + 7 * 64) + tails * 64


def test_bill_parts_are_optional_and_json_ready():
    """The one Bill type: its parts are None until a run sets them; to_dict writes each
    as a nested object or None (strict JSON), summary adds a line per part."""
    b = _bill()  # 16 tokens decoded over 3 steps x 2 prompts x 4 branches = 24 branch-steps
    assert b.adaptive is None and b.pool is None
    d = b.to_dict()
    assert d["adaptive"] is None and d["pool"] is None
    assert d["slot_utilisation"] == b.slot_utilisation == 16 / 24
    assert _bill(steps=0).slot_utilisation == 0.0
    a = dataclasses.replace(b, adaptive=cost.AdaptiveSaving(
        max_n=8, rounds=2, branches_drawn=8, fixed_decoded_tokens=32,
        fixed_decode_flops=2 * b.decode_flops_shared, token_saving=0.5, flop_saving=0.5))
    p = dataclasses.replace(b, pool=cost.PoolRun(requests=2, seconds=4.0, batch_branch_steps=48))
    for x in (a, p):
        d = x.to_dict()
        assert json.loads(json.dumps(d, allow_nan=False)) == d
        assert x.summary().startswith(b.summary() + "\n")
    assert a.to_dict()["adaptive"]["max_n"] == 8 and a.to_dict()["pool"] is None
    assert p.to_dict()["pool"] == {"requests": 2, "seconds": 4.0, "batch_branch_steps": 48,
                                   "requests_per_second": 0.5}
    assert a.summary().endswith("at a fixed n=8: saved 50% of the decoded tokens and 50% of "
                                "the decode FLOPs")
    assert p.summary().endswith("pool: 2 requests in 4.0 s (0.50 requests/s); slot "
                                "utilisation 67% of 24 branch-steps; batch by batch 48 "
                                "branch-steps (33%)")
    assert cost.PoolRun(requests=0, seconds=0.0, batch_branch_steps=0).requests_per_second == 0.0


def test_bill_prices_a_float16_prefix_by_hand():
    """A quantised model's float16 prefix (`prefix_dtype_bytes=2`): each step reads the
    7 prompt tokens' KV at 32 bytes a token (2 layers x 2 x 1 head x 4 x 2 bytes), the
    tails still at 64; the separate-retries count likewise; a bad value is refused."""
    lengths = np.array([[3, 1, 2, 3], [0, 3, 3, 1]])
    args = dict(prompt_lengths=[5, 2], branch_lengths=lengths, n=4, prefix_cache_bytes=0,
                tail_cache_bytes=0, decode_steps=3)
    b = cost.make_bill(TINY, prefix_dtype_bytes=2, **args)
    assert b.decode_bytes_read_shared == 3 * (5088 + 7 * 32) + 35 * 64
    assert b.decode_bytes_read_if_separate == 3 * (5088 + 4 * 7 * 32) + 35 * 64
    assert cost.make_bill(TINY, prefix_dtype_bytes=4, **args) == cost.make_bill(TINY, **args)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="prefix_dtype_bytes must be a positive integer"):
            cost.make_bill(TINY, prefix_dtype_bytes=bad, **args)


def test_bill_properties_and_n1():
    b = _bill()
    assert b.kv_bytes_held <= b.kv_bytes_if_separate
    assert b.decode_bytes_read_shared <= b.decode_bytes_read_if_separate
    b1 = _bill(n=1, lengths=np.array([[3], [2]]))
    assert b1.kv_bytes_held == b1.kv_bytes_if_separate
    assert b1.prefill_flops_shared == b1.prefill_flops_if_separate
    assert b1.decode_bytes_read_shared == b1.decode_bytes_read_if_separate
    assert b1.kv_saving == 1.0


def test_bill_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        _bill(lengths=np.zeros((2, 3), int))
    with pytest.raises(ValueError, match=">= 0"):
        _bill(lengths=-np.ones((2, 4), int))


def test_bill_kept_tokens_and_devices():
    kv = cost.kv_bytes_per_token(TINY)
    lengths = np.array([[3, 1, 2, 3], [0, 3, 3, 1]])
    kept = np.array([[2, 1, 2, 3], [0, 1, 3, 1]])
    b = cost.make_bill(TINY, prompt_lengths=[5, 2], branch_lengths=lengths, n=4,
                       prefix_cache_bytes=16 * kv, tail_cache_bytes=32 * kv, decode_steps=3,
                       kept_lengths=kept, devices=4, kv_bytes_per_device=16 * kv + 8 * kv,
                       kv_bytes_allocated=4 * 16 * kv + 32 * kv)
    assert b.kept_tokens_per_branch == kept.tolist() and b.kept_tokens_total == 13
    assert b.decoded_tokens_total == 16 and b.tokens_discarded == 3
    # Decode cost is what was decoded, not what was kept.
    assert b.decode_flops_shared == _bill().decode_flops_shared
    assert (b.devices, b.kv_bytes_per_device, b.kv_bytes_allocated) == (4, 24 * kv, 96 * kv)
    assert "on 4 devices" in b.summary() and "3 of them decoded after a stop string" in b.summary()
    one = _bill()
    assert one.kept_tokens_per_branch == one.decoded_tokens_per_branch and one.tokens_discarded == 0
    assert (one.devices, one.kv_bytes_allocated, one.kv_bytes_per_device) == (
        1, one.kv_bytes_held, one.kv_bytes_held)
    for bad in (lengths + 1, kept[:, :3], -kept):  # more kept than decoded, shape, sign
        with pytest.raises(ValueError, match="kept_lengths"):
            cost.make_bill(TINY, prompt_lengths=[5, 2], branch_lengths=lengths, n=4,
                           prefix_cache_bytes=0, tail_cache_bytes=0, decode_steps=3,
                           kept_lengths=bad)
    with pytest.raises(ValueError, match="devices"):
        _bill_kw(devices=0)


def _bill_kw(**kw):
    return cost.make_bill(TINY, prompt_lengths=[5], branch_lengths=[[1]], n=1,
                          prefix_cache_bytes=0, tail_cache_bytes=0, decode_steps=1, **kw)


def test_formatting():
    assert cost.format_bytes(1536) == "1.5 KiB"
    assert cost.format_bytes(10) == "10 B"
    assert cost.format_flops(2.5e12) == "2.50 TFLOP"
    assert cost.format_flops(0) == "0 FLOP"
    assert cost.format_flops(12) == "12 FLOP"


def test_bill_of_the_naive_baseline():
    # The naive baseline prefills and stores each prompt N times: its bill says so,
    # and its "if separate" numbers are the same as the shared engine's.
    shared = _bill()
    kv = 64
    naive = cost.make_bill(TINY, prompt_lengths=[5, 2], branch_lengths=shared.decoded_tokens_per_branch,
                           n=4, prefix_cache_bytes=4 * 16 * kv, tail_cache_bytes=32 * kv,
                           decode_steps=3, prefix_copies=4)
    assert naive.prompt_tokens_prefilled == naive.prompt_tokens_if_separate == 28
    assert naive.kv_bytes_held == naive.kv_bytes_if_separate == shared.kv_bytes_if_separate
    assert naive.prefill_flops_shared == naive.prefill_flops_if_separate
    assert naive.decode_bytes_read_shared == naive.decode_bytes_read_if_separate
    assert naive.decode_flops_shared == shared.decode_flops_shared
    with pytest.raises(ValueError, match="prefix_copies"):
        cost.make_bill(TINY, prompt_lengths=[5], branch_lengths=[[1, 2]], n=2,
                       prefix_cache_bytes=0, tail_cache_bytes=0, decode_steps=2, prefix_copies=3)
