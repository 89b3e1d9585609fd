"""One training job of a campaign, started through the launch scripts as a user would.

Each job runs in its own session (process group), so Ctrl-C at the terminal reaches only the campaign,
which then stops the job's whole group; every process of a job also carries DSIM_CAMPAIGN_JOB=<id> in its
environment, so warm spares or spawned replacements that left the group are found and stopped too. Open
MPI's launcher sometimes stays after every rank has ended (dsim.ft.launcher): the launch script stops it,
and the StallWatch here stops the script if it stays anyway.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..ft.launcher import STALL_SECONDS, StallWatch, alive, descendants

ROOT = Path(__file__).resolve().parents[2]
MARK = "DSIM_CAMPAIGN_JOB"
ENDED_SECONDS = 2.0  # every rank of the job gone this long and mpirun still there: the job has ended


class Job:
    """A launch script running one job: poll() for its exit status, stop() to end it and all it started."""

    def __init__(self, script: str, args: list, cwd, log, env: dict, job_id: str, timeout: float, wrap=None):
        """wrap: argv -> the argv that runs it elsewhere (on a cluster's node1: Cluster.command)."""
        self.id, self.started = job_id, time.time()
        self.deadline = self.started + timeout
        self.log = open(log, "a")
        shown = "".join(f"{k}={env[k]} " for k in ("RANK_SIZE", "HOSTFILE") if k in env)
        self.log.write(f"+ {shown}bash launch/{script} {' '.join(map(str, args))}\n")
        self.log.flush()
        env = {**os.environ, **env, MARK: job_id, "VIRTUAL_ENV": sys.prefix,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        argv = ["bash", str(ROOT / "launch" / script), *map(str, args)]
        self.proc = subprocess.Popen(wrap(argv) if wrap else argv, cwd=cwd, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        # watches the script (its child is dsim/ft/launcher.py, not a rank): STALL_SECONDS once children were seen too
        self.watch = StallWatch(self.proc.pid, ended_seconds=STALL_SECONDS)
        self.mpirun, self.ranks_watch = None, None  # mpirun, and a StallWatch of its ranks
        self.code = None
        self.ended = None

    def poll(self):
        """The exit status once the job has ended (by itself, stalled, or past its timeout), else None."""
        if self.code is None:
            code = self.proc.poll()
            now = time.time()
            if code is None and (now > self.deadline or self.watch.stalled(now) or self._ranks_ended(now)):
                why = "timed out" if now > self.deadline else "stalled after every rank had ended"
                self.log.write(f"(campaign: the job {why}; stopped it)\n")
                self.stop()
                code = self.proc.returncode
            if code is not None:
                self.code, self.ended = code, now
                self._close()
        return self.code

    def _ranks_ended(self, now: float) -> bool:
        """Every rank has ended (after some were seen) and mpirun stays: a launcher stall (dsim.ft.launcher)
        that the launch script would stop only after 3 s, which a campaign would count as downtime."""
        if self.mpirun is None or not alive(self.mpirun):
            # the script runs mpirun through dsim.ft.launcher: a grandchild
            self.mpirun = next((c for c in descendants(self.proc.pid) if _name(c) in ("mpirun", "prterun")), None)
            if self.mpirun is None:
                return False
            self.ranks_watch = StallWatch(self.mpirun, seconds=float("inf"), ended_seconds=ENDED_SECONDS)
        return self.ranks_watch.stalled(now)

    def stop(self) -> None:
        """SIGKILL the job's process group and any process that carries its id; wait for the script."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        sweep(self.id)
        if self.code is None:
            self.code, self.ended = self.proc.returncode, time.time()
        self._close()

    def _close(self):
        if not self.log.closed:
            self.log.close()


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def carrying(job_id: str, prefix: bool = False) -> list[int]:
    """Processes whose environment holds DSIM_CAMPAIGN_JOB=<job_id> (those of this job only; with prefix,
    of every job whose id starts so: a campaign's)."""
    needle = f"{MARK}={job_id}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                items = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v == needle or (prefix and v.startswith(needle)) for v in items):
                found.append(int(d.name))
    return found


def sweep(job_id: str, prefix: bool = False) -> None:
    """SIGKILL every process of the job still alive (a spare or a replacement outside its process group)."""
    for pid in carrying(job_id, prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
