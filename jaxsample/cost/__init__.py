"""Pricing: what N branches over one shared prompt cost.

    model.py       the analytic FLOP/byte model (`estimate`, `table`) from a
                   config and (P prompt tokens, T new tokens, N branches)
    bill.py        the one `Bill` type (`make_bill`): measured counts beside
                   the estimate, with optional parts (`AdaptiveSaving`,
                   `PoolRun`) for the runs they apply to
    formatting.py  `format_bytes`, `format_flops`
"""

from jaxsample.cost.bill import AdaptiveSaving, Bill, PoolRun, make_bill, measure_experts_touched
from jaxsample.cost.formatting import format_bytes, format_flops
from jaxsample.cost.model import (
    DTYPE_BYTES,
    MAX_COUNT,
    CostEstimate,
    attention_flops_per_pair,
    decode_flops,
    estimate,
    expected_experts_touched,
    expert_bytes,
    kv_bytes,
    kv_bytes_per_token,
    linear_flops_per_token,
    linear_params_per_layer,
    logits_flops_per_token,
    param_count,
    prefill_flops,
    step_weight_bytes,
    suffix_prefill_flops,
    table,
    weight_bytes,
)

__all__ = ["estimate", "table", "CostEstimate", "Bill", "AdaptiveSaving", "PoolRun",
           "make_bill", "measure_experts_touched",
           "format_bytes", "format_flops", "param_count", "linear_params_per_layer",
           "expected_experts_touched", "expert_bytes", "step_weight_bytes",
           "linear_flops_per_token", "logits_flops_per_token", "attention_flops_per_pair",
           "kv_bytes_per_token", "kv_bytes", "weight_bytes", "prefill_flops",
           "suffix_prefill_flops", "decode_flops", "DTYPE_BYTES", "MAX_COUNT"]
