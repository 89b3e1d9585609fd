"""Checkpoint tensor bytes by positioned I/O (format + tensor_io), and the async save's pieces, without MPI."""
import json
import os
import threading

import h5py
import numpy as np
import pytest

from bench.page_cache import evict, resident_pages
from dsim import aligned
from dsim.checkpoint import CheckpointError, tensor_io
from dsim.checkpoint.async_save import Abandoned, BackgroundWrite, Snapshot
from dsim.checkpoint.format import FORMAT, META_ATTR, Tensor, crc32, meta_table, read_file, write_file
from dsim.checkpoint.tensor_io import CHUNK
from dsim.parallel.layout import Slice

SHAPES = {"w": ((CHUNK // 4 + 7, 3), np.float32), "b": ((5,), np.float32), "empty": ((0, 4), np.float32),
          "d": ((33, 2, 3), np.float64), "i": ((9,), np.int64), "s": ((), np.float32)}


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for name, (shape, dtype) in SHAPES.items():
        data = np.asarray(rng.standard_normal(shape) * 1000).astype(dtype)
        out.append(Tensor("params" if name != "d" else "optimizer", name, shape, Slice((0,) * len(shape), shape), data))
    return out


META = {"epoch": 1, "global_step": 4, "layout": {"data_parallel": 2}, "optimizer": {"global_step": 4}}


def test_round_trip_is_bit_exact_and_plain_h5py_reads_it(tmp_path):
    ts = tensors()
    written = write_file(tmp_path / "x.h5", META, ts, {"step_num": np.int64(4)})
    shard = read_file(tmp_path / "x.h5")
    assert shard.digest == written.digest and shard.meta_checked
    with h5py.File(tmp_path / "x.h5", "r") as f:
        assert f.attrs["format"] == FORMAT
        assert json.loads(f.attrs[META_ATTR]) == meta_table(f)  # the table written from memory is the file's
        for t in ts:
            ds = f[f"{t.kind}/{t.name}"]
            assert ds.chunks is None and ds.compression is None  # contiguous, unfiltered: plain HDF5
            assert ds[()].tobytes() == t.data.tobytes() and ds.dtype == t.data.dtype
            assert int(ds.attrs["crc32"]) == crc32(t.data)
            assert shard.tensors[t.name].data.tobytes() == t.data.tobytes()
    assert int(shard.append_info["step_num"]) == 4


def test_tensor_attributes_are_stored_as_h5pys_own(tmp_path):
    """The attributes written with low-level calls (each HDF5 type and dataspace made once for all tensors and
    files) are, type, shape and value, what h5py's attrs[...] = value stores."""
    for i in range(2):  # the second file reuses the types the first made
        write_file(tmp_path / f"x{i}.h5", META, tensors(i), {})
    with h5py.File(tmp_path / "x1.h5", "r") as f, h5py.File(tmp_path / "ref.h5", "w") as ref:
        for t in tensors(1):
            ds, mine = f[f"{t.kind}/{t.name}"], ref.create_dataset(t.name, data=0)
            for name, value in ds.attrs.items():
                mine.attrs[name] = value
                ours, theirs = ds.attrs.get_id(name), mine.attrs.get_id(name)
                assert ours.get_type().equal(theirs.get_type()) and ours.shape == theirs.shape, (t.name, name)
                assert np.array_equal(mine.attrs[name], value) and type(mine.attrs[name]) is type(value)
            assert list(ds.attrs["global_shape"]) == list(t.global_shape) and ds.attrs["split"] == "replicated"


def test_read_goes_into_given_arrays_when_they_fit(tmp_path):
    ts = tensors()
    write_file(tmp_path / "x.h5", META, ts, {})
    into = {t.name: np.zeros_like(t.data) for t in ts}
    into["b"] = np.zeros(6, np.float32)            # another shape: read into a new array
    into["i"] = np.zeros(9, np.int32)               # another dtype: read into a new array
    into["d"] = np.zeros((33, 2, 6))[:, :, ::2]     # not contiguous: read into a new array
    shard = read_file(tmp_path / "x.h5", into=into)
    for t in ts:
        got = shard.tensors[t.name].data
        assert got.tobytes() == t.data.tobytes()
        assert (got is into[t.name]) == (t.name in ("w", "empty", "s"))


def flip_byte_of(path, dataset, at=0):
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + at)
        byte = fh.read(1)
        fh.seek(offset + at)
        fh.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_is_named_by_its_checksum(tmp_path):
    write_file(tmp_path / "x.h5", META, tensors(), {})
    flip_byte_of(tmp_path / "x.h5", "params/w", at=CHUNK + 5)  # in the second chunk
    with pytest.raises(CheckpointError, match="checksum mismatch in .*x.h5: params/w"):
        read_file(tmp_path / "x.h5")
    damaged = []
    shard = read_file(tmp_path / "x.h5", damaged=damaged)
    assert damaged == ["params/w"] and "w" not in shard.tensors and "b" in shard.tensors


def test_truncated_data_is_one_line(tmp_path):
    write_file(tmp_path / "x.h5", META, tensors(), {})
    with h5py.File(tmp_path / "x.h5", "r") as f:
        end = f["params/w"].id.get_offset() + 100
    os.truncate(tmp_path / "x.h5", end)
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*x.h5"):
        read_file(tmp_path / "x.h5")


def write_old_style(path, ts, version=2):
    """A file as write_file made it before positioned I/O: h5py's own datasets (compact or contiguous,
    allocated late, written by HDF5); version 1 has no metadata checksums."""
    with h5py.File(path, "w") as f:
        f.attrs["format"], f.attrs["format_version"] = FORMAT, version
        for key, value in META.items():
            f.attrs[key] = json.dumps(value) if isinstance(value, dict) else value
        for t in ts:
            ds = f.create_dataset(f"{t.kind}/{t.name}", data=t.data, **({"chunks": True} if t.name == "d" else {}))
            ds.attrs.update(global_shape=t.global_shape, offsets=t.where.offsets, extents=t.where.extents,
                            split=t.split, opt_sharded=t.opt_sharded, crc32=crc32(t.data))
        if version == 2:
            f.attrs[META_ATTR] = json.dumps(meta_table(f), sort_keys=True)


@pytest.mark.parametrize("version", [1, 2])
def test_files_written_the_old_way_still_load(tmp_path, version):
    ts = tensors()
    write_old_style(tmp_path / "old.h5", ts, version)
    into = {t.name: np.zeros_like(t.data) for t in ts}
    shard = read_file(tmp_path / "old.h5", into=into)
    assert shard.meta_checked == (version == 2)
    for t in ts:
        assert shard.tensors[t.name].data.tobytes() == t.data.tobytes()
        assert into[t.name].tobytes() == t.data.tobytes()  # chunked ones too, through h5py
    flip = tmp_path / "old.h5"
    flip_byte_of(flip, "params/w", at=8)
    with pytest.raises(CheckpointError, match="checksum mismatch in .*old.h5: params/w"):
        read_file(flip)


def test_snapshot_buffers_are_reused_and_independent_of_the_live_arrays():
    ts = tensors()
    snap = Snapshot()
    first = snap.take(ts)
    ids = [id(t.data) for t in first]
    ts[0].data[0, 0] += 1  # training goes on after the snapshot
    assert first[0].data[0, 0] != ts[0].data[0, 0]
    second = snap.take(ts)
    assert [id(t.data) for t in second] == ids and second[0].data.tobytes() == ts[0].data.tobytes()
    assert snap.bytes() == sum(t.data.nbytes for t in ts)


def test_background_write_reports_errors_and_can_be_abandoned(tmp_path):
    bad = BackgroundWrite(lambda check: write_file(tmp_path / "nodir" / "\0x.h5", META, tensors(), {}))
    result, error = bad.wait()
    assert result is None and error is not None
    go, release = threading.Event(), threading.Event()

    def slow_check_then(check):
        def each():
            go.set()
            release.wait(10)
            check()
        return write_file(tmp_path / "y.h5", META, tensors(), {}, after_each=each)
    w = BackgroundWrite(slow_check_then)
    assert go.wait(10) and not w.done()
    threading.Timer(0.2, release.set).start()
    result, error = w.abandon()
    assert result is None and isinstance(error, Abandoned)
    assert not list(tmp_path.glob("y.h5*"))  # nothing left: not the file, not its temporary


def test_the_fast_crc32_is_zlibs():
    import zlib

    from dsim.checkpoint import tensor_io
    data = np.random.default_rng(1).integers(0, 256, 3 * CHUNK + 11, dtype=np.uint8).tobytes()
    assert tensor_io.crc32(data) == zlib.crc32(data)
    assert tensor_io.crc32(data[7:], tensor_io.crc32(data[:7])) == zlib.crc32(data)


def test_aligned_arrays_start_at_a_page_and_equal_numpys():
    for shape, dtype in (((3, 1000), np.float32), ((0, 4), np.float64), ((), np.float32), ((7,), np.int64)):
        z, e = aligned.zeros(shape, dtype), aligned.empty(shape, dtype)
        assert z.shape == e.shape == shape and z.dtype == e.dtype == dtype and z.flags.c_contiguous
        assert aligned.is_aligned(z) and aligned.is_aligned(e) and not z.any()
    src = np.random.default_rng(0).standard_normal((5, 300))[:, ::2]  # not contiguous, float64
    c = aligned.copy_of(src, np.float32)
    assert aligned.is_aligned(c) and c.flags.c_contiguous
    assert c.tobytes() == np.ascontiguousarray(src, dtype=np.float32).tobytes()  # the same rounding


def _smaps_of(addr: int) -> dict:
    """The /proc/self/smaps fields (kB) of the mapping holding addr."""
    fields, here = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            here = lo <= addr < hi
        elif here and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def test_large_arrays_start_at_a_huge_page_and_their_partial_last_one_stays_small():
    """Direct I/O's requests then hold 2 MiB per piece of memory, not 4 KiB; no resident memory is added."""
    for make in (aligned.empty, aligned.zeros):
        n = 5 * aligned.HUGE + 12345
        a = make((n // 4,), np.float32)
        assert a.ctypes.data % aligned.HUGE == 0 and a.nbytes == n // 4 * 4 and a.flags.c_contiguous
        assert make is aligned.empty or not a.any()
        small = make((aligned.HUGE_MIN // 8 - 3,), np.float32)  # under numpy's huge-page threshold: a page
        assert aligned.is_aligned(small) and small.nbytes < aligned.HUGE_MIN
        a[:] = 1
        if os.path.exists("/proc/self/smaps") and aligned._MADVISE is not None:
            tail = _smaps_of(a.ctypes.data + a.nbytes - 1)
            assert tail.get("AnonHugePages", 0) == 0, tail  # the partial huge page at the end is in 4 KiB pages


def test_large_datasets_start_at_a_page_of_their_file(tmp_path):
    write_file(tmp_path / "x.h5", META, tensors(), {})
    with h5py.File(tmp_path / "x.h5", "r") as f:
        big = f["params/w"]
        assert big.nbytes >= tensor_io.ALIGNMENT[0] and big.id.get_offset() % aligned.PAGE == 0


@pytest.mark.parametrize("shift", [0, 4, 4096 + 12])
def test_a_cold_file_is_read_with_direct_io_into_aligned_arrays(tmp_path, shift):
    """Direct reads of the aligned middle, the page cache for the ends: the same bytes and CRC as a plain
    read, whatever the array's alignment; the cold file stays out of the page cache where O_DIRECT exists."""
    ts = tensors(3)
    write_file(tmp_path / "x.h5", META, ts, {})
    w = next(t for t in ts if t.name == "w")
    base = aligned.empty((w.data.nbytes + shift,), np.uint8)
    into = base[shift:].view(np.float32).reshape(w.data.shape) if shift % 4 == 0 else None
    evict(tmp_path / "x.h5")
    fd = os.open(tmp_path / "x.h5", os.O_RDONLY)
    try:
        direct = tensor_io.open_direct_read(tmp_path / "x.h5", fd)
        assert direct is not None or not hasattr(os, "O_DIRECT") or _no_direct_io(tmp_path)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)
    shard = read_file(tmp_path / "x.h5", into={"w": into})
    assert shard.tensors["w"].data is into and into.tobytes() == w.data.tobytes()
    if direct is not None and shift == 0:  # w's pages did not pass through the page cache (but for the
        cached, total = resident_pages(tmp_path / "x.h5")  # kernel's read-ahead after the metadata: 128 KiB)
        assert cached < total - w.data.nbytes // aligned.PAGE + 64


def _no_direct_io(path) -> bool:
    try:
        os.close(os.open(path / "x.h5", os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError:
        return True


def test_a_file_in_the_page_cache_is_read_from_there(tmp_path):
    write_file(tmp_path / "x.h5", META, tensors(), {})
    fd = os.open(tmp_path / "x.h5", os.O_RDONLY)
    try:
        os.read(fd, os.fstat(fd).st_size)
        assert tensor_io.cached_fraction(fd) == 1.0 and tensor_io.open_direct_read(tmp_path / "x.h5", fd) is None
        evict(tmp_path / "x.h5")
        assert tensor_io.cached_fraction(fd) < 0.5
    finally:
        os.close(fd)


def test_a_direct_read_of_a_truncated_file_is_one_line(tmp_path):
    ts = tensors()
    write_file(tmp_path / "x.h5", META, ts, {})
    with h5py.File(tmp_path / "x.h5", "r") as f:
        end_of_w = f["params/w"].id.get_offset() + f["params/w"].nbytes
    os.truncate(tmp_path / "x.h5", end_of_w - 3 * aligned.PAGE - 100)
    evict(tmp_path / "x.h5")
    into = {"w": aligned.empty(SHAPES["w"][0], np.float32)}
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*truncated or corrupt"):
        read_file(tmp_path / "x.h5", into=into)


def test_a_save_writes_large_tensors_with_direct_io(tmp_path):
    """The aligned bytes go to the disk without the page cache: after the save, w's pages are not cached
    (where the file system has direct I/O), and the file reads back bit-exact."""
    ts = tensors(5)
    w = next(t for t in ts if t.name == "w")
    w.data = aligned.copy_of(w.data)
    write_file(tmp_path / "x.h5", META, ts, {})
    if tensor_io.open_direct_write(tmp_path / "x.h5") is not None:
        cached, total = resident_pages(tmp_path / "x.h5")
        assert cached < total - w.data.nbytes // aligned.PAGE + 2
    shard = read_file(tmp_path / "x.h5")
    assert all(shard.tensors[t.name].data.tobytes() == t.data.tobytes() for t in ts)


def test_a_file_system_refusing_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    data = aligned.copy_of(np.arange(1 << 18, dtype=np.float32))
    fd = os.open(tmp_path / "x.bin", os.O_RDWR | os.O_CREAT, 0o644)
    direct = os.open(tmp_path / "x.bin", os.O_WRONLY)  # stands for a direct descriptor that is refused
    pwrite = os.pwrite

    def refusing(f, b, at):
        if f == direct:
            raise OSError(22, "Invalid argument")  # EINVAL, as a file system without O_DIRECT says
        return pwrite(f, b, at)
    monkeypatch.setattr(os, "pwrite", refusing)
    try:
        assert tensor_io.write_at(fd, data, 0, direct) == crc32(data)
    finally:
        os.close(fd)
        os.close(direct)
    assert (tmp_path / "x.bin").read_bytes() == data.tobytes()


def test_the_background_write_copies_the_snapshot_first_and_says_so(tmp_path):
    """The thread copies the live arrays into the snapshot, sets `copied`, then writes: what changes in the
    live arrays after `copied` is not in the file."""
    ts = tensors()
    original = {t.name: t.data.copy() for t in ts}
    planned, copies = Snapshot().plan(ts)
    assert all(not np.shares_memory(p.data, t.data) for p, t in zip(planned, ts))
    w = BackgroundWrite(lambda check: write_file(tmp_path / "x.h5", META, planned, {}, after_each=check), copies)
    assert w.copied.wait(30)
    for t in ts:
        t.data[...] = 0                        # the next update, once the copy is done
    assert w.wait()[1] is None
    shard = read_file(tmp_path / "x.h5")
    assert all(shard.tensors[n].data.tobytes() == a.tobytes() for n, a in original.items())


def test_page_cache_staging_writes_the_live_arrays_and_says_when_they_may_change(tmp_path):
    """checkpoint.async_staging: page_cache. The thread writes the live arrays themselves through the page
    cache (no snapshot buffer, no direct I/O) and sets `copied` once every tensor's bytes are in the file,
    before its fsync and rename: what changes in the live arrays after that is not in the file."""
    ts = tensors(7)
    w_live = next(t for t in ts if t.name == "w")
    w_live.data = aligned.copy_of(w_live.data)  # aligned, as the model's arrays: direct I/O would take it
    original = {t.name: t.data.copy() for t in ts}
    seen = {}

    def staged_then_wait(on_staged):
        def staged():
            seen["tmp"] = [p.name for p in tmp_path.iterdir()]  # the temporary only: not renamed yet
            seen["cached"] = resident_pages(tmp_path / "x.h5.tmp")
            on_staged()
            assert release.wait(10)
        return staged
    release = threading.Event()
    w = BackgroundWrite(lambda check, staged: write_file(tmp_path / "x.h5", META, ts, {}, after_each=check,
                                                         direct=False, on_staged=staged_then_wait(staged)),
                        staged_by_write=True)
    assert w.copied.wait(30) and not w.done()
    for t in ts:
        t.data[...] = 0                        # the next update, once the bytes are staged
    release.set()
    assert w.wait()[1] is None
    assert seen["tmp"] == ["x.h5.tmp"]
    cached, total = seen["cached"]
    assert cached >= w_live.data.nbytes // aligned.PAGE  # w went through the page cache, not around it
    if tensor_io.open_direct_write(tmp_path / "x.h5") is not None:  # a disk's file system, not a tmpfs
        assert resident_pages(tmp_path / "x.h5")[0] < w_live.data.nbytes // aligned.PAGE  # durable, pages given back
    shard = read_file(tmp_path / "x.h5")
    assert all(shard.tensors[n].data.tobytes() == a.tobytes() for n, a in original.items())


def test_page_cache_staging_sets_copied_when_the_write_fails_or_is_abandoned(tmp_path):
    bad = BackgroundWrite(lambda check, staged: write_file(tmp_path / "nodir" / "\0x.h5", META, tensors(), {},
                                                           direct=False, on_staged=staged), staged_by_write=True)
    assert bad.wait()[1] is not None and bad.copied.is_set()  # the update that waits for it is not held forever
    go, release = threading.Event(), threading.Event()

    def each(check):
        go.set()
        release.wait(10)
        check()
    w = BackgroundWrite(lambda check, staged: write_file(tmp_path / "y.h5", META, tensors(), {},
                                                         after_each=lambda: each(check), direct=False,
                                                         on_staged=staged), staged_by_write=True)
    assert go.wait(10) and not w.copied.is_set()       # the first tensor is written, the rest are not
    threading.Timer(0.2, release.set).start()
    result, error = w.abandon()
    assert result is None and isinstance(error, Abandoned) and w.copied.is_set()
    assert not list(tmp_path.glob("y.h5*"))
