"""The seeds' MLPs: a flatten, then Dense layers with ReLU between them.

- "network": the last-gasp page's Network, 784 -> 512 -> 5120 -> 5120 -> 512 -> 10 (layer1 a MatMulCell).
- "uce_network": the UCE page's Network, 784 -> 512 -> 512 -> 10.
`hidden` overrides the widths (a small variant keeps tests fast).

Model-parallel splits alternate column, row, column, row...; the last layer is row-split when its
input is a shard and replicated otherwise, so every pair costs one all-reduce each way.
"""
from __future__ import annotations

from .cell import Sequential
from .layers import Dense, ReLU

ARCHITECTURES = {
    "network": [512, 5120, 5120, 512],
    "uce_network": [512, 512],
}
IN_FEATURES, NUM_CLASSES = 28 * 28, 10


class Network(Sequential):
    """An MLP whose parameters are sliced over a model-parallel group."""

    def __init__(self, hidden, in_features=IN_FEATURES, num_classes=NUM_CLASSES):
        super().__init__()
        widths = [in_features, *hidden, num_classes]
        n = len(widths) - 1
        for i in range(n):
            last = i == n - 1
            split = ("row" if i % 2 else None) if last else ("row" if i % 2 else "column")
            kind = "matmul" if i == 0 else "dense"
            self.layers.append(Dense(f"layer{i + 1}", widths[i], widths[i + 1], split, kind))
            if not last:
                self.layers.append(ReLU())

    def forward(self, images, mp_comm, halfway=None):
        """Logits of this rank's batch (images flattened first)."""
        return super().forward(images.reshape(images.shape[0], -1), mp_comm, halfway)

    def prepare(self, images):
        """The first layer's input: the images flattened."""
        return images.reshape(images.shape[0], -1)

    def describe(self) -> str:
        dense = [layer for layer in self.layers if isinstance(layer, Dense)]
        return "-".join(str(w) for w in [dense[0].in_features] + [layer.out_features for layer in dense])
