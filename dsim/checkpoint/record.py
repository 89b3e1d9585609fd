"""The commit record `<name>.commit`: what a committed checkpoint is, in O(distinct slices) whatever the world size.

Format `dsim-commit/2`, one JSON document (one key per line, one slice per line):

    format, name, prefix, epoch, step_in_epoch, global_step, sequence, time   what was saved, and when
    world_size, layout, integrated_save                                       by which job
    files         {"template": "rank_{rank}/<name>.h5", "ranks": [progressions]}: rank r's file is the
                  template with every {rank} replaced by r, for each rank r of the set
    bytes         the total size of the files
    replica_sets  every replica set (group info) once, a progression each (mp x k of them)
    slices        every distinct slice of every tensor once: {"tensor": "params/<name>" or
                  "optimizer/<slot>.<name>", "global_shape", "offsets", "extents", "holders": [progressions]},
                  holders being the ranks whose file holds that slice
    digests       {"file": "<name>.digests", "sha256": ...}: where the per-file digests are, and the SHA-256
                  of that file's bytes
    hosts         {host: [progressions]}: the ranks on each host as MPI found them (dsim.parallel.hosts), in the
                  order of their first rank; one progression a host with `--map-by slot` (ranks 0-3, 4-7), one of
                  step H with `--map-by node` over H hosts. Records written before it have none (a reshard writes
                  none: no job ran it)

A progression is {"start", "stop", "step"} as Python's range (progression.py). A layout's replica sets and
slice holders are a few progressions each, so nothing above grows with the world size: 48 slices describe
the seeds' Network on dp x mp4 at 8 ranks or at 65,536.

Why the digests live in a file of their own: a file's content digest (format.content_digest) is one per
file, so any list of them grows with the world size. They go to `<name>.digests` (`dsim-digests/1`:
`digests` and `sizes`, each a list indexed by rank, null where a rank has no file), written by the
committer just before the record (temporary name, fsync, rename) and pinned by the record's SHA-256 of it:
the record still vouches for every file, and stays small. A digest file that is missing or differs from
its pin is treated as a damaged record would be: recovery does not use that checkpoint (it falls back to the
previous one, saying why) and `--verify` reports it. Only recovery and `--verify` read it; finding the latest
checkpoint, listing and retention read the record alone. Recovery reads it on one rank and scatters each
rank its own digest.

Records of format `dsim-commit/1` (written before: `files`, `sizes` and `digests` maps with one entry per
rank) still read: every accessor here takes both.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from . import progression
from .errors import CheckpointError

FORMAT = "dsim-commit/2"
OLD_FORMAT = "dsim-commit/1"
FORMATS = (FORMAT, OLD_FORMAT)
DIGESTS_FORMAT = "dsim-digests/1"
RANK = "{rank}"


def is_compact(record: dict) -> bool:
    """Whether a record names its files by a template (format 2) rather than one entry per rank."""
    files = record.get("files")
    return isinstance(files, dict) and "template" in files


def file_ranks(record: dict) -> list:
    """The ranks that have a file in a committed checkpoint, ascending (O(world): one per file)."""
    files = record.get("files")
    if is_compact(record):
        return progression.members(progression.set_from_json(files.get("ranks"), "files.ranks"))
    return sorted(int(r) for r in files) if isinstance(files, dict) else []


def file_of(record: dict, rank: int) -> str:
    """rank's file in a committed checkpoint, relative to its directory; KeyError when rank has none."""
    files = record["files"]
    if is_compact(record):
        if not progression.contains(progression.set_from_json(files.get("ranks"), "files.ranks"), rank):
            raise KeyError(rank)
        return files["template"].replace(RANK, str(rank))
    return files[str(rank)]


def files_of(record: dict) -> dict:
    """rank -> file of every rank with one (O(world))."""
    return {r: file_of(record, r) for r in file_ranks(record)}


def template_of(files: dict) -> str:
    """The template ({rank} for the rank number) that gives every file of an explicit rank -> file map.

    Tried on the highest rank's file, replacing its rank number at the fewest places that fit every file
    (`rank_{rank}/ttp_rank_{rank}-2_2.h5` needs two). ValueError when none fits.
    """
    ranks = sorted(int(r) for r in files)
    if not ranks:
        raise ValueError("no files")
    if len(ranks) == 1:
        return files[str(ranks[0])]  # one file (an integrated save): its name, valid for its rank alone
    top = str(ranks[-1])
    sample = files[str(ranks[-1])]
    spots = [m.start() for m in re.finditer(f"(?={re.escape(top)})", sample)]
    candidates = []
    for mask in range(1, 1 << len(spots)):
        chosen = [s for i, s in enumerate(spots) if mask >> i & 1]
        if any(b - a < len(top) for a, b in zip(chosen, chosen[1:])):
            continue  # overlapping occurrences
        t, last = "", 0
        for s in chosen:
            t += sample[last:s] + RANK
            last = s + len(top)
        candidates.append((len(chosen), t + sample[last:]))
    for _, t in sorted(candidates):
        if "{" not in t.replace(RANK, "") and "}" not in t.replace(RANK, "") and \
                all(t.replace(RANK, str(r)) == files[str(r)] for r in ranks):
            return t
    raise ValueError(f"no template {{rank}} gives the files {sample!r}, ...")


def compact_files(files: dict, period: int = None) -> dict:
    """An explicit rank -> file map as {"template", "ranks"} (format 2)."""
    ranks = progression.compress((int(r) for r in files), period)
    return {"template": template_of(files), "ranks": progression.set_to_json(ranks)}


def check_files(record: dict) -> None:
    """Raise CheckpointError (one line) when a format 2 record's files are not a template and a rank set."""
    files = record["files"]
    template = files.get("template")
    ranks = progression.set_from_json(files.get("ranks"), "files.ranks")
    if not isinstance(template, str) or RANK not in template and progression.size(ranks) > 1 \
            or "{" in template.replace(RANK, "") or "}" in template.replace(RANK, ""):
        raise CheckpointError(f"files.template {template!r} is not a file name with {RANK} for the rank")
    world = record.get("world_size")
    if isinstance(world, int) and any(p[-1] >= world for p in ranks):
        raise CheckpointError(f"files.ranks {files.get('ranks')!r} names ranks beyond the world size {world}")


# -- hosts ------------------------------------------------------------------------------------------------------
def hosts_json(host_of, period: int = None) -> dict:
    """The record's `hosts` from each rank's host (host_of[r]): host -> its ranks as the fewest progressions found."""
    by_host = {}
    for r, h in enumerate(host_of):
        by_host.setdefault(str(h), []).append(r)
    out = {}
    for h, ranks in by_host.items():
        ways = [progression.compress(ranks)] + ([progression.compress(ranks, period)] if period else [])
        out[h] = progression.set_to_json(min(ways, key=len))
    return out


def hosts_of(record: dict):
    """Each rank's host from a record's `hosts` (a list indexed by rank); None when the record has none (written
    before, or by a reshard) or when it does not give every rank of the world exactly one host."""
    hosts, world = record.get("hosts"), record.get("world_size")
    if not isinstance(hosts, dict) or not hosts or not isinstance(world, int) or world < 1:
        return None
    out = [None] * world
    try:
        for h, ranks in hosts.items():
            for r in progression.members(progression.set_from_json(ranks, "hosts")):
                if r >= world or out[r] is not None:
                    return None
                out[r] = h
    except CheckpointError:
        return None
    return out if None not in out else None


# -- the digest file ----------------------------------------------------------------------------------------------
def digests_name(name: str) -> str:
    """The digest file of checkpoint name: <name>.digests, beside its commit record."""
    return f"{name}.digests"


def digest_table(name: str, world: int, written: dict) -> dict:
    """The `<name>.digests` document from rank -> (size, digest) of each file written (None: no file)."""
    sizes, digests = [None] * world, [None] * world
    for r, w in written.items():
        if w is not None and 0 <= int(r) < world:
            sizes[int(r)], digests[int(r)] = w[0], w[1]
    return {"format": DIGESTS_FORMAT, "name": name, "world_size": world, "digests": digests, "sizes": sizes}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def read_digests(directory, record: dict) -> tuple:
    """(rank -> content digest, None) of a committed checkpoint's files; (None, None) when the record has none
    (written before checkpoint format 2); (None, why) when its digest file is missing or not the one pinned."""
    pin = record.get("digests")
    if pin is None:
        return None, None
    if not is_compact(record):
        if not isinstance(pin, dict):
            return None, "its commit record's digests are not a map of rank -> digest"
        return {int(r): d for r, d in pin.items() if str(r).isdigit()}, None
    name = pin.get("file") if isinstance(pin, dict) else None
    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
        return None, f"its commit record names no digest file ({pin!r})"
    path = Path(directory) / name
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        return None, f"its digest file {name} cannot be read ({getattr(e, 'strerror', None) or e})"
    if sha256(text) != pin.get("sha256"):
        return None, f"its digest file {name} is not the one committed (its SHA-256 differs from the commit record's)"
    try:
        table = json.loads(text)
        return {r: d for r, d in enumerate(table["digests"]) if d is not None}, None
    except (ValueError, KeyError, TypeError):
        return None, f"its digest file {name} is not a dsim digest file"


# -- text ---------------------------------------------------------------------------------------------------------
def dumps(document: dict) -> str:
    """A record or digest file as written: one key per line, one element per line for lists of objects."""
    lines = []
    for key, value in document.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            inner = ",\n  ".join(json.dumps(v) for v in value)
            lines.append(f" {json.dumps(key)}: [\n  {inner}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
