"""LaTeX and markdown surgery on answer text: braces, `\\boxed{}`, wrapper commands,
fractions and mixed numbers, markdown emphasis (the pieces `normalize` and `extract` share).
"""

from __future__ import annotations

import bisect
import re
from fractions import Fraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


_WRAPPERS = ("text", "textbf", "textit", "mathrm", "mathbf", "mbox", "boxed", "fbox", "operatorname")


_SIMPLE_RE = re.compile(r"^[-+]?[\\\w.{}]+$")


_NOT_SIMPLE_RE = re.compile(r"[^\\\w.{}]")


_BRACE_RE = re.compile(r"[{}]")


_EMPH_RUN_RE = re.compile(r"\*+|_+|`+")


_EMPH_OPEN_AFTER = "([{\"'<:=*_`~"


_EMPH_CLOSE_BEFORE = ".,;:!?)]}\"'>*_`~"


DTFRAC_RE = re.compile(r"\\[dt]frac")


FRAC_DIGITS_RE = re.compile(r"\\frac\s*(\d)\s*(\d)")


_FRAC_OPEN_RE = re.compile(r"\\frac\s*\{")


_MIXED_FRAC_RE = re.compile(r"(?<![\w.,^_}/\\])(?<!\d[ \t\u00a0])(\d+)\s*\\frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")


_MIXED_TEXT_RE = re.compile(r"(?<![\w.,^_}/\\])(?<!\d[ \t\u00a0])(\d+)[ \t\u00a0]+(\d+)/(\d+)(?![\w/^]|[.,]\d)")


_WRAP_RE = re.compile(r"\\(?:" + "|".join(_WRAPPERS) + r")\s*\{")


def strip_outer_braces(s: str) -> str:
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


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}`; nested braces allowed.

    O(len(text)): the braces are matched once for the whole text (not once
    per `\\boxed{`, which would be quadratic in unclosed repeats)."""
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


def unwrap_commands(s: str) -> str:
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


def mixed_numbers(s: str, latex: bool = True) -> str:
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


def trimmed(s: str, i: int, j: int) -> tuple[int, int]:
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


def convert_fracs(s: str) -> str:
    """`\\frac{a}{b}`, `\\dfrac`, `\\tfrac`, `\\frac12` -> `a/b` (parenthesised when compound).

    Every `\\frac` is rewritten in one O(len) pass (nested ones too): its
    parts are parenthesised when their own text is not simple, as if the
    outermost were rewritten first. A `\\frac` without two brace groups is
    left as it is (and does not stop the others)."""
    s = DTFRAC_RE.sub(r"\\frac", s)
    s = FRAC_DIGITS_RE.sub(r"\\frac{\1}{\2}", s)
    s = mixed_numbers(s)
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
        a0, a1 = trimmed(s, num_open + 1, num_close)
        b0, b1 = trimmed(s, den_open + 1, den_close)
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


def strip_emphasis(s: str, ends: bool = False, letters: bool = False) -> str:
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
