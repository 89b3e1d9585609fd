"""A checkpoint written before the compact commit record (dsim-commit/1, group info as lists) still resumes.

tests/data/commit_v1/ is the checkpoint directory of a real run of the code before (commit e17223e), made with

    mpirun -n 4 python -m dsim.train --set model.hidden=[4,4] --set data.num_samples=64 --set data.batch_size=16 \\
        --set train.epochs=1 --set parallel.model_parallel=2 --set output.progress_bar=false --set output.dir=run

Its record lists every rank's file, size and digest; its files and group_info.json list each replica set.
Today's code verifies it, repairs a lost shard of it (the repaired file keeps the content the old record
pinned), resumes from it bit-identically to a resume from the undamaged copy, and writes compact records after it.
"""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, mpirun
from dsim import restore_group_info_list
from dsim.checkpoint.loader import load_checkpoint

pytestmark = pytest.mark.e2e
FIXTURE = ROOT / "tests" / "data" / "commit_v1"
RUN = ["-m", "dsim.train", "--set", "model.hidden=[4,4]", "--set", "data.num_samples=64", "--set", "data.batch_size=16",
       "--set", "parallel.model_parallel=2", "--set", "output.progress_bar=false", "--set", "output.dir=run",
       "--set", "train.epochs=2"]


def inspect(*args, cwd):
    return subprocess.run([sys.executable, "-m", "dsim.inspect", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_old_records_verify_repair_and_resume_bit_identically(tmp_path):
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "old"
    ref_dir.mkdir()
    ckpt = dir_ / "run" / "checkpoints"
    shutil.copytree(FIXTURE, ckpt)
    assert json.loads((ckpt / "network-1_4.commit").read_text())["format"] == "dsim-commit/1"
    assert restore_group_info_list(ckpt / "rank_1" / "group_info.json") == [1, 3]

    listed = inspect(ckpt, "--verify", cwd=dir_)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "verify network-1_4: ok (4 files" in listed.stdout and "not checked" not in listed.stdout
    assert "rank 1   rank_1/network-1_4.h5" in listed.stdout and "group info [1, 3]" in listed.stdout

    # the reference resumes from an untouched copy (the fixture's float32 bits are the old code's: an
    # uninterrupted run of today's code rounds its Dense gradients in another order)
    shutil.copytree(FIXTURE, ref_dir / "run" / "checkpoints")
    mpirun(4, [*RUN, "--resume", "auto"], cwd=ref_dir, check=0)
    (ckpt / "rank_1" / "network-1_4.h5").unlink()
    resumed = mpirun(4, [*RUN, "--resume", "auto", "--repair"], cwd=dir_, check=0)
    assert "dsim: recovery: rank 1: checkpoint file not found: run/checkpoints/rank_1/network-1_4.h5; using the " \
           "replica on rank 3 (group info [1, 3])" in resumed.stderr + resumed.stdout
    assert "resumed from run/checkpoints/rank_0/network-1_4.h5 (global step 4: epoch 2 step 0)" in resumed.stdout
    for rank in range(4):  # the repaired resume ends where the undamaged one does
        a = load_checkpoint(ref_dir / "run" / "checkpoints" / f"rank_{rank}" / "network_1-2_4.h5")
        b = load_checkpoint(ckpt / f"rank_{rank}" / "network_1-2_4.h5")
        assert len(a.slices) == 10 and set(a.slices) == set(b.slices)
        assert all(np.array_equal(a[n], b[n]) for n in a.slices), rank

    new = json.loads((ckpt / "network_1-2_4.commit").read_text())
    assert new["format"] == "dsim-commit/2" and new["files"]["template"] == "rank_{rank}/network_1-2_4.h5"
    after = inspect(ckpt, "--verify", cwd=dir_)  # the repaired old file still matches the old record's digest
    assert after.returncode == 0, after.stdout + after.stderr
    assert "verify network-1_4: ok (4 files" in after.stdout and "verify network_1-2_4: ok (4 files" in after.stdout

    # a compact record whose digest file is lost is not used: the previous checkpoint is, saying why
    (ckpt / "network_1-2_4.digests").unlink()
    again = mpirun(4, [*RUN, "--resume", "auto"], cwd=dir_, check=0)
    assert ("dsim: recovery: checkpoint network_1-2_4 is not usable: its digest file network_1-2_4.digests cannot be "
            "read (No such file or directory); falling back to the previous committed checkpoint network-1_4") \
        in again.stdout + again.stderr
    assert "resumed from run/checkpoints/rank_0/network-1_4.h5 (global step 4: epoch 2 step 0)" in again.stdout
    broken = inspect(ckpt, "--verify", cwd=dir_)
    assert broken.returncode == 1 and "network_1-2_4: its digest file network_1-2_4.digests cannot be read" \
        in broken.stdout
