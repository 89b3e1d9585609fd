"""Async save end to end under mpirun -n 8: bit-identical to synchronous saves, and a kill -9 in the middle of
a background write leaves nothing committed, so the resume takes the previous checkpoint."""
import re

import pytest

from conftest import made_once, mpirun
from dsim import inspect as dinspect
from test_e2e_checkpoint import LOSS, RUN, same_final_state

pytestmark = pytest.mark.e2e
ASYNC = ["--set", "checkpoint.async_save=true", "--set", "train.epochs=3"]
SAVED = re.compile(r"^checkpoint saved: run/checkpoints/(\S+) \(.* in the background, the step stalled \d+ ms\)$", re.M)


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The same 3 epochs with synchronous saves, uninterrupted: (its output, its directory)."""
    d, proc = made_once(tmp_path_factory, "synchronous", 8, [*RUN, "--set", "train.epochs=3"], check=0)
    return proc, d


@pytest.mark.parametrize("staging", ["memory", "page_cache"])
def test_async_save_kill_mid_write_then_resume_is_bit_identical(synchronous, tmp_path, staging, capsys):
    """With either staging (a snapshot buffer, or the live arrays written into the page cache)."""
    ref, ref_dir = synchronous
    dir_ = tmp_path / "async"
    dir_.mkdir()
    opts = [*ASYNC, "--set", f"checkpoint.async_staging={staging}"]
    # rank 3 is killed by its writer thread half-way through its file of step 20, while training goes on
    crash = mpirun(8, [*RUN, *opts, "--set", "fault.kind=kill", "--set", "fault.rank=3", "--set", "fault.at=save",
                       "--set", "fault.step=20"], cwd=dir_, timeout=120)
    assert crash.returncode != 0 and "killing rank 3 (SIGKILL) during the save of step 20" in crash.stdout
    ckpt = dir_ / "run" / "checkpoints"
    assert SAVED.findall(crash.stdout) == ["network-1_10"]
    assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_10.commit"]  # step 20 never committed

    resumed = mpirun(8, [*RUN, *opts, "--resume", "auto"], cwd=dir_, check=0)
    assert "resumed from run/checkpoints/rank_0/network-1_10.h5 (global step 10: epoch 2 step 0)" in resumed.stdout
    assert SAVED.findall(resumed.stdout) == ["network_1-2_10", "network_1-3_10"]
    assert LOSS.findall(resumed.stdout) == LOSS.findall(ref.stdout)[1:]
    same_final_state(ref_dir / "run" / "checkpoints", "network-3_10", ckpt, "network_1-3_10")
    # every checkpoint written in the background verifies clean; what the kill left of step 20 was never committed
    assert dinspect.main([str(ckpt), "--verify"]) == 0
    listing = capsys.readouterr().out
    assert all(f"verify {name}: ok (8 files, 27 tensors" in listing
               for name in ("network-1_10", "network_1-2_10", "network_1-3_10")), listing


def test_a_kill_during_an_async_save_abandons_it_and_the_last_gasp_saves(ft_reference, tmp_path):
    """Rank 0 dies half-way through its background write of step 14: the survivors, already training step 15,
    abandon that save (never committed) and save the last gasp of step 14; the resume is bit-identical."""
    from ftjob import LOSS as FT_LOSS, OPTS, error_lines, fault, final_state_equal
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    opts = ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", "--set", "checkpoint.async_save=true"]
    crash = mpirun(8, [*opts, *fault("kill", 0, "save", 14)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1 and "killing rank 0 (SIGKILL) during the save of step 14" in crash.stdout
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.commit")) == ["network-1_7.commit"]  # step 14 never committed
    assert ("dsim: the async save of network-2_4 (global step 14) was in flight: abandoned, not committed "
            "(a rank failed: the last gasp saves the newest step instead)") in crash.stderr
    errors = error_lines(crash)
    assert len(errors) == 1 and "last-gasp checkpoint ttp-2_4 (global step 14) committed" in errors[0], crash.stderr
    proc = mpirun(8, [*opts, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert "(global step 14: epoch 2 step 4)" in proc.stdout
    assert FT_LOSS.findall(proc.stdout) == ref_losses[14:]
    final_state_equal(ref_ckpt, ckpt)


def test_a_kill_during_an_async_save_is_healed_and_the_save_redone(ft_reference, tmp_path):
    """tft.arf: rank 0 dies half-way through its background write of step 14; the survivors abandon that
    save, spawn a new rank 0, go back to step 14, save it again and train on, bit-identically."""
    from ftjob import OPTS, final_state_equal
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    args = ["-m", "dsim.train", *OPTS, "--set", "tft.arf=true", "--set", "checkpoint.async_save=true",
            "--set", "fault.kind=kill", "--set", "fault.rank=0", "--set", "fault.at=save", "--set", "fault.step=14"]
    proc = mpirun(8, args, cwd=tmp_path, check=0, ft=True)
    assert "world size back to 8; training goes on after step 14" in proc.stdout, proc.stdout
    assert ("dsim: the async save of network-2_4 (global step 14) was in flight: abandoned, not committed "
            "(an in-job repair took over)") in proc.stdout
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.commit")) == [
        "network-1_7.commit", "network-2_10.commit", "network-2_4.commit"]  # step 14 saved again, committed
    final_state_equal(ref_ckpt, ckpt, "network-2_10")
