"""Decode attention over a KV segment (the shared prefix, a slot's tail) in Pallas.

kernel.py: `segments`, the Pallas kernel (Triton and Mosaic drivers, block
shapes); reference.py: `segments`, the same result by `common.partial_attention`;
batching.py: `segment_attention`, the one-branch op the decode step calls and
the vmap rule that puts a row's N branches in one query block over its prefix.
"""

from jaxsample.kernels.decode_attention.batching import segment_attention

__all__ = ["segment_attention"]
