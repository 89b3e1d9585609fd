"""LayerNorm over the last axis, replicated over the model-parallel group (its input is full on every rank)."""
from __future__ import annotations

import numpy as np

from ..parallel.layout import ParamSpec
from .layers import Layer


class LayerNorm(Layer):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis; gamma ones, beta zeros."""

    def __init__(self, name: str, size: int, eps: float = 1e-5):
        super().__init__()
        self.name, self.size, self.eps = name, size, eps
        self.specs = [ParamSpec(f"{name}.gamma", (size,)), ParamSpec(f"{name}.beta", (size,))]
        self.inits = {f"{name}.gamma": ("ones",), f"{name}.beta": ("zeros",)}

    def forward(self, x, mp_comm=None):
        dt = x.dtype.type
        mean = x.mean(axis=-1, keepdims=True)
        centered = x - mean
        var = (centered * centered).mean(axis=-1, keepdims=True)
        self._inv = dt(1) / np.sqrt(var + dt(self.eps))
        self._xhat = centered * self._inv
        return self._xhat * self.params[0].data + self.params[1].data

    def backward(self, dy, mp_comm=None, need_dx=True):
        gamma = self.params[0].data
        self.params[0].grad = (dy * self._xhat).reshape(-1, self.size).sum(axis=0)
        self.params[1].grad = dy.reshape(-1, self.size).sum(axis=0)
        g = dy * gamma
        xhat = self._xhat
        return self._inv * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))

    def __repr__(self):
        return f"LayerNorm({self.name}, {self.size})"
