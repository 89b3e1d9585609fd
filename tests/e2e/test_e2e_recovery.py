"""Recovery end to end under mpirun -n 8: kill a rank, lose or corrupt shards, fall back, resume exactly.

The job: dp2 x mp4 (every shard has a replica), Adam, 3 epochs of 10 steps, a checkpoint every 7 steps
(so the newest one before a kill at step 17 is network-2_4: mid-epoch, global step 14).
"""
import shutil

import numpy as np
import pytest

from conftest import flip_byte, launch, made_once, mpirun, ROOT
from dsim.checkpoint import load_checkpoint
from dsim.checkpoint.group_info import group_info_list
from ftjob import LOSS

pytestmark = pytest.mark.e2e
RUN = ["-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=320",
       "--set", "train.epochs=3", "--set", "output.loss_every=1", "--set", "optimizer.name=adam",
       "--set", "optimizer.learning_rate=0.002", "--set", "checkpoint.save_checkpoint_steps=7",
       "--set", "checkpoint.save_checkpoint_epochs=null", "--set", "output.dir=run"]
KILL = ["--set", "fault.kind=kill", "--set", "fault.rank=3", "--set", "fault.step=17"]
RESUMED = "resumed from run/checkpoints/rank_0/network-2_4.h5 (global step 14: epoch 2 step 4)"


@pytest.fixture(scope="module")
def reference(recovery_reference):
    """The uninterrupted run (conftest's, shared with test_e2e_integrity): its loss lines and its checkpoint directory."""
    losses, d = recovery_reference
    return losses, d / "run" / "checkpoints"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A job whose rank 3 was SIGKILLed after step 17 (committed: steps 7 and 14)."""
    d, proc = made_once(tmp_path_factory, "killed", 8, [*RUN, *KILL], timeout=120)
    assert proc.returncode != 0 and "killing rank 3 (SIGKILL) at step 17" in proc.stdout
    ckpt = d / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_7.commit", "network-2_4.commit"]
    return d


def job_copy(killed, tmp_path):
    shutil.copytree(killed, tmp_path / "job")
    return tmp_path / "job", tmp_path / "job" / "run" / "checkpoints"


def assert_same_final_state(ref_ckpt, ckpt):
    for rank in range(8):
        a = load_checkpoint(ref_ckpt / f"rank_{rank}" / "network-3_10.h5")
        b = load_checkpoint(ckpt / f"rank_{rank}" / "network_1-3_10.h5")
        assert len(a.slices) == 27 and set(a.slices) == set(b.slices)  # 9 params, 18 Adam moments
        for name in a.slices:
            assert np.array_equal(a[name], b[name]), (rank, name)


def assert_resumed_exactly(reference, proc, ckpt):
    ref_losses, ref_ckpt = reference
    assert RESUMED in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[14:]  # steps 15..30, bit for bit
    assert_same_final_state(ref_ckpt, ckpt)


def test_kill_rank_3_then_recover_is_bit_identical(reference, killed, tmp_path):
    job, ckpt = job_copy(killed, tmp_path)
    proc = mpirun(8, [*RUN, "--resume", "auto"], cwd=job, check=0)
    assert "dsim: recovery:" not in proc.stdout  # every shard was whole
    assert_resumed_exactly(reference, proc, ckpt)


def test_resuming_a_finished_run_trains_nothing_then_more_epochs_train_on(recovery_reference, tmp_path):
    """--resume auto on a run that finished: one line, exit 0, nothing written; the directory stays clean. With
    one epoch more asked for, that epoch is trained and saved, and every checkpoint agrees with its files."""
    _, d = recovery_reference
    shutil.copytree(d, tmp_path / "job")
    job, ckpt = tmp_path / "job", tmp_path / "job" / "run" / "checkpoints"
    before = sorted((p.relative_to(ckpt), p.stat().st_mtime_ns) for p in ckpt.rglob("*") if p.name != ".dsim-lease")
    proc = mpirun(8, [*RUN, "--resume", "auto"], cwd=job, check=0)
    assert ("dsim: nothing to train: the run already finished (global step 30, and train.epochs=3 x 10 steps end "
            "at step 30); set train.epochs higher to train on") in proc.stdout, proc.stdout
    assert not LOSS.findall(proc.stdout) and "checkpoint saved" not in proc.stdout, proc.stdout
    assert sorted((p.relative_to(ckpt), p.stat().st_mtime_ns) for p in ckpt.rglob("*") if p.name != ".dsim-lease") \
        == before  # (the lease file names the job that held the directory last)
    more = mpirun(8, [*RUN, "--set", "train.epochs=4", "--resume", "auto"], cwd=job, check=0)
    assert "resumed from run/checkpoints/rank_0/network-3_10.h5 (global step 30: epoch 4 step 0)" in more.stdout
    assert [(int(e), int(s)) for e, s, _ in LOSS.findall(more.stdout)] == [(4, s) for s in range(1, 11)], more.stdout
    assert (ckpt / "network_1-4_10.commit").exists()
    verify = mpirun(1, ["-m", "dsim.inspect", str(ckpt), "--verify"], cwd=job)
    assert verify.returncode == 0 and f"{ckpt}: clean" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.parametrize("rank,donor,damage,repair", [
    (0, 4, "delete", False),
    (0, 4, "delete", True),
    (5, 1, "flip", True),
])
def test_lost_or_corrupt_shard_is_taken_from_its_replica(reference, killed, tmp_path, rank, donor, damage, repair):
    job, ckpt = job_copy(killed, tmp_path)
    shard = ckpt / f"rank_{rank}" / "network-2_4.h5"
    shard.unlink() if damage == "delete" else flip_byte(shard)
    proc = mpirun(8, [*RUN, "--resume", "auto", *(["--repair"] if repair else [])], cwd=job, check=0)
    why = "checkpoint file not found" if damage == "delete" else "checksum mismatch"
    assert (f"dsim: recovery: rank {rank}: {why}" in proc.stdout and
            f"using the replica on rank {donor} (group info {sorted([rank, donor])})" in proc.stdout), proc.stdout
    assert_resumed_exactly(reference, proc, ckpt)
    if not repair:
        assert not shard.exists()  # without --repair the directory is left as it was
        return
    assert f"dsim: recovery: repaired run/checkpoints/rank_{rank}/network-2_4.h5 from rank {donor}'s shard" in proc.stdout
    for r in range(8):  # the directory verifies clean: every file whole, each really its rank's
        p = load_checkpoint(ckpt / f"rank_{r}" / "network-2_4.h5", verify=True)
        assert p.meta["rank"] == r and int(p["global_step"]) == 14
    replica = load_checkpoint(ckpt / f"rank_{donor}" / "network-2_4.h5")
    repaired = load_checkpoint(shard)
    assert repaired.meta["rank"] == rank and group_info_list(repaired.meta["group_info"]) == sorted([rank, donor])
    assert all(np.array_equal(repaired[n], replica[n]) for n in replica.slices)
    kept = shard.with_name("network-2_4.h5.damaged")
    assert kept.exists() == (damage == "flip")  # a damaged file is kept aside, never deleted


NO_REPLICA = [*RUN, "--set", "parallel.optimizer_shard=2"]  # k = dp: every rank's slices are unique


@pytest.fixture(scope="module")
def no_replica(tmp_path_factory):
    """2 epochs without replicas (committed: steps 7, 14 and 20), made once: (its loss lines, its directory)."""
    d, first = made_once(tmp_path_factory, "no-replica", 8, [*NO_REPLICA, "--set", "train.epochs=2"], check=0)
    assert sorted(p.name for p in (d / "run" / "checkpoints").glob("*.commit")) == [
        "network-1_7.commit", "network-2_10.commit", "network-2_4.commit"]
    return LOSS.findall(first.stdout), d


def test_no_replica_falls_back_to_the_previous_checkpoint(no_replica, tmp_path):
    first_losses, _ = no_replica
    shutil.copytree(no_replica[1] / "run", tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "rank_3" / "network-2_10.h5").unlink()
    proc = mpirun(8, [*NO_REPLICA, "--resume", "auto"], cwd=tmp_path, check=0)
    assert ("dsim: recovery: checkpoint network-2_10 is not usable: checkpoint file not found: "
            "run/checkpoints/rank_3/network-2_10.h5, and no other rank holds rank 3's slices (group info [3]); "
            "falling back to the previous committed checkpoint network-2_4") in proc.stdout, proc.stdout
    assert RESUMED in proc.stdout
    # steps 15..20 repeat the first run's exactly, then training goes on to step 30
    losses = LOSS.findall(proc.stdout)
    assert losses[:6] == first_losses[14:] and len(losses) == 16
    assert (ckpt / "network-2_10.commit").exists() and (ckpt / "rank_4" / "network-2_10.h5").exists()  # kept


def test_no_usable_checkpoint_is_one_clear_line(no_replica, tmp_path):
    """(A checkpoint of another layout is resharded on load: tests/e2e/test_e2e_reshard.py.)"""
    shutil.copytree(no_replica[1] / "run", tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints"
    for name in ("network-1_7", "network-2_4", "network-2_10"):
        flip_byte(ckpt / "rank_6" / f"{name}.h5")
    proc = mpirun(8, [*NO_REPLICA, "--resume", "auto"], cwd=tmp_path, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0].startswith("dsim: error: no usable committed checkpoint in run/checkpoints (tried network-2_10: "
                                "checksum mismatch in run/checkpoints/rank_6/network-2_10.h5"), errors[0]
    for name in ("network-2_4", "network-1_7"):
        assert f"{name}: checksum mismatch in run/checkpoints/rank_6/{name}.h5" in errors[0], errors[0]
    assert sorted(p.name for p in ckpt.glob("*.commit")) == [
        "network-1_7.commit", "network-2_10.commit", "network-2_4.commit"]
    assert len(list(ckpt.glob("rank_*/network-*.h5"))) == 24 and not list(ckpt.glob("rank_*/*.damaged"))


def test_launch_scripts_save_then_recover(reference, tmp_path):
    """The seed's two scripts: train with sharded saves until rank 3 is killed, then recover and go on."""
    opts = [a for a in RUN if a not in ("-m", "dsim.train")]
    config = str(ROOT / "configs" / "default.yaml")
    crash = launch("run_parallel_save_ckpt.sh", [config, "ckpt", *opts, *KILL], cwd=tmp_path, timeout=120)
    assert crash.returncode != 0 and "killing rank 3" in crash.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.commit")) == ["network-1_7.commit", "network-2_4.commit"]
    (tmp_path / "ckpt" / "rank_0" / "network-2_4.h5").unlink()
    proc = launch("run_parallel_recover_ckpt.sh", [config, "ckpt", "--repair", *opts], cwd=tmp_path,
                  check=0)
    assert "dsim: resumed from ckpt/rank_0/network-2_4.h5 (global step 14: epoch 2 step 4)" in proc.stdout
    assert "using the replica on rank 4" in proc.stdout and "repaired ckpt/rank_0/network-2_4.h5" in proc.stdout
    assert LOSS.findall(proc.stdout) == reference[0][14:]  # the loss continues exactly where it stopped
