"""Page-aligned arrays: what checkpoints write from and read into with direct I/O (O_DIRECT).

Direct I/O moves bytes between the process's memory and the disk without the page cache's copy, but only
between addresses, file offsets and lengths that are multiples of the disk's block size. numpy's large
arrays start 16 bytes past a page boundary (malloc's header), so the arrays a run trains in place
(parameters, optimizer state) and the async save's snapshot are made here, at a page boundary; checkpoint
files place their large tensors at page boundaries too (dsim.checkpoint.format). An array made elsewhere
still saves and loads, through the page cache.

An array of HUGE_MIN bytes or more starts at a huge-page boundary (2 MiB): numpy asks the kernel for
transparent huge pages on such arrays, and aligned this way every one of its whole 2 MiB stretches gets one,
where a page-aligned start left up to 2 MiB at each end in 4 KiB pages. What it buys is direct I/O: a request
can hold at most 254 separate pieces of memory (a virtio disk's), which is 1 MiB in 4 KiB pages and the
disk's full 4 MiB in huge pages; 8 ranks reading 256 MiB each into 16 MiB arrays went from 2.0-3.0 to
3.7-4.6 GiB/s. The last, partial huge page of such an array stays in 4 KiB pages (MADV_NOHUGEPAGE), so the
alignment costs no resident memory.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from dsim import libc

PAGE = mmap.PAGESIZE
HUGE = 1 << 21        # a transparent huge page (x86-64's and arm64's with 4 KiB pages)
HUGE_MIN = 1 << 22    # numpy madvises huge pages on allocations this large (its own threshold)


_MADVISE = (libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
            if hasattr(mmap, "MADV_NOHUGEPAGE") else None)


def _carve(nbytes: int, shape, dtype: np.dtype, alloc) -> np.ndarray:
    align = HUGE if nbytes >= HUGE_MIN else PAGE
    raw = alloc(nbytes + align, np.uint8)
    base = raw.ctypes.data
    start = (-base) % align
    end = base + start + nbytes
    if align == HUGE and _MADVISE is not None and end % HUGE:  # a partial huge page at the end: 4 KiB pages
        tail, block_end = end // HUGE * HUGE, (base + raw.nbytes) // PAGE * PAGE
        if block_end > tail:
            _MADVISE(tail, block_end - tail, mmap.MADV_NOHUGEPAGE)
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype), its first byte at a page boundary (at a huge page's from HUGE_MIN bytes)."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    return _carve(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, shape, dtype, np.empty)


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), aligned as empty (pages untouched until used, as np.zeros)."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    return _carve(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, shape, dtype, np.zeros)


def copy_of(arr, dtype=None) -> np.ndarray:
    """A C-contiguous, page-aligned copy of arr (as np.ascontiguousarray(arr, dtype), always a copy)."""
    arr = np.asarray(arr)
    out = empty(arr.shape, arr.dtype if dtype is None else dtype)
    out[...] = arr
    return out


def is_aligned(arr: np.ndarray) -> bool:
    """Whether arr's first byte is at a page boundary (an empty array has none to place)."""
    return arr.size == 0 or arr.ctypes.data % PAGE == 0
