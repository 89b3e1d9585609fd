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


def _draw(spec: ParamSpec, init: tuple):
    """(rng, shape) -> the next values of the initializer's stream: drawn in consecutive pieces, the values
    are those of one draw of the whole (numpy's Generator keeps nothing back between calls).

    he_uniform is HeUniform (the seeds' initializer, negative_slope=sqrt(5) as in nn.Dense); bias_uniform is
    uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), as MindSpore's Dense initializes its bias."""
    kind = init[0]
    if kind in ("he_uniform", "bias_uniform"):
        fan_in = init[1]
        bound = np.sqrt(2.0 / (1 + 5.0)) * np.sqrt(3.0 / fan_in) if kind == "he_uniform" else 1.0 / np.sqrt(fan_in)
        return lambda rng, shape: rng.uniform(-bound, bound, size=shape)
    if kind == "normal":
        return lambda rng, shape: rng.normal(0.0, init[1], size=shape)
    if kind == "zeros":
        return lambda rng, shape: np.zeros(shape)
    if kind == "ones":
        return lambda rng, shape: np.ones(shape)
    raise ValueError(f"{spec.name}: unknown initializer {init!r}")


def initial_value(spec: ParamSpec, seed: int, init: tuple) -> np.ndarray:
    """The full initial tensor of a parameter from its initializer, a pure function of (seed, name).

    init: ("he_uniform", fan_in) | ("bias_uniform", fan_in) (MindSpore's Dense defaults),
    ("normal", sigma) (MindSpore's Normal(sigma)), ("zeros",) or ("ones",).
    """
    return _draw(spec, init)(_rng(spec, seed), spec.shape)


DRAW_ELEMS = 1 << 20   # values drawn at a time by initial_slice (8 MiB of float64)


def initial_slice(spec: ParamSpec, seed: int, init: tuple, where, out: np.ndarray) -> None:
    """out[...] = initial_value(spec, seed, init)[where.index] (where: a layout Slice), the same bits, without
    the whole tensor: its rows are drawn in order, a few at a time, up to the slice's last, and each piece
    keeps what falls in the slice. A rank of a model-parallel layout never holds more than its slice and
    DRAW_ELEMS values (the whole 5120 x 5120 float64 tensor of the default model is 200 MiB)."""
    shape = spec.shape
    if not shape or int(np.prod(shape)) <= DRAW_ELEMS:
        out[...] = initial_value(spec, seed, init)[where.index]
        return
    draw, rng = _draw(spec, init), _rng(spec, seed)
    row = int(np.prod(shape[1:]))
    step = max(1, DRAW_ELEMS // row)
    lo, hi = where.offsets[0], where.offsets[0] + where.extents[0]
    rest = where.index[1:]
    for a in range(0, hi, step):
        b = min(a + step, shape[0])
        piece = draw(rng, (b - a, *shape[1:]))
        first, last = max(a, lo), min(b, hi)
        if first < last:
            out[first - lo:last - lo] = piece[(slice(first - a, last - a), *rest)]
