"""The seed pages' scripts in examples/, run as their docstrings say (mpirun, or their launch scripts), shortened by
their arguments: each does what its page shows."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, launch_env, mpirun, run_command
from dsim.checkpoint import load_checkpoint
from ftjob import LOSS, redone_once

pytestmark = pytest.mark.e2e
EXAMPLES = ROOT / "examples"


def same_state(a_dir, a_name, b_dir, b_name, ranks=8):
    """Every rank's saved parameters and optimizer state, bit for bit; returns how many tensors were compared."""
    count = 0
    for rank in range(ranks):
        a = load_checkpoint(Path(a_dir) / f"rank_{rank}" / f"{a_name}.h5")
        b = load_checkpoint(Path(b_dir) / f"rank_{rank}" / f"{b_name}.h5")
        assert set(a.slices) == set(b.slices)
        for key in a.slices:
            assert np.array_equal(a[key], b[key]), (rank, key)
            count += 1
    return count


def test_fault_recover_example(lenet_reference, tmp_path):
    """The fault-recovery page: 'Some errors happen.' at the end of epoch 6 with epochs 2-6 kept, the saved state
    intact; the find-latest script and the resume write lenet_1-7 ... lenet_1-10, ending where the CLI's
    uninterrupted run of configs/lenet5.yaml ends, bit for bit (epochs cut to 2 steps: conftest's lenet_reference,
    the CLI's run that test_e2e_models' fault-recovery test compares with too)."""
    script = str(EXAMPLES / "fault_recover" / "fault_recover.py")
    failed = mpirun(8, [script, "--steps", "2"], cwd=tmp_path)
    assert failed.returncode != 0
    # every rank raises; Open MPI ends the job when the first of them has exited, so some may not get to say it
    said = re.findall(r"^dsim: error: rank (\d): Some errors happen\. \(traceback in logs/rank_\1\.err\)$", failed.stderr, re.M)
    assert said, failed.stderr
    assert "Exception: Some errors happen." in (tmp_path / "logs" / f"rank_{said[0]}.err").read_text()
    lenet = tmp_path / "lenet"
    names = [f"lenet-{e}_2" for e in range(2, 7)]
    assert sorted(p.name for p in lenet.iterdir()) == sorted(
        [f"{n}.commit" for n in names] + [f"{n}.digests" for n in names] + ["lenet-graph.meta", ".dsim-lease"]
        + [f"rank_{r}" for r in range(8)])
    assert sorted(p.name for p in (lenet / "rank_0").iterdir()) == ["group_info.json"] + [f"{n}.h5" for n in names]
    verify = run_command([sys.executable, "-m", "dsim.inspect", str(lenet), "--verify"], tmp_path, 60, None)
    assert verify.returncode == 0 and "clean" in verify.stdout, verify.stdout + verify.stderr

    resumed = mpirun(8, [script, "--steps", "2", "--recover", "1"], cwd=tmp_path, check=0)
    assert "resuming from ./lenet/rank_0/lenet-6_2.h5: epoch_num 6, step_num 12, lr 0.01, momentum 0.9" in resumed.stdout
    assert [(int(e), int(s)) for e, s, _ in LOSS.findall(resumed.stdout)] == [(e, 2) for e in range(7, 11)]
    assert {f"lenet_1-{e}_2.commit" for e in range(7, 11)} | {"lenet_1-graph.meta"} <= {p.name for p in lenet.iterdir()}

    # the CLI's uninterrupted run of configs/lenet5.yaml (its data: the same MNIST-shaped digits, unshuffled)
    ref_losses, ref_ckpt = lenet_reference
    assert LOSS.findall(resumed.stdout) == [x for x in ref_losses if int(x[0]) >= 7 and x[1] == "2"]
    assert same_state(ref_ckpt, "lenet-10_2", lenet, "lenet_1-10_2") >= 8 * 10  # params, momenta


SMALL_TRANSFORMER = ["--epochs", "2", "--num_samples", "64", "--vocab_size", "64", "--d_model", "32",
                     "--ffn_hidden_size", "64", "--callback_size", "2"]


def test_distributed_examples(tmp_path):
    """The distributed page: the sliced save (group info [0, 4]); rank 0's shard lost, the recover script loads
    rank 4's and goes on to the same state as the uninterrupted run."""
    here = "examples/distributed_fault_recover"
    saved = run_command(["bash", str(ROOT / here / "run_parallel_save_ckpt.sh"), *SMALL_TRANSFORMER], tmp_path, 240, 0,
                        {"VIRTUAL_ENV": sys.prefix})
    assert "group info of rank 0: [0, 4]" in saved.stdout
    assert (tmp_path / "ckpt_dir0" / "group_info.json").is_file()  # GROUP_INFO_FILE, as the page's group_info.pb
    ckpt = tmp_path / "ckpt"
    (ckpt / "rank_0" / "test-1_2.h5").unlink()
    recovered = run_command(["bash", str(ROOT / here / "run_parallel_recover_ckpt.sh"), *SMALL_TRANSFORMER,
                             "--ckpt_file", "ckpt/rank_{rank}/test-1_2.h5"], tmp_path, 240, 0,
                            {"VIRTUAL_ENV": sys.prefix})
    assert "rank 0: ckpt/rank_0/test-1_2.h5 is lost; loading rank 4's (group info [0, 4])" in recovered.stdout
    assert LOSS.findall(recovered.stdout) == LOSS.findall(saved.stdout)[1:] != []  # epoch 2 again, the same loss
    assert same_state(ckpt, "test-2_2", ckpt, "test_1-2_2") > 100


def start(cmd, cwd, log, env=None):
    """Launch cmd in its own process group with stdout and stderr to the file log (so the test can watch it)."""
    out = open(log, "w")
    return subprocess.Popen(cmd, cwd=cwd, env={**launch_env(), **(env or {})}, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(log, text, proc, timeout=120):
    start_time = time.time()
    while text not in Path(log).read_text():
        assert proc.poll() is None, f"ended before {text!r}:\n{Path(log).read_text()[-3000:]}"
        assert time.time() - start_time < timeout, f"no {text!r} after {timeout} s"
        time.sleep(0.05)


def pid_of_rank(script: str, rank: int) -> int:
    """The process of a training rank, found as a user would (ps): its command line and Open MPI's rank variable."""
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and script in (p / "cmdline").read_bytes().decode(errors="replace") and \
                    f"OMPI_COMM_WORLD_RANK={rank}".encode() in (p / "environ").read_bytes().split(b"\0"):
                return int(p.name)
        except OSError:
            continue
    raise AssertionError(f"no process of rank {rank} running {script}")


def finish(proc, log, timeout=180):
    """Wait for a launched job (its script stops a launcher stall) with a timeout; returns (status, output)."""
    from dsim.ft.launcher import supervise
    how = supervise(proc, timeout, stalls=False)
    proc.wait()
    assert how != "timeout", f"timed out (the ranks' stacks last):\n{Path(log).read_text()[-30000:]}"
    return proc.returncode, Path(log).read_text()


def test_last_gasp_example(tmp_path):
    """The last-gasp page: kill -9 of a training process after step 5; the survivors save every rank's file under
    ttp_checkpoints/tft_saved_checkpoints-step_{n}/rank_{r}/ttp_rank_{r}-1_{n}.h5; --is_recover=1 goes on at n + 1."""
    options = ["--hidden", "64", "128", "128", "64", "--epochs", "2", "--steps", "30"]
    log = tmp_path / "run.log"
    proc = start(["bash", str(EXAMPLES / "last_gasp" / "msrun.sh"), *options], tmp_path, log, {"VIRTUAL_ENV": sys.prefix})
    try:
        wait_for(log, "epoch: 1 step: 5,", proc)
        os.kill(pid_of_rank("mindio_ttp_case.py", 3), signal.SIGKILL)
    finally:
        code, out = finish(proc, log)
    saved = re.search(r"rank\(s\) 3 failed; last-gasp checkpoint ttp-1_(\d+) \(global step (\d+)\) committed in "
                      r"ttp_checkpoints/tft_saved_checkpoints-step_(\d+) by 7 survivors", out)
    assert code != 0 and saved, out[-3000:]
    n = int(saved.group(1))
    assert n >= 5 and saved.group(2) == saved.group(3) == str(n)
    directory = tmp_path / "ttp_checkpoints" / f"tft_saved_checkpoints-step_{n}"
    assert all((directory / f"rank_{r}" / f"ttp_rank_{r}-1_{n}.h5").is_file() for r in range(8))

    resumed = run_command(["bash", str(EXAMPLES / "last_gasp" / "msrun-resume.sh"), *options], tmp_path, 180, 0,
                          {"VIRTUAL_ENV": sys.prefix})
    assert (f"resuming from ./ttp_checkpoints/tft_saved_checkpoints-step_{n}/rank_0/ttp_rank_0-1_{n}.h5 "
            f"(global step {n})") in resumed.stdout
    steps = [(int(e), int(s)) for e, s, _ in LOSS.findall(resumed.stdout)]
    assert steps[0] == (1, n + 1) and steps[-1] == (2, 30) and len(steps) == 60 - n


def test_uce_example(tmp_path):
    """The UCE page: rank 3's memory fails after step 6; it is repaired from rank 7 in the job, and every loss of
    the run is the one of a run without the fault."""
    options = ["--epochs", "1", "--steps", "10"]
    script = ["bash", str(EXAMPLES / "uce" / "msrun.sh")]
    env = {"VIRTUAL_ENV": sys.prefix}
    hit = run_command([*script, *options, "--uce_rank", "3", "--uce_step", "6"], tmp_path, 180, 0, env)
    # after step 6, or after step 5 when rank 7 (whose all-reduce with rank 3 finished there first) was still
    # in its side of step 6's all-reduce as rank 3 revoked the world: step 6 is then redone (its loss line twice
    # when rank 0 had printed it before the repair)
    repaired = re.search(r"^dsim: uce: rank\(s\) 3 had an uncorrectable memory error \(UCE\); repaired in the job: "
                         r"rank 3 from rank 7 \(group info \[3, 7\]\); training goes on after step ([56]) ",
                         hit.stdout, re.M)
    assert repaired, hit.stdout + hit.stderr
    clean = run_command([*script, *options], tmp_path, 180, 0, env)
    losses, want = LOSS.findall(hit.stdout), LOSS.findall(clean.stdout)
    assert len(want) == 10
    assert (redone_once(losses) if repaired.group(1) == "5" else losses) == want, hit.stdout
