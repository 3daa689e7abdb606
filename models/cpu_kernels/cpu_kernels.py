"""The int8 decode's CPU kernels as XLA FFI custom calls, built on first use.

The sources: `cpu_kernels.cc` (the int8 and float x int8 products),
`cpu_w8a8.cc` (W8A8's whole product), `cpu_attention.cc` (the attention) and
`cpu_kernels.h` (what they share), compiled into one library.

Three products, each `x [M, K]` against an int8 weight stored `[N, K]` (a
`QuantizedWeight` with `transposed=True`, the layout `quant.quantize_params`
writes), and the decode step's attention over the shared prefix:

* `int8_dot(xq, q)`: int8 x int8 -> int32 `[M, N]`, the core of W8A8's
  product. Exact, so it equals `lax.dot_general` bit for bit whatever the
  kernel's order. On a CPU with AVX-512 VNNI it runs one `vpdpbusd` per 64 byte
  products (x offset to unsigned, the offset taken off with the weight row's
  sum), else AVX2's sign trick; `isa()` says which, `use_isa` picks one (the
  same bits).
* `w8a8_dot(x, q, scale, kept)`: W8A8's product in one call, what `quant`
  runs: x float32 quantised per row, `int8_dot`'s loop, the rescale and the
  float channels kept apart, the steps of `quant.w8a8_expression` (bit for bit
  without kept channels). One custom call instead of 6-8 XLA ops per product:
  the programs are smaller, so a warm start fetches and compiles them faster
  (docs/benchmarks.md, "Int8 weights"; benchmarks/step_ablation.py's
  `unfused_w8a8` variant).
* `f32_int8_dot(x, q)`: float32 x int8 -> float32 `[M, N]`, weight-only int8's
  product, summed in an order fixed by K alone (a row's result does not depend
  on M or on the other rows: batch-invariant).
* `segment_attention(q, k, v, mask)`: queries `[H, Q, D]` float32 over one
  segment of keys `[H, M, D]` (float32, or float16: a W8A8 model's prefix,
  `engine.state.prefix_kv_dtype`) that every query sees alike (`mask [M]`), the
  core of `common.partial_attention`: scores, softmax and the product with V in
  one pass per (head, 8 queries, 256 keys), merged by log-sum-exp (split-K,
  as flash-decoding). The int8 decode step's prefix attention
  (`engine.prefix_attention`): XLA CPU runs its two batched dots far below
  its large-GEMM rate (docs/ARCHITECTURE.md, "Attention over a shared
  prefix"). The float32 model keeps XLA's (its tokens stay bit-identical).

Why (docs/benchmarks.md, "Against llama.cpp on CPU" and "Int8 weights";
benchmarks/quantized.py): XLA CPU (jaxlib 0.10.2) runs a small-M int8 x int8
dot through its int8 GEMM at a fixed cost per product that dominates at
decode sizes on an AVX2 CPU, lowers a one-row one to a loop over an int32
copy of the weight, and gives a float x int8 dot a float32 copy of the weight
each call. The kernels read each weight row once for all M rows, on the intra-op
thread pool.

Built on first use in a process that runs an int8 model: `$CXX` (default
`c++`) compiles the source against the installed jaxlib's FFI headers
(`jax.ffi.include_dir()`, a few seconds) into the cache directory's
`kernels/` (`cpu_kernels-<key>.so`, key = SHA-256 of the source, the command
and jaxlib's version; a `.sha256` beside it is checked before loading), or a
temporary directory when the caches are off. The loaded library must pass a
self-test against numpy before it is used. Where any of this fails (no
compiler, not x86-64 with AVX2), one log line says why and the products stay
XLA's `dot_general`: same results (bit for bit for W8A8), slower. Where JAX's
default backend is not the CPU (a GPU, a TPU) nothing is built and the
programs keep `dot_general` (`active()`).

Which models use them is each model's choice, `LanguageModel.cpu_kernels`
("auto" or "off", `CHOICES`), carried to the traced code by its int8 weights
(`quant.QuantizedWeight.kernels`): this module only says whether they can run
in this process. `JAXSAMPLE_CPU_KERNELS=0` (`ENV`) keeps them unbuilt for the
whole process, overriding "auto" (`override`: `jaxsample.loading.load_info`
reports it and the load logs it); `avx2` caps the int8 product's instruction
set (`isa`).

Reference: the AVX2 int8 dot is ggml's sign trick (llama.cpp, ggml-cpu); the
VNNI one the unsigned-offset form of oneDNN's u8 x s8 GEMMs; the FFI is XLA's
typed custom-call API (`jax.ffi`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxsample import cache_paths

CHOICES = ("auto", "off")
"""A model's `cpu_kernels` (`LanguageModel.cpu_kernels`, carried to the traced code by
its int8 weights, `quant.QuantizedWeight.kernels`): "auto" runs its products (and a
W8A8 model's prefix attention) as these kernels where `active()`, "off" keeps XLA's
`dot_general` in this model's programs whatever the process has built."""

ENV = "JAXSAMPLE_CPU_KERNELS"
"""The process's override of every model's `cpu_kernels`: 0 / false / no / off keeps XLA's
dot_general (the A/B of the benchmarks) even for a model whose field is "auto" (which
changes its numerics: `override`), avx2 keeps the kernels but not their AVX-512 VNNI int8
product (`isa`: the same results bit for bit)."""
ISAS = ("avx2", "avx512-vnni")
"""The int8 product's instruction sets, by level (`isa`, `use_isa`)."""

SOURCES = tuple(pathlib.Path(__file__).with_name(n)
                for n in ("cpu_kernels.cc", "cpu_w8a8.cc", "cpu_attention.cc"))
HEADER = pathlib.Path(__file__).with_name("cpu_kernels.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-shared", "-fPIC")
TARGETS = ("jaxsample_int8_dot", "jaxsample_f32_int8_dot", "jaxsample_segment_attention",
           "jaxsample_segment_attention_f16", "jaxsample_w8a8_dot")
MAX_ROWS = 64
"""On AVX2, int8 x int8 products of more rows (a prefill) stay `dot_general`: XLA
CPU's int8 GEMM is as fast there, and reads the int8 weight as it is. On AVX-512 VNNI
the kernel takes every M: its 4 x 4 register tile measures faster than XLA's int8
GEMM on SmolLM2's prefill shapes from M = 257 to 8192. The float32 x int8 product
keeps the kernel at any M, though XLA's float GEMM is faster from about 64 rows:
XLA's path first writes a float32 copy of each weight, which multiplies the
prefill's peak memory to save a small part of its time."""

log = logging.getLogger("jaxsample.cpu_kernels")

_STATE: dict[str, str] = {}  # "status": "on" | the reason it is off; "key"
_LIB: list[ctypes.CDLL] = []  # the loaded library, once enabled()
_CAP: list[int] = []  # the highest ISAS level in use: this CPU's best, or the environment's cap
_ISA_LOCK = threading.RLock()  # one use_isa block at a time (the level is the process's)
_ON = ("", "1", "on", "true", "yes")  # ENV values that keep the kernels on at the best ISA


def _env_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def override(choice: str) -> str | None:
    """What `JAXSAMPLE_CPU_KERNELS` overrides of a model whose `cpu_kernels` is `choice`
    (one of `CHOICES`), as one sentence naming the variable, or None when it overrides
    nothing: set to 0 (or off, false, no) it turns off the kernels that "auto" would
    run, so the model's int8 products are XLA's and a W8A8 model's prefix KV stays
    float32 (`engine.state.prefix_kv_dtype`): other numerics than the field asks for.
    The variable is read once per process, when the kernels are first built (`enabled`,
    called here): set later it overrides nothing. The ISA cap (avx2) changes no result
    and overrides no field: `isa` says it."""
    if choice == "auto" and not enabled() and _STATE["status"].startswith(f"{ENV}="):
        return (f"{_STATE['status']} overrides cpu_kernels='auto': the int8 products "
                "run as XLA's dot_general and a W8A8 model's prefix KV stays float32")
    return None


def _off_reason() -> str | None:
    if _env_off():
        return f"{ENV}={os.environ[ENV]}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    return None


def _compiler() -> list[str] | None:
    """`$CXX` split as a shell would (default `c++`), or None when not found.
    Raises ValueError for a `$CXX` a shell could not split."""
    try:
        cxx = shlex.split(os.environ.get("CXX", "").strip() or "c++")
    except ValueError as e:
        raise ValueError(f"CXX={os.environ.get('CXX')!r}: {e}") from None
    return cxx if cxx and shutil.which(cxx[0]) else None


def _key(cxx: list[str]) -> str:
    h = hashlib.sha256()
    sources = [f.read_bytes() for f in (*SOURCES, HEADER)]
    for part in (*sources, " ".join(cxx + list(FLAGS)).encode(),
                 jax.lib.__version__.encode() if hasattr(jax.lib, "__version__") else b""):
        h.update(part + b"\0")
    return h.hexdigest()[:32]


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _build(cxx: list[str], out: pathlib.Path) -> None:
    """Compile SOURCES to `out` (through a temporary file renamed over it) and write
    `out.sha256`. Raises OSError or RuntimeError (the compiler's last line)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [*cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            lines = [ln for ln in r.stderr.splitlines() if "error" in ln] or r.stderr.splitlines()
            raise RuntimeError(f"{cxx[0]} failed: {(lines or ['no output'])[0][:200]}")
        os.chmod(tmp, 0o755)  # readable by whoever shares the cache directory
        digest = _sha256(pathlib.Path(tmp))
        os.replace(tmp, out)
        out.with_suffix(".sha256").write_text(digest + "\n")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _library(cxx: list[str], key: str) -> ctypes.CDLL:
    """The built library, from the cache when its checksum holds, else built again."""
    base = cache_paths.cache_dir()
    if base is not None:
        so = base / "kernels" / f"cpu_kernels-{key}.so"
        with contextlib.suppress(OSError):
            if (so.is_file() and so.with_suffix(".sha256").is_file()
                    and so.with_suffix(".sha256").read_text().strip() == _sha256(so)):
                return ctypes.CDLL(str(so))
        try:
            _build(cxx, so)
            return ctypes.CDLL(str(so))
        except OSError:
            pass  # not writable: build in a temporary directory instead
    with tempfile.TemporaryDirectory(prefix="jaxsample-kernels-") as d:
        so = pathlib.Path(d) / f"cpu_kernels-{key}.so"
        _build(cxx, so)
        return ctypes.CDLL(str(so))  # stays mapped after the directory is removed


def _self_test() -> None:
    """Both products on small shapes (a K tail, an N tail, M = 1 and 3) and the
    attention (float32 and float16 keys) against numpy; raises RuntimeError on a
    difference beyond float32 summation's bound (K * 2^-24 * sum |x w|; the attention:
    1e-5 at unit scale)."""
    # On a thread of its own: the first call may come while a program traces or inside
    # `jax.set_mesh`, and JAX keeps both per thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(_check_on_cpu, np.random.default_rng(0), jax.devices("cpu")[0]).result()


def _check_on_cpu(rng, cpu) -> None:
    for M, K, N in ((1, 100, 37), (3, 576, 70), (5, 130, 9)):  # 5: VNNI's 4-row tile + 1
        x8, w, xf = (rng.integers(-127, 128, (M, K), dtype=np.int8),
                     rng.integers(-127, 128, (N, K), dtype=np.int8),
                     rng.standard_normal((M, K)).astype(np.float32))
        on_cpu = jax.device_put((x8, w, xf), cpu)
        got8 = np.asarray(jax.jit(_int8_kernel)(on_cpu[0], on_cpu[1]))
        gotf = np.asarray(jax.jit(_f32_kernel)(on_cpu[2], on_cpu[1]), np.float64)
        if not np.array_equal(got8, x8.astype(np.int64) @ w.T.astype(np.int64)):
            raise RuntimeError("self-test: the int8 product differs from numpy")
        want = xf.astype(np.float64) @ w.T.astype(np.float64)
        bound = K * 2.0**-24 * (np.abs(xf).astype(np.float64) @ np.abs(w.T).astype(np.float64))
        if not np.all(np.abs(gotf - want) <= bound):
            raise RuntimeError("self-test: the float32 x int8 product differs from numpy")
        _check_w8a8(rng, cpu, xf, w)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((2, 9, 16), (2, 300, 16), (2, 300, 16)))  # a chunk tail, a query block tail
    mask = np.arange(300) % 7 != 3
    for dtype in (np.float32, np.float16):  # float16 k, v: the exact widening of their values
        k, v = k.astype(dtype), v.astype(dtype)
        out, lse = jax.jit(_attention_kernel)(*jax.device_put((q, k, v, mask), cpu))
        s = np.where(mask, np.einsum("hqd,hmd->hqm", q, k, dtype=np.float64), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hqm,hmd->hqd", p, v.astype(np.float64)) / p.sum(-1)[..., None]
        want_lse = np.log(p.sum(-1)) + s.max(-1)
        if not (np.allclose(out, want, rtol=0, atol=1e-5)
                and np.allclose(lse, want_lse, atol=1e-5)):
            raise RuntimeError(f"self-test: the segment attention ({np.dtype(dtype).name} "
                               "keys) differs from numpy")


def _check_w8a8(rng, cpu, x, w) -> None:
    """`_w8a8_kernel` against numpy's float64 of the same steps, two channels kept apart:
    the int8 part is exact, so the only difference is the float32 rounding of the
    rescale and of the two-term sum (a few ulp of |y|)."""
    M, K = x.shape
    idx = np.array([0, K - 1], np.int32)
    keep = np.ones(K, np.float32)
    keep[idx] = 0.0
    scale = rng.uniform(0.5, 2.0, w.shape[0]).astype(np.float32)
    w_out = rng.standard_normal((2, w.shape[0])).astype(np.float32)
    got = np.asarray(jax.jit(_w8a8_kernel)(*jax.device_put((x, w, scale, idx, keep, w_out), cpu)))
    xf = x * keep  # the kernel's steps in float32: its divisions are reciprocal products
    sx = np.abs(xf).max(1, keepdims=True) * np.float32(1 / 127)
    xq = np.clip(np.rint(xf * (np.float32(1) / sx)), -127, 127).astype(np.int64)
    want = ((xq @ w.T.astype(np.int64)) * sx.astype(np.float64) * scale
            + x[:, idx].astype(np.float64) @ w_out)
    if not np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()):
        raise RuntimeError("self-test: the W8A8 product differs from numpy")


def enabled() -> bool:
    """Whether the kernels are built, registered and passed their self-test in this
    process (the first call builds or loads them; later calls are free). False
    with one log line saying why where they cannot be."""
    if "status" not in _STATE:
        reason = _off_reason()
        if reason is None:
            try:  # anything that goes wrong turns them off: never an error of a product
                cxx = _compiler()
                if cxx is None:
                    given = os.environ.get("CXX", "").strip()
                    raise RuntimeError(f"no C++ compiler at CXX={given!r}" if given else
                                       "no C++ compiler (c++ not found; set CXX)")
                key = _key(cxx)
                lib = _library(cxx, key)
                if not lib.jaxsample_int8_cpu_supported():
                    raise RuntimeError("this CPU lacks AVX2, FMA or F16C")
                for name in TARGETS:
                    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)),
                                                platform="cpu")
                lib.jaxsample_set_isa.restype = ctypes.c_int
                lib.jaxsample_set_isa.argtypes = (ctypes.c_int,)
                _LIB[:] = [lib]
                best = lib.jaxsample_set_isa(len(ISAS))  # as high as this CPU goes
                value = os.environ.get(ENV, "").strip().lower()
                if value not in ISAS + _ON:
                    log.warning("jaxsample: warning: %s=%s is not one of 0, off, %s or 1: the "
                                "kernels stay on", ENV, os.environ[ENV], ", ".join(ISAS))
                _CAP[:] = [min(best, ISAS.index(value)) if value in ISAS else best]
                for level in range(_CAP[0] + 1):  # every instruction set the kernels may run
                    with use_isa(ISAS[level]):
                        _self_test()
                lib.jaxsample_set_isa(_CAP[0])
                _STATE["key"] = key
            except Exception as e:  # noqa: BLE001 - see above
                _LIB.clear()
                _CAP.clear()
                reason = " ".join(str(e).split())[:240] or type(e).__name__
                if isinstance(e, AttributeError):  # a library without our symbols
                    reason += "; `jaxsample cache clear --kernels` rebuilds them"
        _STATE["status"] = "on" if reason is None else reason
        if reason is not None and not _env_off():
            log.warning("jaxsample: warning: int8 CPU kernels off (%s); int8 products run "
                        "as XLA's dot_general, slower", reason)
    return _STATE["status"] == "on"


_LEVEL = -1  # jaxsample_set_isa's "no change"


def isa() -> str | None:
    """The instruction set the int8 product runs now (an `ISAS` name: AVX-512 VNNI where
    the CPU has it, unless `JAXSAMPLE_CPU_KERNELS=avx2`), or None when the kernels are
    off. Results are the same bit for bit on every one for x in [-127, 127] (exact int32
    sums; AVX2's sign trick cannot take x = -128, which W8A8's clipping never makes)."""
    return ISAS[_LIB[0].jaxsample_set_isa(_LEVEL)] if enabled() else None


@contextlib.contextmanager
def use_isa(name: str):
    """Within the block, calls of the int8 product (compiled programs included: the
    choice is made when a call runs) run on instruction set `name` (one of `ISAS`), or
    the highest below it that this CPU has and `JAXSAMPLE_CPU_KERNELS` allows. The
    setting is the process's: blocks in other threads wait for this one to end (nested
    blocks in one thread do not). JAX dispatches asynchronously, so wait for the
    results inside the block (`jax.block_until_ready`, `np.asarray`). Which products
    call the kernel at all is fixed when a program is traced (`uses_int8_kernel`: on
    VNNI the prefill's too): a program traced under VNNI and run in an AVX2 block runs
    its prefill on the AVX2 loop, not XLA's GEMM (the same results, slower), so an A/B
    of prefills traces each ISA's programs afresh. For tests and
    A/B benchmarks. Raises ValueError for another name, RuntimeError where the kernels
    cannot load (`enabled()` is False)."""
    if name not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {name!r}")
    if not _LIB and "status" not in _STATE:
        enabled()  # load them (inside enabled() itself _LIB is already set)
    if not _LIB:
        raise RuntimeError(f"the CPU kernels are off ({_STATE.get('status')})")
    lib = _LIB[0]
    with _ISA_LOCK:
        before = lib.jaxsample_set_isa(_LEVEL)
        lib.jaxsample_set_isa(min(ISAS.index(name), _CAP[0]))
        try:
            yield
        finally:
            lib.jaxsample_set_isa(before)


def active() -> bool:
    """Whether a program traced now calls the kernels: `enabled()` and JAX's default
    backend is the CPU (on a GPU or TPU the products stay `dot_general`)."""
    return jax.default_backend() == "cpu" and enabled()


def fingerprint() -> str:
    """What the traced programs depend on: "off", or the kernels' key and `isa()` (the
    exported programs' cache keys carry it, so no process reads a program whose custom
    calls it has not registered, or whose prefill was routed for another ISA)."""
    return f"{_STATE['key']}:{isa()}" if active() else "off"


def _call(target, dtype, x, w):
    """The custom call `x [M, K], w [N, K] -> [M, N]`. Vmapped, x gains leading axes and
    w leading ones of size 1 (or its own batch), and the kernel runs every batch's rows
    against one weight in one pass (`quant` also folds the engine's vmapped axes into
    M before an int8 product, for its per-row activation scales)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), dtype)
    return jax.ffi.ffi_call(target, out, vmap_method="expand_dims")(x, w)


def _int8_kernel(x, w):
    return _call(TARGETS[0], jnp.int32, x, w)


def _f32_kernel(x, w):
    return _call(TARGETS[1], jnp.float32, x, w)


def _xla(x, w, out_dtype):
    w = w if x.dtype == w.dtype else w.astype(x.dtype)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=out_dtype)


def uses_attention_kernel(q: jax.Array, k: jax.Array, v: jax.Array, scale=None) -> bool:
    """Whether `segment_attention` runs the kernel for queries `q [..., D]` over keys
    `k` and values `v`: `active()`, q float32, k and v both float32 or both float16
    (a W8A8 model's prefix, `engine.state.prefix_kv_dtype`), D a multiple of 8
    and no score soft-cap (a `common.SoftCappedScale`)."""
    return (q.dtype == jnp.float32 and k.dtype == v.dtype
            and k.dtype in (jnp.float32, jnp.float16) and q.shape[-1] % 8 == 0
            and getattr(scale, "softcap", None) is None and active())


def _attention_xla(q, k, v, mask):
    """The XLA expression of `segment_attention` (its fallback and its jvp); float16
    keys and values are widened to float32 first."""
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    s = jnp.einsum("kqd,kmd->kqm", q, k, preferred_element_type=jnp.float32)
    s = jnp.where(mask[None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("kqm,kmd->kqd", p, v, preferred_element_type=jnp.float32) / safe
    return out, jnp.where(denom > 0, jnp.log(safe) + m, -jnp.inf)[..., 0]


def _attention_kernel(q, k, v, mask):
    H, Q, D = q.shape
    out = (jax.ShapeDtypeStruct((H, Q, D), jnp.float32), jax.ShapeDtypeStruct((H, Q), jnp.float32))
    target = TARGETS[3] if k.dtype == jnp.float16 else TARGETS[2]
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(q, k, v, mask)


@jax.custom_jvp
def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """Attention of queries over one segment of keys that all of them see alike.

    Args:
      q: `[H, Q, D]` float32, scaled (the scores are `q . k`); H kv heads, the
        Q queries of each head (its query heads x branches x positions).
      k, v: `[H, M, D]` float32, or both float16 (each element widened to float32
        exactly as it is read: half the bytes of a float32 prefix).
      mask: `[M]` bool, the keys visible to every query.
    Returns:
      (out `[H, Q, D]` float32 softmax(q k^T) v over the visible keys, lse
      `[H, Q]` float32 the log-sum-exp of their scores; out 0 and lse -inf
      where no key is visible), as `common.partial_attention`. Within float32
      rounding of the exact result (its exp is within a few ulp); not bit-equal
      to XLA's. The kernel where `uses_attention_kernel`, else XLA's expression;
      differentiable (the tangent is XLA's expression's).
    """
    if not uses_attention_kernel(q, k, v):
        return _attention_xla(q, k, v, mask)
    return _attention_kernel(q, k, v, mask)


@segment_attention.defjvp
def _segment_attention_jvp(primals, tangents):
    q, k, v, mask = primals
    dq, dk, dv, _ = tangents
    _, tangent = jax.jvp(lambda a, b, c: _attention_xla(a, b, c, mask), (q, k, v), (dq, dk, dv))
    return _vary_like(segment_attention(q, k, v, mask), tangent), tangent


def _w8a8_kernel(x, w, scale, idx, keep, w_out):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[4], out, vmap_method="sequential")(
        x, w, scale, idx, keep, w_out)


def w8a8_dot(x: jax.Array, w: jax.Array, scale: jax.Array, kept=None) -> jax.Array:
    """W8A8's product in one call: `x float32 [M, K]` quantised per row to int8, times
    `w int8 [N, K]^T` (int32, exact), rescaled by the row's scale and `scale [N]`;
    `kept` None or `(idx int32 [J], keep float32 [K], w_out float32 [J, N])`, the input
    channels kept in float (`quant.QuantizedWeight.outliers`). Returns float32 `[M, N]`:
    `quant._w8a8_rows`' XLA expression, bit for bit without kept channels and within
    float32 rounding of their J-term sum with them (cpu_w8a8.cc). Callers check
    `uses_int8_kernel(M, K)` first; not differentiable (quant's custom_vjp is).

    Raises:
      ValueError: a shape or dtype other than the above (when traced)."""
    if x.ndim != 2 or x.dtype != jnp.float32 or w.ndim != 2 or w.dtype != jnp.int8:
        raise ValueError(f"w8a8_dot: needs x float32 [M, K] and w int8 [N, K], got x "
                         f"{x.dtype}{list(x.shape)} and w {w.dtype}{list(w.shape)}")
    (M, K), N = x.shape, w.shape[0]
    idx, keep, w_out = kept if kept is not None else (
        jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32), jnp.zeros((0, N), jnp.float32))
    J = idx.size
    if (w.shape[1] != K or scale.size != N or idx.ndim != 1 or keep.size != (K if J else 0)
            or w_out.shape != (J, N)):
        raise ValueError(f"w8a8_dot: needs w [N, K], scale [N], idx [J], keep [K] and w_out "
                         f"[J, N] for x [M, K] = {[M, K]}, got w {list(w.shape)}, scale "
                         f"{list(scale.shape)}, idx {list(idx.shape)}, keep {list(keep.shape)}, "
                         f"w_out {list(w_out.shape)}")
    y = _w8a8_kernel(x, w, scale.reshape(N).astype(jnp.float32), idx.astype(jnp.int32),
                     keep.reshape(-1).astype(jnp.float32), w_out.astype(jnp.float32))
    return _varying_as(y, x, w)


def uses_int8_kernel(m: int, k: int) -> bool:
    """Whether `int8_dot` of an `[m, k]` x runs the kernel: `active()`, m <= MAX_ROWS
    or the int8 product runs on AVX-512 VNNI (`isa()` when the program is traced: on
    AVX2 the prefill stays XLA's GEMM), and k < 2^17 (the kernel's int32 sums' bound)."""
    return k < 2**17 and active() and (m <= MAX_ROWS or isa() == "avx512-vnni")


def int8_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x int8 [M, K] . w int8 [N, K]^T -> int32 [M, N]`, exact for x in [-127, 127]
    (W8A8's activations) and any w: the kernel where `uses_int8_kernel(M, K)`, else
    `lax.dot_general`. Not differentiable (integers)."""
    if not uses_int8_kernel(*x.shape):
        return _xla(x, w, jnp.int32)
    return _int8_kernel(x, w)


@jax.custom_jvp
def f32_int8_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x float32 [M, K] . float(w int8 [N, K])^T -> float32 [M, N]`: the kernel on CPU
    when `active()` (at any M), else `lax.dot_general` of x and
    `w.astype(float32)`."""
    if not active():
        return _xla(x, w, jnp.float32)
    return _f32_kernel(x, w)


def _varying_as(out, *ins):
    """`out` marked as varying over every mesh axis any of `ins` varies over: inside a
    `shard_map` (check_vma) a custom call's result carries no varying axes, though it
    was computed from sharded inputs (and a psum of an unvarying value would count it
    once per device)."""
    varying = lambda a: getattr(getattr(jax.typeof(a), "mat", None), "varying",  # noqa: E731
                                frozenset())
    extra = tuple(sorted(frozenset().union(*map(varying, ins)) - varying(out), key=str))
    return jax.lax.pcast(out, extra, to="varying") if extra else out


def _vary_like(primal, tangent):
    """`primal` marked as varying over the mesh axes `tangent` varies over (leaf by
    leaf): a custom_jvp rule's primal and tangent types must agree, and the tangent,
    computed by XLA from the sharded inputs, varies where the custom call's result does
    not (`_varying_as`)."""
    return jax.tree_util.tree_map(_varying_as, primal, tangent)


@f32_int8_dot.defjvp
def _f32_int8_dot_jvp(primals, tangents):
    """Linear in x: the tangent is XLA's `dx . float(w)^T` (differentiable both ways:
    jvp, and grad by its transpose); w is int8 and has no tangent."""
    x, w = primals
    tangent = _xla(tangents[0], w, jnp.float32)
    return _vary_like(f32_int8_dot(x, w), tangent), tangent
