"""How long LeNet5 stays on the ln 10 plateau on digits, with the page's settings (not a suite of `python -m bench`).

    $ python -m bench.plateau                          # 4000 glyph digits, 10 epochs, both initialisations
    $ python -m bench.plateau --digits MNIST_Data/train --samples 4000 --epochs 10

The fault-recovery page's run (configs/lenet5.yaml: Momentum(0.01, 0.9), batch 32, Rescale(1/255) and
Resize(32, 32), shuffle off) on one process, through `python -m dsim.train`, on the idx files of --digits (the
real MNIST_Data/train when you have it; by default dsim.data.glyphs's digits, written for the run), cut to
--samples. Two initialisations: `page`, dsim's (the page's MindSpore r2.1 version: HeUniform convolutions,
Normal(0.02) Dense weights, Uniform(1/sqrt(fan_in)) Dense biases), and `before`, dsim's before issue 55 (Normal(0.02)
convolutions too, zero Dense biases). Prints, as one JSON line per initialisation, each epoch's mean loss, the first
epoch whose mean loss is below 0.9 ln 10, and the first step where the mean of the last 25 steps' losses is
(the plateau left there), also as epochs (step / steps per epoch).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT = 0.9 * math.log(10)   # an epoch's mean loss below this: the plateau is left
# dsim's LeNet5 before issue 55, for the comparison: every weight Normal(0.02), Dense biases zeros
BEFORE = """
import sys
from dsim.nn import conv, layers
conv_init, dense_init = conv.Conv2d.__init__, layers.Dense.__init__
conv.Conv2d.__init__ = lambda self, *a, **k: conv_init(self, *a, **{**k, "weight_init": ("normal", 0.02)})
dense_init_zero = lambda self, *a, **k: dense_init(self, *a, **{**k, "bias_init": ("zeros",)})
layers.Dense.__init__ = dense_init_zero
from dsim.train import main
sys.exit(main(sys.argv[1:]))
"""


WINDOW = 25                 # steps of the trailing mean that says where the plateau is left


def step_losses(metrics: Path) -> dict:
    """epoch -> the losses of its steps, from a run's metrics.jsonl."""
    per = {}
    for line in metrics.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "step":
            per.setdefault(event["epoch"], []).append(event["loss"])
    return per


def left_at(losses: list):
    """The first step (1-based) where the mean of the last WINDOW losses is below LEFT, or None."""
    for end in range(WINDOW, len(losses) + 1):
        if sum(losses[end - WINDOW:end]) / WINDOW < LEFT:
            return end
    return None


def run(init: str, digits: Path, samples: int, epochs: int, work: Path) -> dict:
    out = work / init
    args = ["--config", str(ROOT / "configs" / "lenet5.yaml"), "--set", "data.name=mnist",
            "--set", f"data.path={digits}", "--set", "parallel.data_parallel=1", "--set", "parallel.model_parallel=1",
            "--set", "checkpoint.enabled=false", "--set", "output.loss_every=1", "--set", f"train.epochs={epochs}",
            "--set", f"train.steps_per_epoch={samples // 32}", "--set", f"output.dir={out}"]
    cmd = [sys.executable, "-c", BEFORE] if init == "before" else [sys.executable, "-m", "dsim.train"]
    subprocess.run(cmd + args, check=True, cwd=work, capture_output=True, timeout=3600)
    per = step_losses(out / "metrics.jsonl")
    means = [sum(v) / len(v) for _, v in sorted(per.items())]
    step = left_at([x for _, v in sorted(per.items()) for x in v])
    return {"init": init, "samples": samples, "epochs": epochs,
            "left_plateau_epoch": next((i + 1 for i, m in enumerate(means) if m < LEFT), None),
            "left_plateau_step": step, "left_plateau_in_epochs": None if step is None else round(step / (samples // 32), 2),
            "epoch_mean_loss": [round(x, 4) for x in means]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plateau", description=__doc__.splitlines()[0])
    ap.add_argument("--digits", type=Path, help="a directory of MNIST idx files (default: glyph digits, generated)")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--init", default="page,before", help="page, before, or both (comma-separated)")
    ap.add_argument("--seed", type=int, default=0, help="the glyph digits' seed")
    opts = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        digits = opts.digits.resolve() if opts.digits else None
        if digits is None:
            from dsim.data.glyphs import write_digits
            digits = write_digits(work / "MNIST_Data" / "train", opts.samples, opts.seed)
        for init in opts.init.split(","):
            print(json.dumps(run(init, digits, opts.samples, opts.epochs, work)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
