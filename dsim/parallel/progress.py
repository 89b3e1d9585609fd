"""Where this rank's main thread is in its step: computing, or waiting (in a collective, for another rank).

The hang watch (dsim.ft.hang) reads it from its thread to tell a rank stuck but alive from one waiting for
it. When a rank stops making progress while its process runs (a deadlock, a read from a dead file system, a
loop that never ends), every other rank soon waits inside a collective for it, and it alone is inside
its step's computation, outside every collective, with no sign of progress for as long as they have waited.
Signs of progress: entering or leaving a collective, and each layer's forward or backward (check_revoked).
A few attribute writes a layer or a collective: nothing is measured or allocated here.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

computing = False  # inside a step's computation (Model.train_step): forward, backward, reductions, update
waits = 0          # how many waits the main thread is inside (nested: a sum inside a pipeline's wait)
last = 0.0         # time.monotonic() of the main thread's last sign of progress


def tick() -> None:
    """The main thread made progress (a layer, a collective entered or left)."""
    global last
    last = time.monotonic()


@contextmanager
def waiting():
    """The main thread waits for others while in it: a collective, a receive from another rank, an async save's
    background write the update must not overtake."""
    global waits, last
    waits += 1
    last = time.monotonic()
    try:
        yield
    finally:
        waits -= 1
        last = time.monotonic()


@contextmanager
def step():
    """A step's computation: the main thread is judged by its progress while in it (see the module doc)."""
    global computing, last
    computing, last = True, time.monotonic()
    try:
        yield
    finally:
        computing = False


def stalled_for(now: float) -> float | None:
    """Seconds since the main thread's last sign of progress, if it is computing a step outside every
    collective (`now`: time.monotonic()); None when it is between steps or waiting."""
    if not computing or waits:
        return None
    return now - last
