"""A frozen rank made a dead one: the hang watch (`tft.hang_timeout: S`).

A rank that stops running (SIGSTOP, a process stuck in the kernel on a dead device or file system, a
deadlock inside the interpreter) is neither dead nor alive to MPI: nothing fails, and the other ranks wait
for it in their next collective forever. NCCL's and HCCL's timeouts (HCCL_EXEC_TIMEOUT) end the whole job
then; dsim instead finds the frozen process and kills it, so that what follows is what follows a death: the
last gasp, the repair in the job, or the end of the job and a restart.

Each training process writes a heartbeat from a thread every HEARTBEAT seconds to
<output.dir>/heartbeats/<pid>: its rank, the world size, the step it is in, its start time and the time.
A frozen process's threads are frozen with it, so its heartbeat stops; a process blocked in a collective, or
busy saving, keeps beating (MPI calls and file writes release the interpreter). When this rank's step has
gone on for more than the timeout, its watch reads the others' heartbeats: a process of the same world
whose heartbeat is older than the timeout, and which is still that process (pid and start time), is frozen,
and is sent SIGKILL. Every rank's watch may see it; one, the first to claim it, reports it (a `hang` event
and a line). A rank alive but stuck (its threads run while its work does not) is not judged: the job waits
for it, as MPI does, and the watch says so once a step.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from ..engine.callbacks import Callback, event, say
from ..faults import same_process, started

HEARTBEAT = 0.5  # seconds between two heartbeats
RECORD = 256     # bytes of a heartbeat record (JSON, space-padded): one positioned write
_running = None  # this process's HangWatch while it trains


class HangWatch(Callback):
    """The heartbeat of this training process and the watch over the others' (see the module doc)."""

    def __init__(self, timeout: float, directory):
        self.timeout = float(timeout)
        self.dir = Path(directory) / "heartbeats"
        self.rank = self.world_size = None
        self.step = 0
        self.since: Optional[float] = None  # when the step in progress began (None: between steps)
        self.judged = False                  # this step's stall was looked into already
        self._stop = threading.Event()
        self._thread = self._fd = None

    # -- callbacks ----------------------------------------------------------------------------------------
    def begin(self, run_context):
        cb = run_context.original_args()
        self.rank, self.world_size = cb.rank, cb.world_size
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            forget_the_dead(self.dir)
        self._fd = os.open(self.dir / str(os.getpid()), os.O_CREAT | os.O_WRONLY, 0o644)
        self._started = started(os.getpid())
        self._beat(time.time())
        self._thread = threading.Thread(target=self._run, name="dsim-hang-watch", daemon=True)
        self._thread.start()
        global _running
        _running = self

    def recovered(self, run_context):
        """After a repair in the job or an elastic shrink: this process's rank and world now; between steps."""
        cb = run_context.original_args()
        self.rank, self.world_size, self.since = cb.rank, cb.world_size, None

    def step_begin(self, run_context):
        self.step = run_context.original_args().cur_step_num + 1
        self.since, self.judged = time.time(), False

    def step_end(self, run_context):
        self.since = None

    def end(self, run_context=None):
        global _running
        _running = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            (self.dir / str(os.getpid())).unlink(missing_ok=True)
            self._fd = None

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self):
        warned = False
        while not self._stop.wait(HEARTBEAT):
            try:
                now = time.time()
                self._beat(now)
                since = self.since
                if since is not None and not self.judged and now - since > self.timeout:
                    self.judged = True
                    self._judge(now, since)  # (self.since may be cleared meanwhile: the step ended)
            except Exception as e:  # the thread must go on: without its heartbeat this process looks frozen
                if not warned:
                    say(f"dsim: warning: hang watch: rank {self.rank}: {type(e).__name__}: {e}")
                    warned = True

    def _beat(self, now: float) -> None:
        record = json.dumps({"pid": os.getpid(), "started": self._started, "rank": self.rank,
                             "world_size": self.world_size, "step": self.step, "time": now})
        os.pwrite(self._fd, record.encode().ljust(RECORD), 0)

    def _judge(self, now: float, since: float) -> None:
        """This rank's step, begun at `since`, has gone on past the timeout: kill the frozen processes of its
        world, if any."""
        frozen = find_frozen(self.dir, self.world_size, now, self.timeout)
        if not frozen and killed_since(self.dir, since):
            return  # another rank's watch found the frozen one first: its death is on its way here
        if not frozen:
            say(f"dsim: hang watch: rank {self.rank}: step {self.step} has gone on for {now - since:.0f} s; "
                "every rank's process is running (slow, or stuck but alive): waiting")
            return
        for record in frozen:
            try:
                os.kill(record["pid"], signal.SIGKILL)
            except ProcessLookupError:
                continue
            if claim(self.dir, record):  # the first watch to kill it reports it
                ago = now - record["time"]
                event("hang", any_rank=True, rank=record["rank"], frozen_for=round(ago, 3), global_step=self.step,
                      by=self.rank, timeout=self.timeout)
                say(f"dsim: hang watch: rank {record['rank']} (pid {record['pid']}) has not run for {ago:.1f} s "
                    f"(step {self.step}, timeout {self.timeout:g} s): killed (SIGKILL), as a failed rank")


def leave() -> None:
    """This process stops training without its callbacks' end (left idle by an elastic shrink): no heartbeat
    of it is a training rank's any more, and its watch stops."""
    if _running is not None:
        _running.end()


def heartbeats(directory) -> list[dict]:
    """Every heartbeat record in `directory` (a record being rewritten as it is read is skipped)."""
    out = []
    for path in Path(directory).glob("[0-9]*"):
        try:
            out.append(json.loads(path.read_bytes().decode().strip()))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
    return out


def find_frozen(directory, world_size: int, now: float, timeout: float) -> list[dict]:
    """The heartbeats of processes of a world of `world_size` that have not beaten for more than `timeout`
    seconds and are still running as the same process (a dead one's record is not a hang)."""
    return [r for r in heartbeats(directory)
            if r.get("world_size") == world_size and r.get("pid") != os.getpid() and now - r["time"] > timeout
            and same_process(r["pid"], r.get("started"))]


def claim(directory, record: dict) -> bool:
    """Exclusively mark the frozen process `record` as killed (True for the first caller only)."""
    try:
        fd = os.open(Path(directory) / f"killed-{record['pid']}-{record['started']}", os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def killed_since(directory, since: float) -> bool:
    """Whether a watch killed a frozen process at or after `since` (its claim's time)."""
    for path in Path(directory).glob("killed-*"):
        try:
            if path.stat().st_mtime >= since - 1:
                return True
        except OSError:
            continue
    return False


def forget_the_dead(directory) -> None:
    """Remove the heartbeats (and kill marks) of processes that no longer run: a job's start, after a restart."""
    for path in Path(directory).iterdir():
        try:
            if path.name.startswith("killed-"):
                pid, when = path.name.split("-")[1:3]
                when = None if when == "None" else int(when)
            else:
                record = json.loads(path.read_bytes().decode().strip())
                pid, when = record["pid"], record["started"]
            if not same_process(int(pid), when):
                path.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, UnicodeDecodeError):
            continue
