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

import bisect
import re
from decimal import MAX_EMAX, MIN_EMIN, Decimal, InvalidOperation, localcontext
from fractions import Fraction

__all__ = ["KINDS", "extract", "normalize"]

KINDS = ("auto", "boxed", "number", "choice", "text")

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
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
_MINUS_SIGNS = {"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"}
_VULGAR = {"\u00bd": "1/2", "\u2153": "1/3", "\u2154": "2/3", "\u00bc": "1/4", "\u00be": "3/4",
           "\u2155": "1/5", "\u2156": "2/5", "\u2157": "3/5", "\u2158": "4/5", "\u2159": "1/6",
           "\u215a": "5/6", "\u2150": "1/7", "\u215b": "1/8", "\u215c": "3/8", "\u215d": "5/8",
           "\u215e": "7/8", "\u2151": "1/9", "\u2152": "1/10"}
_VULGAR_RE = re.compile("[" + "".join(_VULGAR) + "]")
_SCI_RE = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([-+]?\d+)$")
_POW_RE = re.compile(r"^([-+]?)(\d+(?:\.\d*)?|\.\d+)\^(?:\{([-+]?\d+)\}|([-+]?\d+))$")
# Above this many digits a power or exponent is kept symbolic ("1e5000").
_MAX_EXPANDED_DIGITS = 400
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
_WRAPPERS = ("text", "textbf", "textit", "mathrm", "mathbf", "mbox", "boxed", "fbox", "operatorname")
_SPACING_RE = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\left|\\right|\\displaystyle")
_DEC_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
_TILDE_GROUP_RE = re.compile(r"(?<=\d)~(?=\d{3}(?!\d))")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:(?:,\d{3})+|(?: \d{3})+)(?:\.\d+)?$")
_INT_FRAC_RE = re.compile(r"^([-+]?\d+)/([-+]?\d+)$")
_SIMPLE_RE = re.compile(r"^[-+]?[\\\w.{}]+$")
_NOT_SIMPLE_RE = re.compile(r"[^\\\w.{}]")
_BRACE_RE = re.compile(r"[{}]")
_MATH_TOKEN_RE = re.compile(r"\\.|\$", re.DOTALL)
_EMPH_RUN_RE = re.compile(r"\*+|_+|`+")
_EMPH_OPEN_AFTER = "([{\"'<:=*_`~"
_EMPH_CLOSE_BEFORE = ".,;:!?)]}\"'>*_`~"
# A line that only fences a code block ("```", "```python", "~~~") or only holds marks.
_FENCE_RE = re.compile(r"^[ \t]*(?:(?:`{3,}|~{3,})[\w+-]*|[*_`]+)[ \t]*$")
_DTFRAC_RE = re.compile(r"\\[dt]frac")
_FRAC_DIGITS_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_OPEN_RE = re.compile(r"\\frac\s*\{")
_MIXED_FRAC_RE = re.compile(r"(?<![\w.,^_}/\\])(?<!\d[ \t\u00a0])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_MIXED_TEXT_RE = re.compile(r"(?<![\w.,^_}/\\])(?<!\d[ \t\u00a0])(\d+)[ \t\u00a0]+(\d+)/(\d+)(?![\w/^]|[.,]\d)")
_NUM_FRAC_RE = re.compile(r"(\d)?\\frac\s*\{\s*([-+]?[\d.]+)\s*\}\s*\{\s*([-+]?[\d.]+)\s*\}")
_WRAP_RE = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")


# ----------------------------------------------------------------------------
# Braces
# ----------------------------------------------------------------------------


def _strip_outer_braces(s: str) -> str:
    """Remove all the brace groups that enclose the whole of `s` ("{{5}}" -> "5"), in O(len).

    The same brace rules as `_brace_pairs` (`\\{` and `\\}` are literal)."""
    n = len(s)
    lead = 0
    while lead < n and s[lead] == "{":
        lead += 1
    trail = 0
    while trail < n - lead and s[n - 1 - trail] == "}" and s[n - 2 - trail] != "\\":
        trail += 1
    k = min(lead, trail)
    if k == 0:
        return s
    depth, inner_min = 0, None
    for i, ch in enumerate(s):
        if ch in "{}" and i > 0 and s[i - 1] == "\\":
            pass  # a literal brace
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if k - 1 <= i <= n - k - 1:
            inner_min = depth if inner_min is None else min(inner_min, depth)
    if depth != 0 or inner_min is None:
        return s
    m = min(k, inner_min)
    return s[m : n - m] if m > 0 else s


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of every "{" that closes -> index of its balancing "}", in one O(len) pass.

    A brace right after a backslash (`\\{`, `\\}`) is literal; a stray "}"
    closes nothing; a "{" that never closes is absent. Every lookup is then
    O(1), so scanning many groups (thousands of unclosed `\\boxed{`) stays
    linear instead of rescanning the text once per group."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for m in _BRACE_RE.finditer(text):
        i = m.start()
        if i > 0 and text[i - 1] == "\\":
            continue
        if text[i] == "{":
            stack.append(i)
        elif stack:
            pairs[stack.pop()] = i
    return pairs


def _last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}`; nested braces allowed.

    O(len(text)): the braces are matched once for the whole text (not once
    per `\\boxed{`, which was quadratic in unclosed repeats)."""
    boxes = list(_BOX_RE.finditer(text))
    if not boxes:
        return None
    pairs = _brace_pairs(text)
    for m in reversed(boxes):
        close = pairs.get(m.end() - 1)
        if close is not None:
            return text[m.end() : close]
    return None


def _delete_spans(s: str, spans: list[tuple[int, int, str]]) -> str:
    """`s` with each disjoint `(start, end, replacement)` span replaced, in O(len)."""
    if not spans:
        return s
    out, pos = [], 0
    for start, end, rep in sorted(spans):
        out.append(s[pos:start])
        out.append(rep)
        pos = end
    out.append(s[pos:])
    return "".join(out)


def _unwrap_commands(s: str) -> str:
    """`\\text{X}` -> X for every wrapper command, all in one O(len) pass.

    A wrapper whose group never closes loses the command (and its "{")."""
    spans = []
    pairs = None
    for m in _WRAP_RE.finditer(s):
        if pairs is None:
            pairs = _brace_pairs(s)
        spans.append((m.start(), m.end(), ""))
        close = pairs.get(m.end() - 1)
        if close is not None:
            spans.append((close, close + 1, ""))
    return _delete_spans(s, spans)


def _mixed_fraction(whole: str, num: str, den: str) -> str | None:
    """`whole num/den` as one reduced improper fraction ("3", "1", "2" -> "7/2") if proper, else None."""
    w, a, b = int(whole), int(num), int(den)
    if not 0 < a < b:
        return None
    f = Fraction(w * b + a, b)
    return f"{f.numerator}/{f.denominator}"


def _mixed_numbers(s: str, latex: bool = True) -> str:
    """Mixed numbers -> improper fractions: `3\\frac{1}{2}` (`latex`) or `3 1/2` -> `7/2`.

    A mixed number is a whole number (not glued to a word, a decimal point, a
    "^", "_" or "}" before it, nor following a digit and a space) and then a
    proper fraction of integers (0 < numerator < denominator): in LaTeX right
    after the whole number or after spaces (`\\frac{a}{b}`, with `\\dfrac`,
    `\\tfrac` and `\\frac12` already rewritten to `\\frac{a}{b}`), in plain
    text after one or more spaces (`3 1/2`, no spaces around the "/"). A sign
    before it stays a sign: `-2\\frac{1}{3}` is -7/3. A LaTeX whole number
    before an improper fraction (`3\\frac{5}{2}`) keeps a space between the
    two, so the digits are not read together as 35/2."""
    if latex:
        def sub(m: re.Match) -> str:
            got = _mixed_fraction(m.group(1), m.group(2), m.group(3))
            return got if got is not None else m.group(1) + " " + m.group(0)[len(m.group(1)) :].lstrip()
        return _MIXED_FRAC_RE.sub(sub, s)
    return _MIXED_TEXT_RE.sub(lambda m: _mixed_fraction(m.group(1), m.group(2), m.group(3)) or m.group(0), s)


def _trimmed(s: str, i: int, j: int) -> tuple[int, int]:
    """The range [i, j) of `s` without leading and trailing whitespace (as `str.strip`)."""
    while i < j and s[i].isspace():
        i += 1
    while j > i and s[j - 1].isspace():
        j -= 1
    return i, j


def _is_simple(s: str, i: int, j: int, not_simple: list[int]) -> bool:
    """Whether `s[i:j]` matches `_SIMPLE_RE`, given the sorted positions of `s`'s
    characters outside that class (`_NOT_SIMPLE_RE`): O(log len), no copy."""
    if i < j and s[i] in "+-":
        i += 1
    return i < j and bisect.bisect_left(not_simple, j) == bisect.bisect_left(not_simple, i)


def _convert_fracs(s: str) -> str:
    """`\\frac{a}{b}`, `\\dfrac`, `\\tfrac`, `\\frac12` -> `a/b` (parenthesised when compound).

    Every `\\frac` is rewritten in one O(len) pass (nested ones too): its
    parts are parenthesised when their own text is not simple, as if the
    outermost were rewritten first. A `\\frac` without two brace groups is
    left as it is (and does not stop the others)."""
    s = _DTFRAC_RE.sub(r"\\frac", s)
    s = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = _mixed_numbers(s)
    spans: list[tuple[int, int, str]] = []
    pairs = not_simple = None
    for m in _FRAC_OPEN_RE.finditer(s):
        if pairs is None:
            pairs = _brace_pairs(s)
        num_open = m.end() - 1
        num_close = pairs.get(num_open)
        if num_close is None:
            continue
        den_open = num_close + 1
        while den_open < len(s) and s[den_open].isspace():
            den_open += 1
        den_close = pairs.get(den_open) if den_open < len(s) and s[den_open] == "{" else None
        if den_close is None:
            continue
        # Each part's text without the spaces just inside its braces (which the
        # rewrite drops), and whether it is simple: found in O(1) amortised
        # (no copy of the part, which would make nested \frac quadratic).
        a0, a1 = _trimmed(s, num_open + 1, num_close)
        b0, b1 = _trimmed(s, den_open + 1, den_close)
        if not_simple is None:
            not_simple = [x.start() for x in _NOT_SIMPLE_RE.finditer(s)]
        pa, pb = not _is_simple(s, a0, a1, not_simple), not _is_simple(s, b0, b1, not_simple)
        a_lead, a_trail = a0 - (num_open + 1), num_close - a1
        b_lead, b_trail = b0 - (den_open + 1), den_close - b1
        glued = m.start() > 0 and s[m.start() - 1].isdigit()  # "2.5\frac12": keep the numbers apart
        spans.append((m.start(), num_open + 1 + a_lead, (" " if glued else "") + ("(" if pa else "")))
        spans.append((num_close - a_trail, den_open + 1 + b_lead, (")" if pa else "") + "/" + ("(" if pb else "")))
        spans.append((den_close - b_trail, den_close + 1, ")" if pb else ""))
    return _delete_spans(s, spans)


# ----------------------------------------------------------------------------
# Markdown emphasis
# ----------------------------------------------------------------------------


def _strip_emphasis(s: str, ends: bool = False, letters: bool = False) -> str:
    """Drop Markdown emphasis and code marks (`**`, `__`, `*`, `_`, backticks) from `s`, in O(len).

    A run of one marker character can *open* when it follows the start, a
    space, another mark or one of `([{"'<:=` and is followed by a non-space
    (`_` not by "{"); it can *close* when it follows a non-space other than
    a backslash or "^" (nor a "_" for a lone `*`, as in `f_*`, unless that
    "_" just closed a pair) and is followed by the end, a space, another
    mark or one of `.,;:!?)]}"'>`. Nested marks (`**_x_**`) go in one pass.
    On each line an opener pairs with the next closer of the identical run
    (`**` with `**`), and both go. A run that pairs with nothing goes too
    when it could open or close and is a backtick run or two or more
    `*`/`_` (a lone `*` or `_` may be maths). With `ends`, an unpaired
    opener at the very start of `s` or closer at its very end goes whatever
    its length. With `letters`, a pair around a single letter A-E / a-e
    becomes parentheses (`**b**` -> `(b)`), the form choice extraction reads.

    What survives: `x_1`, `a_{n}`, `3*4`, `2**10`, `3 * 4`, `x^*`, `f_*`,
    `\\_`, `my_var` (none of these markers can open or close)."""
    if "*" not in s and "_" not in s and "`" not in s:
        return s
    n = len(s)
    runs: list[list] = []  # [start, end, marker, can_open, can_close, paired]
    spans: list[tuple[int, int, str]] = []
    stack: list[int] = []  # indices into runs of open runs on this line
    where: dict[str, list[int]] = {}  # marker -> positions in `stack`
    last_end = 0
    closed_at = -1  # end of the last run that closed a pair
    for m in _EMPH_RUN_RE.finditer(s):
        i, j, marker = m.start(), m.end(), m.group()
        if "\n" in s[last_end:i]:  # pairs never cross a line break
            stack.clear()
            where.clear()
        last_end = j
        prev = s[i - 1] if i > 0 else ""
        nxt = s[j] if j < n else ""
        can_open = bool(nxt) and not nxt.isspace() and (not prev or prev.isspace() or prev in _EMPH_OPEN_AFTER)
        if marker[0] == "_" and nxt == "{":
            can_open = False
        can_close = (bool(prev) and not prev.isspace() and prev not in "\\^"
                     # f_* is a subscript; in *_x_* the "_" before "*" just closed
                     and not (marker == "*" and prev == "_" and closed_at != i)
                     and (not nxt or nxt.isspace() or nxt in _EMPH_CLOSE_BEFORE))
        runs.append([i, j, marker, can_open, can_close, False])
        here = len(runs) - 1
        if can_close and where.get(marker):
            k = where[marker][-1]
            while len(stack) > k + 1:  # openers between the pair stay unpaired
                where[runs[stack.pop()][2]].pop()
            op = stack.pop()
            where[marker].pop()
            runs[op][5] = runs[here][5] = True
            closed_at = j
            o, c = runs[op], runs[here]
            single = letters and c[0] - o[1] == 1 and s[o[1]] in "ABCDEabcde"
            spans.append((o[0], o[1], "(" if single else ""))
            spans.append((c[0], c[1], ")" if single else ""))
        elif can_open:
            stack.append(here)
            where.setdefault(marker, []).append(len(stack) - 1)
    for i, j, marker, can_open, can_close, paired in runs:
        if paired or not (can_open or can_close):
            continue
        if marker[0] == "`" or len(marker) >= 2:
            spans.append((i, j, ""))
        elif ends and ((i == 0 and can_open) or (j == n and can_close)):
            spans.append((i, j, ""))
    return _delete_spans(s, spans)


# ----------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------


def _canonical_number(s: str) -> str | None:
    """Canonical decimal text of a plain number ("-3.0" -> "-3", "0.50" -> "0.5"), else None."""
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "").replace(" ", "")
    if not _DEC_RE.match(s):
        return None
    return _decimal_text(s)


def _decimal_text(s: str, exponent: int = 0) -> str | None:
    """Exact canonical decimal text of `s * 10**exponent` (no rounding, any length)."""
    with localcontext() as ctx:
        # Enough digits that nothing is ever rounded: all of the input's.
        ctx.prec = max(28, len(s) + abs(exponent) + 2)
        ctx.Emax, ctx.Emin = MAX_EMAX, MIN_EMIN
        try:
            d = Decimal(s).scaleb(exponent)
        except InvalidOperation:
            return None
        if d == 0:
            return "0"
        out = format(d.normalize(), "f")
    if "." in out:
        out = out.rstrip("0").rstrip(".")
    return out


def _scientific_number(s: str) -> str | None:
    """"1e5" -> "100000", "1.0e-3" -> "0.001", "10^{3}" -> "1000"; None if not such a number.

    Powers with a non-terminating result ("3^{-1}") or with more than
    `_MAX_EXPANDED_DIGITS` digits stay symbolic in a canonical spelling
    ("1e5000", "3^-1") so equal spellings still compare equal."""
    m = _SCI_RE.match(s)
    if m:
        mant, exp = m.group(1), int(m.group(2))
        canon_mant = _canonical_number(mant)
        if canon_mant is None:
            return None
        if abs(exp) + len(mant) > _MAX_EXPANDED_DIGITS:
            return "0" if canon_mant == "0" else f"{canon_mant}e{exp}"
        return _decimal_text(mant, exp)
    m = _POW_RE.match(s)
    if m:  # "-2^2" is -(2^2), as in LaTeX
        sign, base, exp = m.group(1), m.group(2), int(m.group(3) or m.group(4))
        canon_base = _canonical_number(base)
        if canon_base is None:
            return None
        neg = "-" if sign == "-" else ""
        symbolic = f"{neg}{canon_base}^{exp}"
        if len(base) * abs(exp) > _MAX_EXPANDED_DIGITS or (exp < 0 and canon_base == "0"):
            return symbolic
        f = Fraction(canon_base) ** exp
        twos = fives = 0
        den = f.denominator
        while den % 2 == 0:
            den, twos = den // 2, twos + 1
        while den % 5 == 0:
            den, fives = den // 5, fives + 1
        if den != 1:  # no finite decimal ("3^-1"): keep the power
            return symbolic
        shift = max(twos, fives)  # f * 10**shift is an integer
        return _decimal_text(neg + str(f.numerator * 10**shift // f.denominator), -shift)
    return None


def _unify_minus(s: str) -> str:
    """Unicode minus signs and dashes -> "-"; vulgar fractions ("½", "3¾") and
    the fraction slash U+2044 -> ASCII ("1/2", "3 3/4", a mixed number)."""
    for k, v in _MINUS_SIGNS.items():
        s = s.replace(k, v)
    if any(ch in s for ch in _VULGAR):
        t = s
        s = _VULGAR_RE.sub(lambda m: (" " if m.start() > 0 and t[m.start() - 1].isdigit() else "")
                           + _VULGAR[m.group()], t)
    return s.replace("\u2044", "/")


def _normalize_once(s: str) -> str:
    s = _unify_minus(s).strip()
    s = _unwrap_commands(s)
    s = _strip_emphasis(s.strip(), ends=True)
    s = s.replace("{,}", ",")
    s = _TILDE_GROUP_RE.sub(" ", s)  # LaTeX "10~000"
    s = _SPACING_RE.sub(lambda m: "" if m.group(0) in ("\\,", "\\!", "\\left", "\\right", "\\displaystyle") else " ", s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = _convert_fracs(s)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"[.,;:]+$", "", s).strip()
    # Drop spaces next to symbols: "x = 5" -> "x=5", "1 / 2" -> "1/2" (words keep theirs).
    s = re.sub(r"\s*([^\w\s])\s*", r"\1", s)
    s = _mixed_numbers(s, latex=False)  # "3 1/2" -> "7/2"
    # "x=5" -> "5": a lone variable assigned a value.
    m = re.match(r"^[A-Za-z]=([^=]+)$", s)
    if m:
        s = m.group(1)
    # "(B)" -> "B": a parenthesised choice letter.
    m = re.match(r"^\(([A-E])\)$", s)
    if m:
        s = m.group(1)
    # Drop every group of braces around the whole answer: "{{5}}" -> "5".
    s = _strip_outer_braces(s)
    # Numbers and integer fractions.
    num = _canonical_number(s)
    if num is not None:
        return num
    num = _scientific_number(s)
    if num is not None:
        return num
    m = _INT_FRAC_RE.match(s)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if b != 0:
            f = Fraction(a, b)
            return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"
    peeled = _peel_parens(s)
    return s if peeled is None else peeled


def _peel_parens(s: str) -> str | None:
    """`(3/4)`, `-(3/4)`, `-(-(5))`, `((5))`: parentheses (each with an optional
    sign) around a plain number or fraction -> the signed number; else None.

    All the layers are peeled in one O(len) loop (no recursion per layer, so
    a thousand nested parentheses are as cheap as one), and the signs
    multiply: `-(-(3))` is 3."""
    i, j, neg, layers = 0, len(s), False, 0
    while True:
        k = i + 1 if i < j and s[i] in "+-" else i
        if not (k + 1 < j - 1 and s[k] == "(" and s[j - 1] == ")"):
            break
        neg ^= s[i] == "-"
        i, j = _trimmed(s, k + 1, j - 1)
        layers += 1
    if layers == 0:
        return None
    inner = _normalize_once(s[i:j])
    if _canonical_number(inner) is None and not _INT_FRAC_RE.match(inner):
        return None
    if neg:
        inner = _normalize_once(inner[1:] if inner.startswith("-") else "-" + inner)
    return inner


def normalize(answer: object) -> str:
    """Canonical text of an answer, so equal answers compare equal as strings.

    Removes: surrounding whitespace, `$...$`, `\\(...\\)`, `\\boxed{}`,
    `\\text{}` (and `\\textbf`, `\\mathrm`, `\\mbox`, ...), `$` and `%`
    signs, LaTeX spacing (`\\,`, `\\!`, `\\left`, `\\right`), trailing
    periods/commas, spaces next to symbols, a leading `x=` assignment.
    Markdown emphasis and code marks: `**73**`, `__73__`, `*73*`, `_73_`,
    `` `73` `` and a stray `**` next to the answer all give `73`; marks are
    stripped only where they open or close (see `_strip_emphasis`), so maths
    keeps its `x_1`, `a_{n}`, `3*4`, `2**10`, `x^*`.
    Numbers: thousands separators (`1,000`, `9{,}500`, `1\\,000`, `10~000`;
    and space-like ones, `10 000` with a space, U+00A0, U+2009 or U+202F,
    when the leading group has 1-3 digits and every later group exactly 3:
    `2 3` stays two numbers), a leading `+`, and
    trailing zeros go (`-3.0` -> `-3`, `29.00` -> `29`, `0.50` -> `0.5`);
    the unicode minus (U+2212) and dashes become `-`. Numbers are exact at
    any length (no rounding to 28 digits). Scientific notation and integer
    powers are expanded (`1e5` -> `100000`, `1.0e-3` -> `0.001`, `10^{3}`
    -> `1000`, `-2^2` -> `-4`) unless the result has no finite decimal or
    would exceed about 400 digits: then a canonical symbolic spelling stays
    (`1e5000`, `3^-1`). Parentheses around a number go, however deep, and
    their signs multiply: `-(3/4)` -> `-3/4`, `-(-(3))` -> `3`.
    Fractions: `\\frac{a}{b}`, `\\dfrac{a}{b}`, `\\tfrac`, `\\frac12` and
    `a/b` all become `a/b`, integer fractions reduced (`2/4` -> `1/2`,
    `6/3` -> `2`). Mixed numbers become one reduced improper fraction:
    `3\\frac{1}{2}`, `3\\dfrac12`, `3 1/2`, `3½` -> `7/2`, `-2\\frac{1}{3}` ->
    `-7/3` (a whole number, then a proper fraction of integers; see
    `_mixed_numbers`); a whole number before an improper fraction stays
    apart (`3\\frac{5}{2}` -> `3 5/2`, never `35/2`). Vulgar fractions
    (`½`, `¾`) and the fraction slash U+2044 are read as `a/b`. A
    parenthesised choice letter `(B)` becomes `B`.
    Not done: case folding, unit removal, decimal <-> fraction (`0.5` and
    `1/2` stay different).

    The result is a fixed point: `normalize(normalize(x)) == normalize(x)`
    (rewriting repeats until nothing changes, at most len(x) + 8 passes;
    any number of brace groups around the whole answer go in one pass).

    Args:
      answer: the answer; non-strings are converted with `str`.

    Returns:
      The normalised answer; "" when nothing is left. Never raises.
    """
    try:
        s = answer if isinstance(answer, str) else str(answer)
        # Every pass that changes the text strips at least one layer (a brace
        # group, a wrapper, a character), so len(s) + 8 passes reach the fixed point.
        for _ in range(len(s) + 8):
            new = _normalize_once(s)
            if new == s:
                break
            s = new
        return s
    except Exception:  # the contract is "never raise"; keep the text as is
        return answer.strip() if isinstance(answer, str) else ""


# ----------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------


def _prepare_numbers(text: str) -> str:
    text = _SIGNED_PAREN_RE.sub(r"\1\2", text)  # "-(3/4)" -> "-3/4"
    text = _DTFRAC_RE.sub(r"\\frac", text)
    text = _FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", text)
    text = _mixed_numbers(text)
    # A \frac right after a digit that is no mixed number keeps a space, so
    # "2.5\frac{1}{2}" is not read as the number 2.51/2.
    text = _NUM_FRAC_RE.sub(lambda m: (m.group(1) + " " if m.group(1) else "") + f"{m.group(2)}/{m.group(3)}", text)
    return _mixed_numbers(text, latex=False)


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
    boxed = _last_boxed(seg)
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
    boxed = _last_boxed(text)
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
    text = _strip_emphasis(text, letters=kind == "choice")
    if kind == "boxed":
        boxed = _last_boxed(text)
        return (normalize(boxed) or None) if boxed is not None else None
    if kind == "number":
        boxed = _last_boxed(text)
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
    boxed = _last_boxed(text)
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
        return _extract(_unify_minus(text), kind)
    except Exception:  # the contract is "never raise": no answer found
        return None
