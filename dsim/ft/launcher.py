"""Watching mpirun: Open MPI's launcher (prterun) under ULFM now and then stays alive after every rank of
a job with a dead rank has ended (seen about once in ten to twenty such jobs on a loaded 2-core machine;
all its ranks gone, prterun blocked on a lock). Whoever runs mpirun (the tests, the benchmarks; the launch
scripts do the same in bash) stops it then, instead of waiting forever.
"""
from __future__ import annotations

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
