"""Adaptive self-consistency: draw branches in windows over one prefill, stop when
the answer is settled, terminate low-confidence branches, and bill what was saved.

The rules are in `jaxsample.reduce.adaptive_rules` (ESC, Adaptive-Consistency's Beta and
Dirichlet criteria, DeepConf). Branch i of prompt b has the key it has as
branch i of `generate(n=max_n)`, so an adaptive run equals the offline rule
(`adaptive_rules.replay`) applied in branch order to a fixed pool with the same
seed: every saving can be checked against the run it replaces.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import numpy as np

from jaxsample import cost
from jaxsample import progress as progress_lib
from jaxsample.engine import stops as stops_lib
from jaxsample.engine.api import final_text, finish, text_tokenizer
from jaxsample.engine.inputs import check_int
from jaxsample.engine.session import Session
from jaxsample.errors import InputError
from jaxsample.generation import Generation
from jaxsample.lm import LanguageModel
from jaxsample.reduce import adaptive_rules as rules
from jaxsample.reduce import answers as answers_lib
from jaxsample.sampling_params import MAX_LOGPROBS, SamplingParams, refuse_foreign_keywords


@dataclasses.dataclass(frozen=True, eq=False)
class AdaptiveResult:
    """The outcome of `adaptive_self_consistency`.

    Attributes:
      winner: B answers (normalised strings) or None where no branch answered.
      share: `[B]` float32, the winner's share of the counted vote weight
        (support / the total weight of the counted branches).
      support: `[B]` float32, the winner's votes: the number of counted
        branches that gave it, or with `confidence` the sum of their weights
        (lowest group confidences), as `jaxsample.majority_vote`'s
        `Vote.support`; 0 where no branch answered.
      answers: B lists of n_used[b] answers (None: none found), branch order.
      counted: B lists of n_used[b] bools: the branch voted (valid, not terminated).
      n_used: `[B]` int32 branches drawn per prompt.
      terminated: `[B]` int32 branches terminated by the confidence rule.
      confidence: B lists of n_used[b] floats, each branch's lowest group
        confidence (DeepConf; empty lists without `confidence`).
      thresholds: `[B]` float64 DeepConf thresholds (nan without `confidence`).
      generation: the `Generation` of the branches drawn, `[B, max(n_used), T]`
        (finish_reason "not_drawn" past a prompt's n_used, "terminated" for
        terminated branches); its `bill` has the `adaptive` part
        (`cost.AdaptiveSaving`: what was decoded against the same request at
        a fixed max_n).
    """

    winner: list
    share: np.ndarray
    support: np.ndarray
    answers: list
    counted: list
    n_used: np.ndarray
    terminated: np.ndarray
    confidence: list
    thresholds: np.ndarray
    generation: Generation


def extractor(extract) -> Callable[[str], str | None]:
    if callable(extract):
        guarded = answers_lib.guarded(extract)

        def fn(text):
            a = guarded(text)
            a = None if a is None else answers_lib.normalize(a)
            return a or None
        return fn
    if extract not in answers_lib.KINDS:
        raise InputError(f"extract must be one of {answers_lib.KINDS} or a callable, "
                         f"got {extract!r}")
    return lambda text: answers_lib.extract(text, extract)


OPTIONS = ("max_n", "window", "rule", "threshold", "confidence", "warmup", "group_size",
           "chunk_size", "confidence_source")  # adaptive_self_consistency's rule options


def check_options(*, max_n: int = 64, window: int = 8, rule: str = "esc",
                  threshold: float = 0.95, confidence: str | None = None, warmup: int = 16,
                  group_size: int = 16, chunk_size: int = 8,
                  confidence_source: str = "top_logprobs"):
    """`adaptive_self_consistency`'s checks of its rule options (see there), before
    any compute.

    Returns:
      (max_n, window, warmup, group_size, chunk_size) as ints (warmup 0
      without `confidence`).
    Raises:
      InputError: an option outside its range, naming it.
    """
    max_n = check_int("max_n", max_n, 1, 2**20)
    window = check_int("window", window, 1, max_n)
    if rule not in rules.RULES:
        raise InputError(f"rule must be one of {rules.RULES}, got {rule!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            0.0 < float(threshold) < 1.0):
        raise InputError(f"threshold must be a float in (0, 1), got {threshold!r}")
    if confidence not in rules.CONFIDENCES:
        raise InputError(f"confidence must be one of {rules.CONFIDENCES}, got {confidence!r}")
    group_size = check_int("group_size", group_size, 1, 2**31 - 1)
    chunk_size = check_int("chunk_size", chunk_size, 1, 2**31 - 1)
    if confidence is not None:
        warmup = check_int("warmup", warmup, window, max_n)
        if warmup % window:
            raise InputError(f"warmup ({warmup}) must be a multiple of window ({window}): "
                             "the threshold is set between rounds")
    else:
        warmup = 0
    if confidence_source not in rules.CONFIDENCE_SOURCES:
        raise InputError(f"confidence_source must be one of {rules.CONFIDENCE_SOURCES}, "
                         f"got {confidence_source!r}")
    return max_n, window, warmup, group_size, chunk_size


@refuse_foreign_keywords("jaxsample.adaptive_self_consistency")
def adaptive_self_consistency(lm: LanguageModel, prompts, params: SamplingParams | None = None, *,
                              max_n: int = 64, window: int = 8, rule: str = "esc",
                              threshold: float = 0.95, confidence: str | None = None,
                              warmup: int = 16, group_size: int = 16, extract="auto",
                              chat: bool = False, mesh=None, chunk_size: int = 8,
                              compact: bool = True, prompt_index_offset: int = 0,
                              progress=False,
                              confidence_source: str = "top_logprobs") -> AdaptiveResult:
    """Self-consistency that stops spending on branches that cannot change the answer.

    The prompts are prefilled once. Each prompt's branches (global indices
    0 .. max_n - 1) run in a pool of `window` slots (`engine.round.Round`,
    decoded in chunks of `chunk_size` steps): a finished branch's slot takes
    the prompt's next branch at once, with no rounds. `rule` decides, per
    prompt, at n = window, 2 window, ... (as `rules.replay`), as soon as the
    first n branches are done; a prompt that stops gives up its later
    branches (those drawn ahead are reported "not_drawn"). With
    `confidence`, the first `warmup` branches set DeepConf's threshold (later
    branches start only once it is set) and any
    later branch whose group confidence falls below it is terminated at the
    next chunk boundary; votes are then weighted by each branch's lowest group
    confidence (terminated branches excluded). References: ESC (Li et al.
    2024, arXiv 2401.10480), Adaptive-Consistency (Aggarwal et al. 2023, arXiv
    2305.11860), DeepConf (Fu et al. 2025, arXiv 2508.15260); the rules are in
    `jaxsample.reduce.adaptive_rules`.

    Args:
      lm, prompts, chat, mesh, prompt_index_offset: as `jaxsample.generate`.
      params: sampling settings; `params.n` is ignored (`max_n` and `window`
        decide); `params.logprobs` sets k of DeepConf's token confidence
        (default 20).
      max_n: the most branches per prompt, in [1, 2**20].
      window: branches per round, in [1, max_n]; on a mesh, a multiple of its
        "branch" axis.
      rule: "esc", "beta", "dirichlet" or "none" (see `jaxsample.reduce.adaptive_rules`).
      threshold: posterior probability for "beta"/"dirichlet", in (0, 1).
      confidence: None, "deepconf-low" (keep about the top 10% by confidence)
        or "deepconf-high" (about the top 90%).
      warmup: DeepConf's warm-up branches per prompt, a multiple of `window` in
        [window, max_n]; no stop check before them.
      group_size: DeepConf's sliding window in tokens, >= 1.
      extract: an `answers.extract` kind or a callable `text -> answer`.
      chunk_size: decode steps between host checks (stop strings,
        confidence, compaction), >= 1.
      compact: gather live branches into smaller buckets as branches finish.
      progress: as `jaxsample.generate`: True (stderr) or a
        `jaxsample.progress.Progress` reports preparing the programs and, after
        every chunk, the round, the branches drawn and the prompts settled
        (`Progress.adaptive_update`; off a terminal a line every `interval` s).
      confidence_source: DeepConf's token confidence, "top_logprobs" (its
        own: minus the mean of the top-k logprobs, k = `params.logprobs` or
        20, copied to the host every chunk) or "signals" (the self-certainty
        recorded by the step with `SamplingParams(signals=True)`,
        `adaptive_rules.token_confidence_from_signals`: DeepConf's formula with
        k = V, minus log V; no top-k over V and 3 floats per token instead of
        k). The group means, threshold and terminations are computed on the
        host from it in both cases.

    Returns:
      An `AdaptiveResult`.

    Raises:
      InputError: an argument outside the ranges above, or anything
        `generate` refuses; before any compute.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
    max_n, window, warmup, group_size, chunk_size = check_options(
        max_n=max_n, window=window, rule=rule, threshold=threshold, confidence=confidence,
        warmup=warmup, group_size=group_size, chunk_size=chunk_size,
        confidence_source=confidence_source)
    on_signals = bool(confidence) and confidence_source == "signals"
    k = (params.logprobs or MAX_LOGPROBS) if confidence and not on_signals else (params.logprobs or 0)
    get_answer = extractor(extract)
    observer = progress_lib.resolve(progress)
    session = Session(lm, prompts, params.replace(n=window, signals=params.signals or on_signals),
                      chat=chat, mesh=mesh, prompt_index_offset=prompt_index_offset,
                      top_logprobs=k, observer=observer)
    pool = _Pool(session, _Rule(max_n=max_n, window=window, rule=rule, threshold=threshold,
                                confidence=confidence, warmup=warmup, group_size=group_size,
                                on_signals=on_signals), get_answer)
    pool.run(chunk_size, compact, observer)
    pool.drop_undrawn()
    gen = finish(session, [pool.rnd], pool.reasons)
    gen = dataclasses.replace(gen, params=params.replace(n=max_n, seed=session.params.seed))
    return pool.result(gen)


class _Rule(NamedTuple):
    """`adaptive_self_consistency`'s checked rule options (see there)."""

    max_n: int
    window: int
    rule: str
    threshold: float
    confidence: str | None
    warmup: int
    group_size: int
    on_signals: bool  # DeepConf's token confidence from the step's signals


class _Pool:
    """The host side of an adaptive run: one pool over every prompt's max_n branches.

    `window` slots per row: a prompt's next branch takes a slot as soon as one
    of its slots frees (no rounds). The rule reads the answers in global
    branch order at the checkpoints replay uses (n = window, 2 window, ...:
    `rules.replay`), each as soon as that many leading branches are done; a
    prompt that stops gives up its running and waiting branches beyond n
    (drawn ahead, reported "not_drawn"; their slot-steps stay in the bill's
    branch_steps).
    """

    def __init__(self, session: Session, o: _Rule, get_answer):
        self.session, self.o, self.get_answer = session, o, get_answer
        B = session.B
        self.answers = [[] for _ in range(B)]
        self.lowest = [[] for _ in range(B)]
        self.term = [[] for _ in range(B)]
        self.thresholds = np.full(B, np.nan)
        ids = np.broadcast_to(np.arange(o.max_n, dtype=np.int32), (B, o.max_n))
        self.rnd = session.round(range(B), ids, max_slots=o.window)
        if o.confidence:  # later branches start once the warm-up has set the threshold
            self.rnd.admit[:] = o.warmup
        self.checkpoint = np.full(B, min(o.window, o.max_n), np.int64)
        self.n_used = np.zeros(B, np.int64)
        self.settled = np.zeros(B, bool)
        self.reasons = {}
        sp = session.params
        self.watch = (stops_lib.StopWatch(text_tokenizer(session), sp.stop, sp.min_tokens)
                      if sp.stop else None)
        self.checks = 0

    def token_conf(self, i, c, L):
        """DeepConf's C_t of branch (i, c)'s first L tokens."""
        if self.o.on_signals:
            return rules.token_confidence_from_signals(self.rnd.signals[i, c, :L, 1])
        return rules.token_confidence(self.rnd.top_logprobs[i, c, :L])

    def record(self, b, n):
        """The answer, termination and confidence of branch (b, n), once done."""
        rnd = self.rnd
        text, _, _ = final_text(self.session, b, rnd.tokens[b, n], rnd.lengths[b, n],
                                rnd.stopped[b, n])
        self.answers[b].append(self.get_answer(text))
        self.term[b].append(self.reasons.get((b, n)) == "terminated")
        if self.o.confidence:
            self.lowest[b].append(rules.lowest_group_confidence(
                self.token_conf(b, n, int(rnd.lengths[b, n])), self.o.group_size))

    def run(self, chunk_size: int, compact: bool, observer) -> None:
        """Decode chunk by chunk until every prompt is settled or nothing runs."""
        rnd = self.rnd
        while True:
            more = rnd.run(chunk_size)
            self.end_branches()
            for b in np.nonzero(~self.settled)[0]:
                self.settle(b)
            if observer is not None:
                drawn = int((rnd.lengths > 0).sum())
                observer.adaptive_update(self.checks, drawn, int(self.settled.sum()),
                                         self.session.B, final=bool(self.settled.all()))
            if self.settled.all() or not more:
                break
            if compact:
                rnd.compact()

    def end_branches(self) -> None:
        """End the branches whose new tokens hold a stop string, and (DeepConf, past the
        warm-up) those whose group confidence fell below the prompt's threshold."""
        o, rnd = self.o, self.rnd
        end = np.zeros(rnd.done.shape, bool)
        for b, n, new in rnd.new_tokens():
            if self.watch is not None and self.watch.feed((b, n), new):
                end[b, n] = True
            if o.confidence and n >= o.warmup and not np.isnan(self.thresholds[b]):
                conf = self.token_conf(b, n, int(rnd.lengths[b, n]))
                if rules.first_low_group(conf, o.group_size, self.thresholds[b]) is not None:
                    end[b, n] = True
                    self.reasons[(b, n)] = "terminated"
        rnd.finish_slots(end)

    def settle(self, b) -> None:
        """Apply the rule at each of prompt b's checkpoints whose branches are all done:
        set DeepConf's threshold after the warm-up; stop the prompt, or move its
        checkpoint a window on."""
        o, rnd = self.o, self.rnd
        while not self.settled[b] and rnd.done[b, :self.checkpoint[b]].all():
            n = int(self.checkpoint[b])
            for c in range(len(self.answers[b]), n):
                self.record(b, c)
            self.checks = max(self.checks, n // o.window + (n % o.window > 0))
            if o.confidence and n == o.warmup:
                self.thresholds[b] = rules.threshold_from_warmup(self.lowest[b][:o.warmup],
                                                                 o.confidence)
                rnd.admit[b] = o.max_n
            votes = [x if not t else None for x, t in zip(self.answers[b], self.term[b])]
            if n >= o.max_n or (n >= o.warmup and rules.should_stop(o.rule, votes, o.window,
                                                                      o.threshold)):
                self.settled[b], self.n_used[b] = True, n
                rest = np.zeros(rnd.done.shape, bool)
                rest[b, n:] = True
                rnd.finish_slots(rest)  # drawn ahead: never counted
            else:
                self.checkpoint[b] = min(n + o.window, o.max_n)

    def drop_undrawn(self) -> None:
        """Branches beyond n_used: not drawn, as the offline rule has it."""
        rnd = self.rnd
        for b in range(self.session.B):
            used = int(self.n_used[b])
            for n in range(used, self.o.max_n):
                self.reasons[(b, n)] = "not_drawn"
                rnd.clear_branch(b, n)
                rnd.lengths[b, n], rnd.stopped[b, n] = 0, False
            del self.answers[b][used:], self.term[b][used:], self.lowest[b][used:]

    def result(self, gen: Generation) -> AdaptiveResult:
        """The vote of each prompt's counted branches, and `gen` with the adaptive bill."""
        n_used = np.array([len(a) for a in self.answers], np.int32)
        winners, supports, shares, counted = [], [], [], []
        for b in range(self.session.B):
            votes = [a if not t else None for a, t in zip(self.answers[b], self.term[b])]
            w = ([x if v is not None else 0.0 for x, v in zip(self.lowest[b], votes)]
                 if self.o.confidence else None)
            winner, support, share = rules.tally(votes, w)
            winners.append(winner)
            supports.append(support)
            shares.append(share)
            counted.append([v is not None for v in votes])
        saving = _saving(self.session, gen, n_used, self.term, self.o.max_n, self.checks)
        gen = dataclasses.replace(gen, bill=dataclasses.replace(gen.bill, adaptive=saving))
        return AdaptiveResult(winner=winners, share=np.array(shares, np.float32),
                              support=np.array(supports, np.float32), answers=self.answers,
                              counted=counted, n_used=n_used,
                              terminated=np.array([sum(t) for t in self.term], np.int32),
                              confidence=self.lowest, thresholds=self.thresholds,
                              generation=gen)


def _saving(session: Session, gen: Generation, n_used, term, max_n: int,
            rounds: int) -> cost.AdaptiveSaving:
    """The run against the same request at a fixed max_n: each prompt's branches not
    drawn, and the rest of its terminated ones, at the mean length of its complete
    branches."""
    cfg = session.cfg
    decoded = gen.bill.decoded_tokens_per_branch  # device lengths, [B][width]
    fixed_tokens = fixed_flops = 0
    for b in range(session.B):
        P = len(session.ids[b])
        lens = [int(x) for x in decoded[b][:n_used[b]]]
        full = [L for L, t in zip(lens, term[b]) if not t]
        mean = float(np.mean(full)) if full else float(np.mean(lens)) if lens else 0.0
        est = full + [int(math.ceil(mean))] * (max_n - len(full))
        fixed_tokens += sum(est)
        fixed_flops += sum(int(cost.decode_flops(cfg, P, L)) for L in est)
    return cost.AdaptiveSaving(
        max_n=max_n, rounds=rounds, branches_drawn=int(n_used.sum()),
        fixed_decoded_tokens=fixed_tokens, fixed_decode_flops=fixed_flops,
        token_saving=1.0 - gen.bill.decoded_tokens_total / max(fixed_tokens, 1),
        flop_saving=1.0 - gen.bill.decode_flops_shared / max(fixed_flops, 1))
