"""Deterministic generators of small verifiable arithmetic problems (chat prompts).

Used by benchmarks/accuracy.py. Every problem has a single integer answer,
graded by exact match of `jaxsample.reduce.answers.extract(text, "number")` with the
reference. A problem set is a pure function of (family, count, seed): no
downloads, no global random state. Problems within one set are distinct.

Families (difficulty for SmolLM2-135M-Instruct measured in
docs/benchmarks.md, "Accuracy: best-of-N and self-consistency"):

  add1     single-digit addition        "What is 3 + 4?"
  add2     two-digit addition           "What is 23 + 48?"
  addsub   a + b - c, small numbers     "What is 7 + 5 - 3?"
  mul1     single-digit multiplication  "What is 7 * 8?"
  word     one-step word problem        "Sam has 12 apples and gets 5 more. ..."
  compare  the larger of two numbers    "Which number is larger, 37 or 52?"
  mul21    two-digit times one-digit    "What is 23 * 7?"  (harder; benchmarks/selection.py)
"""

from __future__ import annotations

import dataclasses
import random

INSTRUCTION = "Answer with just the number."

_NAMES = ["Sam", "Ana", "Li", "Tom", "Mia", "Ben", "Zoe", "Raj", "Eva", "Max"]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps"]


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem: the user message (chat) and the normalised integer answer."""

    family: str
    question: str
    answer: str

    @property
    def prompt(self) -> str:
        return f"{self.question} {INSTRUCTION}"


def _add1(rng: random.Random):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def _add2(rng: random.Random):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", a + b


def _addsub(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    c = rng.randint(1, a + b - 1)
    return f"What is {a} + {b} - {c}?", a + b - c


def _mul1(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b


def _mul21(rng: random.Random):
    a, b = rng.randint(11, 99), rng.randint(3, 9)
    return f"What is {a} * {b}?", a * b


def _word(rng: random.Random):
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return (f"{name} has {a} {item} and gets {b} more. "
                f"How many {item} does {name} have now?"), a + b
    a = rng.randint(5, 25)
    b = rng.randint(1, a - 1)
    return (f"{name} has {a} {item} and gives away {b}. "
            f"How many {item} does {name} have left?"), a - b


def _compare(rng: random.Random):
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger, {a} or {b}?", max(a, b)


FAMILIES = {"add1": _add1, "add2": _add2, "addsub": _addsub, "mul1": _mul1,
            "word": _word, "compare": _compare, "mul21": _mul21}


def make_tasks(family: str, count: int, seed: int = 0) -> list[Task]:
    """`count` distinct problems of one family, a pure function of the arguments.

    Raises:
      ValueError: an unknown family, or more problems asked than the family holds.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    # Per-family stream: the same seed gives unrelated sets for different families.
    rng = random.Random(f"{family}:{seed}")
    out, seen = [], set()
    for _ in range(100 * count + 1000):
        if len(out) == count:
            return out
        q, ans = FAMILIES[family](rng)
        if q not in seen:
            seen.add(q)
            out.append(Task(family, q, str(ans)))
    raise ValueError(f"family {family!r} has fewer than {count} distinct problems")
