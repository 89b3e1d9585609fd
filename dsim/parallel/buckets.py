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

# DDP's bucket_cap_mb is 25 MB; here a bucket costs memory as large as itself over three or more ranks (the receive
# buffer, kept) and half of it over two (MPI_Allreduce's own temporary, which the heap keeps), so smaller buckets
# save memory, down to where MPI slows: 30 MiB over dp2 in 16.1-17.0 ms with 8 MiB buckets, 15.7-15.9 with 4 MiB,
# 16.1-25.2 with 2 MiB; 121 MiB over dp4 113 / 107 / 184 ms, over dp8 126 / 129 / 187 ms (the three sizes side by
# side in one job, 8 ranks on 2 cores, 2026-12-07)
BUCKET_BYTES = 4 << 20


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
        sum_chunks(comm, flat, flat, lambda n: self._recv_buffer(comm.size, n), between)

    def _recv_buffer(self, p: int, n: int) -> np.ndarray:
        """A buffer of n elements for a group of p, made once: as large as the largest bucket needs."""
        buf = self._recv.get(p)
        if buf is None or buf.size < n:
            chunk = -(-min(self.bucket_elems, self.flat.size) // p)   # the largest chunk any bucket gives
            buf = self._recv[p] = np.empty(max(p * chunk, n), dtype=self.dtype)
        return buf[:n]
