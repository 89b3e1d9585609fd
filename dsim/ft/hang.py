"""A frozen or stuck rank made a dead one: the hang watch (`tft.hang_timeout: S`).

A rank that stops running (SIGSTOP, a process stuck in the kernel on a dead device or file system, a
deadlock inside the interpreter) is neither dead nor alive to MPI: nothing fails, and the other ranks wait
for it in their next collective forever. So is a rank whose process runs but whose training does not (its
main thread in a deadlock, a read that never returns, a loop that never ends). NCCL's and HCCL's timeouts
(HCCL_EXEC_TIMEOUT) end the whole job then; dsim instead finds that process and kills it, so that what
follows is what follows a death: the last gasp, the repair in the job, or the end of the job and a restart.

Each training process writes a heartbeat from a thread every HEARTBEAT seconds to
<output.dir>/heartbeats/<pid>: its rank, the world size, the step it is in, its start time, the time, and
where its main thread is (dsim.parallel.progress): for how long it has worked (its step's computation, the
loading of its batch, the callbacks between steps, a checkpoint's save, the replicas' comparison, a last gasp, a
repair) outside every collective with no sign of progress (a layer, a parameter's update, a tensor written or
read, a collective entered or left), or null (outside all that work, or waiting in a collective). When this
rank's work (a step's computation, a save) has gone on for more than the
timeout, its watch reads the others' heartbeats and kills (SIGKILL) a process of the same world, still that
process (pid and start time):
- frozen: its heartbeat is older than the timeout (its threads are frozen with it; a process blocked in a
  collective, or busy saving, keeps beating: MPI calls and file writes release the interpreter);
- stuck: it beats, but has made no progress outside every collective for more than the timeout, inside
  its step's computation, a save (a write that never returns), a data loader or a callback, while this rank
  waits (every rank waiting for it is inside a collective). With async_save, a background write that stops
  holds its rank's next update or save, which then makes no progress: stuck too.
Every rank's watch may see it; one, the first to claim it, reports it (a `hang` event and a line). When
nobody is frozen or stuck (a slow step, or every rank inside a collective, or one stuck outside all work
watched), the job waits, as MPI does, and the watch says so once the work has gone on for twice the timeout
(looking again at every heartbeat: a rank stuck later in the step is found). One case is no wait for a rank:
a deadlock, every process of the job waiting (a collective, a receive) with no sign of progress on any,
none frozen: collectives that do not match, a receive nobody sends to. Past tft.deadlock_timeout (10 times
the hang timeout unless set), the first watch to see it breaks it: every process prints its stacks (SIGUSR1);
then, under ULFM, the watch revokes its rank's communicators (MPI_Comm_revoke, from its thread: mpi4py runs
MPI_THREAD_MULTIPLE), which ends every wait on the job's communicators with an error on every rank, as after a
death; a process still in a wait begun before (a receive elsewhere) is killed, as a failed rank. What follows
is what follows a death: the repair in the job, or the last gasp (of every rank when none was killed) and a
restart one step back, not at the last periodic checkpoint. Without ULFM, or when the same job deadlocks again
before it recovered, the watch ends the job as NCCL's watchdog does: all processes stopped and killed, exit 1,
a restart resumes from the last checkpoint.
So the timeout must be longer
than any one layer, tensor write, file's fsync, batch's loading or callback (between its own collectives,
which a callback of dsim marks as waits) takes.
The heartbeat also carries how long the rank computes a step outside waits: with tft.straggler_factor, rank
0's watch finds a rank computing much slower than the others (dsim.ft.straggler; the watch runs for it alone
when tft.hang_timeout is off).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from ..engine.callbacks import Callback
from ..log import event, leave as exit_now, say
from ..faults import same_process, started
from ..parallel.layout import ParallelLayout
from ..runtime import PROCESS
from .orders import HOST, ORDER, file_name, here, obey, order, running, send, unseen
from .straggler import StragglerJudge, egress_held

HEARTBEAT = 0.5  # seconds between two heartbeats
DEADLOCK_FACTOR = 10  # tft.deadlock_timeout's default, times tft.hang_timeout
BREAK_WAIT = 10.0  # seconds a deadlock's break waits for every process to beat after its revoke
# seconds after its own watch revoked its rank's communicators that a process still in its old wait is taken to be
# waiting elsewhere: a second was too short once in a loaded run of the tests (ranks the revoke had freed killed)
SETTLE = 3.0
UNSEEN_AFTER = 4  # beats into a job (2 s) before rank 0 looks whether it sees every rank's heartbeat (_say_unseen)
ALIVE = "deadlock-broken-alive"  # a job went on in place after a break with every rank alive: the next is ended
RECORD = 512     # bytes of a heartbeat record (JSON, space-padded): one positioned write
WORK = {"step": "step", "data loading": "data loading", "callback": "callback", "save": "save",
        "comparison": "comparison of replicas", "evaluation": "evaluation", "last gasp": "last-gasp save",
        "repair": "repair in the job"}  # the work watched (progress.watched) in the watch's lines


class HangWatch(Callback):
    """The heartbeat of this training process and the watch over the others' (see the module doc)."""

    def __init__(self, timeout: Optional[float], directory, straggler_factor: Optional[float] = None,
                 straggler_evict: bool = False, deadlock_timeout: Optional[float] = None, runtime=PROCESS):
        self.timeout = None if timeout is None else float(timeout)  # None: no hang judged (stragglers only)
        self.deadlock = (float(deadlock_timeout) if deadlock_timeout else DEADLOCK_FACTOR * self.timeout
                         if self.timeout else None)  # seconds every rank may wait, none progressing
        self.dir = Path(directory) / "heartbeats"  # (stop_frozen_spares reads the same)
        self.stragglers = StragglerJudge(straggler_factor, straggler_evict) if straggler_factor else None
        self.runtime = runtime  # the process it beats for (dsim.runtime): its progress marks, read from the thread
        self.rank = self.world_size = self.stage_size = None
        self.model = None  # the Model trained (its groups: the communicators a deadlock's break revokes)
        self.role = None  # without a rank (standby_heartbeat): "spare" or "newcomer"
        self.step = 0
        self.said = None  # the work watched (progress.began) whose stall was reported already
        self._broken = None  # the mark of the deadlock's break this watch revoked its rank's communicators for
        self._revoked_at = None  # when (time.time(); in the heartbeat: the break waits for every watch's)
        self._stop = threading.Event()
        self._thread = self._fd = None

    # -- callbacks ----------------------------------------------------------------------------------------
    def begin(self, run_context):
        cb = run_context.original_args()
        self.model = getattr(cb, "model", None)
        self.start(cb.rank, cb.world_size, _stage_size(cb))

    def start(self, rank, world_size: int, stage_size: int) -> None:
        """Beat (and watch) as `rank` of a world of `world_size`; rank None: not training yet (standby_heartbeat).
        A training rank's heartbeat replaces this process's standby one."""
        runtime = self.runtime
        if rank is not None and runtime.standby is not None:
            runtime.standby.end()
        self.rank, self.world_size, self.stage_size = rank, world_size, stage_size
        self.dir.mkdir(parents=True, exist_ok=True)
        forget_the_dead(self.dir, starting=True, marks=self.rank == 0)  # (each rank its host's dead)
        self._fd = os.open(self.dir / file_name(os.getpid()), os.O_CREAT | os.O_WRONLY, 0o644)
        self._started = started(os.getpid())
        self._beat(time.time())
        self._thread = threading.Thread(target=self._run, name="dsim-hang-watch", daemon=True)
        self._thread.start()
        if rank is not None:
            runtime.hang = self
        else:
            runtime.standby = self

    def recovered(self, run_context):
        """After a repair in the job or an elastic shrink: this process's rank and world now; between steps. Each rank
        forgets the heartbeats of its host's processes that died (they would stay until the next job otherwise)."""
        cb = run_context.original_args()
        self.rank, self.world_size, self.stage_size = cb.rank, cb.world_size, _stage_size(cb)
        forget_the_dead(self.dir, marks=self.rank == 0)

    def step_begin(self, run_context):
        self.step = run_context.original_args().cur_step_num + 1

    def end(self, run_context=None):
        runtime = self.runtime
        if runtime.hang is self:
            runtime.hang = None
        if runtime.standby is self:
            runtime.standby = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            (self.dir / file_name(os.getpid())).unlink(missing_ok=True)
            self._fd = None

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self):
        warned, beats = False, 0
        while not self._stop.wait(HEARTBEAT):
            try:
                self._join_break()  # (before the beat: the beat then says whether it revoked)
                now = time.time()
                self._beat(now)
                obey(self.dir)  # what another host's watch asked of this host's processes
                began = self.runtime.progress.began  # (read once: the work may end meanwhile)
                if self.timeout and began is not None and time.monotonic() - began > self.timeout:
                    self._judge(now, began)
                self._look_for_a_cut()
                if self.stragglers is not None and self.rank == 0:
                    live = [r for r in heartbeats(self.dir)
                            if now - r.get("time", 0) < 4 * HEARTBEAT and running(r, now)]
                    self.stragglers.look(live, self.world_size, self.stage_size, lambda pid, started: True,
                                         lambda r: _kill(self.dir, r), self._hosts())
                beats += 1
                if beats == UNSEEN_AFTER and self.rank == 0:
                    self._say_unseen()
            except Exception as e:  # the thread must go on: without its heartbeat this process looks frozen
                if not warned:
                    say(f"dsim: warning: hang watch: rank {self.rank}: {type(e).__name__}: {e}")
                    warned = True

    def _look_for_a_cut(self) -> None:
        """Over several hosts: while this rank has waited in a collective longer than the timeout, whether another host
        still answers (dsim.ft.cut: a host that does not is cut off, and this rank's communicators are revoked)."""
        links, waited = self.runtime.links, self.runtime.progress.waiting_for(time.monotonic())
        if links is not None and self.timeout and waited is not None and waited > self.timeout and self.model:
            links.look(self.model.groups, self.runtime, waited)
            self._beat(time.time())  # (a probe may take a second)

    def _beat(self, now: float) -> None:
        mono, progress = time.monotonic(), self.runtime.progress
        stalled, waiting, work = progress.stalled_for(mono), progress.waiting_for(mono), progress.work
        step_time, timed = progress.step_time()
        record = json.dumps({"pid": os.getpid(), "started": self._started, "rank": self.rank,
                             "world_size": self.world_size, "step": self.step, "time": now,
                             "stalled": None if stalled is None else round(stalled, 3),
                             "waiting": None if waiting is None else round(waiting, 1), "work": work,
                             "step_time": None if step_time is None else round(step_time, 5), "timed": timed,
                             "revoked": self._revoked_at, "host": HOST,
                             **({"link": egress_held()} if self.stragglers is not None else {}),  # (straggler.py)
                             **({"role": self.role} if self.rank is None else {})})
        os.pwrite(self._fd, record.encode().ljust(RECORD), 0)

    def _hosts(self):
        """Each rank's host in the world training now (as MPI found them), for the straggler watch; None if unknown."""
        hosts = getattr(getattr(self.model, "groups", None), "hosts", None)
        names = getattr(hosts, "names", None)
        return list(names) if names is not None and len(names) == self.world_size else None

    def _say_unseen(self) -> None:
        """A few beats into the job, rank 0 looks whether it sees every rank's heartbeat: on hosts whose output
        directory is node-local it does not, and says once what the watches cannot do then (dsim.ft.orders)."""
        hosts = self._hosts()
        missing = unseen(heartbeats(self.dir), self.world_size)
        if missing is None or not hosts or len(set(hosts)) < 2:
            return
        event("heartbeats_unseen", missing=missing, world_size=self.world_size, directory=str(self.dir))
        say(f"dsim: warning: hang watch: rank 0 sees no heartbeat of {missing} of the {self.world_size} ranks in "
            f"{self.dir} (not shared by the job's hosts): a frozen or stuck rank is found by the ranks of its own host "
            "only; a deadlock, a straggler or a rank alone on its host is not (put output.dir on a file system every "
            "host shares: docs/cluster.md)")

    def _judge(self, now: float, began: float) -> None:
        """This rank's work watched (a step's computation or a save), begun at `began` (progress.began), has
        gone on past the timeout: kill the frozen and the stuck processes of its world, if any."""
        since = now - (time.monotonic() - began)  # its time.time()
        frozen, stuck = find_hung(self.dir, self.world_size, now, self.timeout)
        if not frozen and not stuck and killed_since(self.dir, since, 2 * self.timeout):
            return  # another rank's watch found it first: its death is on its way here
        if not frozen and not stuck and self.deadlock:
            world = [r for r in heartbeats(self.dir) if r.get("world_size") == self.world_size and running(r, now)]
            waited = deadlocked(world, now, self.deadlock)
            if waited is not None:
                return self._end_deadlock(world, waited)
        if not frozen and not stuck:
            if self.said == began or now - since <= 2 * self.timeout:
                return  # looked again at every heartbeat (a stuck rank's stall grows); said once, later
            self.said = began
            if not first(self.dir, f"said-{self.step}"):
                return  # another rank's watch said it for this step (one line, not one a rank)
            doing = self.runtime.progress.work
            work = f"the {WORK[doing]} of " if doing in WORK and doing != "step" else ""
            say(f"dsim: hang watch: rank {self.rank}: {work}step {self.step} has gone on for {now - since:.0f} s; "
                "no rank's process is frozen or stuck outside a collective (slow, or stuck elsewhere): waiting"
                + (f" (all waiting for {self.deadlock:g} s: a deadlock, "
                   f"{'which is broken' if self._can_break() else 'the job is ended'})" if self.deadlock else ""))
            return
        for record in frozen + stuck:
            if _kill(self.dir, record):  # the first watch to kill it reports it
                self._report(record, now, "stuck" if record in stuck else "frozen")

    def _end_deadlock(self, world: list, waited: float) -> None:
        """Every process of this world waits, none progressing (deadlocked): the first watch to see it says so and
        has each process print its stacks (SIGUSR1: guard.stacks_on_signal), then breaks it (_break). Without ULFM,
        or when a break of this job's deadlock was tried already and it deadlocked again before it recovered, it
        ends the job instead, as NCCL's watchdog does: it stops and kills the others and exits 1 (under ULFM a rank
        killed by a signal is a failure the job tolerates: killed all, mpirun would exit 0); a restart resumes
        from the last checkpoint."""
        job = max(r.get("started") or 0 for r in world)
        breaking = self._can_break()
        if breaking and not first(self.dir, f"breaking-deadlock-{job}"):
            try:  # the break's mark, made once the stacks are printed
                if (self.dir / f"killed-deadlock-{job}").stat().st_mtime > time.time() - waited:
                    return  # made since these waits began: this deadlock is being broken
            except OSError:
                return  # another watch breaks it, its stacks first
            breaking = False  # broken before, and every rank waits again, none recovered: the job is ended
        if not breaking and not first(self.dir, f"ended-deadlock-{job}"):
            return  # another watch ends it
        ranks = sorted(r["rank"] for r in world if r["rank"] is not None)
        event("deadlock", any_rank=True, ranks=ranks, waited=round(waited, 1), timeout=self.deadlock,
              global_step=self.step, by=self.rank, broken=breaking)
        say(f"dsim: hang watch: every process of the job has waited {waited:.0f} s or more in a collective or a "
            f"receive, none frozen, none computing: a deadlock (step {self.step}, tft.deadlock_timeout "
            f"{self.deadlock:g} s); each prints its stacks (SIGUSR1), then "
            + ("the job's communicators are revoked: every rank goes on as after a failure" if breaking else
               "the job is ended (exit status 1): resume from the last checkpoint"))
        others = [r for r in world if not _mine(r)]
        _signal(self.dir, [r for r in others if r.get("role") != "spare"], signal.SIGUSR1)  # (idle spares': nothing)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1.0)  # a second to print them
        if breaking:
            broke_at = time.time()
            claim(self.dir, {"pid": "deadlock", "started": job})  # the mark: every watch joins the break (_join_break)
            return self._break(world, broke_at)
        self._end_job(others)

    def _end_job(self, others: list) -> None:
        """Stop and kill the other processes of the job, then exit 1. (Another host's are killed by order, not
        stopped first: a process stopped by its own order could carry out no other.)"""
        _signal(self.dir, [r for r in others if here(r)], signal.SIGSTOP)  # then none moves: nobody begins a last
        # gasp as the others die
        for r in others:
            _kill(self.dir, r)
        exit_now(1)

    def _can_break(self) -> bool:
        """Whether a deadlock would be broken (under ULFM, training) rather than end the job: not when this job
        went on in place after a break that left every rank alive (went_on_alive): the same one may come again."""
        from . import ulfm
        return (getattr(self.model, "groups", None) is not None and ulfm.unavailable_reason() is None
                and not (self.dir / ALIVE).exists())

    def _join_break(self) -> None:
        """Every watch whose rank has waited long (half the deadlock timeout) looks for a deadlock's break (its
        mark): then it revokes its rank's communicators once. Each rank's, since a revoke reaches only the ranks
        waiting on the communicator revoked, and a rank may wait on one whose other members all wait elsewhere
        (a data-parallel pair whose peer waits for nothing)."""
        waited = self.runtime.progress.waiting_for(time.monotonic())
        if waited is None or not self.deadlock or waited < self.deadlock / 2 or self.model is None:
            return
        mark = next(iter(self.dir.glob("killed-deadlock-*")), None)
        if mark is not None and mark.name != self._broken:
            from . import ulfm
            ulfm.revoke_all(self.model.groups)
            self._broken, self._revoked_at = mark.name, time.time()

    def _break(self, world: list, t: float) -> None:
        """Revoke this rank's communicators (the world and its groups): every rank waiting on one of the job's
        communicators gets an error there, as after a death, and every watch revokes its own rank's (_join_break:
        a revoke reaches only those waiting on the communicator revoked). Then, once every process has beaten
        since, kill (as failed ranks) those still in a wait they began before the revoke: waiting elsewhere (a
        receive on another communicator), nothing but their death ends it. `t`: when the break was marked (the
        other watches may have revoked theirs since, as this one slept)."""
        self._join_break()
        pids = {_key(r) for r in world if r.get("role") != "spare"}
        beats = {}
        while time.time() < t + BREAK_WAIT:
            time.sleep(HEARTBEAT / 2)
            self._beat(time.time())  # (this thread beats for its process)
            obey(self.dir)
            beats = {_key(r): r for r in heartbeats(self.dir) if _key(r) in pids and settled(r, t)}
            if len(beats) == len(pids):
                break
        still = sorted(still_waiting(list(beats.values()), t), key=_mine)  # (self last)
        if len(beats) == len(pids) and len(still) == len(pids):  # the revoke freed nobody: no one to tell apart
            say("dsim: hang watch: every process still waits after the revoke (on communicators it did not reach): "
                "the job is ended (exit status 1): resume from the last checkpoint")
            event("deadlock", any_rank=True, ranks=sorted(r["rank"] for r in world if r["rank"] is not None),
                  timeout=self.deadlock, global_step=self.step, by=self.rank, broken=False)
            return self._end_job([r for r in world if not _mine(r)])
        for record in still:
            mine = _mine(record)  # (its own process: said first, as nothing follows its kill)
            if mine or _kill(self.dir, record):
                event("hang", any_rank=True, rank=record["rank"], how="deadlocked", global_step=self.step,
                      by=self.rank, timeout=self.deadlock, waiting=record["waiting"], revoked=record.get("revoked"),
                      beat=record["time"], broken_at=t)
                say(f"dsim: hang watch: {_who(record)} still waits after the revoke (not on the job's "
                    "communicators): killed (SIGKILL)" + (", as a failed rank" if record["rank"] is not None else ""))
            if mine:
                _kill(self.dir, record)

    def _report(self, record: dict, now: float, how: str) -> None:
        if how == "frozen":
            ago = now - record["time"]
            what = f"has not run for {ago:.1f} s"
        else:
            ago = record["stalled"] + now - record["time"]
            work = WORK.get(record.get("work"), "step")
            what = f"is stuck: its process runs, its {work} has made no progress outside a collective for {ago:.1f} s"
        # a stuck rank's own step (it may be a step behind the others); a frozen one's last beat may be steps old, and
        # a newcomer (no rank) has trained no step yet
        step = record["step"] if how == "stuck" and record["rank"] is not None else self.step
        event("hang", any_rank=True, rank=record["rank"], how=how, frozen_for=round(ago, 3), global_step=step,
              by=self.rank, timeout=self.timeout, host=record.get("host", HOST), ordered=not here(record),
              **({"work": record.get("work")} if how == "stuck" else {}))
        say(f"dsim: hang watch: {_who(record)} {what} (step {step}, timeout {self.timeout:g} s): killed (SIGKILL)"
            + (", as a failed rank" if record["rank"] is not None else ""))


def deadlocked(world: list, now: float, timeout: float) -> Optional[float]:
    """How long (seconds, the least of them) every process of a world, from its heartbeat records (living
    processes of one world size, spares left out), has waited with no sign of progress, when that is more than
    `timeout` for each, and at least two ranks train; else None. A wait that ends (a collective completes, a
    step begins) is progress: ranks that wait in turn for a slow one never all wait that long at once."""
    members = [r for r in world if r.get("role") != "spare"]
    if sum(r.get("rank") is not None for r in members) < 2:
        return None
    sizes = {r.get("world_size") for r in members}
    if len(sizes) == 1 and unseen(members, sizes.pop()) is not None:
        return None  # a rank unseen (another host's, with a node-local directory): nobody can tell it waits too
    waits = [r.get("waiting") for r in members]
    if any(w is None for w in waits):
        return None
    waited = min(w + now - r["time"] for w, r in zip(waits, members))
    return waited if waited > timeout else None


def broke_deadlock(noticed_at: float, runtime=PROCESS) -> bool:
    """Whether a watch of this job (any rank's) broke a deadlock that explains a failure this process noticed at
    `noticed_at` (time.time()): its mark made before, at most 2 BREAK_WAIT (the longest a break takes to free or
    kill every waiting rank, and then some). The failure handling then saves a last gasp even if every rank is
    alive (dsim.ft.last_gasp). An MPI error of another kind, later in the same job, is not the break's (rank 0
    removes the mark at the start of a job and after a repair in the job). `runtime`: the process's, whose hang
    watch's directory holds the marks."""
    if runtime.hang is None:
        return False
    for mark in runtime.hang.dir.glob("killed-deadlock-*"):
        try:
            made = mark.stat().st_mtime
        except OSError:
            continue
        if noticed_at - 2 * BREAK_WAIT <= made <= noticed_at + 1:  # (+1: file times are coarse on some systems)
            return True
    return False


def _wait_began(record: dict) -> Optional[float]:
    """When the wait a heartbeat record shows began (time.time(); its beat's time less the wait, rounded to 0.1 s
    in the record); None: not waiting."""
    return None if record.get("waiting") is None else record["time"] - record["waiting"]


def settled(record: dict, revoked_at: float) -> bool:
    """Whether a heartbeat tells how its process came out of a deadlock's break begun at `revoked_at`: beaten a
    second after it, and either out of the wait it was in then (a wait on the job's communicators ends with a
    revoke of them, and the next, the shrink, begins after), or SETTLE seconds after its own watch revoked its
    rank's communicators (its `revoked`: a rank whose wait is on them only then learns)."""
    if record["time"] < revoked_at + 1.0:
        return False
    began = _wait_began(record)
    out_of_it = began is None or began > revoked_at - 0.25
    revoked = record.get("revoked")
    return out_of_it or (revoked is not None and revoked >= revoked_at - BREAK_WAIT and record["time"] > revoked + SETTLE)


def went_on_alive(runtime=PROCESS) -> None:
    """A repair in the job went on after a deadlock's break with every rank alive (dsim.ft.inprocess): mark it, so
    that a deadlock of this job again ends it (a deterministic one would be broken and repaired for ever)."""
    if runtime.hang is not None:
        first(runtime.hang.dir, ALIVE)


def still_waiting(records: list, revoked_at: float) -> list:
    """The settled heartbeat records of processes still in a wait they began before the break: waiting elsewhere
    than on the job's communicators (a receive on another), which nothing but their death ends."""
    return [r for r in records if (_wait_began(r) or revoked_at) < revoked_at - 0.25]


def _signal(directory, records: list, sig) -> None:
    for r in records:
        send(directory, r, sig)


def _mine(record: dict) -> bool:
    """Whether a heartbeat record is this process's own."""
    return record["pid"] == os.getpid() and here(record)


def _key(record: dict) -> tuple:
    """A heartbeat's process across hosts: its pid and host."""
    return record["pid"], record.get("host", HOST)


def _who(record: dict) -> str:
    """A heartbeat's process in a line: `rank 3 (pid 1234)`, `a warm spare (pid 1234)`, `a newcomer (pid 1234)`; a
    process of another host than this watch's with its host: `rank 3 (pid 1234 on node2)`."""
    who = ({"spare": "a warm spare", "newcomer": "a newcomer"}.get(record.get("role"), "a process not training yet")
           if record["rank"] is None else f"rank {record['rank']}")
    return f"{who} (pid {record['pid']}{'' if here(record) else ' on ' + record['host']})"


def _stage_size(cb) -> int:
    """Ranks per pipeline stage of the layout training now (the straggler watch compares within a stage)."""
    layout = getattr(cb, "layout", None)
    return ParallelLayout(**layout).stage_size if layout else cb.world_size


def standby_heartbeat(directory, world_size: int, timeout, role: str, runtime=PROCESS) -> Optional[HangWatch]:
    """With tft.hang_timeout, the heartbeat of a process that does not train yet: a warm spare while it waits
    (dsim.ft.spares; role "spare") and, given a place, until its training heartbeat begins; a process spawned
    for a dead rank's place from the moment it knows the job's config (role "newcomer"). Its record (rank
    null, the training world's size) lets a training rank's watch find it frozen while a repair waits for it
    (in the pool's shrink, or the state exchange: killed, the place goes to another spare or a spawned process,
    or the repair is given up), and rank 0, at the end of training, a released spare that never leaves
    (stop_frozen_spares). It judges nobody; end() stops it, and so does a training heartbeat's start. `runtime`: the
    process's, which keeps it."""
    if not timeout:
        return None
    if runtime.standby is not None:
        return runtime.standby  # a spare that took a place: the same heartbeat goes on
    watch = HangWatch(None, directory, runtime=runtime)
    watch.role = role
    watch.start(None, world_size, world_size)
    return watch


def end_standby(runtime=PROCESS) -> None:
    """Stop this process's standby heartbeat, if any (a spare released, a newcomer whose join failed)."""
    if runtime.standby is not None:
        runtime.standby.end()


def stop_frozen_spares(directory, world_size: int, timeout: float) -> None:
    """At the end of training (heartbeats under `directory`, the output directory, as HangWatch's), the idle spares
    released: wait for each to leave (its heartbeat goes as it does); kill one frozen (its heartbeat older than
    `timeout`) or still there `timeout` seconds later (stuck): mpirun would wait for it for ever."""
    beats, deadline = Path(directory) / "heartbeats", time.monotonic() + timeout
    while True:
        now = time.time()
        left = [r for r in heartbeats(beats) if r.get("rank") is None and r.get("world_size") == world_size
                and (same_process(r["pid"], r.get("started")) if here(r) else now - r["time"] < 2 * timeout)]
        if not left:
            return
        now, late = time.time(), time.monotonic() > deadline
        for r in left:
            ago = now - r["time"]
            if (ago > timeout or late) and _kill(beats, r):
                how = (f"has not run for {ago:.1f} s" if ago > timeout else
                       f"did not leave within {timeout:g} s of its release")
                say(f"dsim: hang watch: {_who(r)} {how} (released at the end of training, timeout {timeout:g} s): "
                    "killed (SIGKILL)")
        if late:
            return
        time.sleep(HEARTBEAT / 5)


def leave(runtime=PROCESS) -> None:
    """This process (its runtime) stops training without its callbacks' end (left idle by an elastic shrink): no
    heartbeat of it is a training rank's any more, and its watch stops."""
    if runtime.hang is not None:
        runtime.hang.end()


def heartbeats(directory) -> list[dict]:
    """Every heartbeat record in `directory` (a record being rewritten as it is read is skipped)."""
    out = []
    for path in Path(directory).glob("[0-9]*"):
        try:
            out.append(json.loads(path.read_bytes().decode().strip()))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
    return out


def find_hung(directory, world_size: int, now: float, timeout: float) -> tuple[list[dict], list[dict]]:
    """The heartbeats of the other processes of a world of `world_size`, still running as the same process (a
    dead one's record is not a hang), that are frozen (no beat for more than `timeout` seconds) and those that
    are stuck: beating, but their main thread, at their last beat, had computed its step outside every
    collective with no sign of progress for more than `timeout` seconds (their own measure, at most HEARTBEAT
    old: a process that moved on since then has beaten since)."""
    frozen, stuck = [], []
    for r in heartbeats(directory):
        if r.get("world_size") != world_size or _mine(r):
            continue
        hung = frozen if now - r["time"] > timeout else stuck if (r.get("stalled") or 0) > timeout else None
        if hung is None:
            continue
        if here(r) and same_process(r["pid"], r.get("started")):
            hung.append(r)
        elif hung is stuck and not here(r) and now - r["time"] < timeout:
            # another host's, beating (its own thread carries the order out); a frozen one is its host's to find (a
            # stale record of another host may also be a dead process's: nothing here can tell)
            hung.append(r)
    return frozen, stuck


def _kill(directory, record: dict) -> bool:
    """SIGKILL the process of a heartbeat record; whether this caller claimed it first (and so reports it). The
    caller's own process (the straggler watch's judge is rank 0, which may be the straggler) is claimed first."""
    if _mine(record):
        claim(directory, record)
        os.kill(os.getpid(), signal.SIGKILL)
    if not here(record):  # another host's: one order, by the watch that claims it first, carried out there
        return claim(directory, record) and send(directory, record, signal.SIGKILL)
    if not send(directory, record, signal.SIGKILL):
        return False
    return claim(directory, record)


def first(directory, name: str) -> bool:
    """Whether this caller is the first to take `name` in `directory` (an exclusive create)."""
    try:
        os.close(os.open(Path(directory) / name, os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def claim(directory, record: dict) -> bool:
    """Exclusively mark the frozen process `record` as killed (True for the first caller only)."""
    return first(directory, f"killed-{record['pid']}-{record['started']}")


def killed_since(directory, since: float, horizon: float) -> bool:
    """Whether a watch killed a frozen process at or after `since` (its claim's time), less than `horizon`
    seconds ago (a death that ended nothing since is no reason to wait)."""
    now = time.time()
    for path in Path(directory).glob("killed-*"):
        try:
            mtime = path.stat().st_mtime
            if since - 1 <= mtime and now - mtime < horizon:
                return True
        except OSError:
            continue
    return False


def forget_the_dead(directory, starting: bool = False, marks: bool = True) -> None:
    """Remove the heartbeats (kill marks, orders) of this host's processes that no longer run, and with `marks` (rank
    0) the job's marks of a deadlock's break and of a stall said: a job's start (`starting`: then the mark of a break
    that left every rank alive too), after a restart or a repair in the job. Every rank does it for its host (a pid is
    known on its own host only); rank 0 alone for the marks, which are the job's."""
    for path in Path(directory).iterdir():
        try:
            if path.name == ALIVE:
                if starting and marks:
                    path.unlink(missing_ok=True)
                continue
            if path.name.startswith(("killed-deadlock-", "breaking-deadlock-", "ended-deadlock-", "said-")):
                if marks:
                    path.unlink(missing_ok=True)
                continue
            if path.name.startswith("killed-"):
                pid, when = path.name.split("-")[1:3]
                when = None if when == "None" else int(when)
            elif path.name.startswith(ORDER):  # (one never carried out)
                _, pid, when, host = order(path.name)
                if host != HOST:
                    continue
            else:
                record = json.loads(path.read_bytes().decode().strip())
                if not here(record):
                    continue  # another host's: only its own host can tell whether that pid still runs
                pid, when = record["pid"], record["started"]
            if not same_process(int(pid), when):
                path.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, UnicodeDecodeError):
            continue
