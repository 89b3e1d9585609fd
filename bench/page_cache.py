"""Reading from disk, not from memory: drop a file's pages from the page cache, and check they are gone.

`evict(path)` fsyncs the file (dirty pages cannot be dropped) and asks the kernel to drop its cached
pages with posix_fadvise(POSIX_FADV_DONTNEED): per file, unprivileged, and it leaves the rest of the
machine's cache alone (other jobs share this machine). `resident_fraction` asks mincore(2) how much of
a file is still cached, so every load figure can say what it read from.
The machine-wide hammer (echo 1 > /proc/sys/vm/drop_caches, root only) would also empty other jobs'
caches; `drop_all_permitted()` only reports whether it would be allowed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


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
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            return sum(b & 1 for b in vec), pages
        finally:
            _libc.munmap(addr, size)
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
