"""Sets of ranks as arithmetic progressions: what keeps checkpoint metadata independent of the world size.

A progression is Python's `range(start, stop, step)`, stored in JSON as `{"start": a, "stop": b, "step": c}`,
always in its canonical form (stop one past the last rank; step 1 for a single rank) so that equal sets are
equal documents. A rank set is a list of disjoint progressions, first ranks ascending.

Every set of ranks a layout produces is a few progressions whatever the world size: a replica set (group
info) is one, `range(shard * mp + m, world, mp * k)`; the ranks holding a slice are a union of replica sets,
hence at most mp x k progressions of step mp x k, or one of step 1 when the union covers every residue.
"""
from __future__ import annotations

from typing import Iterable

from .errors import CheckpointError


def canonical(r: range) -> range:
    """The same ranks as r, with stop one past the last (step 1 when r has one rank); r must not be empty."""
    if len(r) == 1:
        return range(r[0], r[0] + 1)
    if r.step < 0:
        r = r[::-1]
    return range(r[0], r[-1] + 1, r.step)


def to_json(r: range) -> dict:
    """{"start": a, "stop": b, "step": c} of a progression (canonical form)."""
    r = canonical(r)
    return {"start": r.start, "stop": r.stop, "step": r.step}


def from_json(obj, what: str = "progression") -> range:
    """The range a JSON progression stands for; CheckpointError (one line) when it is not one."""
    try:
        start, stop, step = obj["start"], obj["stop"], obj["step"]
    except (TypeError, KeyError):
        raise CheckpointError(f"{what} {obj!r} is not {{start, stop, step}}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop, step)) \
            or start < 0 or step < 1 or stop <= start:
        raise CheckpointError(f"{what} {obj!r} is not a progression of ranks (start >= 0, stop > start, step >= 1)")
    return range(start, stop, step)


def set_to_json(ranges: Iterable[range]) -> list:
    """A rank set (disjoint progressions) as a JSON list, first ranks ascending."""
    return [to_json(r) for r in sorted((canonical(r) for r in ranges), key=lambda r: r.start)]


def set_from_json(obj, what: str = "rank set") -> list:
    """The progressions of a JSON rank set (a list of progressions)."""
    if not isinstance(obj, list) or not obj:
        raise CheckpointError(f"{what} {obj!r} is not a non-empty list of progressions")
    return [from_json(p, what) for p in obj]


def members(ranges: Iterable[range]) -> list:
    """Every rank of a rank set, ascending (O(ranks): for small sets, or to check a few)."""
    return sorted(r for p in ranges for r in p)


def contains(ranges: Iterable[range], rank: int) -> bool:
    """Whether rank is in the rank set (O(progressions))."""
    return any(rank in p for p in ranges)


def size(ranges: Iterable[range]) -> int:
    """Number of ranks in a rank set of disjoint progressions."""
    return sum(len(p) for p in ranges)


def residues(indices: Iterable[int], period: int, world) -> list:
    """The ranks below world (an int) or in world (a range of ranks from its start) whose residue mod period,
    counted from the start, is one of indices, as progressions.

    All residues -> one progression of step 1; else one of step period per residue (at most period).
    """
    span = world if isinstance(world, range) else range(0, world)
    indices = sorted(set(i for i in indices if i < len(span)))
    if len(indices) == period or period == 1:
        return [canonical(span)]
    return [canonical(range(span.start + i, span.stop, period)) for i in indices]


def compress(ranks: Iterable[int], period: int = None) -> list:
    """A rank set from explicit ranks: the residue form when it fits (see residues), else greedy runs.

    The greedy form is O(ranks) in the worst case; the sets a layout makes always fit the residue form
    with period mp x k.
    """
    ranks = sorted(set(ranks))
    if not ranks:
        raise CheckpointError("an empty set of ranks")
    if period:
        world = ranks[-1] + 1
        candidate = residues({r % period for r in ranks}, period, world)
        if size(candidate) == len(ranks) and all(contains(candidate, r) for r in ranks):
            return candidate
    out, i = [], 0
    while i < len(ranks):
        if i + 1 == len(ranks):
            out.append(range(ranks[i], ranks[i] + 1))
            break
        step, j = ranks[i + 1] - ranks[i], i + 1
        while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
            j += 1
        out.append(range(ranks[i], ranks[j] + 1, step))
        i = j + 1
    return out

