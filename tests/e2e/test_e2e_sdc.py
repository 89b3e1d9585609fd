"""Silent data corruption end to end (`fault.kind: sdc`: a bit of a rank's parameter flips and nothing reports
it): `tft.sdc_check_every` compares the replicas and finds it at the next check. By default every rank rolls
back in the job to the newest committed checkpoint (compared before it was saved) and the job ends
bit-identical to an uninterrupted run; with `tft.sdc_rollback: false` the job stops with one line naming the
damaged replica(s), nothing is saved from the damaged state, and the resume is bit-identical.
A bit flipped and not yet found when a rank dies: the last gasp compares the replicas first and saves
nothing from them; one with a lone holder left saves it and says it was not compared. Every mpirun has a timeout."""
import json

import pytest

from conftest import mpirun
from ftjob import LAYOUTS, LOSS, OPTS, error_lines, events, fault, final_state_equal

pytestmark = pytest.mark.e2e
CHECK = ["--set", "tft.sdc_check_every=4"]


def found_at_12(job, flips):
    flipped, = events(job, "fault")
    found, = events(job, "sdc")
    assert flipped["kind"] == "sdc" and found["global_step"] == 12 and len(found["found"]) == 1  # steps 10-12 on it
    return found["found"][0]


def test_a_flipped_bit_is_rolled_back_in_the_job_bit_identically(ft_reference, tmp_path):
    """dp4 x mp2: four replicas of each parameter, so the odd one out (rank 3) is named."""
    ref_losses, ref_ckpt = ft_reference("dp4xmp2")
    proc = mpirun(8, ["-m", "dsim.train", *OPTS, *LAYOUTS["dp4xmp2"], *CHECK, *fault("sdc", 3, "step_end", 9)],
                  cwd=tmp_path, timeout=120, check=0)
    bad = found_at_12(tmp_path, 3)
    assert bad["ranks"] == [3] and bad["holders"] == [1, 3, 5, 7] and bad["majority"]
    back, = events(tmp_path, "sdc_rollback")
    assert (back["checkpoint"], back["global_step"], back["found_at"]) == ("network-1_7", 7, 12)
    assert (f"dsim: sdc: rank(s) 3 hold(s) a {bad['tensor']} that differs from the other replicas' (holders "
            "[1, 3, 5, 7]) at step 12; rolled back in the job to network-1_7 (global step 7, compared before it was "
            "saved) in ") in proc.stdout, proc.stdout
    # steps 1-11 (12 stopped at its end, before its loss line), then 8-20 again, those bit for bit
    losses = LOSS.findall(proc.stdout)
    assert losses[:9] == ref_losses[:9] and len(losses) == 11 + 13 and losses[11:] == ref_losses[7:]
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints", "network-2_10")


def test_without_rollback_the_job_stops_and_the_resume_is_bit_identical(ft_reference, tmp_path):
    """dp2 x mp4: two replicas of each parameter, so both are named (either may be the damaged one)."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, *CHECK, "--set", "tft.sdc_rollback=false"]
    crash = mpirun(8, [*opts, *fault("sdc", 5, "step_end", 9)], cwd=tmp_path, timeout=120, check=1)
    bad = found_at_12(tmp_path, 5)
    assert error_lines(crash) == [
        f"dsim: error: silent data corruption found at step 12: the replicas of {bad['tensor']} on ranks [1, 5] "
        "differ (either may be damaged); no last gasp (the newest state is the damaged one): resume (--resume auto) "
        "from the newest committed checkpoint, checked before it was saved"], crash.stderr
    losses = LOSS.findall(crash.stdout)
    assert len(losses) == 11 and losses[:9] == ref_losses[:9]  # trained on the damage from step 10 on
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.commit"))
    assert ckpts == ["network-1_7.commit"]  # nothing committed after the flip (the check at step 14 never came)

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5" in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[7:]  # steps 8..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_last_gasp_is_not_saved_from_replicas_that_differ(ft_reference, tmp_path):
    """A bit flips on rank 5 in step 9, and rank 2 dies in step 10, before the check at step 12: the survivors'
    last gasp compares the replicas first, finds ranks 1 and 5 differ, and saves nothing (the damage went into
    every replica's gradients); the resume goes back to the periodic checkpoint of step 7, bit-identically.
    Saved, the damaged last gasp would be the newest checkpoint: resumed, found again, rolled back to."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"rank": 5, "kind": "sdc", "at": "forward", "step": 9},
                                           {"rank": 2, "kind": "kill", "at": "update", "step": 10}]}))
    opts = ["-m", "dsim.train", *OPTS, *CHECK, "--set", "tft.ttp=true"]
    crash = mpirun(8, [*opts, "--set", "fault.kind=plan"], cwd=tmp_path, timeout=120, check=1, ft=True,
                   env={"DSIM_FAULT_PLAN": str(plan)})
    found, = events(tmp_path, "sdc")
    assert found["at"] == "last_gasp" and found["global_step"] in (9, 10) and found["found"]
    assert all(f["holders"] == [1, 5] and f["ranks"] == [1, 5] for f in found["found"])
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith(
        f"dsim: error: rank(s) 2 failed; no last-gasp checkpoint: the replicas of {found['found'][0]['tensor']} on "
        "ranks [1, 5] differ (either may be damaged)"), crash.stderr
    assert errors[0].endswith("(silent data corruption since the last check: every replica may carry it through "
                              "the gradients); resume (--resume auto) falls back to the last periodic checkpoint, "
                              "compared before it was saved"), errors
    assert not (tmp_path / "run" / "checkpoints" / "ttp_checkpoints").exists() or not list(
        (tmp_path / "run" / "checkpoints" / "ttp_checkpoints").rglob("*.commit"))

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5" in proc.stdout, proc.stdout
    assert "sdc" not in proc.stdout  # nothing damaged left
    assert LOSS.findall(proc.stdout) == ref_losses[7:]  # steps 8..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")


def test_a_last_gasp_from_a_lone_holder_says_it_was_not_compared(tmp_path):
    """A bit flips on rank 5 in step 9, and rank 1, its only replica, dies in step 10: the last gasp has one
    holder of their slices, nothing to compare them with. It saves them (the other survivors' slices compared
    equal), and says which were not compared, in its line, its event and its commit record: a flip there would
    go on unfound after the resume (both holders restored from the one)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"rank": 5, "kind": "sdc", "at": "forward", "step": 9},
                                           {"rank": 1, "kind": "kill", "at": "update", "step": 10}]}))
    crash = mpirun(8, ["-m", "dsim.train", *OPTS, *CHECK, "--set", "tft.ttp=true", "--set", "fault.kind=plan"],
                   cwd=tmp_path, timeout=120, check=1, ft=True, env={"DSIM_FAULT_PLAN": str(plan)})
    errors = error_lines(crash)
    assert len(errors) == 1 and errors[0].startswith("dsim: error: rank(s) 1 failed; last-gasp checkpoint ttp-1_"), errors
    assert ("ms after the failure was noticed; not compared since the last check (one surviving holder): the slices "
            "of ranks [1, 5]; resume (--resume auto) continues at step") in errors[0], errors
    assert not events(tmp_path, "sdc")  # the holders of every other slice agreed
    saved, = events(tmp_path, "last_gasp_saved")
    assert saved["unverified"] == [[1, 5]] and saved["global_step"] in (9, 10)
    record, = (tmp_path / "run" / "checkpoints" / "ttp_checkpoints").rglob("*.commit")
    assert json.loads(record.read_text())["last_gasp"]["unverified"] == [[1, 5]]
