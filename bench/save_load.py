"""Sharded save and load, 8 ranks: dsim vs the disk's limit (raw bytes) vs torch.distributed.checkpoint.

Launches bench.save_load_ranks under mpirun (one job, every repeat inside it) and turns its timings
into ratios per repeat: a ratio of two methods is always measured in the same repeat, back to back.
"""
from __future__ import annotations

import statistics

from .harness import GiB, row, run_worker, text_row

NAME = "save_load"
TITLE = "Sharded save and load (every file fsync'd; loads from disk, page cache evicted)"
SIZES = {"full": {"ranks": 8, "model_parallel": 4, "total_bytes": 2 * GiB, "repeats": 3, "timeout": 1500},
         "quick": {"ranks": 8, "model_parallel": 4, "total_bytes": GiB // 4, "repeats": 3, "timeout": 600},
         "toy": {"ranks": 2, "model_parallel": 2, "total_bytes": 2 ** 22, "repeats": 3, "timeout": 180}}
TARGETS = {("save", "raw"): 0.95, ("save", "dcp"): 1.5, ("load", "raw"): 0.9, ("load", "dcp"): 1.2}


def run(params: dict, workdir, opts) -> dict:
    def args_in(d):
        return ["--total-bytes", params["total_bytes"], "--repeats", params["repeats"], "--model-parallel",
                params["model_parallel"], "--dir", d / "files", *(["--no-dcp"] if opts.no_dcp or getattr(opts, "no_torch", False) else [])]
    return summarize(params, run_worker(NAME, "bench.save_load_ranks", params, workdir, opts, args_in))


def summarize(params: dict, raw: dict) -> dict:
    """Throughputs and per-repeat ratios (higher is better for dsim) of the worker's timings."""
    reps = raw["repeats"]
    methods = list(reps[0]["save_s"])
    state = raw["state_bytes"]
    figures = {"state_bytes": state, "methods": methods}
    rows = []
    for op in ("save", "load"):
        for m in methods:
            gibs = [state / GiB / r[f"{op}_s"][m] for r in reps]
            figures[f"{op}_{m}_gib_s"] = gibs
            rows.append(row(f"{op}: {m} ({_what(m, op)})", gibs, "GiB/s"))
        for other in ("raw", "dcp"):
            if other not in methods:
                continue
            ratios = [r[f"{op}_s"][other] / r[f"{op}_s"]["dsim"] for r in reps]
            figures[f"{op}_dsim_over_{other}"] = ratios
            target = TARGETS.get((op, other))
            ok = statistics.median(ratios) >= target if target else None
            rows.append(row(f"{op}: dsim speed / {other} speed (same repeat)", ratios, "x",
                            f">= {target}x" if target else None, ok))
        phase = "write_file" if op == "save" else "read_file"
        inner = [r[f"{op}_s"]["raw"] / r["dsim_phases_s"][phase] for r in reps]
        figures[f"{op}_dsim_{phase}_over_raw"] = inner
        rows.append(row(f"{op}: dsim's HDF5 files alone (format.{phase}, slowest rank) / raw", inner, "x",
                        note="diagnostic"))
        if "dcp" not in methods:
            rows.append(text_row(f"{op}: DCP", raw["dcp"]))
    if "reshard_s" in reps[0]:
        ratios = [r["reshard_s"] / r["load_s"]["dsim"] for r in reps]
        figures["reshard_over_load"] = ratios
        rows.append(row(f"offline reshard to {reps[0]['reshard_ranks']} ranks (python -m dsim.reshard, one process) / "
                        f"dsim's load on {params['ranks']} ranks", ratios, "x"))
    resident = max(v for r in reps for v in r["resident_before_load"].values())
    figures["max_resident_fraction_before_load"] = resident
    rows.append(text_row("page cache before each load",
                         f"fsync + posix_fadvise(DONTNEED) on every file; at most {100 * resident:.1f}% of pages "
                         "still cached (mincore)"))
    return {"params": {**params, "hidden": raw["hidden"], "layout": raw["layout"], "state_bytes": state,
                       "tensors_per_rank": raw["tensors_per_rank"], "dcp": raw["dcp"],
                       "mpi_library": raw["mpi_library"], "torch": raw.get("torch")},
            "figures": figures, "repeats": reps, "rows": rows}


def _what(method: str, op: str) -> str:
    return {"raw": "ndarray.tofile + fsync" if op == "save" else "readinto",
            "dsim": "ModelCheckpoint.save + commit" if op == "save" else "latest_committed + restore",
            "dcp": f"torch.distributed.checkpoint.{op}"}[method]


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    p = suite["params"]
    raw = {"repeats": suite["repeats"], **{k: p[k] for k in ("hidden", "layout", "state_bytes", "tensors_per_rank",
                                                             "dcp", "mpi_library", "torch")}}
    return summarize(p, raw)["rows"]
