"""Resharding: a committed sharded checkpoint read into another layout or world size.

MindSpore converts between strategies offline (`transform_checkpoints`); PyTorch DCP, Megatron-Core and Orbax
reshard when they load. dsim does both from the commit record's slice table, which says for every tensor
(parameters and optimizer state) which boxes were saved and which ranks' files hold each:

- a rank that needs a box (its owned slice under the new layout) reads the overlap of every saved box that
  meets it, only those bytes (an HDF5 hyperslab), straight into its array, from the first holder whose file
  is usable (present, its metadata checksums whole and its content digest the record's); a missing or
  damaged file is passed over for another holder, as a repair from a replica would;
- a saved box read whole is checked against its CRC-32; a part of a box cannot be (its checksum covers the
  box), so the metadata digest is what vouches for the file then;
- nothing is held but the rank's own slices: memory is bounded by its shard.

`Source` does the reading (`load_resharded` puts it into a built run: `--resume` on another layout), and
`dsim.reshard` (python -m dsim.reshard) writes a committed checkpoint for a target layout offline.
"""
from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from ..parallel.layout import ParallelLayout, Slice
from . import progression, record as rec
from .errors import CheckpointError
from .format import JSON_ATTRS, META_ATTR, _plain, check_meta, check_tensor_layouts, content_digest, crc32, datasets_of
from .loader import file_for, whole_slices


def intersect(a: Slice, b: Slice):
    """The box common to two boxes of the same tensor, or None."""
    lo = [max(x, y) for x, y in zip(a.offsets, b.offsets)]
    hi = [min(x + e, y + f) for x, e, y, f in zip(a.offsets, a.extents, b.offsets, b.extents)]
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return Slice(tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi)))


def layout_of(record: dict) -> ParallelLayout:
    return ParallelLayout(**record["layout"])


def specs_of(record: dict) -> list:
    """The parameters of a committed checkpoint (name, global shape, mp split, stage) from its slice table."""
    layout, out, seen = layout_of(record), [], set()
    per_stage = layout.stage_size
    for entry in record["slices"]:
        kind, name = entry["tensor"].split("/", 1)
        if kind != "params" or name in seen:
            continue
        seen.add(name)
        holders = progression.set_from_json(entry["holders"])
        stage = min(r.start for r in holders) // per_stage if layout.pipeline_stage > 1 else 0
        out.append((name, tuple(entry["global_shape"]), stage))
    return out


class Source:
    """A committed sharded checkpoint opened for reading boxes of its tensors (files opened as needed)."""

    def __init__(self, directory, record: dict):
        if record.get("integrated_save"):
            raise CheckpointError(f"{record['name']} is an integrated checkpoint: it loads into any layout as is")
        if not rec.is_compact(record) and "slices" not in record:
            raise CheckpointError(f"{record['name']}: its commit record has no slice table (saved before "
                                  "dsim-commit/2): it can only be loaded on the layout it was saved with")
        self.directory, self.record = Path(directory), record
        self.boxes = {}   # "params/name" -> [(Slice, [progressions of holder ranks])]
        for entry in record["slices"]:
            box = Slice(tuple(entry["offsets"]), tuple(entry["extents"]))
            self.boxes.setdefault(entry["tensor"], []).append((box, progression.set_from_json(entry["holders"])))
        self.digests, why = rec.read_digests(self.directory, record)
        if why:
            raise CheckpointError(f"{record['name']}: {why}")
        self._files = {}   # rank -> open h5py.File, or the reason it cannot be used
        self.passed_over = {}   # rank -> why its file was not used
        self.bytes_read = 0

    def close(self) -> None:
        for f in self._files.values():
            if isinstance(f, h5py.File):
                f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def file(self, rank: int):
        """rank's file, open, when it is usable; None (and why in passed_over) when it is not."""
        if rank not in self._files:
            path = file_for(self.directory, self.record, rank)
            try:
                f = h5py.File(path, "r")
            except (OSError, ValueError):
                self._files[rank] = f"{path} is missing or not a readable HDF5 file"
            else:
                try:
                    check_tensor_layouts(_plain(f.attrs.get("format_version", 1)),
                                         [n for kind in ("params", "optimizer") if kind in f for n in f[kind]], path)
                except CheckpointError:
                    f.close()
                    raise
                table, differ, _ = check_meta(f, datasets_of(f))
                expected = None if self.digests is None else self.digests.get(rank)
                if differ:
                    self._files[rank] = f"metadata checksum mismatch in {path}: {', '.join(differ[:3])}"
                elif expected is not None and content_digest(table) != expected:
                    self._files[rank] = f"{path} is not the file committed (its content digest differs)"
                else:
                    self._files[rank] = f
                if not isinstance(self._files[rank], h5py.File):
                    f.close()
            if not isinstance(self._files[rank], h5py.File):
                self.passed_over[rank] = self._files[rank]
        f = self._files[rank]
        return f if isinstance(f, h5py.File) else None

    def meta(self) -> dict:
        """The scalar state of the checkpoint (global step, optimizer, schedule, data, append_info) from the
        first usable file."""
        for r in sorted(set(range(int(self.record["world_size"])))):
            f = self.file(r)
            if f is not None:
                meta = {k: (json.loads(v) if k in JSON_ATTRS else _plain(v)) for k, v in f.attrs.items()
                        if k != META_ATTR}
                info = {name: _plain(ds[()]) for name, ds in f["append_info"].items()} if "append_info" in f else {}
                return {**meta, "append_info": info}
        raise CheckpointError(f"{self.record['name']}: no file is usable ({self._why()})")

    def dataset(self, tensor: str):
        """The dataset of `tensor` in the first usable file holding it (for its dtype and attributes)."""
        for _, holders in self.boxes.get(tensor, []):
            for rank in _ranks(holders):
                f = self.file(rank)
                if f is not None and tensor in f:
                    return f[tensor]
        raise CheckpointError(f"{self.record['name']}: no usable file holds {tensor} ({self._why()})")

    def dtype_of(self, tensor: str) -> np.dtype:
        return self.dataset(tensor).dtype

    def split_of(self, tensor: str) -> str:
        """How model parallelism split it when saved: "replicated" or "axisN" (each dataset records it)."""
        return _plain(self.dataset(tensor).attrs["split"])

    def read(self, tensor: str, box: Slice, out: np.ndarray) -> None:
        """Fill out (the box `box` of `tensor`, e.g. "params/layer2.weight") from the saved boxes it meets."""
        if tensor not in self.boxes:
            raise CheckpointError(f"{self.record['name']} holds no {tensor}")
        covered = 0
        for saved, holders in self.boxes[tensor]:
            part = intersect(saved, box)
            if part is None:
                continue
            for rank in _ranks(holders):
                f = self.file(rank)
                if f is None or tensor not in f:
                    continue
                ds = f[tensor]
                target = out[part.relative_to(box)]
                if target.flags.c_contiguous:
                    ds.read_direct(target, source_sel=part.relative_to(saved))
                else:
                    target[...] = ds[part.relative_to(saved)]
                if part == saved and "crc32" in ds.attrs and crc32(target) != int(ds.attrs["crc32"]):
                    self.passed_over[rank] = f"checksum mismatch in {f.filename}: {tensor}"
                    continue
                covered += target.size
                self.bytes_read += target.nbytes
                break
            else:
                raise CheckpointError(f"{tensor}: no usable file holds offsets {list(part.offsets)} extents "
                                      f"{list(part.extents)} ({self._why()})")
        if covered != out.size:
            raise CheckpointError(f"{tensor}: the checkpoint's slices cover {covered} of the {out.size} elements "
                                  f"at offsets {list(box.offsets)} extents {list(box.extents)}")

    def _why(self) -> str:
        return "; ".join(f"rank {r}: {why}" for r, why in sorted(self.passed_over.items())[:3]) or "none tried"


def _ranks(holders):
    """The holder ranks of a saved box, lowest first (lazily: a replicated tensor's holders are many)."""
    for r in sorted(holders, key=lambda p: p.start):
        yield from r


def check_target(record: dict, specs, layout: ParallelLayout) -> None:
    """Raise CheckpointError unless the checkpoint's tensors are the model's (names and global shapes)."""
    saved = {name: shape for name, shape, _ in specs_of(record)}
    model = {s.name: tuple(s.shape) for s in specs}
    if set(saved) != set(model):
        extra, missing = sorted(set(saved) - set(model)), sorted(set(model) - set(saved))
        raise CheckpointError(f"{record['name']} does not hold this model's parameters"
                              + (f"; missing {', '.join(missing[:3])}" if missing else "")
                              + (f"; unknown {', '.join(extra[:3])}" if extra else ""))
    for name, shape in model.items():
        if saved[name] != shape:
            raise CheckpointError(f"{name}: the checkpoint's global shape {list(saved[name])} is not the model's "
                                  f"{list(shape)}")


def load_resharded(run, directory, record: dict) -> dict:
    """Load a committed sharded checkpoint of another layout or world size into a built run (collective).

    Every rank reads its owned slices of every parameter and optimizer state from the files holding them;
    then the optimizer-sharded parameters are all-gathered, the step counter and data position set. Any
    rank's error raises the same CheckpointError on all. Returns the checkpoint's scalar state (meta).
    """
    from ..engine.state import owned_pieces
    groups = run.groups
    error, meta, stats = None, None, (0, {})
    params = {p.name for p in run.network.trainable_params()}
    try:
        check_target(record, run.network.specs, groups.layout)
        with Source(directory, record) as source:
            for name, _, where, arr in owned_pieces(run.network, run.optimizer):
                source.read(f"{'params' if name in params else 'optimizer'}/{name}", where, arr)
            meta = source.meta()
            stats = (source.bytes_read, dict(source.passed_over))
    except (CheckpointError, OSError, KeyError, ValueError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"{record['name']}: {e}"
    reports = groups.world.allgather((error, stats[1]))
    errors = [e for e, _ in reports if e]
    if errors:
        raise CheckpointError(errors[0])
    whole_slices(run.network, groups.shard)
    run.optimizer.global_step = int(meta["optimizer"]["global_step"])
    run.loader.set_init_step(int(meta["global_step"]))
    passed = {}
    for _, over in reports:
        passed.update(over)
    return {**meta, "bytes_read": stats[0], "passed_over": passed}
