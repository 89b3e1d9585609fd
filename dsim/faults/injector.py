"""FaultInjector: the callback that arms the configured fault (or a fault plan) in this process, and the hooks where
it strikes: the loop's points (forward, allreduce, update: it registers on Model.points), the ends of a step and an
epoch, and the save, the last gasp and the repair in the job, which call `at_point`, `during_last_gasp` and
`during_repair` here.
"""
from __future__ import annotations

import os
from typing import Optional

from ..engine.callbacks import Callback
from ..log import event
from .actions import Strike, freeze, kill, stall, strike
from ..runtime import PROCESS
from .plan import PLAN_ENV, REPAIR_POINTS, FaultPlan



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
        cb = run_context.original_args()
        self.my_rank, self.optimizer, self.model = cb.rank, cb.optimizer, cb.model
        recovery = getattr(cb.model, "recovery", None)
        self.in_place = getattr(recovery, "in_place", None)  # a UCE repaired in place (tft.uce_in_place)
        if self.kind == "plan":
            self.plan = FaultPlan.load(os.environ[PLAN_ENV], cb.rank, cb.world_size)
        if self.steps and self.my_rank in self.ranks:
            self.step = self.steps[self.ranks.index(self.my_rank)]
        # the fault hooks of this process's runtime: the save, the last gasp and the repair in the job reach this
        # injector there (armed, strikes, at_point, during_last_gasp, during_repair); the loop's points, directly
        self.runtime = getattr(getattr(cb.model, "groups", None), "runtime", PROCESS)
        self.runtime.fault = self
        points = getattr(cb.model, "points", None)  # the step's points (forward, allreduce, update) reach at_point
        if points is not None and self.at_point not in points:
            points.append(self.at_point)

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
        self.runtime.fault = None
        points = getattr(run_context.original_args().model, "points", None)
        if points is not None and self.at_point in points:
            points.remove(self.at_point)

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
        strike(Strike(self.kind, self.my_rank, where, self.at, seed=self.my_rank, slowdown=self.slowdown, target=self))

    def at_point(self, point: str, global_step: int) -> None:
        """A point inside a step (forward, allreduce, update: the loop's Model.points) or a save (save, commit)."""
        if self.kind == "plan":
            self.plan.strike(point, global_step, self)
        elif self.at == point and (self.step is None or self.step == global_step):
            self.fire(f"during the {point} of step {global_step}", global_step)


def armed(point: str, runtime=PROCESS) -> bool:
    """Whether a fault is set to strike at this point (e.g. "save": the saver then stops half-way to let it): the
    configured one, or an entry of this rank's fault plan."""
    f = runtime.fault
    return f is not None and (f.plan.strikes_at(point) if f.kind == "plan" else f.at == point)


def strikes(point: str, global_step: int, runtime=PROCESS) -> bool:
    """Whether the configured fault fires on this rank at this point of this step (not yet fired)."""
    f = runtime.fault
    return (f is not None and f.kind != "plan" and f.at == point and not f.fired
            and (f.step is None or f.step == global_step) and (f.ranks is None or f.my_rank in f.ranks))


def at_point(point: str, global_step: int, runtime=PROCESS) -> None:
    """Called where a fault may strike inside a step (forward, allreduce, update) or a save (save, commit)."""
    if runtime.fault is not None:
        runtime.fault.at_point(point, global_step)


def during_last_gasp(rank: int, global_step: int, runtime=PROCESS) -> None:
    """Called half-way through a survivor's last-gasp writes: the configured second failure strikes here."""
    f = runtime.fault
    if f is not None and f.last_gasp_kill == rank:
        _second_failure("kill", rank, "during the last-gasp save", "last_gasp", global_step,
                        f"dsim: fault: killing rank {rank} (SIGKILL) during the last-gasp save of step {global_step}")
    if f is not None and f.last_gasp_stuck == rank:
        _second_failure("stuck", rank, "during the last-gasp save", "last_gasp", global_step,
                        f"dsim: fault: rank {rank} is stuck (its last-gasp write never returns) during the last-gasp "
                        f"save of step {global_step}")


def during_repair(rank: int, global_step: int, point: str, runtime=PROCESS) -> None:
    """Called at `point` of a survivor's repair in the job (training to go on after `global_step`): "refill", the
    survivors agreed on the step and the dead rank's place is not filled yet; "exchange", the new world is
    formed and the slices have not moved. The configured second failure strikes at fault.repair_at; a fault
    plan's failure due by now, of a kind that stops a process, strikes at either (the step to be redone is
    global_step + 1: inside it, as a failure at a step's point)."""
    f = runtime.fault
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
