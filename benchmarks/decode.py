"""Decode speed and memory: jaxsample's shared-prefix engine against the naive
engine (N materialised prefix copies), two peers (Hugging Face transformers
`generate(num_return_sequences=N)`; optionally llama.cpp's
`llama-batched-bench -pps -kvu`, engine `llamacpp`, see benchmarks/llamacpp.py:
`--llamacpp-bin DIR --llamacpp-model F32.gguf`, skipped with the reason in the
row when absent) and the hardware limit (a memory-bandwidth roofline measured
in the same run).

Usage (CPU, the embedded SmolLM2-135M-Instruct in float32):

    PYTHONPATH=. python benchmarks/decode.py --config smollm2 \
        --prompt-lengths 256,1024 --branches 1,4,16 --new-tokens 64 \
        --out benchmarks/results/cpu_smollm2.jsonl

Accelerators (the same script; bfloat16 there): see benchmarks/gpu_run.sh.

How it measures (letters as in models/llama.py: P prompt tokens, N branches,
T new tokens):

* Every (engine, P, N) cell runs in a fresh subprocess (`--isolate cell`), so
  its peak memory is its own: on CPU the resident set size is polled every
  5 ms during the measured call (`peak_rss_bytes`, and `run_rss_delta_bytes`
  above the RSS just before the call, i.e. what the call itself allocated); on
  GPU/TPU `device.memory_stats()["peak_bytes_in_use"]` (jax) or
  `torch.cuda.max_memory_allocated` (peer). `--isolate engine` runs all N of
  one (engine, P) in one process in increasing N (faster on accelerators: one
  start-up and one model init); peaks are then running maxima, flagged
  `peak_is_running_max`.
* Inside a worker: load (or random init) the model (`load_s`), warm up, then
  the measured call. jaxsample AOT-compiles its programs and reports compile
  seconds apart (`Generation.timings`), so `--warmup small` (a tiny request
  with other shapes: starts thread pools and allocators) is enough to exclude
  compile from every other number; `--warmup full` repeats the measured
  request once first (what accelerators use; costs one extra run).
* All engines decode exactly T tokens per branch: prompts are random token
  ids (the same ids for all engines, `--seed`), temperature 1, no filters;
  jaxsample runs with a tokenizer view whose eos list is empty (the engine
  always adds the model's eos ids to the stop ids), so no branch stops early,
  and `gen.lengths` is checked; the peer uses `min_new_tokens=T`.
* decode time per step = decode seconds / forward steps. jaxsample's loop
  samples T tokens with T - 1 forward passes (the first token comes from the
  prefill's logits); the peer's decode window (first logits processor call to
  the end) is the same T samples and T - 1 forwards. decode tokens/s = N*T /
  decode seconds (all branches). End to end = the whole call without compile
  (`e2e_s`), and with it (`e2e_with_compile_s`).
* Roofline: bandwidth = the best of several large array copies (numpy and
  jax, 2 x bytes moved per copy: read + write); the bytes a decode step must
  read come from `jaxsample.cost.estimate` (weights + prefix KV once + N tails
  for the shared engine, weights + N prefix copies + tails for the naive
  engine and the peer), averaged over the T steps; `roofline_step_s` = bytes /
  bandwidth is the step's lower bound and `roofline_fraction` = that bound /
  the measured step. `roofline_shared_fraction` uses the shared engine's
  bytes for every engine (the limit of the task, not of the algorithm).
* `--naive-prefill tile` (for long prompts on CPU) builds the naive engine's N
  prefix copies by prefilling once and copying the cache N times (the N
  prefills of identical prompts give identical caches), then runs the naive
  decode program unchanged; its prefill and end-to-end time are then not
  measured (null) and the row says `naive_prefill: tile`.

Output: one JSON line per cell (and one per environment/bandwidth record and
per pair of engines) in `--out`, and a markdown table on stdout. Ratios are
computed pair by pair from cells of the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("jaxsample", "naive", "hf", "llamacpp")

# Named configurations (presets for --config).
CONFIGS = {
    "smollm2": dict(model="smollm2", prompt_lengths=[256, 1024, 4096], branches=[1, 4, 16, 64],
                    new_tokens=64),
    "llama-1b": dict(model="llama-1b", prompt_lengths=[4096], branches=[1, 16, 64],
                     new_tokens=128),
}

# A 1B-class Llama with random weights (Llama-3.2-1B shapes).
LLAMA_1B = dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                ffn_dim=8192, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True)


# ---------------------------------------------------------------------------
# Small helpers (no jax import: the parent process never touches the device)


def _now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _versions():
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "torch",
                 "transformers", "numpy"):
        try:
            out[dist] = md.version(dist)
        except Exception:  # noqa: BLE001 - not installed
            pass
    return out


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class PeakRSS:
    """Polls the process RSS in a thread (psutil, else /proc/self/statm)."""

    def __init__(self, interval=0.005):
        self.interval = interval
        try:
            import psutil

            proc = psutil.Process()
            self._read = lambda: proc.memory_info().rss
        except Exception:  # noqa: BLE001
            page = os.sysconf("SC_PAGE_SIZE")

            def read():
                with open("/proc/self/statm") as f:
                    return int(f.read().split()[1]) * page

            self._read = read

    def __enter__(self):
        self.start = self.peak = self._read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            self._stop.wait(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


def _ru_maxrss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _engine_sha():
    """Short hash of the engine's sources as this worker imports them (the engine evolves)."""
    import glob
    import hashlib

    h = hashlib.sha1()
    files = sorted(glob.glob(os.path.join(ROOT, "jaxsample", "engine", "*.py")))
    for name in files:
        with open(name, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:10] if files else None


def _prompt_ids(seed, P, vocab):
    """The same random prompt for every engine (ids in [16, vocab) skip control tokens)."""
    return np.random.default_rng([seed, P]).integers(16, vocab, size=P).tolist()


# ---------------------------------------------------------------------------
# jaxsample side (imported only in workers)


class NoEosTokenizer:
    """A view of a tokenizer with no eos ids, so no branch stops before T tokens."""

    eos_token_ids = ()

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _platform():
    import jax

    return jax.devices()[0].platform


def _dtype_for(model, dtype, plat):
    if dtype != "auto":
        return dtype
    if model == "llama-1b":
        return "bfloat16"
    return "float32" if plat == "cpu" else "bfloat16"


def load_jax_model(model, dtype):
    """Returns (LanguageModel with a no-eos tokenizer, load seconds)."""
    import dataclasses

    import jax

    t0 = time.perf_counter()
    if model == "smollm2":
        from jaxsample.loading import load

        lm = load(None, dtype=dtype)
        lm = dataclasses.replace(lm, tokenizer=NoEosTokenizer(lm.tokenizer))
    elif model == "llama-1b":
        from jaxsample.lm import LanguageModel
        from jaxsample.models import llama
        from jaxsample.models.tokenizer import ByteTokenizer

        cfg = llama.LlamaConfig(**LLAMA_1B, dtype=dtype)
        params = jax.jit(lambda k: llama.init_params(cfg, k, 0.02))(jax.random.key(0))
        jax.block_until_ready(params)
        lm = LanguageModel(config=cfg, params=params, tokenizer=ByteTokenizer(cfg.vocab_size),
                           name="llama-1b-random", source="random")
    else:
        raise ValueError(f"unknown model {model!r}")
    jax.block_until_ready(lm.params)
    return lm, time.perf_counter() - t0


def _device_mem():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        stats = {}
    return stats


def _nbytes(tree):
    import jax

    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves(tree)))


def _naive_tiled(lm, ids, params):
    """The naive engine's decode on N prefix copies made by copying one prefill.

    `generate(naive=True)` with its N identical prefills replaced by one: a
    `Session` prefills the prompt once, then one `Round` over N rows that all
    take that row (the gather copies the prefix N times, as the naive engine
    holds it), one branch each, branch index = copy index.
    """
    from jaxsample import engine as E

    N, T = params.n, params.max_new_tokens
    t_start = time.perf_counter()
    s = E.Session(lm, [ids], params.replace(n=1))
    rnd = s.round([0] * N, np.arange(N, dtype=np.int32)[:, None])
    while rnd.run(T):
        pass
    timings = dict(s.timings, prefill=None, total=time.perf_counter() - t_start)
    out = dict(timings=timings, steps=s.decode_steps, lengths=rnd.lengths.reshape(1, N),
               kv_prefix=_nbytes((rnd.prefix.k, rnd.prefix.v)), kv_tails=rnd.tail_bytes[0])
    del rnd, s
    return out


def run_jax_cell(lm, engine, P, N, T, args, plat):
    """One measured jaxsample/naive request (after warm-up). Returns a result dict."""
    import jax

    from jaxsample import cost
    from jaxsample.engine import generate
    from jaxsample import SamplingParams

    ids = _prompt_ids(args.seed, P, lm.vocab_limit)
    params = SamplingParams(n=N, temperature=1.0, max_new_tokens=T, seed=args.seed)
    tile = engine == "naive" and args.naive_prefill == "tile"

    def call():
        if tile:
            return _naive_tiled(lm, ids, params)
        g = generate(lm, [ids], params, naive=(engine == "naive"))
        return dict(timings=dict(g.timings), steps=g.bill.decode_steps, lengths=g.lengths,
                    kv_prefix=g.bill.kv_bytes_shared_prefix, kv_tails=g.bill.kv_bytes_tails)

    compile_s = 0.0
    if args.warmup == "full":
        r = call()
        compile_s = r["timings"]["compile"]
    elif args.warmup == "small":
        small = SamplingParams(n=1, temperature=1.0, max_new_tokens=2, seed=0)
        generate(lm, [_prompt_ids(args.seed, 16, lm.vocab_limit)], small)

    mem0 = _device_mem() if plat != "cpu" else {}
    with PeakRSS() as rss:
        r = call()
    mem1 = _device_mem() if plat != "cpu" else {}
    tm = r["timings"]
    compile_s += tm["compile"]
    lengths = np.asarray(r["lengths"])
    steps = int(r["steps"])
    forwards = max(steps - 1, 1)
    decoded = int(lengths.sum())
    est = cost.estimate(lm.config, P, T, N)
    e2e = None if tile else tm["total"] - tm["compile"]
    out = dict(
        compile_s=compile_s, prefill_s=tm["prefill"], decode_s=tm["decode"], decode_steps=steps,
        decode_forwards=forwards, decode_step_s=tm["decode"] / forwards,
        decoded_tokens=decoded, all_branches_full=bool((lengths == T).all()),
        decode_tokens_per_s=decoded / tm["decode"],
        e2e_s=e2e, e2e_with_compile_s=None if e2e is None else e2e + compile_s,
        kv_bytes_shared_prefix=r["kv_prefix"], kv_bytes_tails=r["kv_tails"],
        kv_bytes_held=r["kv_prefix"] + r["kv_tails"],
        step_bytes=(est.decode_bytes_separate if engine == "naive" else est.decode_bytes_shared) / T,
        step_bytes_shared=est.decode_bytes_shared / T,
        weight_bytes=est.weight_bytes,
        naive_prefill="tile" if tile else ("run" if engine == "naive" else None),
    )
    if plat == "cpu":
        out.update(peak_rss_bytes=rss.peak, run_rss_delta_bytes=rss.peak - rss.start,
                   ru_maxrss_bytes=_ru_maxrss_bytes())
        out["peak_bytes"] = rss.peak - rss.start
    else:
        out.update(device_peak_bytes=mem1.get("peak_bytes_in_use"),
                   device_bytes_in_use_before=mem0.get("bytes_in_use"),
                   device_bytes_limit=mem1.get("bytes_limit"))
        out["peak_bytes"] = mem1.get("peak_bytes_in_use")
    return out


# ---------------------------------------------------------------------------
# The peer: Hugging Face transformers (imported only in workers)


def load_hf_model(model, dtype):
    """Returns (model, device, vocab rows, load seconds)."""
    import torch
    import transformers

    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if model == "smollm2":
        import importlib.metadata as md

        from jaxsample.models import registry

        path = registry.embedded_path(registry.DEFAULT_MODEL)
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=tdtype)
        del md
    elif model == "llama-1b":
        c = LLAMA_1B
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
    return m, dev, int(m.config.vocab_size), time.perf_counter() - t0


def run_hf_cell(m, dev, vocab, P, N, T, args):
    import torch
    import transformers

    from jaxsample import cost

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
    ids = _prompt_ids(args.seed, P, vocab)
    if args.warmup == "full":
        gen(ids, N, T)
    else:  # small: start kernels and thread pools with a tiny request
        gen(_prompt_ids(args.seed, 16, vocab), 1, 2)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    clock = Clock()
    with PeakRSS() as rss:
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
                 ru_maxrss_bytes=_ru_maxrss_bytes())
        r["peak_bytes"] = rss.peak - rss.start
    return r


def _hf_cost_config(m):
    """A LlamaConfig for `jaxsample.cost` from the HF model's config (same shapes)."""
    from jaxsample.models import llama

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


# ---------------------------------------------------------------------------
# Workers


def bandwidth_worker(gib, repeats):
    """Best-of-`repeats` copy bandwidth (bytes read + written per second)."""
    out = {"kind": "bandwidth", "copy_bytes": int(gib * 2**30)}
    n = int(gib * 2**30) // 4
    try:
        src = np.ones(n, np.float32)
        dst = np.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        out["numpy_copy_bytes_per_s"] = 2 * src.nbytes / best
        del src, dst
    except Exception as e:  # noqa: BLE001
        out["numpy_error"] = repr(e)
    try:
        import jax
        import jax.numpy as jnp

        dev = jax.devices()[0]
        out["platform"] = dev.platform
        out["device_kind"] = dev.device_kind
        out["num_devices"] = jax.device_count()
        x = jnp.ones((n,), jnp.float32)
        f = jax.jit(lambda a: a + 1.0)
        jax.block_until_ready(f(x))
        best = float("inf")
        for _ in range(max(repeats, 5)):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            best = min(best, time.perf_counter() - t0)
        out["jax_copy_bytes_per_s"] = 2 * x.nbytes / best
    except Exception as e:  # noqa: BLE001
        out["jax_error"] = repr(e)
    cands = [out.get("jax_copy_bytes_per_s")]
    if out.get("platform", "cpu") == "cpu":
        cands.append(out.get("numpy_copy_bytes_per_s"))
    cands = [c for c in cands if c]
    out["bandwidth_bytes_per_s"] = max(cands) if cands else None
    return out


def worker(spec):
    """Runs the cells of one spec (one engine, one P, several N) and prints JSON lines."""
    args = argparse.Namespace(**spec["args"])
    if getattr(args, "llama_override", None):
        LLAMA_1B.update(json.loads(args.llama_override))
    if spec["engine"] == "bandwidth":
        print("RESULT " + json.dumps(bandwidth_worker(args.bandwidth_gib, args.bandwidth_repeats)),
              flush=True)
        return
    engine, P = spec["engine"], spec["P"]
    base = dict(kind="cell", engine=engine, config=args.config, P=P, T=args.new_tokens,
                isolate=args.isolate, warmup=args.warmup, engine_sha=_engine_sha())
    if engine == "llamacpp":  # an external process: benchmarks/llamacpp.py
        return _llamacpp_worker(spec, args, base)
    try:
        if engine == "hf":  # never start a jax backend in the peer's process
            import torch

            plat = "gpu" if torch.cuda.is_available() else "cpu"
        else:
            plat = _platform()
        dtype = _dtype_for(args.model, args.dtype, plat)
        base.update(platform=plat, dtype=dtype)
        if engine == "hf":
            m, dev, vocab, load_s = load_hf_model(args.model, dtype)
            base["torch_device"] = dev
        else:
            lm, load_s = load_jax_model(args.model, dtype)
    except Exception as e:  # noqa: BLE001
        for N in spec["Ns"]:
            print("RESULT " + json.dumps(dict(base, N=N, error=f"load: {e!r}",
                                              traceback=traceback.format_exc()[-2000:])),
                  flush=True)
        return
    for i, N in enumerate(spec["Ns"]):
        row = dict(base, N=N, load_s=load_s, peak_is_running_max=i > 0)
        try:
            if engine == "hf":
                row.update(run_hf_cell(m, dev, vocab, P, N, args.new_tokens, args))
            else:
                row.update(run_jax_cell(lm, engine, P, N, args.new_tokens, args, plat))
        except Exception as e:  # noqa: BLE001
            row.update(error=repr(e)[:2000], traceback=traceback.format_exc()[-3000:])
        print("RESULT " + json.dumps(row), flush=True)
        if "error" in row and "RESOURCE_EXHAUSTED" in row["error"]:
            for N2 in spec["Ns"][i + 1:]:  # larger N would fail the same way
                print("RESULT " + json.dumps(dict(base, N=N2, error="skipped: smaller N ran "
                                                  "out of memory")), flush=True)
            return


def _llamacpp_worker(spec, args, base):
    """llama.cpp cells (`llama-batched-bench -pps -kvu`, see benchmarks/llamacpp.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llamacpp

    exe, model, why = llamacpp.locate(args.llamacpp_bin, args.llamacpp_model)
    cfg = None
    if args.model == "smollm2":
        from jaxsample.loading import read_config

        cfg = read_config()
    base.update(platform="cpu", dtype="float32 (gguf F32)", llamacpp_model=model)
    for N in spec["Ns"]:
        row = dict(base, N=N)
        try:
            if why:
                raise RuntimeError(why)
            row.update(llamacpp.run_cell(exe, model, spec["P"], N, args.new_tokens,
                                         args.llamacpp_threads, args.cell_timeout, cfg))
        except Exception as e:  # noqa: BLE001
            row.update(error=str(e)[:2000])
        print("RESULT " + json.dumps(row), flush=True)


# ---------------------------------------------------------------------------
# Parent: schedule workers, compute ratios, print tables


def _spawn(spec, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the device with the peer
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        stdout, stderr, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = f"timeout after {timeout:.0f} s", "timeout"
    rows = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    for row in rows:
        row["worker_wall_s"] = time.perf_counter() - t0
    if rc != 0:  # died (OOM kill, timeout, crash): record what is missing
        done = {r.get("N") for r in rows}
        for N in spec.get("Ns", [None]):
            if N not in done:
                rows.append(dict(kind="cell" if spec["engine"] != "bandwidth" else "bandwidth",
                                 engine=spec["engine"], P=spec.get("P"), N=N,
                                 error=f"worker exit {rc}: {stderr[-1500:]}"))
    return rows


def _fmt(x, unit="", digits=3):
    if x is None:
        return "-"
    if unit == "MiB":
        return f"{x / 2**20:.0f}"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _pairs(cells):
    """Ratios pair by pair: jaxsample/naive and jaxsample/hf at the same (P, N)."""
    by = {(c["engine"], c["P"], c["N"]): c for c in cells if "error" not in c}
    out = []
    for (eng, P, N), c in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if eng != "jaxsample":
            continue
        for other in ("naive", "hf", "llamacpp"):
            o = by.get((other, P, N))
            if o is None:
                continue
            r = dict(kind="pair", P=P, N=N, engines=f"jaxsample/{other}")
            for key in ("decode_step_s", "e2e_s", "prefill_s", "peak_bytes"):
                a, b = c.get(key), o.get(key)
                if a and b:
                    r[f"{key}_ratio"] = a / b  # < 1: jaxsample is faster / smaller
            if c.get("decode_step_s") and o.get("decode_step_s"):
                r["decode_speedup"] = o["decode_step_s"] / c["decode_step_s"]
            if c.get("e2e_s") and o.get("e2e_s"):
                r["e2e_speedup"] = o["e2e_s"] / c["e2e_s"]
            out.append(r)
    return out


def _table(cells, pairs):
    lines = ["| engine | P | N | load s | compile s | prefill s | decode s/step | decode tok/s "
             "| e2e s | e2e+compile s | peak MiB | KV prefix MiB | KV tails MiB | roofline s/step "
             "| roofline frac | note |",
             "|" + "---|" * 16]
    for c in sorted(cells, key=lambda c: (c.get("P") or 0, c.get("N") or 0,
                                          ENGINES.index(c["engine"]) if c["engine"] in ENGINES
                                          else 9)):
        note = c.get("error", "")[:80]
        if not note and c.get("naive_prefill") == "tile":
            note = "prefill tiled (decode only)"
        if not note and c.get("all_branches_full") is False:
            note = f"early stop: {c.get('decoded_tokens')} tokens"
        lines.append("| " + " | ".join([
            c["engine"], str(c.get("P")), str(c.get("N")), _fmt(c.get("load_s")),
            _fmt(c.get("compile_s")), _fmt(c.get("prefill_s")), _fmt(c.get("decode_step_s")),
            _fmt(c.get("decode_tokens_per_s")), _fmt(c.get("e2e_s")),
            _fmt(c.get("e2e_with_compile_s")), _fmt(c.get("peak_bytes"), "MiB"),
            _fmt(c.get("kv_bytes_shared_prefix"), "MiB"), _fmt(c.get("kv_bytes_tails"), "MiB"),
            _fmt(c.get("roofline_step_s")), _fmt(c.get("roofline_fraction")), note]) + " |")
    lines += ["", "| P | N | pair | decode speedup | e2e speedup | peak memory ratio |",
              "|---|---|---|---|---|---|"]
    for r in pairs:
        lines.append(f"| {r['P']} | {r['N']} | {r['engines']} | {_fmt(r.get('decode_speedup'))}x "
                     f"| {_fmt(r.get('e2e_speedup'))}x | {_fmt(r.get('peak_bytes_ratio'))} |")
    return "\n".join(lines)


def _predict_hf(done_hf, P, N):
    """Predicted seconds of an HF cell from the measured ones (scales ~ N * P)."""
    best = None
    for c in done_hf:
        if "error" in c or not c.get("e2e_s"):
            continue
        pred = c["e2e_s"] * (N * P) / (c["N"] * c["P"])
        best = pred if best is None else min(best, pred)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="smollm2", choices=sorted(CONFIGS))
    ap.add_argument("--prompt-lengths", help="comma-separated P (default: the config's)")
    ap.add_argument("--branches", help="comma-separated N (default: the config's)")
    ap.add_argument("--new-tokens", type=int, help="T (default: the config's)")
    ap.add_argument("--engines", default="jaxsample,naive,hf")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: float32 on CPU, bfloat16 on accelerators (llama-1b: bfloat16)")
    ap.add_argument("--warmup", default="small", choices=["small", "full", "none"])
    ap.add_argument("--isolate", default="cell", choices=["cell", "engine"])
    ap.add_argument("--naive-prefill", default="run", choices=["run", "tile"],
                    help="tile: prefill once and copy (decode-only naive numbers)")
    ap.add_argument("--naive-tile-from", type=int, default=None,
                    help="use --naive-prefill tile for P >= this (default: never)")
    ap.add_argument("--hf-skip-above", type=float, default=120.0,
                    help="skip HF cells predicted to take longer (seconds; 0 = never skip)")
    ap.add_argument("--hf-max-p", type=int, default=None, help="skip HF cells with larger P")
    ap.add_argument("--cell-timeout", type=float, default=1800.0)
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="stop starting workers after this many seconds (0 = none)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0)
    ap.add_argument("--bandwidth-repeats", type=int, default=5)
    ap.add_argument("--llama-override", default=None,
                    help='JSON dict overriding the llama-1b shapes, e.g. \'{"n_layers": 2}\' (smoke tests)')
    ap.add_argument("--cost-analysis", action="store_true",
                    help="also print XLA's cost analysis of the compiled decode step (shared, "
                         "naive, ideal bytes) at each (P, N): benchmarks/cost_analysis.py")
    ap.add_argument("--llamacpp-bin", default=None,
                    help="directory of llama-batched-bench (else $JAXSAMPLE_LLAMACPP_BIN)")
    ap.add_argument("--llamacpp-model", default=None,
                    help="GGUF for llama.cpp, e.g. the F32 SmolLM2 (else $JAXSAMPLE_LLAMACPP_MODEL)")
    ap.add_argument("--llamacpp-threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSONL path (default benchmarks/results/<config>_<platform>.jsonl)")
    ap.add_argument("--plot", default=None, help="PNG path for benchmarks/plot.py (optional)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))

    preset = CONFIGS[a.config]
    Ps = [int(x) for x in a.prompt_lengths.split(",")] if a.prompt_lengths else preset["prompt_lengths"]
    Ns = [int(x) for x in a.branches.split(",")] if a.branches else preset["branches"]
    a.new_tokens = a.new_tokens or preset["new_tokens"]
    a.model = preset["model"]
    engines = [e for e in a.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; choose from {ENGINES}")
    t_begin = time.perf_counter()
    wargs = {k: v for k, v in vars(a).items() if k not in ("worker",)}

    env = dict(kind="env", date=_now(), argv=sys.argv, cpu=_cpu_model(), cpu_count=os.cpu_count(),
               versions=_versions(), hostname=platform.node())
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    bw = (_spawn(dict(engine="bandwidth", args=wargs), 600) or [{}])[0]
    env.update(platform=bw.get("platform"), device_kind=bw.get("device_kind"))
    bandwidth = bw.get("bandwidth_bytes_per_s")
    print(f"# {env['date']} {env['cpu']} x{env['cpu_count']} {env.get('device_kind')} "
          f"bandwidth {(bandwidth or 0) / 1e9:.1f} GB/s", flush=True)

    out = a.out or os.path.join(ROOT, "benchmarks", "results",
                                f"{a.config}_{bw.get('platform') or 'unknown'}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fh = open(out, "w")
    for rec in (env, bw):
        fh.write(json.dumps(rec) + "\n")
    fh.flush()

    # Schedule: pair by pair (all engines of one (P, N) back to back) with
    # --isolate cell; one worker per (engine, P) with --isolate engine.
    specs = []
    if a.isolate == "cell":
        for P in Ps:
            for N in Ns:
                for e in engines:
                    specs.append(dict(engine=e, P=P, Ns=[N]))
    else:
        for P in Ps:
            for e in engines:
                specs.append(dict(engine=e, P=P, Ns=sorted(Ns)))
    llamacpp_why = None
    if "llamacpp" in engines:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import llamacpp

        llamacpp_why = llamacpp.locate(a.llamacpp_bin, a.llamacpp_model)[2]
        if a.model != "smollm2" and not llamacpp_why:
            llamacpp_why = "skipped: the llama.cpp peer runs the smollm2 config only"
    cells = []
    for spec in specs:
        e, P = spec["engine"], spec["P"]
        sargs = dict(wargs)
        if e == "naive" and a.naive_tile_from is not None and P >= a.naive_tile_from:
            sargs["naive_prefill"] = "tile"
        spec["args"] = sargs
        skip = None
        if a.deadline and time.perf_counter() - t_begin > a.deadline:
            skip = f"skipped: past --deadline {a.deadline:.0f} s"
        elif e == "llamacpp" and llamacpp_why:
            skip = llamacpp_why
        elif e == "hf" and a.hf_max_p and P > a.hf_max_p:
            skip = f"skipped: P > --hf-max-p {a.hf_max_p}"
        elif e == "hf" and a.hf_skip_above and a.isolate == "cell":
            pred = _predict_hf([c for c in cells if c["engine"] == "hf"], P, spec["Ns"][0])
            if pred and pred > a.hf_skip_above:
                skip = f"skipped: predicted {pred:.0f} s > --hf-skip-above {a.hf_skip_above:.0f} s"
        if skip:
            rows = [dict(kind="cell", engine=e, config=a.config, P=P, N=N, T=a.new_tokens,
                         error=skip) for N in spec["Ns"]]
        else:
            rows = _spawn(spec, a.cell_timeout)
        for row in rows:
            if bandwidth and row.get("step_bytes") and row.get("decode_step_s"):
                row["bandwidth_bytes_per_s"] = bandwidth
                row["roofline_step_s"] = row["step_bytes"] / bandwidth
                row["roofline_fraction"] = row["roofline_step_s"] / row["decode_step_s"]
                row["roofline_shared_fraction"] = (row["step_bytes_shared"] / bandwidth
                                                   / row["decode_step_s"])
            cells.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            msg = row.get("error", "")[:120] or (
                f"prefill {_fmt(row.get('prefill_s'))} s, step {_fmt(row.get('decode_step_s'))} s, "
                f"e2e {_fmt(row.get('e2e_s'))} s, peak {_fmt(row.get('peak_bytes'), 'MiB')} MiB")
            print(f"  {e:9s} P={P:<5d} N={row.get('N')!s:<3s} {msg}", flush=True)

    pairs = _pairs(cells)
    for r in pairs:
        fh.write(json.dumps(r) + "\n")
    fh.close()
    print()
    print(_table(cells, pairs))
    if a.cost_analysis:  # in a subprocess: the parent never starts a jax backend
        env2 = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else ""))
        p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cost_analysis.py"),
                            "--model", a.model, "--prompt-lengths", ",".join(map(str, Ps)),
                            "--branches", ",".join(map(str, Ns)), "--new-tokens",
                            str(a.new_tokens), "--json", out], capture_output=True, text=True,
                           env=env2, cwd=ROOT)
        print("\nXLA cost analysis of one compiled decode step (bytes accessed):\n"
              + (p.stdout if p.returncode == 0 else f"failed: {p.stderr[-1500:]}"))
    print(f"\nwrote {out} ({time.perf_counter() - t_begin:.0f} s)")
    if a.plot:
        try:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import plot

            plot.plot([out], a.plot)
            print(f"wrote {a.plot}")
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e!r}")


if __name__ == "__main__":
    main()
