"""`SamplingParams`: one request's sampling fields, validated on the host.

The fields and their names are vLLM's (`vllm.SamplingParams`); the token
choice they drive is `jaxsample.engine.sampling` (its docstring is the table of
what each field does on the device, in order). Everything here is plain Python and
numpy: constructing a `SamplingParams` never touches JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Sequence

import numpy as np

from jaxsample.errors import ConfigError, ForeignArgumentError, lone_surrogate, short_repr

_SEED_LIMIT = 2**32

# --------------------------------------------------------------------------
# SamplingParams (host side)
# --------------------------------------------------------------------------


_INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # SamplingParams.logprobs: vLLM caps it by max_logprobs (20 by default)


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


# Keywords of vLLM's SamplingParams and Hugging Face's `generate` that jaxsample
# spells differently or does not have: each gets a message naming the
# jaxsample way instead of Python's bare "unexpected keyword argument".
FOREIGN_KEYWORDS = {
    "num_return_sequences": "use n (Hugging Face's num_return_sequences is SamplingParams.n)",
    "do_sample": "use temperature=0 for greedy (do_sample=False); sampling is the default "
                 "(temperature=1.0)",
    "max_length": "use max_new_tokens (counts new tokens only; Hugging Face's max_length "
                  "counts the prompt too) or vLLM's max_tokens",
    "best_of": "vLLM's best_of (draw best_of, return the best n) is not a field here: use "
               "n (the branches drawn) and best_of_n (jaxsample.best_of_n(gen.mean_logprob())"
               ") or self_consistency to pick",
    "use_beam_search": "beam search is not supported; sample n branches and pick one with "
                       "jaxsample.best_of_n (or vote with jaxsample.self_consistency)",
    "num_beams": "beam search is not supported; sample n branches and pick one with "
                 "jaxsample.best_of_n (or vote with jaxsample.self_consistency)",
}


def check_foreign_keywords(where: str, kwargs) -> None:
    """Raise ForeignArgumentError for the first of `kwargs` in FOREIGN_KEYWORDS.

    Args:
      where: the callee as the user typed it ("SamplingParams", "jaxsample.generate").
      kwargs: the keyword names given.
    """
    for name in kwargs:
        if name in FOREIGN_KEYWORDS:
            hint = FOREIGN_KEYWORDS[name]
            if where != "SamplingParams" and hint.startswith("use "):
                hint += " in SamplingParams(...), passed as params"
            raise ForeignArgumentError(f"{where}: {name}: {hint}")


def refuse_foreign_keywords(where: str):
    """Decorator: `fn(**kwargs)` with a FOREIGN_KEYWORDS name raises
    ForeignArgumentError naming the jaxsample equivalent, before `fn` runs; any
    other unknown keyword keeps Python's own TypeError. The signature is kept
    (`functools.wraps`)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            check_foreign_keywords(where, kwargs)
            return fn(*args, **kwargs)
        return inner
    return wrap


MAX_BIAS = 100.0  # SamplingParams.logit_bias is clamped to [-MAX_BIAS, MAX_BIAS], as vLLM does
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (vLLM, OpenAI)
DEFAULT_MAX_NEW_TOKENS = 16  # vLLM's default max_tokens (the command line's is 128)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample N branches for one request (vLLM's field names).

    All fields are validated in `__post_init__`; numpy scalars become Python
    scalars and lists become tuples, so instances are hashable.

    Attributes:
      n: branches per prompt (N), in [1, 2**31 - 1].
      temperature: >= 0 and finite; 0 means greedy decoding (argmax of the
        processed logits: after logit bias, min-tokens and penalties).
      top_k: keep the k most likely tokens; 0 (default) is off, and so is any
        k >= V (the vocabulary size). vLLM's -1 also means off and is stored
        as 0. Must fit int32: in [-1, 2**31 - 1].
      top_p: nucleus mass in (0, 1]; 1 (default) is off.
      min_p: in [0, 1]; keep tokens with prob >= min_p * max prob; 0 is off.
      max_new_tokens: the decode budget per branch in tokens, in
        [1, 2**31 - 1] (Hugging Face's name; default 16, vLLM's default
        `max_tokens`; the command line's `--max-new-tokens` defaults to 128).
      max_tokens: vLLM's name for the same budget. Give either; after
        construction both fields hold the value (`params.max_new_tokens` is
        the one the engine reads). Giving both with different values is a
        ConfigError (equal values are accepted, so that
        `SamplingParams(**dataclasses.asdict(p))` round-trips); `replace`
        with one of them changes both.
      stop_token_ids: extra token ids in [0, 2**31 - 1) (they must fit
        int32) that end a branch, added to the
        model's own end-of-sequence ids. The stop token is kept in the output.
      stop: stop strings (non-empty); a single string is accepted and wrapped
        in a tuple, as vLLM does. The stop string is excluded from the text.
      seed: the PRNG seed in [0, 2**32), or None to draw a random one (the
        engine records the seed it used in `Generation.params`).
      logprobs: None, or k in [0, 20]: also return the k most likely tokens and
        their log-probabilities under the raw distribution at every generated
        position (`Generation.top_logprobs`/`top_token_ids`), and the rank of
        each sampled token (`Generation.token_ranks`), as vLLM's `logprobs`
        (vllm/sampling_params.py; raw, before logit bias, penalties,
        temperature and filters: vLLM's default `logprobs_mode`). 0 records
        only the ranks (vLLM: the sampled token's logprob alone).
      logprobs_mode: which log-probability of each sampled token is reported
        (`Generation.logprobs`, `CompletionOutput.logprobs` and
        `cumulative_logprob`; vLLM's field): "raw_logprobs" (default) under
        the model's distribution (temperature 1, no processors or filters);
        "processed_logprobs" under the distribution the token was drawn from
        (after logit bias, min-tokens, penalties, temperature, top-k, top-p and
        min-p, renormalised over the kept tokens; 0 at temperature 0), the
        behaviour policy of an importance ratio. The top-k alternatives and
        ranks are raw in both modes, so "processed_logprobs" takes `logprobs`
        None or 0. A static setting: on, it compiles another step.
      min_tokens: in [0, max_new_tokens]: until a branch has generated this
        many tokens, every stop token id (the model's end ids and
        `stop_token_ids`, even with `ignore_eos`: vLLM's
        `all_stop_token_ids`) has logit -inf, and stop strings are not
        looked for (vLLM looks for them once more than `min_tokens` tokens
        were generated). 0 is off.
      ignore_eos: the model's end-of-sequence ids do not end a branch (vLLM);
        `stop_token_ids` and stop strings still do.
      presence_penalty: in [-2, 2]; subtracted from the logit of every token
        that the branch has generated at least once (vLLM / OpenAI: over the
        generated tokens only, not the prompt). 0 is off.
      frequency_penalty: in [-2, 2]; times the number of times the branch has
        generated the token, subtracted from its logit. 0 is off.
      repetition_penalty: > 0 and finite; for every token of the prompt or of
        the branch's generated tokens, a positive logit is divided by it and
        a negative one multiplied (Hugging Face's
        `RepetitionPenaltyLogitsProcessor`, vLLM's `apply_penalties`;
        Keskar et al. 2019). 1 is off.
      logit_bias: `{token_id: bias}` (or a sequence of `(token_id, bias)`
        pairs), added to the logits before everything else. Ids are ints
        >= 0 (strings of ASCII decimal digits are converted, as vLLM's OpenAI
        path does; any other string key is a ConfigError naming it);
        they are checked against the model's vocabulary by `generate`
        (InputError). Biases are finite and clamped to [-100, 100], as vLLM
        does. Stored as a tuple of `(token_id, bias)` pairs sorted by id, so
        instances stay hashable; `dict(params.logit_bias)` gives the mapping.
      prompt_logprobs: None, or k in [0, 20]: also return, for every prompt
        token after the first, its log-probability given the tokens before
        it and its rank, plus the k most likely tokens there
        (`Generation.prompt_logprobs`), under the raw distribution, as
        vLLM's `prompt_logprobs`. Computed in the prefill; None costs
        nothing.
      include_stop_str_in_output: False (default): the text ends before the
        stop string that ended the branch; True: the text ends with it
        (vLLM's field). The tokens kept are the same either way (the fewest
        whose text holds the stop string); a stop token's text is never
        included.
      skip_special_tokens: True (default): special tokens (the end of turn,
        BOS, control tokens) are dropped from the decoded text; False keeps
        their text (`tokenizer.decode(ids, skip_special_tokens=...)`, vLLM's
        field). It applies to `Generation.texts`, the stream's deltas and the
        text stop strings are looked for in; tokens are unchanged.
      signals: record per-token selection signals of the raw distribution
        at every generated position (`Generation.token_entropy`,
        `self_certainty`, `top2_margin`, `[B, N, T]` float32; see
        `sampling.token_signals`): one more reduction over V in the decode
        step, no top-k and no per-token copy beyond 3 floats. A static
        setting: on, it compiles another step; off (the default), the step
        is the program it was without the option. Not a vLLM field.

    The order in which the fields act on the logits: the docstring of
    `jaxsample.engine.sampling`, the one place it is written.

    Raises:
      ConfigError (a ValueError): a field is out of range or of the wrong
        type; the message names the field, the allowed values and the value.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int | None = None  # None: max_tokens, or 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    signals: bool = False
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self):
        """Check every field (the class's Raises) and store its normal form."""
        fail = _fail
        set_ = functools.partial(_set, self)
        check_int = functools.partial(_check_int, self)
        check_float = functools.partial(_check_float, self)
        check_int("n", 1, "an int in [1, 2**31 - 1]")
        check_float("temperature", lambda t: t >= 0.0,
                    "a finite float >= 0 (0 is greedy)")
        if is_int(self.top_k) and int(self.top_k) < -1:
            fail("top_k", "an int in [-1, 2**31 - 1] (0 and -1 are off)", self.top_k)
        if is_int(self.top_k) and int(self.top_k) == -1:
            set_("top_k", 0)  # vLLM's "off"
        check_int("top_k", 0, "an int in [-1, 2**31 - 1] (0, -1 or >= vocab size is off)")
        check_float("top_p", lambda p: 0.0 < p <= 1.0,
                    "a float in (0, 1] (1 is off)")
        check_float("min_p", lambda p: 0.0 <= p <= 1.0,
                    "a float in [0, 1] (0 is off)")

        _check_budget(self)

        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            fail("stop_token_ids", "a sequence of ints in [0, 2**31 - 1)", ids)
        for i in ids:
            if not is_int(i) or not 0 <= int(i) < _INT32_MAX:
                fail("stop_token_ids", "a sequence of ints in [0, 2**31 - 1)", ids)
        set_("stop_token_ids", tuple(int(i) for i in ids))

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence):
            fail("stop", "a sequence of non-empty strings", self.stop)
        for s in stop:
            if not isinstance(s, str) or not s or lone_surrogate(s) is not None:
                fail("stop", "a sequence of non-empty strings of Unicode text (no lone "
                     "surrogate)", self.stop)
        set_("stop", tuple(stop))

        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                if not is_int(v) or not 0 <= int(v) <= MAX_LOGPROBS:
                    fail(name, f"None or an int in [0, {MAX_LOGPROBS}]", v)
                set_(name, int(v))

        if self.seed is not None:
            if not is_int(self.seed) or not 0 <= int(self.seed) < _SEED_LIMIT:
                fail("seed", "None or an int in [0, 2**32)", self.seed)
            set_("seed", int(self.seed))

        if not is_int(self.min_tokens) or not 0 <= int(self.min_tokens) <= self.max_new_tokens:
            fail("min_tokens", f"an int in [0, max_new_tokens={self.max_new_tokens}]",
                 self.min_tokens)
        set_("min_tokens", int(self.min_tokens))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            fail("ignore_eos", "a bool", self.ignore_eos)
        set_("ignore_eos", bool(self.ignore_eos))
        for name in ("include_stop_str_in_output", "skip_special_tokens", "signals"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                fail(name, "a bool", getattr(self, name))
            set_(name, bool(getattr(self, name)))
        for name in ("presence_penalty", "frequency_penalty"):
            check_float(name, lambda x: -MAX_PENALTY <= x <= MAX_PENALTY,
                        "a float in [-2, 2] (0 is off)")
        check_float("repetition_penalty", lambda x: x > 0.0, "a finite float > 0 (1 is off)")
        if self.logprobs_mode not in LOGPROBS_MODES:
            fail("logprobs_mode", " or ".join(map(repr, LOGPROBS_MODES)), self.logprobs_mode)
        if self.logprobs_mode == "processed_logprobs" and (self.logprobs or 0) > 0:
            fail("logprobs", "None or 0 with logprobs_mode='processed_logprobs' (the top-k "
                 "alternatives are reported raw only)", self.logprobs)
        set_("logit_bias", _logit_bias(self.logit_bias, fail))

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied (validated again).

        `max_tokens` and `max_new_tokens` are one budget: changing one
        changes both.

        Raises:
          ConfigError: as the constructor; TypeError for an unknown field.
        """
        one = [k for k in ("max_tokens", "max_new_tokens") if k in changes]
        if len(one) == 1:
            other = "max_new_tokens" if one[0] == "max_tokens" else "max_tokens"
            changes = {**changes, other: None}
        return dataclasses.replace(self, **changes)

    @property
    def greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding)."""
        return self.temperature == 0.0

    @property
    def penalties(self) -> bool:
        """True when a repetition, frequency or presence penalty is on (the
        engine then keeps per-branch token counts on the device)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def logits_processors(self) -> bool:
        """True when any logits processor before temperature is on (logit bias,
        min-tokens or a penalty): the engine then runs `process_logits`."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalties

    def bias_vector(self, size: int) -> np.ndarray:
        """`logit_bias` as a dense `[size]` float32 vector (0 elsewhere).

        Raises:
          ValueError: an id is >= size (`generate` checks ids against the
            vocabulary first and raises InputError).
        """
        out = np.zeros((size,), np.float32)
        for i, b in self.logit_bias:
            if i >= size:
                raise ValueError(f"logit_bias id {i} is outside [0, {size})")
            out[i] = b
        return out


SamplingParams.__init__ = refuse_foreign_keywords("SamplingParams")(SamplingParams.__init__)


def _fail(name: str, allowed: str, value: Any):
    """Raise the ConfigError of a SamplingParams field: its name, what it allows, the value."""
    raise ConfigError(f"SamplingParams.{name} must be {allowed}, got {short_repr(value)}")


def _set(p: SamplingParams, name: str, value: Any) -> None:
    """Store a field's normal form on the frozen dataclass."""
    object.__setattr__(p, name, value)


def _check_int(p: SamplingParams, name: str, lo: int, allowed: str) -> None:
    """Field `name` an int in [lo, 2**31 - 1], stored as a Python int."""
    v = getattr(p, name)
    if not is_int(v) or not lo <= int(v) <= _INT32_MAX:
        _fail(name, allowed, v)
    _set(p, name, int(v))


def _check_float(p: SamplingParams, name: str, ok, allowed: str) -> None:
    """Field `name` a finite real with `ok(value)`, stored as a Python float."""
    v = getattr(p, name)
    if not _is_real(v) or not math.isfinite(float(v)) or not ok(float(v)):
        _fail(name, allowed, v)
    _set(p, name, float(v))


def _check_budget(p: SamplingParams) -> None:
    """max_new_tokens (Hugging Face) and max_tokens (vLLM): one budget, both set to it
    (`DEFAULT_MAX_NEW_TOKENS` when neither is given); two different values refused."""
    given = {}
    for name in ("max_new_tokens", "max_tokens"):
        if getattr(p, name) is not None:
            _check_int(p, name, 1, "None or an int in [1, 2**31 - 1]")
            given[name] = getattr(p, name)
    if len(set(given.values())) > 1:
        raise ConfigError(
            "SamplingParams.max_tokens (vLLM's name) and SamplingParams.max_new_tokens "
            "(Hugging Face's) are the same budget: give one, got max_tokens="
            f"{given['max_tokens']!r} and max_new_tokens={given['max_new_tokens']!r} "
            "(SamplingParams.replace with one of them changes both)")
    budget = next(iter(given.values()), DEFAULT_MAX_NEW_TOKENS)
    _set(p, "max_new_tokens", budget)
    _set(p, "max_tokens", budget)


def _logit_bias(value: Any, fail) -> tuple[tuple[int, float], ...]:
    """Validate and normalise SamplingParams.logit_bias (see its docstring)."""
    allowed = ("None, a dict {token_id: bias} or a sequence of (token_id, bias) pairs, "
               "with int ids in [0, 2**31 - 1) and finite biases")
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        fail("logit_bias", allowed, value)
    else:
        pairs = list(value)
    out: dict[int, float] = {}
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (Sequence, np.ndarray)) \
                or len(pair) != 2:
            fail("logit_bias", allowed, value)
        tok, bias = pair
        if isinstance(tok, str):  # JSON keys are strings (vLLM converts them too)
            # ASCII decimal digits only: str.isdigit() also takes "²" (which int() refuses)
            # and int() takes "٣", " 5", "+5" and "-5": none of them is a token id.
            if not (tok.isascii() and tok.isdigit()):
                fail("logit_bias", allowed + f"; the key {short_repr(tok)} is not a token id "
                     "(a string key must be ASCII decimal digits, like \"13\")", value)
            if len(tok) <= 12:  # longer: out of range, refused below without int()'s limit
                tok = int(tok)
        if not is_int(tok) or not 0 <= int(tok) < _INT32_MAX:
            fail("logit_bias", allowed + f"; bad id {short_repr(tok)}", value)
        if not _is_real(bias) or not math.isfinite(float(bias)):
            fail("logit_bias", allowed + f"; bad bias {short_repr(bias)} for id "
                 f"{short_repr(tok)}", value)
        if int(tok) in out:
            fail("logit_bias", allowed + f"; id {int(tok)} repeated", value)
        out[int(tok)] = min(MAX_BIAS, max(-MAX_BIAS, float(bias)))
    return tuple(sorted(out.items()))
