"""Tensor bytes moved straight between arrays and a file, at the disk's speed.

A checkpoint's tensors are HDF5 datasets with contiguous layout whose space is allocated when the file is
created (`early_dcpl`), so each one is a known byte range of the file (`dataset.id.get_offset()`). Their
bytes are then written and read with positioned I/O on the file's descriptor, straight from and into the
arrays the training holds: no intermediate copy, the GIL released by os.pwrite / os.preadv, and the CRC-32
computed on each chunk right after it moved, while it is still in the CPU's cache. The files stay plain
HDF5: h5py and h5dump read them like any other.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

import h5py
import numpy as np

try:  # ISA-L's CRC-32 is zlib's (the same polynomial and values), 3-4x faster on CPUs with carry-less multiply
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32

CHUNK = 1 << 21  # 2 MiB: large enough for few system calls, small enough to stay in cache for the CRC
WRITEBACK = 1 << 24  # start the disk writing every 16 MiB, while the next bytes are copied and checksummed


def _sync_file_range():
    """Linux's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE), or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE, does not wait


start_writeback = _sync_file_range() or (lambda fd, offset, nbytes: 0)


def early_dcpl():
    """A dataset creation property list: contiguous layout, space allocated at creation, never filled.

    HDF5 then writes none of the dataset's bytes itself; they are exactly the ones write_at puts there.
    """
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


def byte_view(arr: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying."""
    return memoryview(arr.reshape(-1)).cast("B") if arr.size else memoryview(b"")


def write_at(fd: int, arr: np.ndarray, offset: int) -> int:
    """Write a C-contiguous array's bytes at offset of fd; returns their CRC-32. Raises OSError.

    Every WRITEBACK bytes the kernel is asked to start writing them to disk (without waiting), so the
    disk works while the CPU copies and checksums the rest, and the final fsync has little left to do.
    """
    view, crc, done, flushed = byte_view(arr), 0, 0, 0
    while done < len(view):
        chunk = view[done:done + CHUNK]
        n = 0
        while n < len(chunk):
            n += os.pwrite(fd, chunk[n:], offset + done + n)
        crc = crc32(chunk, crc)
        done += len(chunk)
        if done - flushed >= WRITEBACK or done == len(view):
            start_writeback(fd, offset + flushed, done - flushed)
            flushed = done
    return crc


def prefetch(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading a byte range (without waiting): the disk works while read_at checksums."""
    if nbytes > 0:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)


def read_at(fd: int, out: np.ndarray, offset: int) -> int:
    """Fill a C-contiguous array with the bytes at offset of fd; returns their CRC-32.

    Raises EOFError when the file ends first (a truncated file).
    """
    view, crc, done = byte_view(out), 0, 0
    while done < len(view):
        chunk = view[done:done + CHUNK]
        n = 0
        while n < len(chunk):
            got = os.preadv(fd, [chunk[n:]], offset + done + n)
            if got == 0:
                raise EOFError(f"the file ends before byte {offset + done + n + 1} of a tensor")
            n += got
        crc = crc32(chunk, crc)
        done += len(chunk)
    return crc


def raw_offset(ds) -> int | None:
    """Where a dataset's bytes start in its file when they can be read in place (contiguous, allocated,
    unfiltered, native byte order); None otherwise (old or foreign files: read through h5py)."""
    if ds.chunks is not None or ds.compression or not ds.dtype.isnative or ds.dtype.hasobject:
        return None
    if ds.size == 0:
        return None
    return ds.id.get_offset()
