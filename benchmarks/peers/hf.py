"""The Hugging Face transformers peer: `generate(num_return_sequences=N)` in decode.py's row schema.

Imported only in decode.py's workers (`--engines ...,hf`), never in a process
that runs jax: torch and transformers are imported when a cell runs, so
without them the cells are rows whose error says so. The measured call
samples T tokens for N sequences at temperature 1, no filters,
`min_new_tokens=T`; its decode window runs from the first logits processor
call (right after the prefill) to the end: T samples and T - 1 forwards, as
jaxsample's loop. Peak memory: the RSS polled during the call on CPU,
`torch.cuda.max_memory_allocated` above the memory in use before it on GPU.
"""

from __future__ import annotations

import time

from benchmarks import common


def platform():
    """ "gpu" where torch sees CUDA, else "cpu" (never starts a jax backend)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def load(model, dtype):
    """Returns ((model, torch device, vocab rows), load seconds, {"torch_device": device})."""
    import torch
    import transformers

    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model == "smollm2":
        from jaxsample.models.checkpoints import registry

        path = registry.embedded_path(registry.DEFAULT_MODEL)
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=tdtype)
    elif model == "llama-1b":
        c = common.LLAMA_1B
        config = transformers.LlamaConfig(
            vocab_size=c["vocab_size"], hidden_size=c["dim"], intermediate_size=c["ffn_dim"],
            num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
            num_key_value_heads=c["n_kv_heads"], head_dim=c["head_dim"],
            max_position_embeddings=c["max_seq_len"], rope_theta=c["rope_theta"],
            tie_word_embeddings=c["tie_embeddings"], bos_token_id=1, eos_token_id=2,
            pad_token_id=0, torch_dtype=tdtype)
        torch.manual_seed(0)
        with torch.device(dev):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(tdtype)
            try:
                m = transformers.LlamaForCausalLM(config)
            finally:
                torch.set_default_dtype(prev)
    else:
        raise ValueError(f"unknown model {model!r}")
    m = m.to(dev).eval()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (m, dev, int(m.config.vocab_size)), time.perf_counter() - t0, {"torch_device": dev}


def run_cell(handle, engine, P, N, T, args, plat):
    """One measured `generate(num_return_sequences=N)` (after warm-up), as a decode.py row."""
    import torch
    import transformers

    from jaxsample import cost

    m, dev, vocab = handle

    class Clock(transformers.LogitsProcessor):
        """Records when each step's logits arrive (the first one right after prefill)."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    def gen(ids, n, t, clock=None):
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  num_return_sequences=n, max_new_tokens=t, min_new_tokens=t,
                  attention_mask=torch.ones_like(x), pad_token_id=0)
        if clock is not None:
            kw["logits_processor"] = transformers.LogitsProcessorList([clock])
        with torch.inference_mode():
            return m.generate(x, **kw)

    torch.manual_seed(args.seed)
    ids = common.prompt_ids(args.seed, P, vocab)
    if args.warmup == "full":
        gen(ids, N, T)
    else:  # small: start kernels and thread pools with a tiny request
        gen(common.prompt_ids(args.seed, 16, vocab), 1, 2)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    clock = Clock()
    with common.PeakRSS() as rss:
        t0 = time.perf_counter()
        out = gen(ids, N, T, clock)
        if dev == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
    new = out.shape[1] - P
    decoded = int(out.shape[0] * new)
    prefill = clock.times[0] - t0
    decode = t1 - clock.times[0]
    forwards = max(len(clock.times) - 1, 1)
    est = cost.estimate(_hf_cost_config(m), P, T, N)
    r = dict(compile_s=0.0, prefill_s=prefill, decode_s=decode, decode_steps=len(clock.times),
             decode_forwards=forwards, decode_step_s=decode / forwards, decoded_tokens=decoded,
             all_branches_full=bool(new == T and out.shape[0] == N),
             decode_tokens_per_s=decoded / decode, e2e_s=t1 - t0, e2e_with_compile_s=t1 - t0,
             kv_bytes_shared_prefix=None, kv_bytes_tails=None,
             kv_bytes_held=N * (P + T) * est.kv_bytes_per_token,
             step_bytes=est.decode_bytes_separate / T, step_bytes_shared=est.decode_bytes_shared / T,
             weight_bytes=est.weight_bytes)
    if dev == "cuda":
        r.update(device_peak_bytes=torch.cuda.max_memory_allocated(),
                 device_bytes_in_use_before=base)
        r["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    else:
        r.update(peak_rss_bytes=rss.peak, run_rss_delta_bytes=rss.peak - rss.start,
                 ru_maxrss_bytes=common.ru_maxrss_bytes())
        r["peak_bytes"] = rss.peak - rss.start
    return r


def _hf_cost_config(m):
    """A LlamaConfig for `jaxsample.cost` from the HF model's config (same shapes)."""
    from jaxsample.models.families import llama

    c = m.config
    heads = c.num_attention_heads
    return llama.LlamaConfig(
        vocab_size=c.vocab_size, dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=heads,
        n_kv_heads=getattr(c, "num_key_value_heads", heads) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        ffn_dim=c.intermediate_size, max_seq_len=c.max_position_embeddings,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        dtype={"torch.float32": "float32", "torch.bfloat16": "bfloat16"}.get(
            str(next(m.parameters()).dtype), "float32"))
