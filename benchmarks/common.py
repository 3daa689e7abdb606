"""What the benchmark scripts share: environment capture, peak-RSS polling,
the worker protocol, the benchmark models and markdown tables.

Run the scripts from the repository root as modules (`python -m
benchmarks.decode ...`, see benchmarks/__init__.py); nothing here imports
jax at module level, so a parent process that only schedules workers never
starts a device backend.

The worker protocol (one for every script that measures in fresh
processes): `spawn("benchmarks.decode:cells", spec, timeout)` runs
`python -m benchmarks.common --worker TARGET SPEC` in a new process at the
repository root; the worker imports TARGET's module, calls the function with
the decoded spec, and prints each row it returns (a dict, or an iterable of
dicts) as one line `RESULT <json>`, flushed at once, so the rows finished
before a crash, a timeout or an out-of-memory kill still come back.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = "RESULT "

# A 1B-class Llama with random weights (Llama-3.2-1B shapes).
LLAMA_1B = dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                ffn_dim=8192, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=True)


# ---------------------------------------------------------------------------
# Environment capture


def now():
    """The UTC time as ISO 8601, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def versions():
    """{distribution: version} of python and the installed numerical stack."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu", "torch",
                 "transformers", "numpy"):
        try:
            out[dist] = md.version(dist)
        except Exception:  # noqa: BLE001 - not installed
            pass
    return out


def cpu_model():
    """The CPU's model name (/proc/cpuinfo, else `platform`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_head():
    """The repository's HEAD commit, or None."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def environment():
    """The `kind: env` record: date, argv, CPU, versions, host and git commit."""
    env = dict(kind="env", date=now(), argv=sys.argv, cpu=cpu_model(), cpu_count=os.cpu_count(),
               versions=versions(), hostname=platform.node())
    head = git_head()
    if head is not None:
        env["git"] = head
    return env


def engine_sha():
    """Short hash of the engine's sources as this worker imports them (the engine evolves)."""
    import glob
    import hashlib

    h = hashlib.sha1()
    files = sorted(glob.glob(os.path.join(ROOT, "jaxsample", "engine", "*.py")))
    for name in files:
        with open(name, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:10] if files else None


def bandwidth(gib, repeats):
    """Best-of-`repeats` copy bandwidth (bytes read + written per second).

    numpy and jax copies of `gib` GiB of float32 (2 x bytes moved per copy:
    read + write); `bandwidth_bytes_per_s` is the jax figure, or the better
    of the two on CPU. Imports jax: call it in a worker.
    """
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


# ---------------------------------------------------------------------------
# Peak memory


class PeakRSS:
    """Polls the process RSS in a thread (psutil, else /proc/self/statm).

    `with PeakRSS() as rss: ...` leaves `rss.start` (bytes at entry) and
    `rss.peak` (the largest RSS seen, every `interval` seconds and at exit).
    """

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


def ru_maxrss_bytes():
    """This process's maximum RSS so far, bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_mem():
    """jax's `memory_stats()` of the first device ({} where it has none)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        stats = {}
    return stats


# ---------------------------------------------------------------------------
# The benchmark models and prompts


def prompt_ids(seed, P, vocab):
    """The same random prompt for every engine (ids in [16, vocab) skip control tokens)."""
    return np.random.default_rng([seed, P]).integers(16, vocab, size=P).tolist()


class NoEosTokenizer:
    """A view of a tokenizer with no eos ids, so no branch stops before T tokens."""

    eos_token_ids = ()

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def int8_without_outliers(lm):
    """`lm` (float, list layout) quantised as `load(weights="int8")` did before its
    outlier channels (`models.quantization.outliers`): every input channel through the int8 W8A8
    product. The baseline the outlier-channel benchmarks compare against."""
    import jax
    import jax.numpy as jnp

    from jaxsample.models.quantization import quant

    params = jax.tree_util.tree_map(jnp.asarray, quant.quantize_params(lm.params))
    return dataclasses.replace(lm, params=params)


# The 8B-class Llama (Llama-3.1-8B shapes, untied head).
LLAMA_8B = dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False)

INIT_STD = 0.02  # the random weights' standard deviation
INT8_STEPS = 42.0  # a random int8 weight's standard deviation in quantisation steps


def random_params(cfg, *, seed=0, weights=None):
    """Random parameters of `cfg` (any family) in the serving layout `load` returns
    (one dict per layer), made on the default device in seconds.

    Each leaf is drawn by a jitted program of its own shape (the model has a few
    distinct shapes, so a few small programs) from its own key, `fold_in(key(seed),
    leaf index)`: nothing is drawn on the host and no program holds every draw. Float
    leaves are N(0, `INIT_STD`) in the model's dtype, 1-D leaves (norm weights) ones.
    With `weights` ("int8" or "int8-weight-only"), the structure `load(weights=...)`
    makes (`quant.quantize_params(abstract=True)` with `outliers.abstract_channels`:
    fused projections, outlier channels, scales), filled the same way: q =
    round(N(0, `INT8_STEPS`)) clipped to +-127 with every scale `INIT_STD /
    INT8_STEPS` (the float draw's spread), the outlier channels evenly spaced and
    their float rows N(0, `INIT_STD`). The values mean nothing: speed only.

    Returns:
      The parameter pytree, its leaves on the default device.
    """
    import jax
    import jax.numpy as jnp

    from jaxsample.models.families import families
    from jaxsample.models.quantization import outliers, quant

    fam = families.module_for(cfg)
    shapes = jax.eval_shape(lambda: fam.unstack_layers(fam.init_params(cfg, jax.random.key(0))))
    if weights is not None:
        mode = {"int8": "w8a8", "int8-weight-only": "weight_only"}[weights]
        shapes = quant.quantize_params(shapes, compute=cfg.dtype, abstract=True, mode=mode,
                                       outliers=outliers.abstract_channels(shapes))
    is_q = lambda a: isinstance(a, quant.QuantizedWeight)  # noqa: E731
    leaves, tree = jax.tree_util.tree_flatten(shapes, is_leaf=is_q)
    base = jax.random.key(seed)
    draw = _drawer()
    out = []
    for i, a in enumerate(leaves):
        key = jax.random.fold_in(base, i)
        if not is_q(a):
            out.append(draw(key, tuple(a.shape), str(a.dtype), "normal" if a.ndim > 1 else "ones"))
            continue
        kept = None
        if a.outliers is not None:
            idx, keep, w = a.outliers
            kept = draw(key, (idx.shape[0], keep.shape[0], w.shape[1]), "float32", "outliers")
        out.append(quant.QuantizedWeight(
            draw(key, tuple(a.q.shape), "int8", "int8"),
            jnp.full(a.scale.shape, INIT_STD / INT8_STEPS, jnp.float32), kept, rows=a.rows,
            transposed=a.transposed, compute=a.compute, mode=a.mode))
    return jax.tree_util.tree_unflatten(tree, out)


@functools.lru_cache(maxsize=None)
def _drawer():
    """`random_params`' jitted draw of one leaf, `draw(key, shape, dtype, kind)` (its
    programs cached by shape, dtype and kind; jax imported on first use)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def draw(key, shape, dtype, kind):
        if kind == "ones":
            return jnp.ones(shape, dtype)
        if kind == "normal":
            return jax.random.normal(key, shape, jnp.dtype(dtype)) * jnp.asarray(INIT_STD, dtype)
        if kind == "int8":
            z = jnp.round(jax.random.normal(key, shape, jnp.float32) * INT8_STEPS)
            return jnp.clip(z, -127, 127).astype(jnp.int8)
        k, n_in, n_out = shape  # the outlier channels (idx, keep, w) of a QuantizedWeight
        idx = (jnp.arange(k) * (n_in // k)).astype(jnp.int32)
        keep = jnp.ones((n_in,), jnp.float32).at[idx].set(0.0)
        return idx, keep, jax.random.normal(key, (k, n_out), jnp.float32) * INIT_STD

    return draw


def load_jax_model(model, dtype, weights=None):
    """Returns (LanguageModel with a no-eos tokenizer, load seconds).

    model: "smollm2" (the embedded GGUF) or "llama-1b" (random weights of the
    `LLAMA_1B` shapes, byte tokenizer, in the serving layout `load` returns: one
    dict per layer). weights: None, or "int8" as `load(..., weights="int8")`
    makes it, in the time: for the random model, outlier channels calibrated
    over 256 random token ids (the speed of the shipped product; its accuracy
    means nothing) and `quant.quantize_params`.
    """
    import jax

    t0 = time.perf_counter()
    if model == "smollm2":
        from jaxsample.loading import load

        lm = load(None, dtype=dtype, weights=weights)
        lm = dataclasses.replace(lm, tokenizer=NoEosTokenizer(lm.tokenizer))
    elif model == "llama-1b":
        import numpy as np

        from jaxsample.lm import LanguageModel
        from jaxsample.models.checkpoints.tokenizer import ByteTokenizer
        from jaxsample.models.families import llama

        if weights not in (None, "int8", "int8-weight-only"):
            raise ValueError(f"unknown weights {weights!r}")
        cfg = llama.LlamaConfig(**LLAMA_1B, dtype=dtype)
        params = jax.block_until_ready(random_params(cfg))
        if weights in ("int8", "int8-weight-only"):
            import jax.numpy as jnp

            from jaxsample.models.quantization import outliers, quant

            tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 256, dtype=np.int32)
            kept = outliers.outlier_channels(outliers.channel_maxima(cfg, params, tokens))
            params = jax.tree_util.tree_map(
                jnp.asarray, quant.quantize_params(params, compute=dtype, outliers=kept,
                                                   mode="w8a8" if weights == "int8" else
                                                   "weight_only"))
        lm = LanguageModel(config=cfg, params=params, tokenizer=ByteTokenizer(cfg.vocab_size),
                           name="llama-1b-random", source="random")
    else:
        raise ValueError(f"unknown model {model!r}")
    jax.block_until_ready(lm.params)
    return lm, time.perf_counter() - t0


# ---------------------------------------------------------------------------
# The worker protocol


def emit(row):
    """Prints one result row of a worker (`RESULT <json>`, flushed)."""
    print(RESULT + json.dumps(row), flush=True)


@dataclasses.dataclass
class Ran:
    """What one worker process gave back.

    rows: the rows it printed; returncode: its exit status, or "timeout";
    stderr: its stderr (or "timeout after S s"); stdout: its stdout;
    wall_s: its wall time, seconds.
    """

    rows: list
    returncode: object
    stderr: str
    stdout: str
    wall_s: float


def spawn(target, spec, timeout, env=None, on_row=None):
    """Runs `target` ("package.module:function") on `spec` in a fresh process.

    The child is `python -m benchmarks.common --worker TARGET JSON` at the
    repository root, with `env` (default: this environment) plus
    XLA_PYTHON_CLIENT_PREALLOCATE=false (jax shares the device with a peer)
    and TF_CPP_MIN_LOG_LEVEL=2 unless set. `on_row(row)` is called for each row
    as the child prints it (a row finished before a crash or the timeout is never
    lost); the child is killed at `timeout` seconds. Returns a `Ran`.
    """
    import queue

    env = dict(os.environ if env is None else env)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "benchmarks.common", "--worker", target, json.dumps(spec)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT)
    lines: queue.Queue = queue.Queue()
    err: list[str] = []
    readers = [threading.Thread(target=lambda: [lines.put(x) for x in p.stdout] + [lines.put(None)],
                                daemon=True),
               threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)]
    for t in readers:
        t.start()
    out, rows, rc = [], [], None
    while True:
        try:
            line = lines.get(timeout=max(timeout - (time.perf_counter() - t0), 0.0))
        except queue.Empty:
            p.kill()
            rc = "timeout"
            break
        if line is None:
            break
        out.append(line)
        if line.startswith(RESULT):
            rows.append(json.loads(line[len(RESULT):]))
            if on_row is not None:
                on_row(rows[-1])
    p.wait()
    for t in readers:
        t.join(timeout=5)
    stderr = "".join(err)
    if rc == "timeout":
        stderr += f"\ntimeout after {timeout:.0f} s"
    else:
        rc = p.returncode
    return Ran(rows, rc, stderr, "".join(out), time.perf_counter() - t0)


def run_worker(target, spec):
    """The child's side of `spawn`: call the target, print its rows."""
    module, name = target.split(":")
    rows = getattr(importlib.import_module(module), name)(spec)
    for row in [rows] if isinstance(rows, dict) else (rows or ()):
        emit(row)


# ---------------------------------------------------------------------------
# Statistics and tables


def se(x, fewer=float("nan")):
    """Standard error of the mean (ddof 1; the binomial SE for 0/1 data); `fewer` below 2 samples."""
    x = np.asarray(x, np.float64)
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else fewer


def fmt(x, unit="", digits=3):
    """One table cell: "-" for None, MiB for unit "MiB", floats to `digits` significant."""
    if x is None:
        return "-"
    if unit == "MiB":
        return f"{x / 2**20:.0f}"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def md_table(header, rows):
    """Lines of a markdown table: the header, the `|---|` rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


if __name__ == "__main__":
    USAGE = ("usage: python -m benchmarks.common --worker PACKAGE.MODULE:FUNCTION SPEC_JSON\n"
             "(the worker side of benchmarks.common.spawn; not run by hand)")
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0)
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit(USAGE)
    from benchmarks.common import run_worker as _run  # the module the targets import, not __main__

    _run(sys.argv[2], json.loads(sys.argv[3]))
