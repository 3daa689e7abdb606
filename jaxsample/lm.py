"""`LanguageModel`: a model config, its parameters and its tokenizer, bundled.

The engine depends on a model only through the functions of its family's
module (`models.families.families.module_for(config)`: `models.families.llama` or
`models.families.gemma3`; embed, run_layers, logits, ...) and on the tokenizer only
through `encode`, `decode`, `apply_chat_template`,
`eos_token_ids`, `pad_token_id` and `vocab_size`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.errors import ConfigError
from jaxsample.models.cpu_kernels import cpu_kernels as cpu_kernels_lib
from jaxsample.models.families import families
from jaxsample.models.quantization import quant

PREFIX_KV_DTYPES = ("auto", "model")
"""The values of `LanguageModel.prefix_kv_dtype`."""
CPU_KERNELS = cpu_kernels_lib.CHOICES
"""The values of `LanguageModel.cpu_kernels`: "auto", "off"."""


def check_switch(name: str, value, allowed) -> str:
    """`value` if it is one of `allowed` (strings), else ConfigError naming `name`, the
    allowed values and the value given."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}, got "
                          f"{value!r}")
    return value


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer (see models/checkpoints/tokenizer.py)."""

    vocab_size: int  # number of real token ids; logits rows past it are never sampled
    eos_token_ids: tuple[int, ...]  # end-of-turn and end-of-text ids: default stop ids
    pad_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str: ...


@dataclasses.dataclass(frozen=True, eq=False)
class LanguageModel:
    """A loaded causal language model.

    Attributes:
      config: the model config (`models.families.llama.LlamaConfig` or
        `models.families.gemma3.Gemma3Config`;
        `models.families.families.module_for(config)` runs it).
      params: the parameter pytree (see the family's `param_shapes`).
      tokenizer: the checkpoint's own tokenizer.
      name: a short name ("smollm2-135m-instruct" or the file name).
      source: where the weights came from (a path), for messages and bills.
      prefix_kv_dtype: the dtype the engine stores each prompt's KV cache in (the
        prefix; the branches' tails always take the model's dtype), in the spirit of
        vLLM's `kv_cache_dtype`. "auto" (default): float16 for a W8A8 float32 model
        whose decode reads the prefix through the CPU attention kernel (half the
        bytes it streams per step; `engine.state.prefix_kv_dtype`), else the model's
        dtype. "model": always the model's dtype (a W8A8 model's prefix stays
        float32: the exact oracle of its cached decode; vLLM's `"auto"`).
      cpu_kernels: the int8 products' CPU kernels (`models.cpu_kernels`). "auto"
        (default): where they build and pass their self-test on the CPU backend;
        "off": XLA's `dot_general` in every program of this model (and so a float32
        prefix under "auto"). The int8 weights of `params` carry it
        (`quant.QuantizedWeight.kernels`, set here on construction), so every
        program traced from them follows it and is keyed by it. The environment
        variable `JAXSAMPLE_CPU_KERNELS=0` overrides "auto" for the whole process
        (`jaxsample.loading.load_info` reports it; `cpu_kernels.override`).

    Raises:
      ConfigError: `prefix_kv_dtype` or `cpu_kernels` outside its values (naming it).
    """

    config: families.ModelConfig
    params: Any
    tokenizer: Tokenizer
    name: str = "model"
    source: str = ""
    prefix_kv_dtype: str = "auto"
    cpu_kernels: str = "auto"

    def __post_init__(self):
        check_switch("prefix_kv_dtype", self.prefix_kv_dtype, PREFIX_KV_DTYPES)
        check_switch("cpu_kernels", self.cpu_kernels, CPU_KERNELS)
        # The traced code reads the choice from the weights (static pytree data).
        object.__setattr__(self, "params",
                           quant.with_cpu_kernels(self.params, self.cpu_kernels == "auto"))

    @property
    def vocab_limit(self) -> int:
        """Number of logits rows that may be sampled (the tokenizer's vocabulary)."""
        return min(int(self.tokenizer.vocab_size), self.config.vocab_size)

    def forward(self, tokens) -> jax.Array:
        """Plain causal forward without a KV cache.

        Args:
          tokens: `[B, S]` int (array or nested lists); a `[S]` row is promoted to `[1, S]`.

        Returns:
          logits `[B, S, V]` float32.

        Raises:
          ValueError: tokens out of range or longer than the context.
        """
        tokens = np.asarray(tokens)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an integer array [B, S], got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(f"tokens must lie in [0, {self.config.vocab_size}), "
                             f"got values in [{tokens.min()}, {tokens.max()}]")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"tokens has {tokens.shape[1]} positions, more than the context "
                             f"({self.config.max_seq_len})")
        return _forward(self.config, self.params, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens):
    return families.module_for(cfg).forward(cfg, params, tokens)
