"""Under mpirun: load a checkpoint as `python -m dsim.train ... --resume NAME` does, then write what each rank holds.

    $ mpirun -n R python tests/loaded.py OUT [dsim.train options] --resume NAME

Each rank writes OUT/rank_R.npz: for every parameter and optimizer-state slice it owns, the array and its offsets
in the tensor (`<tensor>` and `<tensor>@offsets`, tensors named as in a commit record's slices). For tests that
compare the state a load put in memory with the checkpoint it came from (a resume trains at once, or on a finished
run trains nothing, so neither saves the state as loaded).
"""
import sys
from pathlib import Path

import numpy as np


def main(argv) -> int:
    from dsim import guard
    from dsim.train import parse_args
    out, args = Path(argv[0]), parse_args(argv[1:])
    guard.start_mpi()
    from mpi4py import MPI

    from dsim.build import build_run
    from dsim.checkpoint.recovery import resume
    from dsim.config import load_config
    from dsim.engine.state import owned_pieces
    run = build_run(load_config(args.config, args.overrides), MPI.COMM_WORLD)
    resume(run, args.resume)
    params = {p.name for p in run.network.trainable_params()}
    held = {}
    for name, _, owned, arr in owned_pieces(run.network, run.optimizer):
        tensor = f"params/{name}" if name in params else f"optimizer/{name}"
        held[tensor], held[f"{tensor}@offsets"] = np.array(arr), np.array(owned.offsets)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank_{MPI.COMM_WORLD.rank}.npz", **held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
