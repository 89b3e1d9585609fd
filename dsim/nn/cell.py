"""Cell: a network whose layers declare how their parameters are sliced; build() makes this rank's slices.

A network subclasses Cell and sets `self.layers` (every layer, in forward order; those with parameters
declare `specs` and `inits`), then writes forward, backward and (optionally) loss. The order of the
layers is the order of the parameters: of the gradient bucket, the optimizer, the checkpoint files.

For pipeline parallel a network also cuts itself into units (`pipeline_units`: a Sequential's units are
its parameter layers, each with the activations that follow it), says which stage each unit goes to
(`unit_stages`: spread evenly by default) and how a step's loss is taken per micro-batch (`micro_loss`);
build() then makes only the slices of the rank's stage (dsim.parallel.pipeline runs the units).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import aligned
from ..parallel.groups import check_revoked
from ..parallel.layout import LayoutError, ParallelLayout, check_spec, mp_slice
from .layers import softmax_cross_entropy
from .parameter import Parameter, initial_slice


class Unit:
    """A piece of a network that one pipeline stage runs whole: layers one after another.

    `layers` are the objects whose state (activations kept for backward) belongs to the unit; a unit's
    forward takes and gives the carry between units (an array, or a tuple of arrays), with the
    micro-batch's inputs beside it (for masks); backward takes and gives the carry's gradient.
    """

    def __init__(self, layers):
        self.layers = list(layers)

    def forward(self, x, inputs, mp_comm):
        for layer in self.layers:
            check_revoked()
            x = layer.forward(x, mp_comm)
        return x

    def backward(self, dy, mp_comm, need_dx=True):
        for i in range(len(self.layers) - 1, -1, -1):
            check_revoked()
            dy = self.layers[i].backward(dy, mp_comm, need_dx=need_dx or i > 0)
        return dy


def spread(units: int, stages: int, what: str) -> list:
    """The stage of each of `units` consecutive units cut into `stages` near-equal runs (MindSpore's
    even spread); LayoutError when there are more stages than units."""
    if stages > units:
        raise LayoutError(f"parallel.pipeline_stage={stages} exceeds the {units} {what}: every stage needs one")
    return [i * stages // units for i in range(units)]


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
        if layout.pipeline_stage > 1:
            self.unit_stages(layout.pipeline_stage)

    # -- pipeline parallel ---------------------------------------------------------------------------
    def pipeline_units(self) -> list:
        """The network cut into units, in forward order (see Unit)."""
        raise LayoutError(f"{type(self).__name__} cannot be cut into pipeline stages")

    def unit_stages(self, stages: int) -> list:
        """The pipeline stage of each unit: spread evenly (a network may pin some, e.g. the head last)."""
        return spread(len(self.pipeline_units()), stages, f"layers of {self.describe()}")

    def place(self, layout: ParallelLayout) -> None:
        """Record in every parameter's spec the pipeline stage that holds it (all stage 0 without stages)."""
        if layout.pipeline_stage == 1:
            stage_of = {}
        else:
            units = self.pipeline_units()
            stage_of = {id(layer): stage for unit, stage in zip(units, self.unit_stages(layout.pipeline_stage))
                        for layer in _reachable(unit.layers)}
        for layer in self.param_layers():
            layer.specs = [replace(spec, stage=stage_of.get(id(layer), 0)) for spec in layer.specs]

    def prepare(self, inputs):
        """The first unit's input from a micro-batch's inputs."""
        return inputs

    def loss_denominator(self, inputs, labels, global_batch_size: int, dp_comm):
        """What each micro-batch's loss is divided by: the global batch size (its mean over the global batch)."""
        return global_batch_size

    def micro_loss(self, outputs, inputs, labels, denominator):
        """(a micro-batch's share of the global-batch mean loss, its gradient w.r.t. outputs)."""
        return softmax_cross_entropy(outputs, labels, denominator)

    def build(self, layout: ParallelLayout, rank: int, seed: int, dtype, initialize: bool = True) -> "Cell":
        """Create this rank's slices of every parameter (MindSpore's model.build before loading).

        initialize=False leaves them zero (no random draw of whole tensors): for a process whose every
        slice is about to be received or loaded, e.g. a warm spare taking a dead rank's place.
        """
        self.check(layout)
        self.place(layout)
        self.dtype = np.dtype(dtype)
        stage = layout.coords(rank).stage
        self.params = []
        for layer in self.param_layers():
            layer.params = []
            for spec in layer.specs:
                if spec.stage != stage:
                    continue  # another pipeline stage holds it
                where = mp_slice(spec, layout, rank)
                if initialize:
                    local = aligned.empty(where.extents, dtype)
                    initial_slice(spec, seed, layer.inits[spec.name], where, local)
                else:
                    local = aligned.zeros(where.extents, dtype)
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
            check_revoked()
            x = layer.forward(x, mp_comm)
        return x

    def backward(self, dout, mp_comm):
        dy = dout
        for i in range(len(self.layers) - 1, -1, -1):
            check_revoked()
            dy = self.layers[i].backward(dy, mp_comm, need_dx=i > 0)

    def pipeline_units(self) -> list:
        """One unit per layer with parameters, with the layers without parameters that follow it."""
        units = []
        for layer in self.layers:
            if getattr(layer, "specs", None) or not units:
                units.append([])
            units[-1].append(layer)
        return [Unit(layers) for layers in units]


def _reachable(roots) -> list:
    """Every layer-like object (one with a forward) reachable from roots through attributes and lists."""
    seen, out, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not hasattr(obj, "forward"):
            continue
        seen.add(id(obj))
        out.append(obj)
        for value in vars(obj).values():
            if isinstance(value, (list, tuple)):
                todo.extend(value)
            elif hasattr(value, "forward") and not isinstance(value, type):
                todo.append(value)
    return out
