"""Initializers by MindSpore's names, for a layer's weight_init: Normal(0.02) is ("normal", 0.02).

MindSpore's string 'normal' (initializer('normal', ...), the transformer's default) is Normal() = N(0, 0.01^2).
A layer's weight_init None is its MindSpore r2.1 default (see Dense, Conv2d): HeUniform over the fan-in.

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
