"""A checkpoint from elsewhere never makes dsim read or write outside its directory (issue 22, item 5).

Crafted checkpoints of a 2-rank dp2 job (each rank the other's replica): a commit record whose file template
is `../../victim/rank_{rank}.h5` or absolute, a rank file symlinked to a file outside, a rank directory symlinked
to a directory outside. Under `--resume auto --repair` and `dsim.inspect --verify`, nothing outside the
checkpoint directory changes (a digest of the surrounding tree before and after), and the record is named
in one line.
"""
import hashlib
import json
import os
import shutil
import sys

import pytest

from conftest import made_once, mpirun, run_command

pytestmark = pytest.mark.e2e
RUN = ["-m", "dsim.train", "--set", "model.hidden=[16,16]", "--set", "data.num_samples=64",
       "--set", "data.batch_size=16", "--set", "train.epochs=2", "--set", "parallel.model_parallel=1",
       "--set", "parallel.data_parallel=2", "--set", "output.progress_bar=false", "--set", "output.dir=run"]
NEWEST, OLDER = "network-2_4", "network-1_4"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d, _ = made_once(tmp_path_factory, "paths-job", 2, RUN, check=0, timeout=120)
    ckpt = d / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("*.commit")) == [f"{OLDER}.commit", f"{NEWEST}.commit"]
    return d


def digest(root, skip):
    """name -> content digest (or link target) of every entry under root, symlinks never followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [n for n in dirnames if os.path.join(dirpath, n) != str(skip)]
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                out[p] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def crafted(job, tmp_path, kind):
    """A copy of the job whose newest checkpoint points outside; victim/ beside the run holds a real shard."""
    d = tmp_path / "job"
    shutil.copytree(job, d)
    ckpt = d / "run" / "checkpoints"
    victim = d / "victim"
    victim.mkdir()
    shutil.copy(ckpt / "rank_1" / f"{NEWEST}.h5", victim / "target.h5")
    commit = ckpt / f"{NEWEST}.commit"
    record = json.loads(commit.read_text())
    if kind in ("dotdot", "absolute"):
        shutil.copy(victim / "target.h5", victim / "rank_1.h5")  # what the crafted template names for rank 1
        record["files"]["template"] = "../../victim/rank_{rank}.h5" if kind == "dotdot" else \
            str(victim / "rank_{rank}.h5")
        commit.write_text(json.dumps(record))
        (ckpt / "rank_1" / f"{NEWEST}.h5").write_bytes(b"damaged")  # the in-directory file: damaged
    elif kind == "file_link":
        (ckpt / "rank_1" / f"{NEWEST}.h5").unlink()
        (ckpt / "rank_1" / f"{NEWEST}.h5").symlink_to(victim / "target.h5")
    elif kind == "dir_link":
        shutil.copytree(ckpt / "rank_1", victim / "rank_1")
        shutil.rmtree(ckpt / "rank_1")
        (ckpt / "rank_1").symlink_to(victim / "rank_1", target_is_directory=True)
    return d, ckpt


def newest_files(ckpt):
    return {p: v for p, v in digest(ckpt, None).items() if NEWEST in p}


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "file_link"])
def test_resume_repair_falls_back_and_writes_nothing_outside(job, tmp_path, kind):
    d, ckpt = crafted(job, tmp_path, kind)
    before, kept = digest(d, ckpt), newest_files(ckpt)
    proc = mpirun(2, [*RUN, "--resume", "auto", "--repair"], cwd=d, timeout=120)
    after = digest(d, ckpt)
    assert newest_files(ckpt) == kept  # the malformed record's files are kept as they were, not "cleaned"
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    malformed = [line for line in proc.stderr.splitlines() if "malformed commit record" in line]
    assert malformed and all(line.startswith("dsim: warning: ignoring malformed commit record") for line in malformed)
    assert f"{NEWEST}.commit" in malformed[0]
    assert proc.returncode == 0, out
    assert f"resumed from run/checkpoints/rank_0/{OLDER}.h5" in proc.stdout
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    assert {os.path.relpath(p, d) for p in changed} <= {"run/metrics.jsonl"}, changed  # the run's own log


def test_symlinked_rank_dir_is_a_clear_error(job, tmp_path):
    d, ckpt = crafted(job, tmp_path, "dir_link")
    before = digest(d, ckpt)
    proc = mpirun(2, [*RUN, "--resume", "auto", "--repair"], cwd=d, timeout=120)
    assert digest(d, ckpt) == before
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]
    assert errors == ["dsim: error: config: checkpoint.directory 'run/checkpoints': rank_1 is a symlink "
                      f"(to {d / 'victim' / 'rank_1'}); dsim never writes through one"], proc.stderr


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "file_link", "dir_link"])
def test_inspect_verify_names_the_record_and_reads_nothing_outside(job, tmp_path, kind):
    d, ckpt = crafted(job, tmp_path, kind)
    before = digest(d, ckpt)
    proc = run_command([sys.executable, "-m", "dsim.inspect", str(ckpt), "--verify"], d, 60, None)
    assert digest(d, ckpt) == before
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "malformed commit record" in proc.stdout + proc.stderr


def test_a_damaged_link_inside_is_renamed_not_its_target(job, tmp_path):
    """rank 1's file is a symlink to rank 0's (inside the directory, so the record is well formed): it holds
    the wrong rank's shard, so --repair keeps the link as .damaged and writes a file; rank 0's is untouched."""
    d = tmp_path / "job"
    shutil.copytree(job, d)
    ckpt = d / "run" / "checkpoints"
    link = ckpt / "rank_1" / f"{NEWEST}.h5"
    link.unlink()
    link.symlink_to(f"../rank_0/{NEWEST}.h5")
    target = digest(ckpt / "rank_0", None)
    proc = mpirun(2, [*RUN, "--resume", "auto", "--repair", "--set", "train.epochs=2"], cwd=d, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert f"resumed from run/checkpoints/rank_0/{NEWEST}.h5" in proc.stdout
    kept = ckpt / "rank_1" / f"{NEWEST}.h5.damaged"
    assert kept.is_symlink() and os.readlink(kept) == f"../rank_0/{NEWEST}.h5"
    assert link.is_file() and not link.is_symlink()
    assert {k: v for k, v in digest(ckpt / "rank_0", None).items() if NEWEST in k} == \
        {k: v for k, v in target.items() if NEWEST in k}
