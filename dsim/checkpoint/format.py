"""One checkpoint file in HDF5: self-describing for anyone with h5py or h5dump.

Layout of a file:
    /                 attrs: format, format_version, epoch, step_in_epoch, global_step, rank, world_size,
                      layout, prefix, integrated_save, group_info, optimizer, schedule, data, seed, dtype
    /params/<name>    this rank's slice of a parameter
    /optimizer/<name> this rank's slice of an optimizer state (e.g. moment1.layer2.weight)
    /append_info/<k>  user values (epoch_num, step_num, and the append_info dict)
Each tensor carries attrs global_shape, offsets, extents, split (mp axis), opt_sharded and crc32.
JSON-valued attrs (layout, optimizer, ...) are stored as strings.

Format 2 adds `meta_crc32`: a JSON table of CRC-32s over everything but the tensor data, one per item (each
root attribute, each leaf of a JSON attribute such as `optimizer.global_step`, each tensor's attributes with
its dtype and shape, each append_info value), so a damaged file names what differed. The tensor data is
covered by each tensor's own crc32 attribute, which the table covers in turn. `content_digest` (SHA-256 of
the table) is what a commit record keeps per file: a file swapped, edited or replaced after the commit
no longer matches it. Format 1 files (no table) still load; their metadata is unchecked.

Format 3 stores every tensor in MindSpore's own shape: the Transformer's weights that MindSpore keeps (in, out)
(`_Linear(transpose_b=False)`: the feed-forward `output.mapping` and `output.projection`, the attention's and
cross-attention's `projection`) are (in, out); formats 1 and 2 stored them (out, in). The same name and, when
square, the same shape would then mean the transpose, so an older file holding one of them is refused with one
line (check_tensor_layouts); older files without them (the MLPs, LeNet5) load as before.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

import h5py
import numpy as np

from .. import aligned
from ..parallel.layout import Slice
from . import tensor_io
from .errors import CheckpointError

FORMAT, VERSION = "dsim-checkpoint", 3
IN_OUT_SINCE = 3   # the format from which the weights named by IN_OUT are stored (in, out)
IN_OUT = ("output.mapping.weight", "output.projection.weight", "attention.projection.weight")
JSON_ATTRS = ("layout", "group_info", "optimizer", "schedule", "data", "config")
META_ATTR = "meta_crc32"   # the metadata checksum table (format 2); not part of a Shard's meta


def check_tensor_layouts(version, names, path) -> None:
    """Raise CheckpointError (one line) when a file of format `version` holds a tensor stored in a layout dsim
    no longer uses: names are its tensors' names (parameters and optimizer states, e.g. moment1.<param>)."""
    if int(version) >= IN_OUT_SINCE:
        return
    old = sorted(n for n in names if n.endswith(IN_OUT))
    if old:
        raise CheckpointError(f"{path} is a checkpoint of an older dsim (format {version}): its {old[0]} is stored "
                              f"(out, in), dsim now stores it (in, out) as MindSpore does; resume it with the dsim "
                              f"that wrote it, or train from the start")


def crc32(arr: np.ndarray) -> int:
    """CRC-32 of an array's bytes (C order)."""
    return tensor_io.crc32(tensor_io.byte_view(np.ascontiguousarray(arr)))


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


class Deferred(NamedTuple):
    """Tensor data read only when the writer reaches it (one tensor in memory at a time: dsim.reshard)."""

    shape: tuple
    dtype: np.dtype
    fill: object   # fill(out): write the tensor's values into out, an empty array of shape and dtype

    @property
    def flags(self):
        return _DeferredFlags

    def materialize(self) -> np.ndarray:
        out = aligned.empty(self.shape, self.dtype)  # written with direct I/O
        self.fill(out)
        return out


class _DeferredFlags:
    c_contiguous = True


@dataclass
class Shard:
    """A checkpoint file read back: its attributes, tensors and append_info values."""

    path: Path
    meta: dict
    tensors: dict = field(default_factory=dict)   # name -> Tensor
    append_info: dict = field(default_factory=dict)
    digest: Optional[str] = None                  # content_digest of the file as read
    meta_checked: bool = False                    # False: a format 1 file, its metadata has no checksums


class Written(NamedTuple):
    """What write_file wrote: the file's size and its content digest (for the commit record)."""

    size: int
    digest: str


def _crc_item(key: str, value) -> int:
    text = json.dumps(value, sort_keys=True, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    return zlib.crc32(f"{key}={text}".encode())


def _leaves(key: str, value):
    """(dotted key, value) of every leaf of a JSON value: optimizer -> optimizer.global_step, ..."""
    if isinstance(value, dict) and value:
        for k in sorted(value):
            yield from _leaves(f"{key}.{k}", value[k])
    else:
        yield key, value


_STR = h5py.string_dtype()
_ATTR_TYPES = {}   # (dtype, shape) -> (file type, dataspace, memory type): made once, used for every tensor


def _attr_types(data: np.ndarray) -> tuple:
    key = (data.dtype, data.shape)
    types = _ATTR_TYPES.get(key)
    if types is None:
        types = _ATTR_TYPES[key] = (h5py.h5t.py_create(data.dtype, logical=True), h5py.h5s.create_simple(data.shape),
                                    h5py.h5t.py_create(data.dtype))
    return types


def _set_attrs(obj, attrs: dict) -> None:
    """Create the attributes of a new object (ints, int tuples, bools, strings) as h5py's attrs[...] = value
    would, with the low-level calls only, each HDF5 type and dataspace made once: a checkpoint has hundreds
    of tensors, and h5py's checks cost more than HDF5."""
    for name, value in attrs.items():
        if isinstance(value, str):
            data = np.array(value, dtype=_STR)
        elif isinstance(value, (bool, np.bool_)):
            data = np.array(bool(value))
        else:
            data = np.asarray(value, dtype=np.int64)
        htype, space, mtype = _attr_types(data)
        attr = h5py.h5a.create(obj.id, name.encode(), htype, space)
        try:
            attr.write(data, mtype=mtype)
        finally:
            attr.close()


def datasets_of(f, kinds=("params", "optimizer", "append_info")) -> dict:
    """(kind, name) -> (dataset, its attributes as plain values) of every dataset of an open checkpoint file
    (or of the groups named in kinds), each attribute read once (the metadata checks and the tensors share them)."""
    out = {}
    for kind in kinds:
        group = f.get(kind)
        for name, ds in (group.items() if isinstance(group, h5py.Group) else ()):
            out[kind, name] = ds, {k: _plain(v) for k, v in ds.attrs.items()}
    return out


def meta_table(f, datasets: dict = None) -> dict:
    """item -> CRC-32 of everything in an open checkpoint file but the tensor data (see the module doc).

    datasets: datasets_of(f), when already read.
    """
    table = {}
    for key in sorted(f.attrs):
        if key == META_ATTR:
            continue
        raw = _plain(f.attrs[key])
        if key in JSON_ATTRS:
            try:
                raw = json.loads(raw)
            except (TypeError, ValueError):
                pass  # damaged JSON: checked as the string it is
            table.update((k, _crc_item(k, v)) for k, v in _leaves(key, raw))
        else:
            table[key] = _crc_item(key, raw)
    for (kind, name), (ds, attrs) in (datasets_of(f) if datasets is None else datasets).items():
        item = {"dtype": str(ds.dtype), "shape": list(ds.shape), **attrs}
        if kind == "append_info":
            item["value"] = _plain(ds[()])
        table[f"{kind}/{name}"] = _crc_item(f"{kind}/{name}", item)
    return table


def content_digest(table: dict) -> str:
    """SHA-256 of a file's metadata checksum table: one value standing for the whole file's content."""
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


def check_meta(f, datasets: dict = None) -> tuple:
    """(table, what differed, checked) for an open checkpoint file.

    What differed lists the items whose checksum no longer matches (empty when all match); checked is
    False for a format 1 file, which carries no table.
    """
    table, stored = meta_table(f, datasets), f.attrs.get(META_ATTR)
    if stored is None:
        version = _plain(f.attrs.get("format_version", 1))
        return table, (["meta_crc32 (the metadata checksums are missing)"] if version != 1 else []), version != 1
    try:
        stored = json.loads(_plain(stored))
        if not isinstance(stored, dict):
            raise ValueError
    except (TypeError, ValueError):
        return table, ["meta_crc32 (the metadata checksums are unreadable)"], True
    return table, sorted(k for k in set(stored) | set(table) if stored.get(k) != table.get(k)), True


class _Sink(io.RawIOBase):
    """A file for h5py's file-object driver that never fails towards HDF5.

    The first OSError (disk full, quota, I/O error) is kept and later writes are dropped, so HDF5 goes on
    and closes normally; write_file then raises it. HDF5 itself meeting a failed write on a full disk
    leaves broken objects whose clean-up prints tracebacks and can end the process with a segmentation fault.
    """

    def __init__(self, path, direct: bool = True):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        # the tensors' aligned bytes (None: no direct I/O here, or buffered writes asked for)
        self.direct = tensor_io.open_direct_write(path) if direct else None
        self.pos = self.size = 0
        self.error = None

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = offset if whence == 0 else (self.pos + offset if whence == 1 else self.size + offset)
        return self.pos

    def tell(self):
        return self.pos

    def write(self, b):
        view = memoryview(b).cast("B")
        if self.error is None:
            try:
                done = 0
                while done < len(view):
                    done += os.pwrite(self.fd, view[done:], self.pos + done)
            except OSError as e:
                self.error = e
        self.pos += len(view)
        self.size = max(self.size, self.pos)
        return len(view)

    def write_tensor(self, ds, data: np.ndarray, offset) -> int:
        """Put an array's bytes in place of its dataset (allocated early, its bytes at offset: raw_offset(ds));
        returns their CRC-32.

        After an error nothing more is written (the CRC is still computed, so the file stays consistent
        for HDF5 until write_file raises the error).
        """
        if offset is None:  # not laid out as asked (an empty dataset): HDF5 writes it, through this sink
            if data.size:
                ds.write_direct(data)
            return crc32(data)
        if self.error is not None:
            return crc32(data)
        try:
            return tensor_io.write_at(self.fd, data, offset, self.direct)
        except OSError as e:
            self.error = e
            return crc32(data)

    def preallocate(self, nbytes: int) -> None:
        """Reserve the tensors' space on the disk before they are written (tensor_io.preallocate)."""
        if self.error is None:
            try:
                tensor_io.preallocate(self.fd, nbytes)
            except OSError as e:
                self.error = e

    def readinto(self, b):
        n = os.preadv(self.fd, [b], self.pos) if self.error is None else 0
        self.pos += n
        return n

    def truncate(self, size=None):
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                self.error = e
        self.size = size
        return size

    def flush(self):
        pass

    def close(self):
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        super().close()


def fsync_path(path) -> None:
    """fsync a file or directory by path, so a rename that follows is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path, meta: dict, tensors, append_info: dict, on_half_written=None, after_each=None,
               direct: bool = True, on_staged=None) -> Written:
    """Write a checkpoint file via a temporary name, fsync it, rename it into place; returns (size, digest).

    on_half_written() is called once half of the tensors are in the file (fault injection); after_each()
    after every tensor (an async save's thread stops there when abandoned: what it raises ends the write).
    direct=False writes every tensor through the page cache; on_staged() is then called once the last tensor's
    bytes are there, before the fsync: from that moment the arrays may change (an async save staged in the
    page cache lets the next update go on, while the kernel writes the bytes out).
    Every tensor's dataset is allocated when the file is created, their space reserved on the disk at once
    (tensor_io.preallocate: a disk without room fails here, before a byte is written), and each one's bytes
    go straight from the array to their place in the file (tensor_io), with the CRC-32 computed on the way.
    Any failure (disk full, quota, read-only, permission) removes the temporary and raises one OSError
    naming the file; nothing is left behind.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tensors = list(tensors)
    sink = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sink = _Sink(tmp, direct)
        threshold, interval = tensor_io.ALIGNMENT
        with h5py.File(sink, "w", alignment_threshold=threshold, alignment_interval=interval) as f:
            f.attrs["format"], f.attrs["format_version"] = FORMAT, VERSION
            for key, value in meta.items():
                if key != META_ATTR:
                    f.attrs[key] = json.dumps(value) if key in JSON_ATTRS else value
            placed = []
            for t in tensors:
                data = t.data if t.data.flags.c_contiguous else np.ascontiguousarray(t.data)
                ds = f.create_dataset(f"{t.kind}/{t.name}", shape=data.shape, dtype=data.dtype,
                                      dcpl=tensor_io.early_dcpl())
                placed.append((ds, data, tensor_io.raw_offset(ds)))
            sink.preallocate(max([at + ds.id.get_storage_size() for ds, _, at in placed if at is not None], default=0))
            if sink.error is not None:  # no room for the tensors: known before a byte of them is written
                raise sink.error
            datasets = {}  # what the checksum table covers, from memory: no second pass over the file
            for i, (t, (ds, data, at)) in enumerate(zip(tensors, placed)):
                if isinstance(data, Deferred):
                    data = data.materialize()
                attrs = dict(global_shape=t.global_shape, offsets=t.where.offsets, extents=t.where.extents,
                             split=t.split, opt_sharded=t.opt_sharded, crc32=sink.write_tensor(ds, data, at))
                _set_attrs(ds, attrs)
                datasets[t.kind, t.name] = ds, attrs
                if on_half_written is not None and i == len(tensors) // 2:
                    f.flush()
                    on_half_written()
                if after_each is not None:
                    after_each()
            if on_staged is not None:
                on_staged()
            for key, value in append_info.items():
                f.create_dataset(f"append_info/{key}", data=value)
            if append_info:
                datasets.update(datasets_of(f, ("append_info",)))
            table = meta_table(f, datasets)
            f.attrs[META_ATTR] = json.dumps(table, sort_keys=True)
        if sink.error is not None:
            raise sink.error
        os.fsync(sink.fd)
        if not direct:  # staged in the page cache: durable now, so give its pages back for the next save to reuse
            os.posix_fadvise(sink.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        sink.close()
        os.replace(tmp, path)
        fsync_path(path.parent)
        return Written(path.stat().st_size, content_digest(table))
    except BaseException as e:
        if sink is not None:
            sink.close()
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(tmp if sink is not None else path)) from None
        raise


def read_file(path, verify: bool = True, damaged: list = None, into=None) -> Shard:
    """Read a checkpoint file; raises CheckpointError with one line if it is missing, foreign, truncated or corrupt.

    verify: every tensor's CRC-32 and the metadata checksums (format 2) must match; a mismatch names the item.
    With a list as `damaged`, a tensor whose data does not match its checksum is left out and `<kind>/<name>`
    appended there instead of raising (recovery then takes just that tensor from another holder).
    into: name -> array (C-contiguous, writable) where a tensor of that shape and dtype is read, e.g. the
    model's and optimizer's own arrays, so loading allocates and copies nothing; the Shard's tensor then
    is that array. The tensors are read while the metadata is checked, so a file that fails a check may
    have been read into them: the caller replaces them (from a replica or another checkpoint).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        f = h5py.File(path, "r")
    except Exception:
        kind = "truncated or corrupt HDF5 file" if _has_hdf5_signature(path) else "not an HDF5 file"
        raise CheckpointError(f"cannot read checkpoint {path}: {kind}") from None
    fd = direct = reading = None
    try:
        with f:
            fd = os.open(path, os.O_RDONLY)
            direct = tensor_io.open_direct_read(path, fd)  # None: read through the page cache
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"not a dsim checkpoint (no format={FORMAT!r} attribute): {path}")
            check_tensor_layouts(_plain(f.attrs.get("format_version", 1)),
                                 [n for kind in ("params", "optimizer") if isinstance(f.get(kind), h5py.Group)
                                  for n in f[kind]], path)
            found = {(kind, name): ds for kind in ("params", "optimizer", "append_info")
                     for name, ds in (f[kind].items() if isinstance(f.get(kind), h5py.Group) else ())}
            # The bytes of tensors laid out in place are read by a thread of their own, in file order, while this
            # one reads and checks the metadata: the disk starts at once instead of after every rank's CPU work
            offsets = {key: tensor_io.raw_offset(ds) for key, ds in found.items() if key[0] != "append_info"}
            placed = {key: (_target(found[key], (into or {}).get(key[1]), at), at) for key, at in offsets.items()}
            if direct is None:
                tensor_io.prefetch(fd, 0, os.fstat(fd).st_size)
            reading = Reading(fd, direct, {key: (data, at) for key, ((data, _), at) in placed.items() if at is not None})
            datasets = {key: (ds, {k: _plain(v) for k, v in ds.attrs.items()}) for key, ds in found.items()}
            table, differ, checked = check_meta(f, datasets)
            if verify and differ:
                raise CheckpointError(f"metadata checksum mismatch in {path}: {', '.join(differ)}")
            meta = {k: (json.loads(v) if k in JSON_ATTRS else _plain(v)) for k, v in f.attrs.items() if k != META_ATTR}
            shard = Shard(path, meta, digest=content_digest(table), meta_checked=checked)
            crcs = reading.join()
            for (kind, name), (ds, a) in datasets.items():
                if kind == "append_info":
                    shard.append_info[name] = _plain(ds[()])
                    continue
                (data, fits), at = placed[kind, name]
                if at is None:  # not laid out in place (old and foreign files): through h5py
                    data = ds[()] if not fits else data
                    if fits:
                        ds.read_direct(data)
                    crc = crc32(data) if verify else None
                else:
                    crc = crcs[kind, name]
                if verify and crc != int(a["crc32"]):
                    if damaged is None:
                        raise CheckpointError(f"checksum mismatch in {path}: {kind}/{name}")
                    damaged.append(f"{kind}/{name}")
                    continue
                shard.tensors[name] = Tensor(kind, name, tuple(int(x) for x in a["global_shape"]),
                                             Slice(tuple(int(x) for x in a["offsets"]),
                                                   tuple(int(x) for x in a["extents"])),
                                             data, str(a["split"]), bool(a["opt_sharded"]))
            return shard
    except CheckpointError:
        raise
    except EOFError:
        raise CheckpointError(f"cannot read checkpoint {path}: truncated or corrupt HDF5 file") from None
    except Exception as e:  # whatever a damaged file makes h5py raise: one line
        raise CheckpointError(f"cannot read checkpoint {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    finally:
        if reading is not None:
            reading.stop()
        for d in (fd, direct):
            if d is not None:
                os.close(d)


def _target(ds, target, offset) -> tuple:
    """(where a dataset is read, whether that is the given target): the target when its shape, dtype and
    memory fit, else a new page-aligned array (None for one read through h5py: offset None)."""
    fits = (target is not None and target.shape == ds.shape and target.dtype == ds.dtype
            and target.flags.c_contiguous and target.flags.writeable)
    if fits:
        return target, True
    return (aligned.empty(ds.shape, ds.dtype) if offset is not None else None), False


class Reading:
    """A thread that reads tensors' bytes (key -> (array, file offset)) in file order; join() gives key -> CRC-32.

    It touches only the file descriptors and the arrays (no h5py, which is not used by two threads at once).
    """

    def __init__(self, fd: int, direct, jobs: dict):
        self.fd, self.direct, self.jobs = fd, direct, sorted(jobs.items(), key=lambda item: item[1][1])
        self.crcs, self.error, self.stopped = {}, None, False
        self.thread = threading.Thread(target=self._run, name="dsim-read", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for key, (data, offset) in self.jobs:
                if self.stopped:
                    return
                self.crcs[key] = tensor_io.read_at(self.fd, data, offset, self.direct)
        except BaseException as e:  # raised by join(), in the reading process's thread
            self.error = e

    def join(self) -> dict:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.crcs

    def stop(self) -> None:
        """Stop after the tensor being read and wait (the arrays and descriptors are not used after this)."""
        self.stopped = True
        self.thread.join()


def _has_hdf5_signature(path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(8) == b"\x89HDF\r\n\x1a\n"
    except OSError:
        return False


def _plain(value):
    """h5py scalars and bytes to plain Python values; arrays stay arrays."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value
