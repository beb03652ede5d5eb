"""Argument checks shared across ringviz: a bad value raises an error that names the argument."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``; raise otherwise.

    >>> check_int("window", 4)
    4
    >>> check_int("window", 0)
    Traceback (most recent call last):
    ValueError: window must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)
