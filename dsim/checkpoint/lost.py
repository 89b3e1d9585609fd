"""Lost slices: which slices of a committed checkpoint no usable file holds any more, told as a person needs it.

Pure (no MPI, no files). A commit record lists every distinct slice of every tensor once with the ranks whose file
holds it (record.py, `slices`); recovery finds which ranks' files are unusable, whole or for some tensors. A slice is
lost when every holder's file is unusable for it: no replica is left to send it (a lost disk under a layout without
replicas, data_parallel = 1 or optimizer_shard = data_parallel). What is lost is named by tensor and slice index
(the slice's place among the tensor's distinct slices, from 0, the record's order: the model-parallel index for a
layer split over mp), with the ranks that held it and their hosts (the record's `hosts`, as MPI found them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from . import progression
from .survivability import ranks_text


@dataclass(frozen=True)
class LostSlice:
    """One distinct slice of a tensor that no usable file holds."""

    kind: str        # "params" | "optimizer"
    tensor: str      # layer1.weight, moments.layer1.weight
    index: int       # its place among the tensor's distinct slices, from 0
    count: int       # how many distinct slices the tensor has
    offsets: tuple
    extents: tuple
    holders: tuple   # the ranks whose file held it, ascending


def lost_slices(record: dict, damage: dict) -> list[LostSlice]:
    """Every slice of a committed checkpoint whose every holder's file is unusable for it, in the record's order.

    damage: rank -> None (its whole file is unusable: missing, not HDF5, not the file committed) or the names of
    the tensors damaged in it (`layer1.weight`, `moments.layer1.weight`). Ranks not in damage are whole.
    """
    def unusable(rank: int, name: str) -> bool:
        return rank in damage and (damage[rank] is None or name in damage[rank])

    entries = record.get("slices") or []
    counts, seen = {}, {}
    for e in entries:
        counts[e["tensor"]] = counts.get(e["tensor"], 0) + 1
    out = []
    for e in entries:
        kind, name = e["tensor"].split("/", 1)
        index = seen[e["tensor"]] = seen.get(e["tensor"], -1) + 1
        holders = tuple(progression.members(progression.set_from_json(e["holders"], "holders")))
        if all(unusable(r, name) for r in holders):
            out.append(LostSlice(kind, name, index, counts[e["tensor"]], tuple(e["offsets"]), tuple(e["extents"]),
                                 holders))
    return out


def summary(lost: Sequence[LostSlice], host_of: Optional[Sequence[str]] = None) -> str:
    """One phrase: how many slices of how many tensors are lost, and which ranks (on which hosts) held them alone."""
    ranks = sorted({r for s in lost for r in s.holders})
    tensors = {s.tensor for s in lost}
    return (f"{len(lost)} slice(s) of {len(tensors)} tensor(s) have no copy left: every one was held only by "
            f"{_where(ranks, host_of)}")


def describe(lost: Sequence[LostSlice], host_of: Optional[Sequence[str]] = None) -> list[str]:
    """Lines naming every lost slice: per set of holders' hosts, the parameters by slice index, and their
    optimizer state as `the same slices of` when it is lost with them (it always is: it is held as they are)."""
    groups = {}
    for s in lost:
        hosts = tuple(sorted({host_of[r] for r in s.holders})) if host_of else ()
        groups.setdefault(hosts, []).append(s)
    lines = []
    for hosts, group in groups.items():
        ranks = sorted({r for s in group for r in s.holders})
        sets = sorted({s.holders for s in group})
        who = ("one rank a slice" if all(len(h) == 1 for h in sets) else
               "held by " + ", ".join("{" + ",".join(map(str, h)) + "}" for h in sets[:6])
               + (f" and {len(sets) - 6} more rank sets" if len(sets) > 6 else ""))
        params = [s for s in group if s.kind == "params"]
        optim = [s for s in group if s.kind != "params"]
        parts = _by_indices(params)
        slots = sorted({s.tensor.split(".", 1)[0] for s in optim})
        shadow = {(f"{slot}.{s.tensor}", s.index) for s in params for slot in slots}
        if optim and params and {(s.tensor, s.index) for s in optim} == shadow:
            parts.append(f"and the same slices of their optimizer state ({', '.join(slots)})")
        elif optim:
            parts += _by_indices(optim)
        lines.append(f"held only by {_where(ranks, host_of)} ({len(group)} slice(s), {who}; slices numbered from "
                     "0): " + "; ".join(parts))
    return lines


def _by_indices(slices: Sequence[LostSlice]) -> list[str]:
    """'layer1.weight, layer2.weight: slices 4-7 of 8' per group of tensors that lost the same slice indices."""
    per = {}
    for s in slices:
        per.setdefault(s.tensor, (s.count, []))[1].append(s.index)
    groups = {}
    for name, (count, indices) in per.items():
        groups.setdefault((count, tuple(sorted(indices))), []).append(name)
    out = []
    for (count, indices), names in groups.items():
        which = (f"slice {indices[0]}" if len(indices) == 1 else f"slices {ranks_text(indices)}")
        out.append(f"{', '.join(names)}: {which} of {count}" if count > 1 else
                   f"{', '.join(names)} (whole, one slice)")
    return out


def _where(ranks: Sequence[int], host_of: Optional[Sequence[str]]) -> str:
    """'ranks 4-7 on node2', 'rank 3', 'ranks 0, 4 on node1, node2'."""
    noun = "rank" if len(ranks) == 1 else "ranks"
    text = f"{noun} {ranks_text(ranks)}"
    if not host_of:
        return text
    hosts = list(dict.fromkeys(host_of[r] for r in ranks))
    return f"{text} on {', '.join(hosts)}" if len(hosts) <= 4 else f"{text} on {len(hosts)} hosts"
