"""`stream`: the text of every (prompt, branch) as it is decoded, chunk by chunk.

The same host loop as `generate` (`api.chunks`): after every chunk one
`StreamEvent` carries the new text of each branch (`TextDelta`), and the last
event carries the `Generation`, exactly what `generate` would have returned.
The deltas of a branch concatenate to exactly its final text
(`Generation.texts[b][n]`), stop strings cut, because nothing is streamed that
the final text may not hold (`stops.StreamText`: incomplete UTF-8 characters
and the last `max(len(stop)) - 1` characters are held back, vLLM's rule).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Iterator

import numpy as np

from jaxsample.engine import api
from jaxsample.engine import stops as stops_lib
from jaxsample.generation import Generation
from jaxsample.lm import LanguageModel
from jaxsample.sampling_params import SamplingParams, refuse_foreign_keywords


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New text of one branch.

    Attributes:
      prompt: b, the prompt's index in the call.
      branch: n, the branch's index (0 .. N-1).
      text: characters to append to what this branch streamed so far
        (possibly "" on the delta that only reports its end).
      finish_reason: None while the branch may still grow; on its last delta
        "stop" (stop token or stop string) or "length" (max_new_tokens), as
        `Generation.finish_reason`.
    """

    prompt: int
    branch: int
    text: str
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """What one chunk of decoding produced.

    Attributes:
      step: tokens decoded per branch so far (the decode loop's position t).
      max_new_tokens: T, the budget.
      live: branches still decoding after this chunk (0 on the last event).
      decoded_tokens: tokens decoded over all branches so far.
      elapsed: seconds since the `stream` call (prefill and compiles included).
      deltas: the `TextDelta`s of this chunk, in (prompt, branch) order; a
        branch appears when it has new text or has just finished.
      generation: the `Generation` on the last event (`final`), else None.
    """

    step: int
    max_new_tokens: int
    live: int
    decoded_tokens: int
    elapsed: float
    deltas: tuple[TextDelta, ...]
    generation: Generation | None = None

    @property
    def final(self) -> bool:
        """True on the last event, the one that carries the Generation."""
        return self.generation is not None


@refuse_foreign_keywords("jaxsample.stream")
def stream(lm: LanguageModel, prompts, params: SamplingParams | None = None, *,
           chat: bool = False, mesh=None, bridge=None, prompt_index_offset: int = 0,
           chunk_size: int = api.STOP_CHUNK, compact: bool | None = None,
           progress=False, shared_prefix=None, max_rows: int | None = None,
           max_slots: int | None = None, max_kv_bytes: int | None = None
           ) -> Iterator[StreamEvent]:
    """Sample like `generate`, yielding the new text of every branch after each chunk.

        for ev in jaxsample.stream(lm, ["Tell me a story."], SamplingParams(n=4), chat=True):
            for d in ev.deltas:
                print(f"[{d.prompt}.{d.branch}] {d.text}", end="")
            if ev.final:
                gen = ev.generation          # == generate(...) with the same arguments

    The arguments other than `chunk_size` (lm, prompts, params, chat, mesh,
    bridge, prompt_index_offset, compact, progress, shared_prefix, max_rows,
    max_slots, max_kv_bytes) are those of `jaxsample.generate`, and so are the
    tokens: the same loop, and neither the chunk size nor the pool's shape
    changes tokens.

    Args:
      chunk_size: decode steps between two events, in [1, 2**31 - 1] (default 8).

    Returns:
      An iterator of `StreamEvent`s: one per chunk, the last with `final` True
      and the `Generation`. For each (prompt, branch) the `text` of its deltas
      concatenates to exactly `generation.texts[prompt][branch]`, and its last
      delta's `finish_reason` is `generation.finish_reason[prompt][branch]`.

    Raises:
      InputError: as `generate`, by this call itself (the prompts are
        validated and prefilled before it returns), before any compute.
      NumericalError: as `generate`, from the last step of the iteration.
    """
    api.check_compact(compact)
    session, rnd, chunk_size, observer = api.start(
        lm, prompts, params, chat=chat, mesh=mesh, bridge=bridge,
        prompt_index_offset=prompt_index_offset, naive=False, chunk_size=chunk_size,
        progress=progress, shared_prefix=shared_prefix, max_rows=max_rows, max_slots=max_slots,
        max_kv_bytes=max_kv_bytes)
    return events(session, rnd, chunk_size, compact, observer)


def events(session, rnd, chunk_size, compact, observer) -> Iterator[StreamEvent]:
    """The `StreamEvent`s of an opened round (`api.start`): one per chunk, the last
    with the `Generation`."""
    s = session
    texts: dict[tuple[int, int], stops_lib.StreamText] = {}
    ended: set[tuple[int, int]] = set()

    def where(r, c):
        return s.row_prompt[rnd.rows[r]], int(rnd.branch_ids[r, c])

    def event(deltas, live, generation=None):
        deltas.sort(key=lambda d: (d.prompt, d.branch))
        return StreamEvent(step=rnd.t, max_new_tokens=s.T, live=live,
                           decoded_tokens=int(rnd.lengths.sum()),
                           elapsed=time.perf_counter() - s.t_start, deltas=tuple(deltas),
                           generation=generation)

    for t0, more in api.chunks(s, rnd, chunk_size, compact, observer):
        if not more:
            continue  # the last chunk goes into the final event (and the loop ends itself)
        deltas = []
        new = {(r, c): toks for r, c, toks in rnd.new_tokens(t0)}
        for r, c in zip(*np.nonzero(rnd.branch_ids >= 0)):
            r, c = int(r), int(c)
            key = where(r, c)
            if key in ended:
                continue
            st = texts.setdefault(key, _stream_text(s, key[0]))
            text = st.feed(api.text_tokenizer(s, key[0]), new[(r, c)]) if (r, c) in new else ""
            if rnd.done[r, c]:  # ended by a stop token or a stop string: its text is final now
                final, _, _ = api.final_text(s, key[0], rnd.tokens[r, c], rnd.lengths[r, c],
                                             rnd.stopped[r, c])
                rest, ok = st.finish(final)
                _check(ok, key)
                text += rest
                ended.add(key)
                deltas.append(TextDelta(key[0], key[1], text, "stop"))
            elif text:
                deltas.append(TextDelta(key[0], key[1], text))
        yield event(deltas, int((~rnd.done).sum()))
    gen = api.finish(s, [rnd])
    deltas = []
    for b in range(s.B):
        for n in range(s.n_of[b]):
            if (b, n) in ended:
                continue
            st = texts.get((b, n)) or _stream_text(s, b)
            rest, ok = st.finish(gen.texts[b][n])
            _check(ok, (b, n))
            deltas.append(TextDelta(b, n, rest, gen.finish_reason[b][n]))
    yield event(deltas, 0, gen)


def _stream_text(session, b: int) -> stops_lib.StreamText:
    """A branch's stream text under prompt b's stop strings and min_tokens."""
    p = session.prompt_params[b]
    return stops_lib.StreamText(p.stop, p.min_tokens)


def _check(ok: bool, key) -> None:
    if not ok:  # pragma: no cover - byte-level decoding is incremental
        warnings.warn(f"jaxsample.stream: the text streamed for prompt {key[0]}, branch "
                      f"{key[1]} is not a prefix of its final text (tokenizer decoding is not "
                      "incremental); Generation.texts holds the exact text", stacklevel=3)


__all__ = ["stream", "StreamEvent", "TextDelta"]
