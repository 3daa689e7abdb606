"""Stop strings: seen on the way (at chunk boundaries), cut exactly at the end.

During decode, `StopWatch` detokenises only each branch's new tokens
(incrementally, as vLLM's `detokenize_incrementally`: decode from a few tokens
back and keep the new suffix; hold back a trailing replacement character for
up to 3 more tokens, the longest a UTF-8 character can still be completed) and looks for the stop strings in the new text plus the
`max(len(stop)) - 1` characters before it, so the host can mark the branch
done at the next chunk boundary. At the end, `cut` keeps the fewest leading
tokens whose text contains a stop string and the text before it, so tokens
and text agree whatever the chunk size.

With `SamplingParams.min_tokens = m`, a stop string counts only where it ends
beyond the text of the first m tokens (vLLM looks for stop strings once more
than m tokens were generated, in the new text), so a branch cut by a stop
string keeps more than m tokens. The boundary is the length of the decoded
first m tokens: exact unless a multi-byte character straddles it.
"""

from __future__ import annotations

from typing import Sequence


def first_stop(text: str, stops: Sequence[str], floor: int = 0) -> int | None:
    """Index of the earliest stop string in `text` that ends after character
    `floor` (0: anywhere), or None."""
    hits = [i for i in (text.find(s, max(floor - len(s) + 1, 0)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def min_tokens_floor(tokenizer, toks: Sequence[int], min_tokens: int) -> int:
    """Characters of text the first `min_tokens` tokens give (stop strings must
    end after them); the whole text when there are not more tokens than that."""
    if min_tokens <= 0:
        return 0
    return len(tokenizer.decode(list(toks[:min_tokens])))


def tokens_covering(tokenizer, toks: list[int], stops, floor: int = 0) -> int:
    """Fewest leading tokens whose decoded text contains a stop string (ending
    after character `floor`).

    Bisection (O(log T) decodes): containment only grows with the prefix, up to
    a multi-byte character split across tokens, which is why the caller
    re-decodes exactly the tokens it keeps.
    """
    lo, hi = 1, len(toks)  # decode(toks[:hi]) contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(tokenizer.decode(toks[:mid]), stops, floor) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi


def cut(tokenizer, body: list[int], stops, min_tokens: int = 0) -> tuple[str, int | None]:
    """(text, kept tokens or None): the branch's text cut before its first stop string.

    `body` excludes a final stop token. None means no stop string was found
    (all tokens are kept). With `min_tokens`, only stop strings that end
    after the text of the first `min_tokens` tokens count.
    """
    text = tokenizer.decode(body)
    if not stops or len(body) <= min_tokens:
        return text, None
    floor = min_tokens_floor(tokenizer, body, min_tokens)
    if first_stop(text, stops, floor) is None:
        return text, None
    keep = tokens_covering(tokenizer, body, stops, floor)
    text = tokenizer.decode(body[:keep])  # the same tokens the arrays keep
    return text[:first_stop(text, stops, floor)], keep


class IncrementalText:
    """One branch's text, extended by decoding only new tokens."""

    __slots__ = ("tokens", "text", "_prefix", "_read")

    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self._prefix = 0  # decode from here (a few tokens of context)
        self._read = 0  # tokens whose text is already in self.text

    def extend(self, tokenizer, new: Sequence[int]) -> str:
        """Append tokens; returns the new text (possibly '' while a character is incomplete).

        The text grows up to the last token after which it does not end in a
        replacement character, holding back at most 3 tokens (a UTF-8
        character has at most 4 bytes); a replacement character that no
        later token can complete is then let through, as the full decode has it.
        """
        self.tokens.extend(int(t) for t in new)
        before = tokenizer.decode(self.tokens[self._prefix:self._read])
        end, after = len(self.tokens), ""
        for hold in range(min(4, len(self.tokens) - self._read + 1)):
            after = tokenizer.decode(self.tokens[self._prefix:len(self.tokens) - hold])
            if not after.endswith("\ufffd"):
                end = len(self.tokens) - hold
                break
        else:
            if len(self.tokens) - self._read < 4:
                return ""  # wait: the next tokens may complete the character
            after = tokenizer.decode(self.tokens[self._prefix:])
        if end <= self._read or len(after) < len(before):
            return ""
        delta = after[len(before):]
        self.text += delta
        self._prefix, self._read = max(end - 4, 0), end
        return delta


class StopWatch:
    """Which branches' text contains a stop string, checked on new tokens only."""

    def __init__(self, tokenizer, stops: Sequence[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.back = max(map(len, self.stops)) - 1 if self.stops else 0
        self.min_tokens = int(min_tokens)
        self.texts: dict[tuple[int, int], IncrementalText] = {}
        self.floors: dict[tuple[int, int], int] = {}

    def feed(self, key, new_tokens: Sequence[int]) -> bool:
        """Add a branch's new tokens (stop tokens excluded); True if a stop string
        appeared (ending after the text of the first `min_tokens` tokens)."""
        inc = self.texts.setdefault(key, IncrementalText())
        start = max(len(inc.text) - self.back, 0)
        delta = inc.extend(self.tokenizer, new_tokens)
        if not delta or len(inc.tokens) <= self.min_tokens:
            return False
        if key not in self.floors:
            self.floors[key] = min_tokens_floor(self.tokenizer, inc.tokens, self.min_tokens)
        return first_stop(inc.text[start:], self.stops, self.floors[key] - start) is not None
