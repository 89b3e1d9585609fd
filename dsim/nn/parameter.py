"""A parameter as one rank holds it: its model-parallel slice, and the part of it the rank owns."""
from __future__ import annotations

import zlib

import numpy as np

from ..parallel.layout import ParamSpec, ParallelLayout, mp_slice, owned_slice, is_opt_sharded


class Parameter:
    """The mp slice of a global tensor on one rank; `owned` is what this rank updates and saves."""

    def __init__(self, spec: ParamSpec, layout: ParallelLayout, rank: int, data: np.ndarray):
        self.spec = spec
        self.name = spec.name
        self.mp = mp_slice(spec, layout, rank)
        self.owned = owned_slice(spec, layout, rank)
        self.opt_sharded = is_opt_sharded(spec, layout)
        if data.shape != self.mp.extents:
            raise ValueError(f"{self.name}: data shape {data.shape} != mp slice {self.mp.extents}")
        self.data = data
        self._grad = None
        self._bound = False   # True once .grad is a view into a gradient bucket (dsim.parallel.buckets)

    @property
    def grad(self):
        """The gradient of this rank's mp slice (shaped as data), or None before the first backward."""
        return self._grad

    @grad.setter
    def grad(self, value):
        # Bound to a bucket, a new gradient is copied into the view; a layer that can writes there itself.
        if self._bound:
            if value is not self._grad:
                np.copyto(self._grad, value)
        else:
            self._grad = value

    def grad_out(self):
        """Where a layer should write this gradient (`out=`): the bucket view, or None (allocate) when unbound."""
        return self._grad if self._bound else None

    def bind_grad(self, view: np.ndarray) -> None:
        """Make `view` (a part of a flat gradient buffer) this parameter's gradient from now on."""
        if view.shape != self.data.shape:
            raise ValueError(f"{self.name}: gradient view {view.shape} != data {self.data.shape}")
        self._grad, self._bound = view, True

    @property
    def owned_index(self) -> tuple:
        """Index of the owned part inside self.data."""
        return self.owned.relative_to(self.mp)

    @property
    def owned_data(self) -> np.ndarray:
        """A view of the owned part of the data."""
        return self.data[self.owned_index]

    def __repr__(self):
        return f"Parameter({self.name}, global={self.spec.shape}, mp={self.mp.extents}, owned={self.owned.extents})"


def _rng(spec: ParamSpec, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(spec.name.encode())])


def init_global(spec: ParamSpec, seed: int, kind: str, fan_in: int) -> np.ndarray:
    """The full initial tensor of a Dense parameter, a pure function of (seed, name): every rank agrees.

    Weights use HeUniform (the seeds' initializer, negative_slope=sqrt(5) as in nn.Dense); biases
    use uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like MindSpore's Dense.
    """
    rng = _rng(spec, seed)
    if kind == "weight":
        gain = np.sqrt(2.0 / (1 + 5.0))
        bound = gain * np.sqrt(3.0 / fan_in)
    else:
        bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=spec.shape)


def initial_value(spec: ParamSpec, seed: int, init: tuple) -> np.ndarray:
    """The full initial tensor of a parameter from its initializer, a pure function of (seed, name).

    init: ("he_uniform", fan_in) | ("bias_uniform", fan_in) (MindSpore's Dense defaults),
    ("normal", sigma) (MindSpore's Normal(sigma)), ("zeros",) or ("ones",).
    """
    kind = init[0]
    if kind in ("he_uniform", "bias_uniform"):
        return init_global(spec, seed, "weight" if kind == "he_uniform" else "bias", init[1])
    if kind == "normal":
        return _rng(spec, seed).normal(0.0, init[1], size=spec.shape)
    if kind == "zeros":
        return np.zeros(spec.shape)
    if kind == "ones":
        return np.ones(spec.shape)
    raise ValueError(f"{spec.name}: unknown initializer {init!r}")
