"""The last-gasp checkpoint (TTP) end to end: kill -9 a rank under MPI fault tolerance, the survivors save,
the job resumes with 8 ranks and ends bit-identical to an uninterrupted run.

The job: 2 epochs of 10 steps, Adam, a periodic checkpoint every 7 steps, on dp2 x mp4 and on dp4 x mp2
with optimizer shard 2. Every mpirun here has a timeout (conftest.run_command kills the whole group).
"""
import re

import pytest

from conftest import ROOT, launch, mpirun
from dsim import inspect as dinspect
from dsim.checkpoint import load_checkpoint
from ftjob import LAYOUTS, LOSS, OPTS, error_lines, events, fault as _fault, final_state_equal

pytestmark = pytest.mark.e2e
BASE = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true"]
TTP = "run/checkpoints/ttp_checkpoints"


def fault(rank, at, step, *extra):
    return _fault("kill", rank, at, step, *extra)


def committed_ttp(job):
    return sorted(str(p.relative_to(job)) for p in (job / TTP).glob("*/*.commit")) if (job / TTP).exists() else []


# Every point of the step on both layouts, but the forward on dp4 x mp2 k2: that kill (rank 0, forward of step 13,
# saved 12, resumed bit for bit) is test_second_failure_with_a_replica_left_is_saved_by_the_rest's first fault.
@pytest.mark.parametrize("layout,rank,at,step,saved", [
    ("dp2xmp4", 3, "forward", 13, 12),
    ("dp2xmp4", 0, "allreduce", 13, 12),   # rank 0's replica (rank 4) is stuck in that all-reduce: step 13 never finished there
    ("dp2xmp4", 5, "update", 13, 13),      # every survivor finished step 13's update (or see below)
    ("dp2xmp4", 0, "save", 14, 14),        # rank 0 dies half-way through its file of the periodic checkpoint
    ("dp4xmp2k2", 6, "allreduce", 13, 12),
    ("dp4xmp2k2", 0, "update", 13, 13),
    ("dp4xmp2k2", 3, "save", 14, 14),
])
def test_kill_then_last_gasp_then_resume_is_bit_identical(ft_reference, tmp_path, layout, rank, at, step, saved):
    """A kill during the update: step 13 is saved, unless a replica of the killed rank was still in step 13's sum as
    it died (a loaded machine: ULFM fails the sum there). Then step 12 is, and the line says which survivors had not
    finished step 13. The same holds after a kill in the sum, where some survivors may have finished step 13."""
    ref_losses, ref_ckpt = ft_reference(layout)
    opts = [*BASE, *LAYOUTS[layout]]
    crash = mpirun(8, [*opts, *fault(rank, at, step)], cwd=tmp_path, timeout=120, ft=True)
    gasp, = events(tmp_path, "last_gasp_saved")
    if at == "update" and gasp["global_step"] == step - 1:
        assert gasp["unfinished"]["newest_step"] == step, gasp  # held back by the replica still in the sum
        saved = step - 1
    behind = ""  # the clause naming the survivors that had not finished step 13: there after the update's kill
    if saved < step and at in ("allreduce", "update"):  # (then held back), maybe after a kill in the sum
        behind = rf"(step {step} not saved: rank\(s\) [\d, ]+ had not finished it, the only survivors holding " \
            r"their slices; )" + ("" if at == "update" else "?")
    epoch, in_epoch = (saved - 1) // 10 + 1, (saved - 1) % 10 + 1
    where = f"{TTP}/tft_saved_checkpoints-step_{saved}"
    assert crash.returncode == 1, crash.stderr
    assert f"dsim: fault: killing rank {rank} (SIGKILL) during the {at} of step {step}" in crash.stdout
    errors = error_lines(crash)
    assert len(errors) == 1 and re.fullmatch(
        rf"dsim: error: rank\(s\) {rank} failed; last-gasp checkpoint ttp-{epoch}_{in_epoch} \(global step {saved}\) "
        rf"committed in {where} by 7 survivors, \d+ ms after the failure was noticed; {behind}"
        rf"resume \(--resume auto\) continues at step {saved + 1}", errors[0]), crash.stderr
    assert committed_ttp(tmp_path) == [f"{where}/ttp-{epoch}_{in_epoch}.commit"]
    for r in range(8):  # every rank's file, the dead one's too, written from a replica and verified
        p = load_checkpoint(tmp_path / where / f"rank_{r}" / f"ttp_rank_{r}-{epoch}_{in_epoch}.h5")
        assert p.meta["rank"] == r and int(p["global_step"]) == saved and int(p["step_num"]) == saved
    # the time from the kill to the commit is in the metrics: the victim's fault event, the survivors' save
    kill, = events(tmp_path, "fault")
    assert gasp["failed"] == [rank] and gasp["global_step"] == saved and 0 < gasp["time"] - kill["time"] < 60

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert (f"dsim: resumed from {where}/rank_0/ttp_rank_0-{epoch}_{in_epoch}.h5 "
            f"(global step {saved}: epoch {(saved // 10) + 1} step {saved % 10})") in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[saved:]  # steps saved+1..20: nothing skipped, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_kill_in_the_first_step_saves_the_state_before_it_as_epoch_1_step_0(ft_reference, tmp_path):
    """Nothing trained yet: the last gasp holds the starting state, named ttp-1_0 (it was ttp-0_20: epoch 0,
    step 20), and the resume trains every step bit for bit."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    crash = mpirun(8, [*BASE, *fault(3, "forward", 1)], cwd=tmp_path, timeout=120, ft=True)
    where = f"{TTP}/tft_saved_checkpoints-step_0"
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1 and errors[0].startswith(
        f"dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-1_0 (global step 0) committed in {where} "), crash.stderr
    assert committed_ttp(tmp_path) == [f"{where}/ttp-1_0.commit"]
    proc = mpirun(8, [*BASE, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert (f"dsim: resumed from {where}/rank_0/ttp_rank_0-1_0.h5 (global step 0: epoch 1 step 0)"
            in proc.stdout), proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_kill_in_the_step_after_a_last_gasp_says_it_is_already_committed(ft_reference, tmp_path):
    """Resumed from the last gasp of step 12, the job loses a rank in step 13 again: the newest step is still 12,
    whose checkpoint exists; it is kept as it is, and said so (it read "committed ... 0 ms after the failure")."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    where = f"{TTP}/tft_saved_checkpoints-step_12"
    mpirun(8, [*BASE, *fault(3, "forward", 13)], cwd=tmp_path, timeout=120, ft=True)
    committed = (tmp_path / where / "ttp-2_2.commit").read_bytes()
    again = mpirun(8, [*BASE, "--resume", "auto", *fault(6, "forward", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert again.returncode == 1 and error_lines(again) == [
        f"dsim: error: rank(s) 6 failed; last-gasp checkpoint ttp-2_2 (global step 12) was already committed in "
        f"{where}; resume (--resume auto) continues at step 13"], again.stderr
    assert (tmp_path / where / "ttp-2_2.commit").read_bytes() == committed
    proc = mpirun(8, [*BASE, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network_2-2_10")  # the third job's prefix


def test_both_replicas_killed_saves_nothing_and_resume_falls_back(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    # Both die after step 12, a point each surely reaches: killed in a forward instead, rank 7 could be stopped by
    # rank 3's death before reaching it, survive, and hold the slices after all
    crash = mpirun(8, [*BASE, *fault("[3,7]", "step_end", 12)], cwd=tmp_path, timeout=120, ft=True)
    errors = error_lines(crash)
    assert crash.returncode == 1 and errors == [
        "dsim: error: rank(s) 3, 7 failed; no last-gasp checkpoint: the slices of ranks [3, 7] have no surviving "
        "holder; resume (--resume auto) falls back to the last periodic checkpoint"], crash.stderr
    assert committed_ttp(tmp_path) == [] and not (tmp_path / TTP).exists()  # nothing written at all
    proc = mpirun(8, [*BASE, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5 (global step 7: epoch 1 step 7)" in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[7:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("kind,at,who", [("uce", "update", "had an uncorrectable memory error (UCE)"),
                                         ("kill", "allreduce", "failed")])
def test_with_the_last_gasp_off_a_failure_is_one_line_and_resume_uses_the_periodic_checkpoint(
        ft_reference, tmp_path, kind, at, who):
    """Fault tolerance without tft.ttp (a campaign's `periodic`): the job ends with one line from the lowest living
    rank. A UCE gave eight: the damaged rank's own, and the raw MPI error of each of the others (MPI_ERR_OTHER,
    MPI_ERR_REVOKED), since the survivors agreed on who had died and no one had."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS]
    crash = mpirun(8, [*opts, *_fault(kind, 0, at, 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1 and error_lines(crash) == [
        f"dsim: error: rank(s) 0 {who}; the last-gasp checkpoint is off (tft.ttp, or MS_ENABLE_TFT='{{TTP:1}}'); "
        "resume (--resume auto) from the last periodic checkpoint"], crash.stderr
    assert "MPI_ERR" not in crash.stderr and committed_ttp(tmp_path) == []
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5 (global step 7: epoch 1 step 7)" in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[7:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_second_failure_during_the_last_gasp_leaves_no_partial_checkpoint(ft_reference, tmp_path):
    """Rank 3 dies; its only replica, rank 7, dies half-way through writing the last gasp: nothing is committed."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    crash = mpirun(8, [*BASE, *fault(3, "forward", 13, "--set", "fault.last_gasp_kill=7")], cwd=tmp_path,
                   timeout=120, ft=True)
    assert "killing rank 7 (SIGKILL) during the last-gasp save of step 12" in crash.stdout, crash.stdout
    errors = error_lines(crash)
    assert crash.returncode == 1 and errors == [
        "dsim: error: rank(s) 3, 7 failed; no last-gasp checkpoint: the slices of ranks [3, 7] have no surviving "
        "holder; resume (--resume auto) falls back to the last periodic checkpoint"], crash.stderr
    assert (tmp_path / TTP / "tft_saved_checkpoints-step_12").is_dir()  # the interrupted attempt's files ...
    assert committed_ttp(tmp_path) == []                                 # ... were never committed
    proc = mpirun(8, [*BASE, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5" in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[7:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_second_failure_with_a_replica_left_is_saved_by_the_rest(ft_reference, tmp_path, capsys):
    """dp4 x mp2 k2: rank 0 dies, then rank 1 during the last gasp; the 6 left start again and commit."""
    ref_losses, ref_ckpt = ft_reference("dp4xmp2k2")
    opts = [*BASE, *LAYOUTS["dp4xmp2k2"]]
    crash = mpirun(8, [*opts, *fault(0, "forward", 13, "--set", "fault.last_gasp_kill=1")], cwd=tmp_path,
                   timeout=120, ft=True)
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 0, 1 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed in "
        f"{TTP}/tft_saved_checkpoints-step_12 by 6 survivors"), crash.stderr
    # written by 6 of 8 ranks, the optimizer state sharded: it verifies clean, and survivability reads its group info
    where = str(tmp_path / TTP / "tft_saved_checkpoints-step_12")
    assert dinspect.main([where, "--verify"]) == 0
    assert "verify ttp-2_2: ok (8 files, 27 tensors" in capsys.readouterr().out
    assert dinspect.main(["--survivability", where]) == 0
    assert "8 ranks, replica sets (group info) {0,4} {1,5} {2,6} {3,7}" in capsys.readouterr().out
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_launch_scripts_with_ms_enable_tft(ft_reference, tmp_path):
    """As the seed: MS_ENABLE_TFT='{TTP:1}', kill -9 rank 0 (the seed's controller, which dsim does not have)."""
    ref_losses, _ = ft_reference("dp2xmp4")
    opts = OPTS  # no tft.ttp: the environment variable turns it on
    config = str(ROOT / "configs" / "default.yaml")
    env = {"MS_ENABLE_TFT": "{TTP:1}"}
    crash = launch("run_parallel_save_ckpt.sh", [config, "ckpt", *opts, *fault(0, "forward", 13)], cwd=tmp_path,
                   timeout=120, env=env)
    assert crash.returncode != 0 and "last-gasp checkpoint ttp-2_2 (global step 12) committed" in crash.stderr
    assert (tmp_path / "ckpt/ttp_checkpoints/tft_saved_checkpoints-step_12/ttp-2_2.commit").is_file()
    proc = launch("run_parallel_recover_ckpt.sh", [config, "ckpt", *opts], cwd=tmp_path, check=0, env=env)
    assert "dsim: resumed from ckpt/ttp_checkpoints/tft_saved_checkpoints-step_12/rank_0/ttp_rank_0-2_2.h5" in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[12:]


def test_without_fault_tolerance_the_last_gasp_says_it_is_unavailable(tmp_path):
    proc = mpirun(8, [*BASE, "--set", "train.epochs=1"], cwd=tmp_path, check=0)  # plain mpirun: no ULFM
    assert ("dsim: warning: the last-gasp checkpoint (TTP) is unavailable: MPI fault tolerance is off in this job: "
            "launch with launch/run_parallel_save_ckpt.sh (mpirun --with-ft ulfm); periodic checkpoints and --resume "
            "still work") in proc.stderr, proc.stderr


LATE_BEGINNER = '''
import numpy as np
import dsim
from dsim import nn
from dsim.dataset import SyntheticMnist
from dsim.faults import FaultInjector

dsim.set_auto_parallel_context(model_parallel=1)
dsim.init()


class Late(dsim.Callback):
    """Rank 6 begins late: in a begin hook, it waits for a message rank 3 never sends (rank 3 goes on to step 1)."""

    def begin(self, run_context):
        cb = run_context.original_args()
        if cb.rank == 6:
            cb.model.groups.world.Recv(np.empty(1), source=3, tag=77)


class Network(nn.SequentialCell):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Flatten(), nn.Dense("layer1", 784, 32), nn.ReLU(), nn.Dense("layer2", 32, 10)]


net = Network()
optimizer = nn.OptTFTWrapper(nn.SGD(net.trainable_params(), 1e-2))
model = dsim.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
model.train(1, SyntheticMnist(640).batch(32), callbacks=[FaultInjector("kill", 3, 1, at="forward"), Late(),
                                                      dsim.TrainFaultTolerance("./ttp_checkpoints/")])
'''


def test_a_rank_still_beginning_when_another_dies_falls_back_with_the_others(tmp_path):
    """Rank 3 dies in step 1 while rank 6 is still in a begin hook's wait (in CI: the checkpoint's all-gather, under
    load). Rank 6 must join the others' failure handling: before, it fell back to the last gasp alone while the
    others began a repair in the job (tft.uce), their collectives no longer matched, and the job hung."""
    script = tmp_path / "late.py"
    script.write_text(LATE_BEGINNER)
    proc = mpirun(8, [str(script)], cwd=tmp_path, timeout=90, ft=True)
    (line,) = error_lines(proc)
    assert proc.returncode == 1 and line.startswith(
        "dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-1_0 (global step 0) committed in "
        "ttp_checkpoints/tft_saved_checkpoints-step_0 by 7 survivors"), proc.stderr
