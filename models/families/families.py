"""The model families and `module_for(cfg)`: one module object per family, one interface.

Every family module (`models.families.llama`, `models.families.gemma3`) exposes the same functions
with the same signatures, so the engine can run any of them through the
module returned here:

    init_params(cfg, key, scale) -> params        param_shapes(cfg) -> shapes
    check_params(cfg, params, source)             embed(params, tokens [...]) -> [..., E]
    run_layers(cfg, params, x [S, E], positions [S], attend_for_layer,
               layer_xs=None, post_layer=None, post_xs=None) -> (x, (k, v))
    run_causal(cfg, params, x, positions, valid_len=None, post_layer=None,
               post_xs=None) -> (x, (k, v))
    logits(cfg, params, x [..., E]) -> [..., V] float32
    forward_one(cfg, params, tokens [S], valid_len=None) -> (logits [S, V], kv)
    forward(cfg, params, tokens [B, S]) -> logits [B, S, V]
    unstack_layers(params), stack_layers(params)
    partial_attention, merge_attention, causal_attend (from `models.families.common`)

and every config carries `family`, `layer_windows` (per-layer sliding window
or None) and `attention_scale` (the score scale the attention kernel applies
to q; see `models.families.common`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Union

from jaxsample.models.families import gemma3, llama

ModelConfig = Union[llama.LlamaConfig, gemma3.Gemma3Config]

FAMILIES: dict[str, ModuleType] = {"llama": llama, "gemma3": gemma3}


def module_for(cfg) -> ModuleType:
    """The module that runs `cfg` (`models.families.llama` or `models.families.gemma3`).

    Raises:
      ValueError: the config's `family` is unknown.
    """
    family = getattr(cfg, "family", None)
    module = FAMILIES.get(family)
    if module is None:
        raise ValueError(f"no model family {family!r} (config {type(cfg).__name__}); "
                         f"known: {sorted(FAMILIES)}")
    return module
