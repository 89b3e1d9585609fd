"""A straggler: a rank that computes its steps much slower than the others (`tft.straggler_factor: F`).

A device that throttles (heat, power), memory or a link that keeps correcting and retrying, a noisy
neighbour: the rank lives and its steps go on, so neither MPI nor the hang watch sees anything wrong, but
every collective waits for it and the whole job runs at its pace ("fail-slow"). Each training process
measures how long its main thread computes each step outside collectives and waits (dsim.parallel.progress:
the median of its last few steps) and publishes it in its heartbeat (dsim.ft.hang). Waiting is not
computing: the ranks that wait for a straggler keep their own time, the straggler's grows. At every
heartbeat, rank 0's watch compares each rank with the others of its pipeline stage (stages compute different
layers): a rank whose time is more than F times the median of theirs, for STEPS of its own steps in a row, is
a straggler. It is reported once (a `straggler` event and a line) and, with `tft.straggler_evict`, killed
(SIGKILL) as a failed rank, so that what follows is what follows a death: a warm spare takes its place
(tft.spares), or a spawned replacement (tft.arf), or the last gasp and a restart.
"""
from __future__ import annotations

import os
import statistics

from ..log import event, say

STEPS = 5  # steps of its own a rank must stay past the factor to be judged a straggler


def find_stragglers(records: list[dict], world_size: int, stage_size: int, factor: float) -> list[tuple[dict, float]]:
    """(record, the median of the others' step times) of each process of a world of `world_size` whose step
    time is more than `factor` times the median of the other ranks of its pipeline stage (`stage_size` ranks)."""
    stages = {}
    for r in records:
        if r.get("world_size") == world_size and r.get("step_time") is not None:
            stages.setdefault(r["rank"] // stage_size, []).append(r)
    out = []
    for ranks in stages.values():
        for r in ranks:
            others = [x["step_time"] for x in ranks if x is not r]
            median = statistics.median(others) if others else None
            if median is not None and r["step_time"] > factor * median:
                out.append((r, median))
    return out


class StragglerJudge:
    """Rank 0's watch over the others' step times (see the module doc); `look` at every heartbeat."""

    def __init__(self, factor: float, evict: bool):
        self.factor, self.evict = float(factor), evict
        self.since = {}      # pid -> its count of steps measured when it was first seen past the factor
        self.judged = set()  # pids reported already

    def look(self, records: list[dict], world_size: int, stage_size: int, same_process, kill) -> None:
        """`kill(record)` SIGKILLs a straggler with tft.straggler_evict and says whether this watch claimed it
        first (dsim.ft.hang._kill: the hang watch may have killed it as frozen already, and reported it)."""
        slow = {r["pid"]: (r, median) for r, median in find_stragglers(records, world_size, stage_size, self.factor)}
        self.since = {pid: n for pid, n in self.since.items() if pid in slow}  # back under the factor: again
        for pid, (r, median) in slow.items():
            first = self.since.setdefault(pid, r.get("timed", 0))
            if pid in self.judged or r.get("timed", 0) - first < STEPS or not same_process(pid, r.get("started")):
                continue
            self.judged.add(pid)
            self._act(r, median, kill)

    def _act(self, r: dict, median: float, kill) -> None:
        times = r["step_time"] / median
        what = (f"rank {r['rank']} (pid {r['pid']}) computes its steps {times:.1f}x slower than the other ranks of its "
                f"stage ({1000 * r['step_time']:.0f} ms a step against a median of {1000 * median:.0f} ms, as of step "
                f"{r['step']}; tft.straggler_factor {self.factor:g})")
        judge = r["pid"] == os.getpid()  # rank 0 itself: it says so first, then it is killed
        if self.evict and not judge and not kill(r):  # gone already, or killed by a hang watch first, which said so
            return
        event("straggler", any_rank=True, rank=r["rank"], global_step=r["step"], step_ms=round(1000 * r["step_time"], 1),
              median_ms=round(1000 * median, 1), factor=self.factor, evicted=self.evict)
        say(f"dsim: straggler watch: {what}: " + ("killed (SIGKILL), as a failed rank (tft.straggler_evict)"
                                                  if self.evict else "reported (tft.straggler_evict: false)"))
        if self.evict and judge:
            kill(r)
