"""vLLM's offline entry point, `LLM`, on the decode pool.

    from jaxsample import LLM, SamplingParams      # was: from vllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outs = llm.generate(["Hello, my name is"], SamplingParams(n=4, max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "2 + 2 = ?"}], SamplingParams(n=4))

Signatures follow vllm/entrypoints/llm.py (`LLM.generate(prompts,
sampling_params=None, use_tqdm=True, lora_request=None)`, `LLM.chat(messages,
sampling_params=None, use_tqdm=True, lora_request=None, chat_template=None,
..., add_generation_prompt=True)`); arguments vLLM has and jaxsample does not
implement (LoRA, a custom chat template, tools, continuing the final message)
are refused with an InputError naming them, never ignored. Everything runs
through `engine.requests.run_requests` (the continuous-batching pool), and the
results come back in input order, each `RequestOutput.request_id` the
request's position as a string (vLLM counts requests across calls; here each
call starts at 0).
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxsample.errors import InputError


class LLM:
    """A model and its decode pool, used like vLLM's `LLM`.

    Args:
      model: a name or path for `jaxsample.load` (the embedded SmolLM2 by
        default), or an already loaded `LanguageModel`.
      dtype: "float32" or "bfloat16" ("auto": float32).
      seed: the seed of requests whose SamplingParams have none (vLLM's
        `seed`, default 0 there too).
      max_kv_bytes: the pool's byte budget (`engine.budget`); default a fraction
        of device memory (vLLM's `gpu_memory_utilization` plays this part).
      mesh: optional device mesh, as `jaxsample.generate`.
    Raises:
      InputError, ModelLoadError: a bad dtype or model, at construction.
    """

    def __init__(self, model: Any = None, *, dtype: str = "auto", seed: int = 0,
                 max_kv_bytes: int | None = None, mesh=None, tokenizer=None):
        from jaxsample import loading
        from jaxsample.lm import LanguageModel

        if tokenizer is not None:
            raise InputError("tokenizer=: jaxsample uses the checkpoint's own tokenizer; "
                             "pass tokenizer=None")
        if dtype not in ("auto", "float32", "bfloat16"):
            raise InputError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise InputError(f"seed must be an int in [0, 2**31), got {seed!r}")
        self.lm = model if isinstance(model, LanguageModel) else loading.load(
            model, dtype="float32" if dtype == "auto" else dtype)
        self.seed, self.max_kv_bytes, self.mesh = seed, max_kv_bytes, mesh

    def get_tokenizer(self):
        return self.lm.tokenizer

    def _params(self, sampling_params, count: int) -> list:
        from jaxsample import SamplingParams

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
        return [p if p.seed is not None else p.replace(seed=self.seed) for p in ps]

    def _run(self, items, params, chat: bool) -> list:
        from jaxsample.engine.requests import Request, run_requests

        reqs = [Request(id=str(i), messages=x, params=p) if chat
                else Request(id=str(i), prompt=x, params=p)
                for i, (x, p) in enumerate(zip(items, params))]
        out: list = [None] * len(reqs)
        for res in run_requests(self.lm, reqs, max_kv_bytes=self.max_kv_bytes, mesh=self.mesh):
            out[res.index] = res.output
        return out

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 lora_request=None) -> list:
        """vLLM's `LLM.generate`: no chat template.

        Args:
          prompts: a string, a list of strings, a `{"prompt": str}` /
            `{"prompt_token_ids": [...]}` dict (vLLM's TextPrompt / TokensPrompt)
            or a list of them.
          sampling_params: one `SamplingParams` for all, or one per prompt.
          use_tqdm: accepted (progress is not drawn).
          lora_request: must be None (no LoRA).
        Returns:
          One `RequestOutput` per prompt, in input order.
        Raises:
          InputError: bad prompts or params, before any compute.
        """
        if lora_request is not None:
            raise InputError("lora_request: LoRA adapters are not supported; pass None")
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
        return self._run(norm, self._params(sampling_params, len(norm)), chat=False)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, lora_request=None,
             chat_template=None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools=None) -> list:
        """vLLM's `LLM.chat`: the model's chat template, with the generation prompt.

        Args:
          messages: one conversation (a list of `{"role", "content"}` dicts) or
            a list of conversations.
          sampling_params: one `SamplingParams` for all, or one per conversation.
          use_tqdm: accepted (progress is not drawn).
          lora_request, chat_template, tools: must be None; add_generation_prompt
            must be True and continue_final_message False (what is implemented).
        Returns:
          One `RequestOutput` per conversation, in input order.
        Raises:
          InputError: as `generate`, and for the unsupported arguments.
        """
        for name, v, ok in (("lora_request", lora_request, None), ("chat_template", chat_template, None),
                            ("tools", tools, None)):
            if v is not ok:
                raise InputError(f"{name}: not supported; pass None")
        if add_generation_prompt is not True or continue_final_message is not False:
            raise InputError("add_generation_prompt must be True and continue_final_message "
                             "False (the chat template always ends with the generation prompt)")
        if chat_template_content_format != "auto":
            raise InputError("chat_template_content_format must be 'auto'")
        one = isinstance(messages, Sequence) and messages and isinstance(messages[0], dict)
        convs = [messages] if one else list(messages)
        return self._run(convs, self._params(sampling_params, len(convs)), chat=True)
