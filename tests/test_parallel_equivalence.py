"""Every layout trains to the same parameters as the single-process run (run under mpirun -n 8)."""
import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from dsim.engine import build_run
from dsim.engine.state import owned_pieces
from dsim.parallel.groups import gather_full

LAYOUTS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (4, 2, 2), (8, 1, 4), (8, 1, 8)]


def train_and_gather(cfg, comm, train=True):
    run = build_run(cfg, comm)
    if train:
        run.model.train(cfg.train.epochs, run.loader, callbacks=[])
    full = gather_full(comm, owned_pieces(run.network, run.optimizer))
    run.groups.free()
    return full


def agree(comm, ok, detail=""):
    """Every rank learns whether all ranks passed, then all assert together (never hang)."""
    results = comm.allgather((bool(ok), detail))
    bad = [(r, d) for r, (o, d) in enumerate(results) if not o]
    assert not bad, bad[:3]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("dp,mp,k", LAYOUTS)
def test_layout_matches_single_process(dp, mp, k, optimizer):
    comm = MPI.COMM_WORLD.Dup()
    over = dict(parallel__data_parallel=dp, parallel__model_parallel=mp, parallel__optimizer_shard=k,
                optimizer__name=optimizer, optimizer__learning_rate=0.05 if optimizer == "sgd" else 0.002)
    cfg = small_config(**over)
    got = train_and_gather(cfg, comm)
    ref_cfg = small_config(**{**over, "parallel__data_parallel": 1, "parallel__model_parallel": 1,
                              "parallel__optimizer_shard": 1})
    ref = train_and_gather(ref_cfg, MPI.COMM_SELF)
    worst, detail = 0.0, ""
    for name, want in ref.items():
        rel = np.max(np.abs(got[name] - want)) / np.max(np.abs(want))
        if rel > worst:
            worst, detail = rel, name
    init = train_and_gather(ref_cfg, MPI.COMM_SELF, train=False)
    moved = np.max(np.abs(ref["layer3.weight"] - init["layer3.weight"]))  # training really happened
    agree(comm, set(got) == set(ref) and worst <= 1e-10 and moved > 1e-4, f"{detail}: {worst:.3g}, moved {moved:.3g}")
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_two_runs_are_bit_identical():
    comm = MPI.COMM_WORLD.Dup()
    cfg = small_config(parallel__data_parallel=2, parallel__model_parallel=4, parallel__optimizer_shard=2,
                       optimizer__name="adam", dtype="float32")
    a, b = train_and_gather(cfg, comm), train_and_gather(cfg, comm)
    same = all(np.array_equal(a[n], b[n]) for n in a) and a["layer1.param"].dtype == np.float32
    agree(comm, same)
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_replicas_hold_identical_bits():
    comm = MPI.COMM_WORLD.Dup()
    cfg = small_config(parallel__data_parallel=4, parallel__model_parallel=2, parallel__optimizer_shard=2,
                       optimizer__name="adam")
    run = build_run(cfg, comm)
    run.model.train(1, run.loader, callbacks=[])
    mine = {name: arr.copy() for name, _, _, arr in owned_pieces(run.network, run.optimizer)}
    everyone = comm.allgather(mine)
    ok = all(all(np.array_equal(mine[n], everyone[r][n]) for n in mine)
             for r in run.groups.layout.replica_group(comm.rank))
    agree(comm, ok and len(run.groups.layout.replica_group(comm.rank)) == 2)
    comm.Free()
