"""Pallas kernels for accelerators, and the choice between them and the XLA path.

One folder per kernel, its pure-JAX reference beside it (tpu-inference's
kernels/, sglang-jax's srt/kernels/):

    decode_attention/  the decode step's attention over the shared prefix and the
                       slots' tails (kernel.py: the Pallas kernel, Triton and
                       Mosaic drivers; reference.py: the XLA arithmetic it must
                       reproduce; batching.py: the one-branch op and its vmap
                       rule, which makes the prefix one query block per row)

The decode step's attention is chosen by the engine option `attention`
(`resolve_attention`), part of the compiled program's key (`engine.state.Static`):
"pallas" runs the kernels (in Pallas's interpreter on CPU, where the test suite
checks them against the XLA path), "xla" the einsum path of
`models.families.common.partial_attention`, "auto" the kernels on GPU and TPU and XLA on
CPU (where the int8 step keeps its own CPU kernel).
"""

from __future__ import annotations

import jax

from jaxsample.errors import InputError
from jaxsample.kernels.decode_attention import kernel as decode_kernel

ATTENTION = ("auto", "xla", "pallas")


def kernel_backend(platform: str | None = None) -> tuple[str, bool]:
    """(driver, interpret) of the Pallas kernels on `platform` (default: JAX's default
    backend): "mosaic" on TPU, "triton" on GPU, the Triton driver interpreted elsewhere."""
    platform = jax.default_backend() if platform is None else platform
    if platform == "tpu":
        return "mosaic", False
    if platform in ("gpu", "cuda", "rocm"):
        return "triton", False
    return "triton", True


def resolve_attention(attention, cfg, platform: str | None = None) -> str:
    """The decode attention a request runs: "xla" or "pallas".

    Args:
      attention: "auto" (the kernels on GPU and TPU where they can tile the
        model's head dim, XLA otherwise), "xla" or "pallas".
      cfg: the model config (its `head_dim`).
      platform: default JAX's default backend.
    Raises:
      InputError: attention is not one of `ATTENTION`, or "pallas" on a backend
        whose kernel cannot tile the model's head dim.
    """
    if not isinstance(attention, str) or attention not in ATTENTION:
        raise InputError(f"attention must be one of {', '.join(map(repr, ATTENTION))}, "
                         f"got {attention!r}")
    if attention == "xla":
        return "xla"
    backend, interpret = kernel_backend(platform)
    if interpret:  # CPU: the kernels only when asked for, in the interpreter
        return "pallas" if attention == "pallas" else "xla"
    try:
        decode_kernel.check_shapes(backend, cfg.head_dim)
    except ValueError as e:
        if attention == "pallas":
            raise InputError(f"attention='pallas': {e}") from None
        return "xla"
    return "pallas"
