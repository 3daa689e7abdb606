"""Calibrated outlier channels for int8: the input channels of each projection kept in float.

W8A8 (`models.quantization.quant`) quantises each activation row with one scale, `max|x| /
127`. A few input channels of a transformer's activations are far larger
than the rest (LLM.int8(), Dettmers et al. 2022, arXiv 2208.07339; "Massive
activations", Sun et al. 2024, arXiv 2402.17762): on SmolLM2-135M the
largest channel of the down projection's input reaches 477 against a median
channel of 4, so that one channel sets the scale and rounds the others to a
few levels. Like QUIK (Ashkboos et al. 2023, arXiv 2310.09259) the channels
are chosen once, by calibration, rather than per token as LLM.int8() does:
the float model runs over a short built-in text, each projection records the
largest |x| of every input channel, and its `K` largest channels are kept in
float (`quant.QuantizedWeight.outliers`: a `[K, out]` float32 slice of the
weight and an `x[..., idx]` product beside the int8 dot), the rest
quantised as before with those channels masked out of the row scale.

Per projection that is `K x out x 4` more bytes (K = 16: 11% over the
int8 weight at in = E = 576) and a gather and a thin dot per step; the
accuracy it buys is in docs/benchmarks.md ("Int8 weights"), measured by
benchmarks/quantized.py and benchmarks/int8_outliers.py.

    maxima = channel_maxima(cfg, params, tokens)     # the float model, list layout
    idx = outlier_channels(maxima, k=16)
    params = quant.quantize_params(params, outliers=idx)
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample.models.families import common, families
from jaxsample.models.quantization import quant

N_OUTLIERS = 16  # channels kept in float per projection (the default of `load(weights="int8")`)

# The built-in calibration text: generic chat turns (instructions, arithmetic,
# prose, a list, code) that share nothing with the benchmarks' evaluation
# prompts or tasks. Each is one user turn and the start of an answer.
CALIBRATION = (
    ("How do I keep basil alive on a windowsill?",
     "Basil wants six hours of sun, soil that dries between waterings, and its "
     "flower buds pinched off so the plant keeps making leaves."),
    ("Add 348 and 275, then subtract 119.", "348 + 275 = 623, and 623 - 119 = 504."),
    ("Summarise the water cycle for a ten-year-old.",
     "Water warms up, rises as vapour, cools into clouds and falls back as rain "
     "or snow, which flows into rivers and seas to start again."),
    ("Write a Python function that reverses a list.",
     "def reverse(items):\n    return items[::-1]"),
    ("List four planets and one fact about each.",
     "1. Mercury is closest to the Sun. 2. Venus is the hottest. 3. Mars has the "
     "tallest volcano. 4. Jupiter has the most mass."),
    ("Translate 'the train leaves at noon' into French.", "Le train part à midi."),
)


# What the chosen channels depend on beside the model: the text, K and the int8 grid
# (the int8 weight cache keys its entries on it).
RECIPE = hashlib.sha256(repr((CALIBRATION, N_OUTLIERS, quant.QMAX)).encode()).hexdigest()[:16]


def calibration_tokens(tokenizer) -> np.ndarray:
    """The built-in calibration text as one int32 sequence `[S]`: each turn through
    the tokenizer's chat template where it has one (plain text otherwise), joined."""
    ids = []
    for user, answer in CALIBRATION:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": user}])
        except Exception:  # no chat template: plain text
            text = user + "\n"
        ids += list(tokenizer.encode(text + answer))
    return np.asarray(ids, np.int32)


@jax.tree_util.register_pytree_node_class
class _Probe:
    """A float weight whose product records max|x| per input channel (calibration only)."""

    def __init__(self, w, name):
        self.w, self.name = w, name

    def tree_flatten(self):
        return (self.w,), self.name

    @classmethod
    def tree_unflatten(cls, name, leaves):
        return cls(leaves[0], name)

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    def calibration_product(self, x, preferred_element_type=None):
        _RECORDING.append((self.name, jnp.max(jnp.abs(x.reshape(-1, x.shape[-1])), axis=0)))
        return quant.matmul(x, self.w, preferred_element_type)

    def __rmatmul__(self, x):
        return self.calibration_product(x)


_RECORDING: list = []  # (name, max|x| per channel) of the probes' products in one trace


def channel_maxima(cfg, params, tokens) -> dict:
    """max |x| per input channel of every projection over one forward pass.

    Args:
      cfg: the model config (either family).
      params: float parameters in the list layout (`unstack_layers`), host or device.
      tokens: int `[S]`, one sequence.
    Returns:
      {(layer, key): float64 `[in]` for each key of `quant.PROJECTIONS` the layer
      has, "head": float64 `[E]` (the output head's input)}.
    Raises:
      ValueError: params in the stacked layout, or tokens not a non-empty 1-D sequence.
    """
    if not isinstance(params.get("layers"), (list, tuple)):
        raise ValueError("channel_maxima: needs the list layout (unstack_layers)")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not tokens.size:
        raise ValueError(f"channel_maxima: tokens must be a non-empty [S] sequence, "
                         f"got shape {tokens.shape}")
    probed = dict(params)
    probed["layers"] = [{k: _Probe(v, f"{i}.{k}") if k in quant.PROJECTIONS and np.ndim(v) == 2
                         else v for k, v in lp.items()}
                        for i, lp in enumerate(params["layers"])]
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    probed["lm_head"] = _Probe(head, "head")
    cfg = dataclasses.replace(cfg, tie_embeddings=False)
    family = families.module_for(cfg)

    def run(p, t):
        _RECORDING.clear()
        try:
            common.forward_one(family, cfg, p, t)
            return dict(_RECORDING)
        finally:
            _RECORDING.clear()

    out = jax.jit(run)(probed, jnp.asarray(tokens, jnp.int32))
    name = lambda s: s if s == "head" else (int(s.split(".")[0]), s.split(".")[1])  # noqa: E731
    return {name(k): np.asarray(v, np.float64) for k, v in out.items()}


def kept_count(n_in: int, k: int = N_OUTLIERS) -> int:
    """How many of a projection's `n_in` input channels stay float: `k`, at most an
    eighth of them (at least 1)."""
    return max(1, min(k, n_in // 8))


def abstract_channels(params, k: int = N_OUTLIERS) -> dict:
    """`outlier_channels`' structure for a parameter tree of shapes (list layout):
    zeros of each projection's kept count, for `quantize_params(abstract=True)`."""
    out = {(i, key): np.zeros(kept_count(a.shape[0], k), np.int32)
           for i, lp in enumerate(params["layers"]) for key, a in lp.items()
           if key in quant.PROJECTIONS and len(a.shape) == 2}
    out["head"] = np.zeros(kept_count(params["embed"].shape[1], k), np.int32)
    return out


def outlier_channels(maxima: dict, k: int = N_OUTLIERS) -> dict:
    """The `k` largest channels of each projection's input (sorted int32 `[k]`), as
    `quant.quantize_params(outliers=...)` takes them; `k` is capped at an eighth
    of a projection's input width (at least 1). Raises ValueError for k < 1."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"outlier_channels: k must be a positive int, got {k!r}")
    return {name: np.sort(np.argsort(-m, kind="stable")[:kept_count(m.size, k)])
            .astype(np.int32) for name, m in maxima.items()}


def calibrate(cfg, params, tokenizer, k: int = N_OUTLIERS) -> dict:
    """`outlier_channels(channel_maxima(...))` over the built-in calibration text."""
    return outlier_channels(channel_maxima(cfg, params, calibration_tokens(tokenizer)), k)
