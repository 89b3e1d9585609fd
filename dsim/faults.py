"""Fault injection: raise like the seed's myCallback, or SIGKILL a rank's own process.

`fault: {kind: exception | kill | uce | hang | stuck | deadlock | unmatched | slow | sdc, rank: R, step: N, epoch: E,
at: POINT}`
- kind sdc: one bit of one of rank R's parameters flips, and nothing reports it (silent data corruption;
  tft.sdc_check_every finds it by comparing replicas: dsim.ft.sdc);
- kind hang: rank R stops (SIGSTOP): it neither dies nor goes on, and the others wait for it in their next
  collective (until tft.hang_timeout's watch kills it: dsim.ft.hang);
- kind slow: from that point on, rank R computes fault.slowdown (4) times slower (after each layer and each
  parameter's update it sleeps as long again, times slowdown - 1): a throttled device or a degraded node, a
  straggler the others wait for in every collective (tft.straggler_factor finds it: dsim.ft.straggler);
  at forward, allreduce or update only;
- kind stuck: rank R's training stops while its process runs (its main thread sleeps for ever, its threads
  go on: a deadlock, a read that never returns); at forward, allreduce, update, save, step_end or epoch_end
  only (found by the same watch; at save, a write to a dead file system: with async_save, its background
  writer stops; at step_end or epoch_end, a callback that never returns);
- kind deadlock: rank R waits for a message that never comes, on a communicator outside the job's (MPI_COMM_SELF),
  at the same points as stuck: every rank then waits, none frozen or stuck, and after tft.deadlock_timeout the
  hang watch breaks the deadlock: it revokes the job's communicators, and kills rank R, which nothing else frees
  (dsim.ft.hang); kind unmatched: rank R waits, on the job's world, for a message no rank sends (a receive with
  no matching send, as collectives that do not match leave a rank): the revoke frees every rank, none dies;
- kind uce: an uncorrectable memory error (UCE): half of rank R's parameter and optimizer-state buffers
  become garbage and UCEError is raised on that rank, as the hardware would report it;
- at step_end (with step) / epoch_end (with epoch): after that step or epoch finished (and was saved,
  when a checkpoint is due: ModelCheckpoint runs first);
- at forward / allreduce / update: in the middle of step N's forward pass (half the layers done), of its
  gradient all-reduce over data parallel (between the reduce-scatter and the all-gather), or of its
  optimizer update (half the parameters updated): the other ranks are inside that phase's collectives;
- at save: rank R dies half-way through writing its file of the checkpoint due at step N (with async_save,
  its training waits for that write: it dies before starting step N+1, the others inside that step);
- at commit: rank R dies after every file of that checkpoint is written, before the commit record.
rank null means every rank (for exceptions); a list such as [0, 4] names several (they all fire), and with
a list of steps as long as it, each rank fires at its own step (rank: [0, 5], step: [6, 13]).
`last_gasp_kill: R` also kills rank R half-way through writing its last-gasp files: a second failure
while the survivors save; `last_gasp_stuck: R` makes that write never return instead (a dead file system:
tft.hang_timeout's watch kills it, and the others save without it).
`repair_kill: R` kills rank R during a repair in the job (tft.arf, tft.spares, tft.uce), and `repair_hang: R`
freezes it there (tft.hang_timeout's watch kills it): at `repair_at: refill` (the default) the survivors have
agreed on the step and the dead rank's place is not filled yet, at `exchange` the new world is formed and the
state has not moved. Either way the repair is given up on every living rank alike and the last gasp follows.
`repair_stuck: R` makes rank R's repair stop there while its process runs (tft.hang_timeout's watch finds it stuck:
the repair is work watched, its collectives waits).
Naming a dead rank, with `repair_at: exchange`, they strike the newcomer that takes its place (a warm spare or
a spawned process) before the state moves. `spare_hang: true` freezes the warm spares (tft.spares) as they begin to wait (dsim.train): a hot spare node
that hung, found by tft.hang_timeout's watch when a repair waits for it, or at the end of training.
kind plan: the failures of a fault plan, the JSON file named by $DSIM_FAULT_PLAN (python -m dsim.campaign
writes it): each entry {time, rank, kind: kill | uce | corrupt | node | hang | stuck | deadlock | unmatched | sdc | slow,
at: forward | allreduce | update} fires
once, on that rank (modulo the ranks training, which an elastic shrink lowers), at the first such point reached
at or after `time` (Unix seconds; 0 if left out), or, for kill, corrupt, hang and stuck, at a point of a repair in
the job its survivor reaches first (refill or exchange: see repair_at), and, with `step: N`, in global step N or later (a plan
written by hand: {"faults": [{"rank": 1, "kind": "sdc", "at": "forward", "step": 9}, ...]}); `corrupt` kills here (the campaign damages the rank's file on disk); `node`
(with `node_size: n`) is a lost server: every rank of the victim's node (on more than one host, the ranks on the
victim's host, as MPI found them: dsim.parallel.hosts; else n consecutive ranks of those training, ranks 0..n-1 the
first node) dies at that moment, the victim SIGKILLing the others, then itself; `slow` (with
`slowdown: s`, default 4) makes the rank compute s times slower for the rest of its process's life. For that, each
process records its pid as its rank's in <plan>.ranks/ when it loads the plan. A fired entry is marked by a
file created exclusively in <plan>.fired/, so a restarted job, a warm spare or a spawned replacement that takes
the rank never fires it again.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .engine.callbacks import Callback
from .log import event, say
from .parallel import progress


class InjectedFault(Exception):
    """The simulated failure ("Some errors happen.")."""


class UCEError(RuntimeError):
    """An uncorrectable memory error (UCE) reported by the device: this rank's training state is garbage."""

    def __init__(self, rank: int, where: str, damaged: list):
        self.rank, self.damaged = rank, damaged
        super().__init__(f"UCE: uncorrectable memory error on rank {rank} {where} "
                         f"({len(damaged)} buffers of parameters and optimizer state damaged)")


def corrupt(optimizer, seed: int) -> list:
    """Turn half of the owned parameter and optimizer-state buffers into garbage; returns their names."""
    rng = np.random.default_rng(seed)
    arrays = [(p.name, p.data) for p in optimizer.params] + [(n, a) for n, _, a in optimizer.state_items()]
    hit = arrays[::2]
    for _, arr in hit:
        garble(arr, rng)
    names = [name for name, _ in hit]
    if hasattr(optimizer, "invalidate"):
        optimizer.invalidate(names)
    return names


GARBAGE_BLOCK = 1 << 16  # bytes of random garbage, repeated over a damaged buffer


def garble(arr: np.ndarray, rng) -> None:
    """Overwrite every byte of arr with random garbage, a 64 KiB random block repeated (as fast as a copy:
    the fault is the hardware's, its simulation must not add seconds to the time a repair is charged with)."""
    if not arr.flags.c_contiguous:
        arr.view(np.uint8)[...] = rng.integers(0, 256, size=arr.nbytes, dtype=np.uint8).reshape(arr.view(np.uint8).shape)
        return
    flat = arr.reshape(-1).view(np.uint8)
    block = rng.integers(0, 256, size=min(flat.size, GARBAGE_BLOCK), dtype=np.uint8)
    whole = flat.size // block.size * block.size
    flat[:whole].reshape(-1, block.size)[...] = block
    flat[whole:] = block[:flat.size - whole]


_armed = None  # the FaultInjector of this process, consulted at save points


class FaultInjector(Callback):
    """Fires the configured fault once, on the configured rank, at the configured point."""

    def __init__(self, kind: str, rank=None, step: Optional[int] = None,
                 epoch: Optional[int] = None, at: str = "step_end", last_gasp_kill: Optional[int] = None,
                 slowdown: float = 4.0, last_gasp_stuck: Optional[int] = None, repair_kill: Optional[int] = None,
                 repair_hang: Optional[int] = None, repair_at: str = "refill", repair_stuck: Optional[int] = None):
        self.kind, self.epoch, self.at, self.slowdown = kind, epoch, at, slowdown
        self.ranks = None if rank is None else list(rank if isinstance(rank, list) else [rank])
        self.steps = step if isinstance(step, list) else None  # one step per rank
        self.step = None if self.steps else step
        self.last_gasp_kill, self.last_gasp_stuck = last_gasp_kill, last_gasp_stuck
        self.repair_kill, self.repair_hang, self.repair_at = repair_kill, repair_hang, repair_at
        self.repair_stuck = repair_stuck
        self.fired = False
        self.in_place = None  # dsim.ft.in_place.InPlace where a UCE may be repaired in place (set by begin)

    def begin(self, run_context):
        global _armed
        cb = run_context.original_args()
        self.my_rank, self.optimizer, self.model = cb.rank, cb.optimizer, cb.model
        recovery = getattr(cb.model, "recovery", None)
        self.in_place = getattr(recovery, "in_place", None)  # a UCE repaired in place (tft.uce_in_place)
        if self.kind == "plan":
            self.plan = FaultPlan.load(os.environ[PLAN_ENV], cb.rank, cb.world_size)
        if self.steps and self.my_rank in self.ranks:
            self.step = self.steps[self.ranks.index(self.my_rank)]
        _armed = self
        points = getattr(cb.model, "points", None)  # the step's points (forward, allreduce, update) reach at_point
        if points is not None and at_point not in points:
            points.append(at_point)

    def recovered(self, run_context):
        """After an in-job repair or an elastic shrink: a UCE must strike the optimizer training now (a shrink
        builds a new one; striking the old one damaged memory no longer used, and nobody was found damaged),
        and a fault plan's entries are those of this process's rank in the world training now (a configured
        fault, fault.rank, stays with the process that had that rank when training began)."""
        cb = run_context.original_args()
        self.optimizer = cb.optimizer
        self.in_place = getattr(getattr(cb.model, "recovery", None), "in_place", None)
        if self.kind == "plan" and (cb.rank, cb.world_size) != (self.plan.rank, self.plan.world_size):
            self.plan = FaultPlan.load(os.environ[PLAN_ENV], cb.rank, cb.world_size)  # renumbered: its entries

    def end(self, run_context):
        global _armed
        _armed = None
        points = getattr(run_context.original_args().model, "points", None)
        if points is not None and at_point in points:
            points.remove(at_point)

    def step_end(self, run_context):
        cb = run_context.original_args()
        if self.at == "step_end" and cb.cur_step_num == self.step:
            self.fire(f"at step {cb.cur_step_num}", cb.cur_step_num)

    def epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.at == "epoch_end" and cb.cur_epoch_num == self.epoch:
            self.fire(f"at the end of epoch {cb.cur_epoch_num}", cb.cur_step_num)

    def fire(self, where: str, global_step: int):
        if self.kind == "plan":  # a plan's failures strike at their own points (strike); fault.at is not one
            return
        if self.fired or (self.ranks is not None and self.my_rank not in self.ranks):
            return
        self.fired = True
        # recorded before it fires (a killed rank writes nothing after); an all-rank fault once, by rank 0
        event("fault", any_rank=self.ranks is not None, kind=self.kind,
              rank="all" if self.ranks is None else self.my_rank, where=where,
              at=self.at, global_step=global_step)
        if self.kind == "kill":
            kill(f"dsim: fault: killing rank {self.my_rank} (SIGKILL) {where}")
        if self.kind == "hang":
            freeze(f"dsim: fault: rank {self.my_rank} stops (SIGSTOP) {where}")
            return  # continued (SIGCONT): the step goes on
        if self.kind == "stuck":
            stall(f"dsim: fault: rank {self.my_rank} is stuck (its training stops, its process runs) {where}")
        if self.kind == "deadlock":
            wait_for_nothing(self.my_rank, where)
        if self.kind == "unmatched":
            wait_for_nothing(self.my_rank, where, self.model.groups.world)
        if self.kind == "slow":
            slow_down(self.my_rank, self.slowdown, where)
            return
        if self.kind == "sdc":
            say(f"dsim: fault: rank {self.my_rank}: a bit of {flip_bit(self.optimizer, self.my_rank)} flips, "
                f"silently, {where}")
            return  # nothing reports it: training goes on
        if self.kind == "uce":
            error = UCEError(self.my_rank, where, corrupt(self.optimizer, self.my_rank))
            say(f"dsim: fault: {error}")
            if self.in_place is not None and self.in_place.repair(error, self.at):
                return  # repaired from a replica: the step goes on (dsim.ft.in_place)
            raise error
        raise InjectedFault(f"Some errors happen. (injected on rank {self.my_rank} {where})")


def kill(message: str) -> None:
    """Say why and SIGKILL this process (no clean-up, as a real crash)."""
    say(message)
    os.kill(os.getpid(), signal.SIGKILL)


def slow_down(rank: int, slowdown: float, where: str) -> None:
    """This process computes `slowdown` times slower for the rest of its life (dsim.parallel.progress.pace): a
    straggler, found by tft.straggler_factor's watch."""
    say(f"dsim: fault: rank {rank} computes {slowdown:g}x slower from now on {where}")
    progress.slowdown = slowdown


def flip_bit(optimizer, seed: int) -> str:
    """Flip one bit of one parameter of this rank (drawn from seed), as a memory cell that fails silently would;
    returns what it hit ("layer2.param, element 1234, bit 30")."""
    rng = np.random.default_rng([seed, 31])
    p = optimizer.params[int(rng.integers(len(optimizer.params)))]
    flat = p.data.reshape(-1)
    i, bit = int(rng.integers(flat.size)), int(rng.integers(flat.dtype.itemsize * 8))
    word = flat[i:i + 1].view(np.uint32 if flat.dtype.itemsize == 4 else np.uint64)
    word ^= word.dtype.type(1) << word.dtype.type(bit)
    return f"{p.name}, element {i}, bit {bit}"


def freeze(message: str) -> None:
    """Say why and SIGSTOP this process: every thread stops, nothing fails; a hang, until something kills it
    (tft.hang_timeout: dsim.ft.hang)."""
    say(message)
    os.kill(os.getpid(), signal.SIGSTOP)


def stall(message: str) -> None:
    """Say why and never return: the main thread waits for ever while every other thread of the process runs (a
    deadlock, a read from a dead file system), until something kills the process (tft.hang_timeout: dsim.ft.hang)."""
    say(message)
    while True:
        time.sleep(3600)


def wait_for_nothing(rank: int, where: str, world=None) -> None:
    """Say so and wait, as in a collective, for a message that never comes: on MPI_COMM_SELF, where no failure or
    revoke elsewhere ends it; or, given the job's `world`, a receive no rank matches there (a revoke of the world
    ends it). The others wait for this rank in their next collective, and nobody computes (a deadlock, which
    tft.hang_timeout's watch breaks: dsim.ft.hang)."""
    from mpi4py import MPI
    comm, source, on = (MPI.COMM_SELF, 0, "") if world is None else (world, MPI.ANY_SOURCE, ", on the job's world,")
    say(f"dsim: fault: rank {rank} waits for a message no rank sends{on} {where}")
    with progress.waiting():
        comm.Recv(np.empty(1, np.uint8), source=source, tag=0xDEAD)


def during_last_gasp(rank: int, global_step: int) -> None:
    """Called half-way through a survivor's last-gasp writes: the configured second failure strikes here."""
    f = _armed
    if f is not None and f.last_gasp_kill == rank:
        _second_failure("kill", rank, "during the last-gasp save", "last_gasp", global_step,
                        f"dsim: fault: killing rank {rank} (SIGKILL) during the last-gasp save of step {global_step}")
    if f is not None and f.last_gasp_stuck == rank:
        _second_failure("stuck", rank, "during the last-gasp save", "last_gasp", global_step,
                        f"dsim: fault: rank {rank} is stuck (its last-gasp write never returns) during the last-gasp "
                        f"save of step {global_step}")


def during_repair(rank: int, global_step: int, point: str) -> None:
    """Called at `point` of a survivor's repair in the job (training to go on after `global_step`): "refill", the
    survivors agreed on the step and the dead rank's place is not filled yet; "exchange", the new world is
    formed and the slices have not moved. The configured second failure strikes at fault.repair_at; a fault
    plan's failure due by now, of a kind that stops a process, strikes at either (the step to be redone is
    global_step + 1: inside it, as a failure at a step's point)."""
    f = _armed
    if f is not None and f.kind == "plan":
        f.plan.strike(point, global_step + 1, f, repair=True)
    if f is None or f.repair_at != point:
        return
    where = REPAIR_POINTS[point]
    if f.repair_kill == rank:
        _second_failure("kill", rank, f"during a repair in the job, {where}", f"repair_{point}", global_step,
                        f"dsim: fault: killing rank {rank} (SIGKILL) during the repair in the job, {where} (training "
                        f"to go on after step {global_step})")
    if f.repair_hang == rank:
        _second_failure("hang", rank, f"during a repair in the job, {where}", f"repair_{point}", global_step,
                        f"dsim: fault: rank {rank} freezes (SIGSTOP) during the repair in the job, {where} (training "
                        f"to go on after step {global_step})")
    if f.repair_stuck == rank:
        _second_failure("stuck", rank, f"during a repair in the job, {where}", f"repair_{point}", global_step,
                        f"dsim: fault: rank {rank} is stuck (its repair stops, its process runs) during the repair in "
                        f"the job, {where} (training to go on after step {global_step})")


def newcomer_in_repair(f, rank: int, global_step: int) -> None:
    """Called in a newcomer (a spare or a spawned process) that took dead rank `rank`'s place, before the state
    exchange: fault.repair_kill / repair_hang / repair_stuck naming that rank, at repair_at: exchange, strike the
    newcomer there
    (its own fault config is dropped once it trains: the faults of a rank were its predecessor's)."""
    if f.repair_at != "exchange":
        return
    what = f"the newcomer taking rank {rank}'s place"
    where = f"during the repair in the job, before the state is exchanged (training to go on after step {global_step})"
    if f.repair_kill == rank:
        kill(f"dsim: fault: killing {what} (SIGKILL) {where}")
    if f.repair_hang == rank:
        freeze(f"dsim: fault: {what} freezes (SIGSTOP) {where}")
    if f.repair_stuck == rank:
        stall(f"dsim: fault: {what} is stuck (its process runs) {where}")


def _second_failure(kind: str, rank: int, where: str, at: str, global_step: int, message: str) -> None:
    """A configured failure during the handling of another (the last gasp, a repair): recorded, then struck
    (kill: SIGKILL; hang: SIGSTOP; stuck: the main thread never returns)."""
    event("fault", any_rank=True, kind=kind, rank=rank, where=where, at=at, global_step=global_step)
    {"kill": kill, "hang": freeze, "stuck": stall}[kind](message)


POINTS = ("step_end", "epoch_end", "forward", "allreduce", "update", "save", "commit")


def armed(point: str) -> bool:
    """Whether a fault is set to strike at this point (e.g. "save": the saver then stops half-way to let it)."""
    return _armed is not None and _armed.at == point


def strikes(point: str, global_step: int) -> bool:
    """Whether the configured fault fires on this rank at this point of this step (not yet fired)."""
    f = _armed
    return (f is not None and f.kind != "plan" and f.at == point and not f.fired
            and (f.step is None or f.step == global_step) and (f.ranks is None or f.my_rank in f.ranks))


def at_point(point: str, global_step: int) -> None:
    """Called where a fault may strike inside a step (forward, allreduce, update) or a save (save, commit)."""
    f = _armed
    if f is not None and f.kind == "plan":
        f.plan.strike(point, global_step, f)
    elif f is not None and f.at == point and (f.step is None or f.step == global_step):
        f.fire(f"during the {point} of step {global_step}", global_step)


PLAN_ENV = "DSIM_FAULT_PLAN"
PLAN_KINDS = ("kill", "uce", "corrupt", "node", "hang", "stuck", "deadlock", "unmatched", "sdc", "slow")
PLAN_POINTS = ("forward", "allreduce", "update")
DEATH_KINDS = ("kill", "corrupt", "hang", "stuck")  # a plan's failures that stop a process (the hang watch kills a
                                                   # frozen or stuck one)
REPAIR_KINDS = (*DEATH_KINDS, "node")  # those that also strike during a repair in the job (a node's ranks die at once)
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
            (f.get("at") in PLAN_POINTS, f"at must be one of {', '.join(PLAN_POINTS)}, got {f.get('at')!r}"),
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

    def strike(self, point: str, global_step: int, injector: "FaultInjector", repair: bool = False) -> None:
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
            node = (node_of(self.rank, f["node_size"], self.world_size or self.rank + 1, hosts)
                    if f["kind"] == "node" else None)
            event("fault", any_rank=True, kind=f["kind"], rank=self.rank, where=where, at=point,
                  global_step=global_step, plan_index=i, **({"ranks": node} if node else {}))
            if f["kind"] == "uce":
                error = UCEError(self.rank, where, corrupt(injector.optimizer, self.rank))
                say(f"dsim: fault: {error}")
                if injector.in_place is not None and injector.in_place.repair(error, point):
                    return
                raise error
            if f["kind"] == "hang":
                freeze(f"dsim: fault: rank {self.rank} stops (SIGSTOP) {where}")
                return
            if f["kind"] == "stuck":
                stall(f"dsim: fault: rank {self.rank} is stuck (its training stops, its process runs) {where}")
            if f["kind"] in ("deadlock", "unmatched"):
                wait_for_nothing(self.rank, where, injector.model.groups.world if f["kind"] == "unmatched" else None)
            if f["kind"] == "sdc":
                say(f"dsim: fault: rank {self.rank}: a bit of {flip_bit(injector.optimizer, i)} flips, silently, {where}")
                return
            if f["kind"] == "slow":
                slow_down(self.rank, float(f.get("slowdown", 4.0)), where)
                return
            if node:
                on = f" (host {hosts.names[self.rank]})" if on_hosts(hosts, self.world_size) else ""
                ranks = (f"{node[0]}-{node[-1]}" if node == list(range(node[0], node[-1] + 1)) else
                         ",".join(map(str, node)))
                say(f"dsim: fault: node failure: ranks {ranks}{on} die together {where}")
                kill_registered(self.path, [r for r in node if r != self.rank], self.world_size)
            kill(f"dsim: fault: killing rank {self.rank} (SIGKILL) {where}"
                 + (" (its newest shard on disk is damaged too)" if f["kind"] == "corrupt" else ""))


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
