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
