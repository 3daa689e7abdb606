"""Self-consistency on a `Generation`: answers extracted from the texts on the host, then the vote.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxsample.reduce import answers as answers_lib
from jaxsample.reduce.vote import Vote, majority_vote


@dataclasses.dataclass(frozen=True, eq=False)
class SelfConsistency:
    """Result of `self_consistency`.

    Attributes:
      answers: B lists of N normalised answers (`str`, or None where nothing
        was extracted or the branch was marked invalid).
      answer_ids: `[B, N]` int32 id per branch; equal answers share an id
        within a prompt, numbered in first-seen branch order; -1 for None.
      winner: B winning answers (`str`, or None when no branch gave one).
      share: `[B]` float32 winner's fraction of the valid votes (or weight).
      support: `[B]` float32 votes (or summed weight) for the winner.
      first_branch: `[B]` int32 lowest branch index that gave the winner; -1 if none.
      vote: the `Vote` (numpy arrays) returned by `majority_vote`.
    """

    answers: list[list[str | None]]
    answer_ids: np.ndarray
    winner: list[str | None]
    share: np.ndarray
    support: np.ndarray
    first_branch: np.ndarray
    vote: Vote


def self_consistency(
    generation: Any,
    extract: str | Callable[[str], str | None] = "auto",
    weights: Any = None,
    valid: Any = None,
) -> SelfConsistency:
    """Self-consistency: extract each branch's answer and take the majority vote.

    Wang et al. 2022 ("Self-Consistency Improves Chain of Thought Reasoning
    in Language Models", arXiv 2203.11171). Extraction and normalisation run
    on the host (`jaxsample.reduce.answers`); the vote is `majority_vote` (jitted).

    Args:
      generation: a `Generation` (its `texts`, B lists of N strings), or B
        lists of N strings directly (then `weights="mean_logprob"` is not
        available). A flat list of strings is rejected (a string is not a
        row): for one prompt's branches pass `[texts]`.
      extract: an `answers.extract` kind ("auto", "boxed", "number",
        "choice", "text"), or a callable `text -> str | None`. Whatever it
        returns is passed through `answers.normalize`, so "1,000" and
        "1000" are the same answer; empty answers count as None.
      weights: None (plain counting), "mean_logprob" (weights
        `exp(generation.mean_logprob())` in float64, the paper's normalised
        weighted sum; tiny ones, e^-110, still rank), or a `[B, N]` float
        array (e.g. `weights_from_scores`).
      valid: optional `[B, N]` bool; False excludes a branch (e.g. branches
        cut at `max_new_tokens`).

    Returns:
      A `SelfConsistency`.

    Raises:
      ValueError: unknown `extract` kind or `weights` string, texts that are
        not B lists of the same number N >= 1 of strings (a row that is a
        `str` included), or arrays whose shape is not `[B, N]`.
    """
    rows = _rows(generation)
    n = len(rows[0])
    extract_fn = _extractor(extract)
    if valid is not None:
        valid_np = np.asarray(valid)
        if valid_np.shape != (len(rows), n) or valid_np.dtype != np.bool_:
            raise ValueError(f"valid must be a bool array of shape {(len(rows), n)}; got {valid_np.dtype} {valid_np.shape}")
    else:
        valid_np = np.ones((len(rows), n), dtype=bool)
    answers, ids, vocab = _answer_ids(rows, extract_fn, valid_np)
    weights = _weights(weights, generation)
    vote = jax.device_get(majority_vote(ids, ids >= 0, weights))
    winner = [vocab[b][int(w)] if w >= 0 else None for b, w in enumerate(vote.winner)]
    return SelfConsistency(
        answers=answers,
        answer_ids=ids,
        winner=winner,
        share=np.asarray(vote.share),
        support=np.asarray(vote.support),
        first_branch=np.asarray(vote.first_branch),
        vote=Vote(*(np.asarray(x) for x in vote)),
    )


def _rows(generation) -> list[list]:
    """B lists of N texts from a Generation or from the lists; ValueError otherwise."""
    texts = generation.texts if hasattr(generation, "texts") else generation
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise ValueError("generation must be a Generation or B lists of N strings")
    for b, r in enumerate(texts):
        if isinstance(r, (str, bytes)) or not isinstance(r, (Sequence, np.ndarray)):
            raise ValueError(
                f"generation must be B lists of N strings, but row {b} is a {type(r).__name__} "
                f"({r!r:.40}), not a list of strings; for one prompt's N texts pass [texts]")
    rows = [list(r) for r in texts]
    if not rows:
        raise ValueError("generation has no prompts (B = 0)")
    n = len(rows[0])
    if n == 0 or any(len(r) != n for r in rows):
        raise ValueError(f"texts must be B lists of the same number N >= 1 of strings; got lengths {[len(r) for r in rows]}")
    return rows


def _extractor(extract) -> Callable[[str], str | None]:
    """`text -> answer or None` of an `answers.extract` kind or a callable (guarded)."""
    if isinstance(extract, str):
        if extract not in answers_lib.KINDS:
            raise ValueError(f"extract must be one of {answers_lib.KINDS} or a callable; got {extract!r}")
        kind = extract
        return lambda t: answers_lib.extract(t, kind)
    if callable(extract):
        return answers_lib.guarded(extract)
    raise ValueError(f"extract must be a kind string or a callable; got {type(extract).__name__}")


def _answer_ids(rows, extract_fn, valid_np):
    """(each branch's normalised answer or None, `[B, N]` int32 answer ids (-1: none),
    each row's answers in first-seen order: id i is vocab[b][i])."""
    answers: list[list[str | None]] = []
    ids = np.full((len(rows), len(rows[0])), -1, dtype=np.int32)
    vocab: list[list[str]] = []
    for b, row in enumerate(rows):
        seen: dict[str, int] = {}
        row_answers: list[str | None] = []
        for i, text in enumerate(row):
            ans = extract_fn(text) if valid_np[b, i] else None
            if ans is not None:
                ans = answers_lib.normalize(ans) or None
            if ans is not None:
                ids[b, i] = seen.setdefault(ans, len(seen))
            row_answers.append(ans)
        answers.append(row_answers)
        vocab.append(list(seen))
    return answers, ids, vocab


def _weights(weights, generation):
    """The vote's weights: None, a `[B, N]` array as given, or for "mean_logprob"
    exp(the branches' mean logprob) in float64."""
    if isinstance(weights, str):
        if weights != "mean_logprob":
            raise ValueError(f"weights must be None, 'mean_logprob' or a [B, N] array; got {weights!r}")
        if not hasattr(generation, "mean_logprob"):
            raise ValueError("weights='mean_logprob' needs a Generation (with logprobs), not bare texts")
        # float64, not `weights_from_mean_logprob`'s float32: exp(-110) is 0 in
        # float32 but ranks in float64 (majority_vote scales each row exactly).
        weights = np.exp(np.asarray(generation.mean_logprob(), dtype=np.float64))
    return weights
