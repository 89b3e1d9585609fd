"""Peer copies in memory end to end on real hosts (dsim.cluster, issue 52 part 4): a layout with no replica
(data_parallel = 1, model_parallel 8 over 2 hosts x 4) loses node2's ranks (a fault plan's `node` failure: its ranks
die, its Open MPI daemon lives). With `tft.peer_copy_every: 2` the survivors on node1 commit the last gasp of the last
complete copy's step from node2's ranks' copies in their memory (at most 2 steps lost), its record naming those ranks,
and the resume from it ends bit-identical to an uninterrupted run; without the copies the same fault commits nothing.

Needs root and iproute2 (CI runs as root): skipped, with the reason, where namespaces cannot be made.
"""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
from conftest import ROOT, cluster_of, made_once, run_command
from runs import steps, tensors

pytestmark = pytest.mark.e2e

DEFAULT = str(ROOT / "configs" / "default.yaml")
# model parallel 8, no replica, at small widths: 2 epochs of 6 steps, a periodic checkpoint at each epoch's end only
ARGS = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640", "--set", "train.steps_per_epoch=6",
        "--set", "train.epochs=2", "--set", "parallel.data_parallel=1", "--set", "parallel.model_parallel=8",
        "--set", "output.progress_bar=false", "--set", "tft.ttp=true"]
COPIES = ["--set", "tft.peer_copy_every=2"]
# rank 5 (node2) at the forward of step 6: node2's ranks 4-7 die; step 4's copies were complete at step 5's end
NODE = {"faults": [{"rank": 5, "kind": "node", "node_size": 4, "at": "forward", "step": 6}]}
TTP = "ckpt/ttp_checkpoints"


@pytest.fixture(scope="module")
def cluster():
    """2 hosts x 4 slots, shared by this module's tests, torn down after them and checked to have left nothing."""
    yield from cluster_of(2, 4, "p")


def on_cluster(cluster, tmp_path, script, args, check, plan=None):
    """A launch script (through the launcher, with MPI fault tolerance) on node1 over both hosts; checkpoints in
    tmp_path/ckpt (one directory every host sees)."""
    env = {**cluster.env(), "VIRTUAL_ENV": sys.prefix}
    if plan is not None:
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        env["DSIM_FAULT_PLAN"] = str(tmp_path / "plan.json")
        args = [*args, "--set", "fault.kind=plan"]
    cmd = ["bash", str(ROOT / "launch" / script), DEFAULT, str(tmp_path / "ckpt"), *ARGS, *args]
    return run_command(cluster.command(1, cmd, tmp_path), tmp_path, 150, check, env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run on 1 host x 8 ranks, uninterrupted: (its directory, its losses)."""
    d, _ = made_once(tmp_path_factory, "peer-copies-ref", 8, ["-m", "dsim.train", "--config", DEFAULT, *ARGS,
                                                               "--set", "output.dir=run"], check=0)
    return d, steps(d / "run")


def test_a_lost_host_without_replicas_is_saved_from_the_peer_copies_and_resumes_bit_identical(
        cluster, uninterrupted, tmp_path):
    ref, ref_losses = uninterrupted
    crash = on_cluster(cluster, tmp_path, "run_parallel_save_ckpt.sh", [*COPIES, "--set", "output.dir=first"], 1,
                       plan=NODE)
    out = crash.stdout + crash.stderr
    assert re.search(r"^peer copies every 2 steps, each rank's state in the memory of a rank on another host \(rank "
                     r"0's, [\d.]+ MiB, in rank 4's on node2\): 2 snapshots of its own \+ 2 copies of another's \(the "
                     r"last complete, the next in flight\): [\d.]+ MiB on rank 0, at most [\d.]+ MiB per rank$",
                     crash.stdout, re.M), out
    assert "dsim: fault: node failure: ranks 4-7 (host node2) die together during the forward of step 6" in out
    where = f"{TTP}/tft_saved_checkpoints-step_4"
    errors = [line for line in crash.stderr.splitlines() if line.startswith("dsim: error:")]
    assert len(errors) == 1 and re.fullmatch(
        rf"dsim: error: rank\(s\) 4, 5, 6, 7 failed; last-gasp checkpoint ttp-1_4 \(global step 4\) committed in "
        rf"{tmp_path}/{where} by 4 survivors, \d+ ms after the failure was noticed; the state of rank\(s\) 4, 5, 6, 7 "
        rf"from peer copies in the memory of rank\(s\) 0, 1, 2, 3, 1 step\(s\) lost \(the survivors had step 5\); "
        rf"resume \(--resume auto\) continues at step 5", errors[0]), out
    record = json.loads((tmp_path / where / "ttp-1_4.commit").read_text())
    assert record["global_step"] == 4 and record["last_gasp"]["failed"] == [4, 5, 6, 7]
    assert record["last_gasp"]["peer_copies"] == {"ranks": {"4": 0, "5": 1, "6": 2, "7": 3}, "newest_step": 5,
                                                  "steps_lost": 1}
    assert record["last_gasp"]["writers"] == {"4": 0, "5": 1, "6": 2, "7": 3}
    assert not list((tmp_path / "ckpt").glob("network*.commit"))  # no periodic checkpoint before the fault

    resume = on_cluster(cluster, tmp_path, "run_parallel_recover_ckpt.sh", [*COPIES, "--set", "output.dir=second"], 0)
    assert f"dsim: resumed from {tmp_path}/{where}/rank_0/ttp_rank_0-1_4.h5" in resume.stdout, resume.stdout
    first = [s for s in steps(tmp_path / "first") if s[0] <= 4]
    assert first + steps(tmp_path / "second") == ref_losses
    for r in range(8):  # every rank's final file equals the uninterrupted run's, bit for bit
        want = tensors(ref / "run" / "checkpoints" / f"rank_{r}" / "network-2_6.h5")
        saved, = (tmp_path / "ckpt" / f"rank_{r}").glob("*-2_6.h5")  # (network_1-: the first job took network-)
        got = tensors(saved)
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want), r


def test_without_peer_copies_the_same_fault_commits_nothing(cluster, tmp_path):
    crash = on_cluster(cluster, tmp_path, "run_parallel_save_ckpt.sh", ["--set", "output.dir=first"], 1, plan=NODE)
    errors = [line for line in crash.stderr.splitlines() if line.startswith("dsim: error:")]
    assert errors == ["dsim: error: rank(s) 4, 5, 6, 7 failed; no last-gasp checkpoint: the slices of ranks [4]; the "
                      "slices of ranks [5]; the slices of ranks [6]; the slices of ranks [7] have no surviving holder; "
                      "resume (--resume auto) falls back to the last periodic checkpoint"], crash.stdout + crash.stderr
    assert not list((tmp_path / "ckpt").glob("**/*.commit"))  # the 5 steps trained are lost
    assert [s for s, _ in steps(tmp_path / "first")] == [1, 2, 3, 4, 5]
