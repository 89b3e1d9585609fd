"""Loss functions as objects (MindSpore's nn.SoftmaxCrossEntropyWithLogits, nn.CrossEntropyLoss).

A loss is called as `loss_fn(logits, labels, global_batch_size, dp_comm)` and returns this rank's share of
the global-batch mean loss and its gradient w.r.t. the logits (backward is hand-written, as every layer's).
`Model(net, loss_fn=...)` makes it the network's loss; without one the network's own (`Cell.loss`) is used.
"""
from __future__ import annotations

from .layers import softmax_cross_entropy


class SoftmaxCrossEntropyWithLogits:
    """Softmax cross-entropy of logits (batch, classes) against integer labels, mean over the global batch."""

    def __init__(self, sparse: bool = True, reduction: str = "mean"):
        if not sparse or reduction != "mean":
            raise ValueError(f"SoftmaxCrossEntropyWithLogits: dsim has sparse=True, reduction='mean' only, "
                             f"got sparse={sparse!r}, reduction={reduction!r}")
        self.sparse, self.reduction = sparse, reduction

    def __call__(self, logits, labels, global_batch_size: int, dp_comm=None):
        # divided by the global batch, not the local one: the dp all-reduce sums the shares to the mean
        return softmax_cross_entropy(logits, labels, global_batch_size)

    def __repr__(self):
        return f"{type(self).__name__}(sparse={self.sparse}, reduction={self.reduction!r})"


class CrossEntropyLoss(SoftmaxCrossEntropyWithLogits):
    """nn.CrossEntropyLoss on class indices: the same, mean over the global batch."""

    def __init__(self, reduction: str = "mean"):
        super().__init__(True, reduction)
