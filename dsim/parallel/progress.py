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
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager

computing = False  # inside work watched: a step's computation (Model.train_step), a save, a comparison, ...
work = None        # which: "step", "data loading", "callback", "save", "comparison", "evaluation", "last gasp" or
                   # "repair" (the innermost)
waits = 0          # how many waits the main thread is inside (nested: a sum inside a pipeline's wait)
last = 0.0         # time.monotonic() of the main thread's last sign of progress
began = None       # time.monotonic() when the outermost work watched began (None: outside any)
waited = 0.0       # seconds the main thread has spent inside waits, in all
recent = deque(maxlen=5)  # seconds each of the last steps computed outside waits (the straggler watch's measure)
timed = 0          # steps measured so far
slowdown = 1.0     # fault.kind slow: this rank computes this many times slower (pace(); dsim.faults)
_wait_began = 0.0


def tick() -> None:
    """The main thread made progress (a layer, a collective entered or left). Not inside a wait: there the checks a
    rank makes while it polls its collective (dsim.parallel.groups.check_revoked, each a tick at a layer) are
    waiting still, and a deadlock is every rank waiting, none progressing (waiting_for)."""
    global last
    if not waits:
        last = time.monotonic()


def pace() -> None:
    """Called by the main thread before each layer's and each parameter's work is marked (tick): with a slow
    fault (slowdown s > 1), it sleeps s - 1 times what it computed since its last sign of progress, so its
    step computes s times slower (a throttled device, a degraded node); nothing otherwise."""
    if slowdown > 1 and not waits:
        time.sleep((slowdown - 1) * max(0.0, time.monotonic() - last))


@contextmanager
def waiting():
    """The main thread waits for others while in it: a collective, a receive from another rank (not its own
    async save's writer: that wait is judged by the writer's progress, each tensor a tick)."""
    global waits, last, waited, _wait_began
    waits += 1
    last = time.monotonic()
    if waits == 1:
        _wait_began = last
    try:
        yield
    finally:
        waits -= 1
        last = time.monotonic()
        if waits == 0:
            waited += last - _wait_began


@contextmanager
def watched(what: str = "step"):
    """Work of the job the main thread is judged by its progress in (see the module doc): `what`, "step" (its
    computation), "data loading" (fetching its batch: fetched), "callback" (the callbacks between steps),
    "save" (a checkpoint's), "comparison" (the replicas': dsim.ft.sdc), "evaluation" (Model.eval), "last gasp"
    (dsim.ft.last_gasp) or "repair" (in the job: dsim.ft.inprocess). Nested (a save inside a callback, which
    compares first), the innermost names it and the outermost decides when it began and ends."""
    global computing, work, last, began, timed
    kept, outer, computing, work, last = computing, work, True, what, time.monotonic()
    if not kept:
        began = last
    waited_before = waited
    try:
        yield
        if what == "step" and not kept:  # a step computed to its end: how long outside waits
            recent.append(time.monotonic() - began - (waited - waited_before))
            timed += 1
    finally:
        computing, work = kept, outer
        if not kept:
            began = None


def fetched(batches, what: str = "data loading"):
    """The items of `batches` (a data loader), each fetched as work watched (`what`): a loader that never returns
    (a read from a dead file system) is judged as a step that never ends is."""
    it = iter(batches)
    try:
        while True:
            with watched(what):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


def stalled_for(now: float) -> float | None:
    """Seconds since the main thread's last sign of progress, if it is in work watched outside every
    collective (`now`: time.monotonic()); None when it is between steps or waiting."""
    if not computing or waits:
        return None
    return now - last


def waiting_for(now: float) -> float | None:
    """Seconds since the main thread's last sign of progress while it waits (a collective, a receive); None when it
    does not wait. Every rank of a deadlock waits, none progressing (`now`: time.monotonic())."""
    return now - last if waits else None


def step_time() -> tuple[float | None, int]:
    """The median of the last few steps' computing times outside waits (seconds; None before any), and how many
    steps were measured in all."""
    times = list(recent)
    return (statistics.median(times) if times else None), timed
