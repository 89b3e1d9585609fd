"""Page-aligned arrays: what checkpoints write from and read into with direct I/O (O_DIRECT).

Direct I/O moves bytes between the process's memory and the disk without the page cache's copy, but only
between addresses, file offsets and lengths that are multiples of the disk's block size. numpy's large
arrays start 16 bytes past a page boundary (malloc's header), so the arrays a run trains in place
(parameters, optimizer state) and the async save's snapshot are made here, at a page boundary; checkpoint
files place their large tensors at page boundaries too (dsim.checkpoint.format). An array made elsewhere
still saves and loads, through the page cache.
"""
from __future__ import annotations

import mmap

import numpy as np

PAGE = mmap.PAGESIZE


def _carve(raw: np.ndarray, shape, dtype: np.dtype) -> np.ndarray:
    start = (-raw.ctypes.data) % PAGE
    return raw[start:start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(shape)


def empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype), its first byte at a page boundary."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    return _carve(np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + PAGE, np.uint8), shape, dtype)


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), its first byte at a page boundary (pages untouched until used, as np.zeros)."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    return _carve(np.zeros(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + PAGE, np.uint8), shape, dtype)


def copy_of(arr, dtype=None) -> np.ndarray:
    """A C-contiguous, page-aligned copy of arr (as np.ascontiguousarray(arr, dtype), always a copy)."""
    arr = np.asarray(arr)
    out = empty(arr.shape, arr.dtype if dtype is None else dtype)
    out[...] = arr
    return out


def is_aligned(arr: np.ndarray) -> bool:
    """Whether arr's first byte is at a page boundary (an empty array has none to place)."""
    return arr.size == 0 or arr.ctypes.data % PAGE == 0
