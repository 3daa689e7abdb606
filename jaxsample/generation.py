"""`Generation`: what `jaxsample.generate` returns (host-side numpy arrays)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Generation:
    """N sampled continuations for each of B prompts.

    Attributes:
      tokens: `[B, N, T]` int32 generated token ids; positions at or past
        `lengths` hold `pad_id`.
      logprobs: `[B, N, T]` float32 log-probability of each generated token
        under the raw model distribution (temperature 1, no filters); 0 at padding.
      lengths: `[B, N]` int32 generated tokens per branch, the stop token included.
      finish_reason: B lists of N strings, "stop" (a stop token or stop string),
        "length" (max_new_tokens reached), and in adaptive runs "terminated"
        (ended early by a confidence rule) or "not_drawn" (never sampled).
      texts: B lists of N decoded strings; stop token and stop string excluded.
      prompt_tokens: B lists of prompt token ids (what was prefilled).
      prompts: the B prompt strings as rendered (chat template applied), or
        None for prompts given as token ids.
      params: the `SamplingParams` used (with the seed actually used).
      bill: the `jaxsample.cost.Bill` of this request.
      timings: seconds spent per phase ("compile", "prefill", "decode", "total").
      pad_id: the id written after a branch stops.
      top_logprobs: `[B, N, T, k]` float32, with `SamplingParams(logprobs=k)`:
        the k largest log-probabilities of the raw distribution (temperature
        1, no filters, as vLLM's `logprobs`) at each generated position, in
        decreasing order; 0 at padding. None without `logprobs`.
      top_token_ids: `[B, N, T, k]` int32, their token ids (pad_id at padding).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    finish_reason: list[list[str]]
    texts: list[list[str]]
    prompt_tokens: list[list[int]]
    prompts: list[str | None]
    params: Any
    bill: Any
    timings: dict[str, float]
    pad_id: int
    top_logprobs: np.ndarray | None = None
    top_token_ids: np.ndarray | None = None

    @property
    def num_prompts(self) -> int:
        return self.tokens.shape[0]

    @property
    def n(self) -> int:
        return self.tokens.shape[1]

    def sum_logprob(self) -> np.ndarray:
        """`[B, N]` float32 sum of the generated tokens' logprobs (padding excluded)."""
        return np.asarray(self.logprobs, dtype=np.float32).sum(axis=-1, dtype=np.float32)

    def mean_logprob(self) -> np.ndarray:
        """`[B, N]` float32 length-normalised logprob (sum / length; 0 for empty branches)."""
        lengths = np.maximum(np.asarray(self.lengths), 1).astype(np.float32)
        return (self.sum_logprob() / lengths).astype(np.float32)
