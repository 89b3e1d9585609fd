"""Training overhead of checkpointing every k steps (k = 1, 10, 100; and async every 10, its snapshot in memory or
in the page cache) against no checkpoints.

Launches bench.training_ranks under mpirun (one job: every repeat and variant inside it) on the default
run (configs/default.yaml: dp2 x mp4, the seeds' 32M-parameter Network, a 487 MiB checkpoint) and
reports, per repeat, time per step with checkpoints / time per step without; how long the saving step
stalls with async saves against a synchronous save's time (target <= 0.10x); and each rank's peak resident
memory beside the bytes of its parameters, gradients and optimizer state (a save should add <= 0.5x of it).
"""
from __future__ import annotations

import statistics

from .harness import ROOT, row, run_worker

NAME = "training"
TITLE = "Training overhead of checkpointing every k steps (default run, dp2 x mp4)"
# Steps per variant: a per-step time settles within tens of steps (k=1 saves at every step: 9 measured steps
# hold 9 saves; k=10: 29 steps, 3 saves). The full size leaves out k=100 (100 steps, one save: 0.90-1.07x
# none in earlier runs, within the noise), which kept `make bench` above 20 minutes on a slow VM; quick keeps it.
# Without checkpoints it trains 30 steps, as many as k=10.
# p10: async every 10 steps staged in the page cache (checkpoint.async_staging: page_cache).
PLAN = {"none": 30, 1: 10, 10: 30, "a10": 30, "p10": 30}
SIZES = {"full": {"ranks": 8, "plan": PLAN, "repeats": 3, "timeout": 2700, "overrides": []},
         "quick": {"ranks": 8, "plan": {"none": 30, 1: 10, 10: 30, "a10": 30, "p10": 30, 100: 100}, "repeats": 3,
                   "timeout": 900, "overrides": ["model.hidden=[128,1024,1024,128]"]},
         "toy": {"ranks": 2, "plan": {"none": 6, 1: 6, 10: 6, "a10": 6, "p10": 6, 100: 6}, "repeats": 3, "timeout": 180,
                 "overrides": ["model.hidden=[16,32,32,16]", "parallel.data_parallel=1", "parallel.model_parallel=2"]}}


def run(params: dict, workdir, opts) -> dict:
    def args_in(d):
        plan = ",".join(f"{k}={n}" for k, n in params["plan"].items())
        return ["--config", ROOT / "configs" / "default.yaml", "--plan", plan, "--repeats", params["repeats"],
                "--dir", d / "runs", *[a for o in params["overrides"] for a in ("--set", o)]]
    return summarize(params, run_worker(NAME, "bench.training_ranks", params, workdir, opts, args_in))


def _label(k) -> str:
    if isinstance(k, str) and k[0] in "ap":
        return f"async k={k[1:]}" if k[0] == "a" else f"async page_cache k={k[1:]}"
    return f"k={k}"


WHAT = {"a": "async checkpoint every {} step(s)", "p": "async checkpoint staged in the page cache every {} step(s)"}


STALL_TARGET, SAVE_MEMORY_TARGET = 0.10, 0.5
PSS_TARGET = 1.5  # peak PSS over training, saves included, per rank / parameters + gradients + optimizer state


def summarize(params: dict, raw: dict) -> dict:
    reps = raw["repeats"]
    base = [r["variants"]["none"]["step_s"] for r in reps]
    rows = [row(f"time per step, no checkpoints ({reps[0]['variants']['none']['steps']} steps)",
                [1000 * b for b in base], "ms")]
    figures = {"none_step_s": base}
    for k in [k for k in params["plan"] if k != "none"]:
        label = _label(k)
        v0 = reps[0]["variants"][label]
        ratios = [r["variants"][label]["step_s"] / r["variants"]["none"]["step_s"] for r in reps]
        figures[f"{label}_step_s"] = [r["variants"][label]["step_s"] for r in reps]
        figures[f"{label}_over_none"] = ratios
        what = WHAT[k[0]].format(k[1:]) if isinstance(k, str) else f"checkpoint every {k} step(s)"
        rows.append(row(f"time per step, {what} / none ({v0['steps']} steps, {v0['saves']} saves)", ratios, "x"))
    if "a10" in params["plan"] and 10 in params["plan"] and "stall_s" in reps[0]["variants"]["k=10"]:
        for key, label, what in (("a10", "async k=10", "async"), ("p10", "async page_cache k=10",
                                                                  "async staged in the page cache")):
            if key not in params["plan"]:
                continue
            stalls = [r["variants"][label]["stall_s"] / r["variants"]["k=10"]["stall_s"] for r in reps]
            figures["async_stall_over_sync_save" if key == "a10" else "page_cache_stall_over_sync_save"] = stalls
            rows.append(row(f"the saving step's stall, {what} / a synchronous save (every 10 steps; median save, "
                            "slowest rank)", stalls, "x", f"<= {STALL_TARGET}x", statistics.median(stalls) <= STALL_TARGET))
            if "held_s" in reps[0]["variants"][label]:
                held = [1000 * r["variants"][label]["held_s"] for r in reps]
                figures[f"{label}_update_held_ms"] = held
                rows.append(row(f"the next update's wait for the staging, {what} (median save, slowest rank; "
                                "diagnostic)", held, "ms"))
        rows += memory_rows(reps, figures)
    return {"params": params, "figures": figures, "repeats": reps, "rows": rows}


def memory_rows(reps, figures) -> list:
    """Peak RSS (largest rank) per variant beside parameters + gradients + optimizer state, and what saving adds."""
    def per(label, key):
        return [max(r["variants"][label][key]) for r in reps]
    state = per("none", "state_bytes")
    rows = [row("bytes of parameters + gradients + optimizer state (largest rank)", state, "B")]
    variants = reps[0]["variants"]
    for label, what in (("none", "no checkpoints"), ("k=10", "sync saves every 10 steps"),
                        ("async k=10", "async saves every 10 steps"),
                        ("async page_cache k=10", "async saves staged in the page cache every 10 steps")):
        if label not in variants:
            continue
        ratio = [rss / s for rss, s in zip(per(label, "peak_rss_bytes"), state)]
        figures[f"{label}_peak_rss_over_state"] = ratio
        rows.append(row(f"peak RSS / that, {what} (the build included)", ratio, "x"))
        if "peak_pss_bytes" in variants[label]:   # (not in results stored before it was measured)
            pss = [p / s for p, s in zip(per(label, "peak_pss_bytes"), state)]
            figures[f"{label}_peak_pss_over_state"] = pss
            rows.append(row(f"peak PSS over training / that, {what}", pss, "x", f"<= {PSS_TARGET}x",
                            statistics.median(pss) <= PSS_TARGET,
                            "shared pages divided among the node's processes; the build left out"))
    for label, what in (("k=10", "a synchronous save"), ("async k=10", "an async save"),
                        ("async page_cache k=10", "an async save staged in the page cache")):
        if label not in variants:
            continue
        added = [(a - b) / s for a, b, s in zip(per(label, "peak_rss_bytes"), per("none", "peak_rss_bytes"), state)]
        figures[f"{label}_added_rss_over_state"] = added
        note = ""
        if label == "async k=10":
            snap = per(label, "snapshot_bytes")[0] / state[0]
            note = f"its snapshot buffer alone is {snap:.2f}x: one copy of parameters and optimizer state"
        elif label.startswith("async"):
            note = ("no buffer of its own: the kernel holds the bytes as dirty page cache until they are on the "
                    "disk, then as reclaimable cache")
        rows.append(row(f"peak RSS added by {what} / that", added, "x", f"<= {SAVE_MEMORY_TARGET}x",
                        statistics.median(added) <= SAVE_MEMORY_TARGET, note))
    return rows


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    params = {**suite["params"], "plan": {(k if k == "none" or k[0] in "ap" else int(k)): v
                                          for k, v in suite["params"]["plan"].items()}}
    return summarize(params, {"repeats": suite["repeats"]})["rows"]
