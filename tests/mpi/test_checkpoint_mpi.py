"""Save then load gives identical arrays, for every layout, sharded and integrated (mpirun -n 8)."""
import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from dsim.checkpoint import ModelCheckpoint, CheckpointConfig, latest_committed, restore
from dsim.checkpoint.loader import file_for
from dsim.build import build_run
from dsim.engine.state import owned_pieces
from test_parallel_equivalence import LAYOUTS, agree


def state(run):
    return {name: arr.copy() for name, _, _, arr in owned_pieces(run.network, run.optimizer)}


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("integrated", [False, True])
@pytest.mark.parametrize("dp,mp,k", LAYOUTS)
def test_save_load_round_trip(dp, mp, k, integrated, tmp_path_factory):
    comm = MPI.COMM_WORLD.Dup()
    directory = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    cfg = small_config(parallel__data_parallel=dp, parallel__model_parallel=mp, parallel__optimizer_shard=k,
                       optimizer__name="adam", train__steps_per_epoch=3)
    run = build_run(cfg, comm)
    saver = ModelCheckpoint("rt", directory, CheckpointConfig(save_checkpoint_steps=3, integrated_save=integrated))
    run.model.train(1, run.loader, callbacks=[saver])
    before = state(run)
    fresh = build_run(cfg, comm)  # freshly initialised: differs until restored
    differs = any(not np.array_equal(before[n], a) for n, a in state(fresh).items())
    record = latest_committed(directory)
    restore(fresh, file_for(directory, record, comm.rank))
    after = state(fresh)
    same = all(np.array_equal(before[n], after[n]) for n in before)
    mp_same = all(np.array_equal(p.data, q.data) for p, q in zip(run.network.params, fresh.network.params))
    agree(comm, differs and same and mp_same and fresh.optimizer.global_step == 3 and fresh.loader.init_step == 3
          and record["name"] == "rt-1_3", f"differs={differs} same={same} mp={mp_same}")
    comm.Free()
