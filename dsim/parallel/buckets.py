"""Gradient buckets: every gradient a view into one flat buffer, reduced over data parallel in place.

As PyTorch's DDP does, the gradients live in a preallocated flat buffer (in the order of the parameters,
with one extra slot for the step's loss): a layer writes its gradient straight into its view, and the
data-parallel all-reduce works on the buffer itself, one bucket (a contiguous stretch of it) at a time.
Nothing parameter-sized is allocated per step: the receive buffer of a bucket is made once and reused.

The reduction is allreduce_sum's (dsim.parallel.groups): each rank sums its chunk of a bucket over all
contributions in group order, then the chunks are all-gathered, so every rank holds identical bits and
the sum of each element is the same whatever the bucket size.
"""
from __future__ import annotations

import numpy as np

from .groups import _mpi_type, chunk_bounds

BUCKET_BYTES = 32 << 20   # as DDP's bucket_cap_mb (25 MB by default): large enough to keep MPI at full speed


class GradientBuckets:
    """A flat gradient buffer over `params` (bound as their .grad views) plus a loss slot."""

    def __init__(self, params, dtype, bucket_bytes: int = BUCKET_BYTES):
        self.params = list(params)
        self.dtype = np.dtype(dtype)
        sizes = [int(np.prod(p.data.shape)) for p in self.params]
        self.flat = np.zeros(sum(sizes) + 1, dtype=self.dtype)
        offset = 0
        for p, n in zip(self.params, sizes):
            p.bind_grad(self.flat[offset:offset + n].reshape(p.data.shape))
            offset += n
        self.loss = self.flat[-1:]   # the step's loss travels with the gradients (one reduction for both)
        self.bucket_elems = max(1, bucket_bytes // self.dtype.itemsize)
        self._recv = {}              # group size -> a reusable receive buffer

    def serves(self, params) -> bool:
        """True when this buffer is bound to exactly these parameters (the network was not rebuilt)."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def allreduce(self, comm, between=None) -> None:
        """Sum the buffer over comm in place. `between` is called once, between the first bucket's
        reduce-scatter and its all-gather (a fault point)."""
        if comm.size == 1:
            if between is not None:
                between()
            return
        n = self.flat.size
        for start in range(0, n, self.bucket_elems):
            self._reduce(comm, self.flat[start:min(n, start + self.bucket_elems)], between if start == 0 else None)

    def _reduce(self, comm, flat, between):
        from mpi4py import MPI
        p, me = comm.size, comm.rank
        bounds = chunk_bounds(flat.size, p)
        counts, displs = [bounds[i + 1] - bounds[i] for i in range(p)], bounds[:-1]
        mine = counts[me]
        recv = self._recv_buffer(p, mine)
        mpi_type = _mpi_type(flat)
        comm.Alltoallv([flat, counts, displs, mpi_type], [recv, [mine] * p, [mine * i for i in range(p)], mpi_type])
        acc = flat[bounds[me]:bounds[me + 1]]   # this rank's chunk, summed in group order into its own place
        np.add(recv[0], recv[1], out=acc)
        for i in range(2, p):
            acc += recv[i]
        if between is not None:
            between()
        comm.Allgatherv(MPI.IN_PLACE, [flat, counts, displs, mpi_type])

    def _recv_buffer(self, p: int, mine: int) -> np.ndarray:
        buf = self._recv.get(p)
        if buf is None or buf.size < p * mine:
            chunk = -(-min(self.bucket_elems, self.flat.size) // p)   # the largest chunk any bucket gives
            buf = self._recv[p] = np.empty(p * max(chunk, mine), dtype=self.dtype)
        return buf[:p * mine].reshape(p, mine)
