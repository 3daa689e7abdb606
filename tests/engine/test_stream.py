"""`jaxsample.stream` (text deltas per branch, then the Generation) and progress reporting."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxsample
from jaxsample import SamplingParams
from jaxsample.engine import stops
from jaxsample.models.checkpoints.tokenizer import ByteTokenizer
from jaxsample.progress import PREFIX, Progress

PROMPTS = ["hello", "wor", "The answer is"]


def _collect(events):
    """{(b, n): [TextDelta, ...]} and the final Generation; checks the event stream's shape."""
    events = list(events)
    assert events and events[-1].final and all(not e.final for e in events[:-1])
    per = {}
    for e in events:
        keys = [(d.prompt, d.branch) for d in e.deltas]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)
        for d in e.deltas:
            assert not per.get((d.prompt, d.branch)) or per[(d.prompt, d.branch)][-1].finish_reason is None
            per.setdefault((d.prompt, d.branch), []).append(d)
    steps = [e.step for e in events]
    assert steps == sorted(steps) and events[-1].live == 0
    return per, events[-1].generation


def _assert_exact(per, gen):
    for b in range(gen.num_prompts):
        for n in range(gen.n):
            deltas = per[(b, n)]
            assert "".join(d.text for d in deltas) == gen.texts[b][n], (b, n)
            assert [d.finish_reason is None for d in deltas] == [True] * (len(deltas) - 1) + [False]
            assert deltas[-1].finish_reason == gen.finish_reason[b][n]


@pytest.mark.slow
@pytest.mark.parametrize("stop,chunk", [((), 8), ((), 3), (("a",), 1), (("a", "e "), 3),
                                        (("\x80", "ab", "xyz"), 5), (("\ufffd",), 2),
                                        (("  ", "\n"), 8)])
def test_deltas_concatenate_to_the_final_texts(tiny_lm, stop, chunk):
    params = SamplingParams(n=5, temperature=1.0, max_new_tokens=48, seed=3, stop=stop)
    with _no_warning():
        per, gen = _collect(jaxsample.stream(tiny_lm, PROMPTS, params, chunk_size=chunk))
    _assert_exact(per, gen)
    ref = jaxsample.generate(tiny_lm, PROMPTS, params, chunk_size=chunk)
    assert ref.texts == gen.texts and ref.finish_reason == gen.finish_reason
    np.testing.assert_array_equal(ref.tokens, gen.tokens)
    if stop:  # the stop strings did cut something, and text came before the end
        assert any(r == "stop" for row in gen.finish_reason for r in row)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_min_tokens_with_stop_strings_streams_the_final_text(tiny_lm, chunk):
    """A stop string inside the first `min_tokens` tokens does not end the stream
    (regression: StreamText and the done branch's text ignored min_tokens, so the
    stream stopped at a stop string the final text keeps)."""
    params = SamplingParams(n=4, max_new_tokens=20, seed=1, temperature=1.0, stop=["e"],
                            min_tokens=2)
    prompts = ["ctx: e ab e hello"]
    with _no_warning():
        per, gen = _collect(jaxsample.stream(tiny_lm, prompts, params, chunk_size=chunk))
    _assert_exact(per, gen)
    ref = jaxsample.generate(tiny_lm, prompts, params, chunk_size=chunk)
    assert ref.texts == gen.texts and ref.finish_reason == gen.finish_reason
    # the case the regression needs: a final text holding a stop string in the
    # first min_tokens tokens' text
    toks = [t for row in gen.tokens for t in row]
    assert any("e" in tiny_lm.tokenizer.decode([int(x) for x in b[:2]])
               and len(t) > 1 for b, t in zip(toks, gen.texts[0])), gen.texts


@pytest.mark.slow
def test_stream_with_compaction_and_random_bytes(tiny_lm):
    """Random bytes are mostly invalid UTF-8: the replacement characters of the final
    decode are streamed exactly, whatever the chunk and compaction."""
    params = SamplingParams(n=8, temperature=1.5, max_new_tokens=40, seed=11, stop=("q",))
    per, gen = _collect(jaxsample.stream(tiny_lm, PROMPTS[:2], params, chunk_size=2,
                                         compact=True))
    _assert_exact(per, gen)
    assert any("\ufffd" in t for row in gen.texts for t in row)


@pytest.mark.slow
def test_early_deltas_before_the_end(tiny_lm):
    """Text arrives while decoding (not all in the final event), and a branch ended by a
    stop string reports its end in the chunk it ended."""
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=0, stop=("e",))
    events = list(jaxsample.stream(tiny_lm, PROMPTS[:1], params, chunk_size=4))
    assert sum(len(d.text) for e in events[:-1] for d in e.deltas) > 0
    early = [d for e in events[:-1] for d in e.deltas if d.finish_reason]
    gen = events[-1].generation
    assert all(gen.finish_reason[d.prompt][d.branch] == "stop" for d in early)


def test_stream_refuses_bad_input_at_the_call(tiny_lm):
    with pytest.raises(jaxsample.errors.InputError, match="empty"):
        jaxsample.stream(tiny_lm, [""], SamplingParams(n=2, max_new_tokens=4))
    with pytest.raises(jaxsample.errors.InputError, match="chunk_size"):
        jaxsample.stream(tiny_lm, ["x"], SamplingParams(n=2, max_new_tokens=4), chunk_size=0)


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


# ---------------------------------------------------------------------------
# StreamText on its own: any tokens, any chunking, any stop strings


BYTES = ByteTokenizer(vocab_size=258, eos_token_ids=(256,), pad_token_id=257)
# Ids 0-255 are bytes (many sequences are invalid UTF-8), 257 decodes to nothing.
token = st.one_of(st.integers(0, 255), st.sampled_from([0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0,
                                                        0x9F, 0x98, 0x80, 97, 98, 257]))


def _simulate(tokenizer, toks, cuts, stop):
    """Stream `toks` in chunks cut at `cuts` as the engine would (a branch stops being fed
    at the chunk where its text holds a stop string); returns (streamed, final text)."""
    text = stops.StreamText(stop)
    watch = stops.StopWatch(tokenizer, stop) if stop else None
    streamed, t0, end = "", 0, len(toks)
    for t1 in sorted(set(cuts) | {len(toks)}):
        if t1 <= t0:
            continue
        new = toks[t0:t1]
        streamed += text.feed(tokenizer, new)
        hit = watch.feed(0, new) if watch else False
        t0 = t1
        if hit:
            end = t1
            break
    final, _ = stops.cut(tokenizer, [int(t) for t in toks[:end]], stop, 0)
    rest, ok = text.finish(final)
    assert ok
    return streamed + rest, final


@settings(max_examples=300, deadline=None)
@given(toks=st.lists(token, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stop=st.lists(st.sampled_from(["a", "ab", "é", "€", "\ufffd", "b\ufffd", "ba"]),
                     max_size=2).map(tuple))
def test_stream_text_is_exact_for_any_chunking(toks, cuts, stop):
    streamed, final = _simulate(BYTES, toks, cuts, stop)
    assert streamed == final


def test_incremental_text_regressions():
    """Invalid bytes before a character split across chunks: every boundary of the first
    chunk ends in U+FFFD, yet the last one is completed by the next chunk (the old rule let
    it through as U+FFFD and lost the character)."""
    toks = [170, 176, 123, 232, 196, 244, 140, 234, 156, 140, 69, 143, 5, 172, 217]
    for step in (1, 2, 3, 8):
        inc = stops.IncrementalText()
        out = "".join(inc.extend(BYTES, toks[i:i + step]) for i in range(0, len(toks), step))
        out += inc.finish(BYTES)
        assert out == inc.text == BYTES.decode(toks), step
        assert "\ua70c" in out


class _SentencePieceLike:
    """Pieces with "▁" for a space; a decode drops the first leading space (SentencePiece's
    Metaspace decoder), so decoding a suffix alone would lose a space."""

    pieces = ["▁Hello", "▁world", "!", "▁a", "b", "▁", "c"]

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_incremental_text_keeps_leading_spaces_of_later_tokens():
    tok = _SentencePieceLike()
    ids = [0, 1, 2, 3, 4, 5, 6, 1, 3]
    for step in (1, 2, 4):
        inc = stops.IncrementalText()
        out = "".join(inc.extend(tok, ids[i:i + step]) for i in range(0, len(ids), step))
        assert out + inc.finish(tok) == tok.decode(ids) == "Hello world! ab c world a", step


@pytest.mark.slow
def test_stream_text_is_exact_on_the_real_tokenizer(lm):
    """Byte-level BPE pieces (multi-byte characters split across tokens, special tokens
    that decode to nothing) of SmolLM2's tokenizer."""
    tok = lm.tokenizer
    rng = np.random.default_rng(0)
    text = "Voilà: 3 + 4 = 7 ✓ — naïve café 日本語 🎉 emoji 👩‍💻 end"
    pieces = tok.encode(text)
    specials = list(tok.eos_token_ids)
    for trial in range(60):
        toks = list(pieces)
        if trial % 2:  # random tokens from the vocabulary and a few specials
            toks = [int(t) for t in rng.integers(0, tok.vocab_size, size=30)]
            toks[3:3] = specials[:1]
        cuts = sorted(rng.integers(0, len(toks) + 1, size=int(rng.integers(0, 6))).tolist())
        for stop in ((), ("é",), ("日本",), ("= 7",), ("\ufffd",)):
            body = toks
            text = stops.StreamText(stop)
            streamed, t0 = "", 0
            for t1 in cuts + [len(body)]:
                if t1 > t0:
                    streamed += text.feed(tok, body[t0:t1])
                    t0 = t1
            final, _ = stops.cut(tok, body, stop)
            rest, ok = text.finish(final)
            assert ok and streamed + rest == final, (trial, stop)


# ---------------------------------------------------------------------------
# progress


@pytest.mark.slow
def test_progress_without_a_terminal_prints_plain_lines(tiny_lm, capsys):
    params = SamplingParams(n=3, max_new_tokens=24, seed=0)
    gen = jaxsample.generate(tiny_lm, ["abc"], params, progress=True)
    out, err = capsys.readouterr()
    assert out == ""  # never on stdout
    lines = err.splitlines()
    assert lines and all(line.startswith(PREFIX) and "error:" not in line for line in lines)
    assert any("decoding 3 branches of 1 prompt, up to 24 tokens" in line for line in lines)
    assert f"decoded {gen.bill.decoded_tokens_total:,} tokens" in lines[-1]
    # The same tokens as without progress (progress only changes the chunk size).
    ref = jaxsample.generate(tiny_lm, ["abc"], params)
    np.testing.assert_array_equal(ref.tokens, gen.tokens)


@pytest.mark.slow
def test_progress_lines_for_compiles_and_steps(tiny_lm):
    err = io.StringIO()
    prog = Progress(err, interval=0, slow_after=0)  # every lookup announced, every chunk a line
    params = SamplingParams(n=2, max_new_tokens=37, seed=1, temperature=1.0)
    list(jaxsample.stream(tiny_lm, ["xyz"], params, chunk_size=4, progress=prog))
    lines = err.getvalue().splitlines()
    assert all(line.startswith(PREFIX) for line in lines)
    assert any(line.endswith("preparing decode ...") for line in lines)
    steps = [line for line in lines if "decode: step" in line]
    assert steps and "branches live" in steps[0] and "tokens/s" in steps[0] and "left" in steps[0]
    assert "decoded" in lines[-1]


@pytest.mark.slow
def test_progress_on_a_terminal_draws_without_error(tiny_lm):
    err = io.StringIO()
    prog = Progress(err, terminal=True, interval=0, slow_after=0)
    gen = jaxsample.generate(tiny_lm, ["x"], SamplingParams(n=2, max_new_tokens=12, seed=0),
                             progress=prog)
    assert "decoded" in err.getvalue() and prog._live is None  # the bar is gone again
    assert gen.lengths.shape == (1, 2)


def test_progress_phases_announce_only_when_slow():
    err = io.StringIO()
    prog = Progress(err, slow_after=30)
    with prog.compiling("decode"):
        pass  # fast: nothing at all
    with prog.phase("loading x", "loaded x in {s:.1f} s"):
        pass  # announced at once
    assert err.getvalue().splitlines() == [PREFIX + "loading x ...",
                                           PREFIX + "loaded x in 0.0 s"]
    with pytest.raises(jaxsample.errors.InputError, match="progress"):
        jaxsample.generate(None, ["x"], progress="yes")


# ---------------------------------------------------------------------------
# Regression tests: `stop=["\ufffd"]` cut a character in half. The
# bisection over decoded prefixes took a prefix ending inside a multi-byte
# character (decoded as U+FFFD) for the stop string, so the text was cut there
# and the stream's deltas stopped matching it.

# "abc" 一 (3 bytes, one token each) "d", an invalid byte (a real U+FFFD), "e".
_HALF = [97, 98, 99, 0xE4, 0xB8, 0x80, 100, 0xFF, 101]


def test_cut_never_takes_half_a_character_for_a_stop_string():
    assert BYTES.decode(_HALF) == "abc\u4e00d\ufffde"
    assert stops.cut(BYTES, _HALF, ["\ufffd"]) == ("abc\u4e00d", 8)
    assert stops.cut(BYTES, _HALF, ["d\ufffd"]) == ("abc\u4e00", 8)
    assert stops.cut(BYTES, _HALF, ["\u4e00"]) == ("abc", 6)
    assert stops.cut(BYTES, _HALF[:5], ["\ufffd"]) == ("abc", 4)  # truncated: the end is U+FFFD
    for step in (1, 2, 3):
        streamed, final = _simulate(BYTES, _HALF, list(range(0, len(_HALF), step)), ("\ufffd",))
        assert streamed == final == "abc\u4e00d", step


@pytest.fixture(scope="module")
def flat_lm():
    """The tiny model with zero weights: every logit is exactly 0, so greedy decoding
    follows the logit bias and the frequency penalty alone, on any machine."""
    from conftest import make_tiny_lm

    return make_tiny_lm(scale=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 8, 24])
def test_replacement_character_stop_streams_the_final_text(flat_lm, chunk):
    """Greedy with these biases and frequency_penalty=2 writes the bytes
    E4 B8 80 'a' E4 B8 80 FF 'a' ...: "一a一\ufffda一..." (the smallest margin
    between two logits is 0.1). Cut at the first U+FFFD the text is "一a一"; the old
    bisection tried the 5-token prefix "一a" + half of 一 (decoded U+FFFD) and cut
    there. The stream's deltas concatenate to exactly Generation.texts."""
    bias = {0xE4: 100.0, 0xB8: 99.5, 0x80: 99.0, 97: 98.5, 0xFF: 96.9}
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, logit_bias=bias,
                            frequency_penalty=2.0, stop=["\ufffd"])
    free = jaxsample.generate(flat_lm, ["x"], params.replace(stop=()))
    assert free.texts[0][0].startswith("\u4e00a\u4e00\ufffda\u4e00")
    with _no_warning():
        per, gen = _collect(jaxsample.stream(flat_lm, ["x"], params, chunk_size=chunk))
    _assert_exact(per, gen)
    assert gen.texts == [["\u4e00a\u4e00"] * 2] and gen.finish_reason == [["stop"] * 2]
    assert gen.lengths.tolist() == [[8, 8]]  # the tokens up to the invalid byte
    ref = jaxsample.generate(flat_lm, ["x"], params, chunk_size=chunk)
    assert ref.texts == gen.texts
