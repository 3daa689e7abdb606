"""`Generation`: what `jaxsample.generate` returns (host-side numpy arrays), and
the vLLM-style views of it (`Generation.outputs()` -> `RequestOutput`s).

`RequestOutput`, `CompletionOutput` and `Logprob` mirror vLLM's classes of the
same names (vllm/outputs.py, vllm/logprobs.py) as plain frozen dataclasses:
per prompt, the prompt, its token ids, its prompt logprobs, and one
`CompletionOutput` per branch (index, text, token_ids, cumulative_logprob,
logprobs, finish_reason). Logprobs are lists with one dict per position,
`{token_id: Logprob(logprob, rank, decoded_token)}`: the sampled (or prompt)
token first, then the top k, as vLLM builds them; `prompt_logprobs[0]` is
None (the first prompt token has no prefix).
"""

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
      prompt_tokens: B lists of prompt token ids (what was prefilled; with
        `shared_prefix=`, the context's ids then the prompt's own).
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
      token_ranks: `[B, N, T]` int32, with `SamplingParams(logprobs=...)`: the
        rank of each sampled token under the raw distribution (vLLM's
        `Logprob.rank`: the number of tokens at least as likely, 1 for the
        most likely); 0 at padding. None without `logprobs`.
      prompt_token_logprobs: with `SamplingParams(prompt_logprobs=k)`, B
        float32 arrays `[P_b - 1]`: entry j is the raw log-probability of
        prompt token j + 1 given tokens 0..j. None otherwise.
      prompt_token_ranks: B int32 arrays `[P_b - 1]`, their ranks.
      prompt_top_logprobs, prompt_top_token_ids: B arrays `[P_b - 1, k]`, the
        k most likely tokens after tokens 0..j (float32 logprobs, int32 ids).
      tokenizer: the model's tokenizer (for `outputs()`'s decoded tokens).
      stop_reason: B lists of N, vLLM's `CompletionOutput.stop_reason`: the stop
        string (str) that ended the branch, the stop token id (int) when it
        ended on one of `SamplingParams.stop_token_ids` (not the model's own
        end id, unless `ignore_eos`), else None (ended by length or by the
        model's end-of-sequence id; terminated and not drawn branches).
      token_entropy: `[B, N, T]` float32, with `SamplingParams(signals=True)`:
        the entropy (nats) of the raw distribution each token was drawn from
        (temperature 1, no processors or filters: as the logprobs); 0 at
        padding. None without `signals`. See `sampling.token_signals`.
      self_certainty: `[B, N, T]` float32, KL(U || p) = -log V - mean_v log p_v
        (nats, V the real vocabulary; Kang et al. 2025, arXiv 2502.18581) of
        the same distributions; 0 at padding. None without `signals`.
      top2_margin: `[B, N, T]` float32, log p of the most likely token minus
        that of the second (nats, >= 0); 0 at padding. None without `signals`.
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
    token_ranks: np.ndarray | None = None
    prompt_token_logprobs: list[np.ndarray] | None = None
    prompt_token_ranks: list[np.ndarray] | None = None
    prompt_top_logprobs: list[np.ndarray] | None = None
    prompt_top_token_ids: list[np.ndarray] | None = None
    tokenizer: Any = None
    stop_reason: list[list[str | int | None]] | None = None
    token_entropy: np.ndarray | None = None
    self_certainty: np.ndarray | None = None
    top2_margin: np.ndarray | None = None

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

    def outputs(self) -> list["RequestOutput"]:
        """One vLLM-style `RequestOutput` per prompt (see the module docstring).

        `outputs[i].token_ids` are the branch's kept tokens (a final stop token
        included, as vLLM keeps it), `text` excludes the stop token or string,
        `cumulative_logprob` is the sum of their raw logprobs (always given;
        vLLM gives None unless `logprobs` was set), `logprobs` is None unless
        `SamplingParams.logprobs` was set. `decoded_token` is the token
        decoded alone (None without a tokenizer).

        Returns:
          B `RequestOutput`s, `request_id` the prompt's index as a string.
        """
        tok = self.tokenizer
        cache: dict[int, str | None] = {}

        def dec(i: int) -> str | None:
            if i not in cache:
                cache[i] = None if tok is None else tok.decode([i])
            return cache[i]

        def entry(token, logprob, rank, top_ids, top_lps) -> dict[int, Logprob]:
            d = {int(token): Logprob(float(logprob), None if rank is None else int(rank),
                                     dec(int(token)))}
            for j, (i, v) in enumerate(zip(top_ids, top_lps)):
                d[int(i)] = Logprob(float(v), j + 1, dec(int(i)))
            return d

        with_lp = getattr(self.params, "logprobs", None) is not None
        out = []
        for b in range(self.num_prompts):
            branches = []
            for n in range(self.n):
                L = int(self.lengths[b, n])
                ids = self.tokens[b, n, :L]
                logprobs = None
                if with_lp:
                    k_ids = (self.top_token_ids[b, n] if self.top_token_ids is not None
                             else np.zeros((L, 0), np.int32))
                    k_lps = (self.top_logprobs[b, n] if self.top_logprobs is not None
                             else np.zeros((L, 0), np.float32))
                    ranks = self.token_ranks[b, n] if self.token_ranks is not None else [None] * L
                    logprobs = [entry(ids[t], self.logprobs[b, n, t], ranks[t], k_ids[t], k_lps[t])
                                for t in range(L)]
                branches.append(CompletionOutput(
                    index=n, text=self.texts[b][n], token_ids=tuple(int(i) for i in ids),
                    cumulative_logprob=float(np.sum(self.logprobs[b, n, :L], dtype=np.float64)),
                    logprobs=logprobs, finish_reason=self.finish_reason[b][n],
                    stop_reason=None if self.stop_reason is None else self.stop_reason[b][n]))
            prompt_lp = None
            if self.prompt_token_logprobs is not None:
                p_ids = self.prompt_tokens[b]
                prompt_lp = [None] + [
                    entry(p_ids[j + 1], self.prompt_token_logprobs[b][j],
                          self.prompt_token_ranks[b][j], self.prompt_top_token_ids[b][j],
                          self.prompt_top_logprobs[b][j])
                    for j in range(len(p_ids) - 1)]
            out.append(RequestOutput(
                request_id=str(b), prompt=self.prompts[b],
                prompt_token_ids=tuple(int(i) for i in self.prompt_tokens[b]),
                prompt_logprobs=prompt_lp, outputs=tuple(branches)))
        return out


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob` (vllm/logprobs.py): one token's log-probability.

    Attributes:
      logprob: float, under the raw distribution (no bias, penalties,
        temperature or filters).
      rank: int >= 1, the number of tokens at least as likely (vLLM's rank;
        for top-k entries their place in the top k), or None if unknown.
      decoded_token: the token decoded alone, or None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """vLLM's `CompletionOutput` (vllm/outputs.py): one branch of one prompt.

    Attributes:
      index: the branch index in [0, N).
      text: the generated text (stop token and stop string excluded).
      token_ids: the kept token ids (a final stop token included).
      cumulative_logprob: sum of the kept tokens' raw logprobs.
      logprobs: None, or one `{token_id: Logprob}` dict per kept token (the
        sampled token, then the top k) when `SamplingParams.logprobs` was set.
      finish_reason: "stop", "length" (and in adaptive runs "terminated",
        "not_drawn").
      stop_reason: vLLM's: the stop string (str) that ended the branch, the
        stop token id (int) when it ended on one of
        `SamplingParams.stop_token_ids`, None when it ended by length or the
        model's end-of-sequence id (`Generation.stop_reason`).
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """vLLM's `RequestOutput` (vllm/outputs.py): every branch of one prompt.

    Attributes:
      request_id: the prompt's index in the call, as a string.
      prompt: the prompt as rendered (chat template applied), or None for
        token-id prompts.
      prompt_token_ids: what was prefilled.
      prompt_logprobs: None, or (with `SamplingParams.prompt_logprobs`) one
        entry per prompt token: None for the first, then
        `{token_id: Logprob}` (the prompt token, then the top k).
      outputs: the N `CompletionOutput`s, in branch order.
      finished: always True (generate returns finished requests).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: tuple[CompletionOutput, ...]
    finished: bool = True
