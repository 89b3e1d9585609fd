"""One checkpoint file in HDF5: self-describing for anyone with h5py or h5dump.

Layout of a file:
    /                 attrs: format, format_version, epoch, step_in_epoch, global_step, rank, world_size,
                      layout, prefix, integrated_save, group_info, optimizer, schedule, data, seed, dtype
    /params/<name>    this rank's slice of a parameter
    /optimizer/<name> this rank's slice of an optimizer state (e.g. moment1.layer2.weight)
    /append_info/<k>  user values (epoch_num, step_num, and the append_info dict)
Each tensor carries attrs global_shape, offsets, extents, split (mp axis), opt_sharded and crc32.
JSON-valued attrs (layout, optimizer, ...) are stored as strings.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from ..parallel.layout import Slice
from .errors import CheckpointError

FORMAT, VERSION = "dsim-checkpoint", 1
JSON_ATTRS = ("layout", "group_info", "optimizer", "schedule", "data", "config")


def crc32(arr: np.ndarray) -> int:
    """CRC-32 of an array's bytes (C order)."""
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"))


@dataclass
class Tensor:
    """A slice of a global tensor, as stored."""

    kind: str           # "params" | "optimizer"
    name: str
    global_shape: tuple
    where: Slice
    data: np.ndarray
    split: str = "replicated"
    opt_sharded: bool = False


@dataclass
class Shard:
    """A checkpoint file read back: its attributes, tensors and append_info values."""

    path: Path
    meta: dict
    tensors: dict = field(default_factory=dict)   # name -> Tensor
    append_info: dict = field(default_factory=dict)


def fsync_path(path) -> None:
    """fsync a file or directory by path, so a rename that follows is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path, meta: dict, tensors, append_info: dict, on_half_written=None) -> int:
    """Write a checkpoint file via a temporary name, fsync it, rename it into place; returns its size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tensors = list(tensors)
    with h5py.File(tmp, "w") as f:
        f.attrs["format"], f.attrs["format_version"] = FORMAT, VERSION
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value) if key in JSON_ATTRS else value
        for i, t in enumerate(tensors):
            ds = f.create_dataset(f"{t.kind}/{t.name}", data=t.data)
            ds.attrs.update(global_shape=t.global_shape, offsets=t.where.offsets, extents=t.where.extents,
                            split=t.split, opt_sharded=t.opt_sharded, crc32=crc32(t.data))
            if on_half_written is not None and i == len(tensors) // 2:
                f.flush()
                on_half_written()
        for key, value in append_info.items():
            f.create_dataset(f"append_info/{key}", data=value)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path.stat().st_size


def read_file(path, verify: bool = True, damaged: list = None) -> Shard:
    """Read a checkpoint file; raises CheckpointError with one line if it is missing, foreign, truncated or corrupt.

    With a list as `damaged`, a tensor whose checksum does not match is left out and its name appended
    there instead of raising (recovery then takes just that tensor from another holder).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        f = h5py.File(path, "r")
    except OSError:
        kind = "truncated or corrupt HDF5 file" if _has_hdf5_signature(path) else "not an HDF5 file"
        raise CheckpointError(f"cannot read checkpoint {path}: {kind}") from None
    try:
        with f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"not a dsim checkpoint (no format={FORMAT!r} attribute): {path}")
            meta = {k: (json.loads(v) if k in JSON_ATTRS else _plain(v)) for k, v in f.attrs.items()}
            shard = Shard(path, meta)
            for kind in ("params", "optimizer"):
                for name, ds in f.get(kind, {}).items():
                    data = ds[()]
                    a = ds.attrs
                    if verify and crc32(data) != int(a["crc32"]):
                        if damaged is None:
                            raise CheckpointError(f"checksum mismatch in {path}: {kind}/{name}")
                        damaged.append(name)
                        continue
                    shard.tensors[name] = Tensor(kind, name, tuple(int(x) for x in a["global_shape"]),
                                                 Slice(tuple(int(x) for x in a["offsets"]),
                                                       tuple(int(x) for x in a["extents"])),
                                                 data, str(a["split"]), bool(a["opt_sharded"]))
            for key, ds in f.get("append_info", {}).items():
                shard.append_info[key] = _plain(ds[()])
            return shard
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None


def _has_hdf5_signature(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(8) == b"\x89HDF\r\n\x1a\n"


def _plain(value):
    """h5py scalars and bytes to plain Python values; arrays stay arrays."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value
