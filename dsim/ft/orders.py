"""Signals across hosts for the watches (dsim.ft.hang, dsim.ft.straggler): a pid means something on its own host only.

The heartbeats of a job's processes share one directory (<output.dir>/heartbeats). On one machine, or on the hosts
of a cluster whose output directory is on a shared file system, a watch reads every process's record; but a pid
written by a process of another host names some other process here, or none. So a watch signals a process itself
only on its own host (`here`: the record's `host`, this machine's name); a process of another host gets an order,
a file in the same directory (`order-<signal>-<pid>-<started>@<host>`), which any watch thread of that host carries
out at its next beat (`obey`: the process's own, for a rank that runs but is stuck or slow; a host-mate's, for a
frozen one), once it has made sure the pid is still that process (dsim.faults.same_process). A frozen process alone
on its host has nobody to carry its order out: its host is found silent instead, as after a network cut (dsim.ft.cut).

With a node-local output directory each host's watches see their own host's processes only: a frozen or stuck rank
is still found by its host-mates, while a straggler, a deadlock and a stuck rank alone on its host, which need the
whole job's records, are not (rank 0's watch says so once: `unseen`).
"""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Optional

from ..faults import same_process

HOST = socket.gethostname()  # this machine's name (on the test cluster, each host's own: dsim.cluster)
ORDER = "order-"  # the name of an order's file begins so (send)
FRESH = 2.0  # seconds: a record of another host beaten this recently is of a process that runs (nothing else tells)


def here(record: dict) -> bool:
    """Whether a heartbeat record's process runs on this host (a record without a host: written on this one)."""
    return record.get("host", HOST) == HOST


def running(record: dict, now: float) -> bool:
    """Whether a record's process still runs, as far as this host can tell: on this host, that pid is still the
    process that wrote it; on another, the record was beaten within FRESH seconds (a frozen or dead one's is older)."""
    if here(record):
        return same_process(record["pid"], record.get("started"))
    return now - record.get("time", 0) < FRESH


def file_name(pid: int, host: str = HOST) -> str:
    """A process's heartbeat file: its pid and host (two hosts may give one pid to two ranks)."""
    return f"{pid}@{host}"


def send(directory, record: dict, sig: int) -> bool:
    """Signal a record's process: on this host directly; else by an order to its host (obey). Whether it was sent
    or ordered (False: the process here is gone)."""
    if here(record):
        try:
            os.kill(record["pid"], sig)
        except ProcessLookupError:
            return False
        return True
    name = f"{ORDER}{int(sig)}-{record['pid']}-{record.get('started')}@{record['host']}"
    try:
        os.close(os.open(Path(directory) / name, os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError:
        return False
    return True


def order(name: str) -> tuple[int, int, Optional[int], str]:
    """An order's file name (send) read back: (signal, pid, the process's start time, host); ValueError if it is
    not one."""
    what, host = name[len(ORDER):].rsplit("@", 1)
    sig, pid, when = what.split("-", 2)
    return int(sig), int(pid), None if when == "None" else int(when), host


def obey(directory) -> None:
    """Carry out the orders for this host's processes (send): each signal to its process if that pid is still the
    one meant, the order then removed; kills last, and this process's own kill after every other order."""
    orders = []
    for path in Path(directory).glob(f"{ORDER}*@{HOST}"):
        try:
            sig, pid, when, _ = order(path.name)
        except ValueError:
            continue
        orders.append((sig == signal.SIGKILL, pid == os.getpid(), sig, pid, when, path))
    for _, mine, sig, pid, when, path in sorted(orders, key=lambda o: o[:2]):
        path.unlink(missing_ok=True)
        if same_process(pid, when):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def unseen(records: list, world_size: int) -> Optional[int]:
    """How many ranks of a world of `world_size` have no heartbeat record among `records` (None: every rank has
    one): with a node-local output directory, the ranks of the other hosts."""
    ranks = {r.get("rank") for r in records if r.get("world_size") == world_size and r.get("rank") is not None}
    missing = world_size - len(ranks)
    return missing if missing > 0 else None
