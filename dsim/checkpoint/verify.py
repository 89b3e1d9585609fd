"""Verify a committed checkpoint offline: every file, every checksum, every slice covered exactly once.

For a checkpoint of a directory (catalog.Checkpoint):
1. every rank's file named by the commit record exists, is a dsim checkpoint of the committed step and
   of that rank, and every dataset's CRC-32 matches its data;
2. for every parameter and optimizer state, the distinct slices held by the ranks tile the global shape:
   no gap, no overlap (coverage.py, from the offsets/extents attributes), and every rank that should hold a
   tensor does: its holders in the commit record's slices, else every rank of the pipeline stages holding it
   (a pipeline stage holds only its own layers' tensors);
3. the ranks of each replica set (group info) hold the same slices with the same checksums, so any one
   of them can stand in for another, as recovery assumes;
4. every file holds exactly the slices the commit record's `slices` give its rank (record.py).
Step 1 also checks the metadata: every attribute and append_info value against the file's checksum table
(format 2), the file's content digest against the one committed (the digest file, itself checked against
the record's pin), and the scalar state (global step, epoch, data position, optimizer step) against the
record. What could not be checked (format 1 files, a record without digests, a record of the format
before without slices) is a note or skipped, not a problem.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import h5py

from . import commit as cm, progression, record as rec
from .catalog import Checkpoint, ShardIndex, group_sets, read_index
from .coverage import coverage
from .errors import CheckpointError
from .format import crc32
from .group_info import group_info_list


@dataclass
class Verification:
    """Problems found (one line each; empty when clean) and what was checked."""

    checkpoint: str
    problems: list = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    checksums: int = 0
    replica_sets: list = field(default_factory=list)
    notes: list = field(default_factory=list)   # what could not be checked (one line each)

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "clean": self.clean, "problems": self.problems, "files": self.files,
                "tensors": self.tensors, "checksums": self.checksums, "replica_sets": self.replica_sets,
                "notes": self.notes}


def bad_checksums(path) -> list[str]:
    """Datasets of a checkpoint file whose data no longer matches their CRC-32 attribute."""
    bad = []
    with h5py.File(path, "r") as f:
        for kind in ("params", "optimizer"):
            for name, ds in f.get(kind, {}).items():
                try:
                    if crc32(ds[()]) != int(ds.attrs["crc32"]):
                        bad.append(f"{kind}/{name}")
                except Exception:
                    bad.append(f"{kind}/{name} (unreadable)")
    return bad


def indexes_of(checkpoint: Checkpoint) -> dict:
    """rank -> ShardIndex, or the one-line reason its file cannot be read."""
    out = {}
    for s in checkpoint.shards:
        try:
            out[s.rank] = read_index(s.path)
        except CheckpointError as e:
            out[s.rank] = str(e)
    return out


def verify(checkpoint: Checkpoint, checksums: bool = True) -> Verification:
    """Check one committed checkpoint (steps 1-3 above); checksums=False reads attributes only."""
    v = Verification(checkpoint.name)
    record = checkpoint.record
    indexes = indexes_of(checkpoint)
    digests, why = rec.read_digests(checkpoint.directory, record)
    if why:
        v.problems.append(f"{checkpoint.name}: {why}")
    unchecked = []
    good = {}
    for s in checkpoint.shards:
        ix = indexes[s.rank]
        if not isinstance(ix, ShardIndex):
            v.problems.append(f"rank {s.rank}: {ix}")
            continue
        v.files += 1
        meta = ix.meta
        if ix.meta_problems:
            v.problems.append(f"rank {s.rank}: metadata checksum mismatch in {s.relpath}: {', '.join(ix.meta_problems)}")
        elif not ix.meta_checked:
            unchecked.append(s.rank)
        expected = digests.get(cm.digest_key(record, s.rank)) if digests is not None else None
        if expected is not None and ix.digest != expected and not ix.meta_problems:
            v.problems.append(f"rank {s.rank}: {s.relpath} is not the file committed (its content digest differs "
                              f"from the commit record's; it holds rank {meta.get('rank')}'s shard of global step "
                              f"{meta.get('global_step')})")
        mismatch = cm.state_mismatch(meta, record)
        if mismatch:
            v.problems.append(f"rank {s.rank}: {s.relpath} {mismatch}")
        if not record.get("integrated_save") and meta.get("rank") != s.rank:
            v.problems.append(f"rank {s.rank}: {s.relpath} holds rank {meta.get('rank')}'s shard")
        if checksums:
            try:
                bad = bad_checksums(s.path)
            except Exception:
                bad = ["(file unreadable)"]
            v.checksums += len(ix.tensors)
            v.problems += [f"rank {s.rank}: checksum mismatch in {s.relpath}: {b}" for b in bad]
        good[s.rank] = ix
    if unchecked:
        v.notes.append(f"the metadata of the file(s) of rank(s) {_ranks(unchecked)} (format 1: no metadata "
                       "checksums)")
    if digests is None and not why and good:
        v.notes.append("the file digests (the commit record has none: written before checkpoint format 2)")
    if not good:
        return v
    # 2. coverage of every tensor by the distinct slices of all ranks
    names = sorted({n for ix in good.values() for n in ix.tensors})
    v.tensors = len(names)
    planned, malformed = planned_slices(record)
    holders = {}  # tensor -> the rank sets holding its slices, from the record
    for tensor, _, _, ranks in planned or ():
        holders.setdefault(tensor, []).append(ranks)
    stages = checkpoint.layout()
    for name in names:
        held = {r: ix.tensors[name] for r, ix in good.items() if name in ix.tensors}
        expected = ({r for r in good if any(progression.contains(h, r) for h in holders.get(name, ()))}
                    if planned is not None else stage_holders(stages, held, good))
        lacking = sorted(expected & set(good) - set(held))
        if lacking:
            v.problems.append(f"{name}: missing from the file(s) of rank(s) {_ranks(lacking)}")
        shapes = {t[0] for t in held.values()}
        if len(shapes) > 1:
            v.problems.append(f"{name}: ranks disagree on the global shape: {sorted(shapes)}")
            continue
        bad_shape = [r for r, t in held.items() if tuple(t[4]) != tuple(t[1].extents)]
        if bad_shape:
            v.problems.append(f"{name}: data shape differs from the stored extents on rank(s) {_ranks(bad_shape)}")
        v.problems += coverage(shapes.pop(), [(t[1].offsets, t[1].extents) for t in held.values()]).problems(name)
    # 3. replica sets hold identical slices
    v.replica_sets = group_sets(good, checkpoint)
    if not record.get("integrated_save"):
        lists = {}
        for r, ix in good.items():
            try:
                lists[r] = group_info_list(ix.meta.get("group_info"))
            except CheckpointError:
                lists[r] = None
        for r, gi in lists.items():
            if gi is None or r not in gi:
                v.problems.append(f"rank {r}: group info {good[r].meta.get('group_info')!r} does not include the "
                                  "rank itself")
                continue
            for m in gi:
                if m in good and lists[m] != gi:
                    v.problems.append(f"rank {r}: group info {gi} disagrees with rank {m}'s {lists[m]}")
    for group in v.replica_sets:
        members = [r for r in group if r in good]
        for r in members[1:]:
            a, b = good[members[0]].tensors, good[r].tensors
            differ = sorted(n for n in set(a) & set(b) if (a[n][1], a[n][2]) != (b[n][1], b[n][2]))
            if differ:
                v.problems.append(f"replica set {_set(group)}: ranks {members[0]} and {r} hold different "
                                  f"slices or data of {', '.join(differ[:3])}" + (" …" if len(differ) > 3 else ""))
    if malformed or planned is not None:
        v.problems += [malformed] if malformed else slice_problems(planned, good)
    return v


def planned_slices(record: dict) -> tuple:
    """([(tensor, offsets, extents, holders)] of the commit record's slices, or None for a record of the format before,
    which has none; the one-line problem when they are malformed, else None)."""
    try:
        return [(s["tensor"], tuple(s["offsets"]), tuple(s["extents"]),
                 progression.set_from_json(s["holders"], f"holders of {s['tensor']}")) for s in record["slices"]], None
    except (KeyError, TypeError, CheckpointError) as e:
        return None, (None if "slices" not in record else
                      f"{record.get('name')}: the commit record's slices are malformed ({e})")


def stage_holders(layout, held: dict, good: dict) -> set:
    """Without planned slices: the ranks that should hold a tensor held by `held`: every rank of each pipeline
    stage one of its holders is on (every rank when the layout is unknown or has one stage)."""
    if layout is None or layout.pipeline_stage <= 1 or any(h >= layout.world_size for h in held):
        return set(good)
    return {r for h in held for r in layout.stage_ranks(layout.coords(h).stage)}


def slice_problems(planned: list, good: dict) -> list:
    """Step 4: the files against the commit record's slices (planned_slices; records of the format before have
    none: nothing to check)."""
    out = []
    for r, ix in sorted(good.items()):
        want = {(t, o, e) for t, o, e, holders in planned if progression.contains(holders, r)}
        have = {(t, piece.offsets, piece.extents) for t, (_, piece, _, _, _) in ix.tensors.items()}
        if want != have:
            extra, lacking = sorted(have - want), sorted(want - have)
            out.append(f"rank {r}: holds other slices than its commit record names"
                       + (f"; not named: {_pieces(extra)}" if extra else "")
                       + (f"; missing: {_pieces(lacking)}" if lacking else ""))
    return out


def _pieces(pieces) -> str:
    text = ", ".join(f"{t} at {list(o)}" for t, o, _ in pieces[:3])
    return text + (" …" if len(pieces) > 3 else "")


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks))


def _set(group) -> str:
    return "{" + ",".join(map(str, group)) + "}"
