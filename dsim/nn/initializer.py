"""Initializers by MindSpore's names, for a layer's weight_init: Normal(0.02) is ("normal", 0.02).

A layer's initial tensor is a pure function of (seed, parameter name) whatever the layout (see
parameter.initial_value), so every rank's slice holds the same values as the whole tensor (initial_slice
draws it a few rows at a time, never whole).
"""


def Normal(sigma: float = 0.01):
    """N(0, sigma^2), as mindspore.common.initializer.Normal(sigma)."""
    return ("normal", float(sigma))


def Zero():
    return ("zeros",)


def One():
    return ("ones",)
