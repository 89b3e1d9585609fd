"""Model-parallel sums through shared memory, for groups whose ranks all live on one node.

A model-parallel layer sums a small activation (a few hundred KiB) over its group at every layer of every
step. Through MPI a deterministic sum is two collectives (an all-to-all and an all-gather, see
groups.sum_chunks), and at these sizes their latency is the cost. When the group shares a node, its ranks
read each other's contributions straight from a window of shared memory (MPI_Win_allocate_shared), as
intra-node collectives do:

1. every rank copies its contribution into its own slot of the window; barrier;
2. every rank sums its chunk of every slot, in group order, and puts the sum back in its slot; barrier;
3. every rank copies the other ranks' summed chunks out of their slots.

Each element is summed with the same operations in the same order as sum_chunks does, so the result is
bit-identical to the MPI path on every rank: a run does not change a bit with the transport. 0.12 against
0.23 ms for the MPI path per 0.31 MiB on 4 ranks here (a raw Allreduce: 0.17 ms). Calls alternate between
two halves of each slot: a rank that starts call k+2 has passed the barriers of call k+1, which every other
rank reached only after reading what it needed of call k.

Not for the data-parallel gradients: a gradient buffer in the window summed in place was 1.3-1.5x faster
than MPI on dp4 and dp8, but every rank then maps the pages of the others' buffers it reads, and its
resident memory grows by up to twice the gradients (1.2x -> 1.8x the training state on dp8).

Only when fault tolerance (ULFM) is off: Open MPI's shared-memory windows are not made to survive a dead
process, and a fault-tolerant job must be able to shrink its communicators. DSIM_SHARED_MEMORY=0 turns the
path off everywhere (the sums stay the same bits).
"""
from __future__ import annotations

import os

import numpy as np

from ..runtime import PROCESS
from .chunks import chunk_bounds, sum_in_order

# Larger sums go through MPI: copying them into the window costs more than it saves.
MAX_BYTES = 4 << 20
# A slot is a multiple of 64 KiB plus an odd number of cache lines: slots a power of two apart would map the
# chunks a rank sums onto the same cache sets (measured: 0.36 against 0.18 ms per 0.31 MiB sum on 4 ranks).
_SLOT_UNIT, _SLOT_SKEW = 64 << 10, 35 * 64

# Open MPI keeps shared windows in files here; a window must leave room for everything else that uses it
# (a container's /dev/shm may be 64 MiB): a group falls back to MPI when its window would not fit twice.
SHM_DIR = "/dev/shm"



def _key():
    """The attribute key of a communicator's SharedGroup, made once per process (kept by its runtime)."""
    if PROCESS.shared_key is None:
        from mpi4py import MPI
        PROCESS.shared_key = MPI.Comm.Create_keyval()
    return PROCESS.shared_key


def wanted() -> bool:
    """Whether this job may use shared-memory sums (the same answer on every rank of a job)."""
    if os.environ.get("DSIM_SHARED_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    from ..ft import ulfm
    return ulfm.unavailable_reason() is not None   # ULFM is off


def attach(comm, together: bool = None) -> "SharedGroup | None":
    """Make comm a SharedGroup when its ranks share a node; None if not. `together`: whether they do, known already
    (Groups: from dsim.parallel.hosts, which split the world by node; the same answer on every rank of comm);
    None: found here (collective over comm)."""
    if comm.size == 1 or together is False or not wanted():
        return None
    if together is None:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        together = node.size == comm.size
        node.Free()
        if not together:
            return None
    group = SharedGroup(comm)
    comm.Set_attr(_key(), group)
    return group


def release(comm) -> None:
    """Free comm's SharedGroup window, if any (collective over comm; before comm is freed)."""
    group = of(comm)
    if group is not None:
        comm.Delete_attr(PROCESS.shared_key)
        if group._scratch is not None:
            group._scratch.free()
            group._scratch = None


def of(comm) -> "SharedGroup | None":
    """The SharedGroup attached to comm, if any (comm may be a wrapper that passes Get_attr on)."""
    key = PROCESS.shared_key
    if key is None:
        return None
    return comm.Get_attr(key)


def _room(comm, nbytes: int) -> bool:
    """Whether the node's shared memory has room for a window of nbytes per rank of comm (collective: the
    group agrees)."""
    from mpi4py import MPI
    try:
        fs = os.statvfs(SHM_DIR)
        free = fs.f_bavail * fs.f_frsize
    except OSError:
        free = 0
    fits = np.array([free >= 2 * nbytes * comm.size], dtype=np.int32)
    PROCESS.collective(comm.Allreduce, MPI.IN_PLACE, fits, op=MPI.MIN)
    return bool(fits[0])


class _Window:
    """A shared window over comm with a slot of `slot` bytes per rank, each rank's slot as a uint8 array."""

    def __init__(self, comm, nbytes: int):
        from mpi4py import MPI
        self.comm = comm
        self.slot = -(-nbytes // _SLOT_UNIT) * _SLOT_UNIT + _SLOT_SKEW
        self.win = MPI.Win.Allocate_shared(self.slot, 1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)   # loads and stores from here on; Sync orders them
        self.slots = []
        for r in range(comm.size):
            buf, _ = self.win.Shared_query(r)
            self.slots.append(np.frombuffer(buf, dtype=np.uint8, count=self.slot))

    def fence(self) -> None:
        """Every rank's stores before it are seen by every rank's loads after it."""
        self.win.Sync()
        PROCESS.collective(self.comm.Barrier)
        self.win.Sync()

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()   # collective: every rank is done with it


class SharedGroup:
    """A communicator whose ranks share a node, with its scratch window (made on first use, grown as needed)."""

    def __init__(self, comm):
        self.comm = comm
        self._scratch = None
        self._turn = 0
        self._plans = {}   # (bytes, dtype, half) -> the views and bounds of a sum of that size in that half
        self._no_room = MAX_BYTES + 1   # the smallest sum found too large for the node's shared memory

    def sum(self, src: np.ndarray, out: np.ndarray, between=None) -> bool:
        """out (flat, may be src itself) = the sum of the flat src over the group, each element in group order;
        False (nothing done) when the node's shared memory has no room for a window that large.

        `between` is called after this rank's chunk is summed, before the chunks are shared (a fault point)."""
        nbytes = src.nbytes
        if self._scratch is None or 2 * nbytes > self._scratch.slot:
            # collective: every rank of the group sums the same size at the same call
            if nbytes >= self._no_room or not _room(self.comm, 2 * nbytes):
                self._no_room = min(self._no_room, nbytes)
                return False
            PROCESS.collective(self._grow, 2 * nbytes)
            self._plans.clear()
        key = (nbytes, src.dtype, self._turn)
        self._turn ^= 1
        plan = self._plans.get(key) or self._plan(*key)
        mine, parts, lo, hi, theirs = plan
        mine[...] = src
        self._scratch.fence()
        sum_in_order(parts, out[lo:hi])
        mine[lo:hi] = out[lo:hi]
        if between is not None:
            between()
        self._scratch.fence()
        for a, b, chunk in theirs:
            out[a:b] = chunk
        return True

    def _grow(self, nbytes: int) -> None:
        """A new scratch window of nbytes per rank in place of the old (collective over the group)."""
        if self._scratch is not None:
            self._scratch.free()
        self._scratch = _Window(self.comm, nbytes)

    def _plan(self, nbytes: int, dtype, half: int):
        """This rank's slot, the chunks it sums, its bounds, and where the others' sums go (kept per size)."""
        p, me = self.comm.size, self.comm.rank
        start = half * (self._scratch.slot // 2)
        slots = [s[start:start + nbytes].view(dtype) for s in self._scratch.slots]
        bounds = chunk_bounds(slots[0].size, p)
        lo, hi = bounds[me], bounds[me + 1]
        theirs = [(bounds[j], bounds[j + 1], slots[j][bounds[j]:bounds[j + 1]]) for j in range(p) if j != me]
        plan = self._plans[(nbytes, dtype, half)] = (slots[me], [s[lo:hi] for s in slots], lo, hi, theirs)
        return plan
