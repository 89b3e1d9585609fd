"""The optimizer update beside torch's optimizer.step() on the same parameters (Momentum, Adam, AdamWeightDecay).

bench.update_ranks builds the default run's model in one process (every parameter whole, 32M of them), trains a
step, then calls dsim's update and torch's optimizer.step() on copies of the same parameters and gradients in
turn, the order rotating each round: torch's default implementation (what `optimizer.step()` runs) and its
fused one (fused=True: one C++ pass over each parameter, the floor of an update in place). The figure is
dsim's median over torch's. Where dsim's update sits in a step (the rest of a step excluding it, at 1 process,
dp4, mp4 and dp2 x mp4) is in the step suite.
"""
from __future__ import annotations

import statistics

from .harness import ROOT, TORCH_LEFT_OUT, has_torch, row, run_worker, text_row

NAME = "update"
TITLE = "Optimizer update: dsim's beside torch's optimizer.step(), the default model's parameters, one process"
OPTIMIZERS = {"momentum": "SGD(momentum)", "adam": "Adam", "adamweightdecay": "AdamW"}
SIZES = {"full": {"calls": 5, "repeats": 3, "timeout": 900, "overrides": []},
         "quick": {"calls": 3, "repeats": 3, "timeout": 600, "overrides": []},
         "toy": {"calls": 3, "repeats": 1, "timeout": 300, "overrides": ["model.hidden=[16,32,32,16]"]}}


def run(params: dict, workdir, opts) -> dict:
    with_torch = has_torch(opts)

    def args_in(d):
        return ["--config", ROOT / "configs" / "default.yaml", "--calls", params["calls"], "--repeats", params["repeats"], "--dir", d,
                "--optimizers", ",".join(OPTIMIZERS), *(["--torch"] if with_torch else []),
                *[a for o in params["overrides"] for a in ("--set", o)]]
    raw = run_worker(NAME, "bench.update_ranks", {**params, "ranks": 1}, workdir, opts, args_in)
    return summarize({**params, "torch": with_torch}, raw)


def summarize(params: dict, raw: dict) -> dict:
    rows, figures = [], {}
    if not params["torch"]:
        rows.append(text_row("torch", TORCH_LEFT_OUT))
    for name, t in raw["optimizers"].items():
        f = figures[name] = {"dsim_s": t["dsim"]}
        rows.append(row(f"{name}: dsim's update ({t['parameters'] / 1e6:.1f}M parameters; a repeat: the median of "
                        f"{params['calls']} calls)", [1000 * s for s in t["dsim"]], "ms"))
        if not params["torch"]:
            continue
        f.update(over_torch=ratios(t["dsim"], t["torch"]), over_torch_fused=ratios(t["dsim"], t["torch_fused"]))
        rows.append(row(f"{name}: torch {OPTIMIZERS[name]}.step()", [1000 * s for s in t["torch"]], "ms"))
        rows.append(row(f"{name}: dsim / torch {OPTIMIZERS[name]}.step()", f["over_torch"], "x", "<= 1.0x",
                        statistics.median(f["over_torch"]) <= 1.0))
        rows.append(row(f"{name}: dsim / torch {OPTIMIZERS[name]}(fused=True).step() (one C++ pass a parameter; "
                        "no target)", f["over_torch_fused"], "x"))
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def ratios(a: list, b: list) -> list:
    return [x / y for x, y in zip(a, b)]


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
