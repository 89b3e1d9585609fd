"""Survivability: which sets of simultaneous rank failures still leave a complete copy of the state.

A piece of state is lost exactly when every rank holding it fails. With group info, the holders of a
rank's slices are its replica set, so the *minimal fatal sets* are the replica sets themselves (for any
family of holder sets: its minimal members). A failure set F is survivable iff it contains no fatal set.
Nothing here enumerates the 2^n subsets of ranks:

- any c < (smallest fatal set) failures are survivable, so the largest failure count always survivable
  is min |fatal set| - 1;
- some c failures are survivable up to n - (number of fatal sets) when they are disjoint (leave one
  rank of each set alive);
- how many of the C(n, c) failure sets of size c survive follows by inclusion-exclusion over the
  fatal sets wholly contained (one term per count of contained sets of each size), for the few c
  just above the always-survivable count: a regular layout of 65,536 ranks takes milliseconds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import comb
from typing import Iterable, Optional, Union

from ..parallel.layout import ParallelLayout
from . import progression
from .group_info import replica_sets
from .plan import save_plan

ROWS = 6  # failure counts described beyond the always-survivable ones, by default


@dataclass(frozen=True)
class Survivability:
    """The failure sets a layout (or a checkpoint's group info) survives, described by its minimal fatal sets."""

    world_size: int
    fatal_sets: list                   # minimal fatal sets, sorted tuples of ranks, ordered by first rank
    always: int                        # the largest c such that ANY c simultaneous failures leave a full copy
    at_best: int                       # the largest c such that SOME c simultaneous failures leave a full copy
    survivors: dict = field(default_factory=dict)  # c -> how many of the C(n, c) failure sets of size c survive,
                                                   # for c from always + 1 (below, all do) to a few beyond

    def survives(self, failed: Iterable[int]) -> bool:
        """Whether the ranks in `failed` may all fail at once and a complete copy of the state remains."""
        failed = set(failed)
        return not any(failed.issuperset(s) for s in self.fatal_sets)

    def fraction(self, c: int) -> Optional[float]:
        """Share of the failure sets of size c that are survivable (None when not computed)."""
        if c <= self.always:
            return 1.0
        if c > self.at_best:
            return 0.0
        if c not in self.survivors:
            return None
        return self.survivors[c] / comb(self.world_size, c)

    def lines(self, show: int = 4) -> list[str]:
        """A plain-English description: one line per failure count, fatal sets listed (at most `show`)."""
        n, fatal = self.world_size, self.fatal_sets
        out = []
        if self.always >= 1:
            out.append("any single rank" if self.always == 1 else f"any 1 to {self.always} ranks")
        for c in sorted(self.survivors):
            if c <= self.always or c > self.at_best:
                continue
            relevant = [s for s in fatal if len(s) <= c]
            sizes = {len(s) for s in relevant}
            which = _list_sets(relevant, show)
            how = "except" if sizes == {c} else "except those containing"
            noun = "rank" if c == 1 else "ranks"
            total = comb(n, c)
            share = (f"{self.survivors[c]:,} of {total:,}" if total < 10**12 else
                     f"{self.survivors[c] / total:.6%} of the C({n:,}, {c})")
            out.append(f"any {_count(c)} {noun} {how} {which} ({share} survive)")
        last = max(self.survivors, default=0)
        if last < self.at_best:
            out.append(f"{last + 1} to {self.at_best} ranks: only those sparing a rank of every fatal set")
        if self.at_best < n:
            out.append(f"{self.at_best + 1} or more ranks: never (some replica set is then wholly lost)")
        return out

    def nodes(self, node_size: int) -> list[dict]:
        """Each node (node_size consecutive ranks, ranks 0..n-1 the first) and the fatal sets wholly on it:
        losing the node, as a lost server loses every rank on it, loses those pieces of state."""
        out = [{"node": [first, min(first + node_size, self.world_size) - 1], "fatal_sets": []}
               for first in range(0, self.world_size, node_size)]
        for s in self.fatal_sets:  # (sorted) wholly on a node: its first and last rank on the same one
            if s[0] // node_size == s[-1] // node_size:
                out[s[0] // node_size]["fatal_sets"].append(list(s))
        return out

    def node_lines(self, node_size: int, show: int = 4) -> list[str]:
        """Whether each node's loss leaves a complete copy: one line for all when every node's does."""
        nodes = self.nodes(node_size)
        lost = [x for x in nodes if x["fatal_sets"]]
        if not lost:
            return [f"any one of the {len(nodes)} nodes: survivable (every replica set keeps a rank on another node)"]
        out = [f"node {x['node'][0] // node_size} (ranks {x['node'][0]}-{x['node'][1]}): fatal (every rank of "
               f"{_list_sets([tuple(s) for s in x['fatal_sets']], show)} is on it)" for x in lost[:show]]
        if len(lost) > show:
            out.append(f"and {len(lost) - show:,} more of the {len(nodes):,} nodes")
        return out

    def hosts(self, host_of) -> list[dict]:
        """Each host (host_of[r]: rank r's, e.g. a commit record's hosts), its ranks, and the fatal sets wholly on
        it: losing that host alone (its ranks failing at once) loses those pieces of state."""
        lost = host_losses(self.fatal_sets, host_of)
        return [{"host": h, "ranks": ranks, "fatal_sets": [list(s) for s in lost.get(h, [])]}
                for h, ranks in ranks_by_host(host_of).items()]

    def host_lines(self, host_of, tensors: dict = None, show: int = 4) -> list[str]:
        """Whether each host's loss leaves a complete copy: one line for all when every host's does; else a line per
        fatal host naming the sets wholly on it and (tensors: name -> holder sets) some tensors they hold."""
        hosts = self.hosts(host_of)
        lost = [x for x in hosts if x["fatal_sets"]]
        if not lost:
            return [f"any one of the {len(hosts)} hosts: survivable (every replica set keeps a rank on another host)"]
        out = []
        for x in lost[:show]:
            sets = {tuple(s) for s in x["fatal_sets"]}
            names = [n for n, holders in (tensors or {}).items() if any(tuple(sorted(h)) in sets for h in holders)]
            names = [n for n in names if not n.startswith(("moment", "moments."))] or names
            out.append(f"{x['host']} (ranks {ranks_text(x['ranks'])}): fatal (every rank of "
                       f"{_list_sets([tuple(s) for s in x['fatal_sets']], show)} is on it"
                       + (f": {', '.join(names[:3])}{', …' if len(names) > 3 else ''})" if names else ")"))
        if len(lost) > show:
            out.append(f"and {len(lost) - show:,} more of the {len(hosts):,} hosts")
        return out

    def summary(self) -> str:
        """One line: the minimal fatal sets and the two headline numbers."""
        return (f"{self.world_size} ranks, {len(self.fatal_sets)} minimal fatal set(s) "
                f"(a full replica set failing): {_list_sets(self.fatal_sets, 4)}; always survivable: "
                f"{self.always} simultaneous failure(s); at best: {self.at_best}")

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "fatal_sets": [list(s) for s in self.fatal_sets],
                "always_survivable": self.always, "at_best_survivable": self.at_best,
                "survivors": {str(c): v for c, v in sorted(self.survivors.items())},
                "total": {str(c): comb(self.world_size, c) for c in sorted(self.survivors)}}


def survivability(layout_or_sets: Union[ParallelLayout, Iterable[Iterable[int]]], world_size: Optional[int] = None,
                  rows: int = ROWS) -> Survivability:
    """What simultaneous rank failures a layout survives, from its replica sets (or any holder sets given).

    `layout_or_sets` is a ParallelLayout or the sets of ranks holding each piece of state (e.g.
    `replica_sets(layout)`, or the group info read from a checkpoint). `world_size` defaults to one more
    than the highest rank named. Survivor counts are computed for failure counts up to
    always + rows (and never past at_best + 1).
    """
    if isinstance(layout_or_sets, ParallelLayout):
        world_size = layout_or_sets.world_size if world_size is None else world_size
        layout_or_sets = replica_sets(layout_or_sets)
    holders = {tuple(sorted(set(int(r) for r in s))) for s in layout_or_sets}
    if not holders or () in holders:
        raise ValueError("survivability needs non-empty holder sets")
    n = max(max(s) for s in holders) + 1 if world_size is None else world_size
    if any(s[0] < 0 or s[-1] >= n for s in holders):
        raise ValueError(f"holder sets name ranks outside a world of {n}")
    fatal = _minimal(holders)
    always = min(len(s) for s in fatal) - 1
    disjoint = sum(len(s) for s in fatal) == len({r for s in fatal for r in s})
    at_best = n - len(fatal) if disjoint else _at_best_small(fatal, n)
    top = min(at_best + 1, always + rows, n)
    first = always + 1  # below that every failure set survives: C(n, c) of C(n, c)
    survivors = _survivor_counts(fatal, n, first, top) if disjoint else _survivor_counts_small(fatal, n, first, top)
    return Survivability(n, fatal, always, at_best, survivors)


def _minimal(holders: set) -> list:
    """The holder sets that contain no other holder set (the minimal fatal sets), ordered by first rank.

    Replica sets partition the ranks, so this is quick: only sets sharing a rank can contain each other.
    """
    sets = list(holders)
    by_rank = {}
    for i, s in enumerate(sets):
        for r in s:
            by_rank.setdefault(r, []).append(i)
    out = []
    for i, s in enumerate(sets):
        smaller = {j for r in s for j in by_rank[r] if len(sets[j]) < len(s)}
        if not any(set(sets[j]) <= set(s) for j in smaller):
            out.append(s)
    return sorted(out)


def _survivor_counts(fatal: list, n: int, first: int, top: int) -> dict:
    """c -> surviving failure sets of size c (first <= c <= top), for disjoint fatal sets.

    Inclusion-exclusion over how many fatal sets of each size a failure set contains wholly:
    sum over (j_m) of prod C(F_m, j_m) * (-1)^(sum j_m) * C(n - sum j_m m, c - sum j_m m), where F_m
    fatal sets have m ranks. A regular layout has one size, so that is c/m + 1 terms per c.
    """
    sizes = sorted(Counter(len(s) for s in fatal).items())

    def terms(i, c, ranks, sign, weight):
        if i == len(sizes):
            return sign * weight * comb(n - ranks, c - ranks)
        m, count = sizes[i]
        return sum(terms(i + 1, c, ranks + j * m, sign * (-1) ** j, weight * comb(count, j))
                   for j in range(min(count, (c - ranks) // m) + 1))

    return {c: terms(0, c, 0, 1, 1) for c in range(first, top + 1)}


def ranks_by_host(host_of) -> dict:
    """host -> its ranks ascending, hosts in the order of their first rank (host_of[r]: rank r's host)."""
    out = {}
    for r, h in enumerate(host_of):
        out.setdefault(h, []).append(r)
    return out


def host_losses(sets, host_of) -> dict:
    """host -> the sets of ranks (sorted tuples, in the order given) whose every rank is on that host: what losing
    that host alone loses, when each set holds a piece of state. Sets of one rank count too."""
    out = {}
    for s in sets:
        hosts = {host_of[r] for r in s}
        if len(hosts) == 1:
            out.setdefault(hosts.pop(), []).append(tuple(sorted(s)))
    return out


def single_host_slices(layout: ParallelLayout, specs, host_of) -> list[tuple]:
    """(parameter, its holders, host) of every distinct slice of a parameter held by more than one rank, all on one
    host: a replicated slice that losing that host loses (optimizer state is held as its parameter is). Slices held
    by one rank only (no replica: optimizer_shard = data_parallel) are the save's own warning, not listed here."""
    plan = save_plan(layout, specs)
    out = []
    for p in plan.slices:
        ranks = progression.members(plan.holders(p))
        if len(ranks) > 1 and len({host_of[r] for r in ranks}) == 1:
            out.append((p.name, ranks, host_of[ranks[0]]))
    return out


def host_warning(layout: ParallelLayout, specs, host_of) -> Optional[str]:
    """The one line rank 0 prints at start when every holder of some slice is on one host (None when none is, or
    when the run is on one host): the first such slice's parameter and host, and how many more. None too for a
    layout without replicas (optimizer_shard = data_parallel): any host's loss loses state, whatever the mapping,
    and the save says that a lost shard cannot be repaired."""
    if len(set(host_of)) < 2 or layout.optimizer_shard == layout.data_parallel:
        return None
    found = single_host_slices(layout, specs, host_of)
    if not found:
        return None
    name, ranks, host = found[0]
    more = f" (and {len(found) - 1} more slice(s) held on one host only)" if len(found) > 1 else ""
    return (f"dsim: warning: every rank holding a slice of {name} ({{{','.join(map(str, ranks))}}}) is on host "
            f"{host}: losing {host} loses it{more}; map ranks to hosts so that replicas sit on different hosts "
            "(docs/cluster.md: which mapping)")


def ranks_text(ranks) -> str:
    """0-3, or 0,2,4,6 (runs of consecutive ranks as a-b), at most 8 parts shown."""
    ranks, parts, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]},{ranks[j]}" if j == i + 1 else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts[:8]) + (f",… ({len(ranks):,} ranks)" if len(parts) > 8 else "")


def _brute_force_guard(n: int) -> None:
    if n > 20:
        raise ValueError(f"overlapping holder sets over {n} ranks: counting survivors needs 2^{n} subsets")


def _survivor_counts_small(fatal: list, n: int, first: int, top: int) -> dict:
    _brute_force_guard(n)
    masks = [sum(1 << r for r in s) for s in fatal]
    counts = Counter(bin(f).count("1") for f in range(1 << n) if not any(f & m == m for m in masks))
    return {c: counts.get(c, 0) for c in range(first, top + 1)}


def _at_best_small(fatal: list, n: int) -> int:
    _brute_force_guard(n)
    masks = [sum(1 << r for r in s) for s in fatal]
    return max(bin(f).count("1") for f in range(1 << n) if not any(f & m == m for m in masks))


def _count(c: int) -> str:
    words = ["single", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    return words[c - 1] if c <= len(words) else f"{c:,}"


def _list_sets(sets: list, show: int) -> str:
    shown = ", ".join("{" + ",".join(map(str, s)) + "}" for s in sets[:show])
    return shown + (f" and {len(sets) - show:,} more" if len(sets) > show else "")


def parse_layout(text: str) -> ParallelLayout:
    """`dp=2,mp=4,k=1` or `pp=2,dp=2,mp=2` (also data_parallel=, model_parallel=, optimizer_shard=,
    pipeline_stage=) -> ParallelLayout."""
    names = {"dp": "data_parallel", "mp": "model_parallel", "k": "optimizer_shard", "pp": "pipeline_stage",
             "data_parallel": "data_parallel", "model_parallel": "model_parallel", "optimizer_shard": "optimizer_shard",
             "pipeline_stage": "pipeline_stage"}
    values = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in names or not value.strip().isdigit():
            raise ValueError(f"layout {text!r}: expected items like dp=2,mp=4,k=1, got {item!r}")
        values[names[key.strip()]] = int(value)
    return ParallelLayout(**values)
