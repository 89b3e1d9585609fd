"""The tools end to end, as a user runs them: the tutorial of docs/, merge against an integrated save, events."""
import json
import sys

import h5py
import numpy as np
import pytest

import tutorial
from conftest import mpirun, run_command

pytestmark = pytest.mark.e2e
SMALL = ["-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=160",
         "--set", "train.epochs=1", "--set", "output.progress_bar=false"]


def tool(args, cwd, check=None):
    return run_command([sys.executable, "-m", *args], cwd, 120, check)


def test_readme_tutorial_runs_as_shown(tmp_path):
    regions = tutorial.tutorials()
    assert len(regions["seed-pages"]) >= 15  # the section is there: this test checks something
    for name, commands in regions.items():
        problems = tutorial.run(name, commands, tmp_path / name, timeout=900)
        assert not problems, "\n".join(problems)
    run = tmp_path / "seed-pages"
    events = [json.loads(line) for line in (run / "runs/tutorial/metrics.jsonl").read_text().splitlines()]
    quiet = ("step", "train_begin", "train_end", "checkpoint_committed")
    marked = [(e["event"], e["global_step"]) for e in events if e["event"] not in quiet]
    assert marked == [("fault", 60), ("resume", 60), ("repair", 100), ("resume", 100)]
    kept = {p.name.removesuffix(".commit") for p in (run / "runs/tutorial/checkpoints").glob("*.commit")}
    assert kept and kept <= {e["checkpoint"] for e in events if e["event"] == "checkpoint_committed"}
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_of_shards_equals_the_integrated_save_of_the_same_run(tmp_path):
    """dp2 x mp2 with optimizer shard 2 and Adam: slices cut two ways; the merged view must be the full tensors."""
    layout = ["--set", "parallel.model_parallel=2", "--set", "parallel.optimizer_shard=2", "--set", "optimizer.name=adam"]
    mpirun(4, [*SMALL, *layout, "--set", "output.dir=sharded"], cwd=tmp_path, check=0)
    mpirun(4, [*SMALL, *layout, "--set", "output.dir=whole", "--set", "checkpoint.integrated_save=true"], cwd=tmp_path,
           check=0)
    for d in ("sharded", "whole"):
        out = tool(["dsim.inspect", d, "--verify"], tmp_path, check=0).stdout
        assert out.rstrip().endswith(f"{d}/checkpoints: clean"), out
    merged = tool(["dsim.inspect", "--merge", "sharded/checkpoints/network-1_5.commit", "-o", "out/full.h5"], tmp_path,
                  check=0)
    assert merged.stdout.startswith("merged network-1_5 (27 tensors, global step 5) into out/full.h5")
    with h5py.File(tmp_path / "out/full.h5", "r") as m, h5py.File(tmp_path / "whole/checkpoints/network-1_5.h5", "r") as w:
        names = [f"{k}/{n}" for k in ("params", "optimizer") for n in w[k]]
        assert len(names) == 27 and sorted(names) == sorted(f"{k}/{n}" for k in ("params", "optimizer") for n in m[k])
        for n in names:
            assert m[n].is_virtual and np.array_equal(m[n][()], w[n][()]), n
        assert any(len(m[n].virtual_sources()) == 4 for n in names)  # cut by mp and by the optimizer shard


def test_fault_on_a_non_zero_rank_is_recorded_before_it_dies(tmp_path):
    run = mpirun(4, [*SMALL, "--set", "parallel.model_parallel=2", "--set", "fault.kind=kill", "--set", "fault.rank=3",
                     "--set", "fault.step=3", "--set", "output.dir=run"], cwd=tmp_path, timeout=120)
    assert run.returncode != 0
    events = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert (fault["kind"], fault["rank"], fault["global_step"], fault["where"]) == ("kill", 3, 3, "at step 3")
    assert max(e["global_step"] for e in events if e["event"] == "step") <= 3
    plotted = tool(["dsim.plot", "run", "-o", "loss.png"], tmp_path, check=0)
    assert "events: fault@3" in plotted.stdout and (tmp_path / "loss.png").stat().st_size > 10_000
