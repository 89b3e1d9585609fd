"""Dense, activations and losses, with hand-written backward passes and Megatron-style model parallelism.

A layer's `split` says how the mp group shares it (each ParamSpec's `mp_axis` records the same):
- "column": output features split. Input is full on every mp rank, output is a shard.
  Backward all-reduces the input gradient over the mp group.
- "row": input features split. Input is a shard, the partial outputs are all-reduced over the mp
  group (then the replicated bias is added), output is full.
- None: replicated; every mp rank computes the same thing.
Column followed by row needs exactly one all-reduce each way, as in Megatron-LM.
"""
from __future__ import annotations

import numpy as np

from ..parallel.groups import allreduce_sum
from ..parallel.layout import ParamSpec

_WEIGHT_AXIS = {  # (weight stored (in, out), split) -> which axis of the stored weight the split cuts
    (True, "column"): 1, (True, "row"): 0,
    (False, "column"): 0, (False, "row"): 1,
}


class Layer:
    """A layer: the parameters it declares (`specs`, with their slicing and initializers), forward, backward.

    `params` (dsim.nn.Parameter, this rank's slices) are bound by Cell.build in the order of `specs`.
    """

    specs: list = []

    def __init__(self):
        self.params = []
        self.inits = {}  # spec name -> initializer (see parameter.initial_value, initial_slice)

    def param(self, suffix: str):
        """The bound parameter named <layer name>.<suffix>."""
        for p in self.params:
            if p.name.endswith("." + suffix):
                return p
        raise KeyError(suffix)


class Dense(Layer):
    """MindSpore's nn.Dense: weight (out, in), bias (out), y = x @ W.T + b (x is (batch, in)).

    transpose_b=False stores the weight (in, out), y = x @ W + b: MindSpore's transformer `_Linear(...,
    transpose_b=False)` (the feed-forward mapping and projection, the attention's output projection), so the
    stored tensor has MindSpore's shape. With kind="matmul" it is the seeds' MatMulCell: one parameter `param`
    of shape (in, out), y = x @ P, no bias.
    Initializers as MindSpore r2.1's nn.Dense: weight_init None is HeUniform(negative_slope=sqrt(5)), bound
    1/sqrt(fan_in); bias_init None is Uniform(1/sqrt(fan_in)), whatever weight_init is (the fault-recovery page
    sets Normal(0.02) on the weights only). With reduce_dx=False a column layer leaves its input gradient
    partial: the caller sums several before one all-reduce (attention's Q, K and V).
    """

    def __init__(self, name: str, in_features: int, out_features: int, split=None, kind="dense",
                 has_bias=True, weight_init=None, reduce_dx=True, bias_init=None, transpose_b=True):
        super().__init__()
        self.name, self.split, self.kind = name, split, kind
        self.in_features, self.out_features = in_features, out_features
        self.has_bias = has_bias and kind == "dense"
        self.reduce_dx = reduce_dx
        self.in_out = kind == "matmul" or not transpose_b   # the weight stored (in, out)
        axis = _WEIGHT_AXIS.get((self.in_out, split))
        if kind == "matmul":
            self.specs = [ParamSpec(f"{name}.param", (in_features, out_features), axis)]
        else:
            bias_axis = 0 if split == "column" else None
            shape = (in_features, out_features) if self.in_out else (out_features, in_features)
            self.specs = [ParamSpec(f"{name}.weight", shape, axis)]
            if self.has_bias:
                self.specs.append(ParamSpec(f"{name}.bias", (out_features,), bias_axis))
        w_init = weight_init or ("he_uniform", in_features)
        b_init = bias_init or ("bias_uniform", in_features)
        self.inits = {self.specs[0].name: w_init, **{s.name: b_init for s in self.specs[1:]}}
        self._x = None

    @property
    def fan_in(self) -> int:
        return self.in_features

    def _weight(self):
        w = self.params[0].data
        return w if self.in_out else w.T  # as (in, out)

    def forward(self, x, mp_comm):
        self._x = x
        y = x @ self._weight()
        if self.split == "row":
            y = allreduce_sum(mp_comm, y, inplace=True)
        if self.has_bias:
            y = y + self.params[1].data
        return y

    def backward(self, dy, mp_comm, need_dx=True):
        """Store parameter gradients; return the input gradient (None when not needed)."""
        x = self._x
        w, b = self.params[0], self.params[1] if self.has_bias else None
        # Straight into the gradient bucket: (in, out) = x.T @ dy for a weight stored (in, out), (out, in) = dy.T @ x
        # (as torch's Linear) for one stored (out, in), whose transpose a copy would cost several times the product.
        if self.in_out:
            w.grad = np.matmul(x.T, dy, out=w.grad_out())
        else:
            w.grad = np.matmul(dy.T, x, out=w.grad_out())
        if b is not None:
            b.grad = np.sum(dy, axis=0, out=b.grad_out())
        if not need_dx:
            return None
        dx = dy @ self._weight().T
        if self.split == "column" and self.reduce_dx:
            dx = allreduce_sum(mp_comm, dx, inplace=True)
        return dx

    def __repr__(self):
        return f"{type(self).__name__}({self.name}, {self.in_features}->{self.out_features}, split={self.split})"


_SAME_WIDTH = {2: np.int16, 4: np.int32, 8: np.int64}   # an integer type of a float type's width, by itemsize


def keep_mask(mask: np.ndarray, dtype) -> np.ndarray:
    """A boolean mask as integers as wide as dtype's elements: every bit set where it is true, none elsewhere."""
    bits = mask.view(np.uint8).astype(_SAME_WIDTH[np.dtype(dtype).itemsize])
    return np.negative(bits, out=bits)


def kept(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """np.where(mask, values, 0) bit for bit, keep being keep_mask(mask): 0.0 wherever the mask is false, whatever
    the value there (-0.0 and NaN included). A bitwise and of the values' bits has no branch per element, where
    np.where mispredicts one per element on an activation's mask: 3-8x faster (a ReLU on 150,528 float32)."""
    out = np.empty_like(values)
    np.bitwise_and(values.view(keep.dtype), keep, out=out.view(keep.dtype))
    return out


class ReLU:
    """max(x, 0), elementwise: works on full activations and on shards alike (0.0 for a NaN or -0.0, as
    np.where(x > 0, x, 0))."""

    def forward(self, x, mp_comm):
        self._keep = keep_mask(x > 0, x.dtype)
        return kept(x, self._keep)

    def backward(self, dy, mp_comm, need_dx=True):
        return kept(dy, self._keep)

    def __repr__(self):
        return "ReLU()"


class GELU:
    """GELU, tanh approximation (MindSpore's transformer FeedForward activation), elementwise."""

    _C = np.sqrt(2.0 / np.pi)

    def forward(self, x, mp_comm=None):
        self._x = x
        self._t = np.tanh(x.dtype.type(self._C) * (x + x.dtype.type(0.044715) * x ** 3))
        return x.dtype.type(0.5) * x * (1 + self._t)

    def backward(self, dy, mp_comm=None, need_dx=True):
        x, t = self._x, self._t
        dt = x.dtype.type
        inner = dt(self._C) * (1 + dt(3 * 0.044715) * x * x)
        return dy * (dt(0.5) * (1 + t) + dt(0.5) * x * (1 - t * t) * inner)

    def __repr__(self):
        return "GELU()"


def _gradient_rows(logits: np.ndarray, labels: np.ndarray, out):
    """(softmax - one-hot of the label, row by row: the gradient of each row's cross-entropy, written into out
    (a new array when None; out may be logits itself), and each row's log-probability of its label): one array
    of logits' size, no log-probabilities of the other classes."""
    rows = np.arange(logits.shape[0])
    grad = np.subtract(logits, logits.max(axis=1, keepdims=True), out=out)
    picked = grad[rows, labels]
    np.exp(grad, out=grad)
    total = grad.sum(axis=1, keepdims=True)
    grad /= total
    grad[rows, labels] -= 1
    return grad, picked - np.log(total[:, 0])


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, denominator: int, out=None):
    """Sum of per-sample cross-entropy / denominator, and its gradient w.r.t. logits (written into out, which
    may be logits itself when the caller has no further use for them).

    Dividing by the global batch size (not the local one) makes data-parallel gradients sum to the
    single-process mean.
    """
    grad, log_prob = _gradient_rows(logits, labels, out)
    loss = -log_prob.sum() / denominator
    grad /= denominator
    return loss, grad


def masked_cross_entropy(logits: np.ndarray, labels: np.ndarray, mask: np.ndarray, denominator: float, out=None):
    """Sum of the cross-entropy of the rows where mask is true / denominator, and its gradient (into out, as
    softmax_cross_entropy).

    MindSpore's CrossEntropyLoss with an input mask (padding ignored); the denominator is the number of
    unmasked tokens of the global batch, so data-parallel gradients sum to the single-process mean.
    """
    grad, log_prob = _gradient_rows(logits, labels, out)
    weight = mask.astype(logits.dtype) / logits.dtype.type(denominator)
    loss = -(log_prob * weight).sum()
    grad *= weight[:, None]
    return loss, grad
