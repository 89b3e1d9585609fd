"""Pipeline parallel end to end under mpirun -n 8: pp4 x dp2 (the MLP's 5 layers over 4 stages), 8 micro-batches.

Every recovery path across stages ends bit-identical to the uninterrupted run: the last gasp after a kill in a
middle stage, a UCE on a last-stage rank repaired in the job, a dead rank of stage 2 replaced in the job, a lost
shard of stage 0 taken from its replica at resume. Bad pipeline settings are one line and exit 2.
"""
import json
import re
import shutil

import h5py
import numpy as np
import pytest

from conftest import dsim_cli, mpirun
from dsim import inspect as dinspect
from ftjob import LAYOUTS, LOSS, OPTS, error_lines, events, fault, final_state_equal, redone_once

pytestmark = pytest.mark.e2e
PIPELINE = ["-m", "dsim.train", *OPTS, *LAYOUTS["pp4xdp2"]]


def test_pipeline_run_and_its_stages(ft_reference, tmp_path):
    """The header names the layout; inspect shows which ranks hold which layers; the loss equals the one of the
    same model without stages to within one unit of the last printed digit (the micro-batch sums differ in the
    last bits, which can carry the rounding of the sixth decimal either way: seen here at step 2)."""
    losses, ckpt = ft_reference("pp4xdp2")
    flat, _ = ft_reference("dp2xmp4")
    assert [(e, s) for e, s, _ in losses] == [(e, s) for e, s, _ in flat]
    assert all(abs(float(a) - float(b)) <= 1.5e-6 for (_, _, a), (_, _, b) in zip(losses, flat)), (losses, flat)
    listing = mpirun(1, ["-m", "dsim.inspect", str(ckpt)], cwd=tmp_path, check=0).stdout
    assert "pp=4 dp=2 mp=1 k=1" in listing
    for line in ("pipeline stage 0: ranks 0-1: layer1, layer2 (3 parameters)",
                 "pipeline stage 1: ranks 2-3: layer3 (2 parameters)",
                 "pipeline stage 3: ranks 6-7: layer5 (2 parameters)",
                 "rank_7/network-2_10.h5", "stage 3  group info [6, 7]"):
        assert line in listing, listing
    surv = mpirun(1, ["-m", "dsim.inspect", "--survivability", str(ckpt)], cwd=tmp_path, check=0).stdout
    assert "any two ranks except {0,1}, {2,3}, {4,5}, {6,7} (24 of 28 survive)" in surv, surv


def test_verify_of_a_pipeline_checkpoint(ft_reference, tmp_path, capsys):
    """--verify knows that a stage holds only its own layers: clean on a fault-free run, also from a commit record
    of the format before (no slices: the stages decide who holds what); a tensor missing from a rank of its
    stage is still found. The other tools read it too: resharded offline (the stages kept) it verifies clean, and
    merged, before and after, it is the same whole tensors."""
    _, ckpt = ft_reference("pp4xdp2")
    verify = mpirun(1, ["-m", "dsim.inspect", str(ckpt), "--verify"], cwd=tmp_path)
    assert verify.returncode == 0 and f"{ckpt}: clean" in verify.stdout, verify.stdout + verify.stderr
    assert "verify network-2_10: ok (8 files, 27 tensors" in verify.stdout, verify.stdout
    from dsim.checkpoint.catalog import scan
    from dsim.checkpoint.merge import merge
    from dsim.reshard import main as reshard
    assert reshard([str(ckpt / "network-2_10.commit"), "--layout", "dp=1", "-o", str(tmp_path / "dp1")]) == 0
    assert dinspect.main([str(tmp_path / "dp1"), "--verify"]) == 0  # dp2 -> dp1: 4 files, one a stage
    assert "verify network-2_10: ok (4 files, 27 tensors" in capsys.readouterr().out
    for source, out in [(ckpt, "pp4xdp2.h5"), (tmp_path / "dp1", "pp4xdp1.h5")]:
        merge(scan(source).committed[-1], tmp_path / out)  # virtual datasets over every stage's files
    with h5py.File(tmp_path / "pp4xdp2.h5", "r") as a, h5py.File(tmp_path / "pp4xdp1.h5", "r") as b:
        names = [f"{k}/{n}" for k in ("params", "optimizer") for n in a[k]]
        assert len(names) == 27 and all(np.array_equal(a[n][()], b[n][()]) for n in names)
        assert a["params/layer5.weight"].shape == (10, 64)
    copy = tmp_path / "checkpoints"
    shutil.copytree(ckpt, copy)
    for commit in copy.glob("*.commit"):
        record = json.loads(commit.read_text())
        del record["slices"]
        commit.write_text(json.dumps(record))
    verify = mpirun(1, ["-m", "dsim.inspect", str(copy), "--verify"], cwd=tmp_path)
    assert verify.returncode == 0 and f"{copy}: clean" in verify.stdout, verify.stdout + verify.stderr
    with h5py.File(copy / "rank_3" / "network-2_10.h5", "a") as f:
        del f["params/layer3.bias"]
    verify = mpirun(1, ["-m", "dsim.inspect", str(copy), "--verify"], cwd=tmp_path)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "params/layer3.bias: missing from the file(s) of rank(s) 3" in verify.stdout + verify.stderr, verify.stdout


def test_kill_in_a_middle_stage_last_gasp_then_resume(ft_reference, tmp_path, capsys):
    ref_losses, ref_ckpt = ft_reference("pp4xdp2")
    opts = [*PIPELINE, "--set", "tft.ttp=true"]
    crash = mpirun(8, [*opts, *fault("kill", 3, "forward", 12)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1 and "killing rank 3 (SIGKILL) during the forward of step 12" in crash.stdout
    errors = error_lines(crash)
    assert len(errors) == 1 and "last-gasp checkpoint ttp-2_1 (global step 11) committed" in errors[0], crash.stderr
    # the last gasp of a pipeline (rank 3's file written by its replica) verifies clean, as the periodic one
    assert dinspect.main([str(tmp_path / "run" / "checkpoints"), "--verify"]) == 0
    listing = capsys.readouterr().out
    assert "verify ttp-2_1: ok (8 files, 27 tensors" in listing and "verify network-1_7: ok (8 files" in listing, listing
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "(global step 11: epoch 2 step 1)" in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[11:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_whole_stage_replica_set_lost_names_the_stage(tmp_path):
    # Rank 4 dies after step 11, its replica 5 half-way through writing the last gasp in its place: both die for
    # sure (killed together after step 11 instead, 5 could be stopped by 4's death inside the step's last
    # collective, before its own fault point, survive, and hold the slices after all: seen in CI)
    crash = mpirun(8, [*PIPELINE, "--set", "tft.ttp=true", *fault("kill", 4, "step_end", 11),
                       "--set", "fault.last_gasp_kill=5"], cwd=tmp_path, timeout=120, ft=True)
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1, crash.stderr
    assert errors[0].startswith("dsim: error: rank(s) 4, 5 failed; no last-gasp checkpoint: the slices of ranks [4, 5] "
                                "(pipeline stage 2: layer4.weight, layer4.bias) have no surviving holder"), errors


def test_uce_on_a_last_stage_rank_is_repaired_in_the_job(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("pp4xdp2")
    proc = mpirun(8, [*PIPELINE, "--set", "tft.uce=true", *fault("uce", 7, "update", 12)], cwd=tmp_path, check=0,
                  ft=True)
    # rank 7 from its replica; a rank of another stage that does not hold the agreed step (caught mid-update, or
    # gone on past it: stages run apart) is repaired alongside, from its own replica (seen in CI: rank 5 from 4)
    line = re.search(r"dsim: uce: rank\(s\) 7 had an uncorrectable memory error \(UCE\); repaired in the job: (.*); "
                     r"training goes on after step 1[12] ", proc.stdout)
    assert line, proc.stdout
    repairs = re.findall(r"rank (\d) from rank (\d) \(group info \[(\d), (\d)\]\)", line[1])
    assert ("7", "6", "6", "7") in repairs and ", ".join(f"rank {r} from rank {w} (group info [{a}, {b}])"
                                                       for r, w, a, b in repairs) == line[1], line[1]
    assert all(int(r) // 2 == int(w) // 2 and [a, b] == sorted([r, w]) for r, w, a, b in repairs), line[1]
    # rank 6 may be stopped in the world's share of the loss, before its update: then step 11 is agreed and
    # step 12 redone, after rank 0 (stage 0) had finished and printed it (seen in CI-like runs); else step 12
    assert redone_once(LOSS.findall(proc.stdout)) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")


def test_uces_in_forward_passes_of_two_stages_are_repaired_in_place(ft_reference, tmp_path):
    """Rank 2 (stage 1) at step 5 and rank 7 (stage 3) at step 12, each in its first micro-batch's forward: each
    takes the buffers hit from its stage's replica in the other data-parallel copy of the pipeline, which goes on
    until its next layer or the gradient all-reduce and answers there; nobody else stops, nothing is redone."""
    ref_losses, ref_ckpt = ft_reference("pp4xdp2")
    proc = mpirun(8, [*PIPELINE, "--set", "tft.uce=true", *fault("uce", "[2,7]", "forward", "[5,12]")], cwd=tmp_path,
                  check=0, ft=True)
    for rank, donor, step in [(2, 3, 5), (7, 6, 12)]:
        assert (f"dsim: uce: rank(s) {rank} had an uncorrectable memory error (UCE); repaired in place: rank {rank} "
                f"from rank {donor} (group info {sorted([rank, donor])}) while the other ranks "
                f"went on; the forward of step {step} goes on") in proc.stdout, proc.stdout
    assert "repaired in the job" not in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses  # each step once
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")
    assert [(e["damaged"], e["global_step"], e["donors"], e["in_place"]) for e in events(tmp_path, "uce_repair")] == [
        ([2], 4, {"2": 3}, True), ([7], 11, {"7": 6}, True)]


def test_a_dead_rank_of_stage_2_is_replaced_in_the_job(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("pp4xdp2")
    proc = mpirun(8, [*PIPELINE, "--set", "tft.arf=true", *fault("kill", 5, "forward", 12)], cwd=tmp_path, check=0,
                  ft=True)
    assert "rank 5 from rank 4 (group info [4, 5]); world size back to 8" in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")


def test_a_lost_shard_of_stage_0_is_taken_from_its_replica(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("pp4xdp2")
    crash = mpirun(8, [*PIPELINE, *fault("exception", 0, "step_end", 15)], cwd=tmp_path)
    assert crash.returncode != 0 and "Some errors happen." in crash.stderr
    (tmp_path / "run" / "checkpoints" / "rank_0" / "network-2_4.h5").unlink()
    proc = mpirun(8, [*PIPELINE, "--resume", "auto"], cwd=tmp_path, check=0)
    assert ("rank 0: checkpoint file not found: run/checkpoints/rank_0/network-2_4.h5; using the replica on "
            "rank 1 (group info [0, 1])") in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[14:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


# (options, the line, ranks): 8 = under mpirun -n 8; None = the same command in one process, for the config
# errors every rank refuses alike before MPI is used (m-below-p keeps that family under mpirun)
BAD = [
    (["--set", "parallel.pipeline_stage=3", "--set", "parallel.model_parallel=1", "--set", "parallel.micro_batch_num=3"],
     "dsim: error: layout: pipeline_stage=3 x model_parallel=1 = 3 does not divide the world size 8", 8),
    (["--set", "parallel.pipeline_stage=8", "--set", "parallel.model_parallel=1", "--set", "parallel.micro_batch_num=8"],
     "dsim: error: parallel.pipeline_stage=8 exceeds the 5 layers of 784-64-128-128-64-10: every stage "
     "needs one", 8),
    (["--set", "parallel.pipeline_stage=2", "--set", "parallel.micro_batch_num=1"],
     "dsim: error: config: parallel.micro_batch_num must be >= parallel.pipeline_stage=2 (MindSpore requires "
     "micro_batch_num >= pipeline stages), got 1", 8),
    (["--set", "parallel.pipeline_stage=2", "--set", "parallel.micro_batch_num=3"],
     "dsim: error: layout: micro_batch_num=3 does not divide the batch of 32 per data-parallel rank "
     "(data.batch_size=32 / data_parallel=1)", 8),
    (["--set", "parallel.pipeline_stage=2", "--set", "parallel.micro_batch_num=2", "--set", "parallel.pipeline_schedule=zb"],
     "dsim: error: config: parallel.pipeline_schedule must be one of 1f1b, gpipe, got 'zb'", None),
    # one file of whole tensors written by rank 0, which holds stage 0 only: refused, not saved short of 3 stages
    (["--set", "parallel.pipeline_stage=4", "--set", "parallel.model_parallel=1", "--set", "parallel.micro_batch_num=8",
      "--set", "checkpoint.integrated_save=true"],
     "dsim: error: config: checkpoint.integrated_save with parallel.pipeline_stage=4: the one file of whole tensors is "
     "written by rank 0, which holds only the first stage's layers; save sharded (integrated_save: false) and merge "
     "the shards with python -m dsim.inspect --merge", None),
]


@pytest.mark.parametrize("options,line,ranks", BAD, ids=["p-not-dividing", "p-over-layers", "m-below-p",
                                                         "m-not-dividing", "schedule", "integrated"])
def test_bad_pipeline_settings_one_line_exit_2(tmp_path, options, line, ranks):
    proc = dsim_cli(ranks, ["-m", "dsim.train", *OPTS, *options], cwd=tmp_path, timeout=180)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dsim: error:")]
    assert proc.returncode == 2 and errors == [line], proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").rglob("*.h5"))
