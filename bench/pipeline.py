"""Pipeline parallel: time per step with p = 1, 2, 4 stages on the same ranks, global batch and micro-batches.

bench.training_ranks trains (no checkpoints, global batch 32) the MLP on 8 ranks as pp1 x dp8, pp2 x dp4 and pp4 x dp2
(model_parallel 1), each with the same global batch cut into the same m micro-batches per step, and reports
each time per step beside the one without stages, and the ideal bubble fraction (p - 1) / (m + p - 1) of a
synchronous schedule (1F1B, MindSpore's): the share of a step a stage would idle if every micro-batch took
the same time on every stage and communication were free. On a machine with fewer cores than ranks the
ranks share them: a stage's idle time is then given to the others, and the ratio shows the cost of the
point-to-point traffic and the smaller per-stage work rather than the bubble.
"""
from __future__ import annotations

from dsim.parallel.pipeline import bubble_fraction

from .harness import ROOT, row, run_worker

NAME = "pipeline"
TITLE = "Pipeline parallel: time per step with p stages / without, same ranks, batch and micro-batches"
# bench.training_ranks trains on global batches of 32: 4 samples per rank at dp8, so at most 4 micro-batches.
SIZES = {"full": {"ranks": 8, "stages": [1, 2, 4], "micro": 4, "steps": 15, "repeats": 3, "timeout": 1800,
                  "overrides": ["model.hidden=[512,2048,2048,512]"]},
         "quick": {"ranks": 8, "stages": [1, 2, 4], "micro": 4, "steps": 10, "repeats": 3, "timeout": 900,
                   "overrides": ["model.hidden=[128,1024,1024,128]"]},
         "toy": {"ranks": 2, "stages": [1, 2], "micro": 2, "steps": 4, "repeats": 1, "timeout": 300,
                 "overrides": ["model.hidden=[16,32,32,16]"]}}


def run(params: dict, workdir, opts) -> dict:
    raw = {}
    for p in params["stages"]:
        layout = [f"parallel.pipeline_stage={p}", "parallel.model_parallel=1", "parallel.optimizer_shard=1",
                  f"parallel.data_parallel={params['ranks'] // p}", f"parallel.micro_batch_num={params['micro']}"]

        def args_in(d, layout=layout):
            return ["--config", ROOT / "configs" / "default.yaml", "--plan", f"none={params['steps']}",
                    "--repeats", params["repeats"], "--dir", d / "runs",
                    *[a for o in [*params["overrides"], *layout] for a in ("--set", o)]]
        raw[f"pp{p}"] = run_worker(f"{NAME}-pp{p}", "bench.training_ranks", params, workdir, opts, args_in)
    return summarize(params, raw)


def summarize(params: dict, raw: dict) -> dict:
    rows, figures = [], {}
    n, m = params["ranks"], params["micro"]
    base = [r["variants"]["none"]["step_s"] for r in raw["pp1"]["repeats"]]
    for p in params["stages"]:
        steps = [r["variants"]["none"]["step_s"] for r in raw[f"pp{p}"]["repeats"]]
        ratios = [a / b for a, b in zip(steps, base)]
        figures[f"pp{p}"] = {"step_s": steps, "over_pp1": ratios, "ideal_bubble": bubble_fraction(p, m)}
        layout = f"pp{p} x dp{n // p}"
        rows.append(row(f"{layout}, m={m}: time per step", [1000 * s for s in steps], "ms"))
        if p > 1:
            rows.append(row(f"{layout} / pp1 x dp{n} (ideal bubble (p-1)/(m+p-1) = {bubble_fraction(p, m):.2f})",
                            ratios, "x"))
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
