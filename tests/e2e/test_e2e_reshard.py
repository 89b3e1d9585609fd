"""Resharding end to end: a checkpoint saved on dp2 x mp4 (8 ranks, float64, Adam) read into other layouts and
world sizes, offline (python -m dsim.reshard) and at load (--resume on the new layout).

Layouts: dp8, dp2xmp4, dp4xmp2 with optimizer shard 2, mp8 (8 ranks), dp2xmp2 (4 ranks), dp3xmp2 (6 ranks: the
global batch of 32 split 11/11/10). The gathered parameters and Adam moments equal the source's bit for bit
(offline: the source to every layout, every layout back, and a cycle through them all; at load: dp8, dp4xmp2k2,
dp2xmp2, dp3xmp2); A -> B -> A gives back A's files' tensors byte for byte; training continued on B (dp3xmp2, mp8,
dp4xmp2k2) has losses within 1e-12 relative of the uninterrupted run on A.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, made_once, mpirun
from dsim.checkpoint import load_checkpoint
from dsim.checkpoint import commit as cm
from dsim.checkpoint.reshard import Source
from dsim.parallel.layout import Slice

pytestmark = pytest.mark.e2e
RUN = ["-m", "dsim.train", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=320",
       "--set", "optimizer.name=adam", "--set", "optimizer.learning_rate=0.002", "--set", "dtype=float64",
       "--set", "checkpoint.save_checkpoint_steps=10", "--set", "checkpoint.save_checkpoint_epochs=null",
       "--set", "output.loss_every=1", "--set", "output.dir=run"]
# name -> (ranks, dsim.train options, dsim.reshard --layout)
LAYOUTS = {"dp2xmp4": (8, [], "dp=2,mp=4,k=1"),
           "dp8": (8, ["--set", "parallel.model_parallel=1"], "dp=8,mp=1,k=1"),
           "dp4xmp2k2": (8, ["--set", "parallel.model_parallel=2", "--set", "parallel.optimizer_shard=2"],
                         "dp=4,mp=2,k=2"),
           "mp8": (8, ["--set", "parallel.model_parallel=8"], "dp=1,mp=8,k=1"),
           "dp2xmp2": (4, ["--set", "parallel.model_parallel=2"], "dp=2,mp=2,k=1"),
           "dp3xmp2": (6, ["--set", "parallel.model_parallel=2"], "dp=3,mp=2,k=1")}
NAME = "network-1_10"


def losses(job):
    lines = map(json.loads, (job / "run" / "metrics.jsonl").read_text().splitlines())
    return {e["global_step"]: e["loss"] for e in lines if e["event"] == "step"}


def gathered(directory, name=NAME) -> dict:
    """Every tensor of a committed checkpoint, whole, read through its slice table."""
    record = next(r for r in cm.committed(directory) if r["name"] == name)
    out = {}
    with Source(directory, record) as source:
        for tensor in source.boxes:
            entry = next(e for e in record["slices"] if e["tensor"] == tensor)
            shape = tuple(entry["global_shape"])
            out[tensor] = np.empty(shape, source.dtype_of(tensor))
            source.read(tensor, Slice((0,) * len(shape), shape), out[tensor])
    return out


def loaded(ranks, options, cwd) -> tuple:
    """(the job's output, every tensor whole as the ranks of `options`' layout hold it right after loading NAME)."""
    proc = mpirun(ranks, [str(ROOT / "tests" / "loaded.py"), "held", *RUN[2:], *options, "--resume", NAME], cwd=cwd,
                  check=0)
    whole = {}
    for f in sorted((cwd / "held").glob("rank_*.npz")):
        with np.load(f) as held:
            for tensor in (k for k in held.files if not k.endswith("@offsets")):
                want = whole.setdefault(tensor, {})
                want[tuple(zip(held[f"{tensor}@offsets"].tolist(), held[tensor].shape))] = held[tensor]
    return proc, whole


def same_as_loaded(whole: dict, expected: dict) -> bool:
    """Whether the slices the ranks hold are those of the expected whole tensors, bit for bit, and cover them."""
    if set(whole) != set(expected):
        return False
    for tensor, boxes in whole.items():
        covered = np.zeros(expected[tensor].shape, bool)
        for extent, arr in boxes.items():
            box = tuple(slice(o, o + n) for o, n in extent)
            if arr.tobytes() != np.ascontiguousarray(expected[tensor][box]).tobytes():
                return False
            covered[box] = True
        if not covered.all():
            return False
    return True


def tree(directory) -> dict:
    """path -> (size, mtime) of everything under a directory."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and len(a) == 27 and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The uninterrupted run on dp2 x mp4: its checkpoint after step 10, and its losses."""
    job, _ = made_once(tmp_path_factory, "reshard-source", 8, [*RUN, "--set", "train.epochs=2"], check=0)
    return job / "run" / "checkpoints", losses(job)


def reshard(src, layout, dst, *extra):
    return subprocess.run([sys.executable, "-m", "dsim.reshard", str(src), "--layout", layout, "-o", str(dst), *extra],
                          capture_output=True, text=True, timeout=120)


def test_offline_between_every_pair_and_back(source, tmp_path):
    ckpt, _ = source
    want = gathered(ckpt)
    untouched = tree(ckpt)
    for b, (_, _, layout_b) in LAYOUTS.items():
        proc = reshard(ckpt / f"{NAME}.commit", layout_b, tmp_path / b)
        assert proc.returncode == 0 and proc.stdout.startswith(f"resharded {ckpt / NAME} (dp=2 mp=4 k=1, 8 ranks)"), \
            proc.stderr
        assert same(gathered(tmp_path / b), want), b
    assert tree(ckpt) == untouched   # the source is only read
    from dsim.reshard import reshard as reshard_in_process
    from dsim.checkpoint.survivability import parse_layout
    # B -> C between the resharded copies: every B back to dp2xmp4 (for A -> B -> A below), and a cycle through
    # every layout, so each is read and written a second time by a layout other than the source's (not all 30
    # pairs: the reshard is one box intersection whatever the pair, and the subprocess above wrote every layout)
    names = list(LAYOUTS)
    pairs = [(b, "dp2xmp4") for b in names[1:]] + [(b, c) for b, c in zip(names, names[1:])]
    assert {b for b, _ in pairs} == {c for _, c in pairs} == set(LAYOUTS)
    for b, c in pairs:
        reshard_in_process(tmp_path / b, parse_layout(LAYOUTS[c][2]), tmp_path / f"{b}-{c}", log=lambda _: None)
        assert same(gathered(tmp_path / f"{b}-{c}"), want), (b, c)
    for b in LAYOUTS:   # A -> B -> A: every file's tensors as the original's, byte for byte
        if b == "dp2xmp4":
            continue
        for rank in range(8):
            x = load_checkpoint(ckpt / f"rank_{rank}" / f"{NAME}.h5")
            y = load_checkpoint(tmp_path / f"{b}-dp2xmp4" / f"rank_{rank}" / f"{NAME}.h5")
            assert x.slices == y.slices and all(x[k].tobytes() == y[k].tobytes() for k in x.slices), (b, rank)
    integrated = reshard(ckpt / f"{NAME}.commit", "dp=1,mp=1", tmp_path / "whole", "--integrated")
    assert integrated.returncode == 0, integrated.stderr
    whole = load_checkpoint(tmp_path / "whole" / f"{NAME}.h5")
    assert all(np.array_equal(whole[k.split("/", 1)[1]], v) for k, v in want.items())
    verify = mpirun(1, ["-m", "dsim.inspect", str(tmp_path / "dp3xmp2"), "--verify"], cwd=tmp_path, check=0)
    assert f"{tmp_path / 'dp3xmp2'}: clean" in verify.stdout


# dp3xmp2 is test_a_lost_file_is_read_from_another_holder_while_resharding's (the same load, one file lost too);
# mp8 is continued below, each layout written offline above
@pytest.mark.parametrize("name", ["dp8", "dp4xmp2k2", "dp2xmp2"])
def test_resume_on_another_layout_loads_the_same_state(source, tmp_path, name):
    """--resume on B: the state the ranks hold right after the load is the source's, bit for bit."""
    ckpt, _ = source
    ranks, options, _ = LAYOUTS[name]
    job = tmp_path / "job"
    (job / "run").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(ckpt), str(job / "run" / "checkpoints")], check=True)
    proc, whole = loaded(ranks, options, job)
    assert (f"dsim: resharded {NAME} from dp=2 mp=4 k=1 on 8 ranks to {LAYOUTS[name][2].replace(',', ' ')} on "
            f"{ranks} ranks") in proc.stdout, proc.stdout
    assert same_as_loaded(whole, gathered(ckpt))


@pytest.mark.parametrize("name", ["dp3xmp2", "mp8", "dp4xmp2k2"])
def test_training_continued_on_another_layout_matches(source, tmp_path, name):
    ckpt, want = source
    ranks, options, _ = LAYOUTS[name]
    (tmp_path / "run").mkdir()
    subprocess.run(["cp", "-r", str(ckpt), str(tmp_path / "run" / "checkpoints")], check=True)
    mpirun(ranks, [*RUN, *options, "--set", "train.epochs=2", "--resume", NAME], cwd=tmp_path, check=0)
    got = losses(tmp_path)
    assert sorted(got) == list(range(11, 21))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    assert worst <= 1e-12, worst


def test_bad_input_is_one_line_and_nothing_is_overwritten(source, tmp_path):
    ckpt, _ = source
    bad_layout = reshard(ckpt, "dp=1,mp=3", tmp_path / "x")
    assert bad_layout.returncode == 2 and bad_layout.stderr.splitlines() == [
        "dsim: error: the target layout cannot slice the model: layer1.param: axis 1 of shape (784, 64) (64) is not "
        "divisible by model_parallel=3"], bad_layout.stderr
    uncommitted = reshard(ckpt / "network-9_9", "dp=8", tmp_path / "x")
    assert uncommitted.returncode == 2 and uncommitted.stderr.startswith(
        f"dsim: error: no committed checkpoint named network-9_9 in {ckpt}"), uncommitted.stderr
    assert reshard(ckpt / f"{NAME}.commit", "dp=8", tmp_path / "y").returncode == 0
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "y").rglob("*")}
    again = reshard(ckpt / f"{NAME}.commit", "dp=4,mp=2", tmp_path / "y")
    assert again.returncode == 2 and again.stderr.splitlines() == [
        f"dsim: error: {tmp_path / 'y'} already holds a checkpoint named {NAME}: nothing is overwritten"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "y").rglob("*")} == before


def test_a_lost_file_is_read_from_another_holder_while_resharding(source, tmp_path):
    ckpt, _ = source
    (tmp_path / "run").mkdir()
    subprocess.run(["cp", "-r", str(ckpt), str(tmp_path / "run" / "checkpoints")], check=True)
    (tmp_path / "run" / "checkpoints" / "rank_1" / f"{NAME}.h5").unlink()
    ranks, options, _ = LAYOUTS["dp3xmp2"]
    proc, whole = loaded(ranks, options, tmp_path)
    assert (f"dsim: recovery: rank 1's file of {NAME} not used: run/checkpoints/rank_1/{NAME}.h5 is missing or not "
            "a readable HDF5 file; its slices read from other holders") in proc.stdout, proc.stdout
    assert (f"dsim: resharded {NAME} from dp=2 mp=4 k=1 on 8 ranks to dp=3 mp=2 k=1 on 6 ranks") in proc.stdout
    assert same_as_loaded(whole, gathered(ckpt))
