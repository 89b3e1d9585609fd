"""The daily tier (tests/tiers.py): every test it names exists, and docs/testing.md shows its table."""
import re
import subprocess
import sys

from conftest import ROOT
from tiers import FEATURES, check_ids, in_check, table

MARKED_MPI = re.compile(r"^(\s*@pytest\.mark\.mpi\b|pytestmark\b.*\bmark\.mpi\b)", re.M)


def test_every_test_the_tier_names_exists_and_is_marked_check():
    ids = sorted(check_ids())
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "check", *ids], cwd=ROOT, capture_output=True, text=True, timeout=300)
    collected = {line for line in proc.stdout.splitlines() if "::" in line}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # 4: an id not found
    missing = [i for i in ids if i not in collected and not any(c.split("[", 1)[0] == i for c in collected)]
    assert missing == [], missing
    assert all(i.startswith(("tests/mpi/", "tests/e2e/")) for i in ids)  # every serial test is in it anyway


def test_an_id_without_parameters_takes_each_parametrization():
    some = next(i for i in check_ids() if "[" not in i)
    assert in_check(some) and in_check(some + "[x]")
    assert not in_check(some + "_renamed") and not in_check("tests/e2e/test_e2e_x.py::test_y")


def test_the_docs_show_the_tier_table():
    assert all(FEATURES.values())
    assert table() in (ROOT / "docs" / "testing.md").read_text()


def test_every_mpi_test_is_under_tests_mpi():
    """The MPI stages (make test-mpi, make check-mpi) collect tests/mpi alone (8 ranks importing the other
    stages' files cost CPU, and much wall time on a loaded machine): an MPI test elsewhere would not run."""
    outside = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")
               if "mpi" not in p.relative_to(ROOT).parts[:2] and MARKED_MPI.search(p.read_text())]
    assert outside == []


MARKED_E2E = re.compile(r"^(\s*@pytest\.mark\.e2e\b|pytestmark\b.*\bmark\.e2e\b)", re.M)


def test_every_e2e_test_is_under_tests_e2e():
    """The end-to-end stages (make test-e2e, make check-e2e) collect tests/e2e alone, as the MPI stages tests/mpi:
    an end-to-end test elsewhere would not run."""
    outside = [p.relative_to(ROOT) for p in (ROOT / "tests").rglob("test_*.py")
               if "e2e" not in p.relative_to(ROOT).parts[:2] and MARKED_E2E.search(p.read_text())]
    assert outside == []


def test_a_failed_start_keeps_the_launch_scripts_echo_of_the_command():
    """tests/conftest.py's after_failed_starts drops what the launcher's failed starts left, but not the launch
    script's `+ mpirun ...` line printed before them (test_e2e_spares asserts it; a retried start lost it)."""
    from conftest import after_failed_starts
    note = "dsim: note: mpirun failed to start (an Open MPI launcher fault, no rank ran); starting it again\n"
    echo = "+ mpirun --with-ft ulfm --stdin none -n 9 python -m dsim.train x\n"
    assert after_failed_starts(echo + "prte: failed\n" + note + "dsim: error: y\n") == echo + "dsim: error: y\n"
    assert after_failed_starts(echo + "dsim: error: y\n") == echo + "dsim: error: y\n"
    assert after_failed_starts("prte: failed\n" + note) == ""
