"""Argument checks shared by the Python front ends of positions, layouts
and the systems built on softmax attention."""
import numpy as np


def count(value, name, minimum=0):
    """An integer (not a bool) of at least `minimum`, as int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)
