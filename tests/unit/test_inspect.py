"""Inspect, verify, merge and plot on checkpoints written in-process with dsim's own writer (no MPI)."""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import launch_env
from dsim import inspect as dinspect
from dsim.checkpoint import commit as cm
from dsim.checkpoint.catalog import find_checkpoint_dirs, scan
from dsim.checkpoint.coverage import coverage
from dsim.checkpoint.format import Tensor, crc32, write_file
from dsim.checkpoint.group_info import group_info
from dsim.checkpoint.merge import merge
from dsim.checkpoint.verify import verify
from dsim.parallel.layout import ParallelLayout, ParamSpec, owned_slice
from dsim.plot import read_metrics

SPECS = [ParamSpec("w1", (8, 12), mp_axis=1), ParamSpec("b1", (12,), mp_axis=0),
         ParamSpec("w2", (12, 6), mp_axis=0), ParamSpec("b2", (6,), mp_axis=None)]


def global_state(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for s in SPECS:
        out[s.name] = rng.standard_normal(s.shape)
        out[f"moment.{s.name}"] = rng.standard_normal(s.shape)
    return out


def write_checkpoint(directory, layout, name="net-1_4", step=4, state=None, file_of=None):
    """Every rank's shard of `state` under `layout`, then the commit record: what the saver writes."""
    state = global_state() if state is None else state
    files = {}
    for rank in range(layout.world_size):
        tensors = []
        for s in SPECS:
            where = owned_slice(s, layout, rank)
            for kind, key in (("params", s.name), ("optimizer", f"moment.{s.name}")):
                tensors.append(Tensor(kind, key, s.shape, where, state[key][where.index].copy(), s.split))
        rel = file_of(rank, name) if file_of else f"rank_{rank}/{name}.h5"
        meta = {"epoch": 1, "step_in_epoch": step, "global_step": step, "rank": rank,
                "world_size": layout.world_size, "layout": layout.to_dict(), "group_info": group_info(layout, rank)}
        write_file(directory / rel, meta, tensors, {})
        files[str(rank)] = rel
    prefix, _, rest = name.rpartition("-")
    cm.write_commit(directory, {"name": name, "prefix": prefix, "epoch": 1, "step_in_epoch": step, "global_step": step,
                                "sequence": step, "world_size": layout.world_size, "layout": layout.to_dict(),
                                "integrated_save": False, "files": files})
    return state


def run_inspect(capsys, *argv):
    code = dinspect.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- coverage -----------------------------------------------------------------------------------------------
def test_coverage_exact_gap_overlap_outside():
    assert coverage((4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3)), ((0, 0), (4, 3))]).exact  # a replica counts once
    gap = coverage((4, 6), [((0, 0), (4, 3)), ((0, 3), (2, 3))])
    assert (gap.gap, gap.overlap, gap.gap_at) == (6, 0, (2, 3))
    over = coverage((4, 6), [((0, 0), (4, 4)), ((0, 3), (4, 3))])
    assert (over.gap, over.overlap, over.overlap_at) == (0, 4, (0, 3))
    out = coverage((4,), [((0,), (4,)), ((2,), (4,))])
    assert out.outside == (((2,), (4,)),) and "reaches outside" in out.problems("x")[0]
    assert coverage((), [((), ())]).exact and coverage((), []).gap == 1


@pytest.mark.parametrize("dp,mp,k", [(2, 2, 1), (2, 2, 2), (4, 1, 2), (1, 4, 1)])
def test_every_layout_verifies_clean_and_merges_to_the_global_tensors(tmp_path, dp, mp, k):
    layout = ParallelLayout(dp, mp, k)
    state = write_checkpoint(tmp_path, layout)
    (ckpt,) = scan(tmp_path).committed
    v = verify(ckpt)
    assert v.clean, v.problems
    assert (v.files, v.tensors, v.checksums) == (layout.world_size, 8, 8 * layout.world_size)
    assert v.replica_sets == [layout.replica_group(r) for r in range(layout.world_size)
                              if layout.replica_group(r)[0] == r]
    merge(ckpt, tmp_path / "out" / "full.h5")
    with h5py.File(tmp_path / "out" / "full.h5", "r") as f:
        for key, value in state.items():
            kind = "params" if key in {s.name for s in SPECS} else "optimizer"
            assert f[f"{kind}/{key}"].is_virtual
            assert np.array_equal(f[f"{kind}/{key}"][()], value), key


def test_verify_finds_flipped_byte_missing_file_bad_slices_and_diverged_replica(tmp_path, capsys):
    layout = ParallelLayout(2, 2, 1)
    write_checkpoint(tmp_path, layout)
    assert run_inspect(capsys, str(tmp_path), "--verify")[0] == 0
    with h5py.File(tmp_path / "rank_1" / "net-1_4.h5", "r+") as f:   # damage: data no longer matches its CRC
        f["params/w1"][0, 0] += 1.0
    for rank in (0, 2):  # a slice moved on both replicas: a gap above it, an overlap below
        with h5py.File(tmp_path / f"rank_{rank}" / "net-1_4.h5", "r+") as f:
            f["params/w2"].attrs["offsets"] = np.array([3, 0])
    with h5py.File(tmp_path / "rank_2" / "net-1_4.h5", "r+") as f:   # a replica diverged (with a valid CRC)
        f["optimizer/moment.b2"][0] += 1.0
        f["optimizer/moment.b2"].attrs["crc32"] = crc32(f["optimizer/moment.b2"][()])
    (tmp_path / "rank_3" / "net-1_4.h5").unlink()
    code, out, err = run_inspect(capsys, str(tmp_path), "--verify")
    assert code == 1 and err == ""
    assert "rank 1: checksum mismatch in rank_1/net-1_4.h5: params/w1" in out
    assert "rank 3: file missing:" in out
    assert "params/w2: 18 of 72 elements are in no slice (gap, e.g. at (0, 0))" in out
    assert "params/w2: 18 elements are in more than one slice (overlap, e.g. at (6, 0))" in out
    assert "replica set {0,2}: ranks 0 and 2 hold different slices or data of optimizer/moment.b2" in out
    assert "rank 2: checksum" not in out
    assert "replica set {1,3}" not in out  # rank 3 is missing: nothing to compare with
    assert out.rstrip().endswith("1 of 1 committed checkpoint(s) with problems")


def test_listing_text_and_json(tmp_path, capsys):
    layout = ParallelLayout(2, 2, 1)
    write_checkpoint(tmp_path / "ck", layout, "net-1_4", 4)
    write_checkpoint(tmp_path / "ck", layout, "net-2_4", 8)
    (tmp_path / "ck" / "rank_0" / "net-3_4.h5.tmp").write_bytes(b"half")   # an interrupted save
    code, out, _ = run_inspect(capsys, str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{tmp_path / 'ck'}: 2 committed checkpoint(s), 1 never committed"
    assert lines[1].split() == ["checkpoint", "epoch", "step", "global_step", "committed", "shards", "size", "layout",
                                "world"]
    assert lines[3].split()[:6] == ["net-2_4", "1", "8", "8", "yes", "4/4"]
    assert lines[3].split()[-4:] == ["dp=2", "mp=2", "k=1", "4"]
    assert lines[4].split()[:5] == ["net-3_4", "3", "4", "?", "no"]
    assert "  replica sets (group info): {0,2} {1,3}" in lines
    assert any(line.split()[:3] == ["rank", "3", "rank_3/net-2_4.h5"] and line.endswith("group info [1, 3]")
               for line in lines)
    code, out, _ = run_inspect(capsys, str(tmp_path), "--json", "--verify")
    doc = json.loads(out)
    assert code == 0 and doc["clean"] is True
    (d,) = doc["directories"]
    assert [c["name"] for c in d["checkpoints"]] == ["net-1_4", "net-2_4", "net-3_4"]
    assert [c["committed"] for c in d["checkpoints"]] == [True, True, False]
    assert d["replica_sets"] == [[0, 2], [1, 3]]
    assert d["checkpoints"][1]["verify"]["checksums"] == 32


def test_bad_paths_and_foreign_files_are_one_line(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("hello")
    for argv, message in [([str(tmp_path / "nope")], "no such directory"),
                          ([str(tmp_path / "file.txt")], "not a directory"),
                          ([str(tmp_path)], "no checkpoint directory"),
                          (["--survivability", "--layout", "dp=2,tp=3"], "expected items like dp=2,mp=4,k=1"),
                          (["--survivability", "--layout", "dp=4,k=3"], "must divide"),
                          (["--survivability", "--layout", "dp=4", "--ranks-per-node", "0"], "must be >= 1"),
                          (["--layout", "dp=4", "--ranks-per-node", "2"], "--ranks-per-node with --survivability"),
                          (["--merge", str(tmp_path / "x-1_1"), "-o", str(tmp_path / "m.h5")], "no committed"),
                          ([], "give a checkpoint directory")]:
        code, out, err = run_inspect(capsys, *argv)
        assert code == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("dsim: error: "), (argv, err)
        assert message in err, (argv, err)
    # foreign files inside a checkpoint directory: each is one problem line, never a traceback
    ck = tmp_path / "ck"
    write_checkpoint(ck, ParallelLayout(2, 1, 1))
    (ck / "junk.commit").write_text("{not json")
    (ck / "rank_0" / "net-1_4.h5").write_text("not hdf5 at all")
    with h5py.File(ck / "rank_1" / "net-1_4.h5", "w") as f:
        f["x"] = 1
    code, out, err = run_inspect(capsys, str(ck), "--verify")
    assert code == 1 and "Traceback" not in out + err
    assert "note: ignoring unreadable commit record" in out
    assert "rank 0: cannot read" in out and "not an HDF5 file" in out
    assert "rank 1: not a dsim checkpoint" in out


def test_merge_refuses_to_overwrite_and_resolves_names(tmp_path, capsys):
    write_checkpoint(tmp_path, ParallelLayout(2, 2, 1))
    out = tmp_path / "full.h5"
    out.write_text("precious")
    code, _, err = run_inspect(capsys, "--merge", str(tmp_path / "net-1_4"), "-o", str(out))
    assert code == 2 and "exists" in err and out.read_text() == "precious"
    for spec in [tmp_path / "net-1_4", tmp_path / "net-1_4.commit", tmp_path / "rank_2" / "net-1_4.h5", tmp_path]:
        target = tmp_path / f"m{len(list(tmp_path.glob('m*.h5')))}.h5"
        code, text, err = run_inspect(capsys, "--merge", str(spec), "-o", str(target))
        assert code == 0 and text.startswith("merged net-1_4 (8 tensors, global step 4)"), (spec, err)


def test_merge_bridges_a_lost_shard_with_its_replica(tmp_path):
    layout = ParallelLayout(2, 2, 1)
    state = write_checkpoint(tmp_path, layout)
    (tmp_path / "rank_0" / "net-1_4.h5").unlink()
    (ckpt,) = scan(tmp_path).committed
    merge(ckpt, tmp_path / "full.h5")
    with h5py.File(tmp_path / "full.h5", "r") as f:
        assert np.array_equal(f["params/w1"][()], state["w1"])
        assert list(f["params/w1"].attrs["source_ranks"]) == [1, 2]


def test_discovers_ttp_style_directories(tmp_path, capsys):
    """Any directory with commit records and rank_*/ shards is found, e.g. the last-gasp layout."""
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints", ParallelLayout(2, 1, 1))
    ttp = run / "ttp_checkpoints" / "tft_saved_checkpoints-step_7"
    write_checkpoint(ttp, ParallelLayout(2, 1, 1), "ttp-2_3", 7, file_of=lambda r, n: f"rank_{r}/ttp_rank_{r}-2_3.ckpt")
    assert find_checkpoint_dirs(run) == [run / "checkpoints", ttp]
    code, out, _ = run_inspect(capsys, str(run), "--verify")
    assert code == 0
    assert f"{ttp}: 1 committed checkpoint(s)" in out and "rank_1/ttp_rank_1-2_3.ckpt" in out
    assert out.count(": clean") == 2


def test_survivability_cli(tmp_path, capsys):
    code, out, _ = run_inspect(capsys, "--survivability", "--layout", "dp=2,mp=4,k=1")
    assert code == 0
    assert "    any two ranks except {0,4}, {1,5}, {2,6}, {3,7} (24 of 28 survive)" in out.splitlines()
    assert "largest failure count always survivable: 1 (at best 4" in out
    write_checkpoint(tmp_path, ParallelLayout(4, 1, 2))
    code, out, _ = run_inspect(capsys, "--survivability", str(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["fatal_sets"] == [[0, 2], [1, 3]] and doc["always_survivable"] == 1
    # a lost node: every rank on it fails at once; a pipeline stage per node leaves no copy of its slices
    code, out, _ = run_inspect(capsys, "--survivability", "--layout", "pp=2,dp=2,mp=2", "--ranks-per-node", "4")
    assert code == 0 and out.splitlines()[-3:] == [
        "  a lost node (4 consecutive ranks, every one failing at once):",
        "    node 0 (ranks 0-3): fatal (every rank of {0,2}, {1,3} is on it)",
        "    node 1 (ranks 4-7): fatal (every rank of {4,6}, {5,7} is on it)"]
    code, out, _ = run_inspect(capsys, "--survivability", str(tmp_path), "--ranks-per-node", "2", "--json")
    assert json.loads(out)["nodes"] == [{"node": [0, 1], "fatal_sets": []}, {"node": [2, 3], "fatal_sets": []}]


# -- plot ---------------------------------------------------------------------------------------------------
def test_metrics_segments_and_events(tmp_path):
    lines = [{"event": "train_begin", "global_step": 0}] + [
        {"event": "step", "global_step": s, "loss": 3.0 - s / 10} for s in range(1, 7)] + [
        {"event": "fault", "rank": 3, "global_step": 6}, {"event": "resume", "global_step": 4},
        {"event": "train_begin", "global_step": 4}] + [
        {"event": "step", "global_step": s, "loss": 2.0 - s / 10} for s in range(5, 9)] + [
        {"event": "uce_repair", "rank": 5, "global_step": 7}, {"event": "eval", "global_step": 8, "accuracy": 0.25},
        {"event": "train_end", "global_step": 8}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    m = read_metrics(path)
    assert [len(s.steps) for s in m.segments] == [6, 4] and m.skipped == 1
    assert [(e["event"], e["global_step"]) for e in m.events] == [("fault", 6), ("resume", 4), ("uce_repair", 7)]
    assert m.accuracy == [(8, 0.25)]
    p = subprocess.run([sys.executable, "-m", "dsim.plot", str(tmp_path), "-o", str(tmp_path / "loss.png")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "10 steps, 1 evaluation(s)" in p.stdout and (tmp_path / "loss.png").stat().st_size


def test_plot_without_matplotlib_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "step", "global_step": 1, "loss": 1.0}) + "\n")
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    p = subprocess.run([sys.executable, "-m", "dsim.plot", str(tmp_path), "-o", str(tmp_path / "x.png")],
                       env={**launch_env(), "PYTHONPATH": str(fake)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "dsim: error: plotting needs matplotlib: pip install dsim[plot] (or pip install matplotlib)\n"
    assert not (tmp_path / "x.png").exists()
    bad = subprocess.run([sys.executable, "-m", "dsim.plot", str(tmp_path / "nope")], env=launch_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr == f"dsim: error: no such run directory or file: {tmp_path / 'nope'}\n"
