"""Answer extraction and normalisation: handed cases, edge cases, fuzzing."""

from __future__ import annotations

import pytest
from helpers import load_cases
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxsample.reduce import answer_text, answers

# The hand-written cases, tests/data/cases/answers.json ("extract" and "equal").
_CASES = load_cases("answers")
EXTRACT_CASES = [(case["text"], case["answer"]) for case in _CASES["extract"]]
EQUAL_CASES = [tuple(pair) for pair in _CASES["equal"]]


@pytest.mark.parametrize("text,expected", EXTRACT_CASES)
def test_extract_handed_cases(text, expected):
    assert answers.extract(text) == expected


@pytest.mark.parametrize("a,b", EQUAL_CASES)
def test_equal_handed_cases(a, b):
    assert answers.normalize(a) == answers.normalize(b)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2"),  # nested braces
        ("so \\fbox{9{,}500} dollars", "9500"),  # \fbox, LaTeX thousands separator
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{\\text{(B)}}", "B"),
        ("$\\boxed{-\\dfrac{3}{4}}$", "-3/4"),
        ("\\boxed{2/4}", "1/2"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{1,234,567.50}", "1234567.5"),
        ("\\boxed {7}", "7"),  # LaTeX allows space before the group
        ("unterminated \\boxed{3 and then \\boxed{4}", "4"),
        ("first \\boxed{1}, then an unterminated \\boxed{2", "1"),
        ("The answer is $\\frac{1}{2}$.", "1/2"),
        ("The answer is: Paris.", "Paris"),
        ("The answer is (C).", "C"),
        ("The answer is \\$1,200.", "1200"),
        ("We have 5-3=2", "2"),
        ("It costs $5.\n#### 1,234", "1234"),
        ("Result is 0.50", "0.5"),
        ("the value is -0.0", "0"),
        ("", None),
        ("no digits at all", None),
    ],
)
def test_extract_auto(text, expected):
    assert answers.extract(text) == expected


@pytest.mark.parametrize(
    "text,kind,expected",
    [
        ("so \\boxed{12} and 13", "boxed", "12"),
        ("no box: 13", "boxed", None),
        ("\\boxed . nothing", "boxed", None),
        ("first 12 then 1,300 apples.", "number", "1300"),
        ("so x = \\frac{3}{6}", "number", "1/2"),
        ("ratio 3 / 4", "number", "3/4"),
        ("items 1,2,3", "number", "3"),
        ("temperature -4 degrees", "number", "-4"),
        ("Answer: C", "choice", "C"),
        ("the answer is (b)", "choice", "B"),
        ("I think (A) is wrong, (D) is right", "choice", "D"),
        ("Reasoning...\nB\n", "choice", "B"),
        ("\\boxed{E}", "choice", "E"),
        ("A cat sat.", "choice", None),
        ("line one\n  The capital is Paris.  \n\n", "text", "The capital is Paris"),
        ("   \n  ", "text", None),
    ],
)
def test_extract_kinds(text, kind, expected):
    assert answers.extract(text, kind) == expected


@pytest.mark.parametrize(
    "a,b",
    [
        ("$29.00$", "29"),
        ("\\text{29}", "29"),
        ("1{,}000", "1,000"),
        ("1\\,000", "1000"),
        ("\\frac{1}{2}", "1/2"),
        ("\\tfrac12", "1/2"),
        ("\\frac{-1}{2}", "-1/2"),
        ("6/3", "2"),
        ("50%", "50"),
        ("(B)", "B"),
        ("7.", "7"),
        ("x = 1 / 2", "1/2"),
        ("  5  ", "5"),
    ],
)
def test_normalize_equal(a, b):
    assert answers.normalize(a) == answers.normalize(b)


@pytest.mark.parametrize("a,b", [("0.5", "1/2"), ("New York", "NewYork"), ("3", "30"), ("-3", "3")])
def test_normalize_distinct(a, b):
    assert answers.normalize(a) != answers.normalize(b)


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="kind"):
        answers.extract("42", kind="latex")


def test_non_string_text_gives_none():
    assert answers.extract(None) is None
    assert answers.extract(42) is None


_TOKENS = list("0123456789-+.,/ $%{}()\\#:=abcdexABCDE\n") + [
    "\\boxed{", "\\fbox{", "\\frac", "\\dfrac", "{,}", "\\text{", "answer is ", "####", "Answer: "]
_LATEXY = st.lists(st.sampled_from(_TOKENS), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), _LATEXY), st.sampled_from(answers.KINDS))
def test_extract_never_raises(text, kind):
    out = answers.extract(text, kind)
    assert out is None or (isinstance(out, str) and out != "")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=60), _LATEXY))
def test_normalize_never_raises_and_is_idempotent(text):
    once = answers.normalize(text)
    assert isinstance(once, str)
    assert answers.normalize(once) == once


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**9, 10**9))
def test_number_spellings_agree(x):
    plain = str(x)
    assert answers.normalize(f"{x:,}") == plain
    assert answers.normalize(f"{x}.00") == plain
    assert answers.normalize(f"${x:,}$") == plain
    assert answers.extract(f"so the total is \\boxed{{{x:,}}}.") == plain
    assert answers.extract(f"Work...\n#### {x:,}") == plain


# ---------------------------------------------------------------------------
# Regression tests: exact long numbers, unicode minus, scientific notation,
# powers, signed parentheses, deep braces.


@pytest.mark.parametrize("a,b", [
    ("12345678901234567890123456789", "12345678901234567890123456788"),
    ("12345678901234567890123456789", "12345678901234567890123456790"),
    ("0.12345678901234567890123456789123", "0.12345678901234567890123456789124"),
    ("9" * 40, "1" + "0" * 40),
])
def test_normalize_long_numbers_are_exact(a, b):
    assert answers.normalize(a) == a
    assert answers.normalize(a) != answers.normalize(b)
    assert answers.extract(f"The answer is {a}") == a
    assert answers.extract(f"#### {a}") == a


@settings(max_examples=100, deadline=None)
@given(st.integers(-10**80, 10**80))
def test_normalize_is_exact_for_any_length(x):
    assert answers.normalize(str(x)) == str(x)
    assert answers.normalize(f"{x}.000") == str(x)


@pytest.mark.parametrize("text,expected", [
    ("\u22123", "-3"),
    ("The answer is \u22123", "-3"),
    ("#### \u221242", "-42"),
    ("\\boxed{\u22121/2}", "-1/2"),
    ("1e5", "100000"),
    ("The answer is 1e5", "100000"),
    ("1.0e-3", "0.001"),
    ("The answer is 1.0e-3.", "0.001"),
    ("-1E+2", "-100"),
    ("-(3/4)", "-3/4"),
    ("The answer is -(3/4).", "-3/4"),
    ("10^{3}", "1000"),
    ("The answer is 10^3", "1000"),
    ("2^{-1}", "0.5"),
])
def test_extract_minus_scientific_powers_parens(text, expected):
    assert answers.extract(text) == expected
    assert answers.extract(text, "number") == expected or "boxed" in text


@pytest.mark.parametrize("a,b", [("\u22123", "-3"), ("1e3", "1000"), ("1.0e-3", "0.001"),
                                 ("10^{3}", "1000"), ("-(3/4)", "-3/4"), ("1e5000", "1.0e5000")])
def test_normalize_equal_spellings(a, b):
    assert answers.normalize(a) == answers.normalize(b)


def test_huge_exponents_stay_symbolic_and_fast():
    assert answers.normalize("1e5000") == "1e5000"
    assert answers.normalize("2^{100000}") == "2^100000"
    assert answers.normalize("3^{-1}") == "3^-1"  # no finite decimal
    assert answers.normalize("1e99999999999") == "1e99999999999"


@pytest.mark.parametrize("depth", [1, 2, 10, 100, 3000])
def test_normalize_deep_braces_reaches_a_fixed_point(depth):
    text = "{" * depth + "5" + "}" * depth
    assert answers.normalize(text) == "5"
    assert answers.extract("\\boxed{" + text + "}") == "5"


@pytest.mark.parametrize("text", ["{{{{{{{{{{5}}}}}}}}}}", "{{a}{b}}", "{x}}", "{{5}", "{\\}",
                                  "-(-(-(3)))", "\\text{\\text{\\text{{{7}}}}}"])
def test_normalize_idempotent_regressions(text):
    once = answers.normalize(text)
    assert answers.normalize(once) == once


# ---------------------------------------------------------------------------
# Regression tests: linear time on repeated constructs. A quadratic
# extraction took 10 s for 5,000 unclosed "\boxed{" (minutes for 50,000);
# linear code takes well under 0.5 s. The bound is generous so the test is
# no timing flake, and an alarm stops a regression at the bound instead of
# letting it run for minutes. The constructs after "dollars" use 20,000
# repeats (quadratic there is still tens of seconds) to keep the file quick.


def _run_within(seconds, fn, *args):
    import signal
    import time

    if not hasattr(signal, "setitimer"):
        pytest.skip("needs signal.setitimer (Unix)")

    def _alarm(signum, frame):
        raise TimeoutError(f"took more than {seconds} s: super-linear?")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        t0 = time.perf_counter()
        out = fn(*args)
        return out, time.perf_counter() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


_REPEATED = {
    "unclosed boxed": "\\boxed{" * 50_000,
    "unclosed boxed, one closed": "\\boxed{1}" + "\\boxed{" * 50_000,
    "nested boxed": "\\boxed{" * 50_000 + "5" + "}" * 50_000,
    "unclosed fbox": "\\fbox{" * 50_000,
    "unclosed text": "\\text{" * 50_000,
    "nested text": "\\text{" * 50_000 + "7" + "}" * 50_000,
    "many wrappers": "\\text{x}" * 50_000,
    "many fracs": "\\frac{1}{2}" * 50_000,
    "unclosed fracs": "\\frac{" * 50_000,
    "dollars": "The answer is $$ " * 50_000,
    "nested fracs": "\\frac{" * 50_000 + "1" + "}{2}" * 50_000,
    "deep braces in a box": "\\boxed{" + "{" * 50_000 + "5" + "}" * 50_000 + "}",
    "emphasis pairs": "**a** " * 20_000,
    "emphasis runs": "**a" * 20_000,
    "choice parens": "(a) " * 20_000,
    "answer is a": "The answer is a " * 20_000,
    "mixed numbers": "3 1/2 " * 20_000 + "3\\frac{1}{2}" * 20_000,
    "space thousands": "10 000 " * 20_000,
    "escaped dollars": "The answer is $\\$" * 20_000,
    "labelled lines": "B) 42\n" * 20_000,
    "nested parentheses": "(" * 20_000 + "5" + ")" * 20_000,
    "nested signed parentheses": "-(" * 20_000 + "5" + ")" * 20_000,
    "nested emphasis": "**__" * 5_000 + "73" + "__**" * 5_000,
    "nested single emphasis": "*_" * 5_000 + "73" + "_*" * 5_000,
}


@pytest.mark.parametrize("name", list(_REPEATED))
def test_extract_is_linear_in_repeated_constructs(name):
    text = _REPEATED[name]
    for kind in answers.KINDS:
        _, dt = _run_within(5.0, answers.extract, text, kind)
        assert dt < 5.0, (name, kind, dt)
    _, dt = _run_within(5.0, answers.normalize, text)
    assert dt < 5.0, (name, "normalize", dt)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab1+-.{}\\ \t\n(", max_size=30), st.data())
def test_simple_part_check_matches_the_regex(s, data):
    i = data.draw(st.integers(0, len(s)))
    j = data.draw(st.integers(i, len(s)))
    not_simple = [m.start() for m in answer_text._NOT_SIMPLE_RE.finditer(s)]
    i2, j2 = answer_text.trimmed(s, i, j)
    assert s[i2:j2] == s[i:j].strip()
    assert answer_text._is_simple(s, i2, j2, not_simple) == bool(answer_text._SIMPLE_RE.match(s[i:j].strip()))


def test_repeated_constructs_still_give_the_answer():
    assert answers.extract("\\boxed{1}" + "\\boxed{" * 5_000) == "1"
    assert answers.extract("\\boxed{" * 5_000 + "5" + "}" * 5_000) == "5"
    assert answers.extract("\\boxed{" * 5_000 + "5" + "}", "boxed") == "5"
    assert answers.normalize("\\text{" * 5_000 + "7" + "}" * 5_000) == "7"
    assert answers.normalize("\\text{\\textbf{8}}") == "8"
    assert answers.normalize("\\text{9") == "9"  # an unclosed wrapper loses its command
    # One \frac without a denominator no longer stops the others.
    assert answers.normalize("\\frac{1}{2}+\\frac{3}") == "1/2+\\frac{3}"
    assert answers.normalize("\\frac{\\frac{1}{2}}{3}") == "1/2/3"
    assert answers.normalize("\\frac{a+b}{ c }") == "(a+b)/c"


# ---------------------------------------------------------------------------
# Regression tests: Markdown emphasis and code marks around and inside answers.


@pytest.mark.parametrize("text,expected", [
    ("Final Answer: **73**", "73"),
    ("The answer is **73**.", "73"),
    ("**Answer:** 73", "73"),
    ("**Final Answer:** $\\boxed{73}$", "73"),
    ("The answer is ***73***", "73"),
    ("The answer is __73__.", "73"),
    ("The answer is *73*.", "73"),
    ("The answer is _73_.", "73"),
    ("The answer is `73`.", "73"),
    ("The answer is ``73``", "73"),
    ("**The answer is 73.**", "73"),
    ("*Answer*: 73", "73"),
    ("__Answer__: 73", "73"),
    ("Answer: **$18**", "18"),
    ("The answer is **73 apples**.", "73"),
    ("The answer is **73", "73"),       # an unclosed run next to the answer
    ("#### **1,234**", "1234"),
    ("\\boxed{**7**}", "7"),
    ("* Step one\n* The answer is **12**.", "12"),  # list bullets are not emphasis
    ("The answer is **Paris**.", "Paris"),
    ("Answer: `x_1`", "x_1"),
    ("The answer is $x_1$.", "x_1"),
])
def test_extract_strips_emphasis(text, expected):
    assert answers.extract(text) == expected


@pytest.mark.parametrize("text,kind,expected", [
    ("so the value is **12**", "number", "12"),
    ("so \\boxed{__5__}", "boxed", "5"),
    ("line\n**Paris**", "text", "Paris"),
    ("line\n```\n42\n```", "text", "42"),   # a code fence is not the last line
    ("The answer is `B`", "choice", "B"),
])
def test_extract_kinds_strip_emphasis(text, kind, expected):
    assert answers.extract(text, kind) == expected


@pytest.mark.parametrize("spelling", ["**73**", "__73__", "*73*", "_73_", "`73`", "``73``",
                                      "***73***", "**_73_**", "**73", "73**", "**73**.", "$**73**$"])
def test_normalize_strips_emphasis(spelling):
    assert answers.normalize(spelling) == "73"


@pytest.mark.parametrize("answer", ["x_1", "a_{n}", "x_{1}+y_{2}", "a_b_c", "3*4", "2**10", "2^{*}",
                                    "x^*", "f_*", "\\_", "my_var", "3\\cdot4", "x_1*y_1"])
def test_normalize_keeps_maths_markers(answer):
    assert answers.normalize(answer) == answer
    assert answers.extract(f"\\boxed{{{answer}}}") == answer


def test_emphasis_does_not_pair_across_lines_or_maths():
    assert answers.normalize("$x^*$ and $y^*$") == "x^*and y^*"  # spaces next to symbols go
    assert answers.normalize("3 * 4 * 5") == "3*4*5"
    assert answers.extract("Let **step 1\nThe answer is 5**") == "5"


def test_emphasised_spellings_are_one_vote():
    from jaxsample import reduce as reducers
    texts = [["Final Answer: **73**", "The answer is 73.", "**Answer:** 73", "#### 73", "The answer is 72."]]
    sc = reducers.self_consistency(texts)
    assert sc.answers == [["73", "73", "73", "73", "72"]]
    assert sc.winner == ["73"] and float(sc.share[0]) == pytest.approx(0.8)


_NEW_TOKENS = _TOKENS + ["**", "*", "_", "__", "`", "``", "x_1", "3*4", "^*", "\n", "\\$", "$",
                         " 000", "\u00a0000", "\u2009", "\u202f", "~", "\\ ", " 1/2", "\u00bd", "\u2044",
                         "\\frac12", "\\tfrac{1}{3}"]
_NEW_LATEXY = st.lists(st.sampled_from(_NEW_TOKENS), max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(_NEW_LATEXY, st.sampled_from(answers.KINDS))
def test_new_constructs_never_raise_and_normalize_is_idempotent(text, kind):
    out = answers.extract(text, kind)
    assert out is None or (isinstance(out, str) and out != "")
    once = answers.normalize(text)
    assert answers.normalize(once) == once


# ---------------------------------------------------------------------------
# Regression tests: an escaped dollar inside inline maths is a dollar sign,
# not the end of the maths.


@pytest.mark.parametrize("text,expected", [
    ("The answer is $\\$18$.", "18"),
    ("Answer: $\\$1{,}000$", "1000"),
    ("The answer is $\\$18.50$ per hour.", "18.5"),
    ("The answer is $\\$\\,18$", "18"),
    ("#### $\\$18$", "18"),
    ("The answer is $$\\$18$$", "18"),
    ("The answer is $18\\$$", "18"),
    ("The answer is $\\text{\\$}18$", "18"),
    ("Answer: $\\$1\\,000$.", "1000"),
    ("The answer is $\\$18", "18"),             # unterminated maths
    ("The answer is $\\$\\$18$", "18"),
])
def test_extract_escaped_dollar_inside_maths(text, expected):
    assert answers.extract(text) == expected
    assert answers.extract(text, "number") == expected


def test_escaped_dollar_first_maths_after_answer_is():
    text = "The answer is $\\$18$ and then $\\$20$."
    assert answers.extract(text) == "18"
    # "number" takes the number right after the last answer phrase
    # before the last number (it took the last number, "20", before).
    assert answers.extract(text, "number") == "18"


def test_escaped_dollar_spellings_are_one_answer():
    spellings = ["$\\$18$", "\\$18", "$18", "18", "$18.00$"]
    assert {answers.normalize(s) for s in spellings} == {"18"}
    assert {answers.extract(f"The answer is {s}.") for s in spellings} == {"18"}


# ---------------------------------------------------------------------------
# Regression tests: thousands separated by a space-like character. Rule: the
# leading group has 1-3 digits, each later group is one space, U+00A0,
# U+2009 or U+202F followed by exactly 3 digits, and the number does not
# follow a digit and a space.


@pytest.mark.parametrize("sep", [" ", "\u00a0", "\u2009", "\u202f"])
@pytest.mark.parametrize("text,expected", [
    ("10{s}000", "10000"),
    ("The answer is 10{s}000.", "10000"),
    ("#### 1{s}234{s}567", "1234567"),
    ("It costs $12{s}345.50 in total", "12345.5"),
    ("So -10{s}000 it is", "-10000"),
    ("\\boxed{5{s}000{s}000}", "5000000"),
    ("between 3 and 4{s}000", "4000"),
])
def test_extract_space_thousands(sep, text, expected):
    text = text.replace("{s}", sep)
    assert answers.extract(text) == expected
    assert answers.extract(text, "number") == expected


@pytest.mark.parametrize("text,auto,number", [
    ("the answer is 2 3", "2", "2"),                     # groups must be exactly 3 digits
    ("I have 3 apples and 4 pears", "4", "4"),
    ("10 00", "0", "0"),
    ("10 0000", "0", "0"),
    ("in 2023 100 people came", "100", "100"),           # a 4-digit leading group is no group
    ("1 2 3 100", "100", "100"),                         # a list, not 3100
    ("The answer is 1 000 people", "1000", "1000"),
    ("The answer is 7 and 100 more", "7", "7"),          # the answer phrase wins
    ("I have 7 and 100 more", "100", "100"),
])
def test_extract_space_thousands_ambiguity(text, auto, number):
    assert answers.extract(text) == auto
    assert answers.extract(text, "number") == number


@pytest.mark.parametrize("a,b", [("10 000", "10000"), ("10\u202f000", "10,000"), ("1\u2009234\u2009567", "1234567"),
                                 ("10\\ 000", "10000"), ("10\\;000", "10000"), ("10~000", "10000"),
                                 ("$10\u00a0000.00$", "10000")])
def test_normalize_space_thousands(a, b):
    assert answers.normalize(a) == answers.normalize(b)


@pytest.mark.parametrize("a,b", [("2 3", "23"), ("10 00", "1000"), ("1 0000", "10000")])
def test_normalize_space_not_thousands(a, b):
    assert answers.normalize(a) != answers.normalize(b)
    assert answers.normalize(a) == a


# ---------------------------------------------------------------------------
# Regression tests: mixed numbers are one improper fraction, never the
# digits glued together ("3\frac{1}{2}" was "31/2").


@pytest.mark.parametrize("text,expected", [
    ("\\boxed{3\\frac{1}{2}}", "7/2"),
    ("3\\frac{1}{2} cups", "7/2"),
    ("The answer is $3\\frac{1}{2}$.", "7/2"),
    ("\\boxed{3\\dfrac{1}{2}}", "7/2"),
    ("\\boxed{3\\tfrac{1}{2}}", "7/2"),
    ("\\boxed{3\\frac12}", "7/2"),
    ("\\boxed{3 \\frac{1}{2}}", "7/2"),
    ("\\boxed{-2\\frac{1}{3}}", "-7/3"),
    ("so it is -2\\frac{1}{3}", "-7/3"),
    ("\\boxed{\u22122\\dfrac{1}{3}}", "-7/3"),
    ("\\boxed{12\\frac{3}{4}}", "51/4"),
    ("\\boxed{5\\frac{2}{4}}", "11/2"),     # reduced
    ("\\boxed{\\$3\\frac{1}{2}}", "7/2"),
    ("She needs 3 1/2 cups.", "7/2"),
    ("The answer is 3 1/2.", "7/2"),
    ("#### -4 1/3", "-13/3"),
    ("It takes 2 3/4 hours", "11/4"),
    ("3\u00bd cups", "7/2"),
    ("The answer is 2\u00be.", "11/4"),
    ("\\boxed{7/2}", "7/2"),
])
def test_extract_mixed_numbers(text, expected):
    assert answers.extract(text) == expected


@pytest.mark.parametrize("a", ["3\\frac{1}{2}", "3\\dfrac{1}{2}", "3\\tfrac12", "3 1/2", "3 \\frac{1}{2}",
                               "$3\\frac{1}{2}$", "7/2", "14/4", "\\frac{7}{2}", "3\u00bd", "3 1\u20442"])
def test_normalize_mixed_numbers_agree(a):
    assert answers.normalize(a) == "7/2"


@pytest.mark.parametrize("text,kind,expected", [
    ("\\boxed{3\\frac{5}{2}}", "auto", "3 5/2"),     # improper: kept apart, not 35/2
    ("2.5\\frac{1}{2}", "number", "1/2"),           # not the number 2.51/2
    ("x^2\\frac{1}{2}", "number", "1/2"),           # an exponent is no whole part
    ("1 2 1/2", "number", "1/2"),                   # a list of numbers, then a fraction
    ("3 4/2", "number", "2"),                       # improper: no mixed number
    ("on 3 1/2/2020", "number", "2020"),            # a date is no mixed number
])
def test_mixed_number_look_alikes(text, kind, expected):
    assert answers.extract(text, kind) == expected


def test_mixed_numbers_are_one_vote():
    from jaxsample import reduce as reducers
    texts = [["\\boxed{3\\frac{1}{2}}", "She needs 3 1/2 cups.", "#### 7/2", "The answer is $\\frac{7}{2}$",
              "#### 31/2"]]
    sc = reducers.self_consistency(texts)
    assert sc.answers == [["7/2", "7/2", "7/2", "7/2", "31/2"]]
    assert sc.winner == ["7/2"]


# ---------------------------------------------------------------------------
# Regression tests: multiple-choice letters, lower-case and emphasised; an
# article is never a choice. The normalised form is the upper-case letter.


@pytest.mark.parametrize("text,expected", [
    ("a", "A"),
    ("(a)", "A"),
    ("b.", "B"),
    ("**B**", "B"),
    ("**b**", "B"),
    ("The answer is: **B**", "B"),
    ("The answer is **a**", "A"),
    ("Answer: *c*", "C"),
    ("The answer is `d`.", "D"),
    ("B) 42", "B"),
    ("B. 42", "B"),
    ("b) 42", "B"),
    ("The options are\nA) 12\nB) 42", "B"),
    ("answer is (b)", "B"),
    ("Answer: c", "C"),
    ("The answer is c.", "C"),
    ("Answer: a, since it is listed first", "A"),
    ("The correct option is: d", "D"),
    ("Option (e) is right", "E"),
    ("I choose (e).", "E"),
    ("\\boxed{b}", "B"),
    ("\\boxed{(b)}", "B"),
    ("\\boxed{\\text{(c)}}", "C"),
    ("Reasoning...\nd\n", "D"),
    ("The answer is B because it is larger", "B"),
    ("[B]", "B"),
    ('The answer is "C".', "C"),
    ("The answer is 'b'", "B"),
    ("The answer is [d].", "D"),
    ("The answer is \u201cb\u201d", "B"),
    ("so (a) and then [b]", "B"),
])
def test_extract_choice_letters(text, expected):
    assert answers.extract(text, "choice") == expected


@pytest.mark.parametrize("text", [
    "The answer is a banana",
    "I think a lot",
    "A cat sat.",
    "The answer is a number between 1 and 10",
    "answered every question",
    "The answer is e.g. not known",
    "a lot of work, but done",
    "The best choice is a good one",
    "f(a) = 5",                 # a function's argument
    "x[b] = 5",                 # an index
    "I think a. b. and c. are all fine, really",
])
def test_extract_choice_never_reads_an_article(text):
    assert answers.extract(text, "choice") is None


def test_choice_spellings_are_one_vote():
    from jaxsample import reduce as reducers
    texts = [["The answer is (b)", "**B**", "Answer: b", "B) 42", "The answer is a banana"]]
    sc = reducers.self_consistency(texts, extract="choice")
    assert sc.answers == [["B", "B", "B", "B", None]]
    assert sc.winner == ["B"] and float(sc.share[0]) == 1.0


@pytest.mark.parametrize("text,expected", [
    ("(" * 3000 + "5" + ")" * 3000, "5"),
    ("-(" * 3000 + "5" + ")" * 3000, "5"),      # an even number of minus signs
    ("-(" * 3001 + "5" + ")" * 3001, "-5"),
    ("-(-(3))", "3"),                             # was "--3"
    ("-(-(-(3)))", "-3"),
    ("-(-0.50)", "0.5"),
    ("+(-(3/4))", "-3/4"),
    ("-((3/4))", "-3/4"),
    ("( ( 5 ) )", "5"),
    ("(1)+(2)", "(1)+(2)"),                       # not one parenthesised number
    ("((x))", "((x))"),
])
def test_normalize_nested_signed_parentheses(text, expected):
    assert answers.normalize(text) == expected
    assert answers.extract(f"\\boxed{{{text}}}") == expected


@pytest.mark.parametrize("text", ["**_73_**", "*_73_*", "__**73**__", "_*73*_", "**__73__**", "*_*_73_*_*",
                                  "**__" * 1000 + "73" + "__**" * 1000])
def test_normalize_nested_emphasis(text):
    assert answers.normalize(text) == "73"


# ---------------------------------------------------------------------------
# More spellings of the same classes (held-out style probes).


@pytest.mark.parametrize("text,expected", [
    ("**Final Answer**: 42", "42"),
    ("The final answer is: **$42$**", "42"),
    ("Therefore, the answer is __**42**__.", "42"),
    ("Answer:\n**42**", "42"),
    ("The answer is **x** = **5**", "5"),
    ("**Answer:** $\\$1{,}000$", "1000"),
    ("**Answer:** 10 000", "10000"),
    ("**Answer:** $3\\frac{1}{2}$", "7/2"),
])
def test_extract_combined_probes(text, expected):
    assert answers.extract(text) == expected


def test_space_thousands_are_one_vote():
    from jaxsample import reduce as reducers
    texts = [["#### 10 000", "#### 10,000", "The answer is 10000.", "\\boxed{10\u202f000}", "#### 10 00"]]
    sc = reducers.self_consistency(texts)
    assert sc.answers == [["10000", "10000", "10000", "10000", "10"]]  # "10 00": no 3-digit group
    assert sc.winner == ["10000"] and float(sc.share[0]) == pytest.approx(0.8)


# ---------------------------------------------------------------------------
# Regression tests: the precedence of the "number" rules. A
# restated operand after the result won the vote ("12 * 7 = 94 ... numbers
# from 7" counted 7). Rules: \boxed{}; the number right after the last answer
# phrase that has one; the result of the last equation; the last number.

_PRECEDENCE = [
    # The cases.
    ("12 * 7 = 94 \n\nSo we multiply the numbers from 7", "94"),
    ("17 + 25 = 32. That is the sum of 17 and 25.", "32"),
    ("A prime is a number greater than 1 with no divisors but 1 and itself. "
     "The answer is 7, since 7 is prime and greater than 1.", "7"),
    ("7 is prime: its only divisors are 1 and itself, and it is greater than 1. 7 = 1 * 7.",
     "7"),
    # 1. \boxed beats everything.
    ("\\boxed{12}. The answer is 13, as 6 + 7 = 13", "12"),
    # 2. Answer phrases: the last one that has a number wins; fillers, "$", a variable.
    ("The answer is 5. No wait, the answer is 6, from 2 and 3.", "6"),
    ("The answer is 42. I hope the answer is right, given 6 and 7.", "42"),
    ("The answer is 40.\nCheck: 6 * 7 = 42", "40"),
    ("Final Answer: 42 (from 6 and 7)", "42"),
    ("final answer 42, using 6 and 7", "42"),
    ("The final answer is: $\\$1,200$ for the 3 items", "1200"),
    ("The result is 12, not 13", "12"),
    ("answer is: 15 after 3 steps", "15"),
    ("Answer = 9 from 3 squared", "9"),
    ("The answer would be 81, which is 9 times 9", "81"),
    ("The answer is therefore approximately 3.14, close to 3", "3.14"),
    ("So the answer is x = 5, where x > 2", "5"),
    ("Answer:\n24 clips, 48 in April", "24"),
    ("The answer is 17.\n#### 18", "18"),
    ("The answer is 3 1/2 cups, from 7 halves", "7/2"),
    # 3. The final equation: the number after the last "=" that has one.
    ("5 - 8 = -3, so subtract 8", "-3"),
    ("Total = $1,200 for 3 items", "1200"),
    ("x = 3, so y = 2x for all 4 cases", "3"),
    ("3 + \\frac{1}{2} = 3\\frac{1}{2}, from 3 and a half", "7/2"),
    ("12 - 3 = 9 dollars left of 12", "9"),
    ("The total is 4 + 5 = 9; the 4 came first", "9"),
    ("If x >= 10 we stop at 4", "4"),                 # no equation: the last number
    ("a == 3 and b != 5, c <= 7", "7"),
    ("2 + 3 = 5 => 5 items in 2 bags", "5"),
    # 4. Neither: the last number.
    ("I have 3 apples and 4 pears", "4"),
]


# "auto" reads any answer after "the answer is" (a word too), then the same rules.
_AUTO_DIFFERS = {"The answer is 42. I hope the answer is right, given 6 and 7.": "right",
                 "The answer is 3x, so x = 4": "3x"}


@pytest.mark.parametrize("text,expected", _PRECEDENCE)
def test_number_precedence(text, expected):
    assert answers.extract(text, "number") == expected
    assert answers.extract(text) == _AUTO_DIFFERS.get(text, expected)


@pytest.mark.parametrize("text,expected", [
    ("The answer is therefore 12 - 3 = 9 dollars", "9"),    # an expression: its "=" decides
    ("The answer is 2 * 5 = 10", "10"),
    ("The answer is 3x, so x = 4", "4"),                     # glued to a letter: no number
    ("The answer is indeed 94.", "94"),
])
def test_answer_phrase_expressions(text, expected):
    assert answers.extract(text, "number") == expected
    assert answers.extract(text) == _AUTO_DIFFERS.get(text, expected)


def test_precedence_is_one_vote():
    from jaxsample import reduce as reducers
    texts = [["12 * 7 = 84, from 12 and 7", "The answer is 84 (7 twelves).", "\\boxed{84}",
              "12 * 7 = 84 so 7", "The answer is 74."]]
    for kind in ("number", "auto"):
        sc = reducers.self_consistency(texts, extract=kind)
        assert sc.answers == [["84", "84", "84", "84", "74"]], kind
        assert sc.winner == ["84"]


_REPEATED_PRECEDENCE = {
    "answer phrases": "The answer is therefore thus so " * 4_000,
    "answer colons": "Answer: " * 15_000,
    "final answers": "Final answer\n\n" * 10_000,
    "results": "the result is $( " * 8_000,
    "hashes": "####" * 30_000,
    "equals": "= " * 50_000,
    "equals, spaces": ("=" + " " * 20) * 5_000,
    "assignments": "x = " * 30_000,
    "expressions": "= 1 + " * 20_000,
    "equations": "2 * 7 = 7 * 2 " * 8_000,
    "leads": "= $\\$\\(( x = " * 8_000,
}


@pytest.mark.parametrize("name", list(_REPEATED_PRECEDENCE))
def test_number_precedence_is_linear(name):
    """The phrase and "=" scans read each position a bounded number of times (a
    quadratic scan takes minutes here; linear code well under a second)."""
    text = _REPEATED_PRECEDENCE[name]
    for kind in ("number", "auto"):
        _, dt = _run_within(5.0, answers.extract, text, kind)
        assert dt < 5.0, (name, kind, dt)
