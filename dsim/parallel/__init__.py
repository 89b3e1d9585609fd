"""Parallel layout (pure) and the MPI groups built from it."""
from .layout import LayoutError, ParallelLayout, ParamSpec, Slice, mp_slice, owned_slice, slice_table

__all__ = ["LayoutError", "ParallelLayout", "ParamSpec", "Slice", "mp_slice", "owned_slice", "slice_table"]
