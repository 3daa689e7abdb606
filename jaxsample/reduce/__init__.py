"""Reducing N branches per prompt to one answer: the reduce stage.

    answers.py           answer extraction and normalisation (host, pure Python)
    arrays.py            the reducers' boundary checks
    selection.py         best-of-N and branch scores by name
    vote.py              majority vote, DeepConf's confidence vote, Borda vote (jitted)
    self_consistency.py  self-consistency on a `Generation`'s texts
    estimators.py        pass@k, maj@k, best-of-k (exact, unbiased)
    adaptive_rules.py    adaptive stopping rules as pure host functions (ESC, Beta,
                         Dirichlet, DeepConf) and `replay` on a fixed pool
    adaptive.py          `adaptive_self_consistency`: rounds of branches until a rule
                         settles the vote

Letters: B prompts, N branches per prompt. Conventions shared by every reducer:

* A branch marked invalid (`valid=False`) never wins and is never counted.
* Ties go to the lowest branch index: for best-of-N, the lowest index among
  the tied top scores; for a vote, the answer whose *first occurrence* has the
  lowest branch index (the `collections.Counter.most_common` convention).
* A row with nothing valid gives `-1` (index, answer id, first branch).

Every reducer is written for static shapes, so it runs under `jit`, `vmap`
and inside the decode loop.
"""

from jaxsample.reduce.selection import (
    SCORE_NAMES,
    best_of_n,
    branch_scores,
    confidence_scores,
    score_mean_logprob,
    score_sum_logprob,
    token_confidence,
)
from jaxsample.reduce.self_consistency import SelfConsistency, self_consistency
from jaxsample.reduce.vote import (
    Vote,
    borda_vote,
    confidence_vote,
    majority_vote,
    weights_from_mean_logprob,
    weights_from_scores,
)

__all__ = ["Vote", "SelfConsistency", "best_of_n", "majority_vote", "self_consistency",
           "score_sum_logprob", "score_mean_logprob", "weights_from_mean_logprob",
           "weights_from_scores", "SCORE_NAMES", "branch_scores", "confidence_scores",
           "token_confidence", "confidence_vote", "borda_vote"]
