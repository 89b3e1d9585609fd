"""Tensor bytes moved straight between arrays and a file, at the disk's speed.

A checkpoint's tensors are HDF5 datasets with contiguous layout whose space is allocated when the file is
created (`early_dcpl`), so each one is a known byte range of the file (`dataset.id.get_offset()`). Their
bytes are then written and read with positioned I/O on the file's descriptor, straight from and into the
arrays the training holds: no intermediate copy, the GIL released by os.pwrite / os.preadv, and the CRC-32
computed on each chunk right after it moved, while it is still in the CPU's cache. The files stay plain
HDF5: h5py and h5dump read them like any other.

Where the file system has it, the bulk of each tensor moves with direct I/O (O_DIRECT): the bytes go
between the array and the disk without the kernel copying them through its page cache. Saves lose the
copy and the dirty pages the kernel must write back (8 ranks saving 2 GiB here: 2.3x faster than
ndarray.tofile + fsync); loads spend a fraction of the CPU of a buffered read (a 256 MiB file: 7.5 ms of
CPU against 45-60 ms), and CPU is what 8 ranks sharing 2 cores run out of. Durability is unchanged: the
file is fsync'd before it is renamed into place. Direct I/O needs the array and the file offset at block
boundaries: large tensors are placed at page boundaries in the file (ALIGNMENT) and the model's and
optimizer's arrays are page-aligned (dsim.aligned); whatever is not aligned (the ends of an array, small
tensors, a file system without O_DIRECT) goes through the page cache as before. A file mostly in the
page cache already is read from there: a copy from memory beats reading the disk again.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

import h5py
import numpy as np

from dsim import libc

try:  # ISA-L's CRC-32 is zlib's (the same polynomial and values), 3-4x faster on CPUs with carry-less multiply
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32

CHUNK = 1 << 21  # 2 MiB: large enough for few system calls, small enough to stay in cache for the CRC
WRITEBACK = 1 << 24  # start the disk writing every 16 MiB, while the next bytes are copied and checksummed
DIRECT_CHUNK = 1 << 23  # 8 MiB: direct I/O bypasses the cache anyway; larger requests keep the disk busier
BLOCK = mmap.PAGESIZE  # direct I/O's unit (a multiple of any disk's logical block size)
ALIGNMENT = (1 << 18, BLOCK)  # datasets of 256 KiB or more start at a page boundary of their file (HDF5's
# set_alignment); smaller ones gain nothing from direct I/O


_SYNC_FILE_RANGE = libc.function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
# fallocate(fd, 0, 0, nbytes) reserves blocks; posix_fallocate would write zeros where the file system cannot
_FALLOCATE = libc.function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a byte range to the disk, without waiting (Linux's sync_file_range
    with SYNC_FILE_RANGE_WRITE); nothing elsewhere."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, 2)  # 2: SYNC_FILE_RANGE_WRITE


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve a new file's first nbytes on the disk at once, before any is written: the file system can then
    give it a few long runs of blocks. Written piece by piece with direct I/O (the kernel allocates per write),
    8 ranks' files came out as 8 MiB pieces interleaved with one another, and reading one back took the disk
    many short requests and seeks. Raises OSError when the disk has no room (ENOSPC: before a byte is
    written); does nothing where the file system cannot (EOPNOTSUPP) or off Linux."""
    if _FALLOCATE is None or nbytes <= 0:
        return
    if _FALLOCATE(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
            raise OSError(err, os.strerror(err))


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


def write_at(fd: int, arr: np.ndarray, offset: int, direct: int = None) -> int:
    """Write a C-contiguous array's bytes at offset of fd; returns their CRC-32. Raises OSError.

    direct: the same file opened with O_WRONLY | O_DIRECT (open_direct_write), or None. The part of the
    array at block boundaries both in memory and in the file goes with it, straight from the array to the
    disk (no copy into the page cache, no dirty pages for the kernel to write back); the rest through fd.
    There, every WRITEBACK bytes the kernel is asked to start writing them to disk (without waiting), so
    the disk works while the CPU copies and checksums the rest, and the final fsync has little left to do.
    """
    view = byte_view(arr)
    span = _aligned_span(arr, len(view), offset) if direct is not None else None
    if span is None:
        return _write(fd, view, offset, 0)
    head, end = span
    crc = _write(fd, view[:head], offset, 0)
    crc, done = _direct(os.pwrite, direct, view[head:end], offset + head, crc)
    return _write(fd, view[head + done:], offset + head + done, crc)


def _aligned_span(arr: np.ndarray, nbytes: int, offset: int):
    """(head, end): the stretch [head, end) of arr's bytes lies at block boundaries both in memory and in
    its file (at offset), and can move with direct I/O; None when there is none worth it."""
    head = (-arr.ctypes.data) % BLOCK
    if nbytes < ALIGNMENT[0] or (offset + head) % BLOCK:
        return None
    end = head + (nbytes - head) // BLOCK * BLOCK
    return (head, end) if end > head else None


def _write(fd: int, view: memoryview, offset: int, crc: int) -> int:
    done = flushed = 0
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


def _direct(move, fd: int, view: memoryview, offset: int, crc: int) -> tuple:
    """(CRC-32, bytes moved) of a block-aligned stretch written or read (move: os.pwrite or _pread) with
    direct I/O. Stops early, leaving the rest to buffered I/O, where the file system refuses direct I/O
    (EINVAL) or at a short count (a read at the end of the file); other errors raise."""
    done = 0
    while done < len(view):
        chunk = view[done:done + DIRECT_CHUNK]
        try:
            got = move(fd, chunk, offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return crc, done
        got -= got % BLOCK
        crc = crc32(chunk[:got], crc)
        done += got
        if got < len(chunk):
            return crc, done
    return crc, done


def _pread(fd: int, chunk: memoryview, offset: int) -> int:
    return os.preadv(fd, [chunk], offset)


def open_direct_write(path):
    """A file (created already) opened again for direct writes, or None where the file system has none."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def prefetch(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start reading a byte range (without waiting): the disk works while read_at checksums."""
    if nbytes > 0:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)


def read_at(fd: int, out: np.ndarray, offset: int, direct: int = None) -> int:
    """Fill a C-contiguous array with the bytes at offset of fd; returns their CRC-32.

    direct: the same file opened with O_DIRECT (open_direct_read), or None. The part of the array that lies at
    block boundaries both in memory and in the file is read with it; the rest through fd.
    Raises EOFError when the file ends first (a truncated file).
    """
    view = byte_view(out)
    span = _aligned_span(out, len(view), offset) if direct is not None else None
    if span is None:
        return _read(fd, view, offset, 0)
    head, end = span
    crc = _read(fd, view[:head], offset, 0)
    crc, done = _direct(_pread, direct, view[head:end], offset + head, crc)
    return _read(fd, view[head + done:], offset + head + done, crc)


def _read(fd: int, view: memoryview, offset: int, crc: int) -> int:
    done = 0
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


def open_direct_read(path, fd: int):
    """The file opened again for direct reads, or None: where the file system has no direct I/O, or when
    most of the file (fd) is in the page cache already, so reading the disk again would be slower."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None or cached_fraction(fd) >= 0.5:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


_MINCORE = libc.function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


def cached_pages(fd: int) -> tuple:
    """(pages in the page cache, pages in all) of an open file, by mincore(2) on a mapping that touches none."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, 0
    if _MINCORE is None:
        raise OSError(errno.ENOSYS, "mincore is not available here")
    vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        mapped = np.frombuffer(m, np.uint8)  # only its address is used
        failed = _MINCORE(mapped.ctypes.data, size, vec.ctypes.data) != 0
        del mapped
    if failed:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int(np.count_nonzero(vec & 1)), vec.size


def cached_fraction(fd: int) -> float:
    """The fraction of an open file's pages in the page cache; 0.0 when it cannot be told."""
    try:
        cached, total = cached_pages(fd)
    except (OSError, ValueError):
        return 0.0
    return cached / total if total else 0.0


def raw_offset(ds) -> int | None:
    """Where a dataset's bytes start in its file when they can be read in place (contiguous, allocated,
    unfiltered, native byte order); None otherwise (old or foreign files: read through h5py)."""
    if ds.chunks is not None or ds.compression or not ds.dtype.isnative or ds.dtype.hasobject:
        return None
    if ds.size == 0:
        return None
    return ds.id.get_offset()
