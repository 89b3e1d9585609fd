"""Cell: a network whose layers declare how their parameters are sliced; build() makes this rank's slices.

A network subclasses Cell and sets `self.layers` (every layer, in forward order; those with parameters
declare `specs` and `inits`), then writes forward, backward and (optionally) loss. The order of the
layers is the order of the parameters: of the gradient bucket, the optimizer, the checkpoint files.
"""
from __future__ import annotations

import numpy as np

from ..parallel.layout import ParallelLayout, check_spec, mp_slice
from .layers import softmax_cross_entropy
from .parameter import Parameter, initial_value


class Cell:
    """Base of dsim's networks: parameters, build, and the default loss (softmax cross-entropy)."""

    input_kind = "image"      # what the data must give: "image" or "tokens"
    image_size = None         # "image" networks: the side their input must have (None: the dataset's own)

    def __init__(self):
        self.layers = []
        self.params = []

    def param_layers(self):
        return [layer for layer in self.layers if getattr(layer, "specs", None)]

    @property
    def specs(self):
        return [s for layer in self.param_layers() for s in layer.specs]

    def check(self, layout: ParallelLayout) -> None:
        """Raise LayoutError when the layout cannot slice this network (a message naming the numbers)."""
        for spec in self.specs:
            check_spec(spec, layout)

    def build(self, layout: ParallelLayout, rank: int, seed: int, dtype, initialize: bool = True) -> "Cell":
        """Create this rank's slices of every parameter (MindSpore's model.build before loading).

        initialize=False leaves them zero (no random draw of whole tensors): for a process whose every
        slice is about to be received or loaded, e.g. a warm spare taking a dead rank's place.
        """
        self.check(layout)
        self.params = []
        for layer in self.param_layers():
            layer.params = []
            for spec in layer.specs:
                where = mp_slice(spec, layout, rank)
                if initialize:
                    local = initial_value(spec, seed, layer.inits[spec.name])[where.index]
                    local = np.ascontiguousarray(local, dtype=dtype)
                else:
                    local = np.zeros(where.extents, dtype=dtype)
                p = Parameter(spec, layout, rank, local)
                layer.params.append(p)
                self.params.append(p)
        return self

    def loss(self, outputs, labels, global_batch_size: int, dp_comm):
        """(this rank's share of the global-batch mean loss, its gradient w.r.t. outputs)."""
        return softmax_cross_entropy(outputs, labels, global_batch_size)

    def trainable_params(self):
        return list(self.params)

    def describe(self) -> str:
        """A short description for the run's header line."""
        return type(self).__name__

    def __repr__(self):
        return f"{type(self).__name__}(\n  " + "\n  ".join(map(repr, self.layers)) + "\n)"


class Sequential(Cell):
    """A Cell whose layers run one after another: forward in order, backward in reverse."""

    def forward(self, x, mp_comm, halfway=None):
        """Outputs of this rank's batch; `halfway`, if given, is called after half the layers (a fault point)."""
        for i, layer in enumerate(self.layers):
            if halfway is not None and i == len(self.layers) // 2:
                halfway()
            x = layer.forward(x, mp_comm)
        return x

    def backward(self, dout, mp_comm):
        dy = dout
        for i in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[i].backward(dy, mp_comm, need_dx=i > 0)
