"""Fault injection: raise like the seed's myCallback, or SIGKILL a rank's own process.

`fault: {kind: exception | kill, rank: R, step: N, epoch: E, at: step_end | epoch_end | save | commit}`
- at step_end (with step) / epoch_end (with epoch): after that step or epoch finished (and was saved,
  when a checkpoint is due: ModelCheckpoint runs first);
- at save: rank R dies half-way through writing its file of the checkpoint due at step N;
- at commit: rank R dies after every file of that checkpoint is written, before the commit record.
rank null means every rank (for exceptions).
"""
from __future__ import annotations

import os
import signal
from typing import Optional

from .engine.callbacks import Callback, event, say


class InjectedFault(Exception):
    """The simulated failure ("Some errors happen.")."""


_armed = None  # the FaultInjector of this process, consulted at save points


class FaultInjector(Callback):
    """Fires the configured fault once, on the configured rank, at the configured point."""

    def __init__(self, kind: str, rank: Optional[int] = None, step: Optional[int] = None,
                 epoch: Optional[int] = None, at: str = "step_end"):
        self.kind, self.rank, self.step, self.epoch, self.at = kind, rank, step, epoch, at
        self.fired = False

    def begin(self, run_context):
        global _armed
        self.my_rank = run_context.original_args().rank
        _armed = self

    def end(self, run_context):
        global _armed
        _armed = None

    def step_end(self, run_context):
        cb = run_context.original_args()
        if self.at == "step_end" and cb.cur_step_num == self.step:
            self.fire(f"at step {cb.cur_step_num}", cb.cur_step_num)

    def epoch_end(self, run_context):
        cb = run_context.original_args()
        if self.at == "epoch_end" and cb.cur_epoch_num == self.epoch:
            self.fire(f"at the end of epoch {cb.cur_epoch_num}", cb.cur_step_num)

    def fire(self, where: str, global_step: int):
        if self.fired or (self.rank is not None and self.rank != self.my_rank):
            return
        self.fired = True
        # recorded before it fires (a killed rank writes nothing after); an all-rank fault once, by rank 0
        event("fault", any_rank=self.rank is not None, kind=self.kind,
              rank="all" if self.rank is None else self.rank, where=where,
              at=self.at, global_step=global_step)
        if self.kind == "kill":
            say(f"dsim: fault: killing rank {self.my_rank} (SIGKILL) {where}")
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFault(f"Some errors happen. (injected on rank {self.my_rank} {where})")


def at_save_point(point: str, global_step: int) -> None:
    """Called by the checkpoint writer at 'save' (half-written file) and 'commit' (before the record)."""
    f = _armed
    if f is not None and f.at == point and (f.step is None or f.step == global_step):
        f.fire(f"during the {point} of step {global_step}", global_step)
