"""The rescue: each survivor's last-gasp file written before the survivors agree, for a crash that takes MPI's runtime.

With Open MPI 5.0 a whole host's crash ends the job: mpirun exits once its daemon there is gone, and a survivor's
next call of MPI's fault tolerance (the revoke and shrink the last gasp starts with) crashes or never returns
(docs/design/node-faults.md). The survivors do learn of the failure first: their calls with the lost host's ranks
fail at once. So in a job spanning several hosts with tft.ttp, each survivor, at its first failed call and before
any call of MPI's fault tolerance, writes its own file of every step it holds consistently (the last finished step
and the one before: OptTFTWrapper), the file the last gasp would write, under

    <ttp dir>/rescue-step_{n}/rank_{r}/ttp_rank_{r}-{epoch}_{step}.h5

with no commit record: nothing there is a checkpoint. Then:
- the last gasp runs as ever; once it has an outcome (committed, or nothing it could save) this rank's rescue files
  are deleted: the job handled its failure;
- a side of a network cut without the quorum deletes its own before it stops (dsim.ft.quorum.stop): a resume never
  takes anything of the minority's;
- when the runtime goes first, the files stay. They are written by a process forked from the rank (the state as
  it was, copy on write) in a session of its own: Open MPI's daemons kill their ranks within ~0.1 s of mpirun's
  end on a host's crash (measured), and a rank's next call of MPI's fault tolerance may crash, neither of which
  ends the writer.
The next resume completes them (`complete`, collective, before the checkpoint to resume from is chosen): the newest
step newer than every committed checkpoint for which every replica set has a rescue file that verifies (read where
it lies, on any host's disk: every checksum, and the step, rank and layout its attributes name) becomes the
last-gasp checkpoint `ttp-{epoch}_{step}` the survivors would have committed: each rank's file is written from its
own rescue file or a replica's (sent by the rank that read it), and rank 0 commits. The rescue files are deleted
once that is committed, and whenever a committed checkpoint is at least as new; a rescue that cannot be completed is
kept, said in one line, and the resume goes on from the last committed checkpoint.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import warnings
from pathlib import Path

from ..checkpoint import save as sv
from ..checkpoint.errors import CheckpointError
from ..checkpoint.format import read_file, write_file
from ..checkpoint.group_info import replica_sets
from ..checkpoint.loader import candidates
from ..checkpoint.plan import save_plan
from ..checkpoint.record import RANK
from ..checkpoint.recovery import rank_write, record_event
from ..checkpoint.save import epoch_and_step, slots
from ..log import say
from ..parallel.layout import ParallelLayout
from ..runtime import PROCESS
from . import last_gasp

DIRECTORY = re.compile(r"^rescue-step_(\d+)$")
FILE = re.compile(r"^ttp_rank_(\d+)-\d+_\d+\.h5$")
TAG = 0x5E5C
WAIT = 30.0    # seconds a rescue's writer may take
STABLE = 2.0   # seconds the guard's watch waits for the main thread to be inside a wait (Rescue.launcher_gone)
UNSTABLE = 3   # the exit status of a writer that found the state changing
CUE_POLL = 0.01  # seconds between two looks for the cue of another rank's failure (Rescue._watch_cue)


def directory(ttp_dir, step: int) -> Path:
    return Path(ttp_dir) / f"rescue-step_{step}"


class Rescue:
    """This process's rescue (Runtime.rescue), armed when its job starts: it forks the writer once, from the main
    thread at its first failed MPI call (`write`), or from the guard's watch when the launcher is gone first
    (`launcher_gone`), and deletes the files once the failure was handled in the job (`discard`)."""

    def __init__(self, run):
        self.run = run
        self.changed = threading.Condition()
        self.writer = 0        # the writer's pid, once forked
        self.forked = False
        self.checking = False  # a writer forked from another thread is checking its copy (fork)
        job = re.sub(r"[^A-Za-z0-9]+", "_", os.environ.get("PMIX_NAMESPACE", "job"))  # (one per job: mpirun's)
        self.cue = Path(run.ttp_dir) / f"rescue-cue-{job}"
        threading.Thread(target=self._watch_cue, name="dsim-rescue-cue", daemon=True).start()

    def _watch_cue(self) -> None:
        """Another rank of this host (of any, where the disk is shared) noticed a failure and left the cue: fork the
        writer too, without waiting for an MPI error of its own. On a host's crash a rank that waits in a collective
        with living ranks only gets none before Open MPI's end crashes it inside that collective (SIGSEGV, measured:
        1 of node1's 4 ranks in most runs)."""
        while not self.forked and self.run.runtime.rescue is self:  # (a run rebuilt, elastic: armed again)
            if self.cue.exists():
                self.fork_when_stable()
                return
            time.sleep(CUE_POLL)

    def fork(self, stable: bool) -> bool:
        """Fork the writer, once: True when this call forked one that writes. stable: the state cannot be changing
        (the main thread is handling the failure); else the writer checks, in its copy, that the main thread was
        inside a wait at the fork and exits at once with UNSTABLE if not: then False, and the caller may try again.
        A call meanwhile (the main thread's, at its failure) waits for that check."""
        with self.changed:
            while self.checking:
                self.changed.wait()
            if self.forked:
                return False
            with warnings.catch_warnings():  # (Python 3.12 warns of a fork with threads: the writer needs none)
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                _writer(self.run, stable)
            self.writer, self.forked, self.checking = pid, True, not stable
        if stable:
            return True
        time.sleep(0.02)  # a writer that found the state changing exits at once
        done, status = os.waitpid(pid, os.WNOHANG)
        unstable = bool(done) and os.WIFEXITED(status) and os.WEXITSTATUS(status) == UNSTABLE
        with self.changed:
            if unstable:
                self.writer, self.forked = 0, False
            self.checking = False
            self.changed.notify_all()
        return not unstable

    def launcher_gone(self) -> None:
        """From the guard's watch, before it ends this process: mpirun (or this host's daemon) is gone, and the main
        thread saw no MPI error (it waits in a collective that no failure will end). Forks the writer once the main
        thread is inside a wait (its state then changes not), trying again for up to STABLE seconds."""
        if threading.current_thread() is threading.main_thread():  # (its output's pipe broke: between its work)
            self.fork(stable=True)
            return
        self.fork_when_stable()

    def fork_when_stable(self) -> None:
        """From a thread of this rank other than its main one: fork the writer once the main thread is inside a wait
        (its state then changes not), trying again for up to STABLE seconds."""
        progress = self.run.runtime.progress
        deadline = time.monotonic() + STABLE
        while not self.forked and time.monotonic() < deadline:
            if progress.waits and self.fork(stable=False):
                return
            time.sleep(0.005)

    def wait(self, timeout: float = WAIT) -> None:
        """Until the writer has ended (its files written, or it gave up)."""
        deadline = time.monotonic() + timeout
        while self.writer:
            try:
                if os.waitpid(self.writer, os.WNOHANG)[0] or time.monotonic() > deadline:
                    break
            except ChildProcessError:
                break
            time.sleep(0.01)
        self.writer = 0

    def discard(self) -> None:
        """Delete this rank's rescue files (and the directories they leave empty) once written: the failure was
        handled in the job, or this side of a cut stops."""
        self.wait()
        _unlink(self.cue)
        me = self.run.groups.world.rank
        for path in Path(self.run.ttp_dir).glob(f"rescue-step_*/rank_{me}/ttp_rank_{me}-*"):
            _remove(path)


def needed(run) -> bool:
    """With the last gasp as the scheme, in a job spanning several hosts: a host's crash can take MPI's runtime with
    it. Not with a repair in the job (tft.uce, arf, spares, elastic): forked during their recovery, the writers left
    an elastic job hung in 3 of ~15 kill-matrix runs of its `node` cases (not understood yet: node-faults.md)."""
    tft = run.cfg.tft
    hosts = getattr(run.groups, "hosts", None)
    return (bool(tft.ttp) and not (tft.uce or tft.arf or tft.elastic) and hosts is not None
            and len(hosts.distinct) > 1)


def arm(run) -> None:
    """At the start of training: the rescue, where the job needs one (Runtime.rescue, read by the guard)."""
    rescue = run.runtime.rescue
    if needed(run) and (rescue is None or rescue.run is not run):
        run.runtime.rescue = Rescue(run)


def write(run) -> None:
    """At this rank's first failed MPI call: the writer forked, then the job's communicators revoked, so that
    every survivor learns of the failure now and forks its own (one waiting in a collective with living ranks only
    would learn of it from the last gasp's revoke, later). On a host's crash Open MPI's daemons on the other hosts
    kill their ranks ~0.1 s after mpirun's end, and a revoke made then may crash the rank (SIGSEGV; both
    measured): the writer is forked before any call of MPI's fault tolerance."""
    from .ulfm import revoke_groups
    rescue = run.runtime.rescue
    if rescue is None:
        return
    rescue.fork(stable=True)
    try:  # the cue for this host's other ranks (Rescue._watch_cue)
        rescue.cue.parent.mkdir(parents=True, exist_ok=True)
        rescue.cue.touch()
        time.sleep(3 * CUE_POLL)  # theirs forked before the revoke reaches them (one crashed in it: measured)
    except OSError:
        pass
    revoke_groups(run.groups)


def _writer(run, stable: bool) -> None:
    """The forked writer: this rank's state of each step it holds consistently (the last finished and the one
    before; none after a memory error), as it was at the fork (copy on write), written with no MPI. It leaves the
    rank's session and closes the rank's sockets, so that what ends the rank (Open MPI's daemon killing its
    processes once mpirun is gone, a crash in MPI) neither ends it nor hides the rank's death from its peers; it
    gives up after WAIT seconds (a lock some thread of the rank held at the fork)."""
    code = 1
    me = run.groups.world.rank
    try:
        os.setsid()
        if not stable and not run.runtime.progress.waits:
            os._exit(UNSTABLE)
        _name(b"dsim-rescue")  # (dsim/ft/launcher.py waits for it: launcher.RESCUE_NAME)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(WAIT))
        states = run.optimizer.states()
        for step in sorted(states, reverse=True):
            w = last_gasp._write(run, directory(run.ttp_dir, step), me, step, states[step])
            write_file(w.path, w.meta, w.tensors, w.append_info)
        code = 0
    except BaseException as e:  # (a full disk): the last gasp may still save; one line, never a traceback
        try:
            os.write(2, f"dsim: warning: rank {me}: its rescue files were not written: {e}\n".encode())
        except OSError:
            pass
    os._exit(code)


def handled(run) -> None:
    """The failure had its outcome in the job (the last gasp's): this rank's rescue files are deleted."""
    if run.runtime.rescue is not None:
        run.runtime.rescue.discard()


# -- at the next resume ---------------------------------------------------------------------------------------------
def found(ttp_dir) -> list:
    """[(step, rank, path)] of the rescue files on this rank's disk."""
    out = []
    base = Path(ttp_dir)
    if not base.is_dir():
        return out
    for d in base.iterdir():
        m = DIRECTORY.match(d.name)
        if m and d.is_dir():
            for f in d.glob("rank_*/ttp_rank_*.h5"):
                fm = FILE.match(f.name)
                if fm and f.parent.name == f"rank_{fm.group(1)}":
                    out.append((int(m.group(1)), int(fm.group(1)), f))
    return sorted(out)


def _newest_committed(run) -> int:
    """The newest committed step on this rank's disk (periodic or last gasp), -1 when none."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return candidates(run.checkpoint_dir, "auto", run.ttp_dir)[0]["global_step"]
    except CheckpointError:
        return -1


def _check(path: Path, step: int, rank: int, layout: ParallelLayout):
    """(the shard, None) when the rescue file verifies and holds rank's state of step in layout; else (None, why)."""
    try:
        shard = read_file(path, verify=True)
    except CheckpointError as e:
        return None, str(e)
    meta = shard.meta
    if (meta.get("global_step"), meta.get("rank")) != (step, rank):
        return None, f"{path} holds rank {meta.get('rank')}'s state of global step {meta.get('global_step')}"
    if meta.get("layout") != layout.to_dict() or meta.get("world_size") != layout.world_size:
        return None, f"{path} was saved with another layout ({meta.get('layout')})"
    return shard, None


def choices(everyone: list, committed: int, sets) -> list:
    """[(step, readers)], newest first: each step newer than `committed` for which every replica set (of ranks of
    the saved layout) has a rescue file some rank found; readers: rank whose file -> the rank that reads it (its
    own rank when that found it, else the finder reading the fewest). everyone[q]: the (step, rank) of the files
    rank q found on its disk (pure)."""
    world = sorted({r for g in sets for r in g})
    out = []
    for step in sorted({s for held in everyone for s, _ in held if s > committed}, reverse=True):
        readers, load = {}, {}
        for r in world:
            finders = [q for q, held in enumerate(everyone) if (step, r) in held]
            if finders:
                q = r if r in finders else min(finders, key=lambda q: (load.get(q, 0), q))
                readers[r], load[q] = q, load.get(q, 0) + 1
        if all(any(r in readers for r in g) for g in sets):
            out.append((step, readers))
    return out


def complete(run, log=say) -> None:
    """Before a resume chooses its checkpoint (collective over the world): the newest rescue that is complete and
    newer than every committed checkpoint becomes the last-gasp checkpoint of its step (see the module doc)."""
    comm, layout = run.groups.world, run.groups.layout
    for cue in Path(run.ttp_dir).glob("rescue-cue-*"):  # (left by a job that ended: Rescue._watch_cue)
        _unlink(cue)
    mine = found(run.ttp_dir)
    everyone = comm.allgather([(s, r) for s, r, _ in mine])
    if not any(everyone):
        return
    committed = max(comm.allgather(_newest_committed(run)))
    paths = {(s, r): p for s, r, p in mine}
    sets = [list(g) for g in replica_sets(layout)]
    newer = sorted({s for held in everyone for s, _ in held if s > committed}, reverse=True)
    for step, readers in choices(everyone, committed, sets):
        shards, whys = {}, {}
        for r, q in readers.items():
            if q == comm.rank:
                shards[r], why = _check(paths[(step, r)], step, r, layout)
                if why:
                    whys[r] = why
        bad = {r: why for part in comm.allgather(whys) for r, why in part.items()}
        good = {r: q for r, q in readers.items() if r not in bad}
        if comm.rank == 0:
            for r, why in sorted(bad.items()):
                log(f"dsim: recovery: rescue file of rank {r} (step {step}) not used: {why}")
        if all(any(r in good for r in g) for g in sets):
            _commit(run, step, good, {r: s for r, s in shards.items() if r in good}, committed, log)
            break
    else:
        if newer and comm.rank == 0:
            log(f"dsim: recovery: the rescue files of step {newer[0]} (written by the survivors of a failure) do not "
                f"hold every slice: kept in {run.ttp_dir}, not used; resuming from the last committed checkpoint")
        _remove_all([p for s, _, p in mine if s <= committed])
        return
    _remove_all([p for _, _, p in mine])


def _commit(run, step: int, readers: dict, shards: dict, committed: int, log) -> None:
    """Every rank's file of `step` from its own rescue file or its replica's, then the commit (collective)."""
    comm, layout = run.groups.world, run.groups.layout
    # whose rescue file each rank's is written from: its own, else a replica's, spread as the last gasp spreads them
    source = last_gasp.plan({r: {step} for r in readers}, replica_sets(layout)).writers
    requests = [comm.isend(shards[s], dest=r, tag=TAG) for r, s in sorted(source.items())
                if readers[s] == comm.rank and r != comm.rank]
    me = comm.rank
    s = source[me]
    shard = shards[s] if readers[s] == me else comm.recv(source=readers[s], tag=TAG)
    for req in requests:
        req.wait()
    epoch, in_epoch = epoch_and_step(step, run.loader.get_dataset_size())
    target = last_gasp.checkpoint_dir(run.ttp_dir, step)
    name = f"{last_gasp.PREFIX}-{epoch}_{in_epoch}"
    write = rank_write(target / last_gasp.file_name(me, epoch, in_epoch), me, layout, shard)
    missing = sorted(r for r in range(layout.world_size) if r not in readers)
    commit = sv.Commit(target, name, last_gasp.PREFIX, epoch, in_epoch, step,
                       lambda: save_plan(layout, run.network.specs, slots(run.optimizer)),
                       template=last_gasp.file_name(RANK, epoch, in_epoch), host_of=last_gasp._hosts(run.groups),
                       extra={"last_gasp": {"failed": missing,
                                            "writers": {str(r): r for r in range(layout.world_size)},
                                            "rescued": {"from": {str(r): s for r, s in sorted(source.items())},
                                                        "completed_at_resume": True}}})
    outcome = sv.save(sv.World(comm, run.runtime), lambda: [write], commit).outcome
    if outcome.failed:
        why = outcome.failed[min(outcome.failed)]
        raise CheckpointError(f"the rescue of step {step} could not be committed: {why}")
    if comm.rank == 0:
        back = f"; the newest checkpoint committed before was of step {committed}" if committed >= 0 else ""
        log(f"dsim: recovery: the rescue files of step {step}, written by the survivors of a failure that ended the "
            f"job before they could agree (rank(s) {', '.join(map(str, missing)) or 'none'} left none), verified and "
            f"committed as the last-gasp checkpoint {name} in {target}{back}")
        record_event(run, "rescue_completed", global_step=step, checkpoint=name, directory=str(target),
                     missing=missing, before=committed)


def _name(name: bytes) -> None:
    """This process's name (/proc/PID/comm; Linux's PR_SET_NAME), where it can be set."""
    import ctypes
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _remove_all(paths) -> None:
    for path in paths:
        _remove(path)


def _unlink(path: Path) -> None:
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass


def _remove(path: Path) -> None:
    """A rescue file, then its rank directory and its step directory when they are left empty."""
    path = Path(path)
    _unlink(path)
    for d in (path.parent, path.parent.parent):
        try:
            d.rmdir()
        except OSError:
            break
