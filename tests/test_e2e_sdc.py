"""Silent data corruption end to end (`fault.kind: sdc`: a bit of a rank's parameter flips and nothing reports
it): `tft.sdc_check_every` compares the replicas, every rank stops at the first check after it with one line
naming the damaged replica(s), nothing is saved from the damaged state, and the resume from the newest
committed checkpoint ends bit-identical to an uninterrupted run. Every mpirun has a timeout."""
import pytest

from conftest import mpirun
from ftjob import LAYOUTS, LOSS, OPTS, error_lines, events, fault, final_state_equal

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("layout, rank, named", [
    ("dp2xmp4", 5, "the replicas of params/{} on ranks [1, 5] differ (either may be damaged)"),  # two holders
    ("dp4xmp2", 3, "rank(s) 3 hold(s) a params/{} that differs from the other replicas' (holders [1, 3, 5, 7])"),
])
def test_a_flipped_bit_is_found_at_the_next_check_and_the_resume_is_bit_identical(ft_reference, tmp_path,
                                                                                   layout, rank, named):
    ref_losses, ref_ckpt = ft_reference(layout)
    opts = ["-m", "dsim.train", *OPTS, *LAYOUTS[layout], "--set", "tft.sdc_check_every=4"]
    crash = mpirun(8, [*opts, *fault("sdc", rank, "step_end", 9)], cwd=tmp_path, timeout=120, check=1)
    flipped, = events(tmp_path, "fault")
    found, = events(tmp_path, "sdc")
    tensor = found["found"][0]["tensor"].split("/", 1)[1]
    assert flipped["kind"] == "sdc" and found["global_step"] == 12 and len(found["found"]) == 1  # steps 10-12 on it
    assert error_lines(crash) == [
        f"dsim: error: silent data corruption found at step 12: {named.format(tensor)}; no last gasp (the newest "
        "state is the damaged one): resume (--resume auto) from the newest committed checkpoint, checked before "
        "it was saved"], crash.stderr
    losses = LOSS.findall(crash.stdout)
    # trained on the damage from step 10 to the check at the end of step 12, which stopped before its loss line
    assert len(losses) == 11 and losses[:9] == ref_losses[:9]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.commit"))
    assert ckpts == ["network-1_7.commit"]  # nothing committed after the flip (the check at step 14 never came)

    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5" in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[7:]  # steps 8..20, bit for bit
    final_state_equal(ref_ckpt, tmp_path / "run" / "checkpoints")
