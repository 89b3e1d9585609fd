"""A frozen rank end to end (`fault.kind: hang`: the rank SIGSTOPs itself), and a stuck one (`fault.kind: stuck`:
its training stops, its process runs): without `tft.hang_timeout` MPI would wait for either forever; with it the
hang watch kills it, and what follows is what follows a death: the last gasp and a resume bit-identical to an
uninterrupted run, or the repair in the job by a warm spare.
Every mpirun has a timeout (conftest.run_command kills the whole group, a stopped process too)."""
import json
import re
import time

import pytest

from conftest import ROOT, launch, mpirun
from dsim.ft.hang import HEARTBEAT
from ftjob import LAYOUTS, LOSS, OPTS, error_lines, events, fault, final_state_equal, redone_once

pytestmark = pytest.mark.e2e
TIMEOUT = 3
WATCH = ["--set", f"tft.hang_timeout={TIMEOUT}"]


def killed_after_its_stall(stuck: dict, hang: dict) -> None:
    """Killed once its own measure of its stall, beaten every heartbeat, is past the timeout. The stall runs from
    the rank's last progress mark, a moment before its fault line was written: measured from that line the kill
    may come a little under the timeout (2.99 s for 3 in one CI run), never well under it nor long after."""
    assert hang["frozen_for"] > TIMEOUT, (stuck, hang)
    assert TIMEOUT - 0.5 < hang["time"] - stuck["time"] < TIMEOUT + 10, (stuck, hang)
# the deadlock tests: past 6 s of waiting by all; after the break 7 or 8 ranks write their last gasp at once, whose
# fsyncs two loaded CI workers stretched past 3 s once (rank 0 judged stuck in its last-gasp save, as it would be)
BREAK = ["--set", "tft.hang_timeout=5", "--set", "tft.deadlock_timeout=6"]


def frozen_then_killed(job, rank, step):
    """The fault event of the frozen rank and the watch's hang event: the one after the timeout."""
    froze, = events(job, "fault")
    hang, = events(job, "hang")
    assert (froze["kind"], froze["rank"], froze["global_step"]) == ("hang", rank, step)
    # the step of the watch that killed it: frozen inside an update, the others may have finished that step
    assert (hang["rank"], hang["how"], hang["timeout"]) == (rank, "frozen", TIMEOUT) and hang["global_step"] in (step, step + 1)
    # killed once its last heartbeat (up to HEARTBEAT before it froze) is older than the timeout
    assert hang["frozen_for"] >= TIMEOUT and TIMEOUT - HEARTBEAT <= hang["time"] - froze["time"] < TIMEOUT + 10, \
        (froze, hang)
    return hang


def test_a_frozen_rank_is_killed_then_the_last_gasp_and_the_resume_are_bit_identical(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", *WATCH]
    crash = mpirun(8, [*opts, *fault("hang", 3, "forward", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1, crash.stderr
    assert "dsim: fault: rank 3 stops (SIGSTOP) during the forward of step 13" in crash.stdout
    assert re.search(r"dsim: hang watch: rank 3 \(pid \d+\) has not run for \d+\.\d s \(step 13, timeout 3 s\): "
                     r"killed \(SIGKILL\), as a failed rank", crash.stdout), crash.stdout
    assert "no rank's process is frozen or stuck" not in crash.stdout  # the other watches saw it killed
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed"), crash.stderr
    frozen_then_killed(tmp_path, 3, 13)
    gasp, = events(tmp_path, "last_gasp_saved")
    assert gasp["failed"] == [3] and gasp["global_step"] == 12

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]  # steps 13..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_deadlock_is_broken_the_rank_waiting_elsewhere_killed_and_the_last_gasp_saved(ft_reference, tmp_path):
    """Rank 3 waits for a message no rank sends (fault.kind deadlock), in step 13's forward pass: the others wait for
    it in their next collective; nobody is frozen or stuck, nobody computes. Past tft.deadlock_timeout the first
    watch to see it says so, every process prints its stacks, and the watches revoke their ranks' communicators:
    every rank waiting on them comes out as after a death. Rank 3, still in its receive, is killed; the others
    save the last gasp of step 12, and the resume from it is bit-identical. (Before, the whole job was ended and
    resumed from the periodic checkpoint of step 7; and before that, it waited for ever.)"""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", *BREAK]
    t = time.monotonic()
    crash = mpirun(8, [*opts, *fault("deadlock", 3, "forward", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1 and time.monotonic() - t < 60, crash.stderr
    assert "dsim: fault: rank 3 waits for a message no rank sends during the forward of step 13" in crash.stdout
    assert re.search(r"dsim: hang watch: every process of the job has waited \d+ s or more in a collective or a "
                     r"receive, none frozen, none computing: a deadlock \(step 13, tft.deadlock_timeout 6 s\); each "
                     r"prints its stacks \(SIGUSR1\), then the job's communicators are revoked: every rank goes on "
                     r"as after a failure", crash.stdout), crash.stdout
    assert re.search(r"dsim: hang watch: rank 3 \(pid \d+\) still waits after the revoke \(not on the job's "
                     r"communicators\): killed \(SIGKILL\), as a failed rank", crash.stdout), \
        crash.stdout + crash.stderr + (tmp_path / "run" / "metrics.jsonl").read_text()  # (a rare flake: all of it)
    assert crash.stdout.count("a deadlock (step") == 1 and crash.stdout.count("still waits after") == 1
    assert crash.stdout.count("has gone on for") <= 1  # "waiting" (at 2 x 3 s), if said before: by one watch
    assert crash.stderr.count("in wait_for_nothing") == 1, crash.stderr  # the stacks: rank 3's shows where it waits
    assert crash.stderr.count("Current thread") + crash.stderr.count("Thread 0x") >= 8 * 2  # main + watch, each rank
    deadlock, = events(tmp_path, "deadlock")
    assert deadlock["ranks"] == list(range(8)) and deadlock["waited"] >= 6 and deadlock["global_step"] == 13
    assert deadlock["broken"]
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"]) == (3, "deadlocked") and hang["time"] > deadlock["time"]
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed"), crash.stderr
    gasp, = events(tmp_path, "last_gasp_saved")
    assert gasp["failed"] == [3] and gasp["global_step"] == 12

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]  # from the last gasp of step 12: steps 13..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_without_mpi_fault_tolerance_a_deadlock_ends_the_job_with_every_ranks_stacks(tmp_path):
    """Launched without ULFM (plain mpirun) nothing can be revoked: the first watch to see the deadlock ends the job,
    as NCCL's watchdog does, every process's stacks printed first; a restart resumes from the last checkpoint."""
    opts = ["-m", "dsim.train", *OPTS, *BREAK]
    crash = mpirun(8, [*opts, *fault("deadlock", 3, "forward", 13)], cwd=tmp_path, timeout=120)
    assert crash.returncode != 0, crash.stderr
    assert re.search(r"a deadlock \(step 13, tft.deadlock_timeout 6 s\); each prints its stacks \(SIGUSR1\), then the "
                     r"job is ended \(exit status 1\): resume from the last checkpoint", crash.stdout), crash.stdout
    assert "(all waiting for 6 s: a deadlock, the job is ended)" in crash.stdout or "has gone on" not in crash.stdout
    assert crash.stderr.count("in wait_for_nothing") == 1, crash.stderr
    deadlock, = events(tmp_path, "deadlock")
    assert deadlock["ranks"] == list(range(8)) and not deadlock["broken"]


def test_a_deadlock_is_broken_and_healed_in_the_job_while_ranks_poll_their_collectives(ft_reference, tmp_path):
    """With tft.uce (in-place repair) and tft.arf the ranks poll the step's first data-parallel collective, checking
    for a damaged replica's request at each poll: still a wait (found first in a campaign, where arf's jobs were
    never judged deadlocked: each poll counted as progress). Rank 3 waits for nothing at step 13's all-reduce, its
    data-parallel peer (rank 7) waits for it there, on a communicator no other rank is in: its own watch revokes
    it. Rank 3 is killed, a spawned process takes its place, and the job ends as the uninterrupted run did."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, *BREAK, "--set", "tft.arf=true",
            "--set", "tft.uce=true"]
    proc = mpirun(8, [*opts, *fault("deadlock", 3, "allreduce", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert proc.returncode == 0, proc.stderr
    assert "a deadlock (step 1" in proc.stdout and "the job's communicators are revoked" in proc.stdout, proc.stdout
    assert re.search(r"rank 3 \(pid \d+\) still waits after the revoke", proc.stdout), proc.stdout
    deadlock, = events(tmp_path, "deadlock")
    assert deadlock["ranks"] == list(range(8)) and deadlock["broken"]
    hang, = events(tmp_path, "hang")
    heal, = events(tmp_path, "heal")
    assert (hang["rank"], hang["how"]) == (3, "deadlocked") and heal["failed"] == [3] and heal["global_step"] == 12
    assert redone_once(LOSS.findall(proc.stdout)) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")


def test_an_unmatched_receive_on_the_world_is_broken_with_every_rank_alive_and_the_resume_is_bit_identical(
        ft_reference, tmp_path):
    """Rank 3 waits, on the job's world, for a message no rank sends (fault.kind unmatched: a receive with no
    matching send, as collectives that do not match leave a rank), half-way through step 13's update; the others,
    past step 13, wait for it in step 14. The revoke frees every rank, rank 3 too: nobody is killed, and all eight
    save the last gasp of step 13 though no rank failed; rank 3's file is written by its replica, rank 7 (its own
    state is torn by the update it left). The resume from it is bit-identical."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", *BREAK]
    crash = mpirun(8, [*opts, *fault("unmatched", 3, "update", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1, crash.stderr
    assert ("dsim: fault: rank 3 waits for a message no rank sends, on the job's world, during the update of step 13"
            in crash.stdout)
    assert re.search(r"a deadlock \(step 1[34], tft.deadlock_timeout 6 s\)", crash.stdout), crash.stdout
    assert "still waits" not in crash.stdout
    deadlock, = events(tmp_path, "deadlock")
    assert deadlock["broken"] and deadlock["ranks"] == list(range(8)) and not events(tmp_path, "hang")
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        "dsim: error: a deadlock was broken, every rank alive; last-gasp checkpoint ttp-2_3 (global step 13) "
        "committed"), crash.stderr
    gasp, = events(tmp_path, "last_gasp_saved")
    assert gasp["failed"] == [] and gasp["global_step"] == 13
    record = json.loads(next(tmp_path.rglob("tft_saved_checkpoints-step_13/ttp-2_3.commit")).read_text())
    assert record["last_gasp"]["writers"] == {"3": 7}  # (the others each wrote its own)

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[13:]  # from the last gasp of step 13: steps 14..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_an_unmatched_receive_is_repaired_in_the_job_and_the_same_job_deadlocking_again_is_ended(ft_reference,
                                                                                                   tmp_path):
    """Under tft.arf, a break that leaves every rank alive is repaired in the job: rank 3, torn half-way through
    step 13's update, takes step 13 from rank 7, and training goes on, bit-identical. Rank 5 then deadlocks the
    same way in step 17: a job that deadlocks again after going on so is ended (a deterministic deadlock would
    be broken and repaired for ever), and resumes from its periodic checkpoint of step 14, bit-identical."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.arf=true", *BREAK]
    twice = ["--set", "fault.kind=unmatched", "--set", "fault.rank=[3,5]", "--set", "fault.step=[13,17]",
             "--set", "fault.at=update"]
    crash = mpirun(8, [*opts, *twice], cwd=tmp_path, timeout=150, ft=True)
    assert crash.returncode == 1, crash.stderr
    assert ("dsim: deadlock: a deadlock was broken, every rank alive; repaired in the job: rank 3 from rank 7 (group "
            "info [3, 7]); training goes on after step 13" in crash.stdout), crash.stdout
    assert "then the job is ended (exit status 1)" in crash.stdout and "still waits" not in crash.stdout
    first, second = events(tmp_path, "deadlock")
    assert first["broken"] and not second["broken"] and second["global_step"] >= 17
    repair, = events(tmp_path, "deadlock_repair")
    assert repair["donors"] == {"3": 7} and repair["global_step"] == 13 and repair["failed"] == []
    assert redone_once(LOSS.findall(crash.stdout))[:16] == ref_losses[:16]  # steps 1..16, on through the repair

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[14:]  # from the checkpoint of step 14: steps 15..20
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("point, where", [("refill", "before the dead rank's place is filled"),
                                          ("exchange", "before the state is exchanged")])
def test_a_rank_stuck_during_a_repair_is_killed_as_stuck_then_the_last_gasp(ft_reference, tmp_path, point, where):
    """Rank 3 dies in step 13's forward; rank 5 is stuck (its process runs, its repair does not) in the repair that
    follows. The repair is work watched and its collectives are waits, so rank 5 is judged stuck as in a step, and
    killed; the repair falls back to the last gasp of step 12, from which the resume is bit-identical. At refill a
    fault plan strikes it (rank 5 stuck at the first point it reaches after the kill, the repair); at exchange
    fault.repair_stuck, where the others wait for it in the exchange's MPI_Comm_agree. (Before 2026-11-28 the repair
    was one wait: at refill rank 5 was found as a deadlock, 6 s and a break later; at exchange no revoke ends an
    agreement, and the job was ended.)"""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.arf=true", *BREAK]
    if point == "refill":
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps({"format": "dsim-fault-plan/1", "faults": [
            {"time": 0, "rank": 3, "kind": "kill", "at": "forward", "step": 13},
            {"time": 0, "rank": 5, "kind": "stuck", "at": "update", "step": 13}]}))
        crash = mpirun(8, [*opts, "--set", "fault.kind=plan"], cwd=tmp_path, timeout=120, ft=True,
                       env={"DSIM_FAULT_PLAN": str(plan)})
        does = "is stuck (its training stops, its process runs)"
    else:
        crash = mpirun(8, [*opts, *fault("kill", 3, "forward", 13, "--set", "fault.repair_stuck=5", "--set",
                                         f"fault.repair_at={point}")], cwd=tmp_path, timeout=120, ft=True)
        does = "is stuck (its repair stops, its process runs)"
    assert crash.returncode == 1, crash.stderr
    assert f"dsim: fault: rank 5 {does} during {'a' if point == 'refill' else 'the'} repair in the job, {where}" \
        in crash.stdout, crash.stdout
    assert re.search(r"dsim: hang watch: rank 5 \(pid \d+\) is stuck: its process runs, its repair in the job has made "
                     r"no progress outside a collective for \d+\.\d s \(step 13, timeout 5 s\): killed \(SIGKILL\), "
                     r"as a failed rank", crash.stdout), crash.stdout
    assert "deadlock" not in crash.stdout
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"], hang["work"]) == (5, "stuck", "repair")
    assert "dsim: warning: no repair in the job: rank(s) 3 died; rank(s) 5 died during the repair" in crash.stderr
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3, 5 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed"), crash.stderr

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("at, where, work, saved", [
    ("allreduce", "during the allreduce of step 13", "step", 12),
    # a callback that never returns (between steps: before, outside all work watched, so the job waited for ever)
    ("step_end", "at step 13", "callback", 13)])
def test_a_stuck_rank_is_killed_then_the_last_gasp_is_saved(ft_reference, tmp_path, at, where, work, saved):
    """(The resume from that last gasp is the frozen rank's test's: a death is a death.)"""
    ref_losses, _ = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", *WATCH]
    crash = mpirun(8, [*opts, *fault("stuck", 5, at, 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1, crash.stderr
    assert f"dsim: fault: rank 5 is stuck (its training stops, its process runs) {where}" in crash.stdout
    # the others wait for it inside a collective (the gradient all-reduce, or step 14's first); it alone is
    # outside, its heartbeat going on
    assert re.search(rf"dsim: hang watch: rank 5 \(pid \d+\) is stuck: its process runs, its {work} has made no "
                     r"progress outside a collective for \d+\.\d s \(step 13, timeout 3 s\): killed \(SIGKILL\), "
                     r"as a failed rank", crash.stdout), crash.stdout
    assert "no rank's process is frozen or stuck" not in crash.stdout
    stuck, = events(tmp_path, "fault")
    hang, = events(tmp_path, "hang")
    assert (stuck["kind"], stuck["rank"], stuck["global_step"]) == ("stuck", 5, 13)
    assert (hang["rank"], hang["how"], hang["global_step"], hang["timeout"], hang["work"]) == (
        5, "stuck", 13, TIMEOUT, work)
    killed_after_its_stall(stuck, hang)
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        f"dsim: error: rank(s) 5 failed; last-gasp checkpoint ttp-2_{saved - 10} (global step {saved}) committed"), \
        crash.stderr
    assert LOSS.findall(crash.stdout)[:12] == ref_losses[:12]  # the watch changed nothing before


EPOCH_SAVES = ["--set", "checkpoint.save_checkpoint_steps=null", "--set", "checkpoint.save_checkpoint_epochs=1"]
ASYNC_SAVES = ["--set", "checkpoint.save_checkpoint_steps=5", "--set", "checkpoint.async_save=true"]


@pytest.mark.parametrize("saves, step", [(EPOCH_SAVES, 10), (ASYNC_SAVES, 5)], ids=["epoch-end", "async"])
def test_a_rank_stuck_in_its_save_is_killed_then_the_last_gasp_and_the_resume_are_bit_identical(
        ft_reference, tmp_path, saves, step):
    """A write that never returns (a dead file system): the others wait for it in the save's collectives. The
    save at an epoch's end comes after every step callback (it was watched by none); an async save's writer
    thread stops, and its rank waits for it before its next step."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, *saves, "--set", "tft.ttp=true", *WATCH]
    crash = mpirun(8, [*opts, *fault("stuck", 5, "save", step)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1, crash.stderr
    assert f"dsim: fault: rank 5 is stuck (its training stops, its process runs) during the save of step {step}" \
        in crash.stdout
    assert re.search(r"dsim: hang watch: rank 5 \(pid \d+\) is stuck: its process runs, its save has made no "
                     rf"progress outside a collective for \d+\.\d s \(step {step}, timeout 3 s\): killed", crash.stdout), \
        crash.stdout
    assert "no rank's process is frozen or stuck" not in crash.stdout
    stuck, = events(tmp_path, "fault")
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"], hang["work"], hang["global_step"]) == (5, "stuck", "save", step)
    killed_after_its_stall(stuck, hang)
    assert not events(tmp_path, "checkpoint_committed")  # the save never committed; the last gasp saved its step
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        f"dsim: error: rank(s) 5 failed; last-gasp checkpoint ttp-1_{step} (global step {step}) committed"), crash.stderr
    if saves is ASYNC_SAVES:
        assert f"async save of network-1_{step} (global step {step}) was in flight: abandoned" in crash.stderr
        return  # (the resume from a last gasp: the epoch-end case's)
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[step:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_rank_stuck_in_its_last_gasp_write_is_killed_and_the_others_save_without_it(tmp_path):
    """Rank 3 dies; rank 6's last-gasp write never returns (a dead file system). The survivors wait for it in
    the last gasp's agreement; the watch, which before judged only steps and saves, kills it, and the last gasp
    starts again without it (rank 2, its replica, writes its files). (Resumes from such a gasp: test_e2e_last_gasp.)"""
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", *WATCH]
    crash = mpirun(8, [*opts, *fault("kill", 3, "forward", 13, "--set", "fault.last_gasp_stuck=6")], cwd=tmp_path,
                   timeout=120, ft=True)
    assert "dsim: fault: rank 6 is stuck (its last-gasp write never returns) during the last-gasp save of step 12" \
        in crash.stdout, crash.stdout
    assert re.search(r"dsim: hang watch: rank 6 \(pid \d+\) is stuck: its process runs, its last-gasp save has made "
                     r"no progress outside a collective for \d+\.\d s \(step 13, timeout 3 s\): killed", crash.stdout)
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"], hang["work"]) == (6, "stuck", "last gasp")
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3, 6 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed in "
        "run/checkpoints/ttp_checkpoints/tft_saved_checkpoints-step_12 by 6 survivors"), crash.stderr


def test_a_rank_frozen_during_a_repair_in_the_job_is_killed_then_the_last_gasp_and_the_resume_are_bit_identical(
        ft_reference, tmp_path):
    """Rank 3 dies; the survivors agree to give its place to the warm spare; rank 1 freezes before the refill.
    The others wait for it in the pool's shrink: the repair is watched work (before, nothing judged it and the job
    hung for ever). The watch kills rank 1; the refill finds it gone on every living process alike, the repair
    is given up, the 6 survivors save the last gasp of step 12 and the spare leaves with the job."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, *WATCH]
    crash = mpirun(9, [*opts, "--set", "tft.spares=1", *fault("kill", 3, "forward", 13, "--set", "fault.repair_hang=1")],
                   cwd=tmp_path, timeout=120, ft=True)
    assert ("dsim: fault: rank 1 freezes (SIGSTOP) during the repair in the job, before the dead rank's place is "
            "filled (training to go on after step 12)") in crash.stdout, crash.stdout
    assert re.search(r"dsim: hang watch: rank 1 \(pid \d+\) has not run for \d+\.\d s \(step 13, timeout 3 s\): "
                     r"killed \(SIGKILL\), as a failed rank", crash.stdout), crash.stdout
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"]) == (1, "frozen") and hang["frozen_for"] >= TIMEOUT
    assert "dsim: heal:" not in crash.stdout and not events(tmp_path, "heal")
    assert ("dsim: warning: no repair in the job: rank(s) 3 died; rank(s) 1 died during the repair; falling back to "
            "the last-gasp checkpoint") in crash.stderr, crash.stderr
    no_repair, = events(tmp_path, "no_repair")
    assert no_repair["died_during"] == [1]
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 1, 3 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed in "
        "run/checkpoints/ttp_checkpoints/tft_saved_checkpoints-step_12 by 6 survivors"), crash.stderr
    assert "internal error" not in crash.stderr and "spare: every training process" not in crash.stderr
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert LOSS.findall(proc.stdout) == ref_losses[12:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("how, fault_key, does, judged", [
    ("frozen", "repair_hang", "freezes (SIGSTOP)", r"has not run for \d+\.\d s"),
    # its process runs: its joining is work watched (before, it waited for no one, and the job hung for ever)
    ("stuck", "repair_stuck", "is stuck (its process runs)",
     r"is stuck: its process runs, its repair in the job has made no progress outside a collective for \d+\.\d s")])
def test_a_newcomer_frozen_or_stuck_before_the_state_exchange_is_killed_and_the_last_gasp_follows(
        tmp_path, how, fault_key, does, judged):
    """Rank 3 dies; the process spawned for its place freezes, or is stuck, before the state exchange. It beats from
    the moment it knows the job's config (a standby heartbeat, rank null), so the survivors' watch finds it frozen
    or stuck while the exchange waits for it (before, it had no heartbeat until it trained: every watch said
    "waiting" for ever). Killed, the repair is given up alike, and the 7 survivors save the last gasp of step 12."""
    crash = mpirun(8, ["-m", "dsim.train", *OPTS, *WATCH, "--set", "tft.arf=true",
                       *fault("kill", 3, "forward", 13, "--set", f"fault.{fault_key}=3", "--set", "fault.repair_at=exchange")],
                   cwd=tmp_path, timeout=120, ft=True)
    assert (f"dsim: fault: the newcomer taking rank 3's place {does} during the repair in the job, before the "
            "state is exchanged (training to go on after step 12)") in crash.stdout, crash.stdout
    assert re.search(rf"dsim: hang watch: a newcomer \(pid \d+\) {judged} \(step 13, timeout 3 s\): "
                     r"killed \(SIGKILL\)\n", crash.stdout), crash.stdout
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"], hang["global_step"]) == (None, how, 13) and hang["frozen_for"] >= TIMEOUT
    assert "dsim: heal:" not in crash.stdout and not events(tmp_path, "heal")
    assert "dsim: warning: no repair in the job: rank(s) 3 died; " in crash.stderr, crash.stderr
    errors = error_lines(crash)
    assert crash.returncode == 1 and len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-2_2 (global step 12) committed in "
        "run/checkpoints/ttp_checkpoints/tft_saved_checkpoints-step_12 by 7 survivors"), crash.stderr
    assert "internal error" not in crash.stderr


def test_a_frozen_rank_is_killed_and_a_warm_spare_takes_its_place(ft_reference, tmp_path):
    ref_losses, ref_ckpt = ft_reference("dp4xmp2k2")
    args = [str(ROOT / "configs" / "default.yaml"), "run/checkpoints", *OPTS, "--set", "parallel.data_parallel=null",
            *LAYOUTS["dp4xmp2k2"], "--set", "tft.spares=1", *WATCH, *fault("hang", 3, "update", 13)]
    proc = launch("run_parallel_save_ckpt.sh", args, cwd=tmp_path, timeout=150, check=0)
    out = proc.stdout
    assert ("dsim: heal: rank(s) 3 died; repaired in the job: rank 3 from rank 7 (group info [3, 7]); world size "
            "back to 8 (rank(s) 3 taken by a warm spare, 0 left)") in out, out
    hang = frozen_then_killed(tmp_path, 3, 13)
    heal, = events(tmp_path, "heal")
    assert heal["failed"] == [3] and heal["time"] > hang["time"]
    assert LOSS.findall(out) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")


def test_a_straggler_is_evicted_and_a_warm_spare_takes_its_place(ft_reference, tmp_path):
    """Rank 3 computes 50x slower from step 2 on (fault.kind slow): the others wait for it in every collective,
    nothing fails. The straggler watch finds it past tft.straggler_factor, kills it, and a warm spare takes its
    place; the job is bit-identical to an uninterrupted one (slowness changes no number)."""
    ref_losses, ref_ckpt = ft_reference("dp4xmp2k2")
    args = [str(ROOT / "configs" / "default.yaml"), "run/checkpoints", *OPTS, "--set", "parallel.data_parallel=null",
            *LAYOUTS["dp4xmp2k2"], "--set", "tft.spares=1", "--set", "tft.straggler_factor=2.5",
            "--set", "tft.straggler_evict=true", *fault("slow", 3, "forward", 2), "--set", "fault.slowdown=50"]
    proc = launch("run_parallel_save_ckpt.sh", args, cwd=tmp_path, timeout=150, check=0)
    out = proc.stdout
    assert "dsim: fault: rank 3 computes 50x slower from now on during the forward of step 2" in out, out
    assert re.search(r"dsim: straggler watch: rank 3 \(pid \d+\) computes its steps \d+\.\dx slower than the other "
                     r"ranks of its stage \(\d+ ms a step against a median of \d+ ms, as of step \d+; "
                     r"tft.straggler_factor 2.5\): killed \(SIGKILL\), as a failed rank \(tft.straggler_evict\)", out), out
    straggler, = events(tmp_path, "straggler")
    assert straggler["rank"] == 3 and straggler["evicted"] and straggler["step_ms"] > 2.5 * straggler["median_ms"]
    assert straggler["global_step"] >= 2 + 5  # judged after 5 of its steps past the factor
    heal, = events(tmp_path, "heal")
    assert heal["failed"] == [3] and heal["by_spare"] == [3] and heal["time"] > straggler["time"]
    # killed at any moment: rank 0 may have printed a step the repair then redid (printed twice, the same); in the
    # save at a step's end when the repair went on after that step, it prints that step's line after the repair
    assert redone_once(LOSS.findall(out)) == ref_losses
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")
