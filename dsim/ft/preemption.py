"""A scheduler's notice stops training at a step every rank agrees on, saved: `checkpoint.save_on_signal: true`.

A batch system warns a job before it ends it: Slurm's `--signal=USR2@120` two minutes before the time
limit, a preempting scheduler's SIGTERM before its SIGKILL. Without a handler both end the process at
once, and the steps since the last periodic checkpoint are lost. With this callback each rank only notes
the signal (SIGUSR2, or SIGTERM sent to the ranks themselves); at every step's end the ranks take the
largest of their notes (one small all-reduce over the world, marked as a wait for the hang watch), so all
stop after the same step although the signal reached each at a different point of it. ModelCheckpoint's
end saves that step (it always saves the last one, waiting for an async save), rank 0 says so, and the job
exits 128 + the signal's number (140 for SIGUSR2, 143 for SIGTERM), as a process the signal ended: not
finished, and `--resume auto` goes on from the step after, bit-identical to an uninterrupted run.

mpirun passes SIGUSR2 on to every rank; SIGTERM sent to mpirun ends the ranks at once (Open MPI's launcher
kills them), so dsim's launcher (dsim/ft/launcher.py: the launch scripts, the Makefile) passes a SIGTERM it gets
to the ranks on its node instead.
"""
from __future__ import annotations

import signal

import numpy as np

from ..engine.callbacks import Callback
from ..log import event, say
from ..runtime import PROCESS

SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


def _hold(signum, frame):
    """A signal handler: it notes the signal in the process's runtime (the only one it can reach)."""
    PROCESS.held_signal = PROCESS.held_signal or signum


def hold_signals() -> None:
    """For a warm spare (mpirun passes SIGUSR2 on to every process of the job, spares too): the notice neither
    ends it nor is lost; should it take a place, its StopOnSignal starts from it."""
    for s in SIGNALS:
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _hold)


class StopOnSignal(Callback):
    """Stops training after the step in which any rank got SIGUSR2 or SIGTERM; `checkpoint` (ModelCheckpoint,
    earlier in the callbacks) saves it at the end. A signal the program handles itself is left to it."""

    def __init__(self, checkpoint=None, runtime=PROCESS):
        self.checkpoint = checkpoint
        self.runtime = runtime  # the process's (dsim.runtime): a signal held before training, the wait marked
        self.received = 0   # the first of SIGNALS this process got (0: none)
        self.stopped = 0    # the signal training stopped for, the same on every rank (0: none)
        self._flag = np.zeros(1, np.int64)
        self._handlers = {}

    def begin(self, run_context):
        self.received = self.received or self.runtime.held_signal
        for s in SIGNALS:
            if signal.getsignal(s) in (signal.SIG_DFL, _hold):
                self._handlers[s] = signal.signal(s, self._note)

    def _note(self, signum, frame):
        self.received = self.received or signum

    def step_end(self, run_context):
        from mpi4py import MPI
        self._flag[0] = self.received
        world = run_context.original_args().model.groups.world
        self.runtime.collective(world.Allreduce, MPI.IN_PLACE, self._flag, op=MPI.MAX)
        if self._flag[0]:
            self.stopped = int(self._flag[0])
            run_context.request_stop()

    def end(self, run_context):
        for s, previous in self._handlers.items():
            signal.signal(s, previous)
        self._handlers = {}
        if not self.stopped:
            return
        cb = run_context.original_args()
        name = self.checkpoint.saved[-1] if self.checkpoint is not None and self.checkpoint.saved else None
        what = signal.Signals(self.stopped).name
        event("stopped_on_signal", signal=what, global_step=cb.cur_step_num, checkpoint=name)
        if cb.rank == 0:
            saved = f"saved as {name}" if name else "not saved (no checkpoint callback)"
            say(f"dsim: {what}: training stopped after step {cb.cur_step_num} (epoch {cb.cur_epoch_num} step "
                f"{cb.cur_step_in_epoch}), {saved}; resume with --resume auto (exit status {128 + self.stopped})")
