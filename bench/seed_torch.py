"""The seed models beside torch: LeNet5 and the Transformer, a step in one process and on the config's dp degree.

For each model (configs/lenet5.yaml, configs/transformer.yaml: their sizes, batch, optimizer, dtype),
bench.seed_torch_ranks trains dsim and the same model in torch (bench.torch_peers: one thread per rank, torch's
own conv and pool for LeNet5) in one job, in a rotating order, first in one process, then on the config's
data-parallel degree with model_parallel 1 (torch under DistributedDataParallel, gloo). The figure is
dsim's time per step over torch's, per repeat. Where dsim is slower, what bounds it is measured in the same
run: each convolution and pooling's forward and backward alone, dsim's beside torch's, and the step it would
take with torch's in their place. Without torch installed only dsim runs, and the table says so.
"""
from __future__ import annotations

import statistics

from dsim.config import load_config

from .harness import ROOT, TORCH_LEFT_OUT, has_torch, row, run_worker, text_row

NAME = "seed_torch"
TITLE = "Seed models beside torch (same sizes, batch, optimizer, dtype; torch one thread per rank)"
MODELS = ("lenet5", "transformer")
PARTS = {"lenet5"}   # models whose convolutions and poolings are timed alone beside torch's
SIZES = {"full": {"steps": 20, "repeats": 3, "timeout": 1800, "dp": None, "overrides": {}},
         "quick": {"steps": 12, "repeats": 3, "timeout": 900, "dp": None, "overrides": {}},
         "toy": {"steps": 5, "repeats": 1, "timeout": 300, "dp": {"lenet5": 2, "transformer": None},
                 "overrides": {"transformer": ["model.transformer.vocab_size=512"]}}}


def layouts(model: str, params: dict) -> dict:
    """{"one process": 1, "dpN": N}: N the config's data-parallel degree (params["dp"] may lower it; None: none)."""
    dp = load_config(ROOT / "configs" / f"{model}.yaml").parallel.data_parallel
    if params["dp"] is not None:
        dp = params["dp"][model]
    return {"one process": 1, **({f"dp{dp}": dp} if dp else {})}


def run(params: dict, workdir, opts) -> dict:
    raw, with_torch = {}, has_torch(opts)
    for model in MODELS:
        for name, dp in layouts(model, params).items():
            sets = [*params["overrides"].get(model, []), f"parallel.data_parallel={dp}", "parallel.model_parallel=1",
                    "parallel.optimizer_shard=1"]

            def args_in(d, sets=sets, parts=dp == 1 and model in PARTS):
                return ["--config", ROOT / "configs" / f"{model}.yaml", "--steps", params["steps"],
                        "--repeats", params["repeats"], "--dir", d, *(["--torch"] if with_torch else []),
                        *(["--parts"] if parts else []), *[a for o in sets for a in ("--set", o)]]
            raw[f"{model}/{name}"] = run_worker(f"{NAME}-{model}-{name.replace(' ', '')}", "bench.seed_torch_ranks",
                                                {**params, "ranks": dp}, workdir, opts, args_in)
    return summarize({**params, "torch": with_torch}, raw)


def _mean(ranks, framework, key):
    return sum(r[framework][key] for r in ranks) / len(ranks)


def summarize(params: dict, raw: dict) -> dict:
    rows, figures = [], {}
    if not params["torch"]:
        rows.append(text_row("torch", TORCH_LEFT_OUT))
    for key, result in raw.items():
        reps = [rep["ranks"] for rep in result["repeats"]]
        step = [_mean(r, "dsim", "step_s") for r in reps]
        f = figures[key] = {"dsim_step_s": step}
        rows.append(row(f"{key}: dsim time per step ({params['steps']} steps, first 2 left out)",
                        [1000 * s for s in step], "ms"))
        if not params["torch"]:
            continue
        peer = [_mean(r, "torch", "step_s") for r in reps]
        ratios = [a / b for a, b in zip(step, peer)]
        update = [_mean(r, "dsim", "update_s") / _mean(r, "torch", "update_s") for r in reps]
        f.update(torch_step_s=peer, dsim_over_torch=ratios, update_over_torch=update)
        ddp = " (DDP, gloo)" if result["ranks"] > 1 else ""
        rows.append(row(f"{key}: torch time per step{ddp}", [1000 * s for s in peer], "ms"))
        rows.append(row(f"{key}: dsim / torch{ddp} time per step", ratios, "x", "<= 1.0x",
                        statistics.median(ratios) <= 1.0))
        rows.append(row(f"{key}: its optimizer update, dsim's / torch's optimizer.step() (in the same steps)", update, "x"))
        if all("data_s" in x["dsim"] for r in reps for x in r):   # (not in results stored before it was measured)
            drawn = [(a - _mean(r, "dsim", "data_s")) / b for a, b, r in zip(step, peer, reps)]
            f.update(step_less_data_over_torch=drawn)
            rows.append(row(f"{key}: dsim's step less drawing its synthetic batch / torch's step (torch reuses one "
                            "batch)", drawn, "x"))
        if result.get("parts"):
            rows += bound_rows(key, result["parts"], step, peer, f)
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def bound_rows(key: str, parts: dict, step: list, peer: list, f: dict) -> list:
    """Each layer's forward + backward alone, dsim's over torch's; and the step dsim would take with torch's
    layers in place of its own, over torch's step (what numpy's kernels leave, the rest of the step)."""
    rows = []
    for layer, t in parts.items():
        rows.append(row(f"{key}: {layer} forward + backward alone, dsim / torch ({1000 * t['dsim']:.2f} ms / "
                        f"{1000 * t['torch']:.2f} ms)", [t["dsim"] / t["torch"]], "x"))
    dsim_layers, torch_layers = (sum(t[k] for t in parts.values()) for k in ("dsim", "torch"))
    share = [100 * dsim_layers / s for s in step]
    bound = [(s - dsim_layers + torch_layers) / p for s, p in zip(step, peer)]
    f.update(layers_pct_of_step=share, step_with_torch_layers_over_torch=bound)
    rows.append(row(f"{key}: those layers (dsim's, alone) / dsim's step", share, "%"))
    rows.append(row(f"{key}: dsim's step with torch's time for those layers (estimate) / torch's step", bound, "x"))
    return rows


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
