"""A deterministic generator of small verifiable arithmetic word problems.

Used by benchmarks/bridge.py (Bridge training and evaluation). Each problem is
a one-sentence word problem whose answer is a non-negative integer; rewards
are exact-match on the final number (`jaxsample.reduce.answers`). The set is a pure
function of (split, count, seed), so train and held-out problems never
overlap (disjoint seeds and a de-duplication on the prompt text).

Difficulty is tuned for SmolLM2-135M-Instruct: one addition or subtraction
with small numbers, which the base model solves some but not all of the time.
"""

from __future__ import annotations

import random
from typing import Callable

from jaxsample.bridge_training.common import Problem

_NAMES = ["Sam", "Ana", "Li", "Tom", "Mia", "Ben", "Zoe", "Raj", "Eva", "Max"]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "eggs", "shells", "stamps"]
_SUFFIX = ""
# Two worked examples (raw completion format, not chat): the answer line is
# "a + b = c" and ends at the newline, which benchmarks/bridge.py uses as a stop token.
FEW_SHOT = ("Q: Kim has 3 pens and gets 4 more. How many pens does Kim have now?\n"
            "A: 3 + 4 = 7\n"
            "Q: Joe has 9 cards and gives away 5. How many cards does Joe have left?\n"
            "A: 9 - 5 = 4\n")


def _one(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(["add", "add", "sub"])
    if kind == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        text = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        ans = a + b
    else:
        a = rng.randint(5, 25)
        b = rng.randint(1, a - 1)
        text = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
        ans = a - b
    return Problem(f"{FEW_SHOT}Q: {text}\nA:", str(ans))


def distinct_problems(one: Callable[[random.Random], Problem], seeds: dict[str, int], split: str,
                      count: int) -> list[Problem]:
    """`count` distinct problems of one split, drawn with `one(rng)` from the split's seed.

    The other split's first 2000 prompts are excluded, so train and test never
    overlap; repeated prompts are skipped.

    Raises:
      ValueError: an unknown split, or more problems than `100 * count + 1000`
        draws make distinct.
    """
    if split not in seeds:
        raise ValueError(f"split must be one of {sorted(seeds)}, got {split!r}")
    other = "test" if split == "train" else "train"
    rng, rng_other = random.Random(seeds[split]), random.Random(seeds[other])
    excluded = {one(rng_other).prompt for _ in range(2000)}
    out, seen = [], set()
    for _ in range(100 * count + 1000):
        if len(out) == count:
            return out
        p = one(rng)
        if p.prompt not in seen and p.prompt not in excluded:
            seen.add(p.prompt)
            out.append(p)
    if len(out) == count:
        return out
    raise ValueError(f"could not make {count} distinct {split} problems")


def make_problems(split: str, count: int) -> list[Problem]:
    """`count` distinct problems of one split ("train" or "test"); `distinct_problems`."""
    return distinct_problems(_one, {"train": 1234, "test": 98765}, split, count)
