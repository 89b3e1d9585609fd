"""The bucketed in-place gradient all-reduce over real ranks (mpirun -n 8 ... --with-mpi)."""
import numpy as np
import pytest
from mpi4py import MPI

from dsim.parallel.buckets import GradientBuckets
from dsim.parallel.groups import allreduce_sum, sum_chunks
from test_parallel_equivalence import agree


def group_order_sum(comm, x):
    """Independent of dsim: ((x0 + x1) + x2) + ... in group order, from an allgather."""
    every = comm.allgather(x)
    expect = np.add(every[0], every[1]) if len(every) > 1 else every[0].copy()
    for other in every[2:]:
        expect += other
    return expect


class _P:
    def __init__(self, data):
        self.data, self._grad = data, None

    def bind_grad(self, view):
        self._grad = view

    @property
    def grad(self):
        return self._grad


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bucket_bytes", [8, 4 * 13, 1 << 10, 32 << 20])  # chunks of one element ... one bucket
@pytest.mark.parametrize("size", [2, 3, 8])
def test_bucketed_allreduce_equals_one_reduction_bit_for_bit(size, bucket_bytes):
    world = MPI.COMM_WORLD
    comm = world.Split(color=int(world.rank < size), key=world.rank)
    ok, why = True, ""
    if world.rank < size:
        rng = np.random.default_rng(100 + comm.rank)
        shapes = [(7, 5), (3,), (64, 33), (1,)]
        params = [_P(np.zeros(s, np.float32)) for s in shapes]
        buckets = GradientBuckets(params, np.float32, bucket_bytes=bucket_bytes)
        for p in params:
            p.grad[...] = rng.standard_normal(p.data.shape)
        buckets.loss[0] = comm.rank + 0.5
        expect = group_order_sum(comm, buckets.flat.copy())
        calls = []
        buckets.allreduce(comm, between=lambda: calls.append(1))
        ok = np.array_equal(buckets.flat, expect) and calls == [1] and buckets.loss[0] == sum(r + 0.5 for r in range(size))
        ok = ok and all(np.shares_memory(p.grad, buckets.flat) for p in params)
        buckets.flat[:-1] = rng.standard_normal(buckets.flat.size - 1)   # a second step, new gradients
        expect = group_order_sum(comm, buckets.flat.copy())
        buckets.allreduce(comm)   # with the receive buffers of the first (a pair: through MPI's Allreduce)
        ok = ok and np.array_equal(buckets.flat, expect)
        why = f"rank {world.rank}: size={size} bucket_bytes={bucket_bytes}"
    comm.Free()
    agree(world, ok, why)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 5, 24, 1001, 4096])   # chunks equal (n a multiple of size) or not
def test_allreduce_sum_is_the_group_order_sum_on_every_rank(size, n):
    """Independent of dsim's chunking: every element is ((x0 + x1) + x2) + ... in group order, the same bits on
    every rank, in place or not."""
    world = MPI.COMM_WORLD
    comm = world.Split(color=int(world.rank < size), key=world.rank)
    ok, why = True, ""
    if world.rank < size:
        x = np.random.default_rng(7 + comm.rank).standard_normal(n).astype(np.float32) * 10 ** comm.rank
        every = comm.allgather(x)
        expect = group_order_sum(comm, x)
        got = allreduce_sum(comm, x)
        inplace = x.copy()
        same = allreduce_sum(comm, inplace, inplace=True)
        ok = (got.view(np.uint32) == expect.view(np.uint32)).all() and same is not None and \
            np.shares_memory(same, inplace) and (same.view(np.uint32) == expect.view(np.uint32)).all() and \
            (x == every[comm.rank]).all()   # not in place: x untouched
        why = f"rank {world.rank}: size={size} n={n}"
    comm.Free()
    agree(world, ok, why)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fault_point", [False, True])
def test_a_pair_sums_the_same_bits_with_or_without_a_fault_point(dtype, fault_point):
    """A group of two sums through MPI's Allreduce unless a fault point sits between the phases: both give
    x0 + x1 bit for bit (in place or into another buffer), and the fault point is called once."""
    world = MPI.COMM_WORLD
    comm = world.Split(color=int(world.rank < 2), key=world.rank)
    ok, why = True, ""
    if world.rank < 2:
        x = np.random.default_rng(3 + comm.rank).standard_normal(10007).astype(dtype) * 10 ** (3 * comm.rank)
        expect = group_order_sum(comm, x)
        calls = []
        between = (lambda: calls.append(1)) if fault_point else None
        out = np.empty_like(x)
        sum_chunks(comm, x, out, lambda m: np.empty(m, dtype), between)
        inplace = x.copy()
        sum_chunks(comm, inplace, inplace, lambda m: np.empty(m, dtype), between)
        ok = out.tobytes() == expect.tobytes() and inplace.tobytes() == expect.tobytes() and \
            calls == ([1, 1] if fault_point else []) and (x == comm.allgather(x)[comm.rank]).all()
        why = f"rank {world.rank}: dtype={np.dtype(dtype).name} fault_point={fault_point}"
    comm.Free()
    agree(world, ok, why)
