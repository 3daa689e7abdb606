"""Pricing: what N branches over one shared prompt cost.

    model.py   the analytic FLOP/byte model (`estimate`, `table`) from a config
               and (P prompt tokens, T new tokens, N branches)
"""

from jaxsample.cost.model import *  # noqa: F401,F403
