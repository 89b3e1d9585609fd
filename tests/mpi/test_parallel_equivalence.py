"""Every layout trains to the same parameters as the single-process run (run under mpirun -n 8)."""
import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from dsim.build import build_run
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


def on_rank_0(fn):
    """fn() run by rank 0 of COMM_WORLD alone and broadcast to every rank: for the single-process reference runs,
    which the 8 ranks would otherwise each repeat on the same cores. If it fails there, every rank fails (none is
    left waiting in the broadcast)."""
    world = MPI.COMM_WORLD
    result = None
    if world.rank == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (handed to every rank, raised below)
            result = e
    result = world.bcast(result, root=0)
    if isinstance(result, BaseException):
        raise AssertionError(f"the reference run failed on rank 0: {result!r}")
    return result


_references = {}


def reference(key, cfg):
    """The single-process run of a config (initial and final state), made once per module, on rank 0."""
    if key not in _references:
        _references[key] = on_rank_0(lambda: (train_and_gather(cfg, MPI.COMM_SELF, train=False),
                                              train_and_gather(cfg, MPI.COMM_SELF)))
    return _references[key]


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
    # the single-process run depends on the optimizer only: made once per optimizer, not once per layout
    init, ref = reference(("mlp", optimizer), ref_cfg)
    worst, detail = 0.0, ""
    for name, want in ref.items():
        rel = np.max(np.abs(got[name] - want)) / np.max(np.abs(want))
        if rel > worst:
            worst, detail = rel, name
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


SMALL_TRANSFORMER = {"model__name": "transformer", "data__name": "translation",
                     "model__transformer": "{vocab_size: 64, d_model: 32, num_heads: 8, ffn_hidden_size: 64}"}
NEW_MODELS = [("lenet5", {"model__name": "lenet5"}, True), ("transformer", SMALL_TRANSFORMER, True),
              ("transformer-vocab-parallel", {**SMALL_TRANSFORMER, "parallel__vocab_emb_dp": "false"}, False)]
NEW_LAYOUTS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (4, 2, 2), (8, 1, 4)]
@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("optimizer", ["sgd", "adamweightdecay"])
@pytest.mark.parametrize("model,options,dp_only_too", NEW_MODELS, ids=[m[0] for m in NEW_MODELS])
@pytest.mark.parametrize("dp,mp,k", NEW_LAYOUTS)
def test_seed_models_match_single_process(dp, mp, k, model, options, dp_only_too, optimizer):
    """LeNet5 and the Transformer (vocab_emb_dp true and false): float64, 20 steps, within 1e-10 relative."""
    if mp == 1 and not dp_only_too:
        pytest.skip("vocab_emb_dp=false splits the vocabulary over model parallel: same as true when mp=1")
    comm = MPI.COMM_WORLD.Dup()
    over = dict(options, parallel__data_parallel=dp, parallel__model_parallel=mp, parallel__optimizer_shard=k,
                optimizer__name=optimizer, optimizer__weight_decay=0.1 if optimizer == "adamweightdecay" else 0.0,
                optimizer__learning_rate=0.05 if optimizer == "sgd" else 0.002)
    got = train_and_gather(small_config(**over), comm)
    single = {**over, "parallel__data_parallel": 1, "parallel__model_parallel": 1, "parallel__optimizer_shard": 1}
    init, ref = reference((model, optimizer), small_config(**single))
    worst, detail = 0.0, ""
    for name, want in ref.items():
        rel = np.max(np.abs(got[name] - want)) / max(np.max(np.abs(want)), 1e-300)
        if rel > worst:
            worst, detail = rel, name
    # every parameter moved (optimizer state starts at zero; attention's key bias has zero gradient: softmax
    # is invariant to it)
    still = [n for n in init if not n.startswith("moment") and not n.endswith("dense2.bias")
             and np.array_equal(init[n], ref[n])]
    agree(comm, set(got) == set(ref) and worst <= 1e-10 and not still, f"{detail}: {worst:.3g}, unmoved {still[:3]}")
    comm.Free()
