"""Load a Llama-family GGUF file (llama.cpp's format) into `models.llama` params.

Every tensor is dequantised to float32 with `gguf.quants.dequantize` (any
quantisation the `gguf` package implements: F32, F16, BF16, Q4_0/1, Q5_0/1,
Q8_0, K-quants, ...) and mapped into the stacked parameter pytree of
`models.llama.param_shapes`, transposed from GGUF's `[out, in]` rows to our
`[in, out]`.

RoPE permutation: llama.cpp's converter (`convert_hf_to_gguf.py`,
`LlamaModel.permute`) reorders the rows of `attn_q` / `attn_k` of the
`llama` architecture so that each head's rotary pairs are interleaved
(`[x0, x_{D/2}, x1, x_{D/2+1}, ...]`, llama.cpp's "normal" RoPE) instead of
split in halves (Hugging Face's rotate-half). `unpermute_rope_rows` undoes
it, with the query-head count H for Q and the kv-head count K for K. Qwen2
files are written unpermuted (llama.cpp runs them with NEOX RoPE, which is
rotate-half), so nothing is undone for them.

Llama-3 RoPE scaling is stored by llama.cpp as a `rope_freqs.weight` tensor
of per-frequency divisors, not as parameters; the parameters are recovered
by matching the divisors against the Llama-3 formula (`_llama3_from_factors`).

`general.architecture = gemma3` files are configured and mapped by
`models.gemma3_loader` (`load_gguf` dispatches on the architecture).
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
from typing import Any

import numpy as np

from jaxsample.errors import ModelLoadError, UnsupportedModelError
from jaxsample.models import checks, llama
from jaxsample.models.tokenizer import CheckpointTokenizer

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")  # config_from_metadata's (the Llama family)
GGUF_ARCHS = SUPPORTED_ARCHS + ("gemma3",)  # every architecture config_from_gguf dispatches

# GGUF per-layer tensor name -> (our `layers` key, is a matrix to transpose)
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "ffn_norm.weight": ("mlp_norm", False),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` on the rows of a Q or K projection.

    Args:
      w: `[n_heads*D, ...]` rows in GGUF order (interleaved rotary pairs per
        head); a weight `[n_heads*D, E]` or a bias `[n_heads*D]`.
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


def read_gguf(path: str | os.PathLike):
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


def _llama3_from_factors(factors: np.ndarray, base: llama.LlamaConfig) -> llama.RopeScaling | None:
    """Llama-3 scaling parameters whose per-frequency divisors equal `factors` `[D/2]`, or None."""
    plain = llama.rope_frequencies(base.replace(rope_scaling=None)).astype(np.float64)
    factor = float(np.max(factors))
    if np.allclose(factors, 1.0):
        return None
    # (orig, low, high) and (c*orig, c*low, c*high) give the same frequencies: prefer low = 1,
    # then Llama 3.1/3.2's high = 4 and orig = 8192.
    for low, high, orig in itertools.product(
            (1.0, 2.0, 0.5), (4.0, 2.0, 8.0, 1.0), [8192] + [2 ** k for k in range(4, 21)]):
        if high <= low:
            continue
        cand = llama.RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                                 original_max_position_embeddings=orig)
        scaled = llama.rope_frequencies(base.replace(rope_scaling=cand)).astype(np.float64)
        if np.allclose(plain / scaled, factors, rtol=1e-3, atol=1e-4):
            return cand
    raise ValueError("rope_freqs.weight does not match any Llama-3 scaling")


_MISSING = object()


def config_from_metadata(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                         dtype: str = "float32") -> llama.LlamaConfig:
    """Build the `LlamaConfig` a GGUF file describes, validating every key it reads.

    Rules (`ARCH` is `general.architecture`; `models.checks` has the type rules):

        ARCH.embedding_length, .block_count, .feed_forward_length,
        .attention.head_count, .context_length       required, integers in [1, 2**31 - 1]
        .attention.head_count_kv                     optional (default head_count), same
                                                     range, and head_count must be a multiple
        .attention.key_length                        optional; if absent, embedding_length
                                                     must be a multiple of head_count and the
                                                     head dim is their ratio; the head dim
                                                     must be even (RoPE rotates pairs)
        .attention.value_length, .rope.dimension_count  optional, positive, = the head dim
        .vocab_size                                  optional, positive, = rows of token_embd
        .attention.sliding_window                    optional, integer >= 0 (0: none)
        .attention.layer_norm_rms_epsilon            required, finite float > 0
        .rope.freq_base                              optional (10000), finite float > 0
        .rope.scaling.type                           optional string: none, or linear with
                                                     factor 1; others are unsupported
        .rope.scaling.factor                         optional, finite float >= 0 (0 means
                                                     unset, llama.cpp's convention)
        token_embd.weight                            2-D, [E, V] in GGUF order, E =
                                                     embedding_length
        rope_freqs.weight                            [D/2] finite divisors > 0

    Args:
      meta: key -> value from `read_gguf`.
      tensors: tensor name -> `gguf.ReaderTensor` (for shapes and rope_freqs).
      source: the file, for messages.
    Raises:
      UnsupportedModelError: unknown architecture or an option we do not
        implement (rope scaling type, partial rotary, ...).
      ModelLoadError: a required key is missing, or a key has the wrong
        type, is out of range or is inconsistent with another key or a tensor
        shape; the message names the file and the key.
    """
    import gguf

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{source}: architecture {checks.short_repr(arch)} is not supported; supported: "
            f"{list(SUPPORTED_ARCHS)}")

    def what(key):
        return f"{source}: {arch}.{key}"

    def value(key, default=_MISSING):
        v = meta.get(f"{arch}.{key}")
        if v is None:
            if default is _MISSING:
                raise ModelLoadError(f"{source}: missing metadata key {arch}.{key}")
            return default
        return v

    def count(key, default=_MISSING, minimum=1):
        v = value(key, default)
        return v if v is default else checks.int_value(v, what(key), minimum=minimum)

    def positive(key, default=_MISSING):
        v = value(key, default)
        return v if v is default else checks.positive_float(v, what(key))

    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelLoadError(f"{source}: missing tensor token_embd.weight")
    if len(emb.shape) != 2:
        raise ModelLoadError(f"{source}: token_embd.weight must be 2-D [E, V] (GGUF order), got "
                             f"shape {list(int(d) for d in emb.shape)}")
    emb_dim, n_vocab = (int(d) for d in emb.shape)  # gguf shape is (E, V)
    dim = count("embedding_length")
    if emb_dim != dim:
        raise ModelLoadError(f"{source}: token_embd.weight has rows of {emb_dim} values but "
                             f"{arch}.embedding_length = {dim}")
    n_heads = count("attention.head_count")
    if isinstance(value("attention.head_count_kv", None), list):
        raise UnsupportedModelError(f"{source}: {arch}.attention.head_count_kv is a per-layer "
                                    "list; per-layer kv-head counts are not supported")
    n_kv = count("attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise ModelLoadError(f"{source}: {arch}.attention.head_count ({n_heads}) must be a "
                             f"multiple of {arch}.attention.head_count_kv ({n_kv})")
    head_dim = count("attention.key_length", None)
    if head_dim is None:
        if dim % n_heads:
            raise ModelLoadError(
                f"{source}: {arch}.embedding_length ({dim}) must be a multiple of "
                f"{arch}.attention.head_count ({n_heads}) when {arch}.attention.key_length "
                "is absent (the head dim is their ratio)")
        head_dim = dim // n_heads
    if head_dim % 2:
        raise ModelLoadError(f"{source}: the head dim ({arch}.attention.key_length or "
                             f"embedding_length / head_count) must be even for rotary "
                             f"embeddings, got {head_dim}")
    if count("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{source}: key and value head sizes differ")
    rot = count("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise UnsupportedModelError(
            f"{source}: partial rotary embeddings ({arch}.rope.dimension_count = {rot}, head dim "
            f"{head_dim}) are not supported")
    meta_vocab = count("vocab_size", None)
    if meta_vocab is not None and meta_vocab != n_vocab:
        raise ModelLoadError(f"{source}: {arch}.vocab_size = {meta_vocab} but token_embd.weight "
                             f"has {n_vocab} rows")
    ctx = count("context_length")
    window = count("attention.sliding_window", 0, minimum=0)
    if window and window < ctx:
        ctx = window  # full attention equals sliding-window attention within the window

    scaling_type = checks.string_value(value("rope.scaling.type", "none"),
                                       what("rope.scaling.type"))
    factor = value("rope.scaling.factor", None)
    if factor is not None:  # 0 means unset (llama.cpp reads it as 1)
        factor = checks.positive_float(factor, what("rope.scaling.factor"), allow_zero=True)
    if scaling_type == "linear" and factor in (None, 0.0, 1.0):
        scaling_type = "none"
    if scaling_type != "none":
        raise UnsupportedModelError(
            f"{source}: rope scaling type {scaling_type!r} is not supported (only none and "
            "Llama-3 rope_freqs)")
    try:
        cfg = llama.LlamaConfig(
            vocab_size=n_vocab, dim=dim, n_layers=count("block_count"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=count("feed_forward_length"),
            norm_eps=positive("attention.layer_norm_rms_epsilon"),
            rope_theta=positive("rope.freq_base", 10000.0), max_seq_len=ctx,
            tie_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors, dtype=dtype, arch=arch)
    except ValueError as e:
        raise ModelLoadError(f"{source}: inconsistent metadata: {e}") from e
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        factors = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        if factors.shape != (head_dim // 2,):
            raise ModelLoadError(f"{source}: rope_freqs.weight has shape {factors.shape}, expected "
                                 f"({head_dim // 2},)")
        if not (np.isfinite(factors) & (factors > 0)).all():
            raise ModelLoadError(f"{source}: rope_freqs.weight must hold finite divisors > 0, got "
                                 f"{checks.short_repr(factors.tolist())}")
        try:
            cfg = cfg.replace(rope_scaling=_llama3_from_factors(factors, cfg))
        except ValueError as e:
            raise UnsupportedModelError(f"{source}: {e}") from e
    if cfg.qkv_bias and arch != "qwen2":
        raise UnsupportedModelError(f"{source}: q/k/v biases are only supported for qwen2")
    return cfg


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
    if not np.isfinite(a).all():
        raise ModelLoadError(f"{source}: tensor {t.name} holds {int((~np.isfinite(a)).sum())} "
                             "non-finite values (NaN or inf); the checkpoint is corrupt")
    return a


def load_gguf_params(reader, cfg: llama.LlamaConfig, source: str) -> dict[str, Any]:
    """Dequantise and map every tensor into the stacked `[in, out]` pytree (numpy float32).

    Raises:
      ModelLoadError: a tensor is missing, misshapen, holds NaN or inf, or an
        output head does not match the embedding; UnsupportedModelError: an
        unknown tensor.
    """
    shapes = llama.param_shapes(cfg)
    layers = {k: np.empty(s, np.float32) for k, s in shapes["layers"].items()}
    filled: set[tuple[str, int]] = set()
    params: dict[str, Any] = {"layers": layers}
    permute = cfg.arch in ("llama", "mistral")

    for t in reader.tensors:
        name = t.name
        a = dequantize_tensor(t, source)
        if name == "token_embd.weight":
            params["embed"] = a
        elif name == "output_norm.weight":
            params["final_norm"] = a
        elif name == "output.weight":
            if a.shape != (cfg.vocab_size, cfg.dim):
                raise ModelLoadError(
                    f"{source}: output.weight has shape {a.shape}, expected "
                    f"({cfg.vocab_size}, {cfg.dim}) to match token_embd.weight")
            params["lm_head"] = a.T
        elif name == "rope_freqs.weight":
            continue
        else:
            m = _BLOCK_RE.match(name)
            if not m or m.group(2) not in _LAYER_TENSORS:
                raise UnsupportedModelError(f"{source}: unexpected tensor {name}; the model has no "
                                            "place for it")
            i, (key, matrix) = int(m.group(1)), _LAYER_TENSORS[m.group(2)]
            if key not in layers or i >= cfg.n_layers:
                raise UnsupportedModelError(f"{source}: unexpected tensor {name}")
            # Check the shape before un-permuting, which needs the rows to split into heads.
            got = a.shape[::-1] if matrix else a.shape
            if got != layers[key].shape[1:]:
                raise ModelLoadError(f"{source}: tensor {name} has shape {got} after transposing "
                                     f"to [in, out], expected {layers[key].shape[1:]}")
            if permute and key in ("wq", "bq"):
                a = unpermute_rope_rows(a, cfg.n_heads)
            elif permute and key in ("wk", "bk"):
                a = unpermute_rope_rows(a, cfg.n_kv_heads)
            if matrix:
                a = a.T
            layers[key][i] = a
            filled.add((key, i))
    return check_complete(llama, cfg, params, filled, _LAYER_TENSORS, source)


def check_complete(family, cfg, params, filled, layer_tensors, source: str):
    """Every layer tensor, the embedding and the final norm were read; shapes check.

    Args:
      family: the model module (`models.llama`, `models.gemma3`): its `check_params`.
      filled: the (key, layer) pairs read; layer_tensors: GGUF name -> (key, is_matrix).
    Returns:
      params.
    Raises:
      ModelLoadError: naming the file and the first missing tensor, or a bad shape.
    """
    for key in params["layers"]:
        for i in range(cfg.n_layers):
            if (key, i) not in filled:
                gguf_name = next(k for k, v in layer_tensors.items() if v[0] == key)
                raise ModelLoadError(f"{source}: missing tensor blk.{i}.{gguf_name}")
    for key, gguf_name in (("embed", "token_embd.weight"), ("final_norm", "output_norm.weight")):
        if key not in params:
            raise ModelLoadError(f"{source}: missing tensor {gguf_name}")
    try:
        family.check_params(cfg, params, source)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return params


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str,
                     dtype: str = "float32"):
    """(config, its params reader) of any architecture this package loads: the one
    dispatch on `general.architecture`, shared by `load_gguf` and
    `jaxsample.loading.read_config` (config only), so both accept the same files.

    Returns:
      (cfg, `load_params(reader, cfg, source) -> params`): `models.gemma3_loader`
      for `gemma3`, else `config_from_metadata` / `load_gguf_params` (Llama family).
    Raises:
      UnsupportedModelError, ModelLoadError: as `config_from_metadata` (and
        `gemma3_loader.config_from_gguf_metadata`).
    """
    arch = meta.get("general.architecture")
    if arch == "gemma3":
        from jaxsample.models import gemma3_loader

        return (gemma3_loader.config_from_gguf_metadata(meta, tensors, source, dtype=dtype),
                gemma3_loader.params_from_gguf)
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{source}: architecture {checks.short_repr(arch)} is not supported; supported: "
            f"{list(GGUF_ARCHS)}")
    return config_from_metadata(meta, tensors, source, dtype=dtype), load_gguf_params


def load_gguf(path: str | os.PathLike, *, dtype: str = "float32", header=None):
    """Load a GGUF checkpoint: config, dequantised parameters and tokenizer.

    Args:
      path: the `.gguf` file.
      dtype: "float32" or "bfloat16" for the parameters.
      header: optional `(reader, metadata)` from an earlier `read_gguf(path)` of
        the same file, so the header is not parsed twice.
    Returns:
      (cfg `LlamaConfig`, or `Gemma3Config` for `general.architecture = gemma3`
       (see `models.gemma3_loader`), params pytree of numpy float32 `[in, out]`
       arrays, tokenizer `CheckpointTokenizer`).
    Raises:
      ModelLoadError / UnsupportedModelError: see `read_gguf`,
        `config_from_metadata`, `load_gguf_params`; every message names the file.
    """
    source = str(path)
    reader, meta = header if header is not None else read_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg, load_params = config_from_gguf(meta, tensors, source, dtype=dtype)
    tokenizer = CheckpointTokenizer.from_gguf_metadata(meta, source)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {cfg.vocab_size} rows")
    params = load_params(reader, cfg, source)
    return cfg, params, tokenizer
