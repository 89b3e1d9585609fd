"""The failure process of a campaign: exponential inter-failure times, a victim rank, a point in the step
and a kind, all drawn from the seed; and the fault plan file the jobs read (dsim.faults, fault.kind: plan).

Every combination of a campaign meets the same failures at the same offsets from its start (common
random numbers), so their differences are the schemes', not the dice's.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..faults import PLAN_KINDS, PLAN_POINTS, claim_entry, fired_marker

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "y": 365 * 86400}


def parse_duration(text: str) -> float:
    """`30s`, `10m`, `1.5h`, `2d`, `5y` or plain seconds -> seconds (> 0); ValueError naming the text."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdy]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 10m, 2h, 5y; more than 0)")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


@dataclass(frozen=True)
class Failure:
    offset: float  # seconds after the combination's start
    rank: int      # the victim (a training rank)
    kind: str      # kill | uce | corrupt (a kill, and the victim's newest shard on disk damaged) | node (every
                   # rank of the victim's node killed at once) | hang (the victim stops: SIGSTOP) | stuck (the
                   # victim's training stops, its process runs) | deadlock (the victim waits for a message no
                   # rank sends, outside the job's communicators: every rank waits; the watch's break kills it) |
                   # unmatched (the same, on the job's world: the break frees every rank) | sdc (a bit flips) |
                   # slow (the victim computes slower from then on: a straggler)
    at: str        # the point of the step it strikes: forward | allreduce | update


def draw(seed: int, mtbf: float, duration: float, kinds, ranks: int) -> list[Failure]:
    """The failures within `duration` of a Poisson process of mean inter-failure time `mtbf`."""
    rng = np.random.default_rng([seed, 19])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(mtbf))
        if t >= duration:
            return out
        out.append(Failure(round(t, 3), int(rng.integers(ranks)), str(kinds[rng.integers(len(kinds))]),
                           PLAN_POINTS[rng.integers(len(PLAN_POINTS))]))


def write_plan(path, failures: list, start: float, node_size: int = 1, slowdown: float = None) -> Path:
    """The fault plan of one combination started at `start` (Unix seconds), for $DSIM_FAULT_PLAN; a `node`
    failure kills the victim's node of `node_size` ranks, a `slow` one makes its victim compute `slowdown`
    times slower (dsim.faults' default when None)."""
    path = Path(path)
    faults = [{"time": start + f.offset, "rank": f.rank, "kind": f.kind, "at": f.at,
               **({"node_size": node_size} if f.kind == "node" else {}),
               **({"slowdown": slowdown} if f.kind == "slow" and slowdown else {})} for f in failures]
    path.write_text(json.dumps({"format": "dsim-fault-plan/1", "faults": faults}, indent=1))
    Path(f"{path}.fired").mkdir(exist_ok=True)
    return path


def fired(path) -> list[dict]:
    """The entries of the plan at `path` that fired, as their markers say (index, time, rank, global_step, ...);
    not those the campaign claimed (claim_unfired)."""
    n = len(json.loads(Path(path).read_text())["faults"])
    out = []
    for i in range(n):
        try:
            marker = json.loads(fired_marker(path, i).read_text())
        except (OSError, ValueError):  # not fired (or its marker half-written as the rank died: still fired)
            if fired_marker(path, i).exists():
                out.append({"index": i})
            continue
        if not marker.get("claimed"):
            out.append(marker)
    return out


def claim_unfired(path) -> list[int]:
    """Take every entry of the plan at `path` that has not fired yet, so none fires from now on (its marker
    says it was claimed); the indices claimed."""
    n = len(json.loads(Path(path).read_text())["faults"])
    Path(f"{path}.fired").mkdir(exist_ok=True)
    return [i for i in range(n) if claim_entry(path, i, {"index": i, "claimed": True})]


def to_dicts(failures: list) -> list[dict]:
    return [asdict(f) for f in failures]


__all__ = ["Failure", "PLAN_KINDS", "draw", "fired", "parse_duration", "to_dicts", "write_plan"]
