"""Coverage: do the slices of a tensor tile its global shape, with no gap and no overlap?

Computed from offsets/extents alone (no data is read). The slice boundaries along each axis cut the
tensor into a grid of cells (coordinate compression); each slice adds one to the cells it spans, so a
cell counted 0 is a gap and a cell counted twice an overlap. Grid-aligned layouts (model parallel x
optimizer shard) give small grids whatever the tensor size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Coverage:
    """Elements of a tensor not covered (gap) and covered more than once (overlap), with one example each."""

    size: int
    gap: int = 0
    overlap: int = 0
    gap_at: Optional[tuple] = None       # global index of the first uncovered element
    overlap_at: Optional[tuple] = None   # global index of the first element covered twice
    outside: tuple = ()                  # slices reaching outside the global shape

    @property
    def exact(self) -> bool:
        return not (self.gap or self.overlap or self.outside)

    def problems(self, name: str) -> list[str]:
        """One line per kind of defect, naming the tensor and where."""
        out = [f"{name}: slice at offsets {o} extents {e} reaches outside the global shape" for o, e in self.outside]
        if self.gap:
            out.append(f"{name}: {self.gap} of {self.size} elements are in no slice (gap, e.g. at {self.gap_at})")
        if self.overlap:
            out.append(f"{name}: {self.overlap} elements are in more than one slice (overlap, e.g. at {self.overlap_at})")
        return out


def coverage(global_shape: Sequence[int], slices: Sequence[tuple]) -> Coverage:
    """How (offsets, extents) slices cover a tensor of global_shape; identical slices count once (replicas)."""
    shape = tuple(int(s) for s in global_shape)
    size = int(np.prod(shape, dtype=np.int64))
    boxes = sorted({(tuple(int(x) for x in o), tuple(int(x) for x in e)) for o, e in slices})
    outside = tuple((o, e) for o, e in boxes if len(o) != len(shape) or len(e) != len(shape)
                    or any(x < 0 or n < 0 or x + n > s for x, n, s in zip(o, e, shape)))
    boxes = [b for b in boxes if b not in outside]
    cuts = [np.unique([0, s] + [o[a] for o, _ in boxes] + [o[a] + e[a] for o, e in boxes]) for a, s in enumerate(shape)]
    count = np.zeros(tuple(len(c) - 1 for c in cuts), dtype=np.int64)
    for o, e in boxes:
        count[tuple(slice(np.searchsorted(c, x), np.searchsorted(c, x + n)) for c, x, n in zip(cuts, o, e))] += 1
    cell = np.ones(count.shape, dtype=np.int64)  # elements in each cell
    for a, c in enumerate(cuts):
        cell *= np.diff(c).reshape([-1 if i == a else 1 for i in range(len(cuts))])
    gap = int(cell[count == 0].sum())
    overlap = int(((count - 1).clip(min=0) * cell).sum())

    def first(mask):
        idx = np.argwhere(mask & (cell > 0))
        return tuple(int(c[i]) for c, i in zip(cuts, idx[0])) if len(idx) else None

    return Coverage(size, gap, overlap, first(count == 0) if gap else None, first(count > 1) if overlap else None,
                    outside)
