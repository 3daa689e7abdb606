"""Training on the engine: differentiable log-probabilities, rollouts, GRPO, LoRA.

Data flow of one GRPO step, one file per stage:

    rollout.py     prompts --generate with the current weights (N branches per
                   prompt sharing its prefix)--> Batch [B, N, T] in group
                   layout + the behaviour log-probabilities + texts
    logprobs.py    token_logprobs(model, params, tokens [B, S]) -> [B, S]: the
                   sampler's per-token log-probabilities recomputed as a pure,
                   differentiable function of the weights, C positions of
                   logits at a time
    lora.py        low-rank adapters: unmerged for the gradient, merged for rollouts
    grpo.py        rewards -> group-relative advantages -> the clipped
                   policy-gradient loss (KL optional) -> optax; the loop over a
                   `Policy` (LoRA, full fine-tuning; the Bridge recipe's in
                   jaxsample.bridge_training)
    checkpoints.py the trained state and its orbax checkpoints (resume at the
                   same step with the same data order)
"""
