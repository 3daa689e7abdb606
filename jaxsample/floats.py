"""float32 figures as Python floats that print as float32 digits.

`shortest_float32(x)` is the Python float of the shortest decimal that rounds
back to the same float32 (0.15873016, not float64's 0.1587301641702652): the
value the command line's JSON writes and the one the library's Python results
(vote shares and supports) hold, so both print alike.
"""

from __future__ import annotations


def shortest_float32(x) -> float | None:
    """`x` rounded to float32, as the Python float of its shortest round-tripping
    decimal, or None when it is not finite (JSON's null).

    numpy's Dragon4 (`format_float_scientific(unique=True)`) gives the shortest float32
    digits, at most 9 significant; the float64 nearest to them prints back (`repr`, what
    `json` writes) as exactly those digits, since two decimals of <= 9 digits are much
    farther apart than a float64 ulp. `np.float32(shortest_float32(x)) == np.float32(x)`.
    """
    import numpy as np

    x = np.float32(x)
    if not np.isfinite(x):
        return None
    return float(np.format_float_scientific(x, unique=True))
