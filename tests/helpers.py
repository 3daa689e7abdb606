"""Helpers shared by several test modules: the Bridge builders, stop-id padding, the
in-process command-line runner, the offline replay of adaptive self-consistency on
a fixed pool, the hand-written cases in tests/data/cases/, Ctrl-C as Python's
default for tests that send it, models built in place (int8, tiny Gemma 3) and the
sampling filters' float64 oracle.

Imported as `helpers` (tests/ is on sys.path, as for `ties` and `conftest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
from paths import DATA

from jaxsample import SamplingParams, engine, tiny
from jaxsample import bridge as bridge_lib
from jaxsample.engine import sampling
from jaxsample.lm import LanguageModel
from jaxsample.models.families import gemma3, llama
from jaxsample.models.quantization import outliers, quant

# ---------------------------------------------------------------------------
# The hand-written cases (tests/data/cases/, see its README.md)

CASES_DIR = DATA / "cases"


def load_cases(name: str) -> dict:
    """tests/data/cases/<name>.json as a dict (e.g. `load_cases("answers")`)."""
    return json.loads((CASES_DIR / f"{name}.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# The Bridge (tests/test_bridge*.py)

BRIDGE_PROMPTS = ["Hello there, branch!", "ab"]
STOPS = tuple(range(0, 256, 20))  # frequent stops, so some branches finish early


def nonzero(lm, cfg, seed=1, scale=0.5):
    """A Bridge with a random nonzero output projection (a trained-looking Bridge):
    `wo` for the attention block, its own output matrix for the MLP block."""
    b = bridge_lib.init(lm, cfg, jax.random.key(seed))
    name = cfg.out_name
    out = scale * jax.random.normal(jax.random.key(seed + 100), b.params[name].shape)
    return b.replace_params(dict(b.params, **{name: out}))


def sp(n, max_new_tokens=12, **kw):
    """The Bridge tests' sampling: temperature 1, seed 3, the frequent STOPS."""
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=3,
                          stop_token_ids=STOPS, **kw)


def layer_params(b, l=0):
    """Layer l's slice of a Bridge's stacked params."""
    return jax.tree_util.tree_map(lambda a: a[l], b.params)


def block_fn(cfg, p_l, stats=False):
    """The Bridge block (or its attention statistics) over a leading branch axis,
    jitted: `f(x [N, S, E], alive [N] or [N, S])`."""
    fn = bridge_lib.block_stats if stats else bridge_lib.apply_block
    return jax.jit(jax.vmap(lambda x, a: fn(cfg, p_l, x, a, ("branch",)), axis_name="branch"))


def stop_array(lm, stops=STOPS):
    """The model's end-of-text ids and `stops`, padded as the engine holds them
    (`[MAX_STOP_IDS]` int32, -1 padding), by the library's own `pad_stop_ids`."""
    ids = sorted(set(lm.tokenizer.eos_token_ids) | set(stops))
    return jnp.asarray(sampling.pad_stop_ids(ids, size=engine.MAX_STOP_IDS))


# ---------------------------------------------------------------------------
# The command line, in process


def main_captured(argv):
    """`cli.main(argv)` with stdout and stderr captured: (exit code, stdout, stderr)."""
    from jaxsample import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------
# Adaptive self-consistency replayed offline on a fixed pool


def replay_offline(pool, b, extract, *, max_n, window, rule, threshold=0.95, confidence=None,
                   warmup=0, group_size=16, source="top_logprobs"):
    """`stopping.replay` on row b of a fixed pool (a Generation of max_n branches), the
    DeepConf quantities computed on the host from the pool's top logprobs
    (`source="top_logprobs"`) or its self-certainty signals (`source="signals"`).
    `extract(text)` -> answer or None; answers are normalised as
    `adaptive_self_consistency` normalises what a callable extractor returns."""
    from jaxsample.reduce import adaptive_rules as stopping
    from jaxsample.reduce import answers

    ans = [None if (a := extract(t)) is None else (answers.normalize(a) or None)
           for t in pool.texts[b]]
    weights = term = None
    if confidence:
        if source == "signals":
            conf = [stopping.token_confidence_from_signals(
                pool.self_certainty[b, n, :pool.lengths[b, n]]) for n in range(max_n)]
        else:
            conf = [stopping.token_confidence(pool.top_logprobs[b, n, :pool.lengths[b, n]])
                    for n in range(max_n)]
        weights = [stopping.lowest_group_confidence(c, group_size) for c in conf]
        thr = stopping.threshold_from_warmup(weights[:warmup], confidence)
        term = [n >= warmup and stopping.first_low_group(c, group_size, thr) is not None
                for n, c in enumerate(conf)]
    return stopping.replay(ans, max_n=max_n, window=window, rule=rule, threshold=threshold,
                           weights=weights, terminated=term, warmup=warmup if confidence else 0)



def finish_in_rounds(s, rows: int, width: int, firsts, chunk: int):
    """`engine.finish` of rounds over one `Session`'s prefill: for each first branch
    index in `firsts`, a round of branches first .. first + width - 1 on rows
    0 .. rows - 1, run `chunk` steps at a time to its end."""
    rounds = []
    for first in firsts:
        rnd = s.round(range(rows), np.broadcast_to(first + np.arange(width, dtype=np.int32),
                                                   (rows, width)))
        while rnd.run(chunk):
            pass
        rounds.append(rnd)
    return engine.finish(s, rounds)

# ---------------------------------------------------------------------------
# A second process holding a results file (tests of the one-writer lock)

_HOLD = """
import sys
from jaxsample.cli.results_file import ResultsFile
f = ResultsFile(sys.argv[1], resume=sys.argv[2] == "resume")
f.write({"id": "held"}) if sys.argv[3] == "write" else None
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes stdin
f.close()
"""


@contextlib.contextmanager
def results_file_held(path, resume: bool = True, write: bool = False):
    """A real second process that opens `path` as a `ResultsFile` (taking its lock),
    optionally writes the line {"id": "held"}, and holds it until the block ends;
    yields its pid. The process must then have ended cleanly."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(path),
                          "resume" if resume else "new", "write" if write else "-"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "locked\n"
        yield p.pid
    finally:
        p.communicate(timeout=60)
    assert p.returncode == 0


# Per-token log-probabilities (tests/training/test_token_logprobs.py, tests/training/test_grpo.py)


def next_token_logprobs(lm, tokens, temperature=1.0):
    """`[B, S]` float64 oracle of `token_logprobs`: numpy's log-softmax of
    `lm.forward(tokens) / temperature` over the vocabulary at the next token, 0 at
    position 0."""
    z = np.asarray(lm.forward(tokens), np.float64)[:, :-1] / temperature
    z[..., lm.vocab_limit:] = -np.inf
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(lp, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return np.concatenate([np.zeros((len(tokens), 1)), picked], axis=1)


# ---------------------------------------------------------------------------
# Ctrl-C (tests/cli/test_out_file.py, tests/cli/test_results_file.py)
#
# A shell starts a background job (`pytest ... &`) with SIGINT ignored, and children
# inherit an ignored signal: Python then installs no KeyboardInterrupt handler and a
# test's SIGINT does nothing. Tests that send SIGINT set Python's default first.


def sigint_default_in_child():
    """`preexec_fn` for a child process that is sent SIGINT: the OS default, so the
    child's Python installs its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def sigint_raises_keyboard_interrupt():
    """This process's SIGINT handler set to Python's default (KeyboardInterrupt) for
    the block, the previous one restored after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


# ---------------------------------------------------------------------------
# Models built in place: int8 weights as `load(weights="int8")` makes them, and
# tiny random Gemma 3 models with several patterns of sliding windows

def int8_lm(lm: LanguageModel, mode: str = quant.DEFAULT_MODE) -> LanguageModel:
    """As `load(weights="int8")` quantises: calibrated outlier channels kept float."""
    params = llama.unstack_layers(lm.params)
    kept = outliers.calibrate(lm.config, params, lm.tokenizer)
    params = quant.quantize_params(params, mode=mode, outliers=kept)
    return dataclasses.replace(lm, params=jax.tree_util.tree_map(jnp.asarray, params))


GEMMA_WINDOWS = {"5 local : 1 global": gemma3.layer_pattern(6, 8),
            "mixed windows": (8, None, 4, None, 8, 3),
            "windows of 1 and 2": (1, None, 2, 8, None, 8)}


def tiny_gemma(windows) -> LanguageModel:
    cfg = gemma3.Gemma3Config(vocab_size=264, dim=32, n_layers=6, n_heads=4, n_kv_heads=2,
                              head_dim=8, ffn_dim=64, layer_windows=windows,
                              query_pre_attn_scalar=12.0, final_logit_softcapping=30.0,
                              max_seq_len=256)
    params = gemma3.init_params(cfg, jax.random.key(0), 0.3)
    return LanguageModel(config=cfg, params=params, tokenizer=tiny.byte_tokenizer(), name="tiny-gemma")


# ---------------------------------------------------------------------------
# The sampling filters' float64 oracle (tests/sampling)

def keep_reference(logits, temperature, top_k, top_p, min_p, vocab_limit, eps=1e-4):
    """(keep [V] bool, ambiguous [V] bool): ambiguous tokens have a top-p or
    min-p decision within eps of its boundary, where float32 may differ."""
    v = logits.shape[0]
    x = logits[:vocab_limit].astype(np.float64)
    keep = np.zeros(v, bool)
    ambiguous = np.zeros(v, bool)
    if temperature == 0:
        keep[int(np.argmax(x))] = True
        return keep, ambiguous
    z = (x - x.max()) / temperature
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    n = zs.shape[0]
    k_keep = np.ones(n, bool)
    amb_s = np.zeros(n, bool)
    if 0 < top_k < n:
        k_keep[top_k:] = False
        # Values that float32 tempering may round together (or apart) at the cut-off:
        # the float64 order there is not the device's. Exact float64 ties are not
        # ambiguous (equal logits stay equal; the lower index ranks first).
        cut = zs[top_k - 1]
        near = np.abs(zs - cut) <= 1e-6 * max(1.0, abs(cut))
        if near[:top_k].any() and near[top_k:].any() and not np.all(zs[near] == cut):
            amb_s |= near
    e = np.exp(zs) * k_keep
    probs = e / e.sum()
    above = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    keep_s = k_keep.copy()
    if top_p < 1:
        keep_s &= above < top_p
        amb_s |= k_keep & (np.abs(above - top_p) < eps)
    ratio = np.exp(zs - zs[0])
    if min_p > 0:
        amb_s |= keep_s & (np.abs(ratio - min_p) < eps * min_p)
        keep_s &= ratio >= min_p
    keep_s[0] = True
    amb_s[0] &= top_k == 1 and amb_s[1:].any()  # the top token is always kept, unless tied
    keep[order[keep_s]] = True
    ambiguous[order[amb_s]] = True
    return keep, ambiguous
