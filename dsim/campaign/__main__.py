"""Fault campaigns on real jobs: which recovery scheme wins under a given failure rate.

    $ python -m dsim.campaign --mtbf 30s --duration 10m --faults kill,uce,corrupt \\
          --strategy periodic,ttp,arf --save-every 10,50 --seed 1 -o campaign --set model.hidden=[64,128,128,64]

Every strategy x interval for --duration each, under the same failures, then a fault-free run; prints
the table, writes REPORT_DIR/report.json and REPORT_DIR/timeline.png (with matplotlib). Ctrl-C
stops the running job (and everything it started) and keeps the report of the combinations that finished.
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ..checkpoint.survivability import survivability
from ..cluster import ClusterError
from ..config import ConfigError, load_config
from ..parallel.layout import ParallelLayout
from . import analysis, failures, hosts, jobs, report, runner, scale, strategies
from .failures import PLAN_KINDS, parse_duration


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m dsim.campaign", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML config of the job (default: configs/default.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every job, e.g. --set model.hidden=[64,128,128,64] (repeatable)")
    p.add_argument("--mtbf", default="30s", help="mean time between failures of the job (default 30s)")
    p.add_argument("--duration", default="2m", help="wall-clock budget of each combination and of the fault-free run")
    p.add_argument("--faults", default="kill", help=f"kinds of failure drawn, among {','.join(PLAN_KINDS)} (default kill)")
    p.add_argument("--strategy", default="periodic,ttp,arf",
                   help=f"schemes to compare, among {','.join(strategies.STRATEGIES)} (default periodic,ttp,arf)")
    p.add_argument("--save-every", default="10,50", help="periodic checkpoint intervals in steps (default 10,50)")
    p.add_argument("--seed", type=int, default=1, help="seed of the failure process (default 1)")
    p.add_argument("--ranks", type=int, help="training ranks (RANK_SIZE of the launch scripts; default 8, on a cluster "
                                             "its hosts x slots)")
    p.add_argument("--spares", type=int, default=2, help="at most this many warm spares for arf (default 2)")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks a `node` failure kills together: ranks 0..N-1 are the first node (default 4; on a "
                        "cluster its slots: a node failure crashes a host)")
    p.add_argument("--cluster", metavar="HOSTSxSLOTS",
                   help="run every job on a test cluster of network namespaces made for the campaign (dsim.cluster, "
                        "as root), e.g. 4x2: node-local checkpoints; a node failure crashes a host other than node1, "
                        "the restart runs on the hosts left (default: every job on this host)")
    p.add_argument("--peer-copy-every", type=int, default=strategies.PEER_COPY_EVERY,
                   help="the peer strategy's tft.peer_copy_every: steps between two copies of each rank's state into "
                        f"another host's memory (default {strategies.PEER_COPY_EVERY})")
    p.add_argument("--hang-timeout", default="10s",
                   help="with hang, stuck, deadlock or unmatched failures: tft.hang_timeout of every job, how long "
                        "a step may go on before a frozen or stuck rank is killed (default 10s; a deadlock is broken "
                        "after twice that)")
    p.add_argument("--straggler-factor", type=float, default=3.0,
                   help="with slow failures: tft.straggler_factor of every job, with tft.straggler_evict: a rank that "
                        "computes its steps this many times slower than the others of its stage, for 5 of its steps, "
                        "is killed and met as a dead one (default 3; 0: not watched, a slow rank stays slow until a "
                        "restart)")
    p.add_argument("--slowdown", type=float, default=4.0,
                   help="with slow failures: how many times slower the victim computes from then on (default 4)")
    p.add_argument("--sdc-check-every", type=int, default=10,
                   help="with sdc failures: tft.sdc_check_every of every job, steps between two comparisons of the "
                        "replicas (default 10)")
    p.add_argument("--rank-mtbf", default="1y", help="per-rank MTBF of the what-if at scale (default 1y)")
    p.add_argument("--node-mtbf", help="per-node MTBF of the what-if at scale: whole servers of --ranks-per-node ranks "
                                       "fail too (default: off, rank failures only)")
    p.add_argument("--host-mtbf", help="with --cluster: every host but node1 crashes at this mean time between failures "
                                       "each, in the jobs, beside the failures of --mtbf (default: off)")
    p.add_argument("-o", "--output", required=True, metavar="REPORT_DIR", help="a new (or empty) directory")
    return p.parse_args(argv)


def settings_from(args) -> tuple:
    """Validated settings, or ValueError / ConfigError with one line."""
    def durations(opt, text):
        try:
            return parse_duration(text)
        except ValueError as e:
            raise ValueError(f"{opt}: {e}") from None
    mtbf, duration, rank_mtbf = (durations("--mtbf", args.mtbf), durations("--duration", args.duration),
                                 durations("--rank-mtbf", args.rank_mtbf))
    node_mtbf = durations("--node-mtbf", args.node_mtbf) if args.node_mtbf else None
    host_mtbf = durations("--host-mtbf", args.host_mtbf) if args.host_mtbf else None
    if host_mtbf and args.cluster is None:
        raise ValueError("--host-mtbf crashes the hosts of a cluster: it needs --cluster")
    shape = hosts.parse_shape(args.cluster) if args.cluster is not None else None
    if shape:
        if args.ranks_per_node is not None and args.ranks_per_node != shape[1]:
            raise ValueError(f"--ranks-per-node {args.ranks_per_node}: on a cluster a node is a host, of --cluster's "
                             f"{shape[1]} slots (leave it out)")
        args.ranks_per_node = shape[1]
        args.ranks = shape[0] * shape[1] if args.ranks is None else args.ranks
        if not 1 <= args.ranks <= shape[0] * shape[1]:
            raise ValueError(f"--ranks {args.ranks} must fit --cluster {args.cluster}'s {shape[0] * shape[1]} slots")
    args.ranks = 8 if args.ranks is None else args.ranks
    args.ranks_per_node = 4 if args.ranks_per_node is None else args.ranks_per_node
    if node_mtbf and args.ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node must be >= 1 with --node-mtbf, got {args.ranks_per_node}")
    hang_timeout = durations("--hang-timeout", args.hang_timeout)
    kinds = [k.strip() for k in args.faults.split(",")]
    bad = [k for k in kinds if k not in PLAN_KINDS]
    if bad or not kinds:
        raise ValueError(f"--faults: unknown kind {bad[0]!r} (known: {', '.join(PLAN_KINDS)})")
    try:
        intervals = sorted({int(x) for x in args.save_every.split(",")})
    except ValueError:
        raise ValueError(f"--save-every: {args.save_every!r} is not a list of step counts, e.g. 10,50") from None
    if not intervals or intervals[0] < 1:
        raise ValueError(f"--save-every: intervals must be >= 1, got {args.save_every!r}")
    if args.ranks < 1 or args.spares < 0:
        raise ValueError("--ranks must be >= 1 and --spares >= 0")
    if "sdc" in kinds and args.sdc_check_every < 1:
        raise ValueError(f"--sdc-check-every must be >= 1 step, got {args.sdc_check_every}")
    if "slow" in kinds and not args.slowdown > 1:
        raise ValueError(f"--slowdown must be a number > 1, got {args.slowdown:g}")
    if "slow" in kinds and args.straggler_factor != 0 and not args.straggler_factor > 1:
        raise ValueError(f"--straggler-factor must be a number > 1 (or 0: not watched), got {args.straggler_factor:g}")
    if "node" in kinds and (args.ranks_per_node < 1 or args.ranks % args.ranks_per_node):
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} must divide --ranks {args.ranks} "
                         "(the nodes a `node` failure kills are of one size)")
    if args.peer_copy_every < 1:
        raise ValueError(f"--peer-copy-every must be >= 1 step, got {args.peer_copy_every}")
    chosen = [strategies.with_peer_copy_every(x, args.peer_copy_every) for x in strategies.parse(args.strategy)]
    if shape and shape[0] < 2 and ("node" in kinds or "host" in kinds or host_mtbf):
        raise ValueError(f"--cluster {args.cluster}: a host crash needs a host other than node1 (mpirun's): "
                         "2 hosts or more")
    if args.config and not Path(args.config).is_file():
        raise ValueError(f"--config: file not found: {args.config}")
    load_config(args.config, args.overrides)  # a bad config is one line here, not in every job's log
    for s in chosen:
        why = strategies.unavailable(s, args.config, args.overrides)
        if why:
            raise ValueError(why)
    out = Path(args.output).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"-o {args.output}: exists and is not an empty directory (a campaign never writes over one)")
    if shape:
        from ..cluster import unavailable
        why = unavailable()
        if why:
            raise ValueError(f"--cluster: no cluster of network namespaces here: {why}")
    return runner.Settings(out, args.config, args.overrides, mtbf, duration, kinds, chosen, intervals, args.seed,
                           args.ranks, args.spares, args.ranks_per_node,
                           hang_timeout if {"hang", "stuck", "deadlock", "unmatched"} & set(kinds) else None,
                           args.sdc_check_every if "sdc" in kinds else None, node_mtbf,
                           (args.straggler_factor or None) if "slow" in kinds else None,
                           args.slowdown if "slow" in kinds else None, shape,
                           args.peer_copy_every if any(x.name == "peer" for x in chosen) else None,
                           host_mtbf), rank_mtbf


def analyse(raw: dict, ref, ref_losses: dict) -> dict:
    """A finished combination's row: summary figures, and (once the fault-free run is done) the losses and the
    final state against it."""
    row = {k: v for k, v in raw.items() if k != "events"}
    # (on a cluster, a job after one that found no complete checkpoint started over from scratch)
    over = [j["started"] for prev, j in zip(raw["jobs"], raw["jobs"][1:]) if prev.get("started_over")]
    row.update(analysis.summarize(raw["failures"], raw["events"], raw["start"], raw["end"], raw["save_every"],
                                  ref["fault_free_rate"] if ref else None, over))
    row["failures_injected"] = raw["fired"]  # the campaign's count (plan markers); seen is the job's own
    row["unrecovered"] = raw["fired"] - row["survived"]
    if ref is None:
        row["losses"] = row["final_state"] = {"equal": None, "why": "the fault-free run did not run (interrupted)"}
    else:
        row["losses"] = analysis.losses_equal(raw["events"], raw["end"], ref_losses)
        row["final_state"] = runner.final_state(raw, ref)
    return row


def furthest(raws: list) -> int:
    """The highest global step any combination logged within its budget."""
    return max((e["global_step"] for r in raws for e in r["events"] if e["event"] == "step" and e["time"] <= r["end"]),
               default=0)


def what_if(rows: list, ref: dict, rank_mtbf: float, events: list, node_mtbf: float = None, node_size: int = 4) -> dict:
    """The model at scale from the measured costs (scale.py)."""
    begin = next((e for e in events if e["event"] == "train_begin"), {})
    layout = begin.get("layout") or {"data_parallel": 2, "model_parallel": 4, "optimizer_shard": 1}
    per_slice = max(1, layout["data_parallel"] // layout["optimizer_shard"])
    costs = {}
    for name in dict.fromkeys(r["strategy"] for r in rows[1:]):
        mine = [r for r in rows[1:] if r["strategy"] == name]
        # a rank's failure and its scheme's recovery (an sdc is rolled back alike by every scheme, and a slow rank's
        # recovery counts the steps it trained slow before it was killed: neither is a failure's downtime)
        downs = [f["recovery_s"] for r in mine for f in r["failures"]
                 if f["recovered"] and f["kind"] not in ("sdc", "slow")]
        saves = [r["save_s"] for r in mine if r.get("save_s") is not None] or [ref.get("save_s")]
        costs[name] = {"save_s": sorted(saves)[len(saves) // 2], "down_s": analysis.percentile(downs, 50)}
    stages = layout.get("pipeline_stage", 1)
    return {"rank_mtbf_s": rank_mtbf, "node_mtbf_s": node_mtbf, "ranks_per_node": node_size,
            "model_parallel": layout["model_parallel"], "pipeline_stage": stages, "holders_measured": per_slice,
            "costs": costs, "rows": scale.table(rank_mtbf, costs, layout["model_parallel"], per_slice,
                                                node_mtbf=node_mtbf, node_size=node_size, stages=stages)}


def node_loss(events: list):
    """The survivability of the measured job's layout (its replica sets), for the nodes a `node` failure loses;
    None when the fault-free run logged no layout."""
    begin = next((e for e in events if e["event"] == "train_begin" and e.get("layout")), None)
    return survivability(ParallelLayout(**begin["layout"])) if begin else None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        s, rank_mtbf = settings_from(args)
    except (ValueError, ConfigError) as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        return 2
    s.out.mkdir(parents=True, exist_ok=True)
    from .. import guard
    guard.set_run_dir(s.out)
    signal.signal(signal.SIGTERM, _interrupt)
    plan = failures.draw(s.seed, s.mtbf, s.duration, s.kinds, s.ranks)
    if s.cluster:  # a node failure crashes a host; --host-mtbf crashes hosts too
        plan = hosts.on_cluster(plan, s.seed, s.host_mtbf, s.duration, *s.cluster)
    doc = {"format": "dsim-campaign/1", "command": ["python", "-m", "dsim.campaign", *(argv or sys.argv[1:])],
           "settings": {"mtbf_s": s.mtbf, "duration_s": s.duration, "faults": s.kinds, "seed": s.seed,
                        "strategies": [x.name for x in s.strategies], "save_every": s.intervals, "ranks": s.ranks,
                        "ranks_per_node": s.ranks_per_node, "hang_timeout_s": s.hang_timeout,
                        "sdc_check_every": s.sdc_check_every, "node_mtbf_s": s.node_mtbf,
                        "straggler_factor": s.straggler_factor, "slowdown": s.slowdown,
                        "config": str(s.config_file), "overrides": s.overrides,
                        **({"peer_copy_every": s.peer_copy_every} if s.peer_copy_every else {})},
           "plan": failures.to_dicts(plan), "combinations": [], "finished": False}
    raws, rows, events_of, code = [], [], {}, 0
    if s.cluster:
        doc["settings"].update(cluster=f"{s.cluster[0]}x{s.cluster[1]}", host_mtbf_s=s.host_mtbf)
    try:
        with hosts.made(s) as s.hosts:  # (no cluster without --cluster) torn down however this ends
            if s.hosts:
                signal.signal(signal.SIGTERM, _interrupt)  # (the cluster's handler ends the block without a report)
                doc["cluster"] = s.hosts.describe()
            rows, code = run_all(s, plan, doc, raws, events_of)
    except ClusterError as e:
        print(f"dsim: error: the cluster: {e}", file=sys.stderr)
        code = 1
    if not rows:
        rows = doc["combinations"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # every job is stopped: a second Ctrl-C must not lose the report
    finish(s, doc, rows, events_of, rank_mtbf)
    return code


def run_all(s, plan: list, doc: dict, raws: list, events_of: dict) -> tuple[list, int]:
    """Every combination, then the fault-free run: (the rows, the exit status); Ctrl-C or a campaign error stops it
    with the combinations that finished in doc."""
    rows, code = [], 0
    try:
        for strategy in s.strategies:
            for k in s.intervals:
                raw = runner.run_combination(s, strategy, k, plan, say)
                raws.append(raw)
                events_of[raw["dir"]] = raw["events"]
                row = analyse(raw, None, {})
                doc["combinations"].append(row)
                report.write_json(s.out, doc)
                tail = raw["settled"] - raw["end"]
                say(f"campaign: {strategy.name}-every{k}: {row['steps']} steps, {row['failures_injected']} failure(s), "
                    f"{row['survived']} survived" + (f" (the job ran {tail:.0f} s past the budget to recover)"
                                                     if tail >= 1 else ""))
        keep = {c.global_step for c in (runner.newest_committed_periodic(Path(raw["dir"]) / "run" / "checkpoints")
                                        for raw in raws) if c is not None}
        # as far as any combination got in its budget, and past every final checkpoint (one may have been
        # committed while a combination recovered after its budget)
        ref = runner.run_reference(s, runner.gcd(s.intervals), max([furthest(raws), *keep]), say, keep)
        doc["fault_free"] = ref
        events_of[ref["dir"]] = analysis.read_events(Path(ref["dir"]) / "run" / "metrics.jsonl")
        ref_losses = runner.reference_losses(ref)
        doc["combinations"] = [analyse(raw, ref, ref_losses) for raw in raws]
        rows = [ref, *doc["combinations"]]
        doc["finished"] = True
    except KeyboardInterrupt:
        jobs.sweep(f"{s.tag}-", prefix=True)  # a job being started as Ctrl-C came
        say(f"campaign: interrupted; every job stopped; the report keeps the {len(doc['combinations'])} "
            "combination(s) that finished")
        code = 130
    except runner.CampaignError as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        code = 1
    return rows, code


def finish(s, doc: dict, rows: list, events_of: dict, rank_mtbf: float) -> None:
    """Young/Daly, the what-if, the picture, report.json and the table, from whatever finished."""
    ref = doc.get("fault_free")
    lines = report.table(rows) if rows else []
    if ref is not None and len(rows) > 1:
        # on a cluster the jobs meet the host crashes of --host-mtbf too
        mtbf = hosts.job_mtbf(s.mtbf, s.host_mtbf, s.cluster[0]) if s.cluster else s.mtbf
        lines += ["", f"checkpoint interval: measured best beside Young/Daly (MTBF {mtbf:.0f} s"
                      + (", host crashes included" if mtbf != s.mtbf else "") + "):"]
        lines += report.young_daly(rows, mtbf, ref)
        doc["what_if"] = what_if(rows, ref, rank_mtbf, events_of.get(ref["dir"], []), s.node_mtbf, s.ranks_per_node)
        nodes = (f", per-node MTBF {args_time(s.node_mtbf)} (nodes of {s.ranks_per_node} ranks)" if s.node_mtbf
                 else "")
        lines += ["", f"what-if at scale (no MPI; per-rank MTBF {args_time(rank_mtbf)}{nodes}, first-order model "
                      "from the costs above): expected goodput and periodic interval"]
        lines += report.scale_lines(doc["what_if"]["rows"], args_time(rank_mtbf))
        survival = node_loss(events_of.get(ref["dir"], [])) if "node" in s.kinds else None
        if survival is not None:
            doc["node_loss"] = survival.nodes(s.ranks_per_node)
            lines += ["", f"a lost node ({s.ranks_per_node} ranks; the last gasp and the repair in the job need a "
                          "rank of every replica set left):", *(f"  {x}" for x in survival.node_lines(s.ranks_per_node))]
        steps = {r["final_state"].get("global_step") for r in rows[1:]}
        ref["pruned_checkpoints"] = ref.get("pruned_while_running", 0) + runner.prune_reference(ref, steps)
    if s.straggler_factor:  # what the straggler watch killed, slow or not
        lines += ["", f"straggler watch (tft.straggler_factor {s.straggler_factor:g}, a slow failure {s.slowdown:g}x "
                      "slower): ranks killed as stragglers, and of them healthy (a false alarm, paid as a failure):"]
        lines += [f"  {r['strategy']}-every{r['save_every']}: {r['stragglers_evicted']} killed, {r['healthy_evicted']} "
                  "healthy" for r in rows if "stragglers_evicted" in r]  # (not the fault-free run: no watch)
    png = report.timeline(s.out, rows, events_of) if rows else None
    doc["timeline"] = str(png) if png else None
    doc["table"] = lines
    path = report.write_json(s.out, doc)
    print("\n".join(lines))
    print(f"wrote {shown(path)}" + (f" and {shown(png)}" if png else "" if not rows else
                             " (no timeline.png: matplotlib is not installed, pip install dsim[plot])"))


def shown(path) -> str:
    """A path as the user gave it: relative to the working directory when under it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def args_time(seconds: float) -> str:
    for unit, n in (("y", 365 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"


def say(message: str) -> None:
    print(message, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    from .. import guard
    guard.run(main)  # a bug is one line (its traceback in REPORT_DIR/logs); every job was stopped on the way out
