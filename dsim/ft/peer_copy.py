"""Peer copies in memory (tft.peer_copy_every: k; Gemini, SOSP'23): every k steps each rank's state is copied into the
memory of a rank on another host, its keeper, so that the last gasp can save a rank that has no living replica.

The protocol, on every rank (its own communicator, a Dup of the world, so nothing mixes with training traffic):
1. begin       the keepers from the hosts MPI found (`keepers`: pure, below), a permutation so that each rank holds
               one copy, on another host wherever the hosts allow it, not a replica of the same slice where
               avoidable; each rank sends its keeper the description of its state (names, slices, shapes: once),
               and both allocate two buffers: two snapshots of its own state, two copies of its origin's (the rank
               whose copy it keeps);
2. step end s  (s % k == 0) this rank's owned state (parameters, optimizer state) is copied into the snapshot buffer
               not holding the previous snapshot (np.copyto: nothing parameter-sized is allocated), then sent to the
               keeper (Isend) while the origin's copy is received (Irecv) into the copy buffer not holding the last
               complete copy: a copy in flight never overwrites the last complete one;
3. step end s+1 the exchange is waited for (Runtime.collective: a watched wait), so it overlaps one step's compute;
               the copy of s is then complete on this end, and kept with its step;
4. a failure   (dsim.ft.last_gasp) each survivor offers the steps of its own snapshots and of the complete copies it
               keeps; the newest step at which every rank's state is held (by itself, a living replica or the
               living keeper of its copy) is saved (`plan`), the dead ranks' files written by their keepers.
The rest of a rank's state is a function of the step: the data position, the learning rate and every random draw
derive from the seed and the global step (checkpoint.save.resume_meta), so a copy needs nothing else.

With Open MPI 5.0 this covers ranks that die while their host's daemon lives (kill -9, a fault plan's `node` failure);
a whole host's crash ends the job at once (docs/design/node-faults.md), the copies with it: docs/design/peer-copies.md.
On one host the copies are in another rank's memory on the same host: they protect against a rank's loss only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from mpi4py import MPI

from .. import aligned
from ..checkpoint.format import Tensor
from ..checkpoint.group_info import replica_sets
from ..checkpoint.save import state_tensors
from ..engine.callbacks import Callback
from ..engine.state import owned_pieces
from ..log import event, say

TAG = 52
ALIGN = 64  # each tensor's offset in a flat buffer: any dtype's views stay aligned
HOST, SLICE = 3, 1  # what a keeper costs: on its origin's host (worse than any two replicas), a replica of its slice


def keepers(hosts, sets=()) -> list[int]:
    """keeper[r]: the rank that keeps rank r's copy, from each rank's host (hosts[r]) and the replica sets.

    A permutation (each rank keeps one copy) with no rank its own keeper (a world of one rank: itself, no copy). Ranks
    grouped by host, the largest host first, each kept by the rank as many places on as the largest host has ranks:
    every keeper is on another host whenever no host holds more than half the ranks (else as few as can be share a
    host: twice the largest host's ranks minus the world). Then two ranks swap keepers while that makes fewer keepers
    replicas of their origin's slice (a replica holds the same state: useless as a copy), never more on one host."""
    n = len(hosts)
    if n < 2:
        return list(range(n))
    order_of = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    size = {h: hosts.count(h) for h in order_of}
    order = sorted(range(n), key=lambda r: (-size[hosts[r]], order_of[hosts[r]], r))
    largest = max(size.values())
    shift = largest if largest < n else 1
    keeper = [0] * n
    for i, r in enumerate(order):
        keeper[r] = order[(i + shift) % n]
    set_of = {r: i for i, g in enumerate(sets) for r in g}

    def cost(r, k):
        return (HOST * (hosts[k] == hosts[r] and len(order_of) > 1) + SLICE * (k != r and set_of.get(k, -1) ==
                                                                               set_of.get(r, -2)) + 100 * (k == r))
    improved = True
    while improved:
        improved = False
        for r in range(n):
            if not cost(r, keeper[r]):
                continue
            for q in range(n):
                if q != r and cost(r, keeper[q]) + cost(q, keeper[r]) < cost(r, keeper[r]) + cost(q, keeper[q]):
                    keeper[r], keeper[q] = keeper[q], keeper[r]
                    improved = True
                    break
    return keeper


@dataclass
class CopyPlan:
    """The step the last gasp saves from snapshots and copies, who writes each rank's file, and which of them come
    from a keeper's copy (rank -> its keeper)."""

    step: int
    writers: dict
    copied: dict = field(default_factory=dict)


def plan(own: dict, kept: dict, sets, world_size: int) -> Optional[CopyPlan]:
    """The newest step at which every rank's state is held, or None.

    own: living rank -> the steps of its own state it can write (its live states and snapshots); kept: living rank ->
    (origin, the steps of the complete copies of the origin it keeps). A rank's file is written by itself, else by a
    living replica of its slice holding that step, else by the living keeper of its copy of that step."""
    set_of = {r: g for g in sets for r in g}
    steps = sorted(set().union(*own.values()), reverse=True) if own else []
    for step in steps:
        writers, copied = {}, {}
        for r in range(world_size):
            holder = next((q for q in [r, *set_of.get(r, [])] if step in own.get(q, ())), None)
            if holder is None:
                holder = next((h for h, (origin, held) in sorted(kept.items()) if origin == r and step in held), None)
                if holder is None:
                    break
                copied[r] = holder
            writers[r] = holder
        else:
            return CopyPlan(step, writers, copied)
    return None


def _layout(specs) -> tuple:
    """(offsets, total bytes) of tensors (shape, dtype) laid one after the other in a flat buffer, ALIGN apart."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


def _views(buffer, names, specs, offsets) -> dict:
    """name -> the array view of each tensor in a flat byte buffer."""
    out = {}
    for name, (shape, dtype), off in zip(names, specs, offsets):
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out[name] = buffer[off:off + nbytes].view(dtype).reshape(shape)
    return out


def mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


class PeerCopies(Callback):
    """The copies of one rank: its snapshots, the copies of its origin it keeps, the exchange in flight."""

    def __init__(self, run, every: int):
        self.run, self.every = run, every
        self.comm = None               # the copies' own communicator (None: off, a world of one rank)
        self.keeper = self.origin = None
        self.own = [None, None]        # two snapshots of this rank's state: flat buffers, their views, their steps
        self.own_views = [None, None]
        self.own_steps = [None, None]
        self.held = [None, None]       # two copies of the origin's state: flat buffers, views, steps once complete
        self.held_views = [None, None]
        self.held_steps = [None, None]
        self.held_meta = []            # the origin's tensors: (kind, name, global shape, slice, split, opt_sharded)
        self.flight = None             # (step, buffer index, [send, receive]) of the exchange in flight
        self.turn = 0                  # the buffer index of the next exchange
        self.seconds = 0.0             # time in the step-end hook (snapshot, exchange started, waited for)
        self.waited = 0.0              # of which waiting for the exchange
        self.steps = self.copies = 0

    # -- 1. begin ---------------------------------------------------------------------------------------------
    def begin(self, run_context):
        run = self.run
        world = run.groups.world
        if world.size == 1:
            say(f"peer copies every {self.every} steps: off, a world of one rank has no other rank to keep them")
            return
        hosts = run.groups.hosts.names
        keeper = keepers(hosts, replica_sets(run.groups.layout))
        me = world.rank
        sizes = self.setup(run.runtime.collective(world.Dup), keeper[me], keeper.index(me))
        if me == 0:
            say(self.describe(hosts, keeper, sizes))
            event("peer_copies", every=self.every, keepers=keeper, bytes=[2 * own + 2 * held for own, held in sizes])

    def setup(self, comm, keeper: int, origin: int) -> list:
        """Take comm (the copies' own), tell the keeper what this rank's state is, learn the origin's, allocate the
        buffers; every rank's (own state, origin's state) bytes (collective over comm)."""
        runtime = self.run.runtime
        self.comm, self.keeper, self.origin = comm, keeper, origin
        mine = [(t.kind, t.name, tuple(t.global_shape), t.where, t.split, t.opt_sharded, t.data.shape, t.data.dtype.str)
                for t in state_tensors(self.run.network, self.run.optimizer)]
        theirs = runtime.collective(comm.sendrecv, mine, dest=keeper, source=origin)
        for buffers, views, described in ((self.own, self.own_views, mine), (self.held, self.held_views, theirs)):
            names, specs = [d[1] for d in described], [(d[6], d[7]) for d in described]
            offsets, nbytes = _layout(specs)
            for i in range(2):
                buffers[i] = aligned.zeros((nbytes,), np.uint8)
                views[i] = _views(buffers[i], names, specs, offsets)
        self.held_meta = [d[:6] for d in theirs]
        return runtime.collective(comm.allgather, (self.own[0].nbytes, self.held[0].nbytes))

    def describe(self, hosts, keeper, sizes) -> str:
        """The run's line on its peer copies: where rank 0's copy is kept, the memory they take per rank."""
        own, held = sizes[0]
        most = max(2 * o + 2 * h for o, h in sizes)
        cost = (f"2 snapshots of its own + 2 copies of another's (the last complete, the next in flight): "
                f"{mib(2 * own + 2 * held)} on rank 0, at most {mib(most)} per rank")
        if len(set(hosts)) == 1:
            return (f"peer copies every {self.every} steps, each rank's state in another rank's memory on this one "
                    f"host (against a rank's loss only, not the host's; rank 0's, {mib(own)}, in rank {keeper[0]}'s): "
                    f"{cost}")
        shared = [r for r, k in enumerate(keeper) if hosts[k] == hosts[r]]
        also = (f"; rank(s) {', '.join(map(str, shared))} kept on their own host (it holds more than half the ranks)"
                if shared else "")
        return (f"peer copies every {self.every} steps, each rank's state in the memory of a rank on another host "
                f"(rank 0's, {mib(own)}, in rank {keeper[0]}'s on {hosts[keeper[0]]}): {cost}{also}")

    # -- 2, 3. the step ends --------------------------------------------------------------------------------------
    def step_end(self, run_context):
        if self.comm is None:
            return
        start = time.perf_counter()
        if self.flight is not None:
            self._complete()
        step = self.run.optimizer.global_step
        if step % self.every == 0 and step not in self.own_steps:
            self._start(step)
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def _start(self, step: int) -> None:
        """Snapshot this rank's state of `step` and start the exchange with the keeper and the origin."""
        i = self.turn
        views = self.own_views[i]
        for name, _, _, arr in owned_pieces(self.run.network, self.run.optimizer):
            np.copyto(views[name], arr)
        self.own_steps[i], self.held_steps[i] = step, None  # (held[i] is overwritten: never the last complete copy)
        self.flight = (step, i, [self.comm.Isend([self.own[i], MPI.BYTE], self.keeper, TAG),
                                 self.comm.Irecv([self.held[i], MPI.BYTE], self.origin, TAG)])
        self.turn = 1 - i

    def _complete(self) -> None:
        """Wait for the exchange in flight (watched); its copy is complete on this end."""
        step, i, requests = self.flight
        start = time.perf_counter()
        self.run.runtime.collective(MPI.Request.Waitall, requests)
        self.waited += time.perf_counter() - start
        self.held_steps[i], self.flight = step, None
        self.copies += 1

    def end(self, run_context):
        if self.comm is None:
            return
        if self.flight is not None:
            self._complete()
        if self.steps:
            event("peer_copy_time", any_rank=False, every=self.every, steps=self.steps, copies=self.copies,
                  ms_per_step=round(1000 * self.seconds / self.steps, 3),
                  wait_ms_per_step=round(1000 * self.waited / self.steps, 3))
        self.comm.Free()
        self.comm = None

    # -- 4. after a failure ---------------------------------------------------------------------------------
    def settle(self) -> None:
        """Before the last gasp revokes the copies' communicator: a copy in flight whose data all arrived is complete
        (a failure may strike between its end and the wait); one that did not, or failed, is not."""
        if self.flight is None:
            return
        step, i, (_, receive) = self.flight
        try:
            if receive.Test():
                self.held_steps[i] = step
        except MPI.Exception:
            pass
        self.flight = None

    def offer(self, states: dict) -> tuple:
        """(the steps of its own state this rank can write: its live states and snapshots, (origin, the steps of the
        complete copies it keeps)), for the last gasp's plan."""
        own = set(states) | {s for s in self.own_steps if s is not None}
        return own, (self.origin, {s for s in self.held_steps if s is not None})

    def snapshot(self, step: int) -> dict:
        """name -> array of this rank's own state of `step` (one of its snapshots)."""
        return self.own_views[self.own_steps.index(step)]

    def copy_tensors(self, step: int) -> list:
        """The origin's tensors of `step`, from the complete copy this rank keeps, as its file holds them."""
        views = self.held_views[self.held_steps.index(step)]
        return [Tensor(kind, name, shape, where, views[name], split, sharded)
                for kind, name, shape, where, split, sharded in self.held_meta]
