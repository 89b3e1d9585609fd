"""The seed models' time per step on 8 ranks beside one process on the same global batch.

For LeNet5 (configs/lenet5.yaml, dp4 x mp2) and the Transformer (configs/transformer.yaml, dp2 x mp4):
bench.training_ranks trains without checkpoints on the config's layout, then in one process (dp1 x mp1),
same model, batch and optimizer; the figure is (8-rank step) / (1-process step), per repeat, both measured
in this run. On a machine with fewer cores than ranks the 8 ranks share them: the ratio shows the cost of
slicing (communication, smaller matrices) rather than a speed-up.

The Transformer's config saves a sharded checkpoint every step, as the sample does (141 tensors per rank's
file): its 8-rank run also trains that way, in the same job, and the figure is its time per step over the
one without checkpoints (what the saves cost, per-tensor metadata included).
"""
from __future__ import annotations

from .harness import ROOT, row, run_worker

NAME = "models"
TITLE = "Seed models: time per step on 8 ranks / one process, same global batch"
MODELS = {"lenet5": [], "transformer": []}
SAVING = {"transformer": "1"}   # the configs' own save interval, in steps, measured beside no checkpoints
SIZES = {"full": {"ranks": 8, "steps": 30, "saving_steps": 10, "repeats": 3, "timeout": 1800, "overrides": MODELS},
         "quick": {"ranks": 8, "steps": 15, "saving_steps": 6, "repeats": 3, "timeout": 900, "overrides": MODELS},
         "toy": {"ranks": 2, "steps": 4, "saving_steps": 3, "repeats": 1, "timeout": 300,
                 "overrides": {"lenet5": ["parallel.data_parallel=1", "parallel.model_parallel=2"],
                               "transformer": ["parallel.data_parallel=1", "parallel.model_parallel=2",
                                               "model.transformer.vocab_size=512"]}}}
SINGLE = ["parallel.data_parallel=1", "parallel.model_parallel=1", "parallel.optimizer_shard=1"]


def run(params: dict, workdir, opts) -> dict:
    raw = {}
    for model, overrides in params["overrides"].items():
        for where, ranks, extra in (("ranks", params["ranks"], []), ("single", 1, SINGLE)):
            plan = f"none={params['steps']}"
            if where == "ranks" and model in SAVING:
                plan += f",{SAVING[model]}={params['saving_steps']}"

            def args_in(d, plan=plan):
                return ["--config", ROOT / "configs" / f"{model}.yaml", "--plan", plan,
                        "--repeats", params["repeats"], "--dir", d / "runs",
                        *[a for o in [*overrides, *extra] for a in ("--set", o)]]
            raw[f"{model}/{where}"] = run_worker(f"{NAME}-{model}-{where}", "bench.training_ranks",
                                                 {**params, "ranks": ranks}, workdir, opts, args_in)
    return summarize(params, raw)


def summarize(params: dict, raw: dict) -> dict:
    rows, figures = [], {}
    for model in params["overrides"]:
        many = [r["variants"]["none"]["step_s"] for r in raw[f"{model}/ranks"]["repeats"]]
        one = [r["variants"]["none"]["step_s"] for r in raw[f"{model}/single"]["repeats"]]
        ratios = [a / b for a, b in zip(many, one)]
        figures[model] = {"ranks_step_s": many, "single_step_s": one, "ranks_over_single": ratios}
        rows.append(row(f"{model}: time per step, one process ({params['steps']} steps)", [1000 * b for b in one], "ms"))
        rows.append(row(f"{model}: time per step on {params['ranks']} ranks / one process", ratios, "x"))
        k = SAVING.get(model)
        if k is not None and all(f"k={k}" in r["variants"] for r in raw[f"{model}/ranks"]["repeats"]):
            saving = [r["variants"][f"k={k}"]["step_s"] / r["variants"]["none"]["step_s"]
                      for r in raw[f"{model}/ranks"]["repeats"]]
            figures[model]["saving_over_none"] = saving
            rows.append(row(f"{model}: on {params['ranks']} ranks, a save every {k} step(s) (its config) / none",
                            saving, "x"))
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
