"""Layers with hand-written backward passes and Megatron-style model parallelism.

A layer's `split` says how the mp group shares it:
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

_WEIGHT_AXIS = {  # which axis of the stored weight each split cuts
    ("matmul", "column"): 1, ("matmul", "row"): 0,
    ("dense", "column"): 0, ("dense", "row"): 1,
}


class Dense:
    """MindSpore's nn.Dense: weight (out, in), bias (out), y = x @ W.T + b.

    With kind="matmul" it is the seeds' MatMulCell: one parameter `param` of shape (in, out), y = x @ P.
    """

    def __init__(self, name: str, in_features: int, out_features: int, split=None, kind="dense"):
        self.name, self.split, self.kind = name, split, kind
        self.in_features, self.out_features = in_features, out_features
        axis = _WEIGHT_AXIS.get((kind, split))
        if kind == "matmul":
            self.specs = [ParamSpec(f"{name}.param", (in_features, out_features), axis)]
        else:
            bias_axis = 0 if split == "column" else None
            self.specs = [ParamSpec(f"{name}.weight", (out_features, in_features), axis),
                          ParamSpec(f"{name}.bias", (out_features,), bias_axis)]
        self.params = []  # bound by Network.build
        self._x = None

    @property
    def fan_in(self) -> int:
        return self.in_features

    def _weight(self):
        w = self.params[0].data
        return w if self.kind == "matmul" else w.T  # as (in, out)

    def forward(self, x, mp_comm):
        self._x = x
        y = x @ self._weight()
        if self.split == "row":
            y = allreduce_sum(mp_comm, y)
        if self.kind == "dense":
            y = y + self.params[1].data
        return y

    def backward(self, dy, mp_comm, need_dx=True):
        """Store parameter gradients; return the input gradient (None when not needed)."""
        x = self._x
        dw = x.T @ dy  # (in, out) [local]
        self.params[0].grad = dw if self.kind == "matmul" else dw.T
        if self.kind == "dense":
            self.params[1].grad = dy.sum(axis=0)
        if not need_dx:
            return None
        dx = dy @ self._weight().T
        if self.split == "column":
            dx = allreduce_sum(mp_comm, dx)
        return dx

    def __repr__(self):
        return f"{type(self).__name__}({self.name}, {self.in_features}->{self.out_features}, split={self.split})"


class ReLU:
    """max(x, 0), elementwise: works on full activations and on shards alike."""

    def forward(self, x, mp_comm):
        self._mask = x > 0
        return np.where(self._mask, x, 0)

    def backward(self, dy, mp_comm, need_dx=True):
        return np.where(self._mask, dy, 0)

    def __repr__(self):
        return "ReLU()"


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, denominator: int):
    """Sum of per-sample cross-entropy / denominator, and its gradient w.r.t. logits.

    Dividing by the global batch size (not the local one) makes data-parallel gradients sum to the
    single-process mean.
    """
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    log_prob = shifted - np.log(total)
    n = logits.shape[0]
    loss = -log_prob[np.arange(n), labels].sum() / denominator
    grad = exp / total
    grad[np.arange(n), labels] -= 1
    return loss, grad / denominator
