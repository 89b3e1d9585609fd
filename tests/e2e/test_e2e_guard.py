"""The guard at every entry point (issue 22, item 3): an unexpected exception is one line, its traceback kept
in <run dir>/logs/rank_R.err, a non-zero exit; under mpirun the other ranks end too."""
import sys

import pytest

from conftest import mpirun, run_command

pytestmark = pytest.mark.e2e
BUG = """
import sys
from dsim import guard
def main(argv):
    {body}
guard.run(main, run_dir=sys.argv[1])
"""


def script(tmp_path, body):
    path = tmp_path / "bug.py"
    path.write_text(BUG.format(body=body))
    return str(path)


def test_internal_error_is_one_line_and_the_traceback_is_kept(tmp_path):
    proc = run_command([sys.executable, script(tmp_path, "return {}['missing']"), "out"], tmp_path, 60, None)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "dsim: error: internal error on rank 0: KeyError: 'missing' (full traceback in out/logs/rank_0.err)"]
    kept = (tmp_path / "out" / "logs" / "rank_0.err").read_text()
    assert kept.startswith("Traceback") and "KeyError: 'missing'" in kept


def test_dsim_debug_prints_the_traceback(tmp_path):
    proc = run_command([sys.executable, script(tmp_path, "return 1 / 0"), "out"], tmp_path, 60, None,
                       env={"DSIM_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("dsim: error: internal error on rank 0: ZeroDivisionError")


def test_a_hung_job_that_times_out_shows_where_each_rank_was(tmp_path):
    """Rank 1 frozen with no hang watch: rank 0 waits for it for ever. The timeout (the launcher's, or a test's)
    asks every rank for its threads' stacks (SIGUSR1: guard.stacks_on_signal) before the kill: rank 0's shows
    its step waiting in a sum (the frozen rank cannot answer; it is killed with the rest)."""
    from ftjob import OPTS
    with pytest.raises(AssertionError) as timed_out:
        mpirun(2, ["-m", "dsim.train", *OPTS, "--set", "parallel.model_parallel=2", "--set", "fault.kind=hang",
                   "--set", "fault.rank=1", "--set", "fault.at=forward", "--set", "fault.step=3"],
               cwd=tmp_path, timeout=15)
    report = str(timed_out.value)
    assert report.startswith("timed out after 15 s") and "dsim: fault: rank 1 stops (SIGSTOP)" in report
    assert report.count("(most recent call first)") >= 1, report
    assert 'dsim/engine/model.py", line' in report and "in train_step" in report and "in _loop" in report, report


def test_a_failing_rank_ends_the_job(tmp_path):
    body = ("from mpi4py import MPI\n    c = MPI.COMM_WORLD\n    if c.rank == 1:\n        raise ValueError('bug')\n"
            "    c.Barrier()\n    return 0")
    proc = mpirun(2, [script(tmp_path, body), "out"], tmp_path, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "dsim: error: internal error on rank 1: ValueError: bug (full traceback in out/logs/rank_1.err)" \
        in proc.stderr.splitlines()
    assert "ValueError: bug" in (tmp_path / "out" / "logs" / "rank_1.err").read_text()


def test_a_rank_that_fails_to_start_ends_the_job_with_one_line(tmp_path):
    """Under MPI fault tolerance (the launch scripts' `mpirun --with-ft ulfm`), rank 3's process ends before its
    MPI_Init (MPMD: its node runs a broken command): the others waited in MPI_Init for ever (plain mpirun ends
    the job at once). Past DSIM_START_TIMEOUT rank 0 says so in one line and the job exits 1."""
    import time

    from conftest import BIN, LAUNCHER, ft_env
    env = ft_env()
    opts = env.pop("DSIM_FT_MPIRUN_ARGS").split()
    job = [sys.executable, "-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "train.epochs=1"]
    broken = [sys.executable, "-c", "raise SystemExit('rank 3: no dsim on this node')"]
    t = time.time()
    proc = run_command([sys.executable, str(LAUNCHER), str(BIN / "mpirun"), *opts, "-n", "3", *job, ":", "-n", "1",
                        *broken, ":", "-n", "4", *job], tmp_path, 60, None, {**env, "DSIM_START_TIMEOUT": "3"})
    assert proc.returncode == 1, proc.stderr
    assert "rank 3: no dsim on this node" in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.startswith("dsim: error")] == [
        "dsim: error: MPI did not start within 3 s (MPI_Init): a process of this job failed to start or cannot be "
        "reached (see the lines above); DSIM_START_TIMEOUT sets the wait"], proc.stderr
    assert time.time() - t < 30 and not (tmp_path / "runs").exists()  # nothing trained, nothing written
