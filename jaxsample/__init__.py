"""jaxsample: parallel sampling from language models in JAX.

One prompt, N branches that share the prompt's KV cache (prefilled once,
stored once, read once per decode step for all branches), then a jitted
reducer picks one branch (best-of-N) or votes (self-consistency).

    from jaxsample import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["2 + 2 ="], SamplingParams(n=8, max_tokens=16))

The public names are imported lazily, so `import jaxsample` stays cheap and
`jaxsample.cli --help` answers before JAX is initialised; importing changes
no JAX setting. The stages are submodules (`jaxsample.engine`,
`jaxsample.reduce`, `jaxsample.cost`, ...), importable as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# What users call: name -> the module that defines it.
_EXPORTS = {
    # the engine object and its inputs and outputs
    "LLM": "jaxsample.llm",
    "SamplingParams": "jaxsample.sampling_params",
    "Request": "jaxsample.engine.requests",
    "RequestResult": "jaxsample.engine.requests",
    "RequestOutput": "jaxsample.generation",
    "CompletionOutput": "jaxsample.generation",
    "Logprob": "jaxsample.generation",
    "Generation": "jaxsample.generation",
    "StreamEvent": "jaxsample.engine",
    "TextDelta": "jaxsample.engine",
    "Bill": "jaxsample.cost",
    # the same engine without the object
    "load": "jaxsample.loading",
    "LanguageModel": "jaxsample.lm",
    "generate": "jaxsample.engine",
    "stream": "jaxsample.engine",
    "run_requests": "jaxsample.reduce.requests",
    "RequestVote": "jaxsample.reduce.requests",
    "adaptive_self_consistency": "jaxsample.reduce.adaptive",
    "AdaptiveResult": "jaxsample.reduce.adaptive",
    # training on the engine's log-probabilities
    "token_logprobs": "jaxsample.training.logprobs",
    # reducers and estimators
    "best_of_n": "jaxsample.reduce",
    "majority_vote": "jaxsample.reduce",
    "Vote": "jaxsample.reduce",
    "self_consistency": "jaxsample.reduce",
    "SelfConsistency": "jaxsample.reduce",
    "pass_at_k": "jaxsample.reduce.estimators",
    "maj_at_k": "jaxsample.reduce.estimators",
    "best_of_k": "jaxsample.reduce.estimators",
    # set-up and errors
    "enable_compilation_cache": "jaxsample.disk_cache",
    "Progress": "jaxsample.progress",
    "JaxsampleError": "jaxsample.errors",
}
# Submodules reachable as attributes (`jaxsample.engine`), not star-exported.
_SUBMODULES = {"bridge", "bridge_training", "cli", "cost", "disk_cache", "engine", "errors",
               "generation", "kernels", "lm", "llm", "loading", "progress", "reduce",
               "sampling_params", "sharding", "training", "weight_cache"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what IDEs and type checkers see of the lazy names
    from jaxsample.cost import Bill
    from jaxsample.disk_cache import enable_compilation_cache
    from jaxsample.engine import StreamEvent, TextDelta, generate, stream
    from jaxsample.engine.requests import Request, RequestResult
    from jaxsample.errors import JaxsampleError
    from jaxsample.generation import CompletionOutput, Generation, Logprob, RequestOutput
    from jaxsample.llm import LLM
    from jaxsample.lm import LanguageModel
    from jaxsample.loading import load
    from jaxsample.progress import Progress
    from jaxsample.reduce import SelfConsistency, Vote, best_of_n, majority_vote, self_consistency
    from jaxsample.reduce.adaptive import AdaptiveResult, adaptive_self_consistency
    from jaxsample.reduce.estimators import best_of_k, maj_at_k, pass_at_k
    from jaxsample.reduce.requests import RequestVote, run_requests
    from jaxsample.sampling_params import SamplingParams
    from jaxsample.training.logprobs import token_logprobs


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxsample.{name}")
    raise AttributeError(f"module 'jaxsample' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | _SUBMODULES)
