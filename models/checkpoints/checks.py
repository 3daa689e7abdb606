"""Validation of checkpoint metadata values, shared by the GGUF and Hugging Face loaders.

Each helper takes the raw value a file declared and `what`, the text that
names it in messages ("path/model.gguf: llama.attention.head_count"), and
returns the value as a plain Python scalar or raises `ModelLoadError` with
one line: what, the rule, and the value found. The rules:

    count / dim       an integer (not a bool, not a float) in [1, 2**31 - 1]
    length >= 0       an integer in [0, 2**31 - 1] (`minimum=0`)
    positive float    a finite number > 0 (ints are accepted, bools are not)
    string / bool     exactly that JSON / GGUF type
    token id          an integer in [0, n), n the vocabulary's tokens (a stop id
                      that can never be sampled, a pad id past the embedding)

They exist so that an impossible file (a head count of 0, a NaN RoPE base,
a negative RMSNorm epsilon) is refused at load time, never turned into a
ZeroDivisionError, a deep traceback or NaN logits later.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from jaxsample.errors import ModelLoadError

INT_MAX = 2**31 - 1  # positions and shapes must fit int32


def short_repr(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters (metadata arrays can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_value(value: Any, what: str, *, minimum: int = 1) -> int:
    """`value` as an int in [minimum, 2**31 - 1], else ModelLoadError naming `what`.

    Raises:
      ModelLoadError: not an integer (bools, floats, strings and arrays are
        refused), or out of range.
    """
    if not _is_int(value) or not minimum <= int(value) <= INT_MAX:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelLoadError(f"{what} must be {rule} (at most 2**31 - 1), got {short_repr(value)}")
    return int(value)


def positive_float(value: Any, what: str, *, allow_zero: bool = False) -> float:
    """`value` as a finite float > 0 (>= 0 with `allow_zero`), else ModelLoadError naming `what`.

    Raises:
      ModelLoadError: not a number (bools and strings are refused), NaN,
        infinite, negative, or zero without `allow_zero`.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        f = float(value)
        ok = math.isfinite(f) and (f >= 0.0 if allow_zero else f > 0.0)
    if not ok:
        rule = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ModelLoadError(f"{what} must be {rule}, got {short_repr(value)}")
    return float(value)


def string_value(value: Any, what: str) -> str:
    """`value` if it is a str, else ModelLoadError naming `what`."""
    if not isinstance(value, str):
        raise ModelLoadError(f"{what} must be a string, got {short_repr(value)}")
    return value


def bool_value(value: Any, what: str) -> bool:
    """`value` if it is a bool, else ModelLoadError naming `what`."""
    if not isinstance(value, bool):
        raise ModelLoadError(f"{what} must be true or false, got {short_repr(value)}")
    return value


def token_id(value: Any, n: int, what: str) -> int:
    """A special token id (bos, eos, pad, ...) as an int in [0, n), `n` the vocabulary's
    tokens, else ModelLoadError naming `what`."""
    if not _is_int(value) or not 0 <= int(value) < n:
        raise ModelLoadError(f"{what} = {short_repr(value)} is not a token id of the "
                             f"{n}-token vocabulary")
    return int(value)
