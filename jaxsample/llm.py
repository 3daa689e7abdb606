"""`LLM`: the engine as one object, the face JAX code holds.

    from jaxsample import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct", seed=0)
    outs = llm.generate(["Hello, my name is"], SamplingParams(n=4, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "2 + 2 = ?"}], SamplingParams(n=4))

An `LLM` holds what every call would otherwise decide again: the model and
its weights (`params`, replaced in place by `update_weights`), the device
mesh, the KV budget, the context cap, the seed of requests without their own,
the defaults (chunk size, progress) and, through the engine's program cache,
the compiled programs. Its methods take prompts and `SamplingParams` only:

    generate / chat   vLLM's signatures: one `RequestOutput` per prompt, in
                      input order, all prompts in one decode pool
    run               many `Request`s in, each `RequestResult` (with its vote)
                      out as it completes (`jaxsample.run_requests`)
    stream            the text of every branch as it is decoded
    sample            the array form: one `Generation` (`[B, N, T]` tokens,
                      logprobs, the bill), shared-prefix contexts and Bridge
    adaptive_self_consistency   sample in windows until a stopping rule fires

Reproducibility (vLLM's rule): a request whose `SamplingParams.seed` is set
draws from (that seed, branch) alone, wherever it stands in a call; a request
without one draws from the engine's `seed` and its position in the call, so
the same call on the same engine gives the same tokens.

The module-level `jaxsample.generate`, `stream`, `run_requests` and
`adaptive_self_consistency` are the same implementation called without an
engine object; their `SamplingParams.seed` is the batch's seed (prompt b
draws from (seed, b)).

Sources: vLLM's `LLM` (vllm/entrypoints/llm.py: signatures, constructor
keywords, `use_tqdm`); gemma's `Sampler` and Tunix's sampler (an object holding
a model and its compiled loop; Tunix's `update_params`).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Sequence

from jaxsample.errors import InputError

# vLLM constructor keywords (vllm/engine/arg_utils.py EngineArgs) that have no effect
# here: accepted with one warning line saying why.
_NOTED = {
    "trust_remote_code": "jaxsample runs no code from a checkpoint",
    "enforce_eager": "jaxsample always compiles its decode loop with XLA",
    "swap_space": "there is no CPU swap of KV blocks (the pool refills slots instead)",
    "cpu_offload_gb": "weights are not offloaded",
    "disable_log_stats": "jaxsample keeps no request statistics log",
    "enable_prefix_caching": "a request's branches always share their prompt's KV cache",
    "block_size": "the KV cache is per prompt row and per branch tail, not in blocks",
    "tokenizer_mode": "the checkpoint's own tokenizer is used",
    "revision": "nothing is downloaded: pass a local path",
    "tokenizer_revision": "nothing is downloaded: pass a local path",
    "download_dir": "nothing is downloaded: pass a local path",
    "max_num_batched_tokens": "prefill batches follow the pool's free rows",
    "max_seq_len_to_capture": "there are no CUDA graphs to capture per length",
    "disable_custom_all_reduce": "collectives are XLA's",
    "pipeline_parallel_size": "only 1 is accepted (no pipeline parallelism)",
}
# vLLM keywords refused with the jaxsample equivalent.
_REFUSED = {
    "quantization": "checkpoint quantisation methods are not read; quantise at load with "
                    "LLM(model, weights='int8') (or 'int8-weight-only')",
    "lora_modules": "LoRA adapters are not served; merge them into the weights and pass the "
                    "tree to llm.update_weights",
    "enable_lora": "LoRA adapters are not served; merge them into the weights and pass the "
                   "tree to llm.update_weights",
    "speculative_config": "speculative decoding is not implemented",
    "kv_cache_dtype": "the branches' KV cache takes the model's dtype; the prompts' stored KV "
                      "is LLM(model, prefix_kv_dtype='auto') (float16 for a W8A8 model on the "
                      "CPU kernels) or 'model' (the model's dtype, vLLM's 'auto')",
    "max_num_seqs": "the pool's size comes from the KV budget: pass max_kv_bytes or "
                    "gpu_memory_utilization",
}


class LLM:
    """A model, its weights, its device mesh, its KV budget and its compiled programs.

    Args:
      model: a name or path for `jaxsample.load` (the embedded SmolLM2 by
        default: a known name, a `.gguf` file or a Hugging Face directory), or
        an already loaded `LanguageModel`. A Hugging Face hub id whose files are
        not on disk is refused: nothing is downloaded.
      dtype: "auto" (float32), "float32" or "bfloat16".
      weights: None, "int8" or "int8-weight-only" (`jaxsample.load`).
      prefix_kv_dtype: None (default: "auto" when loading, a `LanguageModel`'s
        own otherwise), "auto" or "model": the dtype each prompt's KV cache is
        stored in (`LanguageModel.prefix_kv_dtype`; vLLM's `kv_cache_dtype`
        names the dtype of the whole cache, and its "auto" is our "model").
      cpu_kernels: None (default: "auto" when loading, a `LanguageModel`'s own
        otherwise), "auto" or "off": whether the int8 products may run as the CPU
        kernels (`LanguageModel.cpu_kernels`; `JAXSAMPLE_CPU_KERNELS=0` overrides
        "auto", which `jaxsample.loading.load_info` reports).
      seed: the seed of requests whose SamplingParams have none (vLLM's `seed`;
        an int in [0, 2**32), default 0).
      mesh: a `jax.sharding.Mesh` with a "branch" axis (and optionally
        "data"), as `jaxsample.generate`; or None.
      tensor_parallel_size: vLLM's keyword, mapped to a mesh of that many
        devices on the "branch" axis (jaxsample splits the branches over
        devices and replicates the weights; it does not split the weights).
        Requests' n must then be multiples of it. Not with `mesh`.
      max_kv_bytes: the pool's byte budget per device (`engine.budget`);
        default `engine.budget.DEFAULT_KV_FRACTION` of device memory.
      gpu_memory_utilization: vLLM's keyword, in (0, 1]: the fraction of device
        memory (host RAM on CPU) the weights and the KV budget may take
        together; the budget is that fraction minus the weights' bytes. Not
        with `max_kv_bytes`.
      max_model_len: the longest prompt + max_tokens a request may have
        (vLLM's keyword), at most the model's context; default the model's.
      chunk_size: decode steps between host checks (stop strings, progress,
        the pool's refills); default as `jaxsample.generate`.
      attention: the decode step's attention, "auto" (Pallas kernels on GPU and
        TPU, XLA on CPU), "xla" or "pallas" (`jaxsample.kernels`).
      compilation_cache: turn on JAX's persistent compilation cache and the
        engine's exported programs (`jaxsample.enable_compilation_cache`, in
        `jaxsample.cache_paths.cache_dir()`) unless a compilation cache is
        already configured, so the next process compiles nothing (default
        True; `JAXSAMPLE_NO_CACHE` also turns it off). This changes JAX's
        process-wide cache setting; importing jaxsample never does.
      progress: the default of each call's `use_tqdm`: None (default) shows
        progress on stderr when it is a terminal, True always, False never.
      **vllm_kwargs: other keywords of vLLM's `LLM` are accepted with a
        one-line warning where they mean nothing here (`trust_remote_code`,
        `enforce_eager`, ...), or refused naming the jaxsample equivalent
        (`quantization`, `max_num_seqs`, ...); any other keyword is refused.

    Raises:
      InputError: a bad or unknown argument, before anything loads.
      ModelLoadError: the model cannot be found or read.
    """

    def __init__(self, model: Any = None, *, tokenizer=None, dtype: str = "auto",
                 weights: str | None = None, prefix_kv_dtype: str | None = None,
                 cpu_kernels: str | None = None, seed: int = 0, mesh=None,
                 tensor_parallel_size: int = 1, max_kv_bytes: int | None = None,
                 gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 chunk_size: int | None = None, attention: str = "auto",
                 compilation_cache: bool = True, progress: bool | None = None,
                 **vllm_kwargs):
        from jaxsample import loading
        from jaxsample.engine import inputs
        from jaxsample.lm import CPU_KERNELS, PREFIX_KV_DTYPES, LanguageModel

        for name, value in vllm_kwargs.items():
            if name in _REFUSED:
                raise InputError(f"LLM({name}=...): {_REFUSED[name]}")
            if name not in _NOTED:
                known = sorted(set(_NOTED) | set(_REFUSED))
                raise InputError(f"LLM: unknown keyword {name!r}; jaxsample's are model, dtype, "
                                 f"weights, prefix_kv_dtype, cpu_kernels, seed, mesh, tensor_parallel_size, max_kv_bytes, "
                                 f"gpu_memory_utilization, max_model_len, chunk_size, attention, "
                                 f"compilation_cache, progress (vLLM keywords also understood: "
                                 f"{', '.join(known)})")
            if name == "pipeline_parallel_size" and value not in (None, 1):
                raise InputError(f"LLM(pipeline_parallel_size={value!r}): only 1 is supported "
                                 f"(no pipeline parallelism); split branches with mesh=")
            warnings.warn(f"jaxsample.LLM: {name}={value!r} ignored: {_NOTED[name]}",
                          stacklevel=2)
        if tokenizer is not None:
            raise InputError("LLM(tokenizer=...): jaxsample uses the checkpoint's own tokenizer; "
                             "pass tokenizer=None")
        if dtype not in ("auto", "float32", "bfloat16"):
            raise InputError(f"LLM(dtype=...) must be 'auto', 'float32' or 'bfloat16', got "
                             f"{dtype!r}")
        for name, value, allowed in (("prefix_kv_dtype", prefix_kv_dtype, PREFIX_KV_DTYPES),
                                     ("cpu_kernels", cpu_kernels, CPU_KERNELS)):
            if value is not None and (not isinstance(value, str) or value not in allowed):
                raise InputError(f"LLM({name}=...) must be None or one of "
                                 f"{', '.join(map(repr, allowed))}, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise InputError(f"LLM(seed=...) must be an int in [0, 2**32), got {seed!r}")
        if progress not in (None, True, False):
            raise InputError(f"LLM(progress=...) must be None, True or False, got {progress!r}")
        if not isinstance(compilation_cache, bool):
            raise InputError(f"LLM(compilation_cache=...) must be True or False, got "
                             f"{compilation_cache!r}")
        tp = inputs.check_int("tensor_parallel_size", tensor_parallel_size, 1, 2**16)
        if tp > 1 and mesh is not None:
            raise InputError("LLM: give mesh= or tensor_parallel_size=, not both")
        if max_kv_bytes is not None and gpu_memory_utilization is not None:
            raise InputError("LLM: give max_kv_bytes= or gpu_memory_utilization=, not both")
        if max_kv_bytes is not None:
            max_kv_bytes = inputs.check_int("max_kv_bytes", max_kv_bytes, 1, 2**62)
        if gpu_memory_utilization is not None and (
                isinstance(gpu_memory_utilization, bool)
                or not isinstance(gpu_memory_utilization, (int, float))
                or not 0 < gpu_memory_utilization <= 1):
            raise InputError(f"LLM(gpu_memory_utilization=...) must be a float in (0, 1], got "
                             f"{gpu_memory_utilization!r}")
        if max_model_len is not None:
            max_model_len = inputs.check_int("max_model_len", max_model_len, 1, 2**31 - 1)
        if chunk_size is not None:
            chunk_size = inputs.check_int("chunk_size", chunk_size, 1, 2**31 - 1)
        from jaxsample import kernels

        if compilation_cache:
            _enable_cache()
        if isinstance(model, LanguageModel):
            if weights is not None or dtype != "auto":
                raise InputError("LLM: dtype= and weights= apply when loading; a loaded "
                                 "LanguageModel keeps its own")
            switches = {k: v for k, v in (("prefix_kv_dtype", prefix_kv_dtype),
                                          ("cpu_kernels", cpu_kernels)) if v is not None}
            lm = dataclasses.replace(model, **switches) if switches else model
        else:
            lm = loading.load(model, dtype="float32" if dtype == "auto" else dtype,
                              weights=weights, prefix_kv_dtype=prefix_kv_dtype or "auto",
                              cpu_kernels=cpu_kernels or "auto")
        if max_model_len is not None and max_model_len > lm.config.max_seq_len:
            raise InputError(f"LLM(max_model_len={max_model_len}) is longer than the model's "
                             f"context of {lm.config.max_seq_len} tokens")
        kernels.resolve_attention(attention, lm.config)  # an InputError before any call
        if tp > 1:
            mesh = _branch_mesh(tp)
        self.lm = lm
        self.seed = seed
        self.mesh = mesh
        self.max_model_len = max_model_len
        self.chunk_size = chunk_size
        self.attention = attention
        self.progress = progress
        self._memory_fraction = gpu_memory_utilization
        self._max_kv_bytes = max_kv_bytes
        inputs.resolve_mesh(mesh, mesh.shape.get("branch", 1) if mesh is not None else 1)

    # -- state ----------------------------------------------------------------

    @property
    def params(self):
        """The current parameter pytree (`LanguageModel.params`)."""
        return self.lm.params

    @property
    def max_kv_bytes(self) -> int:
        """The pool's byte budget per device: `max_kv_bytes`, or from
        `gpu_memory_utilization`, or the engine's default fraction of memory."""
        from jaxsample.engine import budget

        if self._max_kv_bytes is not None:
            return self._max_kv_bytes
        if self._memory_fraction is None:
            return budget.default_kv_budget()
        import jax

        weights = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(self.lm.params))
        room = int(self._memory_fraction * budget.device_memory_bytes()) - weights
        if room <= 0:
            raise InputError(f"gpu_memory_utilization={self._memory_fraction} of "
                             f"{budget.device_memory_bytes():,} bytes leaves no room beside the "
                             f"weights' {weights:,} bytes")
        return room

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's `get_tokenizer`)."""
        return self.lm.tokenizer

    def update_weights(self, params) -> None:
        """Replace the weights in place, for the next calls (an RL loop's sync).

        The new tree must have `params`' structure, shapes and dtypes (the
        trainer's tree as it left `llm.params`); it is checked first, and a
        mismatch is one InputError naming the first differing leaf, with the
        engine unchanged. Nothing recompiles (the weights are an argument of
        every program), nothing is reloaded or written to the disk cache, and
        nothing computed from the old weights is kept: the engine's placed copy
        (on a mesh, or the per-layer split of stacked weights) is dropped
        before the new one is made, so the device never holds three copies.
        KV caches live per call, so none outlives it.

        An int8 engine holds quantised weights (`weights="int8"`), which a
        trainer does not produce: it refuses new weights (build the engine
        from the float model for RL).

        Args:
          params: the new parameter pytree (jax or numpy arrays).

        Raises:
          InputError: an int8 engine, or a tree that does not match.
        """
        import jax
        import numpy as np

        from jaxsample.engine import placement
        from jaxsample.models.quantization import quant

        if quant.is_quantized(self.lm.params):
            raise InputError("update_weights: this engine holds int8 weights (weights='int8'); "
                             "an RL loop needs the float engine: LLM(model) without weights=")
        old, new = jax.tree_util.tree_flatten_with_path(self.lm.params), None
        try:
            new = jax.tree_util.tree_flatten_with_path(params)
        except Exception as e:  # noqa: BLE001  (anything that is not a pytree)
            raise InputError(f"update_weights: params is not a pytree: {e}") from None
        if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(self.lm.params):
            names_old = [jax.tree_util.keystr(k) for k, _ in old[0]]
            names_new = [jax.tree_util.keystr(k) for k, _ in new[0]]
            first = next((a for a, b in zip(names_old, names_new) if a != b),
                         names_old[len(names_new)] if len(names_old) > len(names_new)
                         else names_new[len(names_old)] if len(names_new) > len(names_old)
                         else "(the tree's node types)")
            raise InputError(f"update_weights: the tree differs from llm.params at {first} "
                             f"({len(names_new)} leaves given, {len(names_old)} expected)")
        for (path, a), (_, b) in zip(old[0], new[0]):
            sa, sb = tuple(np.shape(a)), tuple(np.shape(b))
            da, db = np.dtype(a.dtype), np.dtype(getattr(b, "dtype", np.asarray(b).dtype))
            if sa != sb or da != db:
                raise InputError(f"update_weights: leaf {jax.tree_util.keystr(path)} is "
                                 f"{db} {list(sb)}, expected {da} {list(sa)}")
        placement.forget(self.lm)
        self.lm = dataclasses.replace(self.lm, params=params)

    # -- calls ----------------------------------------------------------------

    def _progress(self, use_tqdm):
        if use_tqdm is None:
            use_tqdm = self.progress
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        if not isinstance(use_tqdm, bool):
            from jaxsample import progress as progress_lib

            return progress_lib.resolve(use_tqdm)
        return use_tqdm

    def _params(self, sampling_params, count: int) -> list:
        from jaxsample.sampling_params import SamplingParams

        if sampling_params is None:
            sampling_params = SamplingParams()
        many = isinstance(sampling_params, (list, tuple))
        ps = list(sampling_params) if many else [sampling_params] * count
        if len(ps) != count:
            raise InputError(f"sampling_params: {len(ps)} given for {count} prompts "
                             f"(give one, or one per prompt)")
        for i, p in enumerate(ps):
            if not isinstance(p, SamplingParams):
                raise InputError(f"sampling_params[{i}] must be a SamplingParams, got "
                                 f"{type(p).__name__}")
        return ps

    def _pool(self, requests, use_tqdm, index_offset: int = 0):
        from jaxsample.engine.requests import (
            check_requests,
            encode_requests,
            open_pool,
            pool_results,
        )

        reqs = check_requests(requests)
        session = open_pool(self.lm, reqs, encode_requests(self.lm, reqs),
                            max_kv_bytes=self.max_kv_bytes, mesh=self.mesh,
                            index_offset=index_offset, progress=self._progress(use_tqdm),
                            seed=self.seed, max_model_len=self.max_model_len,
                            attention=self.attention)
        return pool_results(session, reqs, chunk_size=self.chunk_size, index_offset=index_offset)

    def _outputs(self, items, params, chat: bool, use_tqdm) -> list:
        from jaxsample.engine.requests import Request

        reqs = [Request(id=str(i), messages=x, params=p) if chat
                else Request(id=str(i), prompt=x, params=p)
                for i, (x, p) in enumerate(zip(items, params))]
        out: list = [None] * len(reqs)
        for res in self._pool(reqs, use_tqdm):
            out[res.index] = res.output
        return out

    def generate(self, prompts, sampling_params=None, use_tqdm: bool | None = None,
                 lora_request=None) -> list:
        """vLLM's `LLM.generate`: no chat template; every prompt in one decode pool.

        Args:
          prompts: a string, a list of strings, a `{"prompt": str}` /
            `{"prompt_token_ids": [...]}` dict (vLLM's TextPrompt / TokensPrompt)
            or a list of them.
          sampling_params: one `SamplingParams` for all, or one per prompt (each
            with its own n, max_tokens, sampling values, stops and seed).
          use_tqdm: show progress on stderr (None: the engine's `progress`).
          lora_request: must be None (no LoRA).

        Returns:
          One `RequestOutput` per prompt, in input order (`request_id`: its
          position as a string; vLLM counts across calls).

        Raises:
          InputError: bad prompts or params, before any compute.
        """
        if lora_request is not None:
            raise InputError("lora_request: LoRA adapters are not supported; pass None")
        items = _prompt_items(prompts)
        return self._outputs(items, self._params(sampling_params, len(items)), False, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool | None = None,
             lora_request=None, chat_template=None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools=None) -> list:
        """vLLM's `LLM.chat`: the model's chat template, with the generation prompt.

        Args:
          messages: one conversation (a list of `{"role", "content"}` dicts) or
            a list of conversations.
          sampling_params: one `SamplingParams` for all, or one per conversation.
          use_tqdm: as `generate`.
          lora_request, chat_template, tools: must be None; add_generation_prompt
            must be True and continue_final_message False (what is implemented).

        Returns:
          One `RequestOutput` per conversation, in input order.

        Raises:
          InputError: as `generate`, and for the unsupported arguments.
        """
        for name, v in (("lora_request", lora_request), ("chat_template", chat_template),
                        ("tools", tools)):
            if v is not None:
                raise InputError(f"{name}: not supported; pass None")
        if add_generation_prompt is not True or continue_final_message is not False:
            raise InputError("add_generation_prompt must be True and continue_final_message "
                             "False (the chat template always ends with the generation prompt)")
        if chat_template_content_format != "auto":
            raise InputError("chat_template_content_format must be 'auto'")
        one = isinstance(messages, Sequence) and messages and isinstance(messages[0], dict)
        convs = [messages] if one else list(messages)
        return self._outputs(convs, self._params(sampling_params, len(convs)), True, use_tqdm)

    def run(self, requests, *, index_offset: int = 0, use_tqdm: bool | None = None):
        """Many requests in, each result out as it completes (`jaxsample.run_requests`).

        Plain requests share one pool whatever their settings; each result
        carries its self-consistency vote; adaptive requests run their rule.

        Args:
          requests: `Request`s or dicts of their fields (id, prompt or messages,
            params, adaptive, extract).
          index_offset: the position of the first request in a larger list
            (requests without their own seed draw from that position).
          use_tqdm: as `generate`.

        Returns:
          An iterator of `RequestResult`s, in completion order.

        Raises:
          InputError: as `jaxsample.run_requests`, before any compute.
        """
        from jaxsample.reduce.requests import run_requests

        return run_requests(self.lm, requests, max_kv_bytes=self.max_kv_bytes,
                            chunk_size=self.chunk_size, mesh=self.mesh, index_offset=index_offset,
                            seed=self.seed, progress=self._progress(use_tqdm),
                            max_model_len=self.max_model_len, attention=self.attention)

    def stream(self, prompts, sampling_params=None, *, chat: bool = False,
               chunk_size: int | None = None, use_tqdm: bool | None = None):
        """The text of every branch as it is decoded (`jaxsample.stream`'s events).

        Args:
          prompts, sampling_params: as `generate` (chat prompts with `chat=True`).
          chunk_size: decode steps between events (default 8).

        Returns:
          An iterator of `StreamEvent`s, the last with the `Generation`.
        """
        from jaxsample.engine import api
        from jaxsample.engine.stream import events

        items = _prompt_items(prompts)
        session, rnd, chunk, observer = api.start(
            self.lm, items, self._params(sampling_params, len(items)), chat=chat,
            mesh=self.mesh, bridge=None, prompt_index_offset=0, naive=False,
            chunk_size=chunk_size or self.chunk_size or api.STOP_CHUNK,
            progress=self._progress(use_tqdm), max_kv_bytes=self.max_kv_bytes,
            seed=self.seed, request_seeds=True, max_model_len=self.max_model_len,
            attention=self.attention)
        return events(session, rnd, chunk, None, observer)

    def sample(self, prompts, sampling_params=None, *, chat: bool = False, shared_prefix=None,
               bridge=None, use_tqdm: bool | None = None, **pool):
        """The array form: one `Generation` over B prompts (`[B, N, T]` tokens,
        logprobs, texts and the bill), as `jaxsample.generate` with this engine's
        model, mesh, budget and seeds.

        Args:
          prompts, sampling_params, chat: as `generate` / `chat` (one
            SamplingParams, or one per prompt).
          shared_prefix: a context common to every prompt, stored once.
          bridge: optional `jaxsample.bridge.Bridge` (cross-branch layers).
          pool: `compact`, `max_rows`, `max_slots` of `jaxsample.generate`.

        Returns:
          A `Generation`.
        """
        from jaxsample.engine import api

        unknown = set(pool) - {"compact", "max_rows", "max_slots"}
        if unknown:
            raise InputError(f"LLM.sample: unknown keywords {sorted(unknown)} (allowed: compact, "
                             f"max_rows, max_slots)")
        if isinstance(sampling_params, tuple):
            sampling_params = list(sampling_params)
        return api.run_generate(
            self.lm, prompts if chat else _prompt_items(prompts), sampling_params, chat=chat,
            mesh=self.mesh, bridge=bridge, chunk_size=self.chunk_size,
            progress=self._progress(use_tqdm), shared_prefix=shared_prefix,
            max_kv_bytes=self.max_kv_bytes, seed=self.seed, request_seeds=True,
            max_model_len=self.max_model_len, attention=self.attention, **pool)

    def adaptive_self_consistency(self, prompts, sampling_params=None, *, chat: bool = False,
                                  use_tqdm: bool | None = None, **rule):
        """Adaptive self-consistency over this engine's model and mesh
        (`jaxsample.adaptive_self_consistency`; `rule`: max_n, window, rule,
        threshold, ...). The params' seed (else the engine's) is the batch's."""
        from jaxsample.reduce import adaptive
        from jaxsample.sampling_params import SamplingParams

        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InputError("adaptive_self_consistency takes one SamplingParams for every "
                             "prompt")
        if params.seed is None:
            params = params.replace(seed=self.seed)
        return adaptive.adaptive_self_consistency(self.lm, prompts, params, chat=chat,
                                                  mesh=self.mesh,
                                                  progress=self._progress(use_tqdm), **rule)


def _prompt_items(prompts) -> list:
    """vLLM's prompt forms -> a list of strings / token-id lists. Raises InputError."""
    items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    if items and all(isinstance(x, int) for x in items):
        raise InputError("prompts: a flat list of ints is ambiguous; pass "
                         "{'prompt_token_ids': [...]} (vLLM's TokensPrompt)")
    norm = []
    for i, x in enumerate(items):
        if isinstance(x, dict):
            keys = set(x)
            if keys == {"prompt"}:
                x = x["prompt"]
            elif keys == {"prompt_token_ids"}:
                x = list(x["prompt_token_ids"])
            else:
                raise InputError(f"prompts[{i}]: a dict must be {{'prompt': str}} or "
                                 f"{{'prompt_token_ids': [...]}}, got keys {sorted(keys)}")
        norm.append(x)
    return norm


def _branch_mesh(size: int):
    """A mesh of `size` devices on the "branch" axis (`tensor_parallel_size`)."""
    import jax
    import numpy as np

    from jaxsample.sharding import BRANCH_AXIS

    devices = jax.devices()
    if size > len(devices):
        raise InputError(f"tensor_parallel_size={size} > the {len(devices)} device(s) here")
    return jax.sharding.Mesh(np.array(devices[:size]), (BRANCH_AXIS,))


def _enable_cache() -> None:
    """JAX's persistent compilation cache and the exported programs, unless the process
    already has a compilation cache (the user's choice is kept)."""
    import jax

    from jaxsample import disk_cache

    if jax.config.jax_compilation_cache_dir:
        return
    disk_cache.enable_compilation_cache()

