"""The training step: dsim beside torch on the same model, where dsim's step goes, and its memory.

For each layout (one process, dp2, dp4, dp8, mp4, dp2 x mp4) bench.step_ranks trains the default run's
model (the seeds' Network, Momentum, global batch 32; no checkpoints) and, on the data-parallel layouts,
the same model in torch (one thread per rank, DistributedDataParallel on gloo), alternating within the
job so each ratio compares figures of one repeat. Ranks share the machine's cores when there are fewer
cores than ranks: the same for both frameworks.
"""
from __future__ import annotations

from .harness import ROOT, has_torch, row, run_worker

NAME = "step"
TITLE = "Training step: dsim beside torch (same model, batch, optimizer), its parts, its memory"
SINGLE = ["parallel.optimizer_shard=1"]
LAYOUTS = {  # name: (data parallel, model parallel, torch beside it)
    "one process": (1, 1, True), "dp2": (2, 1, True), "dp4": (4, 1, True), "dp8": (8, 1, True),
    "mp4": (1, 4, False), "dp2 x mp4": (2, 4, False),
}
BREAKDOWN = ("one process", "dp4", "mp4", "dp2 x mp4")
SIZES = {"full": {"steps": 8, "repeats": 3, "timeout": 1200, "layouts": list(LAYOUTS), "overrides": []},
         "quick": {"steps": 10, "repeats": 3, "timeout": 600, "layouts": list(LAYOUTS),
                   "overrides": ["model.hidden=[128,1024,1024,128]"]},
         "toy": {"steps": 4, "repeats": 1, "timeout": 300, "layouts": ["one process", "dp2"],
                 "overrides": ["model.hidden=[16,32,32,16]"]}}


def run(params: dict, workdir, opts) -> dict:
    raw, with_torch = {}, has_torch(opts)
    for name in params["layouts"]:
        dp, mp, peer = LAYOUTS[name]
        sets = [*params["overrides"], f"parallel.data_parallel={dp}", f"parallel.model_parallel={mp}", *SINGLE]

        def args_in(d):
            return ["--config", ROOT / "configs" / "default.yaml", "--steps", params["steps"],
                    "--repeats", params["repeats"], "--dir", d, *(["--torch"] if peer and with_torch else []),
                    *[a for o in sets for a in ("--set", o)]]
        raw[name] = run_worker(f"{NAME}-{name.replace(' ', '')}", "bench.step_ranks",
                               {**params, "ranks": dp * mp}, workdir, opts, args_in)
    return summarize({**params, "torch": with_torch}, raw)


def _mean(ranks, key):
    return sum(r["dsim"][key] for r in ranks) / len(ranks)


def summarize(params: dict, raw: dict) -> dict:
    rows, figures = [], {}
    for name in params["layouts"]:
        reps = [rep["ranks"] for rep in raw[name]["repeats"]]
        step = [_mean(r, "step_s") for r in reps]
        f = figures[name] = {"dsim_step_s": step}
        rows.append(row(f"{name}: dsim time per step ({params['steps']} steps, first 2 left out)",
                        [1000 * s for s in step], "ms"))
        if "torch" in reps[0][0]:
            peer = [sum(x["torch"]["step_s"] for x in r) / len(r) for r in reps]
            ratios = [a / b for a, b in zip(step, peer)]
            f.update(torch_step_s=peer, dsim_over_torch=ratios)
            rows.append(row(f"{name}: torch time per step" + (" (DDP, gloo)" if name != "one process" else ""),
                            [1000 * s for s in peer], "ms"))
            rows.append(row(f"{name}: dsim / torch time per step", ratios, "x", "<= 1.0x", max(ratios) <= 1.0 or
                            sorted(ratios)[len(ratios) // 2] <= 1.0))
        if name in BREAKDOWN:
            rest = [100 * (1 - (_mean(r, "collectives_s") + _mean(r, "matmul_s")) / _mean(r, "step_s")) for r in reps]
            update = [100 * _mean(r, "update_s") / _mean(r, "step_s") for r in reps]
            beyond = [a - b for a, b in zip(rest, update)]
            f.update(rest_pct=rest, rest_less_update_pct=beyond)
            rows.append(row(f"{name}: matrix products (alone, a floor) / step",
                            [100 * _mean(r, "matmul_s") / _mean(r, "step_s") for r in reps], "%"))
            rows.append(row(f"{name}: MPI collectives / step",
                            [100 * _mean(r, "collectives_s") / _mean(r, "step_s") for r in reps], "%"))
            rows.append(row(f"{name}: the rest / step", rest, "%"))
            rows.append(row(f"{name}: of the rest, the optimizer update (in place, memory-bound) / step", update, "%"))
            rows.append(row(f"{name}: the rest excluding the update / step", beyond, "%", "<= 10 %",
                            sorted(beyond)[len(beyond) // 2] <= 10))
            if "torch" in reps[0][0] and "update_s" in reps[0][0]["torch"]:  # the same update's cost in torch: a floor
                floor = [100 * sum(x["torch"]["update_s"] for x in r) / len(r) / _mean(r, "step_s") for r in reps]
                f["torch_update_pct_of_dsim_step"] = floor
                rows.append(row(f"{name}: torch's optimizer.step() (SGD with momentum, the same parameters) / dsim's step",
                                floor, "%"))
        for kind, what in (("dp", "dp gradient reduction"), ("mp", "mp activation all-reduce")):
            if f"{kind}_dsim_s" in reps[0][0]["dsim"]:
                bw = [_mean(r, f"{kind}_raw_s") / _mean(r, f"{kind}_dsim_s") for r in reps]
                f[f"{kind}_bandwidth_over_raw"] = bw
                size = reps[0][0]["dsim"][f"{kind}_bytes"]
                rows.append(row(f"{name}: {what} bandwidth / raw mpi4py Allreduce ({size / 2**20:.2f} MiB)", bw, "x",
                                ">= 0.8x", sorted(bw)[len(bw) // 2] >= 0.8))
                if f"{kind}_mpi_s" in reps[0][0]["dsim"]:   # the group sums through shared memory
                    mpi = [_mean(r, f"{kind}_raw_s") / _mean(r, f"{kind}_mpi_s") for r in reps]
                    f[f"{kind}_mpi_bandwidth_over_raw"] = mpi
                    rows.append(row(f"{name}: the same through MPI (dsim without shared memory) / raw", mpi, "x"))
        measured = [r for r in reps if "peak_rss" in r[0]["dsim"]]   # the first repeat: a fresh process
        mem = [max(x["dsim"]["peak_rss"] / x["dsim"]["state_bytes"] for x in r) for r in measured]
        f["peak_rss_over_state"] = mem
        state = reps[0][0]["dsim"]["state_bytes"]
        rows.append(row(f"{name}: peak RSS in training (slowest rank) / (parameters + gradients + optimizer "
                        f"state, {state / 2**20:.0f} MiB per rank)", mem, "x", "<= 1.5x", max(mem) <= 1.5))
        extra = [max((x["dsim"]["peak_rss"] - x["dsim"]["baseline_rss"]) / x["dsim"]["state_bytes"] for x in r)
                 for r in measured]
        f["peak_rss_over_state_less_interpreter"] = extra
        rows.append(row(f"{name}: the same, less the interpreter's own RSS before the run "
                        f"({measured[0][0]['dsim']['baseline_rss'] / 2**20:.0f} MiB)", extra, "x"))
        if all("shared_overcount" in x["dsim"] for r in measured for x in r):
            pss = [max((x["dsim"]["peak_rss"] - x["dsim"]["shared_overcount"]) / x["dsim"]["state_bytes"] for x in r)
                   for r in measured]
            f["peak_pss_over_state"] = pss
            rows.append(row(f"{name}: the same as PSS, shared pages counted once per node (peak RSS - (RSS - PSS) "
                            f"at the end; {max(x['dsim']['shared_overcount'] for x in measured[0]) / 2**20:.0f} "
                            "MiB shared)", pss, "x"))
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
