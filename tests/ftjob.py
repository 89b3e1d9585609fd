"""The small job the fault-tolerance tests kill, damage and repair, and what they compare it against.

2 epochs of 10 steps, Adam, a periodic checkpoint every 7 steps, on dp2 x mp4 and on dp4 x mp2 with
optimizer shard 2 (both have a replica of every slice), and on dp2 x mp4 with optimizer shard 2 (none).
"""
import json
import re

import numpy as np

from dsim.checkpoint import load_checkpoint

OPTS = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=320", "--set", "train.epochs=2",
        "--set", "output.loss_every=1", "--set", "optimizer.name=adam", "--set", "optimizer.learning_rate=0.002",
        "--set", "checkpoint.save_checkpoint_steps=7", "--set", "checkpoint.save_checkpoint_epochs=null",
        "--set", "output.dir=run"]
LAYOUTS = {"dp2xmp4": [], "dp4xmp2k2": ["--set", "parallel.model_parallel=2", "--set", "parallel.optimizer_shard=2"],
           "dp4xmp2": ["--set", "parallel.model_parallel=2"],
           "dp2xmp4k2": ["--set", "parallel.optimizer_shard=2"],
           "pp4xdp2": ["--set", "parallel.pipeline_stage=4", "--set", "parallel.model_parallel=1",
                       "--set", "parallel.micro_batch_num=8"]}
LOSS = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$", re.M)


def redone_once(losses: list) -> list:
    """Loss lines with a step that was redone after an in-job repair counted once: rank 0 may have finished
    (and printed) the step before the survivors agreed to go back before it; the redone step prints the same
    line again (bit-identical), right after. A redone step whose loss differed would stay twice."""
    return [x for i, x in enumerate(losses) if i == 0 or x != losses[i - 1]]


def fault(kind, rank, at, step, *extra):
    return ["--set", f"fault.kind={kind}", "--set", f"fault.rank={rank}", "--set", f"fault.at={at}",
            "--set", f"fault.step={step}", *extra]


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("dsim: error:")]


def events(job, kind):
    lines = (job / "run" / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def final_state_equal(ref_ckpt, ckpt, name="network_1-2_10"):
    """Every rank's final parameters and Adam moments, bit for bit, against the uninterrupted run's."""
    held = set()
    for rank in range(8):
        a = load_checkpoint(ref_ckpt / f"rank_{rank}" / "network-2_10.h5")
        b = load_checkpoint(ckpt / f"rank_{rank}" / f"{name}.h5")
        assert a.slices and set(a.slices) == set(b.slices)
        held |= set(a.slices)
        for key in a.slices:
            assert np.array_equal(a[key], b[key]), (rank, key)
    assert len(held) == 27  # 9 params, 18 Adam moments (with pipeline stages, spread over the stages)
