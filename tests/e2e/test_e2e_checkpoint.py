"""Checkpoints end to end under mpirun -n 8: the seed's fault-at-epoch-6 scenario, kills mid-save, bad files."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import made_once, mpirun
from dsim.checkpoint import load_checkpoint, restore_group_info_list
from ftjob import LOSS

pytestmark = pytest.mark.e2e
RUN = ["-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=320",
       "--set", "train.epochs=10", "--set", "output.loss_every=10", "--set", "optimizer.name=adam",
       "--set", "optimizer.learning_rate=0.002", "--set", "parallel.optimizer_shard=2",
       "--set", "output.dir=run"]


def listing(ckpt: Path):
    return sorted(p.name for p in ckpt.iterdir() if p.is_file()), sorted(p.name for p in (ckpt / "rank_0").iterdir())


def same_final_state(dir_a, name_a, dir_b, name_b):
    for rank in range(8):
        a = load_checkpoint(dir_a / f"rank_{rank}" / f"{name_a}.h5")
        b = load_checkpoint(dir_b / f"rank_{rank}" / f"{name_b}.h5")
        tensors = [n for n in a.slices]
        assert len(tensors) == 27 and set(tensors) == set(b.slices)  # 9 params, 18 Adam moments
        for n in tensors:
            assert np.array_equal(a[n], b[n]), (rank, n)


def test_seed_scenario_fault_at_epoch_6_then_resume_is_bit_identical(tmp_path):
    # the seed's 10 epochs, each cut to 3 steps (the scenario is about epochs; 30 steps, not 100)
    seed = [*RUN, "--set", "train.steps_per_epoch=3", "--set", "output.loss_every=1"]
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "faulty"
    ref_dir.mkdir(), dir_.mkdir()
    ref = mpirun(8, seed, cwd=ref_dir, check=0)
    crash = mpirun(8, [*seed, "--set", "fault.kind=exception", "--set", "fault.at=epoch_end", "--set", "fault.epoch=6"],
                   cwd=dir_)
    assert crash.returncode != 0 and "Some errors happen." in crash.stderr
    ckpt = dir_ / "run" / "checkpoints"
    files, shards = listing(ckpt)
    assert files == sorted([".dsim-lease", "network-graph.meta"] + [f"network-{e}_3.{x}" for e in (2, 3, 4, 5, 6)
                                                                    for x in ("commit", "digests")])
    assert shards == ["group_info.json"] + [f"network-{e}_3.h5" for e in (2, 3, 4, 5, 6)]
    p = load_checkpoint(ckpt / "rank_3" / "network-6_3.h5")  # the seed reads these back
    assert int(p["epoch_num"]) == 6 and int(p["step_num"]) == 18

    resumed = mpirun(8, [*seed, "--resume", "auto"], cwd=dir_, check=0)
    assert "resumed from run/checkpoints/rank_0/network-6_3.h5 (global step 18: epoch 7 step 0)" in resumed.stdout
    files, shards = listing(ckpt)
    assert [f for f in files if f.startswith("network_1-")] == sorted(
        ["network_1-graph.meta"] + [f"network_1-{e}_3.{x}" for e in (7, 8, 9, 10) for x in ("commit", "digests")])
    assert len([f for f in files if f.startswith("network-") and f.endswith(".commit")]) == 5
    # the loss lines after the resume point equal the uninterrupted run's, and so does the final state
    ref_losses = LOSS.findall(ref.stdout)
    assert len(ref_losses) == 30 and LOSS.findall(resumed.stdout) == ref_losses[18:]
    same_final_state(ref_dir / "run" / "checkpoints", "network-10_3", ckpt, "network_1-10_3")


@pytest.mark.parametrize("rank,at", [(3, "save"), (0, "commit")])
def test_kill_mid_save_leaves_previous_state_or_committed(tmp_path, rank, at):
    run = mpirun(8, [*RUN, "--set", "train.epochs=3", "--set", "fault.kind=kill", "--set", f"fault.rank={rank}",
                     "--set", f"fault.at={at}", "--set", "fault.step=20"], cwd=tmp_path, timeout=120)
    assert run.returncode != 0
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_10.commit"]  # step 20 never committed
    leftovers = list(ckpt.glob("rank_*/network-2_10.h5*"))
    assert leftovers  # the interrupted save left files behind...
    resumed = mpirun(8, [*RUN, "--set", "train.epochs=3", "--resume", "auto"], cwd=tmp_path, check=0)
    assert "resumed from run/checkpoints/rank_0/network-1_10.h5 (global step 10" in resumed.stdout
    assert "removing leftover of an interrupted save" in resumed.stderr
    assert not any(p.exists() for p in leftovers)  # ...which the next run removed, never loaded
    assert (ckpt / "network-1_10.commit").exists() and (ckpt / "rank_5" / "network-1_10.h5").exists()


def test_group_info_file_env(tmp_path):
    env = {"GROUP_INFO_FILE": str(tmp_path / "ckpt_dir{rank}" / "group_info.pb")}
    os.environ.update(env)
    try:
        mpirun(8, ["-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=64",
                   "--set", "train.epochs=1", "--set", "parallel.optimizer_shard=1"], cwd=tmp_path, check=0)
    finally:
        del os.environ["GROUP_INFO_FILE"]
    assert restore_group_info_list(tmp_path / "ckpt_dir0" / "group_info.pb") == [0, 4]
    assert restore_group_info_list(tmp_path / "ckpt_dir6" / "group_info.pb") == [2, 6]
    assert restore_group_info_list(tmp_path / "runs/default/checkpoints/rank_1/group_info.json") == [1, 5]


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """A finished run of 1 epoch (checkpoint network-1_10), made once; each test below damages a copy."""
    return made_once(tmp_path_factory, "one-epoch", 8, [*RUN, "--set", "train.epochs=1"], check=0)[0]


@pytest.mark.parametrize("damage,msg", [
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "truncated or corrupt HDF5 file"),
    (lambda p: p.write_text("not a checkpoint"), "not an HDF5 file"),
])
def test_resume_from_damaged_file_is_one_clear_line(one_epoch, tmp_path, damage, msg):
    shutil.copytree(one_epoch / "run", tmp_path / "run")
    shard = tmp_path / "run" / "checkpoints" / "rank_5" / "network-1_10.h5"
    damage(shard)
    proc = mpirun(8, [*RUN, "--set", "train.epochs=2", "--resume", "auto"], cwd=tmp_path, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and msg in errors[0] and "rank_5" in errors[0], proc.stderr
    assert shard.exists() and (tmp_path / "run" / "checkpoints" / "network-1_10.commit").exists()  # nothing deleted
