"""Group sums through shared memory (dsim.parallel.shared) over real ranks: the same bits as the MPI path.

    mpirun -n 8 python -m mpi4py -m pytest --with-mpi -m mpi tests/mpi/test_shared_mpi.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from dsim.parallel import shared
from dsim.parallel.groups import allreduce_sum, sum_chunks
from test_buckets_mpi import group_order_sum
from test_parallel_equivalence import agree


def split(size):
    world = MPI.COMM_WORLD
    return world, world.Split(color=int(world.rank < size), key=world.rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_small_sums_through_shared_memory_are_the_group_order_sums(size):
    """Many calls in a row (the two halves of each slot alternate, the window grows), in place or not, with
    sizes that the group's size divides or not, float32 and float64: every result is the group-order sum
    bit for bit and the MPI path's result, and `between` runs once per call."""
    world, comm = split(size)
    ok, why = True, ""
    if world.rank < size:
        group = shared.attach(comm)
        ok = group is not None and shared.of(comm) is group
        rng = np.random.default_rng(3 + comm.rank)
        for n in [1, 5, 24, 1001, 4096, 81920, 40000, 300001, 7]:
            for dtype in (np.float32, np.float64):
                x = (rng.standard_normal(n) * 10.0 ** comm.rank).astype(dtype)
                expect = group_order_sum(comm, x)
                calls = []
                got = allreduce_sum(comm, x, between=lambda: calls.append(1))
                inplace = x.copy()
                same = allreduce_sum(comm, inplace, inplace=True)
                through_mpi = x.copy()
                sum_chunks(comm, x, through_mpi, lambda m: np.empty(m, dtype))
                bits = expect.view(np.uint8)
                ok = ok and calls == [1] and np.shares_memory(same, inplace) and all(
                    np.array_equal(a.view(np.uint8), bits) for a in (got, same, through_mpi))
                why = f"rank {world.rank}: size={size} n={n} {np.dtype(dtype).name}"
                if not ok:
                    break
            if not ok:
                break
    comm.Free()
    agree(world, ok, why)


@pytest.mark.mpi(min_size=2)
def test_groups_sum_through_shared_memory_only_where_asked(monkeypatch):
    """A run's mp group gets a SharedGroup on one node (not dp: see dsim.parallel.shared); DSIM_SHARED_MEMORY=0
    gives none (MPI only)."""
    from dsim.parallel.groups import Groups
    from dsim.parallel.layout import ParallelLayout
    world = MPI.COMM_WORLD
    layout = ParallelLayout(data_parallel=2, model_parallel=world.size // 2)
    on = Groups(world, layout)
    monkeypatch.setenv("DSIM_SHARED_MEMORY", "0")
    off = Groups(world, layout)
    ok = (shared.of(on.mp) is not None) == (on.mp.size > 1) and shared.of(on.dp) is None and \
        shared.of(on.shard) is None and all(shared.of(c) is None for c in (off.dp, off.mp, off.shard)) and \
        on.shared_sums() == (["mp"] if on.mp.size > 1 else []) and off.shared_sums() == []
    x = np.random.default_rng(world.rank).standard_normal(1000)
    ok = ok and np.array_equal(allreduce_sum(on.mp, x), allreduce_sum(off.mp, x))   # on.free() frees this window
    on.free()
    off.free()
    agree(world, ok, f"rank {world.rank}")


@pytest.mark.mpi(min_size=2)
def test_no_room_in_shared_memory_falls_back_to_mpi(monkeypatch):
    """A node whose shared memory cannot hold the window (a container's small /dev/shm; here a missing one):
    the sums go through MPI, with the same results."""
    world, comm = split(4)
    ok, why = True, ""
    if world.rank < 4:
        group = shared.attach(comm)
        monkeypatch.setattr(shared, "SHM_DIR", "/nonexistent/shm")
        x = np.random.default_rng(comm.rank).standard_normal(1000).astype(np.float32)
        got = allreduce_sum(comm, x)
        again = allreduce_sum(comm, x)   # refused at once, without asking the group again
        ok = group._scratch is None and group._no_room == x.nbytes and \
            np.array_equal(got, group_order_sum(comm, x)) and np.array_equal(again, got)
        why = f"rank {world.rank}"
    comm.Free()
    agree(world, ok, why)
