"""jaxsample: parallel sampling from language models in JAX.

One prompt, N branches that share the prompt's KV cache (prefilled once,
stored once, read once per decode step for all branches), then a jitted
reducer picks one branch (best-of-N) or votes (self-consistency).

The public names are imported lazily, so `import jaxsample` stays cheap and
`jaxsample.cli --help` answers before JAX is initialised.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load": "jaxsample.loading",
    "LanguageModel": "jaxsample.lm",
    "SamplingParams": "jaxsample.sampling_params",
    "generate": "jaxsample.engine",
    "stream": "jaxsample.engine",
    "StreamEvent": "jaxsample.engine",
    "TextDelta": "jaxsample.engine",
    "enable_compilation_cache": "jaxsample.disk_cache",
    "Progress": "jaxsample.progress",
    "Generation": "jaxsample.generation",
    "RequestOutput": "jaxsample.generation",
    "CompletionOutput": "jaxsample.generation",
    "Logprob": "jaxsample.generation",
    "best_of_n": "jaxsample.reduce",
    "majority_vote": "jaxsample.reduce",
    "Vote": "jaxsample.reduce",
    "self_consistency": "jaxsample.reduce",
    "SelfConsistency": "jaxsample.reduce",
    "pass_at_k": "jaxsample.reduce.estimators",
    "maj_at_k": "jaxsample.reduce.estimators",
    "best_of_k": "jaxsample.reduce.estimators",
    "JaxsampleError": "jaxsample.errors",
    "adaptive_self_consistency": "jaxsample.reduce.adaptive",
    "AdaptiveResult": "jaxsample.reduce.adaptive",
    "AdaptiveBill": "jaxsample.reduce.adaptive",
    "Bill": "jaxsample.cost",
    "LLM": "jaxsample.llm",
    "run_requests": "jaxsample.reduce.requests",
    "RequestVote": "jaxsample.reduce.requests",
    "Request": "jaxsample.engine.requests",
    "RequestResult": "jaxsample.engine.requests",
    "token_logprobs": "jaxsample.training.logprobs",
}
_SUBMODULES = {"bridge", "bridge_training", "cli", "cost", "disk_cache", "engine", "errors", "weight_cache",
               "generation", "lm", "loading", "progress", "reduce", "sampling_params", "sharding",
               "training"}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxsample.{name}")
    raise AttributeError(f"module 'jaxsample' has no attribute {name!r}")


def __dir__():
    return __all__
