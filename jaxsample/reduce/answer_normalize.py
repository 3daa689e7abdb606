"""`normalize(answer)`: equivalent spellings of one answer mapped to one string
("1,000", "1000" and "$1{,}000$" are one answer). Never raises on any string.
"""

from __future__ import annotations

import re
from decimal import MAX_EMAX, MIN_EMIN, Decimal, InvalidOperation, localcontext
from fractions import Fraction

from jaxsample.reduce.answer_text import (
    convert_fracs,
    mixed_numbers,
    strip_emphasis,
    strip_outer_braces,
    trimmed,
    unwrap_commands,
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


_SPACING_RE = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\left|\\right|\\displaystyle")


_DEC_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")


_TILDE_GROUP_RE = re.compile(r"(?<=\d)~(?=\d{3}(?!\d))")


_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:(?:,\d{3})+|(?: \d{3})+)(?:\.\d+)?$")


_INT_FRAC_RE = re.compile(r"^([-+]?\d+)/([-+]?\d+)$")


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


def unify_minus(s: str) -> str:
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
    s = unify_minus(s).strip()
    s = unwrap_commands(s)
    s = strip_emphasis(s.strip(), ends=True)
    s = s.replace("{,}", ",")
    s = _TILDE_GROUP_RE.sub(" ", s)  # LaTeX "10~000"
    s = _SPACING_RE.sub(lambda m: "" if m.group(0) in ("\\,", "\\!", "\\left", "\\right", "\\displaystyle") else " ", s)
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = convert_fracs(s)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"[.,;:]+$", "", s).strip()
    # Drop spaces next to symbols: "x = 5" -> "x=5", "1 / 2" -> "1/2" (words keep theirs).
    s = re.sub(r"\s*([^\w\s])\s*", r"\1", s)
    s = mixed_numbers(s, latex=False)  # "3 1/2" -> "7/2"
    # "x=5" -> "5": a lone variable assigned a value.
    m = re.match(r"^[A-Za-z]=([^=]+)$", s)
    if m:
        s = m.group(1)
    # "(B)" -> "B": a parenthesised choice letter.
    m = re.match(r"^\(([A-E])\)$", s)
    if m:
        s = m.group(1)
    # Drop every group of braces around the whole answer: "{{5}}" -> "5".
    s = strip_outer_braces(s)
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
        i, j = trimmed(s, k + 1, j - 1)
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
    stripped only where they open or close (see `strip_emphasis`), so maths
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
    `mixed_numbers`); a whole number before an improper fraction stays
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
