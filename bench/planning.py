"""Planning at scale (no MPI): group info, the save plan and the per-checkpoint metadata for 8 ... 65,536 ranks.

For every simulated world size, with the seeds' Network (784-512-5120-5120-512-10, Momentum) on data
parallel x model_parallel 4 (the default layout grown by data parallelism) and on dp x mp8 with
optimizer shard 8, it times what planning a sharded checkpoint takes, as dsim builds it:
  replica_sets        every replica set once (rank 0 puts them in the graph meta)
  group_info          one rank's group info (each rank computes its own, into its file's attributes)
  save_plan           every distinct slice once, with the replica sets that hold it
  graph meta, commit  the records as written (json, indent=1), for one checkpoint
and sizes what a checkpoint carries: the commit record, the graph meta, the group info in every file.
"""
from __future__ import annotations

import json
import statistics
import time

from dsim.checkpoint import group_info, replica_sets
from dsim.checkpoint.plan import commit_record, graph_meta, save_plan
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout

from .harness import row, text_row

NAME = "planning"
TITLE = "Planning at scale (group info, save plan, metadata; no MPI)"
WORLDS = [8, 64, 512, 4096, 32768, 65536]
SIZES = {"full": {"worlds": WORLDS, "repeats": 5},
         "quick": {"worlds": WORLDS, "repeats": 3},
         "toy": {"worlds": [8, 64, 512], "repeats": 3}}
FAMILIES = {"mp4": (4, 1), "mp8_k8": (8, 8)}  # model_parallel, optimizer_shard
SLOTS = ("moments",)


def layout_of(world: int, mp: int, k: int) -> ParallelLayout:
    dp = world // mp
    return ParallelLayout(dp, mp, k if dp % k == 0 else 1)


def plan_once(layout: ParallelLayout, specs) -> dict:
    """Time each planning step once; sizes of what it produced."""
    t = {}
    t0 = time.perf_counter()
    sets = replica_sets(layout)
    t["replica_sets"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = group_info(layout, 0)
    t["group_info_one_rank"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = save_plan(layout, specs, SLOTS)
    t["save_plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    meta = json.dumps(graph_meta("network", layout, specs, SLOTS), indent=1)
    t["graph_meta"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    sizes = {r: 4 * plan.elements_per_rank(r) for r in (0,)}
    per_rank = sizes[0]  # replicas and mp peers write files of (nearly) the same size; the record lists each
    record = commit_record("network-1_60", "network", layout, 1, 60, 60, 1,
                           {r: per_rank for r in range(layout.world_size)}, time=time.time())
    commit = json.dumps(record, indent=1) + "\n"
    t["commit_record"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    gi_file = json.dumps({"format": "dsim-group-info/1", "rank": 0, "group_info": mine,
                          "layout": layout.to_dict()}) + "\n"
    return {"seconds": t, "sizes": {
        "distinct_slices": len(plan.slices), "replica_sets": len(sets), "commit_record_bytes": len(commit),
        "commit_record_file_entries": len(record["files"]), "graph_meta_bytes": len(meta),
        "group_info_entries_per_rank": len(mine), "group_info_json_bytes_per_rank": len(gi_file),
        "group_info_entries_all_files": len(mine) * layout.world_size}}


def run(params: dict, workdir, opts) -> dict:
    specs = create_network("network").specs
    figures = {}
    for family, (mp, k) in FAMILIES.items():
        for world in params["worlds"]:
            layout = layout_of(world, mp, k)
            runs = [plan_once(layout, specs) for _ in range(params["repeats"])]
            figures[f"{family}/{world}"] = {
                "layout": layout.to_dict(), "sizes": runs[0]["sizes"],
                "seconds": {key: [r["seconds"][key] for r in runs] for key in runs[0]["seconds"]}}
    return {"params": {**params, "families": {k: {"model_parallel": v[0], "optimizer_shard": v[1]}
                                              for k, v in FAMILIES.items()},
                       "model": "network 784-512-5120-5120-512-10, momentum"},
            "figures": figures, "rows": rows_of(params, figures)}


def rows_of(params: dict, figures: dict) -> list:
    """Table rows from the figures (targets judged on the median)."""
    rows = []
    largest = params["worlds"][-1]
    for world in params["worlds"]:
        f = figures[f"mp4/{world}"]
        target = "< 1 s" if world == 65536 else None
        ok = statistics.median(f["seconds"]["total"]) < 1.0 if world == 65536 else None
        rows.append(row(f"planning, {world:,} ranks (dp{world // 4} x mp4)", f["seconds"]["total"], "s", target, ok))
    for world in params["worlds"]:
        s = figures[f"mp4/{world}"]["sizes"]
        grows = world > params["worlds"][0]
        rows.append(row(f"commit record per checkpoint, {world:,} ranks ({s['commit_record_file_entries']:,} file entries,"
                        f" {s['distinct_slices']} distinct slices)", [s["commit_record_bytes"]], "B",
                        "no growth beyond one entry per distinct slice" if grows else None,
                        False if grows and s["commit_record_file_entries"] > s["distinct_slices"] else None))
    big = figures[f"mp4/{largest}"]
    s = big["sizes"]
    rows.append(row(f"group info in one rank's file, {largest:,} ranks ({s['group_info_entries_per_rank']:,} ranks listed)",
                    [s["group_info_json_bytes_per_rank"]], "B"))
    rows.append(text_row(f"group info over all files of one checkpoint, {largest:,} ranks",
                         f"{s['group_info_entries_all_files']:,} rank entries (world x dp: grows as the square)"))
    rows.append(row(f"graph meta (once per run), {largest:,} ranks", [s["graph_meta_bytes"]], "B"))
    rows.append(row(f"planning without the commit record, {largest:,} ranks (dp{largest // 4} x mp4)",
                    [t - c for t, c in zip(big["seconds"]["total"], big["seconds"]["commit_record"])], "s"))
    k8 = figures[f"mp8_k8/{largest}"]
    rows.append(row(f"planning, {largest:,} ranks (dp{largest // 8} x mp8, optimizer shard 8; "
                    f"{k8['sizes']['distinct_slices']} distinct slices)", k8["seconds"]["total"], "s"))
    return rows


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return rows_of(suite["params"], suite["figures"])
