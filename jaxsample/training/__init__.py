"""Training on the engine: differentiable log-probabilities, rollouts, GRPO, LoRA.

    logprobs.py   token_logprobs(model, params, tokens [B, S]) -> [B, S]: the
                  sampler's per-token log-probabilities recomputed as a pure,
                  differentiable function of the parameters, C positions at a time
"""
