"""Checkpoint integrity without MPI: metadata checksums, content digests, format 1 files, full and read-only disks."""
import errno
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, readonly_view, tmpfs
from dsim import inspect as dinspect
from dsim.checkpoint import commit as cm
from dsim.checkpoint.record import read_digests
from dsim.checkpoint.catalog import scan
from dsim.checkpoint.errors import CheckpointError
from dsim.checkpoint.format import META_ATTR, Tensor, read_file, write_file
from dsim.checkpoint.saver import SaveError, check_writable
from dsim.checkpoint.verify import verify
from dsim.config import ConfigError, load_config
from dsim.parallel.layout import Slice


def meta(rank=0, step=14):
    """The attributes a dsim file carries (as saver.resume_meta writes them) for a dp2 x mp1 run."""
    return {"epoch": 2, "step_in_epoch": 4, "global_step": step, "rank": rank, "world_size": 2,
            "layout": {"data_parallel": 2, "model_parallel": 1, "optimizer_shard": 1},
            "optimizer": {"name": "adam", "global_step": step, "learning_rate": 0.002, "beta1": 0.9, "beta2": 0.999},
            "schedule": {"name": "constant", "base_lr": 0.002},
            "data": {"global_step": step, "steps_per_epoch": 10, "batch_size": 32},
            "seed": 1, "dtype": "float64", "prefix": "net", "integrated_save": False, "group_info": [0, 1]}


def tensors(seed=0):
    w = np.random.default_rng(seed).standard_normal((4, 3))
    return [Tensor("params", "w", (4, 3), Slice((0, 0), (4, 3)), w), Tensor("optimizer", "moment1.w", (4, 3),
            Slice((0, 0), (4, 3)), w * 0.5)]


def checkpoint(directory, name="net-2_4", step=14, digests=True):
    """A committed two-rank checkpoint (replicas of each other), as the saver writes it."""
    files, written = {}, {}
    for rank in range(2):
        rel = f"rank_{rank}/{name}.h5"
        written[str(rank)] = write_file(directory / rel, meta(rank, step), tensors(), {
            "epoch_num": np.int64(2), "step_num": np.int64(step)}).digest
        files[str(rank)] = rel
    record = {"name": name, "prefix": "net", "epoch": 2, "step_in_epoch": 4, "global_step": step, "sequence": step,
              "world_size": 2, "layout": meta()["layout"], "integrated_save": False, "files": files}
    cm.write_commit(directory, {**record, "digests": written} if digests else record)
    return directory / "rank_1" / f"{name}.h5"


def edit_json_attr(path, attr, key, value):
    with h5py.File(path, "r+") as f:
        d = json.loads(f.attrs[attr])
        d[key] = value
        f.attrs[attr] = json.dumps(d)


DAMAGE = {  # item -> (how to damage it in place, what verify and read_file name)
    "step counter": (lambda p: edit_json_attr(p, "optimizer", "global_step", 15), "optimizer.global_step"),
    "data position": (lambda p: edit_json_attr(p, "data", "global_step", 13), "data.global_step"),
    "hyper-parameter": (lambda p: edit_json_attr(p, "optimizer", "beta1", 0.8), "optimizer.beta1"),
    "layout field": (lambda p: edit_json_attr(p, "layout", "model_parallel", 2), "layout.model_parallel"),
    "append_info value": (lambda p: h5py.File(p, "r+")["append_info/step_num"].write_direct(np.array(15)),
                          "append_info/step_num"),
    "root attribute": (lambda p: h5py.File(p, "r+").attrs.__setitem__("global_step", 15), "global_step"),
    "tensor slice": (lambda p: h5py.File(p, "r+")["params/w"].attrs.__setitem__("offsets", (1, 0)), "params/w"),
}


@pytest.mark.parametrize("item", sorted(DAMAGE))
def test_damaged_metadata_is_named_by_read_and_verify(tmp_path, item, capsys):
    damage, named = DAMAGE[item]
    path = checkpoint(tmp_path)
    damage(path)
    with pytest.raises(CheckpointError, match=f"metadata checksum mismatch in .*rank_1/net-2_4.h5: .*{named}"):
        read_file(path)
    read_file(tmp_path / "rank_0" / "net-2_4.h5")  # its replica is whole
    code = dinspect.main([str(tmp_path), "--verify"])
    out = capsys.readouterr().out
    assert code == 1 and f"rank 1: metadata checksum mismatch in rank_1/net-2_4.h5: {named}" in out, out


def test_swapped_files_are_caught_by_the_commit_digest(tmp_path):
    older = checkpoint(tmp_path, "net-1_7", step=7)
    newest = checkpoint(tmp_path)
    (v,) = [verify(c) for c in scan(tmp_path).committed if c.name == "net-2_4"]
    assert v.clean and not v.notes
    newest.write_bytes(older.read_bytes())  # rank 1's file of an older checkpoint
    (tmp_path / "rank_0" / "net-2_4.h5").write_bytes(newest.read_bytes())  # ... and rank 0 holds rank 1's
    (v,) = [verify(c) for c in scan(tmp_path).committed if c.name == "net-2_4"]
    assert ("rank 1: rank_1/net-2_4.h5 is not the file committed (its content digest differs from the commit "
            "record's; it holds rank 1's shard of global step 7)") in v.problems
    assert "rank 0: rank_0/net-2_4.h5 holds rank 1's shard" in v.problems


def test_a_repaired_file_keeps_its_digest(tmp_path):
    """A file rewritten from its replica's content (what --repair does) has the digest the record names."""
    path = checkpoint(tmp_path)
    record = cm.committed(tmp_path)[-1]
    donor = read_file(tmp_path / "rank_0" / "net-2_4.h5")
    m = {**donor.meta, "rank": 1}
    del m["format"], m["format_version"]
    written = write_file(path, m, donor.tensors.values(), donor.append_info)
    assert written.digest == read_digests(tmp_path, record)[0][1] == read_file(path).digest


def test_last_gasp_commit_gets_digests_from_the_files(tmp_path):
    """write_commit without digests (the last gasp's committer) reads them from the files' attributes."""
    checkpoint(tmp_path, digests=True)
    with_digests = read_digests(tmp_path, cm.committed(tmp_path)[-1])
    (tmp_path / "net-2_4.commit").unlink()
    checkpoint(tmp_path, digests=False)
    assert read_digests(tmp_path, cm.committed(tmp_path)[-1]) == with_digests
    assert set(with_digests[0]) == {0, 1} and with_digests[1] is None


def test_format_1_files_load_and_verify_says_what_it_could_not_check(tmp_path, capsys):
    path = checkpoint(tmp_path, digests=False)
    record = json.loads((tmp_path / "net-2_4.commit").read_text())
    del record["digests"]
    (tmp_path / "net-2_4.commit").write_text(json.dumps(record))
    for rank in range(2):
        with h5py.File(tmp_path / f"rank_{rank}" / "net-2_4.h5", "r+") as f:
            del f.attrs[META_ATTR]
            f.attrs["format_version"] = 1
    shard = read_file(path)
    assert not shard.meta_checked and shard.meta["optimizer"]["global_step"] == 14
    code = dinspect.main([str(tmp_path), "--verify"])
    out = capsys.readouterr().out
    assert code == 0 and "verify net-2_4: ok" in out, out
    assert "not checked: the metadata of the file(s) of rank(s) 0, 1 (format 1: no metadata checksums)" in out
    assert "not checked: the file digests (the commit record has none: written before checkpoint format 2)" in out
    with h5py.File(path, "r+") as f:  # a format 2 file that lost its checksums is damaged, not old
        f.attrs["format_version"] = 2
    with pytest.raises(CheckpointError, match="meta_crc32 \\(the metadata checksums are missing\\)"):
        read_file(path)


def test_leftovers_never_crash_the_tools(tmp_path):
    """A *.tmp cut off by a kill mid-write, a truncated file and a foreign one: one line each, no traceback."""
    checkpoint(tmp_path)
    script = ("import os, sys, numpy as np; from dsim.checkpoint.format import write_file, Tensor; "
              "from dsim.parallel.layout import Slice; "
              "ts = [Tensor('params', f'w{i}', (64, 64), Slice((0, 0), (64, 64)), np.ones((64, 64))) for i in range(20)]; "
              "write_file(sys.argv[1], {'epoch': 3}, ts, {}, lambda: os._exit(9))")
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "rank_0" / "net-3_4.h5")], cwd=ROOT)
    assert (tmp_path / "rank_0" / "net-3_4.h5.tmp").exists()
    (tmp_path / "rank_1" / "net-3_4.h5").write_bytes((tmp_path / "rank_1" / "net-2_4.h5").read_bytes()[:3000])
    (tmp_path / "rank_1" / "notes.h5").write_text("not a checkpoint")
    for args in ([], ["--verify"], ["--verify", "--shards"], ["--json", "--verify"]):
        proc = subprocess.run([sys.executable, "-m", "dsim.inspect", str(tmp_path), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    out = proc.stdout
    assert '"clean": true' in out and "net-3_4.h5.tmp" in out and "notes.h5" in out
    for name in ("net-3_4.h5.tmp", "net-3_4.h5", "notes.h5"):
        path = next(tmp_path.glob(f"rank_*/{name}"))
        with pytest.raises(CheckpointError):
            read_file(path)


def test_disk_full_write_is_one_oserror_and_leaves_nothing(tmp_path):
    target = tmp_path / "small"
    with tmpfs(target, "256k"):
        big = [Tensor("params", f"w{i}", (128, 128), Slice((0, 0), (128, 128)), np.ones((128, 128))) for i in range(4)]
        for _ in range(3):  # again and again: HDF5 is never left broken
            with pytest.raises(OSError) as e:
                write_file(target / "rank_0" / "x-1_1.h5", meta(), big, {})
            assert e.value.errno == errno.ENOSPC and "x-1_1.h5.tmp" in str(e.value)
            assert not list(target.rglob("*.h5*"))
        write_file(target / "rank_0" / "x-1_1.h5", meta(), tensors(), {})  # a small one still fits
        assert read_file(target / "rank_0" / "x-1_1.h5").meta_checked


def test_the_tensors_space_is_reserved_before_the_first_is_written(tmp_path):
    """One fallocate for every tensor's bytes (the file system can give them a few long runs of blocks, not
    8 MiB pieces interleaved with other ranks' files); a disk without room fails before any is written."""
    big = [Tensor("params", f"w{i}", (256, 256), Slice((0, 0), (256, 256)), np.full((256, 256), i, np.float64))
           for i in range(4)]  # 512 KiB each
    reserved = []

    def first():  # after_each: called once a tensor is written
        if not reserved:
            reserved.append(os.stat(tmp_path / "rank_0" / "x-1_1.h5.tmp").st_blocks * 512)

    write_file(tmp_path / "rank_0" / "x-1_1.h5", meta(), big, {}, after_each=first)
    assert reserved[0] >= 4 * 512 * 1024, reserved  # all four, when only the first has been written
    shard = read_file(tmp_path / "rank_0" / "x-1_1.h5")
    assert all(np.array_equal(shard.tensors[f"w{i}"].data, big[i].data) for i in range(4))
    target = tmp_path / "small"
    with tmpfs(target, "1m"):
        written = []
        with pytest.raises(OSError) as e:
            write_file(target / "rank_0" / "x-1_1.h5", meta(), big, {}, after_each=lambda: written.append(1))
        assert e.value.errno == errno.ENOSPC and not written  # 2 MiB never fit in 1 MiB: known at once
        assert not list(target.rglob("*.h5*"))


def test_read_only_directory_is_one_line_before_training(tmp_path):
    src = tmp_path / "src"
    checkpoint(src)
    with readonly_view(src, tmp_path / "ro"):
        with pytest.raises(SaveError) as e:
            check_writable(tmp_path / "ro")
        assert str(e.value).startswith(f"cannot save checkpoints in {tmp_path / 'ro'}: Read-only file system (")
        assert "free of" in str(e.value) and "--resume-from" in str(e.value)
        assert read_file(tmp_path / "ro" / "rank_1" / "net-2_4.h5").meta_checked  # reading works
    check_writable(tmp_path / "new" / "dir")  # made when missing
    assert not list((tmp_path / "new" / "dir").iterdir())


def test_async_save_config():
    assert load_config(None).checkpoint.async_save is False
    assert load_config(None, ["checkpoint.async_save=true"]).checkpoint.async_save is True
    with pytest.raises(ConfigError, match="checkpoint.async_save must be bool"):
        load_config(None, ["checkpoint.async_save=sometimes"])
    assert load_config(None).checkpoint.async_staging == "memory"
    assert load_config(None, ["checkpoint.async_staging=page_cache"]).checkpoint.async_staging == "page_cache"
    with pytest.raises(ConfigError, match="^config: checkpoint: async_staging must be memory or page_cache, got 'disk'$"):
        load_config(None, ["checkpoint.async_staging=disk"])


def test_on_save_error_config():
    assert load_config(None).checkpoint.on_save_error == "stop"
    assert load_config(None, ["checkpoint.on_save_error=continue"]).checkpoint.on_save_error == "continue"
    with pytest.raises(ConfigError, match="checkpoint.on_save_error must be stop or continue, got 'ignore'"):
        load_config(None, ["checkpoint.on_save_error=ignore"])
