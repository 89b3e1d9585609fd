"""End to end on real hosts (dsim.cluster, issue 52 part 3): a lost disk under a layout without replicas.

model_parallel 8 (data_parallel 1) on 2 hosts x 4, node-local checkpoints: every slice of a split layer is held by one
rank alone, so ranks 4-7's slices exist only on node2's disk. (With replicas on the other host the lost shards are
rebuilt from them and the resume is bit-identical: tests/e2e/test_e2e_cluster.py, the replaced-disk test.)

- node2's disk replaced after two committed checkpoints: the recover script exits 2 with one error line naming the lost
  slices' ranks and host, that no committed checkpoint is complete, and that nothing was written; lines after it give
  each checkpoint's verdict and the tensors and slice indices lost; every host's checkpoint directory is the same
  before and after (names, sizes, mtimes), and nothing trained.
- only node2's files of the newest step gone: `--resume NAME` of that step refuses, naming the older complete step and
  how to resume from it; `--resume auto` resumes from it with one line saying the newer step's slices are lost and how
  many steps are trained again, and goes on bit-identical to an uninterrupted run (losses and final tensors).

Needs root and iproute2 (CI runs as root): skipped, with the reason, where namespaces cannot be made.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import ROOT, cluster_of, made_once, run_command
from runs import steps, tensors

from dsim.cluster import DISK_PATH

pytestmark = pytest.mark.e2e

DEFAULT = str(ROOT / "configs" / "default.yaml")
# model parallel 8, no replica, at small widths: epochs of 4 steps, a checkpoint at each epoch's end, all kept
ARGS = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640", "--set", "train.steps_per_epoch=4",
        "--set", "output.progress_bar=false", "--set", "parallel.model_parallel=8", "--set",
        "parallel.data_parallel=null", "--set", "checkpoint.keep_checkpoint_max=5"]
SPLIT = "layer1.param, layer2.weight, layer3.weight, layer3.bias, layer4.weight"   # the tensors split over mp


@pytest.fixture(scope="module")
def cluster():
    """2 hosts x 4 slots for this module's tests, torn down after them whatever happened, checked to leave nothing."""
    yield from cluster_of(2, 4, "ld")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run on 1 host x 8 ranks, 3 epochs uninterrupted: (its directory, its losses)."""
    d, _ = made_once(tmp_path_factory, "lost-disk-ref", 8, ["-m", "dsim.train", "--config", DEFAULT, *ARGS, "--set",
                                                            "train.epochs=3", "--set", "output.dir=run"], check=0)
    return d, steps(d / "run")


def script(cluster, cwd, name, ckpt, *args, check=None):
    """A launch script on node1 over the cluster's hostfile, checkpoints on each host's own disk at ckpt."""
    cmd = ["bash", str(ROOT / "launch" / name), DEFAULT, f"{DISK_PATH}/{ckpt}", *ARGS, *args]
    return run_command(cluster.command(1, cmd, cwd), cwd, 150, check, {**cluster.env(), "VIRTUAL_ENV": sys.prefix})


def listing(cluster, ckpt) -> dict:
    """Every host's checkpoint directory: each file's (size, mtime in ns) and each directory, by host and path.
    The lease (`.dsim-lease`, the job's lock on the directory, taken before anything is read) is listed by name only:
    every job that starts rewrites who holds it."""
    out = {}
    for h in (1, 2):
        d = cluster.disk(h) / ckpt
        for p in sorted(d.rglob("*")) if d.exists() else []:
            st = p.stat()
            key = (h, str(p.relative_to(d)))
            out[key] = "dir" if p.is_dir() else "lease" if p.name == ".dsim-lease" else (st.st_size, st.st_mtime_ns)
    return out


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]


def test_a_lost_disk_without_replicas_names_the_lost_slices_and_writes_nothing(cluster, tmp_path):
    first = script(cluster, tmp_path, "run_parallel_save_ckpt.sh", "ckpt-a", "--set", "train.epochs=2", "--set",
                   "output.dir=first", check=0)
    assert "data_parallel=1: no rank has a replica" in first.stderr, first.stderr
    assert sorted(p.name for p in (cluster.disk(1) / "ckpt-a").glob("*.commit")) == [
        "network-1_4.commit", "network-2_4.commit"]
    assert len(list((cluster.disk(2) / "ckpt-a").glob("rank_*/*.h5"))) == 8   # ranks 4-7's, both steps
    cluster.replace_disk(2)
    before = listing(cluster, "ckpt-a")
    assert before and not [k for k in before if k[0] == 2]

    proc = script(cluster, tmp_path, "run_parallel_recover_ckpt.sh", "ckpt-a", "--set", "train.epochs=3", "--set",
                  "output.dir=second")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error, = errors(proc)
    gone = (f"checkpoint file not found: {DISK_PATH}/ckpt-a/rank_{{rank}}/network-STEP.h5 for ranks 4-7, and no "
            "other rank holds their slices (group info [4], [5], [6], [7])")
    assert error == (f"dsim: error: no usable committed checkpoint in {DISK_PATH}/ckpt-a (tried network-2_4: "
                     f"{gone.replace('STEP', '2_4')}; network-1_4: {gone.replace('STEP', '1_4')}): slices with no copy "
                     "left; no committed "
                     "checkpoint is complete: none to resume from; nothing was written"), error
    lines = proc.stderr.splitlines()
    at = lines.index(error)
    assert lines[at + 1:at + 5] == [
        "  network-2_4 (global step 8): incomplete: 40 slice(s) of 10 tensor(s) have no copy left: every one was held "
        "only by ranks 4-7 on node2",
        "    held only by ranks 4-7 on node2 (40 slice(s), one rank a slice; slices numbered from 0): "
        f"{SPLIT}: slices 4-7 of 8; and the same slices of their optimizer state (moments)",
        "  network-1_4 (global step 4): incomplete: 40 slice(s) of 10 tensor(s) have no copy left: every one was held "
        "only by ranks 4-7 on node2 (the same slices as above)",
        "  complete committed checkpoint to resume from: none (bring the lost files back and resume, or train anew in "
        "another checkpoint.directory)"], "\n".join(lines[at:])
    # nothing written: no checkpoint, no repaired or renamed file, no record, on either host; nothing trained
    assert listing(cluster, "ckpt-a") == before
    assert steps(tmp_path / "second") == [] and "checkpoint saved" not in proc.stdout


def test_a_lost_newest_step_resumes_from_the_older_complete_one_bit_identical(cluster, uninterrupted, tmp_path):
    ref, ref_losses = uninterrupted
    script(cluster, tmp_path, "run_parallel_save_ckpt.sh", "ckpt-b", "--set", "train.epochs=2", "--set",
           "output.dir=first", check=0)
    for p in (cluster.disk(2) / "ckpt-b").glob("rank_*/network-2_4.h5"):   # node2's files of the newest step only
        p.unlink()
    before = listing(cluster, "ckpt-b")

    named = script(cluster, tmp_path, "run_parallel_recover_ckpt.sh", "ckpt-b", "--resume", "network-2_4", "--set",
                   "train.epochs=3", "--set", "output.dir=named")
    assert named.returncode == 2, named.stdout + named.stderr
    error, = errors(named)
    assert error.endswith("): slices with no copy left; the older committed checkpoint network-1_4 (global step 4) is "
                          "complete: resume from it with --resume network-1_4; nothing was written"), error
    assert listing(cluster, "ckpt-b") == before and steps(tmp_path / "named") == []

    proc = script(cluster, tmp_path, "run_parallel_recover_ckpt.sh", "ckpt-b", "--set", "train.epochs=3", "--set",
                  "output.dir=second", check=0)
    out = proc.stdout + proc.stderr
    assert ("dsim: recovery: resuming from network-1_4 (global step 4), not from the newest committed checkpoint "
            "network-2_4 (global step 8), which has slices with no copy left (above): the 4 step(s) after global step "
            "4 are trained again; nothing of network-2_4 is deleted") in out, out
    assert "resumed from /var/tmp/dsim-node/ckpt-b/rank_0/network-1_4.h5 (global step 4: epoch 2 step 0)" in out, out
    assert steps(tmp_path / "first")[:4] + steps(tmp_path / "second") == ref_losses
    after = listing(cluster, "ckpt-b")
    kept = [k for k in before if k[1].endswith((".h5", ".commit", ".digests"))]   # (training rewrote the group info)
    assert [after[k] for k in kept] == [before[k] for k in kept]   # the newer step's files on node1 as they were
    for r in range(8):   # the final state, each rank's file on its own host's disk, under the resumed run's new prefix
        saved = cluster.disk(1 if r < 4 else 2) / "ckpt-b" / f"rank_{r}" / "network_1-3_4.h5"
        want, got = tensors(ref / "run" / "checkpoints" / f"rank_{r}" / "network-3_4.h5"), tensors(saved)
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want), r
