"""Shape buckets: few distinct array shapes, so new lengths and counts rarely recompile.

Plain Python (no JAX): the host scheduler (`scheduler.py`) and the budget use
them as well as the programs' shapes.
"""

from __future__ import annotations


def bucket(length: int, minimum: int = 16) -> int:
    """Round a length up to 2^k or 1.5 * 2^(k-1) (at least `minimum`).

    Few distinct shapes (so new lengths rarely recompile) and < 50% padding.
    """
    length = max(int(length), minimum)
    size = 1 << (length - 1).bit_length()  # next power of two >= length
    three_quarters = size * 3 // 4
    return three_quarters if size >= 32 and three_quarters >= length else size


def slot_bucket(live: int, multiple: int = 1) -> int:
    """Slots for `live` branches (or rows) after compaction: `multiple * 2^j >= live`.

    Powers of two keep the number of compiled shapes at log2(N); `multiple`
    is the mesh axis size the slots are split over.
    """
    size = multiple
    while size < live:
        size *= 2
    return size
