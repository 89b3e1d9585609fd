"""Runtime: the state of one process of a job, in one object, passed to what needs it.

What a process knows of itself beyond its run's objects, each field owned by the module named beside it:

- progress: where its main thread is, computing or waiting (dsim.parallel.progress), which the hang watch reads;
- watched, serve, serving: the world a fault-tolerant step watches for a revoke, and what answers a damaged
  replica's request while this rank waits (watch, check_revoked, collective: below; dsim.ft.in_place);
- shrunk: the communicator of the living its last shrink made (dsim.ft.ulfm), which a deadlock's break revokes too;
- hang, standby: its hang watch while it trains, its standby heartbeat before (dsim.ft.hang);
- spawned: whether it took part in a Spawn and Merge (dsim.ft.spares.finish then skips MPI_Finalize);
- held_signal: a scheduler's notice a warm spare got before it trained (dsim.ft.preemption);
- shared_key: the MPI attribute key of the model-parallel groups' shared-memory sums (dsim.parallel.shared);
- run_dir, launcher: where an internal error's traceback goes, the pid of the launcher it ends with (dsim.guard).
- fault: the fault hooks, the FaultInjector armed in this process (dsim.faults: the save, the last gasp and the
  repair in the job strike through it);
- rescue: the files its forked writer wrote at a failure before the survivors agreed (dsim.ft.rescue), which the
  job deletes once it handled the failure, and a side cut off before it stops.
- links, cut_at, poll: how it reaches the other ranks without MPI, when it found a network cut, and whether its
  collectives are polled so that a revoke ends them (dsim.ft.cut).

A run carries its process's runtime (Run.runtime, Groups.runtime) and the fault tolerance takes it from there.
One process has one: PROCESS, below, a module-level instance for what runs without a run in hand: the layers and
the optimizer (check_revoked at every layer), the module-level sums of dsim.parallel, the signal handler of a warm
spare (dsim.ft.preemption), the launcher's watch thread and the last-resort error handler (dsim.guard).

Every collective that waits for other ranks goes through one wrapper, Runtime.collective: it marks the wait for the
hang watch and, on the communicator a step serves on, polls the nonblocking variant checking for a revoke.
"""
from __future__ import annotations

from contextlib import contextmanager

from .parallel.progress import MARKS, Progress


class Runtime:
    """The state of one process (see the module doc)."""

    def __init__(self, progress: Progress = None):
        self.progress = progress if progress is not None else Progress()
        self.watched = None   # the world of a fault-tolerant run, during a step (Model.train_step: watch)
        self.serve = None     # with it, what answers a damaged replica's request (dsim.ft.in_place), or None
        self.serving = None   # the communicator whose first sum of a step waits checking: the data-parallel group
        self.shrunk = None    # the communicator of the living this process's last shrink made (dsim.ft.ulfm)
        self.hang = None      # its HangWatch while it trains (dsim.ft.hang)
        self.standby = None   # its heartbeat before it trains: a waiting spare, a newcomer joining (dsim.ft.hang)
        self.spawned = False  # connected to processes spawned in the job (dsim.ft.spares.finish)
        self.held_signal = 0  # a signal a process not training yet got while it was held (dsim.ft.preemption)
        self.shared_key = None  # the attribute key of a group's SharedGroup (dsim.parallel.shared)
        self.run_dir = None   # where an internal error's traceback goes (dsim.guard.set_run_dir)
        self.launcher = None  # the pid of this rank's launcher once the guard watches it (dsim.guard)
        self.fault = None     # the fault hooks: the FaultInjector armed in this process, or None (dsim.faults)
        self.rescue = None    # its rescue, armed when it trains in a job over several hosts (dsim.ft.rescue)
        self.links = None     # its listener and the world's duplicate, in a job over several hosts (dsim.ft.cut)
        self.cut_at = None    # when it found a network cut (time.time(); dsim.ft.cut)
        self.poll = False     # every buffer collective polled, ended by a revoke (over several hosts: dsim.ft.cut)

    # -- the communicators a step watches -------------------------------------------------------------------
    def watch(self, world, serve=None, dp=None) -> None:
        """Make check_revoked() consult `world` (None: nothing) and call serve() (a UCE repaired in place: the
        replica's side); the step's first sum on `dp` then waits for its collectives checking too (collective).
        Called at the start of every step."""
        self.watched, self.serve, self.serving = world, serve if world is not None else None, dp

    def check_revoked(self) -> None:
        """Raise ERR_REVOKED if the watched world was revoked: a rank computing its part of a step stops at its
        next layer or collective when another rank failed, instead of going on to its next collective on a
        communicator the failure does not touch (for instance a model-parallel group without the failed rank),
        which can be a whole forward and backward later. Local and cheap (MPIX_Comm_is_revoked). Where a UCE
        can be repaired in place, a damaged replica's request is answered here too (an MPI_Iprobe at most every
        10 ms: dsim.ft.in_place). A sign of this rank's progress (dsim.parallel.progress)."""
        progress = self.progress
        progress.pace()
        progress.tick()
        if self.watched is not None:
            if self.watched.Is_revoked():
                from mpi4py import MPI
                raise MPI.Exception(MPI.ERR_REVOKED)
            if self.serve is not None:
                self.serve()

    @contextmanager
    def before_forward(self):
        """Collectives inside it (a pipeline's last stage counts the global batch over dp before its first forward)
        leave the step's first sum on the data-parallel group, after the forward, to wait checking (collective)."""
        kept = self.serving
        try:
            yield
        finally:
            self.serving = kept

    # -- the one wrapper of a watched collective ------------------------------------------------------------
    def collective(self, call, /, *args, **kwargs):
        """call(*args, **kwargs), a call that waits for other ranks (a communicator's collective, a receive, a shrink,
        a repair's exchange), its wait marked for the hang watch (dsim.parallel.progress: a rank waiting here is
        told from a stuck one). Where a UCE can be repaired in place, a buffer collective on the communicator the
        step serves on (`serving`: the data-parallel group, until its first sum of the step) is made as its
        nonblocking variant, checking for a revoke (check_revoked) while it waits: a replica waiting there for a
        damaged rank that waits for the replica's answer would otherwise wait forever (the same data moves, so
        the same bits)."""
        progress = self.progress
        progress.enter_wait()
        try:
            if self.poll and getattr(call, "__name__", None) in POLLED and self.serve is None:
                return _polled(call, *args, **kwargs)
            if self.serve is None or self.serving is None or getattr(call, "__self__", None) is not self.serving \
                    or not call.__name__[0].isupper():  # (a buffer collective's name: Allreduce, Alltoallv, ...)
                return call(*args, **kwargs)
            name = call.__name__
            request = getattr(self.serving, "I" + name[0].lower() + name[1:])(*args, **kwargs)
            while not request.Test():
                self.check_revoked()
        finally:
            progress.leave_wait()


POLLED = frozenset(("Allreduce", "Alltoall", "Alltoallv", "Allgather", "Allgatherv", "Bcast", "Barrier"))


def _polled(call, *args, **kwargs):
    """A buffer collective made as its nonblocking variant, tested until it completes or its communicator is revoked
    (MPI.Exception ERR_REVOKED; the request is left behind). Over several hosts a blocking one may never return
    after a network cut, a revoke notwithstanding: Open MPI 5.0.11 completes no send whose peer is unreachable
    (docs/design/node-faults.md), and the rank would never come to its side's agreement (dsim.ft.cut)."""
    comm, name = call.__self__, call.__name__
    request = getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kwargs)
    while not request.Test():
        if comm.Is_revoked():
            from mpi4py import MPI
            raise MPI.Exception(MPI.ERR_REVOKED)


# This process's runtime (see the module doc: what reaches it without a run in hand). Its marks are the ones every
# layer writes (dsim.parallel.progress.MARKS).
PROCESS = Runtime(MARKS)
