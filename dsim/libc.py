"""The C library's functions dsim calls through ctypes: fallocate, sync_file_range, mincore, madvise.

The library is the one the process has loaded already (dlopen(NULL)): ctypes.util.find_library would run
a subprocess (ldconfig) to find it, a fork inside an MPI process. Where a function is missing (not Linux),
`function` gives None and its caller does without.
"""
from __future__ import annotations

import ctypes


def function(name: str, argtypes: list):
    """The C library's function `name` with its argument types (errno kept for ctypes.get_errno), or None."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    return fn
