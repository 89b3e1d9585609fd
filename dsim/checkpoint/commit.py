"""The commit protocol: nothing partial is ever "latest".

1) (all ranks) write their files under temporary names, fsync, rename into place;
2) (all ranks) report success or their error to everyone (allgather);
3) (rank 0) only if all succeeded, write the digest file `<name>.digests`, then the commit record
   `<name>.commit` (each: temporary name, fsync, rename, fsync of the directory). A checkpoint exists
   exactly when its commit record does;
4) (rank 0, then every rank) retention: drop the oldest committed checkpoints of the prefix beyond
   keep_checkpoint_max, commit record first, never the newest.
Leftovers of an interrupted save (temporaries, files and digest files without a commit record) are removed
with a warning when the next run starts, and never loaded.

The record (record.py) names every rank's file by a template, and pins the digest file holding each file's
content digest (format.content_digest): a file swapped, edited or replaced after the commit is caught on load
and by `dsim.inspect --verify`. Records of the format before (one entry per rank) and records without
digests (older still) load.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

from . import progression, record as rec
from .errors import CheckpointError
from .format import check_meta, fsync_path
from .paths import check_record, safe_rank_dir

COMMIT_FORMAT = rec.FORMAT
NAME = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)$")


def checkpoint_name(prefix: str, epoch: int, step_in_epoch: int) -> str:
    """MindSpore's naming: prefix-{epoch}_{step}."""
    return f"{prefix}-{epoch}_{step_in_epoch}"


def rank_dir(directory, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}"


def shard_path(directory, rank: int, name: str) -> Path:
    """Where rank's file of a sharded checkpoint lives: <dir>/rank_<r>/<name>.h5."""
    return rank_dir(directory, rank) / f"{name}.h5"


def integrated_path(directory, name: str) -> Path:
    """Where an integrated (full-tensor) checkpoint lives: <dir>/<name>.h5."""
    return Path(directory) / f"{name}.h5"


def commit_path(directory, name: str) -> Path:
    return Path(directory) / f"{name}.commit"


def write_json_atomic(path: Path, record: dict, text: str = None) -> None:
    """Write JSON (or text, when given) under a temporary name, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as fh:
            if text is None:
                json.dump(record, fh, indent=1)
                fh.write("\n")
            else:
                fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)  # a full disk or a read-only directory leaves nothing behind
        except OSError:
            pass
        raise
    fsync_path(path.parent)


def write_commit(directory, record: dict, written: dict = None) -> Path:
    """Commit a checkpoint (step 3 above): its digest file, then its record; it exists from this rename on.

    record: built by plan.commit_record (save.Commit, for every save), with written (rank -> (size, content
    digest) of each file); or, from records written by hand and callers before the one save path (the last gasp
    wrote one), a record with an explicit `files` map rank -> path and no digests: the map becomes a template,
    and sizes, digests and the distinct slices are read from the files' attributes (no tensor data; a file that
    cannot be read gets none).
    """
    directory = Path(directory)
    record = {k: v for k, v in record.items() if k not in ("format", "sizes", "digests")}
    files = record.get("files")
    if isinstance(files, dict) and not rec.is_compact(record):
        layout = record.get("layout") or {}
        period = (layout.get("model_parallel") or 1) * (layout.get("optimizer_shard") or 1)
        written, slices = read_files(directory, files, period)
        record["files"] = rec.compact_files(files, period)
        record.setdefault("slices", slices)
    _compact_last_gasp(record)
    if written is not None:
        world = record.get("world_size") or 1 + max(int(r) for r in written)
        text = rec.dumps(rec.digest_table(record["name"], world, written))
        name = rec.digests_name(record["name"])
        write_json_atomic(directory / name, {}, text)
        record["bytes"] = sum(w[0] for w in written.values() if w is not None and w[0] is not None)
        record["digests"] = {"file": name, "sha256": rec.sha256(text)}
    path = commit_path(directory, record["name"])
    write_json_atomic(path, {}, rec.dumps({"format": COMMIT_FORMAT, **record}))
    return path


def _compact_last_gasp(record: dict) -> None:
    """A last gasp's `writers` (rank -> the survivor that wrote its file) keeps only files written for another rank."""
    gasp = record.get("last_gasp")
    if isinstance(gasp, dict) and isinstance(gasp.get("writers"), dict):
        record["last_gasp"] = {**gasp, "writers": {r: w for r, w in gasp["writers"].items() if str(r) != str(w)}}


def read_files(directory, files: dict, period: int = None) -> tuple:
    """(rank -> (size, content digest), the record's `slices`) from the files' attributes (no tensor data)."""
    import h5py
    from .format import content_digest
    written, held = {}, {}
    for rank, name in files.items():
        path = Path(directory) / name
        try:
            with h5py.File(path, "r") as f:
                written[int(rank)] = (path.stat().st_size, content_digest(check_meta(f)[0]))
                for kind in ("params", "optimizer"):
                    for tensor, ds in f.get(kind, {}).items():
                        a = ds.attrs
                        key = (f"{kind}/{tensor}", tuple(int(x) for x in a["global_shape"]),
                               tuple(int(x) for x in a["offsets"]), tuple(int(x) for x in a["extents"]))
                        held.setdefault(key, []).append(int(rank))
        except Exception:
            pass
    slices = [{"tensor": t, "global_shape": list(g), "offsets": list(o), "extents": list(e),
               "holders": progression.set_to_json(progression.compress(ranks, period))}
              for (t, g, o, e), ranks in held.items()]
    return written, slices


def digest_key(record: dict, rank: int) -> int:
    """The rank whose digest stands for rank's file in a record (an integrated checkpoint has one file, rank 0's)."""
    return 0 if record.get("integrated_save") else rank


def state_mismatch(meta: dict, record: dict) -> str | None:
    """What a file's scalar state (global step, epoch, data position, optimizer step) says against its commit
    record, as one phrase; None when they agree. Items a file does not have (written by other tools) are
    skipped, except the global step; in a format 2 file a removed item is caught by its checksums."""
    def get(*keys):
        value = meta
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return value
    step = record.get("global_step")
    checks = [("global step", get("global_step"), step), ("epoch", get("epoch"), record.get("epoch")),
              ("step in epoch", get("step_in_epoch"), record.get("step_in_epoch")),
              ("data position (data.global_step)", get("data", "global_step"), step),
              ("optimizer step (optimizer.global_step)", get("optimizer", "global_step"), step)]
    for i, (what, found, expected) in enumerate(checks):
        if expected is not None and found != expected and (found is not None or i == 0):
            return f"holds {what} {found}, its commit record says {expected}"
    return None


HEADER = ("name", "prefix", "epoch", "step_in_epoch", "global_step", "sequence", "world_size")  # committed(cache=...)
                                                                                               # keeps these


def committed(directory, cache: dict = None) -> list[dict]:
    """Commit records in directory, oldest first by (global_step, sequence): never by file time.

    cache: a dict kept by a caller that lists the same directory at every save (the saver). A record file
    unchanged since the last call (the same inode, size and modification time: records are only ever
    replaced by a rename) is taken from it, checked as it was then, instead of being read and checked again;
    without it a save's listing reads every record kept (2.6 s a save at 750 of them). With a cache each
    record comes cut to its HEADER (what numbering and retention read), so that it holds a few hundred bytes
    per checkpoint, and only the files of the last listing.
    """
    records, seen = [], {}
    for path in Path(directory).glob("*.commit"):
        key = None
        if cache is not None:
            try:
                st = path.stat()
                key = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                pass
            hit = cache.get(path.name)
            if key is not None and hit is not None and hit[0] == key:
                seen[path.name] = hit
                if hit[1] is not None:
                    records.append(hit[1])
                continue
        record = _read_record(directory, path)
        if cache is not None and record is not None:
            record = {k: record.get(k) for k in HEADER}
        seen[path.name] = (key, record)
        if record is not None:
            records.append(record)
    if cache is not None:
        cache.clear()
        cache.update(seen)
    return sorted(records, key=lambda r: (r["global_step"], r["sequence"]))


def _read_record(directory, path: Path):
    """The commit record in path, checked; None (and a warning) when it is unreadable or malformed."""
    try:
        record = json.loads(path.read_text())
        if isinstance(record, dict) and record.get("format") in rec.FORMATS:
            check_record(directory, record)
            return record
    except CheckpointError as e:  # a path outside the directory, a name with a directory part, ...
        warnings.warn(f"ignoring malformed commit record {path}: {e}")
        return None
    except FileNotFoundError:  # removed since the directory was listed (retention by another process): gone
        return None
    except (ValueError, OSError):
        pass
    warnings.warn(f"ignoring unreadable commit record {path}")
    return None


def used_prefixes(directory) -> set:
    """Prefixes that already name something in directory (meta files, commit records, files)."""
    d = Path(directory)
    found = {p.name[:-len("-graph.meta")] for p in d.glob("*-graph.meta")}
    for path in list(d.glob("*.commit")) + list(d.glob("*.h5")) + list(d.glob("rank_*/*.h5")):
        m = NAME.match(path.name.split(".")[0] if path.suffix == ".commit" else path.name[:-len(".h5")])
        if m:
            found.add(m["prefix"])
    return found


def unique_prefix(directory, prefix: str) -> str:
    """prefix, or prefix_N (the first unused N) when a previous run in directory used it."""
    used = used_prefixes(directory)
    if prefix not in used:
        return prefix
    n = 1
    while f"{prefix}_{n}" in used:
        n += 1
    return f"{prefix}_{n}"


def clean_leftovers(directory, rank: int, committed_names: set) -> list[Path]:
    """Remove temporaries and uncommitted files rank is responsible for; warn about each."""
    d = Path(directory)
    # a file named by any commit record, even one ignored as malformed, is never a leftover: never removed
    committed_names = set(committed_names) | {p.name[:-len(".commit")] for p in d.glob("*.commit")}
    mine, own = [], rank_dir(d, rank)
    if own.exists() or own.is_symlink():
        if safe_rank_dir(d, own):
            mine = list(own.glob("*.tmp")) + [p for p in own.glob("*.h5") if p.name[:-3] not in committed_names]
        else:
            warnings.warn(f"not cleaning {own}: a symlink or outside {d}")
    if rank == 0:
        mine += list(d.glob("*.tmp")) + [p for p in d.glob("*.h5") if p.name[:-3] not in committed_names]
        mine += [p for p in d.glob("*.digests") if p.name[:-len(".digests")] not in committed_names]
    for p in mine:
        warnings.warn(f"removing leftover of an interrupted save (never committed): {p}")
        p.unlink(missing_ok=True)
    return mine


def uncommit(directory, name: str) -> None:
    """Retention's first step: remove the commit record (the checkpoint no longer exists), then its digest file."""
    commit_path(directory, name).unlink()
    (Path(directory) / rec.digests_name(name)).unlink(missing_ok=True)


def to_drop(records: list[dict], prefix: str, keep_max: int) -> list[dict]:
    """The oldest committed checkpoints of prefix beyond keep_max (never the newest one)."""
    own = [r for r in records if r["prefix"] == prefix]
    return own[:max(0, len(own) - max(keep_max, 1))]
