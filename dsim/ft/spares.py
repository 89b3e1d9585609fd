"""Warm spares (tft.spares: N): processes started with the job that wait, idle, to take a dead rank's place.

`mpirun -n W+N python -m dsim.train` with `tft.spares: N` trains on the first W processes (the layout's
world) and keeps the last N as spares, as large clusters keep hot spare nodes. A spare imports what
training needs, then waits on the *pool* (the communicator of every process of the job), asleep but for a
probe every POLL seconds. When a rank dies (tft.arf), the survivors first agree on the repair as without
spares (inprocess.InProcessRecovery), then refill the world, collectively with the spares over the pool:

1. (survivors) revoke the pool: every spare leaves its wait;
2. (all living) shrink the pool and tell each other their role: a training rank, or a spare;
3. (the lowest survivor) broadcast what a joiner needs: config, agreed step, writers, the callbacks' state;
4. (all) the spares, lowest first, take the dead ranks; too few spares: the rest are spawned (as without
   spares) and merged into the pool;
5. (all) split the pool into the new training world, ordered as the old one; the spares left wait again.

A spare leaves when a training rank releases it (training ended: every rank that ends sends the job's
exit status), and on its own when no training process it knows of on its host is alive any more (Watch:
e.g. the whole job crashed while a spare waited, or a repair failed half-way).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from mpi4py import MPI

from ..config import ConfigError
from ..log import leave
from ..parallel.layout import LayoutError
from ..runtime import PROCESS
from .launcher import alive

STOP = 0xA5           # tag of the message that releases a spare (its payload: the exit status)
POLL = 0.02           # seconds between two probes of a waiting spare
WATCH_SECONDS = 5.0   # no training process alive this long: the spare's job is gone


def connected_to_spawned(runtime=PROCESS) -> None:
    """This process (its runtime) took part in a Spawn and Merge (a survivor, a spare, or the spawned process itself):
    it ends without MPI_Finalize (finish)."""
    runtime.spawned = True


def finish(code: int, world=None, runtime=PROCESS) -> int:
    """End a process of a job that spawned replacements: after a barrier on the training world (training
    ended well), exit without MPI_Finalize. Returns code, to end normally, when nothing was spawned.

    Open MPI 5.0.11's MPI_Finalize in such a job waits, in its dynamic-process disconnect
    (ompi_dpm_dyn_finalize), on processes connected to a spawned one that died later: with replacements
    spawned at two steps the job hung there until the launcher's timeout, training done and its checkpoints
    committed. launch/ft.sh tells mpirun that a process may end with status 0 without MPI_Finalize
    (prte_allowed_exit_without_sync; a non-zero status is still an error); the barrier keeps any process from
    leaving while another still needs it in a collective.
    """
    if not runtime.spawned:
        return code
    if world is not None:
        try:
            world.Barrier()
        except MPI.Exception:
            pass  # a process died at the very end: the others end all the same
    leave(code)


@dataclass
class SparePool:
    """The processes of the job (training ranks and spares) and which of them are idle spares."""

    comm: object                                 # every living process of the job
    spares: list = field(default_factory=list)   # comm ranks of the idle spares, lowest first
    watched: list = field(default_factory=list)  # (host, pid) of the training processes, for Watch

    def release(self, code: int) -> None:
        """Tell every idle spare that training ended with exit status `code` (any training rank may)."""
        for s in self.spares:
            try:
                self.comm.send(code, dest=s, tag=STOP)  # a few bytes: sent eagerly, nobody waits
            except MPI.Exception:
                pass  # a revoked pool (a failed repair): the spares' Watch ends them

    def revoke(self) -> None:
        try:
            self.comm.Revoke()
        except MPI.Exception:
            pass


def training_ranks(cfg, size: int, fit) -> int:
    """How many of `size` processes train (the rest are spares); a ConfigError when that cannot fit (fit: the run
    factory's, dsim.build.resolve_layout)."""
    n = cfg.tft.spares
    if not n:
        return size
    ranks = size - n
    if ranks < 1:
        raise ConfigError(f"tft.spares={n} leaves no training rank in a job of {size} process(es): "
                          f"launch mpirun -n <training ranks + {n}>")
    try:
        fit(cfg, ranks)
    except (LayoutError, ConfigError) as e:
        p = cfg.parallel
        mp = p.model_parallel
        need = p.data_parallel * mp if p.data_parallel else max(1, -(-size // mp)) * mp
        raise ConfigError(f"tft.spares={n}: mpirun -n {size} leaves {ranks} training rank(s) beside the spare(s), "
                          f"and {str(e).removeprefix('layout: ')}; launch mpirun -n {need + n} "
                          f"({need} training ranks + {n} spare(s))") from None
    return ranks


def split(comm, cfg, fit):
    """(training world or None on a spare, SparePool or None without tft.arf). Collective over comm. fit: as for
    training_ranks."""
    if not cfg.tft.arf:
        return comm, None
    ranks = training_ranks(cfg, comm.size, fit)
    ids = comm.allgather((socket.gethostname(), os.getpid()))
    pool = SparePool(comm, list(range(ranks, comm.size)), ids[:ranks])
    if ranks == comm.size:
        return comm, pool  # no spares: the world is the job, as without tft.spares
    world = comm.Split(0 if comm.rank < ranks else MPI.UNDEFINED, comm.rank)
    return (None if world == MPI.COMM_NULL else world), pool


def wait(pool: SparePool):
    """A spare's life until it leaves: (exit status, None) when released, or (None, Refill) when given a rank.

    Its heartbeat (dsim.ft.hang.standby_heartbeat, with tft.hang_timeout) ends as it leaves, unless it takes
    a place: then it goes on until the spare's training heartbeat begins.
    """
    from .hang import end_standby
    try:
        code, got = _wait(pool)
    except BaseException:
        end_standby()
        raise
    if got is None:
        end_standby()
    return code, got


def _wait(pool: SparePool):
    warm_up()
    watch = Watch(pool.watched)
    watch.start()
    while True:
        comm = pool.comm
        try:
            if comm.Iprobe(source=MPI.ANY_SOURCE, tag=STOP):
                return comm.recv(source=MPI.ANY_SOURCE, tag=STOP), None
        except MPI.Exception:
            if comm.Is_revoked():
                try:
                    got = refill(pool, None)
                except (RefillFailed, MPI.Exception):  # a rank died during the repair: the survivors save a last
                    return 1, None                     # gasp and the job ends; so does this spare
                if got.rank is not None:
                    watch.watched = []  # a training rank now: nothing to watch
                    return None, got
                pool = got.pool  # another spare took the place: wait again
                watch.watched = pool.watched
                continue
            try:
                comm.Ack_failed()  # a process died: the survivors decide what happens, and revoke the pool
            except MPI.Exception:
                pass
        time.sleep(POLL)


def warm_up() -> None:
    """Import what training needs now, while idle, so taking a place costs no imports (the in-job repair, which
    takes the place, is imported by whoever waits here: dsim.train)."""
    import h5py  # noqa: F401

    from ..checkpoint import saver  # noqa: F401
    from . import last_gasp  # noqa: F401


class RefillFailed(Exception):
    """Training ranks other than those to replace died during the refill (raised by every living process alike)."""

    def __init__(self, lost: list):
        super().__init__(f"rank(s) {', '.join(map(str, lost))} died during the repair")
        self.lost = lost


@dataclass
class Refill:
    """What a process knows after a refill of the world."""

    world: object      # the new training world (None on a spare left idle)
    pool: SparePool    # the pool from now on
    joining: dict      # the survivors' broadcast (config, step, writers, callbacks' state)
    rank: object       # this process's training rank (None on an idle spare)
    by_spare: list     # dead ranks taken by spares
    spawned: list      # dead ranks given to spawned processes


def died_since(world_size: int, failed: list, roles: list) -> list:
    """Training ranks of a world of `world_size` missing from `roles` (per living process, its training rank or
    None for a spare) that are not among the `failed` the survivors agreed to replace: dead since then."""
    return sorted(set(range(world_size)) - set(failed) - {r for r in roles if r is not None})


def assign(roles: list, failed: list):
    """({pool rank: training rank} of the spares that take a place, the failed ranks left over, idle spares left).

    roles: per pool rank, its training rank or None for a spare; spares take the failed ranks lowest first.
    """
    idle = [i for i, r in enumerate(roles) if r is None]
    taken = dict(zip(idle, sorted(failed)))
    return taken, sorted(failed)[len(taken):], idle[len(taken):]


def refill(pool: SparePool, me, joining=None, living=None) -> Refill:
    """Steps 2-5 of the module docstring; collective over the living processes of pool.comm.

    me: this process's training rank (None on a spare); joining: the survivors' broadcast (None on a spare);
    living: the pool already shrunk, when the pool is the training world itself (no spares at start).
    An MPI error here (a process died during the refill) revokes the communicators this process was using: a
    process that got further, past a collective the dead one had already fed, would wait for this one there
    for ever; it fails now and gives the repair up too.
    """
    from .ulfm import revoke, shrink
    comm = living if living is not None else shrink(pool.comm)[0]
    using = [comm]
    try:
        return _refill(comm, me, joining, using)
    except MPI.Exception:
        revoke(*using)
        raise


def _refill(comm, me, joining, using: list) -> Refill:
    roles = comm.allgather((me, socket.gethostname(), os.getpid()))
    root = next(i for i, (r, _, _) in enumerate(roles) if r is not None)  # the lowest survivor
    joining = comm.bcast(joining, root=root)
    failed = joining["ranks"]
    lost = died_since(joining["world_size"], failed, [r for r, _, _ in roles])
    if lost:  # died since the survivors agreed on the repair (the pool's shrink left them out): no refill
        raise RefillFailed(lost)
    taken, missing, left = assign([r for r, _, _ in roles], failed)
    watched = [(h, p) for i, (r, h, p) in enumerate(roles) if r is not None or i in taken]
    if missing:  # no spare left for these: spawn them, as without spares (inprocess.join_spawned)
        connected_to_spawned()
        inter = comm.Spawn(sys.executable, args=["-m", "dsim.train", *sys.argv[1:]], maxprocs=len(missing), root=root)
        merged = inter.Merge(high=False)  # the pool keeps its ranks; the spawned come after
        using.append(merged)
        taken.update({comm.size + j: r for j, r in enumerate(missing)})
        joining = {**joining, "assign": taken, "spares": left}
        merged.bcast(joining, root=0)
        connect_all(merged)
        comm = merged
    mine = me if me is not None else taken.get(comm.rank)
    world = comm.Split(0 if mine is not None else MPI.UNDEFINED, mine if mine is not None else 0)
    return Refill(None if world == MPI.COMM_NULL else world, SparePool(comm, left, watched), joining,
                  None if me is not None else mine, sorted(set(failed) - set(missing)), missing)


def connect_all(comm) -> None:
    """Exchange a byte between every two processes of comm (collective, after a Spawn and Merge).

    Open MPI's MPI_Finalize in a spawned process says goodbye to every process of the jobs it is connected
    to, and crashes (in ompi_dpm_dyn_finalize) on one it never exchanged a message with: with pipeline
    stages a replacement talks only to its stage and its neighbours, so it would.
    """
    import numpy as np
    out, into = np.zeros(1, np.uint8), np.zeros(comm.size, np.uint8)
    requests = [comm.Irecv(into[r:r + 1], source=r, tag=77) for r in range(comm.size) if r != comm.rank]
    requests += [comm.Isend(out, dest=r, tag=77) for r in range(comm.size) if r != comm.rank]
    MPI.Request.Waitall(requests)


class Watch(threading.Thread):
    """Ends a waiting spare whose job is gone: no training process on its host alive for WATCH_SECONDS.

    The last resort when nobody released it. It watches only processes on its own host (it reads /proc);
    a spare with no training process beside it relies on being released.
    """

    def __init__(self, watched, seconds: float = WATCH_SECONDS):
        super().__init__(name="dsim-spare-watch", daemon=True)
        self.watched, self.seconds = watched, seconds

    def run(self):
        gone_since = None
        while True:
            time.sleep(1)
            gone_since = orphaned(self.watched, socket.gethostname(), alive, gone_since, time.time())
            if gone_since is not None and time.time() - gone_since > self.seconds:
                print("dsim: warning: spare: every training process of this job has ended without releasing "
                      "this spare; leaving", file=sys.stderr, flush=True)
                leave(1)


def orphaned(watched, host, is_alive, gone_since, now):
    """Since when (or None) no watched process on `host` is alive; None too when none is on `host`."""
    local = [pid for h, pid in watched if h == host]
    if not local or any(is_alive(pid) for pid in local):
        return None
    return gone_since if gone_since is not None else now
