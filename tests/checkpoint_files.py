"""Checkpoint files bent on purpose: GGUF files rewritten with other keys or tensors,
weight-cache entries corrupted or poisoned in place, and a load that keeps nothing
in the per-process model cache.

Imported as `checkpoint_files` (tests/ is on sys.path, as for `helpers`).
"""

from __future__ import annotations

import json
import os
import pathlib

import gguf
import numpy as np

from jaxsample import loading
from jaxsample.models.checkpoints import registry


def rewrite_gguf(src: pathlib.Path, dst: pathlib.Path, *, arch=None, drop=(), kv=None, tensors=None,
                 set_kv=None):
    """Copy a GGUF file, changing its architecture, dropping tensors or adding keys/tensors.

    set_kv: key -> None (drop the key), (value, GGUFValueType) or (value, ARRAY, item type):
    replaces existing keys in place.
    """
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old_arch)
    set_kv = dict(set_kv or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in set_kv:
            new = set_kv.pop(key)
            if new is not None:
                w.add_key_value(key, *new)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for key, new in set_kv.items():  # keys the file did not have
        if new is not None:
            w.add_key_value(key, *new)
    for key, (value, vtype) in (kv or {}).items():
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, a in (tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def corruptions():
    def truncate(p):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    def garbage(p):
        p.write_bytes(b"\x00" * 8 + b"not a safetensors file")

    def empty(p):
        p.write_bytes(b"")

    def header_json(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        p.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])

    def wrong_shape(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [1] + header[name]["shape"]
        header[name]["data_offsets"] = header[name]["data_offsets"]  # now inconsistent
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    def bad_tokenizer(p):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header["__metadata__"]["tokenizer"] = "{not json"
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    def negative_shape(p):  # the element count still matches: (-8) x (-8) = 64
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name, spec = next((k, v) for k, v in header.items()
                          if k != "__metadata__" and len(v["shape"]) == 1)
        size = spec["shape"][0]
        root = int(round(size ** 0.5))
        spec["shape"] = [-root, -(size // root)] if root * (size // root) == size else [-1, -size]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    def config_edit(p):  # still valid JSON and a valid config: only meta_sha256 tells
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        cfg = json.loads(header["__metadata__"]["config"])
        cfg["norm_eps"] = cfg["norm_eps"] * 10
        header["__metadata__"]["config"] = json.dumps(cfg, sort_keys=True)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        p.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])

    return [truncate, garbage, empty, header_json, wrong_shape, bad_tokenizer, negative_shape,
            config_edit]


def rewrite_in_place(path, offset, data):
    """Overwrite bytes of a file, keeping its size, atime and mtime (cp -p, rsync -t)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns


def poison_entry(entry, nbytes=4096):
    """4 KiB of 0xFF inside the largest tensor's bytes (float32 NaNs), size kept."""
    raw = entry.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__")
    lo, hi = max((v["data_offsets"] for v in header.values()), key=lambda o: o[1] - o[0])
    assert hi - lo > 2 * nbytes
    rewrite_in_place(entry, 8 + n + lo + 1024, b"\xff" * nbytes)


def load_uncached(name_or_path, dtype="float32"):
    """`jaxsample.load` without its per-process cache.

    The same code path (name -> registry path -> loader -> serving layout), but
    nothing is kept: this module loads many checkpoints, and filling the
    4-entry cache would evict the embedded SmolLM2 that later test modules
    expect `load()` to return from it.
    """
    name = str(name_or_path).lower()
    base = loading._cache_base(None)  # the weight cache, as load() uses it
    if name in registry.EMBEDDED_MODELS:
        return loading._load_uncached(str(registry.embedded_path(name)), 0, dtype, name, base)
    path = pathlib.Path(name_or_path).resolve()
    return loading._load_uncached(str(path), 0, dtype, None, base)
