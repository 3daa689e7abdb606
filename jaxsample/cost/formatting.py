"""Byte and FLOP counts as short strings (binary prefixes for bytes, decimal for FLOPs)."""

from __future__ import annotations

import math


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary prefixes)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_flops(n: float) -> str:
    """2.5e12 -> '2.50 TFLOP' (decimal prefixes)."""
    n = float(n)
    if n == 0:
        return "0 FLOP"
    exp = min(int(math.log10(abs(n)) // 3), 5)
    if exp <= 0:
        return f"{n:.0f} FLOP"
    prefix = "kMGTP"[exp - 1]
    return f"{n / 10 ** (3 * exp):.2f} {prefix}FLOP"
