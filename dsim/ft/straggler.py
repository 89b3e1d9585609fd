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

Hosts (issue 52, part 5). When every rank of a host (as MPI found the hosts: dsim.parallel.hosts) is slow, the
host is the straggler, not one of its ranks: it is reported as one (`host node2 (ranks 4-7)`) and, with evict, all
its ranks are killed together. A slow *link* slows nobody's computing: every rank waits longer in the collectives
that cross hosts, on both sides of the link alike (measured: docs/design/node-faults.md), so the compute times
cannot tell it. Its sign is on the host whose link it is: that host's network interfaces hold packets back on
their way out (the kernel's queueing discipline counts them: overlimits, drops; read through netlink, published
in each rank's heartbeat as `link`). A host's link is judged slow when the job's steps take more than F times as
long as the fastest STEPS steps seen before, computing does not explain it (the slowest rank's computing times F
is less than a step), and that host's interfaces held back at
least HELD packets a step over those steps while every other host's held back less than 1/F of it, for STEPS
steps in a row; it is reported once and, with evict, its ranks are killed together as failed ranks.
"""
from __future__ import annotations

import os
import socket
import statistics
import struct
from collections import deque
from typing import Optional, Sequence

from ..log import event, say

STEPS = 5  # steps of its own a rank must stay past the factor to be judged a straggler
HELD = 10  # packets a step a host's interfaces must hold back on their way out for its link to be judged slow


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


def host_groups(slow: Sequence[int], host_of: Optional[Sequence[str]]) -> tuple[list[tuple[str, list[int]]], list[int]]:
    """([(host, its ranks)] for each host of two ranks or more all of whose ranks are in `slow`, [the slow ranks
    left]): a host slow as a whole is one straggler. host_of[r]: rank r's host (None: no hosts known)."""
    if not host_of or len(set(host_of)) < 2:
        return [], sorted(slow)
    slow = set(slow)
    ranks = {}
    for r, h in enumerate(host_of):
        ranks.setdefault(h, []).append(r)
    hosts = [(h, rs) for h, rs in ranks.items() if len(rs) > 1 and slow.issuperset(rs)]
    taken = {r for _, rs in hosts for r in rs}
    return hosts, sorted(slow - taken)


def slow_link(step_s: float, baseline_s: Optional[float], held: dict, factor: float, minimum: float = HELD):
    """The host whose link holds back a job whose steps take more than `factor` times as long as its baseline
    (seconds a step): the one host whose interfaces held back at least `minimum` packets a step (held: host -> packets
    a step over the same steps), every other host's less than 1/factor of it; else None."""
    if baseline_s is None or step_s <= factor * baseline_s or len(held) < 2:
        return None
    host, most = max(held.items(), key=lambda kv: kv[1])
    if most < minimum or any(v * factor >= most for h, v in held.items() if h != host):
        return None
    return host


def ranks_text(ranks) -> str:
    """'rank 4', 'ranks 4-7', 'ranks 1, 5'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class Pace:
    """The job's wall time a step from rank 0's heartbeats (its step and time), with each host's packets held back
    (its ranks' `link`) over the same steps: over the last STEPS steps, and the fastest such stretch seen."""

    def __init__(self):
        self.samples = deque(maxlen=1000)   # (time, step, {host: packets held back since the sample before})
        self.last = {}                      # host -> its counter at the last sample
        self.best = None                    # the fewest seconds a step over STEPS steps seen so far

    def add(self, now: float, step: int, counters: dict) -> Optional[tuple[float, dict]]:
        """Take a sample; (seconds a step, {host: packets held back a step}) over the last STEPS steps, or None."""
        grew = {}
        for h, n in counters.items():
            before = self.last.get(h)
            grew[h] = 0 if before is None else n - before if n >= before else n  # (a new qdisc counts from 0)
            self.last[h] = n
        if self.samples and step < self.samples[-1][1]:
            self.samples.clear()   # another world's steps (after a repair): from the start
        self.samples.append((now, step, grew))
        start = None
        for i in range(len(self.samples) - 1, -1, -1):
            if step - self.samples[i][1] >= STEPS:
                start = i
                break
        if start is None:
            return None
        t0, s0, _ = self.samples[start]
        took = (now - t0) / (step - s0)
        held = {}
        for _, _, g in list(self.samples)[start + 1:]:
            for h, n in g.items():
                held[h] = held.get(h, 0) + n
        held = {h: n / (step - s0) for h, n in held.items()}
        self.best = took if self.best is None else min(self.best, took)
        return took, held


class StragglerJudge:
    """Rank 0's watch over the others' step times (see the module doc); `look` at every heartbeat."""

    def __init__(self, factor: float, evict: bool):
        self.factor, self.evict = float(factor), evict
        self.since = {}      # pid -> its count of steps measured when it was first seen past the factor
        self.judged = set()  # pids reported already
        self.links = set()   # hosts whose link was reported already
        self.link_since = {}  # host -> the step at which its link was first seen holding the job back
        self.pace = Pace()

    def look(self, records: list[dict], world_size: int, stage_size: int, same_process, kill,
             host_of: Optional[Sequence[str]] = None) -> None:
        """`kill(record)` SIGKILLs a straggler with tft.straggler_evict and says whether this watch claimed it
        first (dsim.ft.hang._kill: the hang watch may have killed it as frozen already, and reported it).
        host_of[r]: rank r's host in this world (None: hosts unknown, every straggler a rank)."""
        if host_of is not None and len(host_of) != world_size:
            host_of = None
        slow = {r["pid"]: (r, median) for r, median in find_stragglers(records, world_size, stage_size, self.factor)}
        self.since = {pid: n for pid, n in self.since.items() if pid in slow}  # back under the factor: again
        ready = {}
        for pid, (r, median) in slow.items():
            first = self.since.setdefault(pid, r.get("timed", 0))
            if pid in self.judged or r.get("timed", 0) - first < STEPS or not same_process(pid, r.get("started")):
                continue
            ready[r["rank"]] = (r, median)
        hosts, alone = host_groups([r["rank"] for r, _ in slow.values()], host_of)
        for host, ranks in hosts:  # a host slow as a whole: judged once every one of its ranks is
            if all(k in ready for k in ranks):
                self._act_host(host, [ready[k] for k in ranks], kill)
        for k in alone:
            if k in ready:
                self.judged.add(ready[k][0]["pid"])
                self._act(*ready[k], kill)
        self._look_at_links(records, world_size, host_of, kill)

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

    def _act_host(self, host: str, slow: list, kill) -> None:
        """Every rank of `host` computes slower than the others of its stage: one straggler, the host."""
        rows = [r for r, _ in slow]
        self.judged.update(r["pid"] for r in rows)
        times = statistics.median(r["step_time"] / m for r, m in slow)
        ms = statistics.median(1000 * r["step_time"] for r in rows)
        median = statistics.median(1000 * m for _, m in slow)
        what = (f"host {host} ({ranks_text(r['rank'] for r in rows)}) computes its steps {times:.1f}x slower than the "
                f"other ranks of their stage ({ms:.0f} ms a step against a median of {median:.0f} ms, as of step "
                f"{max(r['step'] for r in rows)}; tft.straggler_factor {self.factor:g})")
        self._evict_host(host, rows, what, kill, cause="compute", step_ms=round(ms, 1), median_ms=round(median, 1))

    def _look_at_links(self, records: list[dict], world_size: int, host_of, kill) -> None:
        """Rank 0's own heartbeat gives the job's pace; its ranks' `link` each host's packets held back. A link is
        judged only while computing does not explain the pace: the slowest rank's computing, times the factor, is
        less than a step (a rank computing slower than its stage is the other verdict's; one preempted for a few
        steps on a loaded machine must not hide a slow link)."""
        if not host_of or len(set(host_of)) < 2:
            return
        mine = [r for r in records if r.get("world_size") == world_size and r.get("rank") == 0]
        if not mine:
            return
        counters = {}
        for r in records:
            if r.get("world_size") == world_size and r.get("link") is not None and r.get("rank") is not None:
                h = host_of[r["rank"]]
                counters[h] = max(counters.get(h, 0), r["link"])
        if len(counters) < len(set(host_of)):
            return  # a host whose interfaces cannot be read: no verdict
        baseline = self.pace.best
        measured = self.pace.add(mine[0]["time"], mine[0]["step"], counters)
        if measured is None:
            return
        took, held = measured
        computing = max((r["step_time"] for r in records if r.get("world_size") == world_size
                         and r.get("step_time") is not None), default=0.0)
        judge = computing * self.factor < took
        host, step = slow_link(took, baseline, held, self.factor) if judge else None, mine[0]["step"]
        self.link_since = {h: s for h, s in self.link_since.items() if h == host}  # back under: the count again
        if host is None or host in self.links or step - self.link_since.setdefault(host, step) < STEPS:
            return
        self.links.add(host)
        rows = [r for r in records if r.get("world_size") == world_size and r.get("rank") is not None
                and host_of[r["rank"]] == host]
        others = max(v for h, v in held.items() if h != host)
        what = (f"host {host} ({ranks_text(r['rank'] for r in rows)}): its link holds the job back: steps take "
                f"{took / baseline:.1f}x as long as before ({1000 * took:.0f} ms a step against {1000 * baseline:.0f} "
                f"ms, as of step {mine[0]['step']}) while the slowest rank computes {1000 * computing:.0f} ms a step, and "
                f"{host}'s network interface held "
                f"back {held[host]:.0f} packets a step on their way out, the other hosts' {others:.0f} "
                f"(tft.straggler_factor {self.factor:g})")
        self._evict_host(host, rows, what, kill, cause="link", step_ms=round(1000 * took, 1),
                         baseline_ms=round(1000 * baseline, 1), computing_ms=round(1000 * computing, 1),
                         held_per_step=round(held[host], 1))

    def _evict_host(self, host: str, rows: list, what: str, kill, **fields) -> None:
        """Report a host (a line and a `straggler` event) and, with evict, kill all its ranks as failed ranks."""
        judge = [r for r in rows if r["pid"] == os.getpid()]  # rank 0 on that host: it says so first, killed last
        event("straggler", any_rank=True, host=host, ranks=sorted(r["rank"] for r in rows),
              global_step=max(r["step"] for r in rows), factor=self.factor, evicted=self.evict, **fields)
        say(f"dsim: straggler watch: {what}: " + ("its ranks killed (SIGKILL), as failed ranks (tft.straggler_evict)"
                                                  if self.evict else "reported (tft.straggler_evict: false)"))
        if self.evict:
            for r in rows:
                if r not in judge:
                    kill(r)
            for r in judge:
                kill(r)


def egress_held() -> Optional[int]:
    """Packets this host's network interfaces held back or dropped on their way out so far, over the root queueing
    disciplines of every interface but loopback (overlimits + drops, as `tc -s qdisc` shows them), read through
    netlink (no privilege needed); None where it cannot be read. Counters of a qdisc replaced start again at 0."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
            s.settimeout(1.0)
            s.send(struct.pack("=IHHII", 36, _RTM_GETQDISC, 0x301, 1, 0) + bytes(20))  # REQUEST | DUMP
            total = 0
            while True:
                data, off = s.recv(1 << 16), 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if kind == _NLMSG_DONE:
                        return total
                    if kind == _NLMSG_ERROR or length < 16:
                        return None
                    if kind == _RTM_NEWQDISC:
                        total += _held(data, off, length)
                    off += (length + 3) & ~3
    except (OSError, struct.error):
        return None


_RTM_NEWQDISC, _RTM_GETQDISC, _NLMSG_DONE, _NLMSG_ERROR = 36, 38, 3, 2
_TCA_STATS = 3           # struct tc_stats: bytes u64, packets, drops, overlimits, bps, pps, qlen, backlog (u32)


def _held(data: bytes, off: int, length: int) -> int:
    """overlimits + drops of one RTM_NEWQDISC message: a root qdisc of an interface other than loopback."""
    ifindex, _, parent = struct.unpack_from("=iII", data, off + 20)
    if parent != 0xFFFFFFFF:
        return 0
    try:
        if socket.if_indextoname(ifindex) == "lo":
            return 0
    except OSError:
        return 0
    a = off + 36
    while a + 4 <= off + length:
        alen, atype = struct.unpack_from("=HH", data, a)
        if alen < 4:
            break
        if atype == _TCA_STATS and alen >= 4 + 20:
            drops, overlimits = struct.unpack_from("=II", data, a + 4 + 12)
            return drops + overlimits
        a += (alen + 3) & ~3
    return 0
