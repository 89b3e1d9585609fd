"""The seed pages' own models end to end under mpirun -n 8, as a user runs them from configs/.

- LeNet5, the fault-recovery page: a fault at the end of epoch 6, the page's checkpoint listing, resume
  with a new prefix for epochs 7-10, bit-identical to an uninterrupted run (epochs cut to 2 steps).
- The Transformer, the distributed page (dp2 x mp4, AdamWeightDecay, small sizes): kill a rank, delete a
  shard, resume from its replica; a LayerNorm damaged on a rank and on its replica taken from another
  holder; the last gasp and a UCE repaired in the job. Each ends bit-identical to an uninterrupted run.
- The Transformer with the sample's pipeline (2 stages): UCEs in both stages repaired in place, bit-identical.
"""
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import dsim_cli, flip_byte, made_once, ROOT, mpirun
from dsim.checkpoint import load_checkpoint
from ftjob import events, LOSS

pytestmark = pytest.mark.e2e
LENET = ["-m", "dsim.train", "--config", str(ROOT / "configs" / "lenet5.yaml"), "--set", "data.num_samples=640",
         "--set", "train.steps_per_epoch=2", "--set", "output.loss_every=1", "--set", "output.dir=run"]
TRANSFORMER = ["-m", "dsim.train", "--config", str(ROOT / "configs" / "transformer.yaml"),
               "--set", "model.transformer={vocab_size: 256, d_model: 32, num_heads: 8}",
               "--set", "data.num_samples=160", "--set", "checkpoint.save_checkpoint_steps=7",
               "--set", "output.dir=run"]  # 4 epochs of 5 steps, saves at steps 7 and 14 and the end


def same_state(ref_dir, ref_name, dir_, name):
    """Every rank's parameters and optimizer state of two checkpoints, bit for bit."""
    for rank in range(8):
        a = load_checkpoint(ref_dir / f"rank_{rank}" / f"{ref_name}.h5")
        b = load_checkpoint(dir_ / f"rank_{rank}" / f"{name}.h5")
        assert a.slices and set(a.slices) == set(b.slices), rank
        for key in a.slices:
            assert np.array_equal(a[key], b[key]), (rank, key)


def test_lenet5_fault_recovery_page(lenet_reference, tmp_path):
    ref_losses, ref_ckpt = lenet_reference  # (conftest's: the uninterrupted run of LENET, shared with test_e2e_examples)
    job = tmp_path / "job"
    job.mkdir()
    crash = mpirun(8, [*LENET, "--set", "fault.kind=exception"], cwd=job)
    assert crash.returncode != 0 and "Some errors happen." in crash.stderr
    ckpt = job / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.is_file()) == sorted(
        [f"lenet-{e}_2.{x}" for e in range(2, 7) for x in ("commit", "digests")] + ["lenet-graph.meta", ".dsim-lease"])
    assert sorted(p.name for p in (ckpt / "rank_0").glob("*.h5")) == [f"lenet-{e}_2.h5" for e in range(2, 7)]
    p = load_checkpoint(ckpt / "rank_0" / "lenet-6_2.h5")
    assert (int(p["epoch_num"]), int(p["step_num"]), float(p["lr"]), float(p["momentum"])) == (6, 12, 0.01, 0.9)
    resumed = mpirun(8, [*LENET, "--resume", "auto"], cwd=job, check=0)
    assert "resumed from run/checkpoints/rank_0/lenet-6_2.h5 (global step 12: epoch 7 step 0)" in resumed.stdout
    assert sorted(p.name for p in ckpt.glob("lenet_1*")) == sorted(
        [f"lenet_1-{e}_2.{x}" for e in range(7, 11) for x in ("commit", "digests")] + ["lenet_1-graph.meta"])
    assert len(ref_losses) == 20 and LOSS.findall(resumed.stdout) == ref_losses[12:]
    same_state(ref_ckpt, "lenet-10_2", ckpt, "lenet_1-10_2")


@pytest.fixture(scope="module")
def transformer_reference(tmp_path_factory):
    d, proc = made_once(tmp_path_factory, "transformer-ref", 8, TRANSFORMER, check=0)
    losses = LOSS.findall(proc.stdout)
    assert len(losses) == 20 and "transformer encoder 1 x decoder 1, d_model 32, 8 heads" in proc.stdout
    return losses, d / "run" / "checkpoints"


@pytest.fixture(scope="module")
def transformer_killed(tmp_path_factory):
    """Rank 3 SIGKILLed after step 17: the newest committed checkpoint is test-3_4 (global step 14)."""
    d, proc = made_once(tmp_path_factory, "transformer-killed", 8,
                        [*TRANSFORMER, "--set", "fault.kind=kill", "--set", "fault.rank=3", "--set", "fault.step=17"],
                        timeout=120)
    assert proc.returncode != 0 and "killing rank 3 (SIGKILL) at step 17" in proc.stdout
    assert sorted(p.name for p in (d / "run" / "checkpoints").glob("*.commit")) == ["test-2_2.commit",
                                                                                    "test-3_4.commit"]
    return d


def test_transformer_lost_shard_is_taken_from_its_replica(transformer_reference, transformer_killed, tmp_path):
    ref_losses, ref_ckpt = transformer_reference
    job = tmp_path / "job"
    shutil.copytree(transformer_killed, job)
    (job / "run" / "checkpoints" / "rank_0" / "test-3_4.h5").unlink()
    proc = mpirun(8, [*TRANSFORMER, "--resume", "auto"], cwd=job, check=0)
    assert ("dsim: recovery: rank 0: checkpoint file not found: run/checkpoints/rank_0/test-3_4.h5; "
            "using the replica on rank 4 (group info [0, 4])") in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[14:]
    same_state(ref_ckpt, "test-4_5", job / "run" / "checkpoints", "test_1-4_5")


def test_transformer_layernorm_damaged_on_a_rank_and_its_replica(transformer_reference, transformer_killed,
                                                                  tmp_path):
    """Rank 0 and its only replica, rank 4, both have a damaged LayerNorm gamma: it is held by every rank."""
    ref_losses, ref_ckpt = transformer_reference
    job = tmp_path / "job"
    shutil.copytree(transformer_killed, job)
    ckpt = job / "run" / "checkpoints"
    gamma = "encoder.blocks.0.layernorm1.gamma"
    for rank in (0, 4):
        flip_byte(ckpt / f"rank_{rank}" / "test-3_4.h5", f"params/{gamma}")
    proc = mpirun(8, [*TRANSFORMER, "--resume", "auto", "--repair"], cwd=job, check=0)
    for rank in (0, 4):
        assert re.search(rf"dsim: recovery: rank {rank}: checksum mismatch in run/checkpoints/rank_{rank}/test-3_4.h5: "
                         rf"params/{gamma}; no replica in its group info \[0, 4\] is whole, taking {gamma} from rank \d "
                         r"\(other holders of the same slices\)", proc.stdout), proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[14:]
    same_state(ref_ckpt, "test-4_5", ckpt, "test_1-4_5")
    tools = subprocess.run([sys.executable, "-m", "dsim.inspect", str(ckpt), "--verify"], capture_output=True,
                           text=True, timeout=120)
    assert tools.returncode == 0, tools.stdout + tools.stderr  # repaired in place: every file verifies
    report = subprocess.run([sys.executable, "-m", "dsim.inspect", str(ckpt), "--survivability", "--json"],
                            capture_output=True, text=True, timeout=120, check=True)
    holders = json.loads(report.stdout)["tensor_holders"]
    assert holders[gamma] == [list(range(8))]  # survives {0, 4} failing, unlike rank 0's attention slices
    assert holders["encoder.blocks.0.attention.dense1.weight"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_transformer_last_gasp_then_resume(transformer_reference, tmp_path):
    """Rank 5 killed halfway through step 13's update: the survivors save step 13, which every survivor finished;
    or step 12 when rank 1, rank 5's only replica, was still in step 13's sum as rank 5 died (a loaded machine:
    ULFM fails the sum), which the line and the event say. The resume from it is bit-identical."""
    ref_losses, ref_ckpt = transformer_reference
    ttp = [*TRANSFORMER, "--set", "tft.ttp=true"]
    crash = mpirun(8, [*ttp, "--set", "fault.kind=kill", "--set", "fault.rank=5", "--set", "fault.at=update",
                       "--set", "fault.step=13"], cwd=tmp_path, timeout=120, ft=True)
    [saved] = events(tmp_path, "last_gasp_saved")
    step, in_epoch = saved["global_step"], saved["global_step"] - 10
    assert step == 13 and "unfinished" not in saved or \
        step == 12 and 1 in saved["unfinished"]["ranks"] and saved["unfinished"]["newest_step"] == 13, saved
    assert crash.returncode == 1 and re.search(
        rf"dsim: error: rank\(s\) 5 failed; last-gasp checkpoint ttp-3_{in_epoch} \(global step {step}\) committed.* "
        + ("" if step == 13 else r"step 13 not saved: rank\(s\) (\d, )*1(, \d)* had not finished it"), crash.stderr), \
        crash.stderr
    proc = mpirun(8, [*ttp, "--resume", "auto"], cwd=tmp_path, check=0, ft=True)
    assert (f"resumed from run/checkpoints/ttp_checkpoints/tft_saved_checkpoints-step_{step}/rank_0/"
            f"ttp_rank_0-3_{in_epoch}.h5") in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses[step:]
    same_state(ref_ckpt, "test-4_5", tmp_path / "run" / "checkpoints", "test_1-4_5")


def test_transformer_uce_is_repaired_in_place(transformer_reference, tmp_path):
    ref_losses, ref_ckpt = transformer_reference
    proc = mpirun(8, [*TRANSFORMER, "--set", "tft.uce=true", "--set", "fault.kind=uce", "--set", "fault.rank=2",
                      "--set", "fault.at=forward", "--set", "fault.step=9"], cwd=tmp_path, check=0, ft=True)
    assert ("dsim: uce: rank(s) 2 had an uncorrectable memory error (UCE); repaired in place: rank 2 from rank 6 "
            "(group info [2, 6]) while the other ranks went on; the forward of step 9 goes on") in proc.stdout, proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses
    same_state(ref_ckpt, "test-4_5", tmp_path / "run" / "checkpoints", "test-4_5")


PIPELINED = ["-m", "dsim.train", "--config", str(ROOT / "configs" / "transformer_pipeline.yaml"),
             *[a for kv in ("model.transformer.vocab_size=256", "model.transformer.d_model=32", "data.num_samples=160",
                            "train.epochs=2", "checkpoint.save_checkpoint_steps=7", "output.dir=run")
               for a in ("--set", kv)]]  # 2 epochs of 5 steps: saves at steps 7 and 10


def test_transformer_pipeline_uces_in_both_stages_are_repaired_in_place(tmp_path):
    """The sample's pipeline (configs/transformer_pipeline.yaml: 2 stages of dp2 x mp2, 4 micro-batches, 1F1B;
    small sizes, 10 steps): a UCE on rank 1 (stage 0, the embeddings and encoder) at step 4 and one on rank 6 (stage
    1, the decoder and the head) at step 8, each in a forward pass. Each takes the buffers hit from its stage's replica;
    nobody else stops, nothing is redone, and every loss and every rank's final state equal the uninterrupted
    run's. (The replica reached in the dp gradient sum after the last stage's token count: test_in_place_mpi.)"""
    (tmp_path / "ref").mkdir()
    ref = mpirun(8, PIPELINED, cwd=tmp_path / "ref", check=0)
    assert "pipeline_stage=2 micro_batch_num=4 (1f1b); transformer encoder 2 x decoder 2, d_model 32" in ref.stdout
    ref_losses = LOSS.findall(ref.stdout)
    assert len(ref_losses) == 10
    job = tmp_path / "job"
    job.mkdir()
    proc = mpirun(8, [*PIPELINED, "--set", "tft.uce=true", "--set", "fault.kind=uce", "--set", "fault.rank=[1,6]",
                      "--set", "fault.at=forward", "--set", "fault.step=[4,8]"], cwd=job, check=0, ft=True)
    for rank, donor, step in [(1, 3, 4), (6, 4, 8)]:
        assert (f"dsim: uce: rank(s) {rank} had an uncorrectable memory error (UCE); repaired in place: rank {rank} "
                f"from rank {donor} (group info {sorted([rank, donor])}) while the other ranks went on; the forward "
                f"of step {step} goes on") in proc.stdout, proc.stdout
    assert "repaired in the job" not in proc.stdout
    assert LOSS.findall(proc.stdout) == ref_losses
    same_state(tmp_path / "ref" / "run" / "checkpoints", "test-2_5", job / "run" / "checkpoints", "test-2_5")


# the last case (a config error, refused by every rank alike before MPI is used) runs without mpirun; the first
# (the same family) keeps it
@pytest.mark.parametrize("args, message", [
    (["--set", "model.name=lenet6"], "config: model.name must be one of network, uce_network, lenet5, transformer, "
                                     "got 'lenet6'"),
    (["--set", "model.name=lenet5", "--set", "parallel.model_parallel=3", "--set", "parallel.data_parallel=1"],
     "layout data_parallel=1 x model_parallel=3 = 3 ranks does not fit the world size 4"),
    (["--config", str(ROOT / "configs" / "lenet5.yaml"), "--set", "parallel.data_parallel=null",
      "--set", "parallel.model_parallel=4", "--set", "model.name=lenet5"], None),  # 16 channels / 4: fine
    (["--config", str(ROOT / "configs" / "transformer.yaml"), "--set", "parallel.data_parallel=1",
      "--set", "model.transformer.num_heads=6", "--set", "model.transformer.d_model=24"],
     "transformer: num_heads=6 is not divisible by model_parallel=4"),
    (["--config", str(ROOT / "configs" / "transformer.yaml"), "--set", "parallel.data_parallel=1",
      "--set", "parallel.vocab_emb_dp=false", "--set", "model.transformer.vocab_size=1001"],
     "transformer: vocab_size (vocab_emb_dp: false)=1001 is not divisible by model_parallel=4"),
    (["--config", str(ROOT / "configs" / "transformer.yaml"), "--set", "parallel.data_parallel=1",
      "--set", "model.transformer.src_len=12", "--set", "model.transformer.max_position=10"],
     "config: transformer: the source length 12 is longer than the position table (max_position=10)"),
    (["--config", str(ROOT / "configs" / "transformer.yaml"), "--set", "parallel.data_parallel=1",
      "--set", "data.name=text", "--set", "data.path=pairs.txt"],
     "malformed line 3 in pairs.txt: expected 'source<TAB>target'"),
    (["--set", "model.name=transformer"], "config: model transformer needs data.name translation, text, "
                                          "got 'synthetic'"),
])
def test_bad_model_input_is_one_line(tmp_path, args, message):
    (tmp_path / "pairs.txt").write_text("le chat\tthe cat\nun chien\ta dog\nno tab here\n")
    if message is None:  # a layout the model admits: it trains (one step)
        proc = mpirun(4, ["-m", "dsim.train", *args, "--set", "train.epochs=1", "--set", "train.steps_per_epoch=1",
                          "--set", "checkpoint.enabled=false", "--set", "output.loss_every=1"], cwd=tmp_path, check=0)
        assert "data_parallel=1 model_parallel=4" in proc.stdout and "epoch: 1 step: 1, loss is" in proc.stdout
        return
    one_process = args == ["--set", "model.name=transformer"]
    proc = dsim_cli(None if one_process else 4, ["-m", "dsim.train", *args], cwd=tmp_path, timeout=180)
    errors = [line for line in proc.stderr.splitlines()  # prterun adds its notice; the launcher watch its own
              if line.startswith("dsim:") and not line.startswith("dsim: note: mpirun")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith("dsim: error: ") and \
        message in errors[0] and "Traceback" not in proc.stderr, proc.stderr
