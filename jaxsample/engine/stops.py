"""Stop strings: seen on the way (at chunk boundaries), cut exactly at the end.

During decode, `StopWatch` detokenises only each branch's new tokens
(incrementally, as vLLM's `detokenize_incrementally`: decode from an anchor a
few tokens back and keep the new suffix; a trailing replacement character,
which the next bytes may still turn into a character, is held back; see
`IncrementalText`) and looks for the stop strings in the new text plus the
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


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (O(answer) per call, by
    halving on slices compared in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def stable_prefix(tokenizer, toks: Sequence[int], k: int, text: str) -> str:
    """The part of `decode(toks[:k])` that the decode of all of `toks` (`text`) keeps:
    their common prefix. A prefix that ends inside a multi-byte character decodes
    it as U+FFFD, which the full text replaces by the character; for byte-level
    tokenizers the stable part only grows with k, and never ends inside a
    character."""
    head = tokenizer.decode(list(toks[:k]))
    return head[:_common_prefix(head, text)]


def tokens_covering(tokenizer, toks: list[int], stops, floor: int = 0,
                    text: str | None = None) -> int:
    """Fewest leading tokens whose text holds a stop string (ending after character
    `floor`), counting only text the full decode keeps (`stable_prefix`): a
    U+FFFD that a prefix shows for a character cut in half is no stop string
    (so `stop=["\\ufffd"]` never cuts a multi-byte character in half).

    Bisection (O(log T) decodes): the stable text only grows with the prefix.
    `text` is `decode(toks)` (computed if None).
    """
    text = tokenizer.decode(list(toks)) if text is None else text
    lo, hi = 1, len(toks)  # stable_prefix(toks[:hi]) contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(stable_prefix(tokenizer, toks, mid, text), stops, floor) is not None:
            hi = mid
        else:
            lo = mid + 1
    return hi


def cut(tokenizer, body: list[int], stops, min_tokens: int = 0) -> tuple[str, int | None]:
    """(text, kept tokens or None): `cut_at` without the stop string."""
    text, keep, _ = cut_at(tokenizer, body, stops, min_tokens)
    return text, keep


def cut_at(tokenizer, body: list[int], stops, min_tokens: int = 0,
           include_stop: bool = False) -> tuple[str, int | None, str | None]:
    """(text, kept tokens or None, the stop string or None): the branch's text cut
    before its first stop string (after it with `include_stop`,
    `SamplingParams.include_stop_str_in_output`).

    `body` excludes a final stop token. None means no stop string was found
    (all tokens are kept). With `min_tokens`, only stop strings that end
    after the text of the first `min_tokens` tokens count. The text is always a
    prefix of `decode(body)` (never a character cut in half): the kept tokens'
    stable text (`stable_prefix`) cut before its first stop string. Of stop
    strings starting at the same place the one ending first is reported (the
    one the kept tokens hold).
    """
    text = tokenizer.decode(body)
    if not stops or len(body) <= min_tokens:
        return text, None, None
    floor = min_tokens_floor(tokenizer, body, min_tokens)
    if first_stop(text, stops, floor) is None:
        return text, None, None
    keep = tokens_covering(tokenizer, body, stops, floor, text)
    head = stable_prefix(tokenizer, body, keep, text)  # the same tokens the arrays keep
    at = first_stop(head, stops, floor)
    stop = min((s for s in stops if head.startswith(s, at) and at + len(s) > floor),
               key=len)
    return head[:at + len(stop)] if include_stop else head[:at], keep, stop


class KeepSpecialTokens:
    """A view of a tokenizer whose `decode` keeps special tokens' text
    (`skip_special_tokens=False`, `SamplingParams.skip_special_tokens`)."""

    __slots__ = ("tokenizer",)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def text_tokenizer(tokenizer, skip_special_tokens: bool = True):
    """The tokenizer to decode branch text with: itself (special tokens dropped, its
    default), or `KeepSpecialTokens` of it."""
    return tokenizer if skip_special_tokens else KeepSpecialTokens(tokenizer)


class IncrementalText:
    """One branch's text, extended by decoding only new tokens, exactly as a full decode.

    `text` is always the stable part of `decode(tokens)`: every later token only
    appends to it. For byte-level tokenizers (bytes joined, invalid UTF-8
    replaced by U+FFFD) only the last character of a decode can still change: a
    trailing U+FFFD that stands for a UTF-8 sequence the next bytes may complete
    (or show invalid, which gives one U+FFFD again). So `text` is the decode
    without a trailing U+FFFD; at the end `decode(tokens)` may add that one.

    Decoding starts at an anchor, a token boundary where the text so far ended
    with a complete character (the UTF-8 decoder is then between characters, so
    decoding from there continues the full decode exactly), and the difference
    is taken against the decode from the anchor before it (vLLM's prefix
    offset), so a tokenizer that drops the leading space of the first token
    decoded (SentencePiece) loses nothing. The anchor advances to one of the
    last few token boundaries whose decode ends with a complete character, so
    each call decodes a handful of tokens (vLLM's `detokenize_incrementally`
    keeps 5 tokens of context for the same reason).
    """

    __slots__ = ("tokens", "text", "_ctx", "_anchor", "_anchor_len")

    SEARCH = 8  # token boundaries tried, from the end, when advancing the anchor

    def __init__(self):
        self.tokens: list[int] = []
        self.text = ""
        self._ctx = 0  # the anchor before the current one (decode from here)
        self._anchor = 0  # a token boundary between characters
        self._anchor_len = 0  # len(decode(tokens[:anchor]))

    def _decode_from_anchor(self, tokenizer, end: int) -> str:
        base = tokenizer.decode(self.tokens[self._ctx:self._anchor])
        full = tokenizer.decode(self.tokens[self._ctx:end])
        return full[len(base):] if full.startswith(base) else full

    def extend(self, tokenizer, new: Sequence[int]) -> str:
        """Append tokens; returns the text they added (possibly '' while a UTF-8
        character is incomplete)."""
        self.tokens.extend(int(t) for t in new)
        end = len(self.tokens)
        tail = self._decode_from_anchor(tokenizer, end)  # text since the anchor
        stable = tail[:-1] if tail.endswith("\ufffd") else tail
        done = len(self.text) - self._anchor_len  # already returned of `tail`
        delta = stable[done:] if len(stable) > done else ""
        self.text += delta
        # Advance the anchor to the latest boundary whose text ends with a complete
        # character (its decode is then final, and the decoder between characters).
        for e in range(end, max(self._anchor, end - self.SEARCH), -1):
            head = tail if e == end else self._decode_from_anchor(tokenizer, e)
            if head and not head.endswith("\ufffd") and len(head) <= len(stable) \
                    and stable.startswith(head):
                self._ctx, self._anchor = self._anchor, e
                self._anchor_len += len(head)
                break
        return delta

    def finish(self, tokenizer) -> str:
        """The text of all tokens (a last U+FFFD included); `text` becomes it. Returns
        what it adds."""
        tail = self._decode_from_anchor(tokenizer, len(self.tokens))
        done = len(self.text) - self._anchor_len
        delta = tail[done:]
        self.text += delta
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


class StreamText:
    """One branch's text as deltas that never show what the final text will not hold.

    The deltas concatenate to a prefix of the branch's final text
    (`Generation.texts`, stop string cut) at every point, and `finish`
    completes them to exactly that text. Two things are held back, as vLLM's
    streaming does: the characters of an incomplete UTF-8 character (by
    `IncrementalText`), and the last `max(len(stop)) - 1` characters, which
    may turn out to be the start of a stop string. Once a stop string is seen
    nothing more is streamed until `finish` (the exact cut is decided on the
    tokens, see `cut`). With `min_tokens`, as in `cut` and `StopWatch`, only
    stop strings ending past the text of the first `min_tokens` tokens count.

    Why this is a prefix of the final text: a final text cut at a stop string
    ends where the earliest stop string starts; that string was not in the
    text seen so far (else streaming would have stopped), so it ends past it,
    and starts at most `len(stop) - 1` characters before its end.
    """

    __slots__ = ("inc", "sent", "stops", "back", "seen_stop", "min_tokens", "floor")

    def __init__(self, stops: Sequence[str] = (), min_tokens: int = 0):
        self.inc = IncrementalText()
        self.sent = ""
        self.stops = tuple(stops)
        self.back = max(map(len, self.stops)) - 1 if self.stops else 0
        self.seen_stop = False
        self.min_tokens = int(min_tokens)  # stop strings count only past these tokens' text
        self.floor: int | None = None

    def feed(self, tokenizer, new_tokens: Sequence[int]) -> str:
        """Add new tokens (a final stop token excluded); returns the text now safe to show."""
        start = max(len(self.inc.text) - self.back, 0)
        self.inc.extend(tokenizer, new_tokens)
        if self.seen_stop:
            return ""
        if self.stops and len(self.inc.tokens) > self.min_tokens:
            if self.floor is None:
                self.floor = min_tokens_floor(tokenizer, self.inc.tokens, self.min_tokens)
            if first_stop(self.inc.text[start:], self.stops, self.floor - start) is not None:
                self.seen_stop = True
                return ""
        safe = len(self.inc.text) - self.back
        if safe <= len(self.sent):
            return ""
        delta = self.inc.text[len(self.sent):safe]
        self.sent += delta
        return delta

    def finish(self, final: str) -> tuple[str, bool]:
        """(the rest of `final`, True) once the branch's final text is known.

        The second value is False if the text streamed so far is not a prefix
        of `final` (a tokenizer whose decoding is not incremental, which
        byte-level BPE always is); the delta then only completes the common
        prefix, and `Generation.texts` stays the reference.
        """
        ok = final.startswith(self.sent)
        if not ok:
            common = 0
            for a, b in zip(self.sent, final):
                if a != b:
                    break
                common += 1
            delta = final[common:]
        else:
            delta = final[len(self.sent):]
        self.sent = final
        return delta, ok
