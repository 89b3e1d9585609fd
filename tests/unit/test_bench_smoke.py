"""The save plan the benchmarks time (bench/planning.py), checked against the layout; the bench's command line; the
torch models the benchmarks time beside dsim's (bench/torch_peers.py), checked against them (when torch is there).

The benchmarks at toy size, and the plan against what the saver writes: tests/e2e/test_e2e_bench.py."""
import json
import sys

import numpy as np
import pytest

from conftest import ROOT, run_command
from dsim.checkpoint.plan import commit_record, save_plan
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout, owned_slice

SPECS = create_network("network").specs
LAYOUTS = [ParallelLayout(2, 4, 1), ParallelLayout(4, 2, 2), ParallelLayout(8, 1, 8), ParallelLayout(1, 8, 1),
           ParallelLayout(4, 2, 4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_save_plan_gives_every_rank_its_owned_slices(layout):
    plan = save_plan(layout, SPECS, ("moment1", "moment2"))
    for rank in range(layout.world_size):
        got = sorted((p.name, p.where.offsets, p.where.extents) for p in plan.for_rank(rank))
        want = sorted((f"{slot}{s.name}", owned_slice(s, layout, rank).offsets, owned_slice(s, layout, rank).extents)
                      for slot in ("", "moment1.", "moment2.") for s in SPECS)
        assert got == want, rank
    assert len({(p.name, p.where) for p in plan.slices}) == len(plan.slices)  # each distinct slice once


def test_save_plan_does_not_grow_with_data_parallel():
    small = save_plan(ParallelLayout(2, 4, 1), SPECS, ("moments",))
    big = save_plan(ParallelLayout(16384, 4, 1), SPECS, ("moments",))
    assert len(small.slices) == len(big.slices) == 48  # 7 of 10 parameters split 4 ways, 3 replicated; x2 for moments
    assert sum(len(s) for s in big.replica_sets) == 65536 and len(big.replica_sets) == 4
    small_record = commit_record("n-1_1", "n", small, 1, 1, 1, 1)
    big_record = commit_record("n-1_1", "n", big, 1, 1, 1, 1)
    assert len(big_record["slices"]) == len(small_record["slices"]) == 48
    assert len(json.dumps(big_record)) < 1.05 * len(json.dumps(small_record))  # only longer numbers


def test_record_holders_are_the_ranks_holding_each_slice():
    """Every slice's holders (progressions) are exactly the ranks whose owned slice it is, for every layout."""
    from dsim.checkpoint import progression
    for layout in LAYOUTS:
        plan = save_plan(layout, SPECS, ("moments",))
        for entry in commit_record("n-1_1", "n", plan, 1, 1, 1, 1)["slices"]:
            name = entry["tensor"].split("/", 1)[1].removeprefix("moments.")
            spec = next(s for s in SPECS if s.name == name)
            want = [r for r in range(layout.world_size)
                    if list(owned_slice(spec, layout, r).offsets) == entry["offsets"]]
            assert progression.members(progression.set_from_json(entry["holders"])) == want, (layout, entry)


def test_bench_unknown_suite_is_one_error_line(tmp_path):
    proc = run_command([sys.executable, "-m", "bench", "--only", "nope", "--out", str(tmp_path / "x.json")],
                       ROOT, 60, 2)
    known = "step, update, save_load, planning, training, recovery, models, seed_torch, pipeline, cluster"
    assert proc.stderr.strip().splitlines() == [f"bench: error: unknown suite nope (known: {known})"]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("config", ["default", "lenet5", "transformer"])
def test_the_torch_peers_have_dsims_parameters(config):
    """bench.torch_peers matches each benchmarked model layer for layer: the same parameter shapes (up to a stored
    transpose) and the same weight-decay group, so the two frameworks time the same work."""
    pytest.importorskip("torch")
    from bench.torch_peers import optimizer, peer
    from dsim.config import load_config
    from dsim.optim.optimizers import decays
    cfg = load_config(ROOT / "configs" / f"{config}.yaml")
    m = cfg.model
    specs = create_network(m.name, m.hidden, vars(m.transformer), cfg.parallel.vocab_emb_dp).specs
    torch_net = peer(cfg)
    assert sorted(sorted(s.shape) for s in specs) == sorted(sorted(p.shape) for p in torch_net.parameters())
    groups = optimizer(cfg, torch_net.named_parameters()).param_groups
    if cfg.optimizer.name == "adamweightdecay":   # the decay group: dsim's rule on both sides
        decayed = sum(p.numel() for g in groups if g["weight_decay"] for p in g["params"])
        assert decayed == sum(int(np.prod(s.shape)) for s in specs if decays(s.name)) > 0
