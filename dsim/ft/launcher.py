"""Watching mpirun: Open MPI's launcher (prterun) under ULFM now and then stays alive after every rank of
a job with a dead rank has ended (seen about once in ten to twenty such jobs on a loaded 2-core machine;
all its ranks gone, prterun blocked on a lock). Whoever runs mpirun (the tests, the benchmarks; the launch
scripts do the same in bash) stops it then, instead of waiting forever.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

STALL_SECONDS = 15  # no rank left for this long, and mpirun still there: stalled


def children(pid: int) -> list[int]:
    """The living child processes of pid (of all its threads): the ranks, for mpirun.

    Zombies do not count: a stalled launcher does not even reap the rank that was killed.
    """
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return [c for c in found if _state(c) not in ("Z", "X", None)]


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    return _state(pid) not in ("Z", "X", None)


def _state(pid: int):
    """The one-letter state of a process (R, S, Z, ...), None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class StallWatch:
    """Feed it the time now and then while mpirun runs; it says when mpirun has stalled."""

    def __init__(self, pid: int, seconds: float = STALL_SECONDS):
        self.pid, self.seconds, self.idle_since = pid, seconds, None

    def stalled(self, now: float) -> bool:
        if children(self.pid):
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        return self.idle_since is not None and now - self.idle_since > self.seconds


def supervise(proc, timeout: float, wait=None, stalls: bool = True, stall_seconds: float = STALL_SECONDS) -> str:
    """Wait for proc, started with start_new_session=True (mpirun, or a launch script that runs it), to end.

    Returns "ended"; or, with its whole process group (mpirun and every rank) SIGKILLed, "stalled" when every
    rank had ended and mpirun stayed (stalls=True), "timeout" past `timeout` seconds. wait() waits a
    second at most and raises subprocess.TimeoutExpired when proc has not ended (by default proc.wait;
    proc.communicate to collect pipes); the caller reaps proc after a kill.
    """
    wait = wait or (lambda: proc.wait(timeout=1))
    watch, start = StallWatch(proc.pid, stall_seconds) if stalls else None, time.time()
    while True:
        try:
            wait()
            return "ended"
        except subprocess.TimeoutExpired:
            now = time.time()
            why = "stalled" if watch is not None and watch.stalled(now) else "timeout" if now - start > timeout else None
            if why is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return why
