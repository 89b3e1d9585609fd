"""The parallel layout: how ranks map to (stage, dp, mp) coordinates and which slice of every tensor each holds.

Pure functions only (no MPI). This is the single source of truth for slicing: training, checkpointing
and group info all ask it.

Ranks are laid out like MindSpore's device matrix with model parallel innermost:
``rank = d * mp + m`` (so with dp=2, mp=4 rank 0 and rank 4 hold the same model-parallel slice).

Pipeline parallel (MindSpore's ``pipeline_stages``): the world is cut into p consecutive blocks of dp x mp
ranks, one per stage, ``rank = stage * dp * mp + d * mp + m``. A parameter lives on the ranks of one stage
(its spec's `stage`); dp, mp, optimizer-shard and replica groups are all inside a stage.

Optimizer parallel (MindSpore's ``optimizer_weight_shard_size``): the dp group is cut into groups of
``k`` consecutive dp indices; inside such an optimizer-shard group each of the k ranks owns and updates
1/k of the (model-parallel) slice along its first axis. A parameter whose first axis does not divide by
k stays whole on every rank of the group, as MindSpore does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


class LayoutError(ValueError):
    """A parallel layout that does not fit the world size or the model."""


@dataclass(frozen=True)
class ParallelLayout:
    """p stages of dp x mp ranks, optimizer state sharded over k ranks of each dp group."""

    data_parallel: int = 1
    model_parallel: int = 1
    optimizer_shard: int = 1
    pipeline_stage: int = 1

    def __post_init__(self):
        for name in ("data_parallel", "model_parallel", "optimizer_shard", "pipeline_stage"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.data_parallel % self.optimizer_shard:
            raise LayoutError(f"parallel.optimizer_shard={self.optimizer_shard} must divide "
                              f"data_parallel={self.data_parallel}")

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: dp x mp."""
        return self.data_parallel * self.model_parallel

    @property
    def world_size(self) -> int:
        return self.pipeline_stage * self.stage_size

    def check_world_size(self, world_size: int) -> None:
        """Raise LayoutError unless p x dp x mp equals the number of ranks."""
        if self.world_size != world_size:
            stages = f"pipeline_stage={self.pipeline_stage} x " if self.pipeline_stage > 1 else ""
            raise LayoutError(f"layout {stages}data_parallel={self.data_parallel} x model_parallel="
                              f"{self.model_parallel} = {self.world_size} ranks does not fit the world size {world_size}")

    # -- coordinates ---------------------------------------------------------------------------------
    def coords(self, rank: int) -> "RankCoords":
        """The (stage, dp, mp, shard group, shard index) coordinates of a rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside a world of {self.world_size}")
        stage, inner = divmod(rank, self.stage_size)
        d, m = divmod(inner, self.model_parallel)
        g, s = divmod(d, self.optimizer_shard)
        return RankCoords(rank=rank, dp=d, mp=m, shard_group=g, shard=s, stage=stage)

    def rank_of(self, dp: int, mp: int, stage: int = 0) -> int:
        return stage * self.stage_size + dp * self.model_parallel + mp

    def stage_ranks(self, stage: int) -> range:
        """The ranks of a pipeline stage."""
        return range(stage * self.stage_size, (stage + 1) * self.stage_size)

    def dp_group(self, rank: int) -> list[int]:
        """Ranks that share rank's model-parallel slice (gradients are averaged over them)."""
        c = self.coords(rank)
        return [self.rank_of(d, c.mp, c.stage) for d in range(self.data_parallel)]

    def mp_group(self, rank: int) -> list[int]:
        """Ranks that together hold one full copy of the stage's part of the model."""
        c = self.coords(rank)
        return [self.rank_of(c.dp, m, c.stage) for m in range(self.model_parallel)]

    def shard_group(self, rank: int) -> list[int]:
        """The k ranks of rank's dp group that split its optimizer state between them."""
        c = self.coords(rank)
        first = c.shard_group * self.optimizer_shard
        return [self.rank_of(d, c.mp, c.stage) for d in range(first, first + self.optimizer_shard)]

    def replica_group(self, rank: int) -> list[int]:
        """Ranks holding exactly the slices rank holds: same stage, mp index and shard index (incl. rank)."""
        c = self.coords(rank)
        k = self.optimizer_shard
        return [self.rank_of(d, c.mp, c.stage) for d in range(c.shard, self.data_parallel, k)]

    def neighbour(self, rank: int, offset: int) -> int:
        """The rank with rank's dp and mp indices in the stage `offset` away (+1 next, -1 previous)."""
        c = self.coords(rank)
        return self.rank_of(c.dp, c.mp, c.stage + offset)

    def describe(self) -> str:
        """dp=2 mp=4 k=1 (pp=2 first when there are stages): how logs and tools name a layout."""
        stages = f"pp={self.pipeline_stage} " if self.pipeline_stage > 1 else ""
        return f"{stages}dp={self.data_parallel} mp={self.model_parallel} k={self.optimizer_shard}"

    def to_dict(self) -> dict:
        out = {"data_parallel": self.data_parallel, "model_parallel": self.model_parallel,
               "optimizer_shard": self.optimizer_shard}
        if self.pipeline_stage > 1:  # records of layouts without stages stay as they were
            out["pipeline_stage"] = self.pipeline_stage
        return out


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp: int
    mp: int
    shard_group: int
    shard: int
    stage: int = 0


@dataclass(frozen=True)
class ParamSpec:
    """A parameter's global shape and how model parallelism splits it.

    mp_axis: None (replicated on the mp group), or the axis split into mp equal pieces.
    opt_shard: whether optimizer parallelism may slice it (only trainable weights; scalars never).
    stage: the pipeline stage whose ranks hold it (set by the network for the layout: Cell.place).
    """

    name: str
    shape: tuple
    mp_axis: Optional[int] = None
    opt_shard: bool = True
    stage: int = 0

    @property
    def split(self) -> str:
        return "replicated" if self.mp_axis is None else f"axis{self.mp_axis}"


@dataclass(frozen=True)
class Slice:
    """A box inside a global tensor: offsets and extents per axis."""

    offsets: tuple
    extents: tuple

    @property
    def index(self) -> tuple:
        """numpy index selecting this slice from the global tensor."""
        return tuple(slice(o, o + e) for o, e in zip(self.offsets, self.extents))

    def relative_to(self, outer: "Slice") -> tuple:
        """numpy index selecting this slice from the array of an enclosing slice."""
        return tuple(slice(o - oo, o - oo + e) for o, oo, e in zip(self.offsets, outer.offsets, self.extents))


def check_spec(spec: ParamSpec, layout: ParallelLayout) -> None:
    """Raise LayoutError if model parallelism cannot split the parameter evenly."""
    if spec.mp_axis is None:
        return
    size = spec.shape[spec.mp_axis]
    if size % layout.model_parallel:
        raise LayoutError(f"{spec.name}: axis {spec.mp_axis} of shape {tuple(spec.shape)} ({size}) is not "
                          f"divisible by model_parallel={layout.model_parallel}")


def mp_slice(spec: ParamSpec, layout: ParallelLayout, rank: int) -> Slice:
    """The model-parallel slice of a parameter on rank: what its forward pass uses."""
    check_spec(spec, layout)
    offsets = [0] * len(spec.shape)
    extents = list(spec.shape)
    if spec.mp_axis is not None:
        piece = spec.shape[spec.mp_axis] // layout.model_parallel
        offsets[spec.mp_axis] = layout.coords(rank).mp * piece
        extents[spec.mp_axis] = piece
    return Slice(tuple(offsets), tuple(extents))


def is_opt_sharded(spec: ParamSpec, layout: ParallelLayout) -> bool:
    """Whether optimizer parallelism slices this parameter (first local axis divisible by k)."""
    k = layout.optimizer_shard
    if k == 1 or not spec.opt_shard or not spec.shape:
        return False
    local0 = spec.shape[0] // (layout.model_parallel if spec.mp_axis == 0 else 1)
    return local0 % k == 0


def owned_slice(spec: ParamSpec, layout: ParallelLayout, rank: int) -> Slice:
    """The slice of a parameter (and of its optimizer state) that rank owns: updates and saves.

    The model-parallel slice, cut further along axis 0 by optimizer parallelism when it applies.
    """
    base = mp_slice(spec, layout, rank)
    if not is_opt_sharded(spec, layout):
        return base
    k = layout.optimizer_shard
    piece = base.extents[0] // k
    offsets = (base.offsets[0] + layout.coords(rank).shard * piece,) + base.offsets[1:]
    extents = (piece,) + base.extents[1:]
    return Slice(offsets, extents)


def holds(spec: ParamSpec, layout: ParallelLayout, rank: int) -> bool:
    """Whether rank holds a slice of the parameter: it is in the parameter's pipeline stage."""
    return layout.coords(rank).stage == spec.stage


def slice_table(specs: Sequence[ParamSpec], layout: ParallelLayout, rank: int) -> dict:
    """For every parameter: its mp slice (forward) and owned slice (update, save) on rank."""
    return {s.name: {"mp": mp_slice(s, layout, rank), "owned": owned_slice(s, layout, rank)} for s in specs}
