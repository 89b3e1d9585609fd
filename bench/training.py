"""Training overhead of checkpointing every k steps (k = 1, 10, 100) against no checkpoints.

Launches bench.training_ranks under mpirun (one job: every repeat and variant inside it) on the default
run (configs/default.yaml: dp2 x mp4, the seeds' 32M-parameter Network, a 487 MiB checkpoint) and
reports, per repeat, time per step with checkpoints / time per step without.
"""
from __future__ import annotations

from .harness import ROOT, row, run_worker

NAME = "training"
TITLE = "Training overhead of checkpointing every k steps (default run, dp2 x mp4)"
# Steps per variant: 100 with k=100 (one save), fewer elsewhere: a per-step time settles within tens of
# steps (k=1 saves at every step: 9 measured steps hold 9 saves; k=10: 29 steps, 3 saves).
PLAN = {"none": 50, 1: 10, 10: 30, 100: 100}
SIZES = {"full": {"ranks": 8, "plan": PLAN, "repeats": 3, "timeout": 1800, "overrides": []},
         "quick": {"ranks": 8, "plan": {"none": 30, 1: 10, 10: 30, 100: 100}, "repeats": 3, "timeout": 900,
                   "overrides": ["model.hidden=[128,1024,1024,128]"]},
         "toy": {"ranks": 2, "plan": {"none": 6, 1: 6, 10: 6, 100: 6}, "repeats": 3, "timeout": 180,
                 "overrides": ["model.hidden=[16,32,32,16]", "parallel.data_parallel=1", "parallel.model_parallel=2"]}}


def run(params: dict, workdir, opts) -> dict:
    def args_in(d):
        plan = ",".join(f"{k}={n}" for k, n in params["plan"].items())
        return ["--config", ROOT / "configs" / "default.yaml", "--plan", plan, "--repeats", params["repeats"],
                "--dir", d / "runs", *[a for o in params["overrides"] for a in ("--set", o)]]
    return summarize(params, run_worker(NAME, "bench.training_ranks", params, workdir, opts, args_in))


def summarize(params: dict, raw: dict) -> dict:
    reps = raw["repeats"]
    base = [r["variants"]["none"]["step_s"] for r in reps]
    rows = [row(f"time per step, no checkpoints ({reps[0]['variants']['none']['steps']} steps)",
                [1000 * b for b in base], "ms")]
    figures = {"none_step_s": base}
    for k in [k for k in params["plan"] if k != "none"]:
        label = f"k={k}"
        v0 = reps[0]["variants"][label]
        ratios = [r["variants"][label]["step_s"] / r["variants"]["none"]["step_s"] for r in reps]
        figures[f"{label}_step_s"] = [r["variants"][label]["step_s"] for r in reps]
        figures[f"{label}_over_none"] = ratios
        rows.append(row(f"time per step, checkpoint every {k} step(s) / none ({v0['steps']} steps, {v0['saves']} saves)",
                        ratios, "x"))
    return {"params": params, "figures": figures, "repeats": reps, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    params = {**suite["params"], "plan": {("none" if k == "none" else int(k)): v
                                          for k, v in suite["params"]["plan"].items()}}
    return summarize(params, {"repeats": suite["repeats"]})["rows"]
