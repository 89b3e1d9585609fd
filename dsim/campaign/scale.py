"""What-if at scale (no MPI): the expected goodput of each strategy on 1,024 ... 65,536 ranks at a per-rank
MTBF, from the costs the campaign measured on its small job and the survivability of the layout.

A first-order model (Young/Daly's), per strategy s, with the job's MTBF M = per-rank MTBF / ranks:
- C: the cost of one periodic save (measured), tau: the interval, in seconds of work;
- D_s: the downtime of one failure (measured: median time from a failure to the next finished step);
- p_s: the chance a failure falls back to the periodic checkpoint. For periodic, always (p = 1). For the
  last gasp and the in-job repair, when every other holder of the victim's slices also fails within D_s
  (their in-memory copy is then gone too): p = (1 - exp(-D_s / per-rank MTBF))^(h - 1), with h the
  holders per slice of the layout at that size (dsim.checkpoint.survivability: its smallest fatal set);
- waste = C / tau + (D_s + p_s (tau / 2 + D_periodic [in-job only])) / M, tau = sqrt(2 C M / p_s) (Young);
  goodput = 1 - waste, at least 0.
With a per-node MTBF (`--node-mtbf`, nodes of `--ranks-per-node` consecutive ranks), whole servers fail too,
every rank on one at once: 1 / M = ranks / per-rank MTBF + nodes / per-node MTBF, and p_s is the mean of
both kinds' chances, weighted by their rates; for a node failure p = 1 when a replica set lies wholly on one
node at that size (survivability.nodes: the layout puts every holder of some slice on the same server),
else at most the chance that another node fails within D_s (1 - exp(-D_s / per-node MTBF)).
The layout at scale keeps the measured job's model parallel and pipeline stages (a stage's ranks stay
consecutive: dp grows inside each), and its holders per slice where dp admits them.
Step time and per-failure costs are taken as constant with the size (weak scaling); at scale restarts
grow slower, so the model favours restarts.
"""
from __future__ import annotations

import math

from ..checkpoint.survivability import survivability
from ..parallel.layout import ParallelLayout

RANKS = (1024, 4096, 16384, 65536)


def layout_at(ranks: int, model_parallel: int, per_slice: int, stages: int = 1) -> ParallelLayout:
    """The layout at `ranks` that keeps the measured job's model parallel, pipeline stages and `per_slice`
    holders per slice, or the most below it that divide dp (dp = ranks / (mp x stages), optimizer shard
    dp / holders: 3 holders of dp3 become 2 of dp512, never more than measured)."""
    dp = max(1, ranks // (model_parallel * stages))
    h = max(d for d in range(1, min(per_slice, dp) + 1) if dp % d == 0)
    return ParallelLayout(dp, model_parallel, dp // h, stages)


def at_size(ranks: int, model_parallel: int, per_slice: int, node_size: int = None,
            stages: int = 1) -> tuple[int, bool]:
    """Holders per slice of layout_at(...), from its minimal fatal sets, and (with node_size) whether losing a
    node of node_size consecutive ranks loses every holder of some slice."""
    s = survivability(layout_at(ranks, model_parallel, per_slice, stages), rows=0)
    fatal = node_size is not None and any(x["fatal_sets"] for x in s.nodes(node_size))
    return min(len(x) for x in s.fatal_sets), fatal


def job_mtbf(ranks: int, rank_mtbf: float, nodes: int = 0, node_mtbf: float = None) -> float:
    """The job's MTBF M: 1 / M = ranks / per-rank MTBF (+ nodes / per-node MTBF)."""
    return 1 / (ranks / rank_mtbf + (nodes / node_mtbf if node_mtbf else 0.0))


def expected(ranks: int, rank_mtbf: float, costs: dict, h: int, node_mtbf: float = None, nodes: int = 0,
             node_fatal: bool = False) -> dict:
    """Expected goodput per strategy at `ranks` ranks; costs: {strategy: {"save_s", "down_s"}} (+ "periodic");
    with node_mtbf, `nodes` servers fail too, each losing a whole replica set when node_fatal."""
    m = job_mtbf(ranks, rank_mtbf, nodes, node_mtbf)
    rank_rate, node_rate = ranks / rank_mtbf, nodes / node_mtbf if node_mtbf else 0.0
    out = {}
    d_restart = costs.get("periodic", {}).get("down_s")
    for name, c in costs.items():
        save, down = c["save_s"], c["down_s"]
        if save is None or down is None:
            out[name] = None
            continue
        p = 1.0
        if name != "periodic":
            p_node = 1.0 if node_fatal else (1 - math.exp(-down / node_mtbf)) if node_rate else 0.0
            p = (rank_rate * (1 - math.exp(-down / rank_mtbf)) ** (h - 1) + node_rate * p_node) * m
        tau = math.sqrt(2 * save * m / p) if p > 0 else math.inf
        extra = (d_restart or 0.0) if name not in ("periodic", "ttp") else 0.0
        # C / tau written as sqrt(C p / 2M): 0, not 0 / 0, for a save that costs nothing (async: the step it
        # starts in stalls no longer than the others) and for p = 0
        waste = math.sqrt(save * p / (2 * m)) + (down + p * (min(tau, 1e18) / 2 + extra)) / m
        out[name] = {"goodput_fraction": max(0.0, 1 - waste), "interval_s": tau, "fallback": p}
    return out


def table(rank_mtbf: float, costs: dict, model_parallel: int, per_slice: int, sizes=RANKS, node_mtbf: float = None,
          node_size: int = 4, stages: int = 1) -> list[dict]:
    """One row per size: job MTBF, holders per slice, (with node_mtbf) whether losing a node loses a whole
    replica set, and each strategy's expected figures; the measured job's pipeline stages kept."""
    rows = []
    for n in sizes:
        h, fatal = at_size(n, model_parallel, per_slice, node_size if node_mtbf else None, stages)
        nodes = -(-n // node_size) if node_mtbf else 0
        row = {"ranks": n, "job_mtbf_s": job_mtbf(n, rank_mtbf, nodes, node_mtbf), "holders_per_slice": h,
               "strategies": expected(n, rank_mtbf, costs, h, node_mtbf, nodes, fatal)}
        if node_mtbf:
            row.update(nodes=nodes, node_fatal=fatal)
        rows.append(row)
    return rows
