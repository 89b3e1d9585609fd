"""Watching mpirun. Open MPI's launcher (prterun) misbehaves in three known ways, neither dsim's doing:

- a **stall**: under ULFM it now and then stays alive after every rank of a job with a dead rank has ended
  (about once in ten to twenty such jobs on a loaded 2-core machine; all its ranks gone, prterun blocked on
  a lock). It is stopped then, instead of waited for forever: ENDED_SECONDS after the last rank seen running
  has ended (a healthy prterun ends within 0.05 s of it), STALL_SECONDS when no rank was seen running. The
  launcher then exits with the status mpirun would have given, told from the ranks (ranks_status): those it
  left unreaped, and those it reaped from the statuses they kept as they ended (ENDED: dsim.log.ended); 1 when
  that cannot be told (a rank killed, with no status of its own to read).
- a **failed start**: now and then it exits before starting any rank, with "The PMIx server's listener
  thread failed to start" (rare: about once in some hundreds of launches), or, over several hosts, with a
  daemon that "failed to report back" before any rank ran (prted's exit status 213, seen in CI on the test
  cluster at a load of 20 and more). No rank ran, so nothing was read or written: it is started again, up to
  START_TRIES times.
- an **abort at its end**: the stall's other face. Instead of blocking on the lock, prterun trips glibc's
  check of it and aborts ("prterun: tpp.c:83: __pthread_tpp_change_priority: Assertion `...' failed.", exit
  250), its ranks already ended and reaped (rarer than the stall, in jobs with a dead rank on a loaded
  machine). The launcher exits with the status told from those the ranks kept (as after a stall), with a note.

And a **lost host**: when a whole host dies (its daemon, prted, with its ranks), Open MPI 5.0's runtime (PRRTE 3)
ends the job at once whatever `--with-ft ulfm` says: it prints that it lost a daemon, naming the host, exits 0,
and leaves its own host's ranks running, their MPI calls crashing (docs/design/node-faults.md). The launcher tells
it (lost_hosts), waits LOST_WAIT seconds for the ranks left to end (they end with their launcher: dsim.guard),
kills any still there, says which host was lost in one line and exits 1, never 0.

And **lost lines**: in a job whose spawned processes died (a repair in the job with tft.arf, the newcomer killed),
prterun now and then closes a rank's stderr (its next line fails with EPIPE) or passes on none of what it wrote
(a few jobs in a hundred of such tests; it may print libevent's "[warn] Epoll ADD(4) on fd 22 failed"). The lines
that tell how a job ended (dsim.log.tell: the last gasp, a repair given up, a rank's error) are first kept in a file
of the launcher's (TOLD, named to the ranks in their environment); after mpirun has ended, those it did not pass on
are printed, after a note (repeat_lost).

And a job must not outlive its launcher: mpirun dies with this process (ends_with), and this process stops the job
when its own caller ends (waited); the ranks end when mpirun does (dsim.guard.end_with_launcher).

Whoever runs mpirun goes through here: the tests (conftest.run_command), the benchmarks, the Makefile and
the launch scripts (`python dsim/ft/launcher.py mpirun ARGS...`, which launch/watch.sh's dsim_watched runs;
as a script it imports the standard library only: 40 ms and 13 MiB for the watch, against 0.3 s and 50 MiB
as `python -m dsim.ft.launcher`, which imports dsim first).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STALL_SECONDS = 15  # no rank running for this long, and mpirun still there: stalled
ENDED_SECONDS = 3   # the same once ranks were seen running: a healthy mpirun ends 0.05 s after its last rank
PARENT_POLL = 0.25  # seconds between looks at mpirun and at whether the launcher's caller is still there
START_TRIES = 3     # a launcher that failed to start is started again, this many launches in all
CUT_MARK = b"network cut"  # in a line a rank told (dsim.log.tell) at its end: its side met a network cut (dsim.ft.cut)
# What mpirun prints when it failed before starting any rank, for a cause that passes (not bad input)
START_FAILURES = ("The PMIx server's listener thread failed to start",)
# What prterun prints when it aborts at its end on a failed check of its own (after its ranks ended)
END_ABORT = re.compile(r"^prterun: .*Assertion .* failed\.$", re.M)
# What prterun prints when one of its daemons is gone, by which of two paths of PRRTE 3's errmgr saw it first (its help
# texts "node-died", on stderr, and "failed-daemon", on stdout), and where each names the host
LOST_DAEMON = {
    "PRTE has lost communication with a remote daemon": re.compile(r"^\s*Remote daemon:.* on node (\S+)\s*$", re.M),
    "A daemon failed to report back": re.compile(r"^\s*Remote host:\s*(\S+)\s*$", re.M)}
CUT_WAIT = 35.0   # after a network cut: seconds the ranks still below mpirun (the other side's, on a test cluster) may
                  # take to stop on their own (dsim.ft.cut: an agreement takes 30 s at most) before the job is stopped
LOST_WAIT = 10.0  # seconds the ranks left on this host after a lost host may take to end before they are killed
TOLD = "DSIM_TOLD"  # the variable naming the file where ranks keep the lines that tell how the job ended (dsim.log)
ENDED = ".ended"    # added to its name: the file where each rank keeps its exit status as it ends (dsim.log.ended)


def failed_to_start(returncode: int, output: str, ranks_ran: bool = False) -> bool:
    """Whether mpirun ended, having printed `output` (both streams), before starting any rank, for a cause worth
    another try: PMIx's listener (START_FAILURES), or a daemon lost while no rank had run (LOST_DAEMON: with ranks
    run, that is a lost host)."""
    if returncode == 0 or ranks_ran:
        return False
    return any(text in output for text in START_FAILURES) or any(text in output for text in LOST_DAEMON)


def aborted_at_end(returncode: int, stderr: str, ranks_ran: bool) -> bool:
    """Whether mpirun, whose ranks ran, ended with `stderr` by aborting on a check of its own (END_ABORT)."""
    return returncode != 0 and ranks_ran and END_ABORT.search(stderr) is not None


def lost_hosts(output: str, ranks_ran: bool) -> list[str] | None:
    """The hosts whose Open MPI daemon mpirun lost while its ranks ran, from what mpirun printed (both streams);
    [] when lost but not named; None when no daemon was lost. A daemon that fails before any rank ran is a failed
    start instead (ranks_ran False: None)."""
    said = [(text, host) for text, host in LOST_DAEMON.items() if text in output]
    if not ranks_ran or not said:
        return None
    return sorted({name for text, host in said for name in host.findall(output[output.index(text):])})


def end_left(ranks, seconds: float = LOST_WAIT) -> list[int]:
    """Wait up to `seconds` for the given ranks to end; SIGKILL those still there. Returns the ones killed."""
    deadline = time.monotonic() + seconds
    while any(alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [r for r in ranks if alive(r)]
    for r in left:
        try:
            os.kill(r, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


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


def ask_for_stacks(pid: int, wait: float = 1.5) -> list[int]:
    """Before a job that timed out is killed: every Python process below pid that prints its threads' stacks on
    SIGUSR1 (a dsim rank: guard.stacks_on_signal) is sent it, and the output given `wait` seconds to pass
    through mpirun, so that the caller's output shows where each rank was. Others are left alone: SIGUSR1 would
    end them, and mpirun, which catches it, would pass it on to every rank again. Returns the processes asked."""
    asked = []
    for p in descendants(pid):
        try:
            if not os.path.basename(os.readlink(f"/proc/{p}/exe")).startswith("python"):
                continue
            caught = int(next(line.split()[1] for line in Path(f"/proc/{p}/status").read_text().splitlines()
                              if line.startswith("SigCgt:")), 16)
            if caught >> (signal.SIGUSR1 - 1) & 1:
                os.kill(p, signal.SIGUSR1)
                asked.append(p)
        except (OSError, StopIteration, ValueError):
            continue
    if asked:
        time.sleep(wait)
    return asked


def children(pid: int, zombies: bool = False) -> list[int]:
    """The child processes of pid (of all its threads): the ranks, for mpirun.

    Zombies count only with zombies=True: a stalled launcher does not even reap the rank that was killed.
    """
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return [c for c in found if _state(c) not in ((None,) if zombies else ("Z", "X", None))]


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    return _state(pid) not in ("Z", "X", None)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command's name (the state first), [] when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _state(pid: int):
    """The one-letter state of a process (R, S, Z, ...), None when it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def wait_status(pid: int):
    """A zombie's wait status (as waitpid gives it: the exit status times 256, or the signal that killed it),
    read without reaping it; None when pid is not a zombie (alive, or reaped and gone).

    Field 52 of /proc/<pid>/stat (Linux 3.5 and later), readable by the owner of the process."""
    fields = _stat(pid)
    if len(fields) < 50 or fields[0] != "Z":
        return None
    return int(fields[49])


def ranks_status(statuses: list) -> int | None:
    """The exit status mpirun would have given, told from its ranks' wait statuses (None: not read).

    Under ULFM a rank killed by a signal is a failure the job tolerates, and mpirun ends with a status its
    ranks exited with (measured on Open MPI 5.0: 0 when the others exit 0; one of theirs when some do not).
    So: the status most ranks exited with among those that did not exit 0 (the higher on a tie); 0 when
    every rank was read, none exited other than 0 and at least one exited 0; None when it cannot be told
    (a rank reaped unread may have failed; every rank killed by a signal).
    """
    failed = sorted(s >> 8 for s in statuses if s is not None and s & 0x7F == 0 and s >> 8)
    if failed:
        return max(failed, key=lambda code: (failed.count(code), code))
    if statuses and None not in statuses and any(s == 0 for s in statuses):
        return 0
    return None


class StallWatch:
    """Feed it the time now and then while mpirun runs; it says when mpirun has stalled, and then, from the
    ranks it has seen, the status mpirun would have ended with (read before mpirun is killed: init reaps the
    zombies of a killed mpirun, and their statuses with them)."""

    def __init__(self, pid: int, seconds: float = STALL_SECONDS, ended_seconds: float | None = None,
                 told: str | None = None):
        self.pid, self.seconds, self.idle_since = pid, seconds, None
        self.ended_seconds = ENDED_SECONDS if ended_seconds is None else ended_seconds
        self.ranks: set[int] = set()  # every rank seen running
        self.ranks_status = None      # after a stall, supervise() sets it from status()
        self.told = told              # the ranks' told lines (TOLD): one saying a network cut was met (cut)
        self.cut = False

    def stalled(self, now: float) -> bool:
        running = children(self.pid)
        if not self.cut and self.told is not None:
            try:
                self.cut = CUT_MARK in Path(self.told).read_bytes()
            except OSError:
                pass
        if self.cut:  # the daemons across a cut never end: only this host's ranks are waited for
            running = [c for c in running if is_rank(c)]
        self.ranks.update(running)
        if running:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        limit = min(self.seconds, self.ended_seconds) if self.ranks else self.seconds
        return self.idle_since is not None and now - self.idle_since > limit

    def status(self) -> int | None:
        """ranks_status of every rank seen running and of every zombie left (a rank may end unseen). A rank mpirun has
        reaped (a stall after its ranks ended, an abort at its end) has its status from the file where it kept it
        as it ended (ENDED: dsim.log.ended), a process that did not keep one (killed) none."""
        kept = ended_statuses(self.told)
        return ranks_status([kept.get(pid) if (status := wait_status(pid)) is None else status
                             for pid in self.ranks | set(children(self.pid, zombies=True))])


def ended_statuses(told: str | None) -> dict[int, int]:
    """pid -> wait status (the exit status times 256) of each process that kept its status as it ended, in the file
    beside `told` (ENDED); a torn or foreign line is skipped."""
    out = {}
    try:
        lines = Path(str(told) + ENDED).read_text().splitlines() if told is not None else []
    except OSError:
        return out
    for line in lines:
        pid, _, code = line.partition(" ")
        if pid.isdigit() and code.isdigit():
            out[int(pid)] = int(code) << 8
    return out


def supervise(proc, timeout: float, wait=None, stalls: bool = True, stall_seconds: float = STALL_SECONDS,
              group: bool = True, watch: StallWatch | None = None) -> str:
    """Wait for proc (mpirun, or a launch script that runs it) to end.

    Returns "ended"; or, with proc and every process below it (every rank) SIGKILLed, and its process group
    with group=True (proc started with start_new_session=True), "stalled" when every rank had ended and
    mpirun stayed (stalls=True; after a network cut, this host's ranks, and the ranks still below mpirun are given
    CUT_WAIT seconds first: across_cut), "timeout" past `timeout` seconds (the ranks asked for their stacks first:
    ask_for_stacks). wait() waits a second at most and raises
    subprocess.TimeoutExpired when proc has not ended (by default proc.wait; proc.communicate to collect
    pipes); the caller reaps proc after a kill. A watch given (stalls=True) is the one used: after a stall
    its `ranks_status` holds the status told from the ranks (StallWatch.status), read before the kill.
    """
    wait = wait or (lambda: proc.wait(timeout=1))
    watch = (watch or StallWatch(proc.pid, stall_seconds)) if stalls else None
    start = time.time()
    while True:
        try:
            wait()
            return "ended"
        except subprocess.TimeoutExpired:
            now = time.time()
            why = "stalled" if watch is not None and watch.stalled(now) else "timeout" if now - start > timeout else None
            if why is not None:
                if why == "stalled":
                    watch.ranks_status = watch.status()
                    if watch.cut:
                        across_cut(proc.pid)
                else:  # hung: where was each rank? (their stacks on stderr, then killed)
                    ask_for_stacks(proc.pid)
                kill_tree(proc.pid, group)
                return why


def across_cut(pid: int, seconds: float = CUT_WAIT) -> None:
    """After a network cut, before mpirun (pid) is stopped: the ranks still running below it are given `seconds` to
    stop on their own. Over ssh there are none: the other side's ranks run on their hosts, which mpirun's stop does
    not reach. On the test cluster (dsim.cluster) they are processes below mpirun's agents, which its stop would kill:
    a side without the quorum would then end before it had found the cut and said so (its cut_off event). A rank
    stopped (SIGSTOP: a host gone silent is one) is not waited for."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_state(p) not in ("T", "t", "Z", "X", None) and is_rank(p)
                                              for p in descendants(pid)):
        time.sleep(0.2)


def notice_ranks(pid: int) -> bool:
    """SIGTERM to mpirun's (pid's) ranks on this node, not to mpirun: Open MPI's launcher kills its ranks at once on a
    SIGTERM, while a rank with checkpoint.save_on_signal takes it as a scheduler's notice (dsim.ft.preemption): every
    rank, on every node, then stops after the same step, saved (a rank without it ends, as on mpirun's kill).
    Whether there was a rank to tell.

    Only processes of the job (is_rank): on a job over several hosts mpirun's other children start the daemons of
    the other hosts (ssh, or a test cluster's agent); a SIGTERM ends them, and mpirun then takes those daemons for
    failed and ends the job unsaved. The other hosts' ranks learn of the notice from these (dsim.ft.preemption)."""
    ranks = [child for child in children(pid) if is_rank(child)]
    for rank in ranks:
        try:
            os.kill(rank, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return bool(ranks)


RESCUE_NAME = b"dsim-rescue"  # the process name of a rank's rescue writer (dsim.ft.rescue)


def rescue_writers() -> list[int]:
    """The rescue writers on this host (dsim.ft.rescue: forked by ranks at a failure, in sessions of their own): after
    a lost host the launcher waits for them too, so that a resume started when it returns finds their files whole."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_bytes().strip() == RESCUE_NAME:
                out.append(int(d.name))
        except OSError:
            pass
    return out


def is_rank(pid: int) -> bool:
    """Whether a child of mpirun is a process of the job (Open MPI gave it a PMIx rank), not one that starts a
    daemon on another host; True when its environment cannot be read."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return True
    return environ.startswith(b"PMIX_RANK=") or b"\0PMIX_RANK=" in environ


def ends_with(parent: int):
    """For Popen's preexec_fn: the child (mpirun) is SIGKILLed when `parent` (this launcher) ends, however it ends
    (Linux's PR_SET_PDEATHSIG; mpirun's ranks then end too: dsim.guard.end_with_launcher). Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        prctl = ctypes.CDLL(None).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None

    def arm():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher ended before the call
            os._exit(1)
    return arm


def run(cmd: list[str], timeout: float | None = None, tries: int = START_TRIES) -> int:
    """Run mpirun (cmd) as a user's command: output passed through, a stall stopped, a failed start tried
    again. Returns its exit status: after a stall, the one told from the ranks (ranks_status; 1 when it
    cannot be told); 124 after the timeout, as timeout(1) does.

    mpirun stays in the caller's process group, so whoever stops the caller's group (a test's timeout, a
    terminal's Ctrl-C) stops it too. A job never outlives its launcher: mpirun is killed when this process ends
    however it ends (ends_with), and this process stops mpirun and its ranks when its own caller ends (a launch
    script killed): within PARENT_POLL seconds, the ranks within dsim.guard.LAUNCHER_POLL after mpirun.
    Sent to this process alone: SIGINT is passed to mpirun as SIGTERM (stop now);
    SIGTERM, a scheduler's notice before its SIGKILL, to the ranks themselves (notice_ranks), and a second one to
    mpirun; SIGUSR1 and SIGUSR2 to mpirun as they are, which passes them on to every rank.
    """
    caller = os.getppid()
    told = tempfile.NamedTemporaryFile(prefix="dsim-told-", suffix=".txt", delete=False)
    told.close()
    try:
        return _run(cmd, timeout, tries, caller, told.name)
    finally:
        os.unlink(told.name)
        Path(told.name + ENDED).unlink(missing_ok=True)


def _run(cmd: list[str], timeout: float | None, tries: int, caller: int, told: str) -> int:
    for attempt in range(1, tries + 1):
        Path(told).write_bytes(b"")
        Path(told + ENDED).write_bytes(b"")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=ends_with(os.getpid()),
                                env={**os.environ, TOLD: told})
        head = bytearray()  # the first of what it printed on stderr: a failed start says so at once
        tail = bytearray()  # and the last: an abort at its end says so last
        out_tail = bytearray()  # the last on stdout: a lost daemon's message (lost_hosts)
        passed = set()  # the lines of dsim's it passed on on stderr (from "dsim: " on: with --output tag too)

        def relay(pipe, to, tail, head=None, passed=None):
            line = bytearray()
            for chunk in iter(lambda: pipe.read1(65536), b""):
                to.write(chunk)
                to.flush()
                if head is not None and len(head) < 65536:
                    head.extend(chunk)
                tail.extend(chunk)
                del tail[:-4096]
                if passed is not None:
                    *ended, rest = bytes(line + chunk).split(b"\n")
                    passed.update(x[x.find(b"dsim: "):] for x in ended if b"dsim: " in x)  # tagged too
                    line[:] = rest[-65536:]
        relayed = [threading.Thread(target=relay, args=args, daemon=True) for args in
                   ((proc.stderr, sys.stderr.buffer, tail, head, passed), (proc.stdout, sys.stdout.buffer, out_tail))]
        for thread in relayed:
            thread.start()
        # SIGINT as SIGTERM (started in the background of a script, mpirun ignores SIGINT); SIGTERM to the ranks
        # once; SIGUSR1 (stacks) and SIGUSR2 (stop and save) as they came, which mpirun passes to every rank
        stop = lambda signum, frame: proc.send_signal(signal.SIGTERM)  # noqa: E731
        noticed = []

        def notice(signum, frame):
            if noticed or not notice_ranks(proc.pid):
                stop(signum, frame)
            noticed.append(signum)
        old = {signal.SIGINT: signal.signal(signal.SIGINT, stop), signal.SIGTERM: signal.signal(signal.SIGTERM, notice)}
        old.update({s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
                    for s in (signal.SIGUSR1, signal.SIGUSR2)})
        watch = StallWatch(proc.pid, STALL_SECONDS, told=told)
        try:
            # ranks looked for 4 times a second: one that ends within a second of starting (a job every rank
            # refuses) is seen too, so a stall after it is stopped ENDED_SECONDS later, not STALL_SECONDS
            how = supervise(proc, float("inf") if timeout is None else timeout, wait=lambda: waited(proc, caller),
                            group=False, watch=watch)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        proc.wait()
        left = [r for r in watch.ranks if alive(r)]  # a rank outliving mpirun: its job was ended under it
        for thread in relayed:
            thread.join(timeout=5)
        repeat_lost(told, passed)
        lost = lost_hosts(out_tail.decode(errors="replace") + tail.decode(errors="replace"), bool(watch.ranks))
        if how == "ended" and lost is not None:
            return host_lost(lost, left, proc.returncode, after_line=tail.endswith(b"\n") or not tail)
        if how == "ended" and aborted_at_end(proc.returncode, tail.decode(errors="replace"), bool(watch.ranks)):
            how = "aborted"  # prterun had reaped its ranks: their statuses are those they kept (ENDED)
            watch.ranks_status = watch.status()
        if how in ("stalled", "aborted"):
            status = 1 if watch.ranks_status is None else watch.ranks_status
            told = "the ranks' own" if watch.ranks_status is not None else "the ranks' status unknown, so 1"
            what = ("this host's ranks have ended after a network cut, and mpirun waits for daemons it cannot reach; "
                    "stopped it" if how == "stalled" and watch.cut else
                    "every rank has ended but mpirun has not (an Open MPI launcher stall); stopped it" if how == "stalled"
                    else f"mpirun aborted after its ranks had run (an Open MPI launcher fault, its exit status "
                         f"{proc.returncode} not the ranks')")
            print(f"dsim: note: {what}, exit status {status} ({told})", file=sys.stderr)
            return status
        if how == "timeout":
            print(f"dsim: error: mpirun still running after {timeout:g} s; stopped it", file=sys.stderr)
            return 124
        if os.getppid() != caller:
            return 128 + signal.SIGKILL  # stopped with its caller (waited): nobody reads the status
        said = head.decode(errors="replace") + out_tail.decode(errors="replace")
        if not failed_to_start(proc.returncode, said, bool(watch.ranks)) or attempt == tries:
            return proc.returncode
        print(f"dsim: note: mpirun failed to start (an Open MPI launcher fault, no rank ran); starting it again "
              f"({attempt + 1} of {tries})", file=sys.stderr)
        time.sleep(1)
    raise AssertionError("unreachable")


def repeat_lost(told: str, passed: set) -> None:
    """Print the lines the ranks told (dsim.log.tell, kept in the file `told`) that mpirun did not pass on (`passed`
    holds those it did), after a note saying so."""
    try:
        lost = [line for line in Path(told).read_bytes().splitlines() if line not in passed]
    except OSError:
        return
    if lost:
        print("dsim: note: mpirun did not pass on the last of the ranks' stderr (an Open MPI launcher fault); "
              "what they told of the job's end:", file=sys.stderr, flush=True)
        sys.stderr.buffer.write(b"".join(line + b"\n" for line in dict.fromkeys(lost)))
        sys.stderr.flush()


def host_lost(hosts: list[str], left: list[int], returncode: int, after_line: bool = True) -> int:
    """After mpirun ended the job on a lost daemon: the ranks it left on this host are given LOST_WAIT seconds to end
    (dsim.guard ends them with their launcher), then killed; one line says what happened. Returns mpirun's status,
    or 1 where it gave 0 (PRRTE 3 exits 0 then: a job that did not finish must not look finished). after_line
    False: what mpirun printed last on stderr did not end its line (its message ends in a NUL): a new line first."""
    ranks = [r for r in left if is_rank(r)]  # (not the connection to a lost host: ssh, an agent)
    killed = [r for r in end_left(left) if r in ranks]
    end_left(rescue_writers())  # forked by the ranks before they ended: their files whole before this returns
    status = returncode or 1
    named = ", ".join(hosts) if hosts else "a host (unnamed)"
    ended = f"; {len(killed)} rank(s) it left running killed after {LOST_WAIT:g} s" if killed else ""
    print(("" if after_line else "\n") + f"dsim: error: host {named} lost: Open MPI's daemon there is gone with its "
          f"ranks, and mpirun ended the job (Open MPI 5.0 does not run through a lost host){ended}; no last gasp was "
          f"agreed; resume (--resume auto) on the hosts left: from the survivors' rescue files when they hold every "
          f"slice, else from the last committed checkpoint (docs/cluster.md: a host lost); exit status {status}",
          file=sys.stderr, flush=True)
    return status


def waited(proc, caller: int) -> None:
    """proc.wait for PARENT_POLL seconds; when the launcher's caller (a launch script) has ended meanwhile, mpirun and
    every process below it are killed first: a job whose launch script was killed is not left running."""
    if os.getppid() != caller:
        try:
            print(f"dsim: error: the launcher's caller (pid {caller}) is gone; stopping mpirun and its ranks",
                  file=sys.stderr, flush=True)
        except OSError:
            pass  # its stderr went with the caller
        kill_tree(proc.pid, group=False)
    proc.wait(timeout=PARENT_POLL)


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
