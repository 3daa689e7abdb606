"""Final-answer extraction and normalisation for votes and grading (host side).

`extract(text, kind)` finds the final answer in a model's output and returns
it normalised; `normalize(answer)` maps equivalent spellings of one answer to
one string, so that a vote (`jaxsample.reduce.self_consistency`) counts
"1,000", "1000" and "$1{,}000$" as the same answer.

Conventions follow the usual math-reasoning graders: the last `\\boxed{...}`
wins (Hendrycks et al. 2021, MATH, arXiv 2103.03874), GSM8K's "#### X"
(Cobbe et al. 2021, arXiv 2110.14168), "The answer is X" (Wei et al. 2022,
chain-of-thought prompting, arXiv 2201.11903; Wang et al. 2022,
self-consistency, arXiv 2203.11171). Numbers follow one precedence (`extract`,
kind "number"), the order answer-extraction harnesses apply: a boxed answer
(Qwen2.5-Math's parser), then an answer phrase ("#### X", "The answer is X",
"Answer: X", "Final answer: X", "The result is X": lm-evaluation-harness's
GSM8K "strict-match" and chain-of-thought filters, OpenAI simple-evals'
`Answer\\s*:`), then the result of the last equation ("= X"), and only then the
last number (lm-evaluation-harness's "flexible-extract"), so a restated
operand ("12 * 7 = 94, from the numbers 12 and 7") does not win the vote.

Neither function ever raises on any string: a text with no answer gives None.
"""

from __future__ import annotations

import re

from jaxsample.errors import ExtractError, short_repr
from jaxsample.reduce.answer_normalize import normalize, unify_minus
from jaxsample.reduce.answer_text import (
    DTFRAC_RE,
    FRAC_DIGITS_RE,
    last_boxed,
    mixed_numbers,
    strip_emphasis,
)

__all__ = ["KINDS", "extract", "normalize"]


KINDS = ("auto", "boxed", "number", "choice", "text")


_GSM8K_RE = re.compile(r"####[ \t]*([^\n]*)")


_ANSWER_IS_RE = re.compile(r"\banswer\s*(?:is|:|=)[ \t]*:?[ \t]*", re.IGNORECASE)


# Answer phrases of the "number" rules (`_number_by_precedence`): GSM8K's "####",
# "final answer" (with or without a verb or colon), and "answer" / "result"
# followed by a verb ("is", "was", "would be", ...) or ":" / "=". Then up to
# three filler words ("The answer is therefore 42", "indeed", "approximately").
_BE = r"(?:is|was|(?:would|will|should|must)[ \t]+be)\b"


_PHRASE_RE = re.compile(
    r"####|\bfinal[ \t]+answer\b(?:[ \t]*" + _BE + r"[ \t]*:?|[ \t]*[:=])?"
    r"|\b(?:answer|result)\b(?:[ \t]*" + _BE + r"[ \t]*:?|[ \t]*[:=])",
    re.IGNORECASE)


_FILLERS_RE = re.compile(
    r"(?:[ \t]*(?:therefore|thus|hence|then|so|simply|just|exactly|indeed|actually|clearly"
    r"|about|approximately|roughly|around|equal[ \t]+to)\b[ \t]*,?)*", re.IGNORECASE)


# What may stand between a phrase or an "=" and its number: spaces (a line
# break too), "$", "\\$", "\\(", "\\[", "(", and a lone variable ("x = ").
_LEAD_RE = re.compile(r"(?:\s|\$|\\[$(\[]|\()*(?:[A-Za-z][ \t]*=(?:\s|\$|\\[$(\[]|\()*)?")


# An "=" sign that states a result: not part of "==", "<=", ">=", "!=", "=>".
_EQUALS_RE = re.compile(r"(?<![<>!=])=(?![=>])")


# After a number: the expression goes on ("= 12 - 3"), so the number is no result.
_EXPR_GOES_ON_RE = re.compile(r"[ \t]*(?:[-+*/^\u00d7\u00f7\u00b7]|\\times|\\cdot|\\div)[ \t]*[\w(\\$.]")


# A number: optional sign (not glued to a preceding word/digit/closing
# bracket, so "5-3" is 5 and 3), digits with optional thousands separators
# (",", LaTeX "{,}", "\\,", "\\;", "\\:", "\\ ", "~"; or a space-like character: space, no-break
# space U+00A0, thin space U+2009, narrow no-break space U+202F), optional
# decimals, optional "/denominator".
# Space grouping rule: the leading group has 1-3 digits, every later group
# is one space-like character then exactly 3 digits (not followed by a
# digit), and the number does not follow a digit and a space ("1 2 3 100" is
# a list, not 3100). So "10 000" is 10000, "2 3" is 2 then 3, "4 pears" is 4.
_SPACE_SEP = "[ \u00a0\u2009\u202f]"


_NUM = (r"(?:\d{1,3}(?:(?:,|\{,\}|\\[,;: ]|~)\d{3})+(?![\d])"
        r"|(?<!\d" + _SPACE_SEP + r")\d{1,3}(?:" + _SPACE_SEP + r"\d{3})+(?![\d])"
        r"|\d+)(?:\.\d+)?|\.\d+")


# Scientific notation ("1e5", "1.0e-3") and powers ("10^3", "10^{3}") belong
# to the number: "1e5" is 100000, not 5.
_EXP = r"(?:[eE][-+]?\d+(?!\w|\.\d))?(?:[ \t]*\^[ \t]*(?:\{[ \t]*[-+]?\d+[ \t]*\}|[-+]?\d+))?"


_NUMBER_RE = re.compile(
    r"(?:(?<![\w)}\]])[-+])?(?:" + _NUM + r")" + _EXP
    + r"(?:[ \t]*/[ \t]*(?:" + _NUM + r"))?(?![\d])"
)


# "-(3/4)", "-(5)": a sign before a parenthesised plain number or fraction.
_SIGNED_PAREN_RE = re.compile(
    r"(?<![\w)}\]])([-+])\([ \t]*((?:" + _NUM + r")(?:[ \t]*/[ \t]*(?:" + _NUM + r"))?)[ \t]*\)"
)


# Choice letters. An upper-case letter standing alone counts anywhere the
# rules below look; a lower-case one only where it cannot be a word: in
# parentheses, brackets or quotes, before ")" or right before punctuation or
# the end of the line ("answer: c", "answer is (b)", "b) 42"), never before
# another word ("the answer is a banana", "I think a lot").
_LOWER_CHOICE_END = r"(?=[ \t]*(?:\n|$)|[.,;:!?)\]]+(?:\s|$))"


_BRACKETED_CHOICE = r"\(([A-Ea-e])\)|\[([A-Ea-e])\]"


_QUOTED_CHOICE = "\"([A-Ea-e])\"|'([A-Ea-e])'|\u201c([A-Ea-e])\u201d|\u2018([A-Ea-e])\u2019"


_CHOICE_AFTER_KEYWORD_RE = re.compile(
    r"\b(?i:answer|option|choice)\b\s*(?:(?i:is\b|:|=)\s*)?(?:(?i:option|choice)\b\s*)?(?::\s*)?"
    r"(?:" + _BRACKETED_CHOICE + "|" + _QUOTED_CHOICE
    + r"|\(?([A-E])\)?(?![A-Za-z0-9])|([a-e])(?:\)|" + _LOWER_CHOICE_END + r"))"
)


# Not glued to a word or a backslash: "f(a)", "x[b]" and "\\[B\\]" are no choices.
_CHOICE_PAREN_RE = re.compile(r"(?<![\w\\])(?:" + _BRACKETED_CHOICE + ")")


_CHOICE_LINE_RE = re.compile(r"^[ \t]*(?:" + _BRACKETED_CHOICE + "|" + _QUOTED_CHOICE
                             + r"|\(?([A-Ea-e])\)?)[ \t]*[.):]?[ \t]*$", re.MULTILINE)


# A line that starts with a labelled option: "B) 42", "B. 42", "(b) 42".
_CHOICE_LABEL_RE = re.compile(r"^[ \t]*(?:\(([A-Ea-e])\)|([A-Ea-e])[.)])[ \t]+\S", re.MULTILINE)


_CHOICE_BOXED_RE = re.compile(r"^\(?([A-Ea-e])\)?$")


_MATH_TOKEN_RE = re.compile(r"\\.|\$", re.DOTALL)


# A line that only fences a code block ("```", "```python", "~~~") or only holds marks.
_FENCE_RE = re.compile(r"^[ \t]*(?:(?:`{3,}|~{3,})[\w+-]*|[*_`]+)[ \t]*$")


_NUM_FRAC_RE = re.compile(r"(\d)?\\frac\s*\{\s*([-+]?[\d.]+)\s*\}\s*\{\s*([-+]?[\d.]+)\s*\}")


def _prepare_numbers(text: str) -> str:
    text = _SIGNED_PAREN_RE.sub(r"\1\2", text)  # "-(3/4)" -> "-3/4"
    text = DTFRAC_RE.sub(r"\\frac", text)
    text = FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", text)
    text = mixed_numbers(text)
    # A \frac right after a digit that is no mixed number keeps a space, so
    # "2.5\frac{1}{2}" is not read as the number 2.51/2.
    text = _NUM_FRAC_RE.sub(lambda m: (m.group(1) + " " if m.group(1) else "") + f"{m.group(2)}/{m.group(3)}", text)
    return mixed_numbers(text, latex=False)


def _last_number(text: str, prepared: bool = False) -> str | None:
    matches = list(_NUMBER_RE.finditer(text if prepared else _prepare_numbers(text)))
    return normalize(matches[-1].group(0)) or None if matches else None


def _number_at(text: str, pos: int) -> str | None:
    """The number that `text` (prepared) states at `pos`, after `_LEAD_RE`: not glued
    to a letter ("3x") and not the start of a longer expression ("12 - 3"); else None.
    O(length of what it reads)."""
    pos = _LEAD_RE.match(text, pos).end()
    m = _NUMBER_RE.match(text, pos)
    if m is None:
        return None
    end = m.end()
    if end < len(text) and text[end].isalpha():
        return None
    if _EXPR_GOES_ON_RE.match(text, end):
        return None
    return normalize(m.group(0)) or None


def _number_by_precedence(text: str) -> str | None:
    """Rules 2-4 of the "number" kind on `text` (emphasis already stripped): the
    number right after the last answer phrase that has one, else the result of
    the last equation (the number right after the last "=" that has one), else
    the last number. One pass over the text per rule (linear time)."""
    prep = _prepare_numbers(text)
    for m in reversed(list(_PHRASE_RE.finditer(prep))):
        got = _number_at(prep, _FILLERS_RE.match(prep, m.end()).end())
        if got is not None:
            return got
    equals = list(_EQUALS_RE.finditer(prep))
    if equals:
        numbers = list(_NUMBER_RE.finditer(prep))
        ending = {m.end(): m for m in numbers}
        for m in reversed(equals):
            got = _number_at(prep, m.end())
            if got is None:  # "7 = 7 * 1": the result is written first
                got = _number_before(prep, m.start(), ending)
            if got is not None:
                return got
        return normalize(numbers[-1].group(0)) or None if numbers else None
    return _last_number(prep, prepared=True)


def _number_before(text: str, pos: int, ending: dict) -> str | None:
    """The number that ends right before `pos` (an "=" sign; spaces and `$` between),
    standing alone: not the end of an expression ("2 * 7 = ...") nor glued to a
    letter. `ending` maps the end of each `_NUMBER_RE` match of `text` to it."""
    j = pos
    while j > 0 and text[j - 1] in " \t$":
        j -= 1
    m = ending.get(j)
    if m is None:
        return None
    i = m.start()
    if i > 0 and (text[i - 1].isalpha() or text[i - 1] in "_^."):
        return None
    k = i
    while k > 0 and text[k - 1] in " \t$(":
        k -= 1
    if k > 0 and (text[k - 1] in "-+*/^\u00d7\u00f7\u00b7" or text.endswith(("\\times", "\\cdot", "\\div"), 0, k)):
        return None
    return normalize(m.group(0)) or None


def _first_number(segment: str) -> str | None:
    """The number the segment starts with (after `$` / `\\$` / spaces), else None."""
    seg = _prepare_numbers(segment)
    m = re.match(r"^[\s$\\]*(?:\\\$)?\s*", seg)
    start = m.end() if m else 0
    nm = _NUMBER_RE.match(seg, start)
    if nm is None:
        return None
    after = seg[nm.end() :]
    if after[:1].isalpha() and not after[:1].isspace():
        return None  # "3x" is not the number 3
    return normalize(nm.group(0)) or None


def _closing_dollar(text: str, start: int) -> int | None:
    """Index of the first `$` at or after `start` that closes inline maths.

    An escaped dollar (`\\$`, a dollar sign inside the maths, as in
    `$\\$18$`) does not close it; after an escaped backslash (`\\\\$`) the
    dollar does."""
    for m in _MATH_TOKEN_RE.finditer(text, start):
        if m.group() == "$":
            return m.start()
    return None


def _from_segment(segment: str) -> str | None:
    """The answer stated at the start of `segment` (text after "answer is" / "####"),
    after up to three filler words ("therefore", "indeed", "approximately", ...);
    None for a number that starts an expression ("12 - 3 = 9")."""
    seg = segment[_FILLERS_RE.match(segment).end():].strip()
    if not seg:
        return None
    boxed = last_boxed(seg)
    if boxed is not None:
        return normalize(boxed) or None
    if seg.startswith("$") and not seg.startswith("$$"):
        close = _closing_dollar(seg, 1)
        if close is not None:
            inner = seg[1:close]
            if inner.strip():
                return normalize(inner) or None
    m = re.match(r"^\(?([A-E])\)?(?![A-Za-z0-9])", seg)
    if m:
        return m.group(1)
    num = _first_number(seg)
    if num is not None:
        prep = _prepare_numbers(seg)
        m = _NUMBER_RE.match(prep, _LEAD_RE.match(prep).end())
        if m is not None and _EXPR_GOES_ON_RE.match(prep, m.end()):
            return None  # "12 - 3 = 9": an expression, not the answer; the "=" rule decides
        return num
    m = re.match(r"^(.+?)(?:[.;,!?](?:\s|$)|$)", seg)
    return (normalize(m.group(1)) or None) if m else None


def _extract_choice(text: str) -> str | None:
    """The multiple-choice letter, upper-cased (see `extract`, kind "choice")."""
    boxed = last_boxed(text)
    if boxed is not None:
        m = _CHOICE_BOXED_RE.match(normalize(boxed))
        if m:
            return m.group(1).upper()
    for pattern in (_CHOICE_AFTER_KEYWORD_RE, _CHOICE_PAREN_RE, _CHOICE_LINE_RE, _CHOICE_LABEL_RE):
        last = None
        for last in pattern.finditer(text):
            pass
        if last is not None:
            return next(g for g in last.groups() if g).upper()
    return None


def _extract(text: str, kind: str) -> str | None:
    text = strip_emphasis(text, letters=kind == "choice")
    if kind == "boxed":
        boxed = last_boxed(text)
        return (normalize(boxed) or None) if boxed is not None else None
    if kind == "number":
        boxed = last_boxed(text)
        if boxed is not None:
            got = normalize(boxed)
            if got:
                return got
        return _number_by_precedence(text)
    if kind == "choice":
        return _extract_choice(text)
    if kind == "text":
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not _FENCE_RE.match(ln)]
        return (normalize(lines[-1]) or None) if lines else None
    # auto: boxed, then GSM8K "####", then "the answer is", then the "number" rules.
    boxed = last_boxed(text)
    if boxed is not None:
        got = normalize(boxed)
        if got:
            return got
    for m in reversed(list(_GSM8K_RE.finditer(text))):
        got = _from_segment(m.group(1))
        if got is not None:
            return got
    for m in reversed(list(_ANSWER_IS_RE.finditer(text))):
        line_end = text.find("\n", m.end())
        got = _from_segment(text[m.end() : line_end if line_end >= 0 else len(text)])
        if got is not None:
            return got
    return _number_by_precedence(text)


def guarded(extract_fn):
    """A caller's extractor whose exceptions come back as `ExtractError` naming it and the
    text it was given (an extractor is user code: its traceback alone names neither)."""
    def fn(text):
        try:
            return extract_fn(text)
        except Exception as e:
            name = getattr(extract_fn, "__qualname__", None) or repr(extract_fn)
            raise ExtractError(f"the extract callable {short_repr(name)} raised "
                               f"{type(e).__name__}: {short_repr(str(e))} on the text "
                               f"{short_repr(text)}") from e
    return fn


def extract(text: object, kind: str = "auto") -> str | None:
    """The final answer in a model's output, normalised (see `normalize`).

    Markdown emphasis and code marks are stripped from the text first, for
    every kind (`Final Answer: **73**` and `**Answer:** 73` give `73`; the
    rules are those of `normalize`); the "text" kind skips code-fence lines.

    Kinds:
      * "boxed": the last complete `\\boxed{...}` or `\\fbox{...}` (nested
        braces balanced; a `\\boxed` without a brace group is not an answer).
      * "number": the final numeric answer, by this precedence (the first
        rule that finds one wins):
          1. the last complete `\\boxed{...}` / `\\fbox{...}`, normalised;
          2. the number right after the LAST answer phrase that is followed
             by one: "#### X", "the answer is X" / "answer was X" / "answer
             would be X", "answer: X", "answer is: X", "answer = X", "final
             answer X" (with or without "is" or ":"), "the result is X" /
             "result: X" (case-insensitive; up to three filler words such as
             "therefore", "indeed", "approximately" may come between; so may
             spaces, a line break, `$`, `\\$`, `(` and a lone variable, as
             in "The answer is x = 5");
          3. the result of the final equation: the number right after the
             last "=" sign that is followed by one, or, where what follows
             that "=" is an expression, the number standing alone right
             before it ("7 = 7 * 1" gives 7); "<=", ">=", "!=", "==" and
             "=>" are no equations;
          4. the last number in the text.
        In rules 2 and 3 a number glued to a letter ("3x") or followed by
        an operator and more ("= 12 - 3", "answer is 2 * 5") is not the
        answer (the expression's own "=" decides). So "12 * 7 = 94, from
        the numbers 12 and 7" gives 94 and "The answer is 7 since 7 > 1"
        gives 7. Numbers are integers, decimals, thousands separators
        (also space-like ones by the rule of `normalize`: `10 000` is one
        number, 10000; in `2 3` and in the list `1 2 3 100` each number
        stands alone), signs including the unicode minus, scientific
        notation `1e5`, powers `10^{3}`, `-(3/4)`, `a/b` and `\\frac{a}{b}`
        with numeric parts, mixed numbers (`3\\frac{1}{2}`, `3 1/2`, `3½`
        are `7/2`). Linear time in the length of the text.
      * "choice": a multiple-choice letter A-E, in this order: a boxed
        letter; the last "answer: C" / "the answer is (C)" / "option C"
        (also `[C]`, `"C"`, `'C'`); the last "(B)" or "[B]"; the last line
        holding only a letter ("B", "(b)", "b.", `"b"`); the last line
        starting with a labelled option ("B) 42", "B. 42"). Emphasis counts
        as a letter standing alone (`**B**`). Lower-case letters count
        only where they cannot be a word: in parentheses, brackets or
        quotes, before ")", alone on a line, or right before
        punctuation or the end of the line ("Answer: c", "answer is a.");
        a letter followed by another word is an article, not a choice
        ("The answer is a banana", "I think a lot" give None). An
        upper-case letter after the keyword counts even before more words
        ("The answer is B because ..."). Normalised form: the upper-case
        letter ("b", "(b)", "**b**" all give "B").
      * "text": the last non-empty line, stripped (free-form answers).
      * "auto": the last boxed answer; else GSM8K's last "#### X"; else the
        last "The answer is X" / "Answer: X" (any answer: a number, a
        letter, maths, a word; filler words skipped; a number that starts
        an expression, "12 - 3 = 9", is left to the next rules); else
        rules 2-4 of "number". An
        answer in inline maths (`The answer is $\\$18$.`) ends at the first
        unescaped `$`, so an escaped dollar inside it is a dollar sign.

    Args:
      text: the generated text (anything else gives None).
      kind: one of `KINDS`.

    Returns:
      The normalised answer, or None when none is found (also for a
      non-string text). Never raises on any text.

    Raises:
      ValueError: `kind` is not one of `KINDS` (a programming error, not a
        property of the text).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    if not isinstance(text, str):
        return None
    try:
        return _extract(unify_minus(text), kind)
    except Exception:  # the contract is "never raise": no answer found
        return None
