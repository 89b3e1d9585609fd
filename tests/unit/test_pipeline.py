"""Pipeline parallel's pure parts: the layout's stages, schedules, stage placement, the save plan across stages."""
import numpy as np
import pytest

from dsim.checkpoint import progression
from dsim.checkpoint.group_info import group_info, replica_sets, tensor_holders
from dsim.checkpoint.plan import graph_meta, save_plan, slices_json
from dsim.nn import create_network
from dsim.parallel.layout import LayoutError, ParallelLayout
from dsim.parallel.pipeline import bubble_fraction, micro_batches, schedule


def test_ranks_are_cut_into_consecutive_stages_of_dp_x_mp():
    layout = ParallelLayout(2, 2, 1, pipeline_stage=2)
    assert layout.world_size == 8 and layout.stage_size == 4
    c = layout.coords(6)
    assert (c.stage, c.dp, c.mp) == (1, 1, 0)
    assert layout.dp_group(6) == [4, 6] and layout.mp_group(6) == [6, 7] and layout.replica_group(6) == [4, 6]
    assert layout.neighbour(6, -1) == 2 and layout.neighbour(2, +1) == 6
    assert layout.to_dict()["pipeline_stage"] == 2 and "pipeline_stage" not in ParallelLayout(2, 4).to_dict()
    with pytest.raises(LayoutError, match="pipeline_stage=2 x data_parallel=2 x model_parallel=2 = 8 ranks"):
        layout.check_world_size(4)


def test_replica_sets_are_inside_a_stage():
    layout = ParallelLayout(4, 1, 2, pipeline_stage=2)   # k=2: replicas every other dp index
    assert replica_sets(layout) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_info(layout, 5) == [5, 7]


def _ops_in_flight(ops):
    live, worst = set(), 0
    for op, j in ops:
        if op == "F":
            live.add(j)
            worst = max(worst, len(live))
        else:
            assert j in live
            live.remove(j)
    return worst


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
def test_schedules_run_every_micro_batch_once_and_never_deadlock(name, p, m):
    ops = {s: schedule(name, p, s, m) for s in range(p)}
    for s in range(p):
        assert sorted(ops[s]) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        limit = min(p - s, m) if name == "1f1b" else m
        assert _ops_in_flight(ops[s]) == limit   # 1F1B keeps at most p - stage micro-batches' activations
    # run the stages together: F j needs F j of the stage before, B j needs B j of the stage after
    done, position = set(), {s: 0 for s in range(p)}
    while any(position[s] < len(ops[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if position[s] == len(ops[s]):
                continue
            op, j = ops[s][position[s]]
            need = (s - 1, "F", j) if op == "F" else (s + 1, "B", j)
            if need[0] < 0 or need[0] >= p or need in done:
                done.add((s, op, j))
                position[s] += 1
                moved = True
        assert moved, "deadlock"


def test_1f1b_alternates_after_the_warm_up():
    assert schedule("1f1b", 4, 1, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule("1f1b", 4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert bubble_fraction(4, 8) == 3 / 11 and bubble_fraction(1, 8) == 0


def test_micro_batches_are_views_of_consecutive_samples():
    x, ids = np.arange(24.0).reshape(8, 3), np.arange(16).reshape(8, 2)
    parts = micro_batches((x, ids), 4)
    assert len(parts) == 4 and np.array_equal(parts[1][0], x[2:4]) and np.array_equal(parts[3][1], ids[6:8])
    assert np.shares_memory(parts[0][0], x)


def test_stage_placement_mlp_lenet_and_transformer():
    mlp = create_network("network", [8, 8, 8, 8])   # 5 Dense layers
    layout = ParallelLayout(1, 1, 1, pipeline_stage=4)
    mlp.place(layout)
    assert [s.stage for s in mlp.specs] == [0, 0, 0, 1, 1, 2, 2, 3, 3]
    lenet = create_network("lenet5")
    lenet.place(ParallelLayout(1, 1, 1, pipeline_stage=2))
    assert {s.name: s.stage for s in lenet.specs}["conv2.weight"] == 0 and lenet.specs[-1].stage == 1
    with pytest.raises(LayoutError, match="pipeline_stage=8 exceeds the 5 layers of conv6-conv16-120-84-10"):
        lenet.check(ParallelLayout(1, 1, 1, pipeline_stage=8))
    t = create_network("transformer", transformer={"vocab_size": 16, "d_model": 8, "num_heads": 2,
                                                   "encoder_layers": 2, "decoder_layers": 2})
    t.place(ParallelLayout(1, 1, 1, pipeline_stage=4))
    stage = {s.name: s.stage for s in t.specs}
    assert stage["src_embedding.word_embedding.embedding_table"] == stage["tgt_embedding.word_embedding.embedding_table"] == 0
    assert stage["head.weight"] == 3 and stage["encoder.blocks.1.layernorm1.gamma"] == 1
    assert stage["decoder.blocks.0.attention.dense1.weight"] == 2 and stage["decoder.blocks.1.output.mapping.weight"] == 3
    with pytest.raises(LayoutError, match="exceeds the 4 encoder and decoder blocks"):
        t.check(ParallelLayout(1, 1, 1, pipeline_stage=8))


def test_the_save_plan_puts_each_parameter_on_its_stage():
    mlp = create_network("network", [8, 8, 8, 8])
    layout = ParallelLayout(2, 2, 2, pipeline_stage=2)   # 8 ranks: stage 0 = 0-3, stage 1 = 4-7
    mlp.place(layout)
    plan = save_plan(layout, mlp.specs, ("moments",))
    written = {r: {p.name for p in plan.for_rank(r)} for r in range(8)}
    assert written[0] == written[3] and "layer1.param" in written[0] and "layer5.weight" not in written[0]
    assert "layer5.weight" in written[6] and "layer1.param" not in written[6]
    for entry in slices_json(plan):
        holders = progression.members(progression.set_from_json(entry["holders"]))
        stage = {s.name: s.stage for s in mlp.specs}[entry["tensor"].split("/")[1].removeprefix("moments.")]
        assert holders and all(layout.coords(r).stage == stage for r in holders), entry
    spec = next(s for s in mlp.specs if s.name == "layer4.bias")   # replicated over mp, sharded by k
    assert tensor_holders(spec, layout, 5) == [4, 5] and spec.stage == 1
    meta = graph_meta("net", layout, mlp.specs, ("moments",))
    assert [p["stage"] for p in meta["parameters"]] == [s.stage for s in mlp.specs]


def test_a_checkpoint_of_another_stage_count_is_refused_naming_it():
    from dsim.checkpoint.errors import CheckpointError
    from dsim.checkpoint.loader import check_compatible
    saved = {"world_size": 8, "layout": ParallelLayout(2, 2, 1, pipeline_stage=2).to_dict()}
    with pytest.raises(CheckpointError, match="saved with pipeline_stage=2, this run has pipeline_stage=1"):
        check_compatible(saved, ParallelLayout(4, 2), 8, "x.commit")
    old = {"world_size": 8, "layout": {"data_parallel": 2, "model_parallel": 4, "optimizer_shard": 1}}
    check_compatible(old, ParallelLayout(2, 4), 8, "x.commit")   # records without stages still fit
    with pytest.raises(CheckpointError, match="saved with pipeline_stage=1, this run has pipeline_stage=2"):
        check_compatible(old, ParallelLayout(1, 4, 1, pipeline_stage=2), 8, "x.commit")
