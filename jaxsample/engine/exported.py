"""Exported programs on disk: a second process skips tracing and lowering.

JAX's persistent compilation cache (`disk_cache.enable_compilation_cache`,
`<cache dir>/xla/`) skips the XLA compile in a second process, but not the
Python work before it: tracing the model (a second for the 30-layer SmolLM2)
and lowering it to StableHLO. This module keeps each program's StableHLO
(`jax.export`) in `<cache dir>/exported/`, one file per program:

    <name>-<sha256 of the key text, 32 hex>.jaxexport
      MAGIC, 8-byte little-endian header length, a JSON header
      {"format", "key" (the key text), "out_tree" (the result's pytree,
      `encode_tree`), "payload_sha256", "payload_bytes"}, then the payload:
      `Exported.serialize()` of the program over its flattened arguments.

The key text (`entry_key`) is everything that changes the program: the
engine's static key (model config with its dtype, shapes and buckets, static
sampling settings, mesh; its `repr`, so a key whose `repr` names an object
address is never written), the arguments' abstract signature (pytree
structure, shapes, dtypes, weak types, shardings: a new kind of parameter
leaf such as int8 weights changes it by itself), the donated arguments, the
trace-time module constants (`TRACE_KNOBS`), the jax/jaxlib and jaxsample
versions, a SHA-256 of the library's source files (`source_digest`: any code
change invalidates every entry), the platform and the devices, and, for a
program with int8 arguments, the int8 CPU kernels' fingerprint
(`models.cpu_kernels.cpu_kernels`: their custom calls are in the program, registered by
any process whose key matches; `jax.export`'s check of custom-call targets is
lifted for those two only). A model's switches are in the key too: its
`cpu_kernels` through its int8 weights' static `QuantizedWeight.kernels` (the
arguments' pytree structure), its `prefix_kv_dtype` in the engine's static key.

A program is always built the same way when the exported cache is on:
exported first (traced and lowered once, written), then
`jit(exported.call, donate_argnums=...)` lowered and compiled; a second
process reads the file instead of tracing, so both processes lower the same
module and the compilation cache serves the second. The XLA program is the
model's own (the exported function is inlined), so tokens and logprobs equal
those of the plain `jit` path bit for bit (tests/engine/test_exported.py).
Donation is that of the outer `jit`: donated buffers are still reused.

An unreadable, truncated, corrupt or stale entry (its key text differs) is
ignored with one warning line on stderr (logger `jaxsample.disk_cache`) and
rewritten atomically (`disk_cache.atomic_write`). A program `jax.export`
cannot export is built the plain way (and not tried again in this process).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import pathlib
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxsample import disk_cache

FORMAT = 1

MAGIC = b"JAXSAMPLE-EXPORTED\n"

SUFFIX = ".jaxexport"

TRACE_KNOBS = ("jaxsample.models.families.flash", "jaxsample.models.families.moe",
               "jaxsample.models.families.common", "jaxsample.models.cpu_kernels.cpu_kernels",
               "jaxsample.engine.prefill", "jaxsample.engine.loop",
               "jaxsample.engine.state", "jaxsample.engine.sampling.select",
               "jaxsample.engine.sampling.logprobs", "jaxsample.bridge")
"""Modules whose public constants (upper-case ints, floats, strings, tuples) are
read while a program is traced (`flash.BLOCKWISE_FROM`, `select.TOP_CANDIDATES`,
...): their current values are part of every key, so a process that changed
one (a benchmark) never reads another's program."""

READ_EVENT = "/jaxsample/exported/read_duration"  # jax.monitoring: reading + deserialising
WRITE_EVENT = "/jaxsample/exported/export_duration"  # exporting + serialising + writing

_SOURCE_PACKAGES = ("jaxsample", "jaxsample.models")  # the second is the folder models/

_DIGEST: list[str] = []

log = logging.getLogger("jaxsample.disk_cache")


class Unsupported(Exception):
    """A program that is not written: its key is not stable across processes, or
    its result's pytree has a node `encode_tree` does not know."""


def available() -> bool:
    """Whether `jax.export` can serialize here (it needs the `flatbuffers` package,
    a dependency of jaxsample; without it the exported cache is off)."""
    return importlib.util.find_spec("flatbuffers") is not None


def source_digest() -> str:
    """SHA-256 (hex) of every `.py` file of the library's packages (paths and
    contents), computed once per process."""
    if not _DIGEST:
        h = hashlib.sha256()
        for pkg in _SOURCE_PACKAGES:
            mod = sys.modules.get(pkg) or importlib.import_module(pkg)
            root = pathlib.Path(mod.__file__).parent
            for p in sorted(root.rglob("*.py")):
                h.update(str(p.relative_to(root.parent)).encode() + b"\0")
                h.update(p.read_bytes() + b"\0")
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


def _knobs() -> list:
    out = []
    for name in TRACE_KNOBS:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for k, v in sorted(vars(mod).items()):
            if k.isupper() and isinstance(v, (int, float, str, tuple)):
                out.append((name, k, repr(v)))
    return out


def _leaf_sig(a) -> tuple:
    sharding = getattr(a, "sharding", None)
    return (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False)),
            None if sharding is None else repr(sharding))


def entry_key(key, args, donate) -> str:
    """The key text of a program: see the module docstring. Raises Unsupported
    when it is not stable across processes (the static key's `repr` or an
    argument's pytree node names an object address)."""
    static = repr(key)
    devices = jax.devices()
    material = {
        "format": FORMAT,
        "key": static,
        "in_tree": str(jax.tree_util.tree_structure(args)),
        "leaves": [_leaf_sig(a) for a in jax.tree_util.tree_leaves(args)],
        "donate": list(donate),
        "knobs": _knobs(),
        "x64": bool(jax.config.jax_enable_x64),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else "",
        "jaxsample": _version(),
        "source": source_digest(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "processes": jax.process_count(),
        "cpu_kernels": _kernels(args),
    }
    text = json.dumps(material, sort_keys=True, default=repr)
    if re.search(r" at 0x[0-9a-fA-F]+", text):  # the key or an argument's pytree node
        raise Unsupported("the key names an object address")
    return text


def _kernels(args) -> str:
    """The int8 CPU kernels' fingerprint when an argument is int8 (its program may call
    them: `models.cpu_kernels.cpu_kernels`), else "" (a float program never builds them);
    "off" for int8 weights whose model turned them off (`LanguageModel.cpu_kernels`: the
    `QuantizedWeight.kernels` of every one False, which the arguments' pytree
    structure in the key also says)."""
    if not any(getattr(a, "dtype", None) == jnp.int8 for a in jax.tree_util.tree_leaves(args)):
        return ""
    from jaxsample.models.cpu_kernels import cpu_kernels
    from jaxsample.models.quantization import quant

    weights = quant.quantized_weights(args)
    if weights and not any(w.kernels for w in weights):
        return "off"
    return cpu_kernels.fingerprint()


def _version() -> str:
    from jaxsample import __version__

    return __version__


def entry_path(directory: pathlib.Path, name: str, text: str) -> pathlib.Path:
    safe = re.sub(r"[^A-Za-z0-9_]+", "_", name)[:40] or "program"
    return directory / f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:32]}{SUFFIX}"


# -- result pytrees ------------------------------------------------------------

def encode_tree(treedef) -> Any:
    """A JSON value for a pytree structure of leaves, None, tuples, lists, dicts
    with string keys and jaxsample's NamedTuples (by module and name).
    Raises Unsupported for anything else."""
    if jax.tree_util.treedef_is_leaf(treedef):
        return "*" if treedef.num_leaves == 1 else ["None"]
    kind, aux = treedef.node_data()
    kids = [encode_tree(c) for c in treedef.children()]
    if kind is type(None):
        return ["None"]
    if kind is tuple:
        return ["tuple", kids]
    if kind is list:
        return ["list", kids]
    if kind is dict and all(isinstance(k, str) for k in aux):
        return ["dict", list(aux), kids]
    if (issubclass(kind, tuple) and hasattr(kind, "_fields")
            and kind.__module__.split(".")[0] == "jaxsample"):
        return ["namedtuple", kind.__module__, kind.__qualname__, kids]
    raise Unsupported(f"a result node of type {kind!r}")


def decode_tree(code) -> Any:
    """The pytree structure `encode_tree` wrote. Raises ValueError if malformed."""

    def build(c):
        if c == "*":
            return 0
        if not isinstance(c, list) or not c:
            raise ValueError("malformed tree")
        tag = c[0]
        if tag == "None":
            return None
        if tag in ("tuple", "list"):
            kids = [build(k) for k in c[1]]
            return tuple(kids) if tag == "tuple" else kids
        if tag == "dict":
            return dict(zip(c[1], (build(k) for k in c[2]), strict=True))
        if tag == "namedtuple":
            module, qualname = c[1], c[2]
            if module.split(".")[0] != "jaxsample":
                raise ValueError(f"a node type outside the library: {module}")
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
            if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
                raise ValueError(f"{module}.{qualname} is not a NamedTuple")
            return cls(*(build(k) for k in c[3]))
        raise ValueError(f"unknown tree tag {tag!r}")

    return jax.tree_util.tree_structure(build(code))


# -- entries -------------------------------------------------------------------

def write_entry(path: pathlib.Path, text: str, exp, out_tree) -> bool:
    """Write one entry atomically (False if the directory cannot be written)."""
    payload = bytes(exp.serialize())
    header = json.dumps({"format": FORMAT, "key": text, "out_tree": encode_tree(out_tree),
                         "payload_sha256": hashlib.sha256(payload).hexdigest(),
                         "payload_bytes": len(payload)}).encode()
    return disk_cache.atomic_write(path, MAGIC + len(header).to_bytes(8, "little") + header
                                   + payload)


def read_entry(path: pathlib.Path, text: str):
    """(Exported, result treedef) of the entry at `path`, or CacheMiss (CacheAbsent
    when there is none) for a file that is truncated, corrupt or stale."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # (a file where a folder should be)
        raise disk_cache.CacheAbsent("no entry") from None
    except OSError as e:
        raise disk_cache.CacheMiss(str(e)) from None
    m = len(MAGIC)
    if data[:m] != MAGIC or len(data) < m + 8:
        raise disk_cache.CacheMiss("not an exported program")
    n = int.from_bytes(data[m:m + 8], "little")
    if n > len(data) - m - 8:
        raise disk_cache.CacheMiss("truncated header")
    try:
        header = json.loads(data[m + 8:m + 8 + n])
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        if header.get("format") != FORMAT or header.get("key") != text:
            raise disk_cache.CacheMiss("stale (another key)")
        payload = data[m + 8 + n:]
        if (len(payload) != header.get("payload_bytes")
                or hashlib.sha256(payload).hexdigest() != header.get("payload_sha256")):
            raise disk_cache.CacheMiss("truncated or corrupt payload")
        out_tree = decode_tree(header["out_tree"])
        exp = jax.export.deserialize(bytearray(payload))
    except disk_cache.CacheMiss:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read it is a miss
        raise disk_cache.CacheMiss(f"cannot read it: {type(e).__name__}: {e}") from None
    return exp, out_tree


class FlatProgram:
    """A program compiled from an Exported over the flattened arguments; called
    like the compiled `jit` it replaces (same arguments, same result pytree)."""

    __slots__ = ("compiled", "out_tree")

    def __init__(self, compiled, out_tree):
        self.compiled, self.out_tree = compiled, out_tree

    def __call__(self, *args):
        return self.out_tree.unflatten(self.compiled(*jax.tree_util.tree_leaves(args)))


def _flat_donate(args, donate) -> tuple[int, ...]:
    out, start = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate:
            out.extend(range(start, start + n))
        start += n
    return tuple(out)


_UNWRITABLE: set = set()  # directories an entry could not be written to (said once)


def build(directory: pathlib.Path, key, fn, args, donate=(),
          compiler_options: dict | None = None) -> tuple[FlatProgram, bool]:
    """(program, whether its entry was read) for `fn(*args)`: the entry read
    and compiled, or `fn` exported, written, then compiled from the export,
    with `compiler_options` (XLA's, as the plain path compiles it: they change
    the executable, not the exported program, and JAX's compilation cache keys
    them). Raises Unsupported (nothing written) when the key is not stable or
    the program cannot be exported; the caller then builds it the plain way."""
    options = compiler_options or None
    text = entry_key(key, args, donate)
    path = entry_path(directory, str(key[0]) if isinstance(key, tuple) and key else "program",
                      text)
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    flat_donate = _flat_donate(args, donate)
    try:
        t0 = time.perf_counter()
        exp, out_tree = read_entry(path, text)
        jax.monitoring.record_event_duration_secs(READ_EVENT, time.perf_counter() - t0)
        prog = FlatProgram(jax.jit(exp.call, donate_argnums=flat_donate).lower(*leaves)
                           .compile(options), out_tree)
        return prog, True
    except disk_cache.CacheAbsent:
        pass
    except Exception as e:  # noqa: BLE001 - a corrupt, stale or unusable entry
        if disk_cache.in_the_way(path):
            disk_cache.warn_in_the_way("exported program", path)
        else:
            log.warning("jaxsample: warning: exported program %s is unusable (%s); ignored: "
                        "tracing it again and rewriting it", path,
                        " ".join(str(e).split())[:200])
    trees = []

    def flat(*xs):
        out = fn(*in_tree.unflatten(xs))
        out_leaves, tree = jax.tree_util.tree_flatten(out)
        trees.append(tree)
        return out_leaves

    t0 = time.perf_counter()
    try:
        from jaxsample.models.cpu_kernels import cpu_kernels

        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in cpu_kernels.TARGETS]
        exp = jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
        encode_tree(trees[-1])
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001 - not exportable: the plain path
        raise Unsupported(f"jax.export: {type(e).__name__}: {e}") from None
    if (not write_entry(path, text, exp, trees[-1]) and not path.is_dir()  # (said above)
            and directory not in _UNWRITABLE):
        _UNWRITABLE.add(directory)  # one line per directory and process
        log.warning("jaxsample: warning: exported programs not written to %s (cannot write "
                    "there); traced again by the next process", directory)
    jax.monitoring.record_event_duration_secs(WRITE_EVENT, time.perf_counter() - t0)
    prog = FlatProgram(jax.jit(exp.call, donate_argnums=flat_donate).lower(*leaves)
                       .compile(options), trees[-1])
    return prog, False
