"""Where this rank's main thread is in its work: computing, or waiting (in a collective, for another rank).

The hang watch (dsim.ft.hang) reads it from its thread to tell a rank stuck but alive from one waiting for
it. When a rank stops making progress while its process runs (a deadlock, a read from a dead file system, a
loop that never ends), every other rank soon waits inside a collective for it, and it alone is inside
its work (a step's computation, a save, the replicas' comparison, an evaluation), outside every collective, with
no sign of progress for as long as they have waited. Signs of progress: entering or leaving a collective, each
layer's forward or backward (check_revoked), each parameter's update, each tensor a save writes (or its
background writer: the wait for it is not for another rank) or a comparison reads.
A few attribute writes a layer or a collective, and per step one float kept (its time outside waits, for the
straggler watch): nothing parameter-sized.

The marks are a Progress; this process's are MARKS, which its runtime carries (dsim.runtime.Runtime.progress). The
functions below (tick, waiting, watched, ...) are MARKS's methods, for the code that marks its progress without a
runtime in hand: every layer, every parameter's update, a save's every tensor.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager

slowdown = 1.0     # fault.kind slow: this process computes this many times slower for the rest of its life (pace();
                   # set by dsim.faults: a setting of the process, not a mark of where it is)


class Progress:
    """The marks of where a main thread is (see the module doc); written by it, read by the hang watch's thread."""

    __slots__ = ("computing", "work", "waits", "last", "began", "waited", "recent", "timed", "_wait_began")

    def __init__(self):
        self.computing = False  # inside work watched: a step's computation (Model.train_step), a save, ...
        self.work = None        # which: "step", "data loading", "callback", "save", "comparison", "evaluation",
        #                         "last gasp" or "repair" (the innermost)
        self.waits = 0          # how many waits the main thread is inside (nested: a sum inside a pipeline's wait)
        self.last = 0.0         # time.monotonic() of the main thread's last sign of progress
        self.began = None       # time.monotonic() when the outermost work watched began (None: outside any)
        self.waited = 0.0       # seconds the main thread has spent inside waits, in all
        self.recent = deque(maxlen=5)  # seconds each of the last steps computed outside waits (the straggler watch's)
        self.timed = 0          # steps measured so far
        self._wait_began = 0.0

    def tick(self) -> None:
        """The main thread made progress (a layer, a collective entered or left). Not inside a wait: there the checks a
        rank makes while it polls its collective (dsim.runtime.Runtime.check_revoked, each a tick at a layer) are
        waiting still, and a deadlock is every rank waiting, none progressing (waiting_for)."""
        if not self.waits:
            self.last = time.monotonic()

    def pace(self) -> None:
        """Called by the main thread before each layer's and each parameter's work is marked (tick): with a slow
        fault (slowdown s > 1), it sleeps s - 1 times what it computed since its last sign of progress, so its
        step computes s times slower (a throttled device, a degraded node); nothing otherwise."""
        if slowdown > 1 and not self.waits:
            time.sleep((slowdown - 1) * max(0.0, time.monotonic() - self.last))

    def enter_wait(self) -> None:
        """The main thread begins to wait for others (leave_wait ends it): see waiting."""
        self.waits += 1
        self.last = time.monotonic()
        if self.waits == 1:
            self._wait_began = self.last

    def leave_wait(self) -> None:
        self.waits -= 1
        self.last = time.monotonic()
        if self.waits == 0:
            self.waited += self.last - self._wait_began

    @contextmanager
    def waiting(self):
        """The main thread waits for others while in it: a collective, a receive from another rank (not its own
        async save's writer: that wait is judged by the writer's progress, each tensor a tick). A single call that
        waits goes through dsim.runtime.Runtime.collective instead."""
        self.enter_wait()
        try:
            yield
        finally:
            self.leave_wait()

    @contextmanager
    def watched(self, what: str = "step"):
        """Work of the job the main thread is judged by its progress in (see the module doc): `what`, "step" (its
        computation), "data loading" (fetching its batch: fetched), "callback" (the callbacks between steps),
        "save" (a checkpoint's), "comparison" (the replicas': dsim.ft.sdc), "evaluation" (Model.eval), "last gasp"
        (dsim.ft.last_gasp) or "repair" (in the job: dsim.ft.inprocess). Nested (a save inside a callback, which
        compares first), the innermost names it and the outermost decides when it began and ends."""
        kept, outer = self.computing, self.work
        self.computing, self.work, self.last = True, what, time.monotonic()
        if not kept:
            self.began = self.last
        waited_before = self.waited
        try:
            yield
            if what == "step" and not kept:  # a step computed to its end: how long outside waits
                self.recent.append(time.monotonic() - self.began - (self.waited - waited_before))
                self.timed += 1
        finally:
            self.computing, self.work = kept, outer
            if not kept:
                self.began = None

    def fetched(self, batches, what: str = "data loading"):
        """The items of `batches` (a data loader), each fetched as work watched (`what`): a loader that never returns
        (a read from a dead file system) is judged as a step that never ends is."""
        it = iter(batches)
        try:
            while True:
                with self.watched(what):
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                yield item
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def stalled_for(self, now: float) -> float | None:
        """Seconds since the main thread's last sign of progress, if it is in work watched outside every
        collective (`now`: time.monotonic()); None when it is between steps or waiting."""
        if not self.computing or self.waits:
            return None
        return now - self.last

    def waiting_for(self, now: float) -> float | None:
        """Seconds since the main thread's last sign of progress while it waits (a collective, a receive); None when
        it does not wait. Every rank of a deadlock waits, none progressing (`now`: time.monotonic())."""
        return now - self.last if self.waits else None

    def step_time(self) -> tuple[float | None, int]:
        """The median of the last few steps' computing times outside waits (seconds; None before any), and how many
        steps were measured in all."""
        times = list(self.recent)
        return (statistics.median(times) if times else None), self.timed


# This process's marks. A module-level one because the main thread marks its progress at every layer, every
# parameter's update and every tensor a save writes (too deep and too often to be handed a runtime: nn/, optim/,
# the checkpoint writer), and the hang watch's thread reads them; dsim.runtime.PROCESS carries this one.
MARKS = Progress()
tick, pace, waiting, watched, fetched = MARKS.tick, MARKS.pace, MARKS.waiting, MARKS.watched, MARKS.fetched
stalled_for, waiting_for, step_time = MARKS.stalled_for, MARKS.waiting_for, MARKS.step_time
