"""The loader core: one config reader and one tensor-copy loop for every family and format.

A checkpoint is read in three steps, the same for GGUF files and Hugging
Face directories:

1. the *config reader* (`ConfigReader`) answers the values the file
   declares (GGUF metadata `ARCH.key`, or config.json keys), each validated
   by `models.checkpoints.checks` (type and range) with a one-line `ModelLoadError` that
   names the file and the key;
2. the family's *config mapping* (a function of the family's loader module:
   `models.checkpoints.llama_loader`, `models.checkpoints.gemma3_loader`) turns those values into
   its config (`LlamaConfig`, `Gemma3Config`);
3. the *tensor-copy loop* (`copy_tensors`) walks the file's tensors through
   the family's *tensor table* (`TensorTable`: file name -> params key,
   transposed or not, split when fused, with an optional per-tensor
   transform such as llama.cpp's RoPE row permutation) into the stacked
   `[in, out]` params pytree of the family's `param_shapes`, and refuses
   unknown, missing, misshapen and non-finite tensors.

Each family declares one `Architecture` (its HF classes, its GGUF
architecture names, its config mappings and tensor tables);
`models.checkpoints.architectures` lists them all, and every "not supported" message is
computed from that one list.

The names of a tensor table are llama.cpp's (`gguf.TENSOR_NAMES`, GGUF files)
and transformers' state-dict names (HF directories). A per-layer name holds
`{i}` (the layer) through the table's `layer_prefix`, and may hold `{e}` (an
expert: the tensor goes to `layers[key][i, e]`, for mixtures of experts).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import struct
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models.checkpoints import checks

_MISSING = object()


# ---------------------------------------------------------------------------
# Config values


def json_kind(value: Any) -> str:
    """'array', 'string', ... : the JSON name of a parsed value's type."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


class ConfigReader:
    """Validated access to a checkpoint's declared values (GGUF metadata or config.json).

    Absent and null (None) values are the same. Every accessor names the
    value in its error as `what(key)`: `"{source}: {arch}.{key}"` for GGUF,
    `"{source}: config.json '{key}'"` for Hugging Face.

    Args:
      values: GGUF metadata (key -> value, from `read_gguf`) or the parsed
        config.json object.
      source: the file or directory, for messages.
      gguf_arch: the GGUF architecture (keys are read as `{gguf_arch}.{key}`);
        None for config.json.
      label: what the values are called in messages when they are not GGUF
        metadata ("config.json", or a nested object of it).
    """

    def __init__(self, values: Mapping[str, Any], source: str, gguf_arch: str | None = None,
                 label: str = "config.json"):
        self.values = values
        self.source = source
        self.arch = gguf_arch
        self.label = label

    def full_key(self, key: str) -> str:
        return key if self.arch is None else f"{self.arch}.{key}"

    def what(self, key: str) -> str:
        if self.arch is None:
            return f"{self.source}: {self.label} {key!r}"
        return f"{self.source}: {self.arch}.{key}"

    def raw(self, key: str) -> Any:
        """The value as stored (None when absent), unvalidated."""
        return self.values.get(self.full_key(key))

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value, or `default` when absent; ModelLoadError when absent without a default."""
        v = self.raw(key)
        if v is None:
            if default is _MISSING:
                if self.arch is None:
                    raise ModelLoadError(f"{self.source}: {self.label} has no {key!r}")
                raise ModelLoadError(f"{self.source}: missing metadata key {self.full_key(key)}")
            return default
        return v

    def count(self, key: str, default: Any = _MISSING, minimum: int = 1):
        """An integer in [minimum, 2**31 - 1] (`checks.int_value`), or `default` when absent."""
        v = self.get(key, default)
        return v if v is default else checks.int_value(v, self.what(key), minimum=minimum)

    def positive(self, key: str, default: Any = _MISSING, allow_zero: bool = False):
        """A finite float > 0 (>= 0 with allow_zero), or `default` when absent."""
        v = self.get(key, default)
        return v if v is default else checks.positive_float(v, self.what(key),
                                                            allow_zero=allow_zero)

    def string(self, key: str, default: Any = _MISSING):
        v = self.get(key, default)
        return v if v is default else checks.string_value(v, self.what(key))

    def flag(self, key: str, default: Any = None):
        """A boolean, or `default` (None) when absent."""
        v = self.raw(key)
        return default if v is None else checks.bool_value(v, self.what(key))


def head_dim_of(r: ConfigReader, dim: int, n_heads: int, key: str, dim_key: str,
                heads_key: str) -> int:
    """The head dim: `key` if declared, else dim / n_heads (which must divide); even (RoPE).

    Raises:
      ModelLoadError: naming the keys (both formats word it the same way).
    """
    head_dim = r.count(key, None)
    if head_dim is None:
        if dim % n_heads:
            q = (lambda k: k) if r.arch is not None else repr
            raise ModelLoadError(
                f"{r.source}: {'' if r.arch is not None else 'config.json '}"
                f"{q(r.full_key(dim_key))} ({dim}) must be a multiple of "
                f"{q(r.full_key(heads_key))} ({n_heads}) when {q(r.full_key(key))} is absent "
                "(the head dim is their ratio)")
        head_dim = dim // n_heads
    return head_dim


def gguf_embedding(tensors: dict[str, Any], r: ConfigReader) -> tuple[int, int]:
    """(E, V) from `token_embd.weight`, checked against `ARCH.embedding_length`."""
    source, arch = r.source, r.arch
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(f"{source}: missing tensor token_embd.weight")
    if len(emb.shape) != 2:
        raise ModelLoadError(f"{source}: token_embd.weight must be 2-D [E, V] (GGUF order), got "
                             f"shape {list(int(d) for d in emb.shape)}")
    emb_dim, n_vocab = (int(d) for d in emb.shape)  # gguf shape is (E, V)
    dim = r.count("embedding_length")
    if emb_dim != dim:
        raise ModelLoadError(f"{source}: token_embd.weight has rows of {emb_dim} values but "
                             f"{arch}.embedding_length = {dim}")
    return dim, n_vocab


def gguf_attention(r: ConfigReader, dim: int) -> tuple[int, int, int]:
    """(H, K, D) from `ARCH.attention.*` (rules: `llama_config.config_from_gguf`)."""
    source, arch = r.source, r.arch
    n_heads = r.count("attention.head_count")
    if isinstance(r.raw("attention.head_count_kv"), list):
        raise UnsupportedModelError(f"{source}: {arch}.attention.head_count_kv is a per-layer "
                                    "list; per-layer kv-head counts are not supported")
    n_kv = r.count("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ModelLoadError(f"{source}: {arch}.attention.head_count ({n_heads}) must be a "
                             f"multiple of {arch}.attention.head_count_kv ({n_kv})")
    head_dim = head_dim_of(r, dim, n_heads, "attention.key_length", "embedding_length",
                           "attention.head_count")
    if head_dim % 2:
        raise ModelLoadError(f"{source}: the head dim ({arch}.attention.key_length or "
                             f"embedding_length / head_count) must be even for rotary "
                             f"embeddings, got {head_dim}")
    if r.count("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{source}: key and value head sizes differ")
    return n_heads, n_kv, head_dim


def hf_attention(r: ConfigReader) -> tuple[int, int, int, int]:
    """(E, H, K, D) from hidden_size, num_attention_heads, num_key_value_heads, head_dim."""
    source = r.source
    dim, n_heads = r.count("hidden_size"), r.count("num_attention_heads")
    n_kv = r.count("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ModelLoadError(f"{source}: config.json 'num_attention_heads' ({n_heads}) must be a "
                             f"multiple of 'num_key_value_heads' ({n_kv})")
    head_dim = head_dim_of(r, dim, n_heads, "head_dim", "hidden_size", "num_attention_heads")
    if head_dim % 2:
        raise ModelLoadError(f"{source}: config.json: the head dim ('head_dim' or hidden_size / "
                             f"num_attention_heads) must be even for rotary embeddings, "
                             f"got {head_dim}")
    return dim, n_heads, n_kv, head_dim


# ---------------------------------------------------------------------------
# Files


def read_gguf(path):
    """Open a GGUF file and check that every tensor's bytes are present.

    Returns:
      (reader `gguf.GGUFReader`, metadata dict key -> Python value).
    Raises:
      ModelLoadError: missing, unreadable, not GGUF, truncated or corrupt.
    """
    import gguf  # deferred: the package is slow-ish to import

    path = pathlib.Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, IndexError, struct/numpy errors)
        raise ModelLoadError(
            f"{path}: not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated: tensor {t.name} needs bytes up to "
                f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader, meta


def finite(a: np.ndarray, name: str, source: str) -> np.ndarray:
    """`a` unless it holds NaN or inf (ModelLoadError naming the tensor and the count)."""
    if not np.isfinite(a).all():
        raise ModelLoadError(f"{source}: tensor {name} holds {int((~np.isfinite(a)).sum())} "
                             "non-finite values (NaN or inf); the checkpoint is corrupt")
    return a


def dequantize_tensor(t, source: str) -> np.ndarray:
    """One GGUF tensor dequantised to float32 numpy in GGUF's row order (`[out, in]` for matrices).

    Raises:
      ModelLoadError: the `gguf` package cannot dequantise it (the message names
        the file, the tensor and its type), or it holds NaN or inf.
    """
    import gguf

    try:
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{source}: cannot dequantise tensor {t.name} "
                             f"({t.tensor_type.name}): {type(e).__name__}: {e}") from e
    return finite(a, t.name, source)


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy (BF16, which numpy lacks, widened to float32)."""
    from safetensors import safe_open

    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        out = {}
        bf16 = {k for k, v in header.items() if k != "__metadata__" and v.get("dtype") == "BF16"}
        with safe_open(str(path), framework="numpy") as sf:
            for k in sf.keys():
                if k not in bf16:
                    out[k] = sf.get_tensor(k)
        if bf16:
            raw = np.memmap(path, np.uint8, mode="r")
            for k in bf16:
                begin, end = header[k]["data_offsets"]
                u16 = np.frombuffer(raw[8 + n + begin:8 + n + end].tobytes(), "<u2")
                out[k] = (u16.astype(np.uint32) << 16).view(np.float32).reshape(header[k]["shape"])
        return out
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        raise ModelLoadError(f"{path}: not a readable safetensors file: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------
# llama.cpp's RoPE row permutation (its `llama` architecture)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on the rows of a Q or K projection.

    llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`)
    reorders the rows of `attn_q` / `attn_k` of the `llama` architecture so
    that each head's rotary pairs are interleaved (`[x0, x_{D/2}, x1, ...]`,
    llama.cpp's "normal" RoPE) instead of split in halves (Hugging Face's
    rotate-half).

    Args:
      w: `[n_heads*D, ...]` rows in GGUF order; a weight `[n_heads*D, E]` or a
        bias `[n_heads*D]`.
      n_heads: H for Q, K (kv heads) for K.
    Returns:
      `[n_heads*D, ...]` in Hugging Face order (rotate-half halves per head).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (Hugging Face order -> GGUF order); inverse of the above."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------
# Tensor tables and the copy loop


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one file tensor goes.

    Attributes:
      key: the params key (a `layers` key for per-layer tensors); for a fused
        tensor, the keys of its row blocks in order (`("wq", "wk", "wv")`:
        the rows are split by the target shapes, e.g. Phi-3's `qkv_proj`).
      matrix: the file stores `[out, in]` (PyTorch / GGUF order): transposed
        to our `[in, out]` (the last two axes: llama.cpp's stacked experts
        `[X, out, in]` become `[X, in, out]`).
    """

    key: str | tuple[str, ...]
    matrix: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return self.key if isinstance(self.key, tuple) else (self.key,)


@dataclasses.dataclass(frozen=True)
class TensorTable:
    """A family's map from one format's tensor names to its params pytree.

    Attributes:
      layer_prefix: the per-layer name prefix with `{i}` ("blk.{i}.",
        "model.layers.{i}.").
      top: whole-model tensors by full name ("token_embd.weight" -> embed).
      layer: per-layer tensors by the name after the prefix; a name may hold
        `{e}` (an expert index; stored at `layers[key][i, e]`).
      ignore: full names that are skipped when present (RoPE buffers, a tied
        checkpoint's copy of the head, llama.cpp's `rope_freqs.weight`).
      ignore_suffixes: name endings that are skipped ("rotary_emb.inv_freq").
      transform: optional `f(key, a) -> a` on each tensor (or block of a
        fused one) in the file's row order, after the shape check and before
        the transpose (llama.cpp's RoPE un-permutation, Gemma's norm shift).
    """

    layer_prefix: str
    top: Mapping[str, Tensor]
    layer: Mapping[str, Tensor]
    ignore: frozenset[str] = frozenset()
    ignore_suffixes: tuple[str, ...] = ()
    transform: Callable[[str, np.ndarray], np.ndarray] | None = None

    def __post_init__(self):
        pre = re.escape(self.layer_prefix).replace(re.escape("{i}"), r"(?P<i>\d+)")
        pats = []
        for suffix, spec in self.layer.items():
            body = re.escape(suffix).replace(re.escape("{e}"), r"(?P<e>\d+)")
            pats.append((re.compile(f"^{pre}{body}$"), suffix, spec))
        object.__setattr__(self, "_patterns", tuple(pats))

    def lookup(self, name: str):
        """(spec, layer index or None, expert index or None, suffix) for a name, or None."""
        if name in self.top:
            return self.top[name], None, None, name
        for pat, suffix, spec in self._patterns:
            m = pat.match(name)
            if m:
                e = m.groupdict().get("e")
                return spec, int(m.group("i")), None if e is None else int(e), suffix
        return None

    def skipped(self, name: str) -> bool:
        return name in self.ignore or name.endswith(self.ignore_suffixes)

    def name_of(self, key: str, i: int | None = None, e: int | None = None) -> str:
        """The file name of params key `key` (layer i, expert e): for messages."""
        if i is None:
            return next((n for n, s in self.top.items() if key in s.keys), key)
        suffix = next((n for n, s in self.layer.items() if key in s.keys), key)
        return self.layer_prefix.format(i=i) + suffix.replace("{e}", str(e))


def copy_tensors(family: ModuleType, cfg, table: TensorTable, names: Iterable[str],
                 fetch: Callable[[str], np.ndarray], source: str) -> dict[str, Any]:
    """Copy a checkpoint's tensors into the family's stacked `[in, out]` params (numpy float32).

    Args:
      family: the model module (`models.families.llama`, `models.families.gemma3`): its
        `param_shapes(cfg)` sizes the params and its `check_params` checks them.
      table: the family's tensor table for this format.
      names: every tensor name in the file, in file order.
      fetch: `f(name) -> float32 array` in file order (`[out, in]` for
        matrices), finite (non-finite values raise inside it).
    Returns:
      The params pytree: top-level keys and `layers` arrays stacked over L
      (`[L, ...]`, or `[L, X, ...]` for per-expert tensors).
    Raises:
      UnsupportedModelError: a tensor the table has no place for (or beyond
        the config's layers / experts).
      ModelLoadError: a tensor whose shape does not fit the config, or a
        tensor the family needs that the file lacks; every message names the
        file and the tensor.
    """
    shapes = family.param_shapes(cfg)
    layer_shapes = shapes["layers"]
    layers = {k: np.empty(s, np.float32) for k, s in layer_shapes.items()}
    params: dict[str, Any] = {"layers": layers}
    filled: set = set()
    for name in names:
        if table.skipped(name):
            continue
        hit = table.lookup(name)
        if hit is None:
            raise UnsupportedModelError(f"{source}: unexpected tensor {name}; the model has no "
                                        "place for it")
        spec, i, e, _ = hit
        lead = (0 if i is None else 1) + (0 if e is None else 1)
        if i is None:
            if any(k not in shapes or k == "layers" for k in spec.keys):
                raise UnsupportedModelError(f"{source}: unexpected tensor {name}; the model has "
                                            "no place for it")
            targets = [tuple(shapes[k]) for k in spec.keys]
        else:
            ok = all(k in layers and len(layers[k].shape) > lead for k in spec.keys)
            if not ok or i >= layers[spec.keys[0]].shape[0] or (
                    e is not None and e >= layers[spec.keys[0]].shape[1]):
                raise UnsupportedModelError(f"{source}: unexpected tensor {name}; the model has "
                                            "no place for it")
            targets = [layers[k].shape[lead:] for k in spec.keys]
        a = fetch(name)
        # The shape in our [in, out] order, checked before any transform (an un-permute
        # needs rows that split into heads).
        # A matrix swaps its last two axes (a stacked [X, out, in] expert tensor too).
        got = a.shape[:-2] + a.shape[-2:][::-1] if spec.matrix else a.shape
        if len(spec.keys) == 1:
            want = targets[0]
        else:
            want = targets[0][:-1] + (sum(t[-1] for t in targets),)
            if any(t[:-1] != want[:-1] for t in targets):
                raise ModelLoadError(f"{source}: tensor {name}: fused blocks of different input "
                                     f"shapes {targets}")
        if tuple(got) != tuple(want):
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(got)}"
                                 f"{' after transposing to [in, out]' if spec.matrix else ''}, "
                                 f"expected {tuple(want)}")
        start = 0
        for key, t in zip(spec.keys, targets):
            block = a[start:start + t[-1]] if len(spec.keys) > 1 else a
            start += t[-1]
            if table.transform is not None:
                block = table.transform(key, block)
            block = block.swapaxes(-1, -2) if spec.matrix else block
            if i is None:
                params[key] = np.ascontiguousarray(block, np.float32)
            elif e is None:
                layers[key][i] = block
                filled.add((key, i))
            else:
                layers[key][i, e] = block
                filled.add((key, i, e))
    for key, s in shapes.items():
        if key != "layers" and key not in params:
            raise ModelLoadError(f"{source}: missing tensor {table.name_of(key)}")
    for key, arr in layers.items():
        for i in range(arr.shape[0]):
            if (key, i) in filled:
                continue
            per_expert = any("{e}" in n and key in s.keys for n, s in table.layer.items())
            if not per_expert:
                raise ModelLoadError(f"{source}: missing tensor {table.name_of(key, i)}")
            for e in range(arr.shape[1]):
                if (key, i, e) not in filled:
                    raise ModelLoadError(f"{source}: missing tensor {table.name_of(key, i, e)}")
    try:
        family.check_params(cfg, params, source)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return params


# ---------------------------------------------------------------------------
# Families


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One family's loader: what it reads, and how.

    Attributes:
      family: the model module that runs its configs (`models.families.llama`, ...).
      hf_classes: the transformers `architectures` names it loads
        (config.json), e.g. ("Qwen3ForCausalLM",).
      gguf_archs: the `general.architecture` values it loads, e.g. ("qwen3",).
      config_from_hf: `f(hf dict, source, dtype, hf_class) -> cfg`.
      config_from_gguf: `f(meta, tensors, source, dtype) -> cfg` (the
        architecture is `meta["general.architecture"]`).
      hf_table: `f(cfg) -> TensorTable` of transformers' state-dict names.
      gguf_table: `f(cfg) -> TensorTable` of llama.cpp's names.
      hf_prefixes: other `architectures` prefixes routed here so the family
        can refuse them with its own reason (Gemma 3's multimodal classes).
    """

    family: ModuleType
    hf_classes: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    config_from_hf: Callable[..., Any]
    config_from_gguf: Callable[..., Any] | None
    hf_table: Callable[[Any], TensorTable]
    gguf_table: Callable[[Any], TensorTable] | None
    hf_prefixes: tuple[str, ...] = ()
