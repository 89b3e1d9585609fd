"""Paths taken from a checkpoint stay inside its directory.

Every path read from a checkpoint (a commit record's `files`: each rank's file its template gives, or
each entry of a record of the format before; its `name`; its digest file) must be relative, free of `..`,
and resolve inside the checkpoint directory; a symlinked rank file or rank directory pointing elsewhere
fails the last test. Anything else makes the record malformed (CheckpointError, one line): the loader
skips it like any damaged record, so nothing is ever read, renamed or written outside the directory.
"""
from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from . import record as rec
from .errors import CheckpointError


def plain_name(value, what: str = "name") -> str:
    """value when it is a non-empty file name with no directory part (no '/', not '.' or '..')."""
    if not isinstance(value, str) or not value or value in (".", "..") or "/" in value or "\\" in value \
            or "\0" in value:
        raise CheckpointError(f"{what} {value!r} is not a plain file name")
    return value


def inside(directory, rel, what: str = "path", root: str = None) -> Path:
    """directory / rel, when rel is relative, has no '..' and resolves (following any symlink) inside directory.

    root: os.path.realpath(directory), when the caller checks many paths of one directory."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise CheckpointError(f"{what} {rel!r} is not a path")
    if rel.startswith(("/", "\\")):
        raise CheckpointError(f"{what} {rel!r} is absolute")
    if ".." in rel.split("/"):
        raise CheckpointError(f"{what} {rel!r} contains '..'")
    root = root or os.path.realpath(directory)
    target = os.path.realpath(os.path.join(directory, rel))
    if target != root and not target.startswith(root.rstrip(os.sep) + os.sep):
        raise CheckpointError(f"{what} {rel!r} resolves outside the checkpoint directory (to {target})")
    return Path(directory) / PurePosixPath(rel)


def check_record(directory, record: dict) -> None:
    """Raise CheckpointError (one line) when a commit record is malformed: its name, counters or files."""
    plain_name(record.get("name"), "name")
    for key in ("global_step", "sequence"):
        if not isinstance(record.get(key), int) or isinstance(record.get(key), bool):
            raise CheckpointError(f"{key} {record.get(key)!r} is not an integer")
    pin = record.get("digests")
    if rec.is_compact(record) and pin is not None:
        plain_name(pin.get("file") if isinstance(pin, dict) else None, "digests.file")
    files = record.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise CheckpointError("files is not a mapping of rank -> path")
    if rec.is_compact(record):
        rec.check_files(record)
        template, root = files["template"], os.path.realpath(directory)
        inside(directory, template, "files.template", root)
        for rank in rec.file_ranks(record):  # a symlinked file or rank directory shows only once resolved
            inside(directory, template.replace(rec.RANK, str(rank)), f"files[{rank}]", root)
        return
    root = os.path.realpath(directory)
    for rank, rel in files.items():
        if not str(rank).isdigit():
            raise CheckpointError(f"files has a key {rank!r} that is not a rank")
        inside(directory, rel, f"files[{rank}]", root)


def safe_rank_dir(directory, path) -> bool:
    """True when a rank directory may be written in: not a symlink, and inside directory."""
    path = Path(path)
    if path.is_symlink():
        return False
    try:
        inside(directory, os.path.relpath(path, directory))
    except (CheckpointError, ValueError):
        return False
    return True
