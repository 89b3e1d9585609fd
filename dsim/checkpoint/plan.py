"""The save plan of a layout: which ranks write which slices, and the metadata a checkpoint carries.

Pure functions of (layout, parameter specs, optimizer slots): no MPI, no files, so planning can be
timed and sized for any world size (65,536 ranks in milliseconds). They build exactly what the saver
(dsim/checkpoint/saver.py) writes:

- `save_plan`: every distinct slice of every parameter and optimizer state once, with the replica sets
  whose ranks hold (and, with sharded saves, each write) it; `SavePlan.for_rank(r)` is rank r's file.
- `graph_meta`: the `<prefix>-graph.meta` record (once per run);
- `commit_record`: the `<name>.commit` record (once per checkpoint; record.py describes it).
None of them grows with the world size: replica sets and holders are progressions (progression.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..parallel.layout import ParallelLayout, Slice, is_opt_sharded, owned_slice
from . import progression, record as rec
from .commit import shard_path
from .group_info import replica_ranges


@dataclass(frozen=True)
class PlannedSlice:
    """One distinct slice of a tensor, and which replica sets hold it (indices into SavePlan.replica_sets)."""

    kind: str            # "params" | "optimizer"
    name: str            # layer2.weight, moments.layer2.weight
    global_shape: tuple
    where: Slice
    split: str
    opt_sharded: bool
    holders: tuple

    @property
    def size(self) -> int:
        """Number of elements in the slice."""
        n = 1
        for e in self.where.extents:
            n *= e
        return n


@dataclass(frozen=True)
class SavePlan:
    """All distinct slices of a checkpoint; every rank of a holder set writes the slice to its own file."""

    layout: ParallelLayout
    replica_sets: list   # range per replica set (index (stage * k + s) * mp + m)
    slices: tuple

    def set_of(self, rank: int) -> int:
        """Index of rank's replica set (the order of group_info.replica_sets: stage, shard index, mp index)."""
        c = self.layout.coords(rank)
        return (c.stage * self.layout.optimizer_shard + c.shard) * self.layout.model_parallel + c.mp

    def for_rank(self, rank: int) -> list:
        """The slices rank writes (its owned slices of every parameter and optimizer state)."""
        s = self.set_of(rank)
        return [p for p in self.slices if s in p.holders]

    def elements_per_rank(self, rank: int) -> int:
        return sum(p.size for p in self.for_rank(rank))

    def holders(self, planned: PlannedSlice) -> list:
        """The ranks holding a planned slice: the union of its replica sets, as progressions (all in one stage)."""
        period = self.layout.model_parallel * self.layout.optimizer_shard
        stage = planned.holders[0] // period
        return progression.residues([h - stage * period for h in planned.holders], period,
                                    self.layout.stage_ranks(stage))


def save_plan(layout: ParallelLayout, specs, slots=()) -> SavePlan:
    """The save plan of a layout: one entry per distinct (tensor, slice), with the replica sets holding it.

    Work and size grow with the number of distinct slices (tensors x mp x optimizer shard), not with the
    world size. A parameter's slices are held by replica sets of its pipeline stage.
    """
    mp, k = layout.model_parallel, layout.optimizer_shard
    specs = list(specs)
    entries = []
    for spec in specs:
        holders = {}  # slice -> replica-set indices, in first-seen order
        for s in range(k):
            for m in range(mp):
                where = owned_slice(spec, layout, layout.rank_of(s, m, spec.stage))
                holders.setdefault(where, []).append((spec.stage * k + s) * mp + m)
        sharded = is_opt_sharded(spec, layout)
        for where, sets in holders.items():
            entries.append(PlannedSlice("params", spec.name, tuple(spec.shape), where, spec.split, sharded,
                                        tuple(sets)))
    # optimizer state: each slot holds the owned slice of every parameter (named <slot>.<param>)
    params = list(entries)
    for slot in slots:
        entries += [PlannedSlice("optimizer", f"{slot}.{p.name}", p.global_shape, p.where, p.split, p.opt_sharded,
                                 p.holders) for p in params]
    return SavePlan(layout, replica_ranges(layout), tuple(entries))


def graph_meta(prefix: str, layout: ParallelLayout, specs, slots=()) -> dict:
    """The `<prefix>-graph.meta` record as the saver writes it when training begins."""
    specs = list(specs)
    return {"format": GRAPH_META_FORMAT, "prefix": prefix, "layout": layout.to_dict(),
            "world_size": layout.world_size,
            "parameters": [{"name": s.name, "shape": list(s.shape), "split": s.split,
                            "opt_sharded": is_opt_sharded(s, layout),
                            **({"stage": s.stage} if layout.pipeline_stage > 1 else {})} for s in specs],
            "optimizer_state": sorted(f"{slot}.{s.name}" for slot in slots for s in specs),
            "replica_sets": replica_sets_json(layout)}


GRAPH_META_FORMAT = "dsim-graph-meta/2"   # /1 listed every replica set's ranks


def replica_sets_json(layout: ParallelLayout) -> list:
    """Every replica set once, a progression each: what the graph meta and the commit record store."""
    return [progression.to_json(r) for r in replica_ranges(layout)]


def slices_json(plan: SavePlan, integrated_save: bool = False) -> list:
    """The commit record's `slices`: every distinct slice once with the ranks whose file holds it.

    An integrated save is one file of whole tensors, rank 0's.
    """
    if integrated_save:
        seen = {}
        for p in plan.slices:
            seen.setdefault(f"{p.kind}/{p.name}", p.global_shape)
        return [{"tensor": t, "global_shape": list(shape), "offsets": [0] * len(shape), "extents": list(shape),
                 "holders": [progression.to_json(range(0, 1))]} for t, shape in seen.items()]
    return [{"tensor": f"{p.kind}/{p.name}", "global_shape": list(p.global_shape), "offsets": list(p.where.offsets),
             "extents": list(p.where.extents), "holders": progression.set_to_json(plan.holders(p))}
            for p in plan.slices]


def commit_record(name: str, prefix: str, plan: SavePlan, epoch: int, step_in_epoch: int, global_step: int,
                  sequence: int, integrated_save: bool = False, time: float = 0.0, nbytes: int = 0,
                  host_of=None) -> dict:
    """The `<name>.commit` record as the saver builds it (record.py), before commit.write_commit adds the pin
    of its digest file. nbytes: the total size of the files; host_of: each rank's host (dsim.parallel.hosts), kept
    as host -> progressions. O(distinct slices and hosts): no entry per rank."""
    layout = plan.layout
    world = layout.world_size
    files = ({"template": f"{name}.h5", "ranks": [progression.to_json(range(0, 1))]} if integrated_save else
             {"template": str(shard_path("", rec.RANK, name)), "ranks": [progression.to_json(range(0, world))]})
    return {"format": rec.FORMAT, "name": name, "prefix": prefix, "epoch": epoch, "step_in_epoch": step_in_epoch,
            "global_step": global_step, "sequence": sequence, "time": time, "world_size": world,
            "layout": layout.to_dict(), "integrated_save": integrated_save, "files": files, "bytes": nbytes,
            "replica_sets": replica_sets_json(layout), "slices": slices_json(plan, integrated_save),
            **({"hosts": rec.hosts_json(host_of, layout.model_parallel * layout.optimizer_shard)} if host_of else {})}
