"""Token choice for one distribution `logits [V]`, in one documented order.

The decode engine vmaps these over the branch axis N (and the rows R) inside
its jitted `lax.while_loop`. Letter table: docs/ARCHITECTURE.md.

    processors.py  the raw logits masked (`prepare`), the logits processors
                   (`process_logits`), stop ids (`pad_stop_ids`, `is_stop`)
    select.py      the kept set: temperature, top-k, top-p, min-p (`keep_mask`),
                   decided on a top-k pre-selection of candidates
    draw.py        the Gumbel-max draw over the kept set (`choose_token`)
    logprobs.py    raw logprobs, ranks, top-k logprobs, selection signals, and
                   the host check for rows without a distribution

Order of the steps: the processors that may change the argmax first, in
vLLM's v1 sampler order (vllm/v1/sample/sampler.py: logit bias and
min-tokens, then `apply_penalties`: repetition, frequency, presence), all in
`process_logits`; then Hugging Face's warper order (`TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, each applied to
the already tempered and filtered scores) in `choose_token`. (vLLM applies
min-p before top-k / top-p; we keep Hugging Face's order for the filters.)

    step         | rule
    -------------+---------------------------------------------------------------
    padding      | rows >= vocab_limit (vocabulary padding of the embedding) are
                 | never sampled and excluded from every step, including the
                 | reported logprob. Tokens whose logit is -inf are never kept
                 | (except as the single token of a row without a distribution).
    NaN, inf     | a NaN logit counts as -inf: never sampled, excluded from the
                 | logprob's normaliser, like padding. A +inf logit counts as
                 | the largest finite float32, so the +inf tokens share all the
                 | mass (the softmax limit). A row whose every valid logit is
                 | NaN or -inf has no distribution: the token is 0 and the
                 | logprob is NaN, the only NaN `choose_token` ever returns.
                 | `generate` checks for it on the host and raises
                 | `NumericalError` (see `check_logprobs`): it never returns
                 | such a token.
    logit bias   | x = logits + bias (`SamplingParams.logit_bias`, clamped to
                 | [-100, 100]; 0 elsewhere).
    min-tokens   | while the branch has generated < min_tokens tokens, every
                 | stop id (the model's end ids and stop_token_ids, even with
                 | ignore_eos) has x = -inf.
    repetition   | for tokens of the prompt or of the branch's generated tokens:
                 | x / p where x > 0, x * p elsewhere (p = repetition_penalty;
                 | 1 is off).
    frequency    | x -= frequency_penalty * count (count: how often the branch
                 | generated the token; the prompt does not count).
    presence     | x -= presence_penalty * (count > 0).
                 | The steps above are `process_logits`; without any of them
                 | (the engine's static flag off) x is the raw logits, with
                 | no arithmetic on them.
    temperature  | z = (x - max(x)) / temperature. temperature == 0
                 | means greedy: the argmax of x (first index on
                 | ties), whatever the filters say; there is no division by
                 | zero and no NaN.
    top-k        | keep the k highest tempered logits; k == 0 or k >= V is off.
                 | Ties at the k-th value: exactly k tokens are kept, by rank;
                 | among equal logits the lower token index ranks first
                 | (`lax.top_k`'s convention).
    top-p        | on softmax(z) renormalised over the top-k survivors, keep the
                 | smallest rank prefix whose mass reaches p (cumulative >= p);
                 | the top token is always kept; p >= 1 is off. A token is kept
                 | iff the mass ranked strictly above it is < p - 1e-6: the
                 | tolerance absorbs float32 rounding of the cumulative sum, so
                 | that e.g. probs [0.3, 0.1, 0.1, 0.5], p = 0.8 keeps {0, 3}
                 | (0.5 + 0.3 may round to 0.79999995). Mass within 1e-6 below
                 | p counts as reaching p. Ties rank as in top-k.
    min-p        | keep tokens with prob >= min_p * max prob on the distribution
                 | after top-k/top-p (the ratio is renormalisation-free:
                 | z_i - z_max >= log(min_p)); inclusive, with a relative
                 | tolerance of 1e-6 on the ratio for the same float32 reason;
                 | min_p == 0 is off.
    sample       | Gumbel-max over the kept tokens' tempered logits with `key`:
                 | each kept token is drawn with probability proportional to
                 | exp(z). The top-ranked token is always in the kept set, so
                 | it is never empty.
    logprob      | log_softmax of the *raw* logits (no bias, no penalties,
                 | temperature 1, no filters, padding rows excluded) at the
                 | chosen token, as vLLM reports by default
                 | (`logprobs_mode="raw_logprobs"`).

References: Hugging Face transformers `generation/logits_process.py`
(`RepetitionPenaltyLogitsProcessor`, `TopKLogitsWarper`, `TopPLogitsWarper`,
`MinPLogitsWarper`); vLLM `vllm/sampling_params.py` (fields, ranges, the
logit-bias clamp), `vllm/v1/sample/sampler.py` (processor order, raw logprobs
by default), `vllm/v1/sample/logits_processor/builtin.py` (logit bias,
min-tokens), `vllm/model_executor/layers/utils.py` (`apply_penalties`);
Keskar et al. 2019, "CTRL" (arXiv 1909.05858, the repetition penalty); Nguyen et al.
2024, "Min-p sampling" (arXiv 2407.01082); Holtzman et al. 2020, "The
curious case of neural text degeneration" (nucleus sampling).
"""

from jaxsample.engine.sampling.draw import choose_token
from jaxsample.engine.sampling.logprobs import (
    NUM_SIGNALS,
    SIGNAL_NAMES,
    check_logprobs,
    position_logprobs,
    token_rank,
    token_signals,
    top_logprobs,
)
from jaxsample.engine.sampling.processors import is_stop, pad_stop_ids, prepare, process_logits
from jaxsample.engine.sampling.select import MIN_P_TOL, TOP_CANDIDATES, TOP_P_TOL, keep_mask

__all__ = ["choose_token", "keep_mask", "process_logits", "prepare", "is_stop", "pad_stop_ids",
           "token_rank", "position_logprobs", "top_logprobs", "token_signals", "check_logprobs",
           "NUM_SIGNALS", "SIGNAL_NAMES", "TOP_CANDIDATES", "TOP_P_TOL", "MIN_P_TOL"]
