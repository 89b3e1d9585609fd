"""Elastic continuation in the job (`tft.elastic: true`): a dead rank is not replaced; the survivors go on
with fewer ranks.

When no replacement can be had (tft.arf off), after the survivors have shrunk the world and agreed on the
newest step every replica set holds (dsim.ft.inprocess, as for a repair):
1. the largest layout the living count admits is chosen, keeping model parallel (and the pipeline stage
   count) and lowering data parallel; optimizer shard is kept when it divides the new dp, else 1;
2. the first living ranks (in their old order) form the new world; those left over wait idle until the job
   ends (they are not counted again: a second failure shrinks the training world);
3. every rank of the new layout builds its model without initial values, and its owned slices of every
   parameter and optimizer state are sent to it point to point from the ranks holding the agreed step
   (the overlap of each old owned slice with each new one, as resharding a checkpoint does, but in memory);
4. the training loop goes on from that step with the same global batch, split over the new dp.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
from mpi4py import MPI

from ..checkpoint.reshard import intersect
from ..checkpoint.loader import whole_slices
from ..parallel.layout import LayoutError, ParallelLayout, owned_slice
from . import ulfm

TAG = 0xE1A0
RELEASE = 0xE1A1


def smaller_layout(old: ParallelLayout, living: int) -> ParallelLayout:
    """The largest layout on at most `living` ranks with old's model parallel and stages (LayoutError if none)."""
    per_dp = old.model_parallel * old.pipeline_stage
    dp = living // per_dp
    if dp < 1:
        raise LayoutError(f"{living} living rank(s) cannot hold model_parallel={old.model_parallel} x "
                          f"pipeline_stage={old.pipeline_stage}")
    k = old.optimizer_shard if dp % old.optimizer_shard == 0 else 1
    return ParallelLayout(dp, old.model_parallel, k, old.pipeline_stage)


def pieces(specs, slots, old: ParallelLayout, new: ParallelLayout, source_of):
    """(tensor name, old box, new rank, new box, overlap, source) of every piece to move.

    source_of(old rank): the process that holds the old rank's slices at the agreed step. Replicas share a
    box: each distinct old box is sent once, from the first old rank's source.
    """
    for spec in specs:
        names = [spec.name] + [f"{slot}.{spec.name}" for slot in slots]
        boxes = {}
        for o in old.stage_ranks(spec.stage):
            boxes.setdefault(owned_slice(spec, old, o), source_of(o))
        for r in new.stage_ranks(spec.stage):
            nbox = owned_slice(spec, new, r)
            for obox, src in boxes.items():
                part = intersect(obox, nbox)
                if part is not None:
                    for name in names:
                        yield name, obox, r, nbox, part, src


def continue_smaller(run, comm, plan, cfg_of):
    """Steps 1-3 on every living process (collective over comm, the shrunk world); returns
    (new layout, new run or None on an idle process, the new world's comm ranks in comm)."""
    from ..engine.state import owned_pieces
    old = run.groups.layout
    new = smaller_layout(old, comm.size)
    run.factory.fit(cfg_of(new), new.world_size)   # the batch and micro-batches fit (ConfigError, on every process
    run.network.check(new)                        # alike, before anything moves), and the model's slicing does
    old_of = ulfm.world_ranks(comm, run.groups.world)          # comm rank -> old world rank
    comm_of = {o: i for i, o in enumerate(old_of)}
    me = comm.rank
    states = run.optimizer.states().get(plan.step, {})
    slots = sorted({name.split(".", 1)[0] for name, _, _ in run.optimizer.state_items()})
    moves = list(pieces(run.network.specs, slots, old, new, lambda o: comm_of[plan.writers[o]]))
    sends = []
    for i, (name, obox, r, _, part, src) in enumerate(moves):
        if src == me:
            data = np.ascontiguousarray(states[name][part.relative_to(obox)])
            sends.append((comm.Isend(data, dest=r, tag=TAG + i), data))
    active = me < new.world_size
    world = comm.Split(0 if active else MPI.UNDEFINED, me)
    fresh = None
    if active:
        fresh = run.factory.build(cfg_of(new), world, initialize=False)
        arrays = {name: arr for name, _, _, arr in owned_pieces(fresh.network, fresh.optimizer)}
        for i, (name, _, r, nbox, part, src) in enumerate(moves):
            if r == me:
                target = arrays[name][part.relative_to(nbox)]
                buf = np.empty(part.extents, dtype=target.dtype)
                comm.Recv(buf, source=src, tag=TAG + i)
                target[...] = buf
        whole_slices(fresh.network, fresh.groups.shard)
        fresh.optimizer.received(plan.step)
    MPI.Request.Waitall([s for s, _ in sends])
    return new, fresh


def adopt(run, fresh, cfg) -> None:
    """Make `run` (whose Model is inside the training loop) train on the new layout: swap in fresh's parts."""
    model = run.model
    model.network, model.optimizer, model.groups = fresh.network, fresh.optimizer, fresh.groups
    model.pipeline, model._buckets = fresh.model.pipeline, None
    run.network, run.optimizer, run.groups, run.cfg = fresh.network, fresh.optimizer, fresh.groups, cfg
    run.loader.sampler = fresh.loader.sampler


def new_config(cfg, layout: ParallelLayout):
    """cfg with the layout's data parallel and optimizer shard."""
    return replace(cfg, parallel=replace(cfg.parallel, data_parallel=layout.data_parallel,
                                         optimizer_shard=layout.optimizer_shard))


class Idle(Exception):
    """This process was left over by an elastic shrink: it waits, out of training, until the job ends."""

    def __init__(self, comm):
        super().__init__("idle")
        self.comm = comm


def wait_idle(comm) -> None:
    """Block until the job's rank 0 releases this process, or until the job can no longer (a failure)."""
    try:
        comm.recv(source=MPI.ANY_SOURCE, tag=RELEASE)
    except MPI.Exception:
        pass


def release_idle(idle) -> None:
    """(rank 0 of the training world, at the end) let every idle process of earlier shrinks go."""
    for comm, ranks in idle:
        for r in ranks:
            try:
                comm.send(None, dest=r, tag=RELEASE)
            except MPI.Exception:
                pass


def elapsed_ms(t0: float) -> float:
    return 1000 * (time.time() - t0)
