"""The compact commit record without MPI: progressions, file templates, the digest file, old records."""
import json

import numpy as np
import pytest

from dsim.checkpoint import commit as cm, progression, record as rec
from dsim.checkpoint.catalog import scan
from dsim.checkpoint.errors import CheckpointError
from dsim.checkpoint.format import Tensor, write_file
from dsim.checkpoint.group_info import (group_info, group_info_as, group_info_attr, group_info_list, replica_ranges,
                                        replica_sets, restore_group_info_list, write_group_info)
from dsim.checkpoint.verify import verify
from dsim.parallel.layout import ParallelLayout, Slice


def test_progressions_round_trip_in_canonical_form():
    assert progression.to_json(range(0, 8, 4)) == {"start": 0, "stop": 5, "step": 4}
    assert progression.to_json(range(3, 100, 7)) == progression.to_json(range(3, 95, 7))
    assert progression.to_json(range(6, 7, 5)) == {"start": 6, "stop": 7, "step": 1}
    assert list(progression.from_json({"start": 1, "stop": 8, "step": 2})) == [1, 3, 5, 7]
    for bad in [[0, 8, 4], {"start": 0, "stop": 8}, {"start": -1, "stop": 8, "step": 1},
                {"start": 0, "stop": 8, "step": 0}, {"start": 4, "stop": 4, "step": 1}, {"start": True, "stop": 2, "step": 1}]:
        with pytest.raises(CheckpointError, match="progression"):
            progression.from_json(bad)


def test_compress_finds_the_layout_form_else_runs():
    # dp4 x mp2 x k2, a tensor replicated over mp and sharded by the optimizer: shard 0 -> ranks 0, 1, 4, 5
    assert progression.compress([0, 1, 4, 5], period=4) == [range(0, 5, 4), range(1, 6, 4)]
    assert progression.compress(range(8), period=4) == [range(0, 8)]
    assert progression.compress(range(65536), period=4) == [range(0, 65536)]
    assert progression.compress([2, 5, 8, 9, 10]) == [range(2, 9, 3), range(9, 11)]
    assert progression.compress([7]) == [range(7, 8)]
    assert progression.members(progression.compress([0, 3, 4, 11, 12, 13], period=5)) == [0, 3, 4, 11, 12, 13]


@pytest.mark.parametrize("dp,mp,k", [(2, 4, 1), (4, 2, 2), (8, 1, 8), (16384, 4, 1)])
def test_group_info_is_one_progression_and_expands_to_the_replica_group(dp, mp, k):
    layout = ParallelLayout(dp, mp, k)
    for rank in [0, 1, layout.world_size - 1]:
        stored = group_info_attr(layout, rank)
        assert set(stored) == {"start", "stop", "step"}
        assert group_info_list(stored) == group_info(layout, rank) == layout.replica_group(rank)
        assert group_info_as([0, 4], layout, rank) == group_info(layout, rank)  # a file of the format before
        assert group_info_as(stored, layout, rank) == stored
    assert len(replica_ranges(layout)) == mp * k
    if layout.world_size <= 64:
        assert sorted(r for s in replica_sets(layout) for r in s) == list(range(layout.world_size))


def test_group_info_files_of_both_formats_read(tmp_path):
    path = write_group_info(tmp_path / "rank_{rank}" / "group_info.json", ParallelLayout(16384, 4), 5)
    data = json.loads(path.read_text())
    assert data["format"] == "dsim-group-info/2" and data["group_info"] == {"start": 1, "stop": 65534, "step": 4}
    assert len(path.read_text()) < 200
    assert restore_group_info_list(path) == list(range(1, 65536, 4))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "dsim-group-info/1", "rank": 0, "group_info": [0, 4]}))
    assert restore_group_info_list(old) == [0, 4]
    old.write_text(json.dumps({"format": "dsim-group-info/2", "rank": 0, "group_info": {"start": 0}}))
    with pytest.raises(CheckpointError, match="not a dsim group info file"):
        restore_group_info_list(old)


def test_template_of_explicit_file_maps():
    assert rec.template_of({str(r): f"rank_{r}/net-1_7.h5" for r in range(8)}) == "rank_{rank}/net-1_7.h5"
    assert rec.template_of({str(r): f"rank_{r}/ttp_rank_{r}-2_2.h5" for r in range(4)}) == \
        "rank_{rank}/ttp_rank_{rank}-2_2.h5"
    assert rec.template_of({str(r): f"rank_{r}/net-{r}_1.h5" for r in range(3)}) == "rank_{rank}/net-{rank}_1.h5"
    assert rec.template_of({"0": "net-1_10.h5"}) == "net-1_10.h5"  # an integrated save: one file
    with pytest.raises(ValueError):
        rec.template_of({"0": "a.h5", "1": "b.h5"})


def tensors(rank):
    w = np.full((2, 3), float(rank % 2))
    return [Tensor("params", "w", (4, 3), Slice((2 * (rank % 2), 0), (2, 3)), w, "axis0"),
            Tensor("params", "b", (3,), Slice((0,), (3,)), np.ones(3))]


def checkpoint(directory, name="net-1_4", step=4, world=4):
    """A dp2 x mp2 checkpoint committed from an explicit rank -> file map (as the last gasp's committer does)."""
    layout = ParallelLayout(2, 2)
    files = {}
    for rank in range(world):
        rel = f"rank_{rank}/{name}.h5"
        write_file(directory / rel, {"epoch": 1, "step_in_epoch": step, "global_step": step, "rank": rank,
                                     "world_size": world, "layout": layout.to_dict(),
                                     "group_info": group_info_attr(layout, rank)}, tensors(rank), {})
        files[str(rank)] = rel
    cm.write_commit(directory, {"name": name, "prefix": "net", "epoch": 1, "step_in_epoch": step, "global_step": step,
                                "sequence": step, "world_size": world, "layout": layout.to_dict(),
                                "integrated_save": False, "files": files,
                                "last_gasp": {"failed": [1], "writers": {"0": 0, "1": 3, "2": 2, "3": 3}}})
    return json.loads((directory / f"{name}.commit").read_text())


def test_an_explicit_file_map_is_committed_compact_with_its_digest_file(tmp_path):
    record = checkpoint(tmp_path)
    assert record["format"] == "dsim-commit/2"
    assert record["files"] == {"template": "rank_{rank}/net-1_4.h5", "ranks": [{"start": 0, "stop": 4, "step": 1}]}
    assert record["last_gasp"]["writers"] == {"1": 3}  # only the file a survivor wrote for a dead rank
    assert {(s["tensor"], tuple(s["offsets"])): s["holders"] for s in record["slices"]} == {
        ("params/w", (0, 0)): [{"start": 0, "stop": 3, "step": 2}], ("params/w", (2, 0)): [{"start": 1, "stop": 4, "step": 2}],
        ("params/b", (0,)): [{"start": 0, "stop": 4, "step": 1}]}
    digests, why = rec.read_digests(tmp_path, record)
    assert why is None and sorted(digests) == [0, 1, 2, 3]
    assert rec.file_of(record, 3) == "rank_3/net-1_4.h5" and rec.file_ranks(record) == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        rec.file_of(record, 4)
    v = verify(scan(tmp_path).committed[0])
    assert v.clean and not v.notes, v.problems


def test_a_damaged_or_missing_digest_file_is_a_problem(tmp_path):
    record = checkpoint(tmp_path)
    path = tmp_path / "net-1_4.digests"
    path.write_text(path.read_text().replace('"sizes"', '"sizes" '))
    assert "is not the one committed" in rec.read_digests(tmp_path, record)[1]
    assert any("net-1_4.digests is not the one committed" in p for p in verify(scan(tmp_path).committed[0]).problems)
    path.unlink()
    assert "net-1_4.digests cannot be read" in rec.read_digests(tmp_path, record)[1]


def test_files_holding_other_slices_than_the_record_names_are_a_problem(tmp_path):
    checkpoint(tmp_path)
    record = json.loads((tmp_path / "net-1_4.commit").read_text())
    (first,) = [s for s in record["slices"] if s["tensor"] == "params/w" and s["offsets"] == [0, 0]]
    first["holders"] = [{"start": 0, "stop": 1, "step": 1}]  # rank 2 no longer named for it
    (tmp_path / "net-1_4.commit").write_text(json.dumps(record))
    problems = verify(scan(tmp_path).committed[0]).problems
    assert "rank 2: holds other slices than its commit record names; not named: params/w at [0, 0]" in problems


@pytest.mark.parametrize("files,message", [
    ({"template": "../../victim/rank_{rank}.h5", "ranks": [{"start": 0, "stop": 4, "step": 1}]}, "contains '..'"),
    ({"template": "/abs/rank_{rank}.h5", "ranks": [{"start": 0, "stop": 4, "step": 1}]}, "is absolute"),
    ({"template": "rank_{rank}/{name}.h5", "ranks": [{"start": 0, "stop": 4, "step": 1}]}, "is not a file name"),
    ({"template": "rank_0/x.h5", "ranks": [{"start": 0, "stop": 4, "step": 1}]}, "is not a file name"),
    ({"template": "rank_{rank}/x.h5", "ranks": [{"start": 0, "stop": 9, "step": 1}]}, "beyond the world size"),
    ({"template": "rank_{rank}/x.h5", "ranks": []}, "not a non-empty list")])
def test_malformed_templates_make_the_record_ignored(tmp_path, files, message):
    checkpoint(tmp_path)
    record = json.loads((tmp_path / "net-1_4.commit").read_text())
    record["files"] = files
    (tmp_path / "net-1_4.commit").write_text(json.dumps(record))
    with pytest.warns(UserWarning, match=f"ignoring malformed commit record .*{message}"):
        assert cm.committed(tmp_path) == []


def test_old_records_read_through_the_same_accessors(tmp_path):
    checkpoint(tmp_path)
    old = {"format": "dsim-commit/1", "name": "net-1_4", "prefix": "net", "epoch": 1, "step_in_epoch": 4,
           "global_step": 4, "sequence": 4, "world_size": 4, "layout": ParallelLayout(2, 2).to_dict(),
           "integrated_save": False, "files": {str(r): f"rank_{r}/net-1_4.h5" for r in range(4)},
           "sizes": {str(r): 1 for r in range(4)},
           "digests": {str(r): d for r, d in rec.read_digests(tmp_path, checkpoint(tmp_path))[0].items()}}
    (tmp_path / "net-1_4.commit").write_text(json.dumps(old))
    (tmp_path / "net-1_4.digests").unlink()
    (record,) = cm.committed(tmp_path)
    assert rec.file_of(record, 2) == "rank_2/net-1_4.h5" and rec.file_ranks(record) == [0, 1, 2, 3]
    assert rec.read_digests(tmp_path, record)[0] == {r: old["digests"][str(r)] for r in range(4)}
    v = verify(scan(tmp_path).committed[0])
    assert v.clean and not v.notes, v.problems  # an old record has no slices: that check is skipped
    del old["digests"]
    (tmp_path / "net-1_4.commit").write_text(json.dumps(old))
    assert rec.read_digests(tmp_path, cm.committed(tmp_path)[0]) == (None, None)


def test_digest_files_are_removed_with_their_record_and_as_leftovers(tmp_path):
    checkpoint(tmp_path, "net-1_4", 4)
    checkpoint(tmp_path, "net-2_4", 8)
    (tmp_path / "net-3_4.digests").write_text("{}")  # the committer died between the digest file and the record
    with pytest.warns(UserWarning, match="removing leftover of an interrupted save"):
        removed = cm.clean_leftovers(tmp_path, 0, {r["name"] for r in cm.committed(tmp_path)})
    assert [p.name for p in removed] == ["net-3_4.digests"]
    cm.uncommit(tmp_path, "net-1_4")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["net-2_4.commit", "net-2_4.digests"]
