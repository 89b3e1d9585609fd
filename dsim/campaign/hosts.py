"""A campaign on real hosts (--cluster HxS): the test cluster of network namespaces, its hostfiles, and host crashes.

Every job of the campaign (each combination's and the fault-free run's) runs on a dsim.cluster of H hosts of S
slots made for the campaign and torn down after it, however it ends: through the launch scripts on node1 (which
runs mpirun, as a cluster's first node does) with HOSTFILE (--map-by slot: node1's slots first), each host's
checkpoint files on its own disk (checkpoint.directory under the cluster's disk_path: node-local), the commit
records on node1's (rank 0's). A strategy with warm spares (arf) gets one more host, for the spares alone.

On a cluster a `node` failure is a host crash (the plan's kind `host`: Open MPI's daemon there, prted, and every
rank on it die at once), and --host-mtbf makes every host but node1 crash at that mean time between failures, on
top of the failures --mtbf draws. Never node1: its loss is the launch node's, with nothing left to watch the job.
With Open MPI 5.0 a host crash ends the whole job, whatever the scheme (docs/design/node-faults.md). Then:
- the crashed host's leftovers are killed and its disk is replaced by an empty one (cluster.replace_disk): a
  crashed machine's local disk is not assumed to survive, and its replacement comes with a disk of its own;
- the restart runs on the hosts left: a hostfile without the crashed host, every host's slots widened so that every
  rank fits (the ranks then sit on other hosts than their files: recovery reads those where they are, and takes a
  crashed host's from their replicas);
- the replaced machine is back for the jobs after that restart (a cluster's spare pool fills the hole by then);
- when the crashed host's disk held the only copy of some slices (a layout without replicas: data_parallel = 1), no
  committed checkpoint is complete and the resume says so (exit 2): the campaign removes the combination's
  checkpoints from every disk and starts it over from scratch, as a user would (the job's `started_over`).
A failure is planned for a rank, and a process learns its rank when it starts: so before every job the plan's host
crashes are aimed again, each at the first rank its host has under that job's hostfile (at another host left when
its own is out: the next one; only node1 left: its last rank, whose host failure on one host kills it alone).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

from ..faults import PLAN_POINTS
from .failures import Failure


def parse_shape(text: str) -> tuple[int, int]:
    """`4x2` -> (4 hosts, 2 slots each); ValueError naming the text."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--cluster: {text!r} is not HOSTSxSLOTS, e.g. 4x2 (4 hosts of 2 slots)")
    return int(m.group(1)), int(m.group(2))


def widened(hosts: int, ranks: int, slots: int) -> int:
    """Each host's slots in a hostfile of `hosts` hosts: its own, or more so that every rank fits."""
    return max(slots, math.ceil(ranks / hosts))


def placement(up: list, ranks: int, slots: int) -> dict:
    """{rank: host} of a job on the hosts `up` (in order) with --map-by slot: the first host's slots first."""
    per = widened(len(up), ranks, slots)
    return {r: up[r // per] for r in range(ranks)}


def hostfile_text(up: list, ranks: int, slots: int, spares: int = 0, spares_host: Optional[int] = None) -> str:
    """The hostfile of a job on the hosts `up`: every training rank fits, then the spares' own host."""
    per = widened(len(up), ranks, slots)
    lines = [f"node{h} slots={per}" for h in up]
    if spares and spares_host:
        lines.append(f"node{spares_host} slots={spares}")
    return "\n".join(lines) + "\n"


def target_host(rank: int, hosts: int, slots: int) -> int:
    """The host a drawn host crash of victim `rank` strikes: the rank's host on every host, or, when that is node1
    (mpirun's, never crashed), node 2 + rank mod (hosts - 1)."""
    h = rank // slots + 1
    return h if 1 < h <= hosts else 2 + rank % (hosts - 1)


def aimed_rank(host: int, up: list, ranks: int, slots: int) -> int:
    """The rank a crash of `host` is planned for in a job on the hosts `up`: the first on it; when it is out (or holds
    no rank), the first of the next host with ranks after it (node1 excluded); with node1 alone, its last rank."""
    where = placement(up, ranks, slots)
    others = sorted(set(where.values()) - {1})  # (a host the widened slots left empty holds no rank to aim at)
    if not others:
        return ranks - 1
    h = host if host in others else next((x for x in others if x > host), others[0])
    return min(r for r, x in where.items() if x == h)


def draw_host_crashes(seed: int, host_mtbf: float, duration: float, hosts: int, slots: int) -> list[Failure]:
    """Host crashes within `duration` of every host but node1 failing at `host_mtbf` each (a Poisson process of
    rate (hosts - 1) / host_mtbf): a host drawn among node2..nodeH, its first rank on every host the victim."""
    if hosts < 2:
        return []
    rng = np.random.default_rng([seed, 23])
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(host_mtbf / (hosts - 1)))
        if t >= duration:
            return out
        host = int(rng.integers(2, hosts + 1))
        out.append(Failure(round(t, 3), (host - 1) * slots, "host", PLAN_POINTS[rng.integers(len(PLAN_POINTS))]))


def on_cluster(plan: list, seed: int, host_mtbf: Optional[float], duration: float, hosts: int, slots: int) -> list:
    """The campaign's failures on a cluster: those drawn from --mtbf with `node` a host crash, and the host crashes
    of --host-mtbf, in time order."""
    mine = [replace(f, kind="host") if f.kind == "node" else f for f in plan]
    if host_mtbf:
        mine += draw_host_crashes(seed, host_mtbf, duration, hosts, slots)
    return sorted(mine, key=lambda f: f.offset)


def job_mtbf(mtbf: float, host_mtbf: Optional[float], hosts: int) -> float:
    """The mean time between the failures a job on the cluster meets: those of --mtbf and, with --host-mtbf, the
    crashes of its hosts but node1."""
    return 1 / (1 / mtbf + (hosts - 1) / host_mtbf) if host_mtbf and hosts > 1 else mtbf


class CampaignCluster:
    """The campaign's cluster: which hosts each job runs on, the hostfiles, the plan aimed, host crashes met."""

    def __init__(self, cluster, hosts: int, slots: int, ranks: int, spares_host: Optional[int] = None):
        self.cluster, self.hosts, self.slots, self.ranks = cluster, hosts, slots, ranks
        self.spares_host = spares_host
        self.training = list(range(1, hosts + 1))
        self.down: set = set()  # hosts out of the next job (crashed in the last one)
        self.seen: set = set()  # the plan's entries fired in jobs already ended (whose hosts were looked at)

    def describe(self) -> dict:
        return {"name": self.cluster.name, "hosts": self.hosts, "slots": self.slots,
                "spares_host": self.name(self.spares_host) if self.spares_host else None,
                "disk_path": self.cluster.disk_path}

    def name(self, host: int) -> str:
        return self.cluster.hostname(host)

    def checkpoints(self, combination: str) -> str:
        """The checkpoint directory of a combination's jobs: the same path on every host, on its own disk."""
        return f"{self.cluster.disk_path}/{combination}"

    def records(self, combination: str) -> Path:
        """Where node1 keeps a combination's checkpoints, the commit records among them, seen from here."""
        return self.cluster.disk(1) / combination

    def up(self) -> list:
        return [h for h in self.training if h not in self.down]

    def start(self, d: Path, n: int, spares: int = 0) -> tuple[dict, list]:
        """The environment of a job (the cluster's, HOSTFILE) on the hosts up, and those hosts; writes the hostfile.
        A new combination (n == 0) starts on every host, its disks as the last combination left them."""
        if n == 0:
            self.down, self.seen = set(), set()
        up = self.up()
        hostfile = d / f"hostfile-{n}"
        hostfile.write_text(hostfile_text(up, self.ranks, self.slots, spares, self.spares_host))
        return {**self.cluster.env(), "HOSTFILE": str(hostfile)}, up

    def aim(self, plan: list, up: list) -> list:
        """The plan with each host crash planned for the first rank of its host in a job on `up`."""
        return [replace(f, rank=aimed_rank(target_host(f.rank, self.hosts, self.slots), up, self.ranks, self.slots))
                if f.kind == "host" else f for f in plan]

    def command(self, cwd):
        return lambda argv: self.cluster.command(1, argv, cwd)

    def after_job(self, fired: list, job: dict) -> None:
        """Once a job has ended: the hosts its host crashes struck (the plan's markers fired since the last job ended:
        the striking rank, in this job's placement) are down for the next job, their leftovers killed and their disks
        replaced; whatever else is left on a host is killed too, and counted (job['left_running'])."""
        where = placement([number(h) for h in job["hosts"]], self.ranks, self.slots)
        new = [m for m in fired if m.get("index") not in self.seen]
        self.seen |= {m.get("index") for m in new}
        crashed = sorted({where.get(m.get("rank")) for m in new if m.get("kind") == "host"} - {1, None})
        for h in crashed:
            self.cluster.kill_host(h)
            self.cluster.replace_disk(h)
        left = self.clean([h for h in self.training + [self.spares_host] if h and h not in crashed])
        self.down = set(crashed)
        job.update(crashed=[self.name(h) for h in crashed], left_running={self.name(h): n for h, n in left.items()})

    def start_over(self, combination: str) -> None:
        """Remove a combination's checkpoints from every host's disk: none is complete any more (the only copy of some
        slices was on a crashed host's), and the next job starts from scratch."""
        for h in self.training:
            shutil.rmtree(self.cluster.disk(h) / combination, ignore_errors=True)

    def clean(self, hosts: list, wait: float = 2.0) -> dict:
        """Kill what a job left on the hosts (their keepers stay), after `wait` s for it to end; {host: count}."""
        until = time.monotonic() + wait
        while True:
            left = {h: [p for p in self.cluster.processes(h) if p != self.cluster.keepers[h]] for h in hosts}
            left = {h: p for h, p in left.items() if p}
            if not left or time.monotonic() > until:
                break
            time.sleep(0.2)
        return {h: len(self.cluster.kill_host(h)) for h in left}

    def gather(self, combination: str, into: Path) -> int:
        """Copy a combination's checkpoint files from every host's disk into one directory (the newest copy of a
        file held on several disks), for the comparisons; returns how many files."""
        chosen = {}
        for h in self.training:
            root = self.cluster.disk(h) / combination
            for path in root.rglob("*") if root.is_dir() else ():
                if path.is_file():
                    rel = path.relative_to(root)
                    if rel not in chosen or path.stat().st_mtime > chosen[rel].stat().st_mtime:
                        chosen[rel] = path
        for rel, path in chosen.items():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, into / rel)
        return len(chosen)

    def locate(self, path, combination: str) -> Optional[Path]:
        """A file named under node1's view of a combination's checkpoints (a commit record's shard), on the disk of
        whichever host holds it (the newest copy); None when no disk does."""
        rel = Path(path).relative_to(self.records(combination))
        found = [p for p in (self.cluster.disk(h) / combination / rel for h in self.up()) if p.is_file()]
        return max(found, key=lambda p: p.stat().st_mtime, default=None)

    def prune(self, combination: str, names: list) -> None:
        """Remove the files of the checkpoints named (paths under node1's view) from every host's disk."""
        for path in names:
            rel = Path(path).relative_to(self.records(combination))
            for h in self.training:
                (self.cluster.disk(h) / combination / rel).unlink(missing_ok=True)


def annotate(recs: list, jobs: list, ranks: int, slots: int) -> None:
    """Each failure's host (its rank's in the job it struck) and, if a restart met it, the hosts the restart ran on."""
    for r in recs:
        struck = next((j for j in reversed(jobs) if j["started"] <= r["time"]), None)
        if struck is None or "hosts" not in struck:
            continue
        up = [number(h) for h in struck["hosts"]]
        r["host"] = f"node{placement(up, ranks, slots)[r['rank'] % ranks]}"
        after = next((j for j in jobs if j["started"] > r["time"]), None)
        r["restart_hosts"] = after.get("hosts") if after and r["how"] == "restart" else None


def number(hostname: str) -> int:
    """node3 -> 3."""
    return int(hostname[len("node"):])


@contextlib.contextmanager
def made(s):
    """The campaign's CampaignCluster for the `with` block (None without --cluster), torn down however it is left; a
    strategy with warm spares gets a host more, theirs."""
    if not s.cluster:
        yield None
        return
    from ..cluster import Cluster
    n, slots = s.cluster
    spares = s.max_spares if any(x.spares for x in s.strategies) and s.max_spares else 0
    with Cluster(hosts=n + bool(spares), slots=slots, name=f"camp{os.getpid()}") as cluster:
        yield CampaignCluster(cluster, n, slots, s.ranks, n + 1 if spares else None)
