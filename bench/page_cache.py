"""Reading from disk, not from memory: drop a file's pages from the page cache, and check they are gone.

`evict(path)` fsyncs the file (dirty pages cannot be dropped) and asks the kernel to drop its cached
pages with posix_fadvise(POSIX_FADV_DONTNEED): per file, unprivileged, and it leaves the rest of the
machine's cache alone (other jobs share this machine). `resident_fraction` asks mincore(2) how much of
a file is still cached, so every load figure can say what it read from.
The machine-wide hammer (echo 1 > /proc/sys/vm/drop_caches, root only) would also empty other jobs'
caches; `drop_all_permitted()` only reports whether it would be allowed.
"""
from __future__ import annotations

import os
from pathlib import Path

from dsim.checkpoint.tensor_io import cached_pages


def files_under(path) -> list[Path]:
    path = Path(path)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def evict(path) -> None:
    """fsync then drop the cached pages of a file, or of every file under a directory."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(path) -> tuple[int, int]:
    """(pages in the page cache, pages in total) of a file, by mincore(2)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd)
    finally:
        os.close(fd)


def resident_fraction(path) -> float:
    """Fraction of the pages of a file (or all files under a directory) that are in the page cache."""
    cached = total = 0
    for p in files_under(path):
        c, t = resident_pages(p)
        cached, total = cached + c, total + t
    return cached / total if total else 0.0


def drop_all_permitted() -> bool:
    """Whether this process could write /proc/sys/vm/drop_caches (machine-wide drop; checked, not done)."""
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)
