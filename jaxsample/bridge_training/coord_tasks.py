"""A coordination task for Bridge: pick two different items, differently from the other branches.

Used by `benchmarks/bridge_recipe.py --task coord`. Each problem lists K
single-token items of one category (colours, fruits, animals, digits, ...) in a
random order and asks for two different ones; an answer is the *unordered*
pair. A branch scores 1 when its pair is valid (two different listed items) and
no other branch of the group gave the same pair
(`jaxsample.bridge_training.grpo.distinct_rewards`).

Why an unordered pair (the mechanism, `docs/ARCHITECTURE.md`, Bridge): a Bridge
block attends across branches at the same position. At the first answer token
every branch holds the same state (shared prefill), so only sampling separates
them. If the answer were an ordered sequence (e.g. "a two-digit multiple of
7"), two branches whose first tokens differ are already distinct, and two
whose histories are identical have identical states, which no cross-branch
layer can tell apart: the best either can do is the flat distribution a
per-token adapter can learn too. With an unordered pair, branch A that wrote
"red" and branch B that wrote "blue" collide if A adds "and blue" and B
adds "and red": at the second item each branch can see the others' first items (one
token earlier, at the same positions: every item of a problem has the same
token count) and avoid them, which a per-token model cannot.

The set is a pure function of (split, count): train and test use disjoint
seeds and never share a prompt.
"""

from __future__ import annotations

import random
import re

from jaxsample.bridge_training.common import Problem
from jaxsample.bridge_training.tasks import distinct_problems

# Every item is one SmolLM2 token after a space (" red"); digits are two (" ", "3"),
# the same count for every item of the digit category.
CATEGORIES = {
    "colours": ["red", "blue", "green", "black", "white", "pink", "brown", "grey", "gold",
                "orange", "purple", "yellow"],
    "fruits": ["apple", "pear", "lemon", "plum", "fig", "lime", "grape", "peach", "mango",
               "kiwi", "cherry", "banana"],
    "animals": ["cat", "dog", "cow", "pig", "fox", "owl", "bee", "rat", "bat", "duck", "goat",
                "wolf", "bear", "lion", "fish", "frog", "horse", "sheep", "mouse"],
    "digits": [str(d) for d in range(10)],
}
K_RANGE = (4, 5)  # items listed per problem

# Four worked examples (raw completion format, not chat), one per category; the
# answer line "x and y" ends at the newline, a stop token in benchmarks/bridge_recipe.py.
# (With a comma-separated format the base model keeps listing items and rarely
# gives a valid answer; this one gives many more valid answers at temperature 0.7.)
FEW_SHOT = ("Q: Name two different colours from: pink, grey, gold, red, white.\nA: gold and white\n"
            "Q: Name two different animals from: owl, cow, bee, fox.\nA: fox and cow\n"
            "Q: Name two different digits from: 4, 8, 1, 7.\nA: 1 and 7\n"
            "Q: Name two different fruits from: lime, fig, pear, plum, apple.\nA: pear and fig\n")

_SPLIT = re.compile(r"\s*(?:,|\band\b)\s*")



def options(problem: Problem) -> list[str]:
    """The items listed in a problem."""
    return problem.answer.split(",")


def parse(text: str, problem: Problem):
    """The unordered pair a completion names, or None if it is not a valid answer.

    Valid: the first line holds exactly two items separated by "and" or a comma,
    both listed in the problem, different from each other (case and surrounding
    spaces/periods ignored).

    Returns:
      frozenset of two item strings, or None.
    """
    line = text.strip().split("\n")[0].strip().rstrip(".").lower()
    parts = [p.strip() for p in _SPLIT.split(line) if p.strip()]
    if len(parts) != 2 or parts[0] == parts[1]:
        return None
    allowed = set(options(problem))
    if not all(p in allowed for p in parts):
        return None
    return frozenset(parts)


def _one(rng: random.Random) -> Problem:
    cat = rng.choice(sorted(CATEGORIES))
    items = rng.sample(CATEGORIES[cat], rng.randint(*K_RANGE))
    noun = "digits" if cat == "digits" else cat
    text = f"Name two different {noun} from: {', '.join(items)}."
    return Problem(f"{FEW_SHOT}Q: {text}\nA:", ",".join(items))


def make_problems(split: str, count: int) -> list[Problem]:
    """`count` distinct problems of one split ("train" or "test"); `tasks.distinct_problems`."""
    return distinct_problems(_one, {"train": 4321, "test": 56789}, split, count)
