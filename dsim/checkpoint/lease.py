"""The lease on a checkpoint directory: one job writes it at a time.

Rank 0 of a job holds an exclusive lock (flock) on `<directory>/.dsim-lease` from before it resumes until the job
ends, and writes into the file who holds it (host, pid, time, command line). A second job on the same directory
finds the lock taken and refuses, in one line naming the first, before it reads, cleans or writes anything: two
jobs in one directory would delete each other's files in flight (a new job removes the `.tmp` files it finds,
which a living job is still writing) and commit checkpoints of two different trainings under one prefix.

The kernel drops the lock when the process holding it ends, however it ends (kill -9 included), so a dead job
never keeps a directory: there is no stale lock to remove by hand, and a job started again after a crash takes it
at once. The file itself stays (removing it would race with a job taking it). On a file system shared by several
hosts the lock is as good as the file system's own (NFS v4 locks across clients; flock is emulated with them on
Linux).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import CheckpointError

FILE = ".dsim-lease"


class DirectoryInUse(CheckpointError):
    """Another living job holds the directory's lease."""


class Lease:
    """An exclusive lease on a checkpoint directory, held while the object (its open file) lives."""

    def __init__(self, directory, fd: int):
        self.directory, self._fd = Path(directory), fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with the file description
            self._fd = None

    __del__ = release

    @property
    def held(self) -> bool:
        return self._fd is not None

    def covers(self, directory) -> bool:
        return self.held and os.path.realpath(self.directory) == os.path.realpath(directory)


def take(directory, what: str = "") -> Lease:
    """The lease on directory (made if missing); DirectoryInUse (one line naming the holder) when a living job has it.
    what: the command line to name this job by (default: this process's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise DirectoryInUse(f"the checkpoint directory {directory} is in use by another job ({describe(holder)}): "
                             "two jobs must not write one directory; wait for it to end or stop it, or save "
                             "elsewhere (checkpoint.directory)") from None
    except OSError:
        os.close(fd)
        raise
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
              "command": what or " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    return Lease(directory, fd)


def describe(holder) -> str:
    if not holder:
        return "which one it has not yet written"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {when}: {holder.get('command', '?')}"


def _read(fd: int):
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "null")
    except (OSError, ValueError):
        return None
