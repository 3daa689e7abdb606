"""Exceptions raised by jaxsample.

Every error that reaches a user from the public API derives from
`JaxsampleError`, so callers (and the command line) can catch one type and
print a one-line message. Argument errors are also `ValueError`s, so code
written against the usual Python conventions keeps working.
"""

from __future__ import annotations


class JaxsampleError(Exception):
    """Base class of every error jaxsample raises on purpose."""


class ModelLoadError(JaxsampleError):
    """A checkpoint or tokenizer could not be read: names the file and the problem."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint asks for an architecture or an option we do not implement."""


class ConfigError(JaxsampleError, ValueError):
    """A configuration file or value is invalid: names the key and the allowed values."""


class ForeignArgumentError(ConfigError, TypeError):
    """A keyword of another library (vLLM, Hugging Face `generate`) that jaxsample
    spells differently or does not support; the message names the jaxsample
    equivalent. A ConfigError and a TypeError (what Python raises for an
    unknown keyword), so either `except` catches it."""


class InputError(JaxsampleError, ValueError):
    """A request cannot be served (empty prompt, prompt longer than the context, ...)."""


class NumericalError(JaxsampleError, RuntimeError):
    """The model produced no valid distribution (every logit NaN or -inf) for a sampled token."""


class ExtractError(JaxsampleError, RuntimeError):
    """A caller's `extract` callable raised on a branch's text; the message names the
    callable and the text (and, from `run_requests`, the request), the callable's own
    exception is its `__cause__`."""


QUOTE_LIMIT = 200  # characters of a value an error message quotes at most


def short_repr(value, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)` for an error message, at most `limit` characters.

    Built with `reprlib` (a few levels and items of nested containers, long
    strings and numbers cut), so the cost is bounded too: a YAML "billion
    laughs" value (nested aliases, exponentially large when expanded) is never
    expanded in full. Longer results are cut with "...".
    """
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxtuple, r.maxlist, r.maxarray, r.maxdict = 3, 8, 8, 8, 8
    r.maxset = r.maxfrozenset = r.maxdeque = 8
    r.maxstring, r.maxlong, r.maxother = limit, 60, limit
    try:
        text = r.repr(value)
    except Exception:  # a repr that fails: say what it was  # noqa: BLE001
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (U+D800..U+DFFF not paired, as
    JSON's `"\\udfff"` escape or undecodable bytes read with `surrogateescape` give),
    or None when `text` is Unicode text that UTF-8 can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None
