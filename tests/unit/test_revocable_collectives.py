"""dsim's collectives must be ones a revoke reaches.

mpi4py's pickled reductions (comm.allreduce, reduce, scan, exscan) run point to point on a hidden duplicate
of the communicator. Revoking the communicator after a failure does not reach that duplicate, so a rank
blocked in one waits forever on a peer that has gone into recovery (seen as a 1-in-10 hang of a kill during an
async save). Reductions use the buffer forms (Allreduce, ...) on the communicator itself.
"""
import re
from pathlib import Path

import dsim

PICKLED_REDUCTION = re.compile(r"\.(allreduce|reduce|scan|exscan)\(")


def test_no_pickled_reduction_in_dsim():
    root = Path(dsim.__file__).parent
    found = [f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
             for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if PICKLED_REDUCTION.search(line.split("#")[0]) and "buckets.allreduce" not in line]
    assert not found, "pickled reductions (not reached by a revoke):\n" + "\n".join(found)
