"""Checkpoint integrity end to end under mpirun -n 8: damaged metadata and swapped files repaired from replicas,
a full disk during a save (stop and continue), a read-only checkpoint directory as a resume source.

The job is test_e2e_recovery's: dp2 x mp4 (replica sets {0,4} {1,5} {2,6} {3,7}), Adam, 3 epochs of 10 steps,
a checkpoint every 7 steps. "Stopped" is the reference run's directory cut back to the checkpoints of steps
7 and 14 (network-1_7, network-2_4), as a job that ended after step 14 leaves it.
"""
import json
import re
import shutil
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest

from conftest import dsim_cli, flip_byte, mpirun, readonly_view, tmpfs
from dsim.checkpoint import load_checkpoint
from test_e2e_recovery import LOSS, RUN  # the same job; its uninterrupted run is conftest's recovery_reference

pytestmark = pytest.mark.e2e
RESUMED = "resumed from run/checkpoints/rank_0/network-2_4.h5 (global step 14: epoch 2 step 4)"


@pytest.fixture(scope="module")
def reference(recovery_reference):
    """The uninterrupted run: its loss lines and its directory (checkpoints of steps 7, 14, 21, 28, 30)."""
    return recovery_reference


def stopped(reference, tmp_path):
    """A copy of the reference job as if it had ended after step 14; returns (job dir, checkpoint dir)."""
    job = tmp_path / "job"
    shutil.copytree(reference[1], job)
    ckpt = job / "run" / "checkpoints"
    for name in ("network-3_1", "network-3_8", "network-3_10"):
        (ckpt / f"{name}.commit").unlink()
        (ckpt / f"{name}.digests").unlink()
        for p in ckpt.glob(f"rank_*/{name}.h5"):
            p.unlink()
    return job, ckpt


def same_final_state(ref_ckpt, ckpt, name="network_1-3_10"):
    for rank in range(8):
        a = load_checkpoint(ref_ckpt / f"rank_{rank}" / "network-3_10.h5")
        b = load_checkpoint(ckpt / f"rank_{rank}" / f"{name}.h5")
        assert len(a.slices) == 27 and set(a.slices) == set(b.slices)
        for n in a.slices:
            assert np.array_equal(a[n], b[n]), (rank, n)


def inspect(*args, cwd):
    return subprocess.run([sys.executable, "-m", "dsim.inspect", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


# -- damage, one protected item per rank's file of the newest checkpoint -------------------------------------


def edit_json_attr(attr, key, change):
    def damage(path):
        with h5py.File(path, "r+") as f:
            d = json.loads(f.attrs[attr])
            d[key] = change(d[key])
            f.attrs[attr] = json.dumps(d)
    return damage


def edit_append_info(key):
    def damage(path):
        with h5py.File(path, "r+") as f:
            f[f"append_info/{key}"].write_direct(np.array(f[f"append_info/{key}"][()] + 1))
    return damage


def replace_with(other):
    def damage(path):
        shutil.copyfile(path.parent.parent / other, path)
    return damage


# rank -> (item, damage, what the log names). Ranks 0-3 (group A) and 4-7 (group B) each damage one rank of
# every replica set, so every damaged file has a healthy replica.
DAMAGES = {
    0: ("a tensor", flip_byte, "checksum mismatch in run/checkpoints/rank_0/network-2_4.h5: params/"),
    1: ("a step counter", edit_json_attr("optimizer", "global_step", lambda v: v + 1),
        "metadata checksum mismatch in run/checkpoints/rank_1/network-2_4.h5: optimizer.global_step"),
    2: ("the data position", edit_json_attr("data", "global_step", lambda v: v - 1),
        "metadata checksum mismatch in run/checkpoints/rank_2/network-2_4.h5: data.global_step"),
    3: ("an optimizer hyper-parameter", edit_json_attr("optimizer", "beta1", lambda v: 0.8),
        "metadata checksum mismatch in run/checkpoints/rank_3/network-2_4.h5: optimizer.beta1"),
    4: ("a layout field", edit_json_attr("layout", "optimizer_shard", lambda v: 2),
        "metadata checksum mismatch in run/checkpoints/rank_4/network-2_4.h5: layout.optimizer_shard"),
    5: ("an append_info value", edit_append_info("step_num"),
        "metadata checksum mismatch in run/checkpoints/rank_5/network-2_4.h5: append_info/step_num"),
    6: ("an older file of the same rank", replace_with("rank_6/network-1_7.h5"),
        "run/checkpoints/rank_6/network-2_4.h5 is not the file committed (its content digest differs from the "
        "commit record's; it holds rank 6's shard of global step 7)"),
    7: ("another rank's file of the same step", replace_with("rank_3/network-2_4.h5"),
        "run/checkpoints/rank_7/network-2_4.h5 is not the file committed (its content digest differs from the "
        "commit record's; it holds rank 3's shard of global step 14)"),
}


def damage(ckpt, ranks):
    for r in sorted(ranks, key=lambda r: r not in (6, 7)):  # copies of whole files first
        DAMAGES[r][1](ckpt / f"rank_{r}" / "network-2_4.h5")


def test_verify_names_every_damaged_item(reference, tmp_path):
    job, ckpt = stopped(reference, tmp_path)
    clean = inspect("run", "--verify", cwd=job)
    assert clean.returncode == 0 and "run/checkpoints: clean" in clean.stdout and "not checked" not in clean.stdout
    damage(ckpt, range(8))
    proc = inspect("run", "--verify", cwd=job)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "verify network-1_7: ok" in proc.stdout
    for rank, (item, _, named) in DAMAGES.items():
        assert f"rank {rank}: {named.replace('run/checkpoints/', '')}" in proc.stdout, (item, proc.stdout)


@pytest.mark.parametrize("group", [(0, 1, 2, 3), (4, 5, 6, 7)])
def test_damaged_files_are_repaired_from_replicas_bit_identically(reference, tmp_path, group):
    job, ckpt = stopped(reference, tmp_path)
    damage(ckpt, group)
    proc = mpirun(8, [*RUN, "--resume", "auto", "--repair"], cwd=job, check=0)
    for rank in group:
        donor = (rank + 4) % 8
        assert (f"dsim: recovery: rank {rank}: {DAMAGES[rank][2]}" in proc.stdout and
                f"using the replica on rank {donor} (group info {sorted([rank, donor])})" in proc.stdout), proc.stdout
        assert (f"dsim: recovery: repaired run/checkpoints/rank_{rank}/network-2_4.h5 from rank {donor}'s shard "
                "(the damaged file is kept as network-2_4.h5.damaged)") in proc.stdout
    assert RESUMED in proc.stdout
    assert LOSS.findall(proc.stdout) == reference[0][14:]  # steps 15..30, bit for bit
    same_final_state(reference[1] / "run" / "checkpoints", ckpt)
    after = inspect("run", "--verify", cwd=job)
    assert after.returncode == 0 and "run/checkpoints: clean" in after.stdout, after.stdout


def test_without_a_healthy_replica_recovery_falls_back_to_the_previous_checkpoint(reference, tmp_path):
    job, ckpt = stopped(reference, tmp_path)
    damage(ckpt, range(8))  # both ranks of every replica set damaged
    proc = mpirun(8, [*RUN, "--resume", "auto"], cwd=job, check=0)
    assert ("dsim: recovery: checkpoint network-2_4 is not usable: checksum mismatch in "
            "run/checkpoints/rank_0/network-2_4.h5") in proc.stdout, proc.stdout
    assert "falling back to the previous committed checkpoint network-1_7" in proc.stdout
    assert "resumed from run/checkpoints/rank_0/network-1_7.h5 (global step 7: epoch 1 step 7)" in proc.stdout
    assert LOSS.findall(proc.stdout) == reference[0][7:]
    same_final_state(reference[1] / "run" / "checkpoints", ckpt)


# -- a full disk during a save ------------------------------------------------------------------------------
def checkpoint_bytes(reference) -> int:
    return sum(p.stat().st_size for p in (reference[1] / "run" / "checkpoints").glob("rank_*/network-1_7.h5"))


def fill(directory, leave: int):
    """Fill directory's file system up to `leave` free bytes with one ballast file; returns its path."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as fh:
        fh.write(b"\0" * max(0, shutil.disk_usage(directory).free - leave))
    return ballast


def test_disk_full_with_stop_is_one_line_and_the_previous_checkpoint_stays_latest(reference, tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "16m"):
        fill(disk, int(1.5 * checkpoint_bytes(reference)) + 256 * 1024)  # room for one checkpoint, not two
        ckpt = disk / "ckpt"
        proc = mpirun(8, [*RUN, "--set", f"checkpoint.directory={ckpt}"], cwd=tmp_path, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: ")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr
        assert re.match(rf"dsim: error: checkpoint network-2_4 \(global step 14\) not saved in {re.escape(str(ckpt))}: "
                        r"its files could not be written: No space left on device on rank\(s\) [-, 0-9]+ \([0-9.]+ \w*B free "
                        r"of 16.0 MiB\); the latest checkpoint is still network-1_7$", errors[0]), errors[0]
        assert "Traceback" not in proc.stderr + proc.stdout and "signal" not in proc.stderr.lower()
        assert LOSS.findall(proc.stdout) == reference[0][:13]  # the save of step 14 runs before its loss line
        assert not list(ckpt.rglob("*.tmp")) and not list(ckpt.glob("rank_*/network-2_4.h5*"))
        assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_7.commit"]
        verified = inspect(ckpt, "--verify", cwd=tmp_path)
        assert verified.returncode == 0 and f"{ckpt}: clean" in verified.stdout, verified.stdout


def test_disk_full_during_an_async_save_is_the_same_one_line(reference, tmp_path):
    """The background write fails; a later step end reports it as a synchronous save would, and stops."""
    disk = tmp_path / "disk"
    with tmpfs(disk, "16m"):
        fill(disk, int(1.5 * checkpoint_bytes(reference)) + 256 * 1024)
        ckpt = disk / "ckpt"
        proc = mpirun(8, [*RUN, "--set", f"checkpoint.directory={ckpt}", "--set", "checkpoint.async_save=true"],
                      cwd=tmp_path, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: ")]
        assert proc.returncode == 1 and len(errors) == 1, proc.stderr
        assert re.match(rf"dsim: error: checkpoint network-2_4 \(global step 14\) not saved in {re.escape(str(ckpt))}: "
                        r"its files could not be written: No space left on device on rank\(s\) [-, 0-9]+ ", errors[0])
        assert errors[0].endswith("the latest checkpoint is still network-1_7"), errors[0]
        assert "Traceback" not in proc.stderr + proc.stdout
        losses = LOSS.findall(proc.stdout)  # training went on while the files were written, until the failure was known
        assert 14 <= len(losses) <= 20 and losses == reference[0][:len(losses)]
        assert not list(ckpt.rglob("*.tmp")) and not list(ckpt.glob("rank_*/network-2_4.h5*"))
        assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_7.commit"]


def test_disk_full_with_continue_warns_and_later_saves_succeed(reference, tmp_path):
    disk = tmp_path / "disk"
    with tmpfs(disk, "16m"):
        ballast = fill(disk, int(1.5 * checkpoint_bytes(reference)) + 256 * 1024)
        ckpt, metrics = disk / "ckpt", tmp_path / "run" / "metrics.jsonl"
        done = threading.Event()

        def free_space_on_failure():  # an operator freeing space after the warning
            while not done.is_set():
                if metrics.exists() and "checkpoint_save_failed" in metrics.read_text():
                    ballast.unlink()
                    return
                time.sleep(0.02)
        watcher = threading.Thread(target=free_space_on_failure, daemon=True)
        watcher.start()
        try:
            proc = mpirun(8, [*RUN, "--set", f"checkpoint.directory={ckpt}", "--set", "checkpoint.on_save_error=continue"],
                          cwd=tmp_path, check=0)
        finally:
            done.set()
            watcher.join()
        warnings = [line for line in proc.stderr.splitlines() if line.startswith("dsim: ")]
        assert len(warnings) == 1 and warnings[0].startswith(
            f"dsim: warning: checkpoint network-2_4 (global step 14) not saved in {ckpt}: its files could not be "
            "written: No space left on device on rank(s) "), proc.stderr
        assert warnings[0].endswith("the latest checkpoint is still network-1_7; training goes on and the next save "
                                    "tries again (checkpoint.on_save_error: continue)")
        assert "Traceback" not in proc.stderr + proc.stdout
        assert LOSS.findall(proc.stdout) == reference[0]  # training itself went on untouched
        commits = sorted(p.name for p in ckpt.glob("*.commit"))
        assert "network-2_4.commit" not in commits and {"network-1_7.commit", "network-3_8.commit",
                                                       "network-3_10.commit"} <= set(commits), commits
        assert not list(ckpt.rglob("*.tmp"))
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        failed = [e for e in events if e.get("event") == "checkpoint_save_failed"]
        assert len(failed) == 1 and failed[0]["checkpoint"] == "network-2_4" and failed[0]["global_step"] == 14
        same_final_state(reference[1] / "run" / "checkpoints", ckpt, "network-3_10")
        verified = inspect(ckpt, "--verify", cwd=tmp_path)
        assert verified.returncode == 0 and f"{ckpt}: clean" in verified.stdout, verified.stdout


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_with_continue_to_the_end_reports_the_unsaved_steps_and_fails(reference, tmp_path, mode):
    """on_save_error: continue with the storage full to the end: the last save has no next save to try again, so
    the run ends with one error line naming the steps that exist in no checkpoint, and exit status 1."""
    disk = tmp_path / "disk"
    with tmpfs(disk, "16m"):
        fill(disk, int(1.5 * checkpoint_bytes(reference)) + 256 * 1024)  # room for one checkpoint, not two
        ckpt = disk / "ckpt"
        proc = mpirun(8, [*RUN, "--set", f"checkpoint.directory={ckpt}", "--set", "checkpoint.on_save_error=continue",
                          "--set", f"checkpoint.async_save={mode == 'async'}"], cwd=tmp_path, timeout=120)
        lines = [line for line in proc.stderr.splitlines() if line.startswith("dsim: ")]
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert all(w.startswith("dsim: warning: checkpoint ") for w in lines[:-1]) and len(lines) >= 2, proc.stderr
        assert lines[-1] == ("dsim: error: the last save was refused (checkpoint.on_save_error: continue): global steps "
                             "8-30 exist in no checkpoint; the latest checkpoint is network-1_7 (global step 7)"), proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
        assert LOSS.findall(proc.stdout) == reference[0]  # training itself went on untouched
        assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_7.commit"]
        verified = inspect(ckpt, "--verify", cwd=tmp_path)
        assert verified.returncode == 0 and f"{ckpt}: clean" in verified.stdout, verified.stdout


# -- a read-only checkpoint directory -------------------------------------------------------------------------
def test_read_only_source_resumes_with_saves_elsewhere(reference, tmp_path):
    job, ckpt = stopped(reference, tmp_path)
    ro = job / "snapshot"
    with readonly_view(ckpt, ro):
        before = sorted((str(p), p.stat().st_mtime_ns) for p in ro.rglob("*"))
        proc = mpirun(8, [*RUN, "--resume-from", "snapshot", "--set", "checkpoint.directory=elsewhere"], cwd=job,
                      check=0)
        assert "resumed from snapshot/rank_0/network-2_4.h5 (global step 14: epoch 2 step 4)" in proc.stdout
        assert "Traceback" not in proc.stderr and "dsim: warning" not in proc.stderr, proc.stderr
        assert LOSS.findall(proc.stdout) == reference[0][14:]
        same_final_state(reference[1] / "run" / "checkpoints", job / "elsewhere", "network-3_10")
        assert sorted((str(p), p.stat().st_mtime_ns) for p in ro.rglob("*")) == before  # never written

        # refused before step 1: the first under mpirun, the second (the command line alone) in one process
        for args, line, ranks in [
            (["--resume", "auto", "--set", "checkpoint.directory=snapshot"],
             "dsim: error: config: checkpoint.directory 'snapshot' is not a writable directory: Read-only file "
             "system; save elsewhere (checkpoint.directory), and to resume from its checkpoints, --resume-from snapshot",
             8),
            (["--resume-from", "snapshot", "--repair"],
             "dsim: error: --repair writes into the checkpoint directory, and --resume-from snapshot is only read", None),
        ]:
            refused = dsim_cli(ranks, [*RUN, *args], cwd=job, timeout=120)
            lines = [x for x in refused.stderr.splitlines() if x.startswith("dsim: ")]
            assert refused.returncode == 2 and len(lines) == 1 and lines[0].startswith(line), refused.stderr
            assert not LOSS.findall(refused.stdout) and "Traceback" not in refused.stderr  # before step 1


def test_a_campaign_compares_a_file_it_damaged_through_its_replica(reference, tmp_path):
    # a campaign's `corrupt` failure damages the victim's newest file; when a newer last gasp made its repair
    # unneeded, the file is still damaged when the final state is compared with the fault-free run's
    from dsim.campaign.runner import final_state
    mine = tmp_path / "mine"
    shutil.copytree(reference[1], mine)
    files = mine / "run" / "checkpoints"
    ref = {"dir": str(reference[1])}
    flip_byte(files / "rank_0" / "network-3_10.h5")
    row = {"dir": str(mine), "damaged_files": [str(files / "rank_0" / "network-3_10.h5")]}
    state = final_state(row, ref)  # rank 0's damaged tensor compared on rank 4, its replica
    assert (state["equal"], state["checkpoint"], state["differ"]) == (True, "network-3_10", [])
    assert state["damaged"] == ["rank 0: params/layer1.param"]
    flip_byte(files / "rank_4" / "network-3_10.h5")  # and the replica: no other rank holds that slice
    row["damaged_files"].append(str(files / "rank_4" / "network-3_10.h5"))
    state = final_state(row, ref)
    assert state["equal"] is None and state["differ"] == []
    assert state["why"] == ("damaged by the campaign and held by no other rank: rank 0: params/layer1.param, "
                            "rank 4: params/layer1.param")
    row["damaged_files"].pop()  # a file the campaign did not damage that fails its checksum is a difference
    state = final_state(row, ref)
    assert state["equal"] is False and state["differ"] == ["rank 4: params/layer1.param fails its checksum"]
