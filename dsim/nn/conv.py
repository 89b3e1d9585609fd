"""Conv2d, MaxPool2d and Flatten on NCHW batches, vectorized (strided windows, no loop per pixel or sample).

Conv2d may split its output channels over the model-parallel group (split="column": weight axis 0, each
rank computes its channels; the input gradient is all-reduced over mp) or be replicated (split=None).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..parallel.groups import allreduce_sum
from ..parallel.layout import ParamSpec
from .layers import Layer, keep_mask, kept


class Conv2d(Layer):
    """MindSpore's nn.Conv2d with pad_mode='valid', stride 1, no bias (its default): weight (out, in, kh, kw).

    weight_init None is MindSpore r2.1's default, HeUniform(negative_slope=sqrt(5)) over fan_in = in x kh x kw:
    uniform within +-1/sqrt(fan_in).
    """

    def __init__(self, name, in_channels, out_channels, kernel_size, split=None, weight_init=None):
        super().__init__()
        self.name, self.split = name, split
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel_size
        k = kernel_size
        self.specs = [ParamSpec(f"{name}.weight", (out_channels, in_channels, k, k), 0 if split == "column" else None)]
        self.inits = {self.specs[0].name: weight_init or ("he_uniform", in_channels * k * k)}

    def forward(self, x, mp_comm):
        k = self.kernel_size
        n, c, h, w = x.shape
        ho, wo = h - k + 1, w - k + 1
        # (n, c, ho, wo, k, k) -> rows (n*ho*wo, c*k*k): im2col by strided views, one copy
        self._shape = x.shape
        self._cols = sliding_window_view(x, (k, k), axis=(2, 3)).transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, -1)
        weight = self.params[0].data
        y = self._cols @ weight.reshape(weight.shape[0], -1).T  # (n*ho*wo, out)
        return y.reshape(n, ho, wo, -1).transpose(0, 3, 1, 2)

    def backward(self, dy, mp_comm, need_dx=True):
        n, c, h, w = self._shape
        k = self.kernel_size
        weight = self.params[0].data
        out = weight.shape[0]
        dy_rows = dy.transpose(0, 2, 3, 1).reshape(-1, out)  # (n*ho*wo, out)
        p, into = self.params[0], self.params[0].grad_out()
        dw = np.matmul(dy_rows.T, self._cols, out=None if into is None else into.reshape(out, -1))
        if into is None:
            p.grad = dw.reshape(weight.shape)
        if not need_dx:
            return None
        ho, wo = h - k + 1, w - k + 1
        dcols = (dy_rows @ weight.reshape(out, -1)).reshape(n, ho, wo, c, k, k)
        # col2im: one add per kernel offset, in the same order; each offset's block made contiguous first (one copy:
        # the adds then read it in order, 1.2x faster than reading it strided out of dcols)
        per_offset = dcols.transpose(4, 5, 0, 3, 1, 2).copy()
        dx = np.zeros(self._shape, dtype=dy.dtype)
        for i in range(k):
            for j in range(k):
                dx[:, :, i:i + ho, j:j + wo] += per_offset[i, j]
        if self.split == "column":
            dx = allreduce_sum(mp_comm, dx, inplace=True)
        return dx

    def __repr__(self):
        k = self.kernel_size
        return f"Conv2d({self.name}, {self.in_channels}->{self.out_channels}, {k}x{k}, split={self.split})"


class MaxPool2d:
    """Max pooling, kernel k, stride k (LeNet5's 2); the gradient goes to the first maximum of each window (in
    row-major order, as an argmax takes it; a window whose maximum is a NaN passes none)."""

    def __init__(self, kernel_size=2):
        self.k = kernel_size

    def _offsets(self, x, ho, wo):
        """x's elements at each offset of a window, in row-major order: one strided view each."""
        k = self.k
        return [x[:, :, i:ho * k:k, j:wo * k:k] for i in range(k) for j in range(k)]

    def forward(self, x, mp_comm=None):
        # the maximum over the k * k offsets, each a strided view of x (3x faster than an argmax over windows copied
        # out of x). np.maximum gives a tie's value, except that between -0.0 and 0.0 it may give either: where x
        # holds a -0.0, each window whose maximum is zero takes its first zero (what an argmax takes)
        n, c, h, w = x.shape
        ho, wo = h // self.k, w // self.k
        views = self._offsets(x, ho, wo)
        out = views[0].copy()
        for view in views[1:]:
            np.maximum(out, view, out=out)
        negative = np.signbit(x)  # behind a ReLU, set only on a -0.0: the zeros are compared only then
        if negative.any() and np.logical_and(negative, x == 0, out=negative).any():
            zero = out == 0
            for view in reversed(views):
                np.copyto(out, view, where=zero & (view == 0))
        self._x, self._out = x, out
        return out

    def backward(self, dy, mp_comm=None, need_dx=True):
        x, out = self._x, self._out
        ho, wo = out.shape[2], out.shape[3]
        # dx laid out in memory as x: behind a convolution (and its ReLU) channels-last, so that the ReLU's backward
        # reads its mask in order and the convolution's backward takes dx's rows without copying them
        dx = np.zeros_like(x, dtype=dy.dtype)
        taken = np.zeros(out.shape, dtype=bool)
        for view, into in zip(self._offsets(x, ho, wo), self._offsets(dx, ho, wo)):   # each window's first maximum
            first = view == out                                                       # takes its gradient
            first &= ~taken
            taken |= first
            into[...] = kept(dy, keep_mask(first, dy.dtype))   # +0.0 elsewhere, as a scatter into zeros
        return dx

    def __repr__(self):
        return f"MaxPool2d({self.k})"


class Flatten:
    """(n, c, h, w) -> (n, c*h*w), channel-major: a channel shard becomes a contiguous block of features."""

    def forward(self, x, mp_comm=None):
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy, mp_comm=None, need_dx=True):
        return dy.reshape(self._shape)

    def __repr__(self):
        return "Flatten()"
