"""Merge: one HDF5 file of virtual datasets that stitch a sharded checkpoint's slices into whole tensors.

Nothing is copied: each `/params/<name>` and `/optimizer/<name>` of the merged file is an HDF5 virtual
dataset (h5py.VirtualLayout) whose pieces point into the rank files, so plain h5py (or h5dump) reads
full weights. Source paths are stored relative to the merged file, so the pair moves together.
Each distinct slice is taken from the first rank of its holders whose file reads; a lost shard is
therefore bridged by its replica, and a slice no readable file holds is one clear error.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from .catalog import Checkpoint, ShardIndex
from .coverage import coverage
from .errors import CheckpointError
from .verify import indexes_of

FORMAT = "dsim-merged-checkpoint"


def merge(checkpoint: Checkpoint, out) -> dict:
    """Write `out` (refusing to overwrite) with a virtual dataset per tensor; returns {name: global_shape}."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} exists; choose another output name (nothing was overwritten)")
    if not checkpoint.committed:
        raise CheckpointError(f"checkpoint {checkpoint.name} in {checkpoint.directory} was never committed")
    indexes = {r: ix for r, ix in indexes_of(checkpoint).items() if isinstance(ix, ShardIndex)}
    if not indexes:
        raise CheckpointError(f"no readable file of checkpoint {checkpoint.name} in {checkpoint.directory}")
    paths = {s.rank: s.path for s in checkpoint.shards}
    pieces = {}   # tensor -> {(offsets, extents): (rank, dtype)}
    shapes = {}
    for rank, ix in sorted(indexes.items()):
        for name, (global_shape, where, _, dtype, _) in ix.tensors.items():
            shapes.setdefault(name, global_shape)
            pieces.setdefault(name, {}).setdefault((where.offsets, where.extents), (rank, dtype))
    for name, boxes in pieces.items():
        problems = coverage(shapes[name], list(boxes)).problems(name)
        if problems:
            raise CheckpointError(f"cannot merge {checkpoint.name}: {problems[0]}")
    meta = next(iter(indexes.values())).meta
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(format=FORMAT, checkpoint=checkpoint.name, source=os.path.relpath(checkpoint.directory,
                           out.parent), epoch=int(meta.get("epoch", 0)), step_in_epoch=int(meta.get("step_in_epoch", 0)),
                           global_step=int(meta.get("global_step", 0)), world_size=int(meta.get("world_size", 1)),
                           layout=json.dumps(meta.get("layout")))
            for name in sorted(pieces):
                _virtual(f, name, shapes[name], pieces[name], paths, out.parent)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return shapes


def _virtual(f, name, global_shape, boxes, paths, home):
    """One virtual dataset: every distinct slice mapped from the file of a rank holding it."""
    dtype = np.result_type(*[d for _, d in boxes.values()])
    sources = []
    if not global_shape:  # a scalar cannot be virtual; it is one number, copy it
        (rank, _), = boxes.values()
        with h5py.File(paths[rank], "r") as src:
            f.create_dataset(name, data=src[name][()])
        sources.append(rank)
    else:
        layout = h5py.VirtualLayout(shape=tuple(global_shape), dtype=dtype)
        for (offsets, extents), (rank, _) in sorted(boxes.items()):
            index = tuple(slice(o, o + e) for o, e in zip(offsets, extents))
            layout[index] = h5py.VirtualSource(os.path.relpath(paths[rank], home), name, shape=tuple(extents))
            sources.append(rank)
        f.create_virtual_dataset(name, layout, fillvalue=np.nan if np.issubdtype(dtype, np.floating) else 0)
    f[name].attrs.update(global_shape=tuple(global_shape), source_ranks=sorted(set(sources)))
