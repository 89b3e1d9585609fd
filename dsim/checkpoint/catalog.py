"""Catalog: what checkpoints a directory holds, read from commit records and file attributes (no tensor data).

A checkpoint directory is any directory holding `<name>.commit` records (commit.py) and/or `rank_<r>/`
shard directories: the training run's `checkpoints/`, and directories written with the same protocol
elsewhere (e.g. `ttp_checkpoints/tft_saved_checkpoints-step_{n}/`). A commit record names each rank's
file (`files`: a template, record.py); files under `rank_*/` that no record names are leftovers of a save
that never committed.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import h5py

from . import commit as cm, progression, record as rec
from .format import FORMAT, JSON_ATTRS, META_ATTR, _plain, check_meta, content_digest
from .group_info import group_info_list, replica_sets
from .errors import CheckpointError
from ..parallel.layout import LayoutError, ParallelLayout, Slice

SKIP_SUFFIXES = (".json", ".meta", ".commit", ".digests")  # group info, graph meta, commit records, digest files


@dataclass
class ShardFile:
    """One rank's file of a checkpoint, as found on disk."""

    rank: int
    path: Path                       # absolute or relative to the working directory, as given
    relpath: str                     # relative to the checkpoint directory
    size: Optional[int] = None       # None: missing


@dataclass
class Checkpoint:
    """A checkpoint of a directory: its commit record (committed) or the files an interrupted save left."""

    directory: Path
    name: str
    committed: bool
    record: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)   # ShardFile per rank

    @property
    def global_step(self) -> Optional[int]:
        return self.record.get("global_step")

    @property
    def size(self) -> int:
        return sum(s.size or 0 for s in self.shards)

    @property
    def present(self) -> int:
        return sum(s.size is not None for s in self.shards)

    def layout(self) -> Optional[ParallelLayout]:
        try:
            return ParallelLayout(**self.record["layout"])
        except (KeyError, TypeError, LayoutError):
            return None


@dataclass
class CheckpointDir:
    path: Path
    checkpoints: list                # committed ones oldest first (global_step, sequence), then uncommitted
    notes: list = field(default_factory=list)     # unreadable commit records and the like (one line each)
    problems: list = field(default_factory=list)  # what makes the directory not clean

    @property
    def committed(self) -> list:
        return [c for c in self.checkpoints if c.committed]


def is_checkpoint_dir(path: Path) -> bool:
    """Holds commit records or rank_<r>/ shard directories."""
    return path.is_dir() and (any(path.glob("*.commit")) or any(p.is_dir() for p in path.glob("rank_*")))


def find_checkpoint_dirs(root) -> list[Path]:
    """root itself if it is a checkpoint directory, and those among its subdirectories two levels down
    (e.g. runs/x/checkpoints, runs/x/ttp_checkpoints/tft_saved_checkpoints-step_12), sorted by path."""
    root = Path(root)
    found, level = [], [root]
    for depth in range(3):
        nxt = []
        for d in level:
            if is_checkpoint_dir(d):
                found.append(d)
            if depth < 2:
                try:
                    nxt += sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "rank_")))
                except OSError:
                    pass
        level = nxt
    return found


def read_records(directory: Path) -> tuple[list, list]:
    """(commit records oldest first, one line per unreadable record) — the loader's view, warnings kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = cm.committed(directory)
    return records, [str(w.message) for w in caught]


def record_files(directory: Path, record: dict) -> dict:
    """rank -> file path of a committed checkpoint: the record's `files`, else the sharded naming."""
    files = rec.files_of(record) if isinstance(record.get("files"), dict) else None
    if files is None:
        n = int(record.get("world_size", 1))
        files = {"0": cm.integrated_path("", record["name"]).name} if record.get("integrated_save") else {
            str(r): str(cm.shard_path("", r, record["name"])) for r in range(n)}
    return {int(r): directory / p for r, p in files.items()}


def _shard(directory: Path, rank: int, path: Path) -> ShardFile:
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError:
        size = None
    return ShardFile(rank, path, os.path.relpath(path, directory), size)


def scan(directory) -> CheckpointDir:
    """Every checkpoint of a directory: committed ones from their records, then uncommitted leftovers."""
    directory = Path(directory)
    records, notes = read_records(directory)
    out = CheckpointDir(directory, [], notes=list(notes), problems=list(notes))
    claimed = set()
    for record in records:
        try:
            files = record_files(directory, record)
        except (KeyError, TypeError, ValueError, CheckpointError) as e:
            out.problems.append(f"commit record {record.get('name')!r} is malformed ({type(e).__name__}: {e})")
            continue
        shards = [_shard(directory, r, p) for r, p in sorted(files.items())]
        claimed.update(s.path.resolve() for s in shards)
        out.checkpoints.append(Checkpoint(directory, record["name"], True, record, shards))
    leftovers = {}
    for path in sorted(directory.glob("rank_*/*")) + sorted(directory.glob("*.h5")) + sorted(directory.glob("*.tmp")):
        base = path.name.removesuffix(".tmp")
        if (not path.is_file() or base.endswith(SKIP_SUFFIXES) or ".damaged" in base or path.resolve() in claimed):
            continue
        stem = Path(base).stem
        rank = _rank_of(path.parent.name) if path.parent != directory else 0
        leftovers.setdefault(stem, []).append(_shard(directory, rank, path))
    for name, shards in sorted(leftovers.items()):
        record = {"name": name}
        m = cm.NAME.match(name)
        if m:
            record.update(prefix=m["prefix"], epoch=int(m["epoch"]), step_in_epoch=int(m["step"]))
        out.checkpoints.append(Checkpoint(directory, name, False, record, sorted(shards, key=lambda s: s.rank)))
    return out


def _rank_of(dirname: str) -> int:
    try:
        return int(dirname.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


@dataclass
class ShardIndex:
    """A checkpoint file's attributes and the slice and checksum of every tensor (data not read)."""

    meta: dict
    tensors: dict   # "params/<name>" | "optimizer/<name>" -> (global_shape, Slice, crc32, dtype, shape)
    meta_problems: list = field(default_factory=list)  # items whose metadata checksum no longer matches
    meta_checked: bool = True                           # False: a format 1 file (no metadata checksums)
    digest: Optional[str] = None                        # format.content_digest of the file as found


def read_index(path) -> ShardIndex:
    """Attributes of a checkpoint file; raises CheckpointError (one line) when missing, foreign or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"file missing: {path}")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"not a dsim checkpoint (no format={FORMAT!r} attribute): {path}")
            table, differ, checked = check_meta(f)
            meta = {}
            for k, v in f.attrs.items():
                if k != META_ATTR:
                    try:
                        meta[k] = json.loads(v) if k in JSON_ATTRS else _plain(v)
                    except (TypeError, ValueError):
                        meta[k] = _plain(v)  # damaged JSON: the checksum table names it
            tensors = {}
            for kind in ("params", "optimizer"):
                for name, ds in f.get(kind, {}).items():
                    a = ds.attrs
                    tensors[f"{kind}/{name}"] = (tuple(int(x) for x in a["global_shape"]),
                                                 Slice(tuple(int(x) for x in a["offsets"]),
                                                       tuple(int(x) for x in a["extents"])),
                                                 int(a["crc32"]), ds.dtype, ds.shape)
            return ShardIndex(meta, tensors, differ, checked, content_digest(table))
    except CheckpointError:
        raise
    except OSError:
        raise CheckpointError(f"cannot read {path}: not an HDF5 file, or truncated") from None
    except Exception as e:  # whatever a damaged or foreign file makes h5py raise: one line
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              .rstrip(": ")) from None


def group_sets(indexes: dict, checkpoint: Checkpoint) -> list:
    """Replica sets of a checkpoint: from its files' group info, else from its layout.

    An integrated checkpoint is one file of full tensors: rank 0's, with no replica.
    """
    if checkpoint.record.get("integrated_save"):
        return [[0]]
    sets = set()
    for ix in indexes.values():
        if isinstance(ix, ShardIndex) and ix.meta.get("group_info") is not None:
            try:
                sets.add(tuple(sorted(group_info_list(ix.meta["group_info"]))))
            except CheckpointError:
                pass
    sets = sorted(sets)
    if sets:
        return [list(s) for s in sets]
    layout = checkpoint.layout()
    return replica_sets(layout) if layout else []


def tensor_holder_sets(indexes: dict) -> dict:
    """From the files themselves: tensor name -> the sets of ranks holding identical slices of it.

    A slice is lost only when every rank of its set fails; tensors replicated beyond the replica sets
    (LayerNorm, biases after row layers, replicated embeddings) have larger sets than the group info.
    """
    where = {}
    for rank, ix in sorted(indexes.items()):
        if not isinstance(ix, ShardIndex):
            continue
        for key, (_, piece, _, _, _) in ix.tensors.items():
            where.setdefault(key.split("/", 1)[1], {}).setdefault(piece, []).append(rank)
    return {name: sorted(sorted(ranks) for ranks in pieces.values()) for name, pieces in sorted(where.items())}


def record_holder_sets(record: dict) -> dict:
    """From a commit record's `slices` alone (format 2): tensor name -> the sets of ranks holding identical slices of
    it, as tensor_holder_sets gives from the files; {} for a record without them. Needs no file: on node-local disks
    one host's directory holds its own ranks' files only, and the record still names every holder."""
    where = {}
    try:
        for entry in record.get("slices") or []:
            ranks = progression.members(progression.set_from_json(entry["holders"], "holders"))
            where.setdefault(str(entry["tensor"]).split("/", 1)[1], []).append(ranks)
    except (CheckpointError, KeyError, TypeError, IndexError, AttributeError):
        return {}
    return {name: sorted(sets) for name, sets in sorted(where.items())}

