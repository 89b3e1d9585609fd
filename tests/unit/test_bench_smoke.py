"""The benchmarks run at toy size (seconds, no torch), and the save plan they time is what the saver writes."""
import json
import socket
import sys

import pytest

from conftest import ROOT, SMALL, mpirun, run_command
from dsim.checkpoint.plan import commit_record, graph_meta, save_plan
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



@pytest.mark.e2e
def test_plan_records_equal_what_the_saver_writes(tmp_path):
    overrides = SMALL + ["data.num_samples=64", "train.epochs=1", "output.progress_bar=false", "output.dir=run",
                         "parallel.optimizer_shard=2", "dtype=float64"]
    mpirun(8, ["-m", "dsim.train", *[a for o in overrides for a in ("--set", o)]], cwd=tmp_path, check=0)
    ckpt = tmp_path / "run" / "checkpoints"
    layout = ParallelLayout(2, 4, 2)
    specs = create_network("network", [64, 128, 128, 64]).specs
    assert json.loads((ckpt / "network-graph.meta").read_text()) == graph_meta("network", layout, specs, ("moments",))
    written = json.loads((ckpt / "network-1_2.commit").read_text())
    plan = save_plan(layout, specs, ("moments",))
    host = socket.gethostname()  # every rank on this one host (dsim.parallel.hosts, from MPI itself)
    assert written == {**commit_record("network-1_2", "network", plan, 1, 2, 2, 1, time=written["time"],
                                       nbytes=written["bytes"], host_of=[host] * 8), "digests": written["digests"]}
    assert written["hosts"] == {host: [{"start": 0, "stop": 8, "step": 1}]}
    assert written["files"] == {"template": "rank_{rank}/network-1_2.h5", "ranks": [{"start": 0, "stop": 8, "step": 1}]}
    assert written["digests"]["file"] == "network-1_2.digests"
    digests = json.loads((ckpt / "network-1_2.digests").read_text())
    assert len(digests["digests"]) == len(digests["sizes"]) == 8 and None not in digests["digests"]
    assert sum(digests["sizes"]) == written["bytes"] == sum((ckpt / f"rank_{r}/network-1_2.h5").stat().st_size
                                                            for r in range(8))


@pytest.mark.e2e
def test_bench_runs_at_toy_size(tmp_path):
    out = tmp_path / "results" / "toy.json"
    proc = run_command([sys.executable, "-m", "bench", "--size", "toy", "--no-dcp", "--out", str(out),
                        "--workdir", str(tmp_path / "work")], ROOT, 900, 0)
    assert "| figure | min | median | target |" in proc.stdout
    results = json.loads(out.read_text())
    assert list(results["suites"]) == ["step", "save_load", "planning", "training", "recovery", "models", "pipeline"]
    assert results["machine"]["cores"] >= 1 and results["versions"]["h5py"]
    assert list((tmp_path / "work").iterdir()) == []  # every benchmark file removed

    step = results["suites"]["step"]["raw"]   # one process and dp2, one repeat; torch beside only when installed
    for name, ranks in (("one process", 1), ("dp2", 2)):
        (rep,) = step[name]["repeats"]
        assert len(rep["ranks"]) == ranks
        for r in rep["ranks"]:
            d = r["dsim"]
            assert d["step_s"] > 0 and d["matmul_s"] > 0 and d["update_s"] > 0
            assert d["peak_rss"] > d["state_bytes"] > 0  # the interpreter alone is larger than a toy model
            assert 0 <= d["shared_overcount"] < d["peak_rss"]  # RSS - PSS: pages shared with the other processes
    assert step["dp2"]["repeats"][0]["ranks"][0]["dsim"]["dp_raw_s"] > 0

    io = results["suites"]["save_load"]
    assert len(io["repeats"]) == 3 and io["params"]["state_bytes"] >= 2 ** 22
    for rep in io["repeats"]:
        assert rep["verified"] == {"raw": True, "dsim": True}  # each load restored the saved bytes
        assert max(rep["resident_before_load"].values()) < 0.1  # and read them from disk, not the page cache
        assert all(rep["save_s"][m] > 0 and rep["load_s"][m] > 0 for m in ("raw", "dsim"))
        assert rep["reshard_s"] > 0 and rep["reshard_ranks"] == 1   # 2 ranks -> 1 (3/4 of 2, at least 1)
    assert len(io["figures"]["save_dsim_over_raw"]) == 3
    assert "skipped (--no-dcp)" in results["table"]

    plan = results["suites"]["planning"]["figures"]
    assert [plan[f"mp4/{w}"]["sizes"]["commit_record_file_entries"] for w in (8, 64, 512)] == [1, 1, 1]
    assert {plan[f"mp4/{w}"]["sizes"]["commit_record_slices"] for w in (8, 64, 512)} == {48}
    assert {plan[f"mp4/{w}"]["sizes"]["distinct_slices"] for w in (8, 64, 512)} == {48}

    train = results["suites"]["training"]
    for rep in train["repeats"]:
        v = rep["variants"]
        assert (v["none"]["saves"], v["k=1"]["saves"], v["k=10"]["saves"]) == (0, 6, 1)  # k=10: the last step's save
        assert all(x["steps"] == 6 and x["step_s"] > 0 for x in v.values())

    rec = results["suites"]["recovery"]  # rank 3 killed in step 9, periodic checkpoints every 5 steps
    for rep in rec["repeats"]:
        assert {w: rep[w]["steps_lost"] for w in rep} == {"restart": 3, "last_gasp": 0, "healing": 0, "spares": 0,
                                                          "uce": 0}
        assert {w: rep[w]["resumed_from"] for w in rep} == {"restart": 5, "last_gasp": 8, "healing": 8, "spares": 8,
                                                            "uce": 8}
        assert all(0 < rep[w]["seconds"] < 120 for w in rep)
        assert all(rep[w]["repair_ms"] > 0 for w in ("healing", "spares", "uce"))

    models = results["suites"]["models"]["figures"]  # each seed model on 2 ranks and in one process
    assert set(models) == {"lenet5", "transformer"}
    assert all(len(f["ranks_over_single"]) == 1 and f["single_step_s"][0] > 0 for f in models.values())
    assert models["transformer"]["saving_over_none"][0] > 1  # its config saves every step: slower than none

    pipe = results["suites"]["pipeline"]["figures"]  # pp1 x dp2 and pp2 x dp1, 2 micro-batches
    assert set(pipe) == {"pp1", "pp2"} and pipe["pp2"]["ideal_bubble"] == 1 / 3
    assert pipe["pp2"]["step_s"][0] > 0 and pipe["pp1"]["over_pp1"] == [1.0]


def test_bench_unknown_suite_is_one_error_line(tmp_path):
    proc = run_command([sys.executable, "-m", "bench", "--only", "nope", "--out", str(tmp_path / "x.json")],
                       ROOT, 60, 2)
    assert proc.stderr.strip().splitlines() == ["bench: error: unknown suite nope (known: step, save_load, planning, training, recovery, models, pipeline)"]
    assert not (tmp_path / "x.json").exists()
