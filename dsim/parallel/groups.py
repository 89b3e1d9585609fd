"""Sub-communicators of a layout and the collectives training uses on them.

Reductions are deterministic and bit-identical on every rank of a group by construction: each rank
sums one chunk of the buffer over all contributions in group order (an all-to-all, i.e. a
reduce-scatter), and the reduced chunks are then all-gathered. Replicas therefore hold identical bits,
which is what lets a rank be repaired from its replica, and reruns of a layout are bit-identical.
A model-parallel group on one node sums its activations through shared memory instead
(dsim.parallel.shared): the same operations in the same order, so the same bits.
"""
from __future__ import annotations

import numpy as np

from ..runtime import PROCESS
from . import hosts, shared
from .chunks import chunk_bounds, sum_in_order
from .layout import ParallelLayout


def _split(comm, ranks_of):
    """A sub-communicator of comm for the group ranks_of(rank) (ordered as listed)."""
    members = ranks_of(comm.rank)
    return comm.Split(color=members[0], key=members.index(comm.rank))


class Groups:
    """The world communicator of a run, the host of each of its ranks, and its dp, mp and optimizer-shard groups;
    `runtime`, the state of the process they belong to (dsim.runtime: which of them a step watches)."""

    def __init__(self, comm, layout: ParallelLayout, runtime=PROCESS):
        layout.check_world_size(comm.size)
        self.runtime = runtime
        self.world = comm
        self.layout = layout
        self.rank = comm.rank
        self.coords = layout.coords(comm.rank)
        self.hosts = hosts.discover(comm)   # each rank's host, from MPI's split of the world by node
        self.dp = _split(comm, layout.dp_group)
        self.mp = _split(comm, layout.mp_group)
        self.shard = _split(comm, layout.shard_group)
        # the activations' sums, through shared memory where the group shares a node
        shared.attach(self.mp, self.hosts.together(layout.mp_group(comm.rank)))

    def shared_sums(self) -> list[str]:
        """The groups that sum through shared memory (dsim.parallel.shared), by name."""
        return ["mp"] if shared.of(self.mp) is not None else []

    def free(self):
        """Release the communicators and the mp group's shared window (collective; a healthy world only)."""
        shared.release(self.mp)
        for c in (self.dp, self.mp, self.shard):
            c.Free()


# what the layers call at each forward and backward (dsim.nn.cell): this process's runtime's check
check_revoked = PROCESS.check_revoked


def _sum_phase(call, *args) -> None:
    """call(*args), a phase of a sum, through the watched-collective wrapper (dsim.runtime.Runtime.collective: the
    step's first sum on the data-parallel group waits checking, where a UCE can be repaired in place). Once that one
    is done every rank of the group is past its forward pass, so the later ones (and every model-parallel sum: that
    group never holds a rank's replica) stay blocking."""
    polled = PROCESS.serve is not None and call.__self__ is PROCESS.serving
    PROCESS.collective(call, *args)
    if polled:
        PROCESS.serving = None


def allreduce_sum(comm, x: np.ndarray, between=None, inplace: bool = False) -> np.ndarray:
    """Sum x over comm, deterministically and bit-identically on every rank.

    `between`, if given, is called between the reduce-scatter and the all-gather (a fault point).
    inplace: x is the caller's temporary (a product just computed): the sum goes into it when it is
    C-contiguous, so nothing is allocated.
    """
    check_revoked()
    if comm.size == 1:
        return x if inplace else np.array(x, copy=True)
    flat = np.ascontiguousarray(x).reshape(-1)
    out = flat if inplace else np.empty_like(flat)
    group = shared.of(comm) if flat.nbytes <= shared.MAX_BYTES else None
    if group is None or not group.sum(flat, out, between):
        sum_chunks(comm, flat, out, lambda n: _receive_buffer(flat.dtype, n), between)
    return out.reshape(x.shape)


def sum_chunks(comm, src: np.ndarray, out: np.ndarray, receive, between=None) -> None:
    """out (flat, may be src itself) = the sum of the flat src over comm, each element summed in group order.

    Each rank receives every rank's contribution to one chunk (an all-to-all, i.e. a reduce-scatter), sums
    it in group order into its place in out, and the chunks are then all-gathered. Whichever rank sums a
    chunk, an element's sum is the same, so the chunking does not change a bit. With equal chunks (the
    size a multiple of the group's) the plain all-to-all and all-gather are used: Open MPI's v-variants
    are slower on small buffers. receive(n) gives a reusable buffer of n elements of src's dtype.

    A group of two without a fault point between the phases uses MPI's own Allreduce: each element's sum
    is then one addition, x0 + x1, and IEEE addition is commutative, so whichever rank adds and in whichever
    order, the bits are those of the group-order sum; one call instead of two (30 MiB over dp2 in dp2 x mp4,
    8 MiB buckets: 40.7 ms against 53.7 ms, a raw Allreduce of the 30 MiB 39.5 ms).
    """
    from mpi4py import MPI
    p, me, n, mpi_type = comm.size, comm.rank, src.size, _mpi_type(src)
    if p == 2 and between is None:
        _sum_phase(comm.Allreduce, MPI.IN_PLACE if out is src else [src, mpi_type], [out, mpi_type], MPI.SUM)
        return
    equal = n % p == 0
    if equal:
        mine = n // p
        lo, hi = me * mine, (me + 1) * mine
        recv = receive(n).reshape(p, mine)
        _sum_phase(comm.Alltoall, [src, mpi_type], [recv, mpi_type])
    else:
        bounds = chunk_bounds(n, p)
        counts, displs = [bounds[i + 1] - bounds[i] for i in range(p)], bounds[:-1]
        mine, lo, hi = counts[me], bounds[me], bounds[me + 1]
        recv = receive(p * mine).reshape(p, mine)
        _sum_phase(comm.Alltoallv, [src, counts, displs, mpi_type],
                    [recv, [mine] * p, [mine * i for i in range(p)], mpi_type])
    sum_in_order(recv, out[lo:hi])   # this rank's chunk, summed in group order in its place
    if between is not None:
        between()
    if equal:
        _sum_phase(comm.Allgather, MPI.IN_PLACE, [out, mpi_type])
    else:
        _sum_phase(comm.Allgatherv, MPI.IN_PLACE, [out, counts, displs, mpi_type])


_RECEIVE = {}  # dtype -> a receive buffer reused by every allreduce_sum (grown as needed)


def _receive_buffer(dtype, n: int) -> np.ndarray:
    buf = _RECEIVE.get(dtype)
    if buf is None or buf.size < n:
        buf = _RECEIVE[dtype] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def allgather_axis0(comm, local: np.ndarray) -> np.ndarray:
    """Concatenate equal-shaped pieces from every rank of comm along axis 0, in rank order."""
    if comm.size == 1:
        return local
    local = np.ascontiguousarray(local)
    out = np.empty((comm.size * local.shape[0],) + local.shape[1:], dtype=local.dtype)
    PROCESS.collective(comm.Allgather, local, out)
    return out


def allgather_axis0_inplace(comm, full: np.ndarray) -> None:
    """Fill full (contiguous, axis 0 cut in comm.size equal blocks, this rank's block already in place)
    with every rank's block: an in-place all-gather, nothing allocated."""
    if comm.size == 1:
        return
    from mpi4py import MPI
    PROCESS.collective(comm.Allgather, MPI.IN_PLACE, full)


def _mpi_type(a: np.ndarray):
    from mpi4py import MPI  # here, so that importing dsim (e.g. for python -m dsim.inspect) does not start MPI
    return MPI._typedict[a.dtype.char]


def gather_full(comm, pieces) -> dict:
    """Assemble whole tensors on every rank from (name, global_shape, Slice, array) pieces of all ranks.

    Replicated pieces simply overwrite each other (they are identical by construction).
    """
    out = {}
    gathered = PROCESS.collective(comm.allgather, list(pieces))
    for rank_pieces in gathered:
        for name, shape, where, arr in rank_pieces:
            if name not in out:
                out[name] = np.zeros(shape, dtype=arr.dtype)
            out[name][where.index] = arr
    return out
