"""Planning at scale (no MPI): group info, the save plan and the per-checkpoint metadata for 8 ... 65,536 ranks.

For every simulated world size, with the seeds' Network (784-512-5120-5120-512-10, Momentum) on data
parallel x model_parallel 4 (the default layout grown by data parallelism) and on dp x mp8 with
optimizer shard 8, it times what planning a sharded checkpoint takes, as dsim builds it:
  replica_sets        every replica set once, a progression each (rank 0 puts them in the graph meta)
  group_info          one rank's group info (each rank computes its own, into its file's attributes)
  save_plan           every distinct slice once, with the replica sets that hold it
  graph meta, commit  the records as written, for one checkpoint
and sizes what a checkpoint carries: the commit record, the graph meta, the group info in every file. The
digest file (one content digest and size per rank: O(world) by nature, see dsim/checkpoint/record.py) is
timed and sized beside, not counted as planning: the committer writes it from the files' results; so are the
replica sets as lists of ranks (what a repair in the job and the last gasp plan with).
"""
from __future__ import annotations

import json
import statistics
import time

from dsim.checkpoint import record as rec
from dsim.checkpoint.group_info import group_info_attr, replica_ranges, replica_sets
from dsim.checkpoint.plan import commit_record, graph_meta, save_plan
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout

from .harness import row

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
    sets = replica_ranges(layout)
    t["replica_sets"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = group_info_attr(layout, 0)
    t["group_info_one_rank"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = save_plan(layout, specs, SLOTS)
    t["save_plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    meta = json.dumps(graph_meta("network", layout, specs, SLOTS), indent=1)
    t["graph_meta"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    per_rank = 4 * plan.elements_per_rank(0)  # replicas and mp peers write files of (nearly) the same size
    record = commit_record("network-1_60", "network", plan, 1, 60, 60, 1, time=time.time(),
                           nbytes=per_rank * layout.world_size)
    record["digests"] = {"file": rec.digests_name("network-1_60"), "sha256": "0" * 64}  # write_commit's pin
    commit = rec.dumps(record)
    t["commit_record"] = time.perf_counter() - t0
    t["total"] = sum(t.values())
    t0 = time.perf_counter()  # every replica set as a list of ranks (the repairs' and the last gasp's planning)
    as_lists = replica_sets(layout)
    lists_s = time.perf_counter() - t0
    assert sum(map(len, as_lists)) == layout.world_size
    written = {r: (per_rank, f"{r:064x}") for r in range(layout.world_size)}  # what the ranks report
    t0 = time.perf_counter()
    digests = rec.dumps(rec.digest_table("network-1_60", layout.world_size, written))
    digest_s = time.perf_counter() - t0
    gi_file = json.dumps({"format": "dsim-group-info/2", "rank": 0, "group_info": mine,
                          "layout": layout.to_dict()}) + "\n"
    return {"seconds": {**t, "digest_file": digest_s, "replica_sets_lists": lists_s}, "sizes": {
        "distinct_slices": len(plan.slices), "replica_sets": len(sets), "commit_record_bytes": len(commit),
        "commit_record_file_entries": len(record["files"]["ranks"]), "commit_record_slices": len(record["slices"]),
        "graph_meta_bytes": len(meta), "group_info_bytes_per_file": len(json.dumps(mine)),
        "group_info_json_bytes_per_rank": len(gi_file), "group_info_ranks_per_rank": len(range(mine["start"], mine["stop"], mine["step"])),
        "digest_file_bytes": len(digests)}}


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
        target = "<= 0.1 s" if world == 65536 else None
        ok = statistics.median(f["seconds"]["total"]) <= 0.1 if world == 65536 else None
        rows.append(row(f"planning, {world:,} ranks (dp{world // 4} x mp4)", f["seconds"]["total"], "s", target, ok))
    smallest = figures[f"mp4/{params['worlds'][0]}"]["sizes"]
    for world in params["worlds"]:
        s = figures[f"mp4/{world}"]["sizes"]
        grows = world > params["worlds"][0]
        rows.append(row(f"commit record per checkpoint, {world:,} ranks ({s['commit_record_file_entries']} file "
                        f"entry, {s['commit_record_slices']} slices for {s['distinct_slices']} distinct slices)",
                        [s["commit_record_bytes"]], "B",
                        "one entry per distinct slice, none per rank" if grows else None,
                        # only the numbers in it (world size, last ranks, bytes) get more digits: within 5 %
                        (s["commit_record_bytes"] <= 1.05 * smallest["commit_record_bytes"]
                         and s["commit_record_slices"] == s["distinct_slices"]
                         and s["commit_record_file_entries"] == 1) if grows else None))
    for world in params["worlds"]:
        s = figures[f"mp4/{world}"]["sizes"]
        rows.append(row(f"group info in each file and each group_info.json, {world:,} ranks "
                        f"({s['group_info_ranks_per_rank']:,} ranks as one progression)",
                        [s["group_info_bytes_per_file"]], "B",
                        "no growth with the world size" if world > params["worlds"][0] else None,
                        s["group_info_bytes_per_file"] <= 1.5 * smallest["group_info_bytes_per_file"]
                        if world > params["worlds"][0] else None))
    big = figures[f"mp4/{largest}"]
    s = big["sizes"]
    rows.append(row(f"group_info.json of one rank, {largest:,} ranks", [s["group_info_json_bytes_per_rank"]], "B"))
    rows.append(row(f"graph meta (once per run), {largest:,} ranks", [s["graph_meta_bytes"]], "B"))
    rows.append(row(f"digest file per checkpoint (one digest and size per rank: O(world)), {largest:,} ranks",
                    [s["digest_file_bytes"]], "B"))
    rows.append(row(f"digest file built (not planning), {largest:,} ranks", big["seconds"]["digest_file"], "s"))
    rows.append(row(f"planning without the commit record, {largest:,} ranks (dp{largest // 4} x mp4)",
                    [t - c for t, c in zip(big["seconds"]["total"], big["seconds"]["commit_record"])], "s"))
    if "replica_sets_lists" in big["seconds"]:  # (results stored before it was timed have none)
        rows.append(row(f"replica sets as lists of ranks (repairs, last gasp; not in the total), {largest:,} ranks",
                        big["seconds"]["replica_sets_lists"], "s"))
    k8 = figures[f"mp8_k8/{largest}"]
    rows.append(row(f"planning, {largest:,} ranks (dp{largest // 8} x mp8, optimizer shard 8; "
                    f"{k8['sizes']['distinct_slices']} distinct slices, commit record "
                    f"{k8['sizes']['commit_record_bytes'] / 1024:.1f} KiB)", k8["seconds"]["total"], "s"))
    return rows


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return rows_of(suite["params"], suite["figures"])
