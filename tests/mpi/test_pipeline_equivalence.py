"""Pipeline parallel trains to the same parameters as the single-process run (run under mpirun -n 8).

Float64, 20 steps, within 1e-10 relative: the MLP on every pipelined layout of 8 ranks, LeNet5 and the
Transformer on those that cut or slice their layers differently; m micro-batches per step (m = p and 2p;
MindSpore requires m >= p), both schedules (a covering subset of the combinations: see CASES).
"""
import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from test_parallel_equivalence import agree, on_rank_0, train_and_gather

MLP8 = {"model__hidden": "[32,48,48,48,48,48,32]"}   # 8 Dense layers: enough for 8 stages
LENET = {"model__name": "lenet5"}
TRANSFORMER = {"model__name": "transformer", "data__name": "translation",
               "model__transformer": "{vocab_size: 64, d_model: 32, num_heads: 8, ffn_hidden_size: 64, "
                                     "encoder_layers: 2, decoder_layers: 2}"}
#  (p, dp, mp, k)
LAYOUTS = [(2, 2, 2, 1), (2, 4, 1, 1), (4, 2, 1, 1), (2, 2, 2, 2), (8, 1, 1, 1)]
# A covering subset of layout x m x schedule (not the 5 x 2 x 2 grid): the schedule's order of micro-batches does
# not depend on the layout, nor the layout's groups on the schedule. The MLP: every layout with both schedules,
# m = p and 2p alternating between layouts, so every pair (layout, schedule), (layout, m) and (m, schedule) is met.
MLP = [("mlp", MLP8, layout, m, s) for i, layout in enumerate(LAYOUTS)
       for m, s in ([(1, "1f1b"), (2, "gpipe")] if i % 2 == 0 else [(2, "1f1b"), (1, "gpipe")])]
# LeNet5 and the Transformer add how their layers are cut into stages and sliced within one: stages with model
# parallel (pp2 x dp2 x mp2), the deepest cut (pp4), and the optimizer shard (k2); pp2 x dp4 is only data
# parallel within a stage, which the MLP covers. Each model meets both schedules, and each of these layouts meets
# both schedules over the two models.
MODELS = [(name, options, layout, m, s) for name, options, first in (("lenet5", LENET, 0), ("transformer", TRANSFORMER, 1))
          for i, layout in enumerate([LAYOUTS[0], LAYOUTS[2], LAYOUTS[3]])
          for m, s in [[(1, "1f1b"), (2, "gpipe")][(i + first) % 2]]]
CASES = MLP + MODELS
_references = {}


def reference(name, cfg):
    if name not in _references:  # made once, on rank 0
        _references[name] = on_rank_0(lambda: train_and_gather(cfg, MPI.COMM_SELF))
    return _references[name]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("model,options,layout,times,schedule", CASES,
                         ids=[f"{c[0]}-pp{c[2][0]}xdp{c[2][1]}xmp{c[2][2]}k{c[2][3]}-m{c[3]}p-{c[4]}" for c in CASES])
def test_pipeline_matches_single_process(model, options, layout, times, schedule):
    p, dp, mp, k = layout
    comm = MPI.COMM_WORLD.Dup()
    common = dict(options, optimizer__name="momentum", optimizer__learning_rate=0.05, data__batch_size=32)
    got = train_and_gather(small_config(**common, parallel__pipeline_stage=p, parallel__data_parallel=dp,
                                        parallel__model_parallel=mp, parallel__optimizer_shard=k,
                                        parallel__micro_batch_num=times * p, parallel__pipeline_schedule=schedule),
                           comm)
    ref = reference(model, small_config(**common, parallel__data_parallel=1, parallel__model_parallel=1))
    worst, detail = 0.0, ""
    for name, want in ref.items():
        rel = np.max(np.abs(got[name] - want)) / max(np.max(np.abs(want)), 1e-300)
        if rel > worst:
            worst, detail = rel, name
    agree(comm, set(got) == set(ref) and worst <= 1e-10, f"{detail}: {worst:.3g}, {sorted(set(ref) ^ set(got))[:3]}")
    comm.Free()


@pytest.mark.mpi(min_size=8)
def test_micro_batches_without_stages_match_single_process():
    """p = 1, m = 4: gradient accumulation over micro-batches on dp2 x mp4."""
    comm = MPI.COMM_WORLD.Dup()
    got = train_and_gather(small_config(parallel__data_parallel=2, parallel__model_parallel=4,
                                        parallel__micro_batch_num=4), comm)
    ref = reference("mlp-small", small_config(parallel__data_parallel=1, parallel__model_parallel=1))
    worst = max(np.max(np.abs(got[n] - w)) / np.max(np.abs(w)) for n, w in ref.items())
    agree(comm, set(got) == set(ref) and worst <= 1e-10, f"{worst:.3g}")
    comm.Free()
