"""Real hosts: the default run on H hosts x S ranks against 1 host x H*S, links as made and shaped; bytes between hosts.

dsim.cluster makes H hosts of network, mount and UTS namespaces on this machine, joined by a bridge (docs/cluster.md).
Each repeat runs, in a rotating order, three jobs of bench.cluster_ranks (the default config, no checkpoints):
all ranks on node1 (1 host: shared memory between every rank), `--hostfile --map-by slot` over the H hosts with
the links as made, and the same with every host's link shaped with tc tbf to a rate (10 Gbit/s). Each job reports
its time per step and the bytes each host sent from the end of the first step to the end of training; the rows
give the times, their ratios to the one host's in the same repeat (min and median over the repeats), and the bytes
crossing hosts per step (every host's sent bytes: what one sends another receives) against the volume the layout's
collectives must move between hosts.

That volume, from the layout and the hosts MPI reported: every step each data-parallel group sums each rank's
gradient buffer (its model-parallel slices and the loss, N bytes) with dsim.parallel.groups.sum_chunks: an
all-to-all then an all-gather of N/p chunks, so each rank sends 2N/p to every other member (a group of 2: MPI's
Allreduce, N each way, what any all-reduce of two must move). The pairs on different hosts count. The model-parallel
sums (activations, input gradients) are not counted: with --map-by slot every model-parallel group of these runs
is on one host (the suite checks it); the measured bytes hold TCP/IP headers and acknowledgements besides.

Where namespaces cannot be made (not root, no iproute2) the suite's row says why and the others run.
"""
from __future__ import annotations

import json
import os
import shutil

from dsim.build import resolve_layout
from dsim.cluster import Cluster, leftovers, unavailable
from dsim.config import load_config
from dsim.nn import create_network
from dsim.parallel.layout import holds, mp_slice

from .harness import ROOT, mpirun, row, scratch_dir, text_row

NAME = "cluster"
TITLE = "Real hosts (dsim.cluster): time per step on H hosts / 1 host, links as made and shaped; bytes between hosts"
CONFIG = ROOT / "configs" / "default.yaml"
SIZES = {"full": {"hosts": 2, "slots": 4, "steps": 20, "repeats": 5, "rate": "10gbit", "timeout": 900,
                  "overrides": []},
         "quick": {"hosts": 2, "slots": 4, "steps": 10, "repeats": 3, "rate": "10gbit", "timeout": 600,
                   "overrides": ["model.hidden=[512,2048,2048,512]"]},
         "toy": {"hosts": 2, "slots": 1, "steps": 4, "repeats": 1, "rate": "10gbit", "timeout": 300,
                 "overrides": ["model.hidden=[16,32,32,16]", "parallel.data_parallel=2", "parallel.model_parallel=1"]}}


def variants(params: dict) -> list[str]:
    h, s = params["hosts"], params["slots"]
    return [f"1 host x {h * s}", f"{h} hosts x {s}", f"{h} hosts x {s}, {params['rate']}"]


def run(params: dict, workdir, opts) -> dict:
    why = unavailable()
    if why:
        return {"params": params, "raw": {"unavailable": why}, "figures": {}, "rows": summarize(params, {
            "unavailable": why})["rows"]}
    name = f"bench{os.getpid()}"
    n = params["hosts"] * params["slots"]
    one, hosts, shaped = variants(params)
    raw = {"cluster": name, "repeats": []}
    with Cluster(hosts=params["hosts"], slots=params["slots"], name=name) as cluster:
        options = {one: ["--host", f"node1:{n}"], hosts: cluster.mpirun_args("slot"),
                   shaped: cluster.mpirun_args("slot")}
        for rep in range(params["repeats"]):
            todo = variants(params)
            todo = todo[rep % 3:] + todo[:rep % 3]
            raw["repeats"].append({"order": todo})
            for v in todo:
                for h in range(1, params["hosts"] + 1):
                    if v == shaped:
                        cluster.shape(h, params["rate"])
                    else:
                        cluster.unshape(h)
                d = scratch_dir(workdir, f"{NAME}-{rep}")
                try:
                    args = ["--config", CONFIG, "--steps", params["steps"], "--dir", d / "run", "--out",
                            d / "result.json", *[a for o in params["overrides"] for a in ("--set", o)]]
                    log = opts.logdir / f"{NAME}-{rep}-{variants(params).index(v)}.log"
                    mpirun(n, "bench.cluster_ranks", args, params["timeout"], log, options[v],
                           wrap=lambda cmd: cluster.command(1, cmd, ROOT), env=cluster.env())
                    raw["repeats"][-1][v] = json.loads((d / "result.json").read_text())
                finally:
                    shutil.rmtree(d, ignore_errors=True)
                print(f"bench: cluster repeat {rep + 1}/{params['repeats']} {v}: "
                      f"{1000 * raw['repeats'][-1][v]['step_s']:.1f} ms/step", flush=True)
    raw["left_behind"] = leftovers(name)
    return summarize(params, raw)


def volume(params: dict, hosts: list[str]) -> dict:
    """Bytes the layout's collectives must move between hosts per step, ranks on `hosts` (see the docstring)."""
    cfg = load_config(CONFIG, params["overrides"])
    layout = resolve_layout(cfg, len(hosts))
    m = cfg.model
    specs = create_network(m.name, m.hidden, vars(m.transformer), cfg.parallel.vocab_emb_dp).specs
    itemsize = 8 if cfg.dtype == "float64" else 4
    mp_across = {tuple(g) for g in map(layout.mp_group, range(len(hosts))) if len({hosts[q] for q in g}) > 1}
    total = 0
    for r in range(len(hosts)):
        n = itemsize * (1 + sum(_size(mp_slice(s, layout, r).extents) for s in specs if holds(s, layout, r)))
        group = layout.dp_group(r)
        total += sum(2 * n // len(group) for q in group if hosts[q] != hosts[r])
    return {"bytes": total, "layout": layout.describe(), "mp_groups_across_hosts": len(mp_across)}


def _size(extents) -> int:
    out = 1
    for e in extents:
        out *= e
    return out


def summarize(params: dict, raw: dict) -> dict:
    if "unavailable" in raw:
        return {"params": params, "raw": raw, "figures": {},
                "rows": [text_row("hosts made of namespaces", f"not measured: {raw['unavailable']}")]}
    one, hosts, shaped = variants(params)
    reps = raw["repeats"]
    figures = {"step_s": {v: [r[v]["step_s"] for r in reps] for v in (one, hosts, shaped)},
               "crossing_bytes_per_step": {v: [sum(b["tx"] for b in r[v]["bytes"].values()) / r[v]["measured_steps"]
                                               for r in reps] for v in (one, hosts, shaped)}}
    placed = reps[0][hosts]["hosts"]
    want = volume(params, placed)
    figures["volume"] = {**want, "hosts": placed}
    rows = [row(f"{v}: time per step", [1000 * s for s in figures["step_s"][v]], "ms") for v in (one, hosts, shaped)]
    for v in (hosts, shaped):
        ratios = [a / b for a, b in zip(figures["step_s"][v], figures["step_s"][one])]
        figures[f"{v} / {one}"] = ratios
        rows.append(row(f"{v} / {one}", ratios, "x"))
    for v in (hosts, shaped):
        rows.append(row(f"{v}: bytes crossing hosts per step", figures["crossing_bytes_per_step"][v], "B"))
    measured = figures["crossing_bytes_per_step"][hosts] + figures["crossing_bytes_per_step"][shaped]
    figures["crossing_over_volume"] = [b / want["bytes"] for b in measured]
    rows.append(row(f"bytes crossing / the data-parallel sums' volume ({want['bytes'] / 2**20:.1f} MiB a step; "
                    f"{want['mp_groups_across_hosts']} model-parallel group(s) across hosts)",
                    figures["crossing_over_volume"], "x"))
    rows.append(row(f"{one}: bytes leaving node1 per step", figures["crossing_bytes_per_step"][one], "B"))
    return {"params": params, "figures": figures, "raw": raw, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["raw"])["rows"]
