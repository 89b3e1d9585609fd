"""Watching mpirun. Open MPI's launcher (prterun) misbehaves in two known ways, neither dsim's doing:

- a **stall**: under ULFM it now and then stays alive after every rank of a job with a dead rank has ended
  (about once in ten to twenty such jobs on a loaded 2-core machine; all its ranks gone, prterun blocked on
  a lock). It is stopped then, instead of waited for forever.
- a **failed start**: now and then it exits before starting any rank, with "The PMIx server's listener
  thread failed to start" (once in some hundreds of launches; seen in CI). No rank ran, so nothing was read
  or written: it is started again, up to START_TRIES times.

Whoever runs mpirun goes through here: the tests (conftest.run_command), the benchmarks, the Makefile and
the launch scripts (`python dsim/ft/launcher.py mpirun ARGS...`, which launch/watch.sh's dsim_watched runs;
as a script it imports the standard library only: 40 ms and 13 MiB for the watch, against 0.3 s and 50 MiB
as `python -m dsim.ft.launcher`, which imports dsim first).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

STALL_SECONDS = 15  # no rank left for this long, and mpirun still there: stalled
START_TRIES = 3     # a launcher that failed to start is started again, this many launches in all
# What mpirun prints when it failed before starting any rank, for a cause that passes (not bad input)
START_FAILURES = ("The PMIx server's listener thread failed to start",)


def failed_to_start(returncode: int, stderr: str) -> bool:
    """Whether mpirun ended with `stderr` before starting any rank, for a cause worth another try."""
    return returncode != 0 and any(text in stderr for text in START_FAILURES)


def descendants(pid: int) -> list[int]:
    """Every living process below pid (the ranks and whatever they started). prterun puts each rank in a
    process group of its own, so killing mpirun's group does not reach them."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_tree(pid: int, group: bool = True):
    """SIGKILL pid and every process below it; with group=True pid's process group too (pid leads one)."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if group:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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


def supervise(proc, timeout: float, wait=None, stalls: bool = True, stall_seconds: float = STALL_SECONDS,
              group: bool = True) -> str:
    """Wait for proc (mpirun, or a launch script that runs it) to end.

    Returns "ended"; or, with proc and every process below it (every rank) SIGKILLed, and its process group
    with group=True (proc started with start_new_session=True), "stalled" when every rank had ended and
    mpirun stayed (stalls=True), "timeout" past `timeout` seconds. wait() waits a second at most and raises
    subprocess.TimeoutExpired when proc has not ended (by default proc.wait; proc.communicate to collect
    pipes); the caller reaps proc after a kill.
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
                kill_tree(proc.pid, group)
                return why


def run(cmd: list[str], timeout: float | None = None, tries: int = START_TRIES) -> int:
    """Run mpirun (cmd) as a user's command: output passed through, a stall stopped, a failed start tried
    again. Returns its exit status (1 after a stall, 124 after the timeout, as timeout(1) does).

    mpirun stays in the caller's process group, so whoever stops the caller's group (a test's timeout, a
    terminal's Ctrl-C) stops it too; SIGINT and SIGTERM sent to this process alone are passed to it.
    """
    for attempt in range(1, tries + 1):
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
        head = bytearray()  # the first of what it printed on stderr: a failed start says so at once

        def relay(pipe=proc.stderr):
            for chunk in iter(lambda: pipe.read1(65536), b""):
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
                if len(head) < 65536:
                    head.extend(chunk)
        relayed = threading.Thread(target=relay, daemon=True)
        relayed.start()
        # SIGTERM whichever came: started in the background of a script, mpirun ignores SIGINT
        forward = lambda signum, frame: proc.send_signal(signal.SIGTERM)  # noqa: E731
        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            how = supervise(proc, float("inf") if timeout is None else timeout, stall_seconds=STALL_SECONDS,
                            group=False)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        proc.wait()
        relayed.join(timeout=5)
        if how == "stalled":
            print("dsim: note: every rank has ended but mpirun has not (an Open MPI launcher stall); stopped it",
                  file=sys.stderr)
            return 1
        if how == "timeout":
            print(f"dsim: error: mpirun still running after {timeout:g} s; stopped it", file=sys.stderr)
            return 124
        if not failed_to_start(proc.returncode, head.decode(errors="replace")) or attempt == tries:
            return proc.returncode
        print(f"dsim: note: mpirun failed to start (an Open MPI launcher fault, no rank ran); starting it again "
              f"({attempt + 1} of {tries})", file=sys.stderr)
        time.sleep(1)
    raise AssertionError("unreachable")


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python dsim/ft/launcher.py", description=(
        "Run mpirun as dsim's launch scripts do: a launcher that stays after every rank has ended is stopped, "
        "one that failed to start (a PMIx fault, no rank ran) is started again."))
    parser.add_argument("--timeout", type=float, default=None, help="stop mpirun and every rank after this many "
                        "seconds (exit 124)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="mpirun and its arguments")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given (e.g. mpirun -n 8 python -m dsim.train)")
    return run(args.command, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
