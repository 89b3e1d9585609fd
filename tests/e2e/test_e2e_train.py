"""`mpirun -n 8 python -m dsim.train` as a user runs it: output, metrics, determinism, bad input."""
import json
import re

import numpy as np
import pytest

from conftest import dsim_cli, mpirun
from dsim.data import write_idx

pytestmark = pytest.mark.e2e
SMALL = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=960", "--set", "output.loss_every=1",
         "--set", "optimizer.learning_rate=0.05"]
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\d+\.\d{6})$", re.M)


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if json.loads(line)["event"] == "step"]


def test_train_prints_mindspore_loss_lines_and_loss_falls(tmp_path):
    proc = mpirun(8, ["-m", "dsim.train", *SMALL, "--set", "output.dir=run"], cwd=tmp_path, check=0)
    found = LOSS_LINE.findall(proc.stdout)
    assert len(found) == 60, proc.stdout  # 2 epochs x 960/32 steps, rank 0 only
    assert found[0][:2] == ("1", "1") and found[-1][:2] == ("2", "30")
    values = [float(v) for _, _, v in found]
    assert np.mean(values[-10:]) < 0.85 * np.mean(values[:5])  # 2.31 -> 1.73 here
    assert "data_parallel=2 model_parallel=4" in proc.stdout
    assert proc.stdout.count("Train epoch time:") == 2
    assert losses(tmp_path / "run") == pytest.approx(values, abs=1e-6)


def test_two_runs_are_bit_identical(ft_reference, tmp_path):
    """The same job twice: the fault-tolerance tests' uninterrupted run on dp2 x mp4 with optimizer shard 2 (Adam,
    made once for the session), and the same command again here. Every loss (exact floats from metrics.jsonl) and
    every rank's final parameters and Adam moments are the same, bit for bit."""
    from ftjob import LAYOUTS, OPTS, final_state_equal
    _, ckpt = ft_reference("dp2xmp4k2")
    mpirun(8, ["-m", "dsim.train", *OPTS, *LAYOUTS["dp2xmp4k2"]], cwd=tmp_path, check=0)
    a, b = losses(ckpt.parent), losses(tmp_path / "run")
    assert len(a) == 20 and a == b  # exact floats from JSON
    final_state_equal(ckpt, tmp_path / "run" / "checkpoints", name="network-2_10")


def test_default_config_runs_as_typed(tmp_path):
    # the full-size Network on dp2 x mp4, cut to 1 step to stay quick
    proc = mpirun(8, ["-m", "dsim.train", "--set", "train.steps_per_epoch=1", "--set", "train.epochs=1"],
                  cwd=tmp_path, check=0, timeout=300)
    assert "network 784-512-5120-5120-512-10 float32" in proc.stdout
    assert (tmp_path / "runs" / "default" / "metrics.jsonl").is_file()


def test_real_mnist_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    train = tmp_path / "MNIST_Data" / "train"
    train.mkdir(parents=True)
    write_idx(train / "train-images-idx3-ubyte", rng.integers(0, 256, (128, 28, 28), dtype=np.uint8))
    write_idx(train / "train-labels-idx1-ubyte", rng.integers(0, 10, 128, dtype=np.uint8))
    proc = mpirun(4, ["-m", "dsim.train", *SMALL, "--set", "parallel.model_parallel=2", "--set", "data.name=mnist",
                      "--set", "data.path=MNIST_Data/train", "--set", "train.epochs=1"], cwd=tmp_path, check=0)
    assert len(LOSS_LINE.findall(proc.stdout)) == 4  # 128 // 32


# ranks: 8 = under mpirun -n 8; None = the same command in one process (config errors, refused by every rank
# alike before MPI is used; the config family keeps the unknown key under mpirun)
@pytest.mark.parametrize("args,msg,ranks", [
    (["--set", "parallel.bogus=1"], "config: unknown key 'parallel.bogus'", 8),
    (["--set", "train.epochs=many"], "config: train.epochs must be int, got str 'many'", None),
    (["--set", "parallel.data_parallel=2", "--set", "parallel.model_parallel=2"],
     "layout data_parallel=2 x model_parallel=2 = 4 ranks does not fit the world size 8", 8),
    (["--set", "data.name=mnist", "--set", "data.path=MNIST_Data/train"], "config: data.path not found: MNIST_Data/train",
     None),
    (["--set", "model.hidden=[62,64]"], "is not divisible by model_parallel=4", 8),
    (["--config", "missing.yaml"], "config: file not found: missing.yaml", None),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, msg, ranks):
    proc = dsim_cli(ranks, ["-m", "dsim.train", *args], cwd=tmp_path, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and msg in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("ft", [False, True])
def test_an_exception_on_one_rank_ends_the_job_instead_of_hanging(tmp_path, ft):
    """Rank 3 alone raises at step 5: the others must not wait for it forever, with or without ULFM."""
    proc = mpirun(8, ["-m", "dsim.train", *SMALL, "--set", "fault.kind=exception", "--set", "fault.rank=3",
                      "--set", "fault.step=5", "--set", "output.dir=run"], cwd=tmp_path, timeout=90, ft=ft)
    assert proc.returncode != 0
    assert "dsim: error: rank 3: Some errors happen. (injected on rank 3 at step 5)" in proc.stderr, proc.stderr


@pytest.mark.parametrize("layout", ["dp2xmp4", "dp4xmp2k2"])
def test_sums_through_shared_memory_change_no_bit(ft_reference, tmp_path, layout):
    """On one node the mp group sums through shared memory (dsim.parallel.shared); DSIM_SHARED_MEMORY=0 sends
    every sum through MPI. Same loss lines, same final parameters and Adam moments, bit for bit (the shared
    run: the fault-tolerance tests' reference, which runs with the default)."""
    from ftjob import LAYOUTS, LOSS, OPTS, final_state_equal
    losses, ckpt, out = ft_reference(layout, output=True)
    mpi = mpirun(8, ["-m", "dsim.train", *OPTS, *LAYOUTS[layout]], cwd=tmp_path, check=0,
                 env={"DSIM_SHARED_MEMORY": "0"})
    assert "; sums in shared memory: mp" in out
    assert "shared memory" not in mpi.stdout
    assert len(losses) == 20 and losses == LOSS.findall(mpi.stdout)
    final_state_equal(tmp_path / "run" / "checkpoints", ckpt, name="network-2_10")
