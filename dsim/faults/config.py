"""The `fault:` section: fault injection, to practise recovery (dsim.faults.injector arms it)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..section import ConfigError, key
from .plan import PLAN_ENV, PLAN_POINTS, POINTS, STUCK_POINTS, plan_error

KINDS = ("exception", "kill", "uce", "hang", "stuck", "deadlock", "unmatched", "slow", "sdc", "plan")
# each one rank, struck inside the last gasp or a repair in the job
FAULT_RANK_KEYS = ("last_gasp_kill", "last_gasp_stuck", "repair_kill", "repair_hang", "repair_stuck")


def _rank(r) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and r >= 0


@dataclass
class FaultConfig:
    """Fault injection, to practise recovery."""
    kind: Optional[str] = key(None, "what fails: null (nothing), exception, kill (SIGKILL), uce (a memory error), "
                                    "hang (SIGSTOP), stuck (main thread stops), deadlock, unmatched, slow, sdc (a "
                                    "flipped bit) or plan ($DSIM_FAULT_PLAN)",
                              "null | exception | kill | uce | hang | stuck | deadlock | unmatched | slow | sdc | plan")
    rank: Any = key(None, "the rank that fails; a list for several; null: every rank", "a rank, a list of ranks, or null")
    last_gasp_kill: Optional[int] = key(None, "also kill this rank half-way through its last-gasp writes",
                                        "a training rank or null; needs tft.ttp")
    last_gasp_stuck: Optional[int] = key(None, "this rank's last-gasp write never returns (found by tft.hang_timeout)",
                                         "a training rank or null; needs tft.ttp")
    repair_kill: Optional[int] = key(None, "also kill this rank during a repair in the job (at repair_at)",
                                     "a training rank or null; needs tft.arf or tft.uce")
    repair_hang: Optional[int] = key(None, "this rank freezes (SIGSTOP) during a repair in the job (at repair_at)",
                                     "a training rank or null; needs tft.arf or tft.uce")
    repair_stuck: Optional[int] = key(None, "this rank's repair stops while its process runs (at repair_at)",
                                      "a training rank or null; needs tft.arf or tft.uce")
    repair_at: str = key("refill", "where in a repair the repair_* faults strike: refill (the dead rank's place not "
                                   "filled yet) or exchange (filled, state not moved yet)", "refill | exchange")
    spare_hang: bool = key(False, "the warm spares freeze (SIGSTOP) as they begin to wait", "needs tft.spares")
    step: Any = key(None, "the global step (1-based) the fault strikes at; a list gives one per rank of a rank list",
                    "a step >= 1 up to the run's last, or a list")
    epoch: Optional[int] = key(None, "the epoch, with at: epoch_end", ">= 1 up to the run's last, or null")
    at: str = key("step_end", "where in the step it strikes", POINTS)
    slowdown: float = key(4.0, "kind slow: how many times slower the rank computes from then on", "> 1")

    def validate(self) -> None:
        """Its own rules (those on the fault tolerance it strikes in: dsim.config.validate)."""
        if self.kind not in (None, *KINDS):
            raise ConfigError(f"config: fault.kind must be {', '.join(KINDS[:-1])} or {KINDS[-1]}, got {self.kind!r}")
        d = self.slowdown
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 1:
            raise ConfigError(f"config: fault.slowdown must be a number > 1 (how many times slower), got {d!r}")
        if self.kind == "plan":
            plan = os.environ.get(PLAN_ENV)
            if not Path(plan or "/nonexistent/").is_file():
                raise ConfigError("config: fault.kind plan needs $DSIM_FAULT_PLAN, a fault plan file (python -m "
                                  f"dsim.campaign writes one), got {plan!r}")
            wrong = plan_error(plan)
            if wrong:
                raise ConfigError(f"fault plan {plan}: {wrong}")
        ranks = self.rank if isinstance(self.rank, list) else [self.rank]
        if self.rank is not None and not all(_rank(r) for r in ranks):
            raise ConfigError(f"config: fault.rank must be a rank, a list of ranks or null, got {self.rank!r}")
        for name in FAULT_RANK_KEYS:
            r = getattr(self, name)
            if r is not None and not _rank(r):
                raise ConfigError(f"config: fault.{name} must be a rank (>= 0) or null, got {r!r}")
        if isinstance(self.step, list) and not (isinstance(self.rank, list) and len(self.rank) == len(self.step)):
            raise ConfigError(f"config: a list of fault.step needs a list of fault.rank as long, got {self.rank!r}")
        steps = self.step if isinstance(self.step, list) else [self.step]
        if self.step is not None and not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps):
            raise ConfigError(f"config: fault.step must be a step (>= 1) or a list of steps, got {self.step!r}")
        if self.at not in POINTS:
            raise ConfigError(f"config: fault.at must be one of {', '.join(POINTS)}, got {self.at!r}")
        if self.repair_at not in ("refill", "exchange"):
            raise ConfigError(f"config: fault.repair_at must be refill or exchange, got {self.repair_at!r}")
        if self.kind in ("stuck", "deadlock", "unmatched") and self.at not in STUCK_POINTS:  # in work watched
            raise ConfigError(f"config: fault.kind {self.kind} strikes inside a step's computation, a save or a "
                              f"callback: fault.at must be {', '.join(STUCK_POINTS[:-1])} or {STUCK_POINTS[-1]}, "
                              f"got {self.at!r}")
        if self.kind == "slow" and self.at not in PLAN_POINTS:  # from a point of a step on
            raise ConfigError(f"config: fault.kind slow begins inside a step's computation: fault.at must be "
                              f"{', '.join(PLAN_POINTS[:-1])} or {PLAN_POINTS[-1]}, got {self.at!r}")
        if self.kind and self.kind != "plan" and (self.epoch if self.at == "epoch_end" else self.step) is None:
            raise ConfigError(f"config: fault at {self.at} needs fault.{'epoch' if self.at == 'epoch_end' else 'step'}")

    def check_ranks(self, world_size: int) -> None:
        """Every rank the fault settings name is a training rank of this job (0 .. world_size - 1, warm spares not
        counted): a fault meant for rank 9 of 8 would never strike, and the run would look like one that survived
        it. Only with fault.kind set, the settings that act then (a plan's entries name their own ranks)."""
        if not self.kind:
            return
        named = [] if self.kind == "plan" else [("rank", r) for r in (self.rank if isinstance(self.rank, list)
                                                                         else [self.rank])]
        named += [(name, getattr(self, name)) for name in FAULT_RANK_KEYS]
        for name, r in named:
            if r is not None and r >= world_size:
                raise ConfigError(f"config: fault.{name}={r} is not a rank of this job: it trains on {world_size} "
                                  f"rank(s), 0-{world_size - 1}")
