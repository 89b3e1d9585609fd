"""What a run tells: `say` prints a line for the person watching, `event` records one in the job's metrics.jsonl.

The bottom layer: every package may import it, and it imports nothing of dsim. Events go through Python's logging,
to the logger `dsim.events`: the running training's MetricsLog (dsim.engine.callbacks) attaches the handler that
writes metrics.jsonl at its begin and detaches it at its end, so no state of dsim's is kept here; outside training
(no handler attached) an event is dropped.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

EVENTS = logging.getLogger("dsim.events")
EVENTS.propagate = False  # events are records for metrics.jsonl, not lines for the terminal
EVENTS.setLevel(logging.INFO)
# Set by dsim/ft/launcher.py for the job it runs: a file where the lines that tell how the job ended are kept too
# (the launcher names the same variable itself: run as a script, it imports the standard library only)
TOLD = "DSIM_TOLD"
ENDED = ".ended"  # added to TOLD's file name: the file of the ranks' exit statuses (ended)


def say(message: str) -> None:
    """Print a log line without tearing a progress bar (one can show only once ProgressBar imported tqdm)."""
    bars = sys.modules.get("tqdm")
    if bars is not None:
        bars.tqdm.write(message, file=sys.stdout)
    else:
        sys.stdout.write(message + "\n")  # (one write: a line of another thread's never lands inside it)
    sys.stdout.flush()


def tell(line: str) -> None:
    """Print a line on stderr that tells how the job ended (its last gasp, the repair given up, a rank's error), and
    keep it in the launcher's file (TOLD), from which the launcher prints what mpirun did not pass on: Open MPI's
    launcher now and then closes a rank's stderr in a job whose spawned processes died (dsim/ft/launcher.py). Kept
    first, then printed: a closed stderr (EPIPE) is sent to /dev/null, so that no later line, nor the flush at exit,
    fails. Without the launcher, or on a host whose disk does not have its file, just printed."""
    path = os.environ.get(TOLD)
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:  # as Python's documentation of SIGPIPE advises
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def ended(code: int) -> None:
    """Keep this process's exit status in the launcher's file of statuses (TOLD's file with ENDED added to its name:
    a line "pid status"): when mpirun has reaped its ranks and then stays, the launcher still ends with their status
    (dsim/ft/launcher.py). Without the launcher, or on a host whose disk does not have its file (the launcher makes
    it; never made here), nothing."""
    path = os.environ.get(TOLD)
    if path:
        try:
            fd = os.open(path + ENDED, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, f"{os.getpid()} {code}\n".encode())  # one write, appended: never torn by another's
            finally:
                os.close(fd)
        except OSError:
            pass


def leave(code: int) -> NoReturn:
    """End this process now with `code`, without MPI_Finalize: a rank that fails alone must look dead to the others,
    which would otherwise wait for it in their next collective while it waits for them in MPI_Finalize. Its status is
    kept for the launcher first (ended), its output flushed."""
    ended(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def event(name: str, any_rank: bool = False, **fields) -> None:
    """Record an event (fault, resume, repair, last_gasp_saved, ...) in the running job's metrics.jsonl.

    Rank 0 writes; with any_rank=True the calling rank writes too (e.g. a survivor when rank 0 is dead).
    Outside training (no MetricsLog running) this does nothing.
    """
    if EVENTS.handlers:
        EVENTS.info(name, extra={"dsim_fields": fields, "dsim_any_rank": any_rank})


def recording() -> bool:
    """Whether a running training records events (a MetricsLog is attached)."""
    return bool(EVENTS.handlers)
