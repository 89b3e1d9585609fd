"""The seeds' networks: a flatten, then Dense layers with ReLU between them.

- "network": the last-gasp page's Network, 784 -> 512 -> 5120 -> 5120 -> 512 -> 10 (layer1 a MatMulCell).
- "uce_network": the UCE page's Network, 784 -> 512 -> 512 -> 10.
`hidden` overrides the widths (a small variant keeps tests fast).

Model-parallel splits alternate column, row, column, row...; the last layer is row-split when its
input is a shard and replicated otherwise, so every pair costs one all-reduce each way.
"""
from __future__ import annotations

import numpy as np

from ..parallel.layout import ParallelLayout, check_spec, mp_slice
from .layers import Dense, ReLU
from .parameter import Parameter, init_global

ARCHITECTURES = {
    "network": [512, 5120, 5120, 512],
    "uce_network": [512, 512],
}
IN_FEATURES, NUM_CLASSES = 28 * 28, 10


class Network:
    """An MLP whose parameters are sliced over a model-parallel group."""

    def __init__(self, hidden, in_features=IN_FEATURES, num_classes=NUM_CLASSES):
        widths = [in_features, *hidden, num_classes]
        n = len(widths) - 1
        self.layers = []
        for i in range(n):
            last = i == n - 1
            split = ("row" if i % 2 else None) if last else ("row" if i % 2 else "column")
            kind = "matmul" if i == 0 else "dense"
            self.layers.append(Dense(f"layer{i + 1}", widths[i], widths[i + 1], split, kind))
            if not last:
                self.layers.append(ReLU())
        self.params = []

    @property
    def specs(self):
        return [s for layer in self.layers for s in getattr(layer, "specs", [])]

    def build(self, layout: ParallelLayout, rank: int, seed: int, dtype) -> "Network":
        """Create this rank's slices of every parameter (MindSpore's model.build before loading)."""
        for spec in self.specs:
            check_spec(spec, layout)
        self.params = []
        for layer in self.layers:
            if not isinstance(layer, Dense):
                continue
            layer.params = []
            for spec in layer.specs:
                kind = "bias" if spec.name.endswith(".bias") else "weight"
                full = init_global(spec, seed, kind, layer.fan_in)
                local = full[mp_slice(spec, layout, rank).index]
                p = Parameter(spec, layout, rank, np.ascontiguousarray(local, dtype=dtype))
                layer.params.append(p)
                self.params.append(p)
        return self

    def forward(self, images, mp_comm, halfway=None):
        """Logits of this rank's batch; `halfway`, if given, is called after half the layers (a fault point)."""
        x = images.reshape(images.shape[0], -1)
        for i, layer in enumerate(self.layers):
            if halfway is not None and i == len(self.layers) // 2:
                halfway()
            x = layer.forward(x, mp_comm)
        return x

    def backward(self, dlogits, mp_comm):
        dy = dlogits
        for i in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[i].backward(dy, mp_comm, need_dx=i > 0)

    def trainable_params(self):
        return list(self.params)

    def __repr__(self):
        return "Network(\n  " + "\n  ".join(map(repr, self.layers)) + "\n)"


def create_network(name: str, hidden=None) -> Network:
    """A network by the seed's name, optionally with other hidden widths."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown model.name {name!r}; choose from {sorted(ARCHITECTURES)}")
    return Network(hidden if hidden is not None else ARCHITECTURES[name])
