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


def test_a_failing_rank_ends_the_job(tmp_path):
    body = ("from mpi4py import MPI\n    c = MPI.COMM_WORLD\n    if c.rank == 1:\n        raise ValueError('bug')\n"
            "    c.Barrier()\n    return 0")
    proc = mpirun(2, [script(tmp_path, body), "out"], tmp_path, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr
    assert "dsim: error: internal error on rank 1: ValueError: bug (full traceback in out/logs/rank_1.err)" \
        in proc.stderr.splitlines()
    assert "ValueError: bug" in (tmp_path / "out" / "logs" / "rank_1.err").read_text()
