"""The benchmarks run at toy size (seconds, torch left out: --no-torch), and the save plan they time is what the
saver writes under mpirun -n 8. (Moved from tests/unit/test_bench_smoke.py, whose other tests need no MPI.)"""
import json
import socket
import sys

import pytest

from bench.harness import TORCH_LEFT_OUT
from conftest import ROOT, SMALL, mpirun, run_command
from dsim.checkpoint.plan import commit_record, graph_meta, save_plan
from dsim.cluster import leftovers, unavailable
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout

pytestmark = pytest.mark.e2e


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


def test_bench_runs_at_toy_size(tmp_path):
    out = tmp_path / "results" / "toy.json"
    proc = run_command([sys.executable, "-m", "bench", "--size", "toy", "--no-dcp", "--no-torch", "--out", str(out),
                        "--workdir", str(tmp_path / "work")], ROOT, 900, 0)
    assert "| figure | min | median | target |" in proc.stdout
    results = json.loads(out.read_text())
    assert list(results["suites"]) == ["step", "update", "save_load", "planning", "training", "recovery", "models",
                                       "seed_torch", "pipeline", "cluster"]
    assert results["machine"]["cores"] >= 1 and results["versions"]["h5py"]
    assert list((tmp_path / "work").iterdir()) == []  # every benchmark file removed

    step = results["suites"]["step"]["raw"]   # one process and dp2, one repeat; torch left out (--no-torch)
    for name, ranks in (("one process", 1), ("dp2", 2)):
        (rep,) = step[name]["repeats"]
        assert len(rep["ranks"]) == ranks
        for r in rep["ranks"]:
            d = r["dsim"]
            assert d["step_s"] > 0 and d["matmul_s"] > 0 and d["update_s"] > 0
            assert d["peak_rss"] > d["state_bytes"] > 0  # the interpreter alone is larger than a toy model
            assert 0 <= d["shared_overcount"] < d["peak_rss"]  # RSS - PSS: pages shared with the other processes
    assert step["dp2"]["repeats"][0]["ranks"][0]["dsim"]["dp_raw_s"] > 0

    assert all("torch" not in r for rep in step["dp2"]["repeats"] for r in rep["ranks"])

    update = results["suites"]["update"]   # dsim's update of each optimizer alone, the table saying torch is left out
    assert set(update["raw"]["optimizers"]) == {"momentum", "adam", "adamweightdecay"}
    assert all(t["dsim"][0] > 0 and "torch" not in t for t in update["raw"]["optimizers"].values())
    assert update["rows"][0] == {"label": "torch", "text": TORCH_LEFT_OUT}

    seed = results["suites"]["seed_torch"]   # each seed model in one process, LeNet5 on dp2 too; dsim alone
    assert set(seed["raw"]) == {"lenet5/one process", "lenet5/dp2", "transformer/one process"}
    for key, result in seed["raw"].items():
        (rep,) = result["repeats"]
        assert [r["order"] for r in rep["ranks"]] == [["dsim"]] * result["ranks"]
        assert all(r["dsim"]["step_s"] > r["dsim"]["update_s"] > 0 for r in rep["ranks"])
    parts = seed["raw"]["lenet5/one process"]["parts"]   # its convolutions and poolings timed alone
    assert [k.split(": ")[1].split("(")[0] for k in parts] == ["Conv2d", "MaxPool2d", "Conv2d", "MaxPool2d"]
    assert all(set(t) == {"dsim"} and t["dsim"] > 0 for t in parts.values())
    assert seed["rows"][0] == {"label": "torch", "text": TORCH_LEFT_OUT}

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

    hosts = results["suites"]["cluster"]  # dp2 on 2 hosts x 1 rank against 1 host x 2, as made and at 10gbit
    if unavailable():
        assert hosts["rows"] == [{"label": "hosts made of namespaces", "text": f"not measured: {unavailable()}"}]
    else:
        f = hosts["figures"]
        assert f["volume"]["hosts"] == ["node1", "node2"] and f["volume"]["mp_groups_across_hosts"] == 0
        assert all(s > 0 for v in f["step_s"].values() for s in v)
        assert f["crossing_bytes_per_step"]["1 host x 2"] == [pytest.approx(0, abs=1000)]  # (an ARP now and then)
        assert all(0.95 < x < 1.3 for x in f["crossing_over_volume"]), f  # the gradients' sums, and headers
        assert hosts["raw"]["left_behind"] == [] and leftovers(hosts["raw"]["cluster"]) == []
