"""What strikes, where and when: the points a fault may strike at, and a fault plan's entries.

A fault plan (python -m dsim.campaign writes one; $DSIM_FAULT_PLAN names it) lists failures by time, rank, kind
and point; each process loads its rank's entries, registers its pid as its rank's (a node failure kills its
node-mates by it), and fires an entry at most once across every process (a marker created exclusively).
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

from ..log import event, say
from .actions import Strike, strike

POINTS = ("step_end", "epoch_end", "forward", "allreduce", "update", "save", "commit")
PLAN_ENV = "DSIM_FAULT_PLAN"
PLAN_KINDS = ("kill", "uce", "corrupt", "node", "host", "hang", "stuck", "deadlock", "unmatched", "sdc", "slow")
PLAN_POINTS = ("forward", "allreduce", "update")  # a step's points (a campaign draws among them)
PLAN_AT = (*PLAN_POINTS, "save", "commit")  # where a plan's entry may strike: a step's points, or a save's (half-way
                                            # through this rank's file; before the commit record)
DEATH_KINDS = ("kill", "corrupt", "hang", "stuck")  # a plan's failures that stop a process (the hang watch kills a
                                                   # frozen or stuck one)
REPAIR_KINDS = (*DEATH_KINDS, "node", "host")  # those that also strike during a repair in the job (a node's ranks die at once)
REPAIR_POINTS = {"refill": "before the dead rank's place is filled", "exchange": "before the state is exchanged"}
STUCK_POINTS = (*PLAN_POINTS, "save", "step_end", "epoch_end")  # inside work the hang watch judges (progress)


def plan_error(path) -> Optional[str]:
    """What is wrong with the fault plan at `path` (a file), in one sentence naming the entry; None when nothing
    is. Every rank checks it alike before training (config.validate): a plan written by hand fails there, not
    with a traceback on the rank it names when its entry falls due."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"cannot be read as JSON: {e}"
    entries = plan.get("faults") if isinstance(plan, dict) else None
    if not isinstance(entries, list):
        return 'must be a JSON object with a list "faults"'

    def number(x, low):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x >= low

    def integer(x, low):
        return number(x, low) and isinstance(x, int)

    for i, f in enumerate(entries):
        where = f"entry {i}"
        if not isinstance(f, dict):
            return f"{where} must be an object, got {f!r}"
        unknown = sorted(set(f) - {"time", "rank", "kind", "at", "step", "node_size", "slowdown"})
        checks = [
            (not unknown, f"has unknown key(s) {', '.join(unknown)}"),
            (integer(f.get("rank"), 0), f"rank must be a rank (>= 0), got {f.get('rank')!r}"),
            (f.get("kind") in PLAN_KINDS, f"kind must be one of {', '.join(PLAN_KINDS)}, got {f.get('kind')!r}"),
            (f.get("at") in PLAN_AT, f"at must be one of {', '.join(PLAN_AT)}, got {f.get('at')!r}"),
            ("time" not in f or number(f["time"], 0), f"time must be Unix seconds, got {f.get('time')!r}"),
            ("step" not in f or integer(f["step"], 1), f"step must be a step (>= 1), got {f.get('step')!r}"),
            (f.get("kind") != "node" or integer(f.get("node_size"), 1),
             f"a node failure needs node_size, its node's ranks (>= 1), got {f.get('node_size')!r}"),
            ("slowdown" not in f or (number(f["slowdown"], 1) and f["slowdown"] > 1),
             f"slowdown must be a number > 1 (how many times slower), got {f.get('slowdown')!r}"),
        ]
        wrong = next((what for ok, what in checks if not ok), None)
        if wrong:
            shown = json.dumps(f)
            return f"{where} ({shown}): {wrong}" if len(shown) < 120 else f"{where}: {wrong}"
    return None


class FaultPlan:
    """This rank's entries of a fault plan, in time order; each fires once across every process of the campaign."""

    def __init__(self, path, rank: int, entries: list, world_size: int = None):
        self.path, self.rank, self.entries = Path(path), rank, entries  # [(index, entry)] of this rank
        self.world_size = world_size  # the ranks training when it was loaded (entries' ranks modulo it)

    @classmethod
    def load(cls, path, rank: int, world_size: int = None) -> "FaultPlan":
        """The entries of `rank` not yet fired. With world_size, an entry's rank counts modulo it: after an
        elastic shrink (8 ranks training -> 4) the failure planned for rank 6 strikes rank 2, so every
        strategy meets the same failures (the idle processes train nothing a failure could stop)."""
        faults = json.loads(Path(path).read_text())["faults"]
        Path(f"{path}.fired").mkdir(exist_ok=True)
        mine = [(i, f) for i, f in enumerate(faults)
                if (f["rank"] % world_size if world_size else f["rank"]) == rank and not fired_marker(path, i).exists()]
        register(path, rank, world_size)
        return cls(path, rank, sorted(mine, key=lambda x: x[1].get("time", 0)), world_size)

    def strike(self, point: str, global_step: int, injector, repair: bool = False) -> None:
        """Fire the first due entry set for this point, unless another process already did. In a repair in the job
        (`repair`: point is refill or exchange, global_step the step to be redone), the first due entry of a kind
        that stops processes (REPAIR_KINDS), whatever its point: a failure whose time came during the repair."""
        now = time.time()
        for n, (i, f) in enumerate(self.entries):
            if f.get("time", 0) > now:
                return
            if (f["kind"] not in REPAIR_KINDS if repair else f["at"] != point) or f.get("step", 0) > global_step:
                continue
            del self.entries[n]
            # exclusive: whoever creates the marker fires (a newcomer reading the plan late does not)
            if not claim_entry(self.path, i, {"index": i, "time": now, "global_step": global_step, **f,
                                              "rank": self.rank, "planned_rank": f["rank"]}):
                return
            where = (f"during a repair in the job, {REPAIR_POINTS[point]} (training to go on after step "
                     f"{global_step - 1}; fault plan entry {i})" if repair else
                     f"during the {point} of step {global_step} (fault plan entry {i})")
            hosts = getattr(getattr(getattr(injector, "model", None), "groups", None), "hosts", None)
            world = self.world_size or self.rank + 1
            node = (node_of(self.rank, f["node_size"], world, hosts) if f["kind"] == "node" else
                    node_of(self.rank, 1, world, hosts) if f["kind"] == "host" else None)
            event("fault", any_rank=True, kind=f["kind"], rank=self.rank, where=where, at=point,
                  global_step=global_step, plan_index=i, **({"ranks": node} if node else {}))
            if f["kind"] == "host":
                crash_host(self.path, self.rank, node, world, hosts, where)
            elif node:
                on = f" (host {hosts.names[self.rank]})" if on_hosts(hosts, self.world_size) else ""
                say(f"dsim: fault: node failure: ranks {spans(node)}{on} die together {where}")
                kill_registered(self.path, [r for r in node if r != self.rank], self.world_size)
            strike(Strike("kill" if f["kind"] == "host" else f["kind"], self.rank, where, point, seed=i,
                          slowdown=float(f.get("slowdown", 4.0)), target=injector))
            return

    def strikes_at(self, point: str) -> bool:
        """Whether an entry of this rank is set for this point (a save's: the saver then stops half-way for it)."""
        return any(f["at"] == point for _, f in self.entries)


def spans(ranks: list) -> str:
    """'4-7' for consecutive ranks, else '1,5'."""
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))


DAEMON = "prted"  # Open MPI's daemon on a host other than mpirun's (on mpirun's own host, mpirun is the daemon)


def crash_host(plan, rank: int, ranks: list, world_size: int, hosts, where: str) -> None:
    """A host crash, from its victim: Open MPI's daemon there (this process's parent, when it is DAEMON) SIGKILLed
    first, then the other ranks on the host (`ranks`, as MPI found them); the victim's own kill follows (strike).
    A host whose daemon is mpirun itself loses its ranks alone (a node failure); on one host only the victim dies (a
    host crash needs real hosts: dsim.cluster); either is said."""
    daemon = os.getppid()
    try:
        name = Path(f"/proc/{daemon}/comm").read_text().strip()
    except OSError:
        name = ""
    on = on_hosts(hosts, world_size)
    what = (f"host {hosts.names[rank]} crashes (Open MPI's daemon there, {DAEMON} pid {daemon}, and ranks "
            f"{spans(ranks)})" if on and name == DAEMON else
            f"host failure: ranks {spans(ranks)} (host {hosts.names[rank]}) die together; Open MPI's daemon there is "
            f"left alive (mpirun itself, {name or 'unknown'})" if on else
            f"host failure on one host: rank {rank} alone dies (a host crash needs real hosts: dsim.cluster)")
    say(f"dsim: fault: {what} {where}")
    if on and name == DAEMON:
        os.kill(daemon, signal.SIGKILL)
    kill_registered(plan, [r for r in ranks if r != rank], world_size)


def node_of(rank: int, node_size: int, world_size: int, hosts=None) -> list[int]:
    """The ranks of rank's node. On real hosts (hosts: the training world's dsim.parallel.hosts.Hosts, more than one
    host), the ranks on rank's host: the processes a lost server takes with it, all local to the victim, so its
    SIGKILL reaches them on any cluster. Else node_size consecutive ranks (0..n-1 the first node) of the world_size
    training: a node of one machine, as a campaign models it."""
    if on_hosts(hosts, world_size):
        return hosts.ranks(hosts.names[rank])
    first = rank // node_size * node_size
    return list(range(first, min(first + node_size, world_size)))


def on_hosts(hosts, world_size) -> bool:
    """Whether the training world of world_size ranks runs on more than one host (its Hosts, or None: unknown)."""
    return hosts is not None and len(hosts.names) == world_size and len(hosts.distinct) > 1


def registry(plan) -> Path:
    """Where the processes of the plan's jobs record which rank each holds (<plan>.ranks/<rank>)."""
    return Path(f"{plan}.ranks")


def register(plan, rank: int, world_size) -> None:
    """Record this process as `rank` of `world_size` training (its pid and start time, which tell it from a later
    process given the same pid), atomically; a node failure reads it to kill the victim's node-mates."""
    registry(plan).mkdir(exist_ok=True)
    tmp = registry(plan) / f".{rank}.{os.getpid()}"
    tmp.write_text(json.dumps({"pid": os.getpid(), "started": started(os.getpid()), "world_size": world_size}))
    os.replace(tmp, registry(plan) / str(rank))


def started(pid: int) -> Optional[int]:
    """Process pid's start time (clock ticks after boot, /proc/PID/stat field 22); None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def same_process(pid: int, start: Optional[int]) -> bool:
    """Whether process pid still runs and is the one started at `start` (started()), not a later one given its pid."""
    return start is not None and started(pid) == start


def kill_registered(plan, ranks: list, world_size, wait: float = 5.0) -> list[int]:
    """SIGKILL the processes holding `ranks` of the world_size training (the registry); the ranks killed.
    A registration of a process that has ended, or of another world (before an elastic shrink), is one the
    rank's process has not replaced yet (a job starting, a rank renumbered): waited for, at most `wait` s."""
    left, killed, until = set(ranks), [], time.time() + wait
    while left and time.time() < until:
        for r in sorted(left):
            try:
                reg = json.loads((registry(plan) / str(r)).read_text())
            except (OSError, ValueError):
                continue
            if (reg.get("world_size") != world_size or reg["pid"] == os.getpid()
                    or not same_process(reg["pid"], reg["started"])):
                continue
            try:
                os.kill(reg["pid"], signal.SIGKILL)
                killed.append(r)
            except ProcessLookupError:
                pass
            left.discard(r)
        if left:
            time.sleep(0.05)
    return killed


def fired_marker(plan, index: int) -> Path:
    """The file that says entry `index` of the plan at `plan` has fired (created by the rank that fired it)."""
    return Path(f"{plan}.fired") / str(index)


def claim_entry(plan, index: int, record: dict) -> bool:
    """Create entry `index`'s marker holding `record`, unless a process already did (False): exclusive, so
    an entry fires at most once across every process (or is claimed by the campaign, so it never does)."""
    try:
        fd = os.open(fired_marker(plan, index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh)
    return True
