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

from .groups import sum_chunks

# DDP's bucket_cap_mb is 25 MB; here a bucket costs memory as large as itself (the receive buffer, kept: every
# bucket over three or more ranks, only the first over two) and over two ranks half of it more (MPI_Allreduce's own
# temporary, which the heap keeps), so smaller buckets save memory, down to where MPI slows: 30 MiB over dp2 in
# 16.1-17.0 ms with 8 MiB buckets, 15.7-15.9 with 4 MiB, 16.1-25.2 with 2 MiB; 121 MiB over dp4 113 / 107 / 184 ms,
# over dp8 126 / 129 / 187 ms (the three sizes side by side in one job, 8 ranks on 2 cores, 2026-12-07)
BUCKET_BYTES = 4 << 20
# The first bucket of a step is summed with its fault point between its phases (all-to-all, then all-gather), so over
# two ranks it is the only one that needs a receive buffer: a smaller one keeps that buffer small (the bits are the
# same whatever the buckets' sizes)
FIRST_BUCKET_BYTES = 1 << 20


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
        self.first_elems = max(1, min(bucket_bytes, FIRST_BUCKET_BYTES) // self.dtype.itemsize)
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
        first = min(n, self.first_elems)
        self._reduce(comm, self.flat[:first], between)
        for start in range(first, n, self.bucket_elems):
            self._reduce(comm, self.flat[start:min(n, start + self.bucket_elems)], None)

    def _reduce(self, comm, flat, between):
        sum_chunks(comm, flat, flat, lambda n: self._recv_buffer(comm.size, n), between)

    def _recv_buffer(self, p: int, n: int) -> np.ndarray:
        """A buffer of n elements for a group of p, kept and grown to the largest n asked: every step sums the same
        buckets, so it grows in the first step only, to the largest bucket that needs one (over two ranks only the
        first: the others are one MPI_Allreduce, dsim.parallel.groups.sum_chunks)."""
        buf = self._recv.get(p)
        if buf is None or buf.size < n:
            buf = self._recv[p] = np.empty(n, dtype=self.dtype)
        return buf[:n]
