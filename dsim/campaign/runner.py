"""Running a campaign: each combination (strategy x checkpoint interval) until its wall-clock budget is spent,
restarting its jobs through the launch scripts as its strategy says; then the fault-free reference run.

The fault-free run comes last: it must get as far as the furthest combination, for the comparisons.
A combination's jobs share one output directory (metrics.jsonl accumulates over restarts, as a user's
would) and one fault plan (dsim.faults, fault.kind: plan): each planned failure strikes once, at its time,
in whichever job is then running; when the job ends before the budget is spent (a failure it does not
heal, or one it could not), the next is started at once with `launch/run_parallel_recover_ckpt.sh
--repair` (the newest usable committed checkpoint, periodic or last gasp), or from scratch when there is
none yet. When the budget is spent, no further failure strikes (the campaign claims the plan's entries not
fired yet) and the job goes on until every failure struck within the budget has been recovered, for at most
TAIL seconds, so that a failure shortly before the end is not counted unrecovered for want of time; the
figures of goodput count the budget only. Then the running job is stopped.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..checkpoint import load_checkpoint, progression
from ..checkpoint.catalog import find_checkpoint_dirs, read_index, scan
from ..checkpoint.errors import CheckpointError
from ..checkpoint.format import read_file
from ..checkpoint.loader import param_dict_of
from ..faults import DEATH_KINDS, PLAN_ENV
from ..parallel.layout import Slice
from . import analysis, failures as failure_process, hosts as hosts_of
from .jobs import ROOT, Job
from .strategies import Strategy

SAVE = "run_parallel_save_ckpt.sh"
RECOVER = "run_parallel_recover_ckpt.sh"
GRACE = 30.0  # a job's timeout: the combination's remaining budget (and TAIL) and this
TAIL = 60.0  # after the budget, the most a combination waits for the failures struck in it to be recovered


class CampaignError(Exception):
    """A campaign that cannot go on (the fault-free run failed, a job refused its config, ...)."""


DEADLOCK_FACTOR = 2  # a campaign's tft.deadlock_timeout, times its hang timeout


@dataclass
class Settings:
    out: Path
    config: Optional[str]
    overrides: list
    mtbf: float
    duration: float
    kinds: list
    strategies: list
    intervals: list
    seed: int
    ranks: int = 8
    max_spares: int = 2
    ranks_per_node: int = 4  # the ranks a `node` failure kills together
    hang_timeout: Optional[float] = None  # tft.hang_timeout of every job (with hang, stuck, deadlock, unmatched failures)
    sdc_check_every: Optional[int] = None  # tft.sdc_check_every of every job (with `sdc` failures)
    node_mtbf: Optional[float] = None  # per-node MTBF of the what-if at scale (None: rank failures only)
    straggler_factor: Optional[float] = None  # tft.straggler_factor (and evict) of every job (with `slow` failures)
    slowdown: Optional[float] = None  # how many times slower a `slow` failure makes its victim
    cluster: Optional[tuple] = None  # (hosts, slots) with --cluster: every job on the test cluster (hosts.py)
    peer_copy_every: Optional[int] = None  # the peer scheme's tft.peer_copy_every (--peer-copy-every)
    host_mtbf: Optional[float] = None  # with a cluster: each host but node1 crashes at this MTBF (--host-mtbf)
    hosts: Optional[object] = None  # the campaign's hosts.CampaignCluster while it runs on one
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{int(time.time())}")

    @property
    def config_file(self) -> Path:
        return Path(self.config).resolve() if self.config else ROOT / "configs" / "default.yaml"


def job_args(s: Settings, save_every: int, extra=(), keep: int = 5, checkpoints: str = "run/checkpoints") -> list:
    """The launch script's arguments: config, checkpoint directory, the user's settings, then the campaign's."""
    args = [s.config_file, checkpoints]
    for item in [*s.overrides, "output.dir=run", "output.progress_bar=false", "output.loss_every=100",
                 "train.epochs=100000", f"checkpoint.save_checkpoint_steps={save_every}",
                 "checkpoint.save_checkpoint_epochs=null", f"checkpoint.keep_checkpoint_max={keep}", *extra]:
        args += ["--set", item]
    return args


def newest_committed(root) -> Optional[object]:
    """The committed checkpoint with the highest global step in any checkpoint directory under root."""
    best = None
    for d in find_checkpoint_dirs(root) if Path(root).exists() else []:
        for c in scan(d).committed:
            if c.global_step is not None and (best is None or c.global_step > best.global_step):
                best = c
    return best


def damage(path, dataset=None) -> tuple:
    """Flip one byte in the middle of a tensor's data (dataset, e.g. "params/layer1.param"; by default the file's
    first parameter), as a bad disk block would; returns the tensor and its slice: ("params/layer1.param", Slice)."""
    import h5py
    with h5py.File(path, "r") as f:
        ds = f[dataset] if dataset else f["params"][sorted(f["params"])[0]]
        offset = ds.id.get_offset() + ds.nbytes // 2
        tensor = ds.name.lstrip("/")
    where = read_index(path).tensors[tensor][1]
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return tensor, where


def has_replica(record: dict, rank: int, tensor: str, where: Slice) -> bool:
    """Whether another rank's file of a committed checkpoint holds rank's slice of tensor (its commit record's
    `slices`), so a resume can repair it; True when the record does not say (an older format)."""
    for s in record.get("slices") or ():
        if (s["tensor"], tuple(s["offsets"]), tuple(s["extents"])) == (tensor, where.offsets, where.extents):
            holders = progression.members(progression.set_from_json(s["holders"]))
            if rank in holders:
                return len(holders) > 1
    return True


def run_reference(s: Settings, save_every: int, target: int = 0, say: Callable = print, keep=None) -> dict:
    """The fault-free run: the same job with no failure, a save every `save_every` steps. Its row
    counts the steps of the first --duration seconds; it then goes on until it has passed step `target`
    (the furthest any combination got), so every loss and final checkpoint has its fault-free counterpart
    (at most 3 x --duration more).

    keep: the global steps whose checkpoints the comparisons need (each combination's newest periodic one);
    the others are removed while the job runs (all but its newest), so the disk holds a few checkpoints,
    not one per interval (a save every 10 steps of the 710 MiB Transformer filled 17 GB in 4 minutes)."""
    d = s.out / "fault-free"
    d.mkdir(parents=True)
    say(f"campaign: fault-free run ({s.duration:.0f} s, then on to step {target}; a checkpoint every {save_every} "
        "steps, those compared kept)")
    start = time.time()
    end, limit = start + s.duration, start + 4 * s.duration
    metrics = d / "run" / "metrics.jsonl"
    env, where, wrap = {"RANK_SIZE": str(s.ranks)}, {}, None
    if s.hosts:  # on every host, each with its files on its own disk
        more, up = s.hosts.start(d, 0)
        env.update(more)
        where, wrap = {"checkpoints": s.hosts.checkpoints(d.name)}, s.hosts.command(d)
    job = Job(SAVE, job_args(s, save_every, keep=1_000_000, **where), d, d / "jobs.log", env, f"{s.tag}-ref",
              limit - start + GRACE, wrap)
    pruned, pruning = 0, time.time()
    try:
        reached, checked = 0, 0.0
        while job.poll() is None and time.time() < limit and (time.time() < end or reached <= target):
            time.sleep(0.2)
            if time.time() > max(end, checked + 2):  # past the budget: read how far it got now and then
                checked = time.time()
                reached = analysis.progress(analysis.read_events(metrics), checked)
            if keep is not None and time.time() > pruning + 2:
                pruning = time.time()
                pruned += prune_reference({"dir": str(d)}, keep, spare_newest=True, hosts=s.hosts)
        if job.code is not None:
            raise CampaignError(f"the fault-free run ended early (exit {job.code}): see {d / 'jobs.log'}")
    finally:
        job.stop()
        if s.hosts:
            s.hosts.clean(s.hosts.up())
            s.hosts.gather(d.name, d / "run" / "checkpoints")
    events = analysis.read_events(metrics)
    cost = analysis.checkpoint_cost(events, end, save_every)
    if not cost["rate"]:
        raise CampaignError(f"the fault-free run finished no step in {s.duration:.0f} s: see {d / 'jobs.log'}")
    steps = analysis.progress(events, end)
    row = {"strategy": "fault-free", "save_every": save_every, "steps": steps, "seconds": round(end - start, 3),
           "goodput": round(steps / (end - start), 3), "goodput_fraction": round(steps / (end - start) / cost["rate"], 4),
           "fault_free_rate": round(cost["rate"], 3), "step_s": cost["step_s"], "save_s": cost["save_s"],
           "checkpoint_overhead": round(steps // save_every * (cost["save_s"] or 0) / (end - start), 4),
           "reached": analysis.progress(events, time.time()), "start": start, "end": end, "dir": str(d),
           "pruned_while_running": pruned}
    say(f"campaign: fault-free: {steps} steps in {s.duration:.0f} s ({cost['rate']:.1f} steps/s without saves); "
        f"stopped at step {row['reached']}")
    return row


def reference_losses(ref: dict) -> dict:
    """Every loss the fault-free run logged, by global step (also past its budget)."""
    events = analysis.read_events(Path(ref["dir"]) / "run" / "metrics.jsonl")
    return {e["global_step"]: e["loss"] for e in events if e["event"] == "step"}


def run_combination(s: Settings, strategy: Strategy, save_every: int, plan: list, say: Callable = print) -> dict:
    """One strategy at one interval until its budget is spent; returns its row (analysis.summarize + more)."""
    name = f"{strategy.name}-every{save_every}"
    d = s.out / name
    d.mkdir(parents=True)
    extra = ["fault.kind=plan", *strategy.settings]
    if s.hang_timeout:  # a frozen or stuck rank is found and killed, then met as a dead one; a deadlock is broken
        # after DEADLOCK_FACTOR hang timeouts (not tft.deadlock_timeout's 10: a campaign's budget is minutes)
        extra += [f"tft.hang_timeout={s.hang_timeout:g}", f"tft.deadlock_timeout={DEADLOCK_FACTOR * s.hang_timeout:g}"]
    if s.sdc_check_every:  # a flipped bit is found by comparing replicas, and rolled back in the job
        extra.append(f"tft.sdc_check_every={s.sdc_check_every}")
    if s.straggler_factor:  # a slow rank is found by its step times and killed, then met as a dead one
        extra += [f"tft.straggler_factor={s.straggler_factor:g}", "tft.straggler_evict=true"]
    spares = 0
    if strategy.spares:  # a warm spare per dead rank it will meet, up to max_spares (then spawning)
        dead = sum(s.ranks_per_node if f.kind == "node" or f.kind == "host" and s.hosts else
                   f.kind in DEATH_KINDS or f.kind == "slow" and bool(s.straggler_factor)
                   for f in plan)
        spares = min(s.max_spares, dead)
        extra.append(f"tft.spares={spares}")
    start = time.time()
    end = start + s.duration
    path = failure_process.write_plan(d / "plan.json", plan, start, s.ranks_per_node, s.slowdown)
    say(f"campaign: {name}: {strategy.summary}; {len(plan)} failure(s) planned in {s.duration:.0f} s")
    root = s.hosts.records(name) if s.hosts else d / "run" / "checkpoints"  # the commit records
    jobs, damaged, job, closed, checked = [], {}, None, None, 0.0
    try:
        while True:
            now = time.time()
            if now >= end:
                if closed is None:  # no failure strikes after the budget (one may have as it ran out)
                    failure_process.claim_unfired(path)
                    closed = time.time()
                if now >= end + TAIL:
                    break
                if job is None or now >= checked + 1:  # (no restart once nothing is left to recover)
                    checked = now
                    if not _unrecovered(d, closed, now, jobs, damaged, bool(s.straggler_factor)):
                        break
            if job is None:
                resume = newest_committed(root) is not None
                env, where, wrap, on = {PLAN_ENV: str(path), "RANK_SIZE": str(s.ranks)}, {}, None, {}
                if s.hosts:  # on the hosts up, the plan's host crashes aimed at their ranks there
                    more, up = s.hosts.start(d, len(jobs), spares)
                    env.update(more)
                    failure_process.write_plan(path, s.hosts.aim(plan, up), start, s.ranks_per_node, s.slowdown)
                    where, wrap = {"checkpoints": s.hosts.checkpoints(name)}, s.hosts.command(d)
                    on = {"hosts": [s.hosts.name(h) for h in up]}
                args = job_args(s, save_every, extra, **where) + (["--repair"] if resume else [])
                logged = (d / "jobs.log").stat().st_size if (d / "jobs.log").exists() else 0
                job = Job(RECOVER if resume else SAVE, args, d, d / "jobs.log", env,
                          f"{s.tag}-{name}-{len(jobs)}", end + TAIL - time.time() + GRACE, wrap)
                jobs.append({"started": job.started, "resume": resume, **on})
            code = job.poll()
            # before any restart: the victim's disk fails with it
            _damage_fired(path, root, damaged, s.seed, s.hosts and (lambda x: s.hosts.locate(x, name)))
            if code is not None:
                jobs[-1].update(ended=job.ended, code=code)
                if s.hosts:
                    s.hosts.after_job(failure_process.fired(path), jobs[-1])
                job = None
                if code == 2 and s.hosts and jobs[-1]["resume"] and nothing_to_resume(d / "jobs.log", logged):
                    # a crashed host's disk held the only copy of some slices: start over, as a user would
                    s.hosts.start_over(name)
                    jobs[-1]["started_over"] = True
                    continue
                if code == 2:
                    raise CampaignError(f"{name}: a job refused its input (exit 2): see {d / 'jobs.log'}")
                continue
            time.sleep(0.2)
    finally:
        if job is not None:
            job.stop()
            jobs[-1].update(ended=job.ended, code=None)  # stopped: the budget (and the recoveries) done
            if s.hosts:
                s.hosts.after_job(failure_process.fired(path), jobs[-1])
        if s.hosts:  # every host's files in one place, for the comparisons
            s.hosts.gather(name, d / "run" / "checkpoints")
    settled = time.time()
    events = analysis.read_events(d / "run" / "metrics.jsonl")
    recs = _failures(events, closed or settled, settled, jobs, damaged)
    fired = failure_process.fired(path)
    for r in recs:
        r["damaged_file"] = (damaged.get(r["index"]) or {}).get("file")
        r["damaged_tensor"] = (damaged.get(r["index"]) or {}).get("tensor")
    if s.hosts:
        hosts_of.annotate(recs, jobs, s.ranks, s.hosts.slots)
    return {"strategy": strategy.name, "save_every": save_every, "exact_required": strategy.exact,
            "start": start, "end": end, "settled": settled, "dir": str(d), "jobs": jobs, "fired": len(fired),
            "damaged_files": sorted(x["file"] for x in damaged.values() if x), "failures": recs, "events": events}


NOTHING_TO_RESUME = re.compile(r"dsim: error: no (usable )?committed checkpoint in ")


def nothing_to_resume(log: Path, offset: int) -> bool:
    """Whether the job whose output starts at `offset` of its log ended finding no committed checkpoint complete
    (on a cluster, the only copy of some slices was on a crashed host's disk)."""
    with open(log, "rb") as f:
        f.seek(offset)
        return bool(NOTHING_TO_RESUME.search(f.read().decode(errors="replace")))


def _failures(events: list, end: float, until: float, jobs: list, damaged: dict) -> list:
    """analysis.failures of a combination: those struck by `end` (the budget's end), recovered by `until`."""
    broken = {i: x["checkpoint"] for i, x in damaged.items() if x and not x["replica"]}
    return analysis.failures(events, end, [j["started"] for j in jobs[1:]], broken, until)


def _unrecovered(d: Path, end: float, now: float, jobs: list, damaged: dict, stragglers_watched: bool) -> int:
    """How many failures struck within the budget are not recovered yet (a slow rank nothing watches never is, nor
    a flipped bit no check can find)."""
    events = analysis.read_events(d / "run" / "metrics.jsonl")
    return sum(not r["recovered"] and (r["kind"] != "slow" or stragglers_watched) and r["findable"]
               for r in _failures(events, end, now, jobs, damaged))


def struck_tensor(path, rng) -> str:
    """A tensor of the file at `path` ("params/..." or "optimizer/..."), drawn in proportion to its bytes:
    where a bad block of the file lands."""
    tensors = read_index(path).tensors
    names = sorted(tensors)
    size = np.array([math.prod(tensors[n][4]) * tensors[n][3].itemsize for n in names], dtype=np.float64)
    return names[int(rng.choice(len(names), p=size / size.sum()))] if size.sum() else names[0]


def _damage_fired(plan, root: Path, done: dict, seed: int = 0, locate: Optional[Callable] = None) -> None:
    """For each `corrupt` failure that fired, damage the victim's file of the newest committed checkpoint (under
    root; on a cluster where `locate` finds it, on some host's disk), in a tensor drawn from the campaign's seed and
    the failure (struck_tensor: the same draw in every combination); done[index]: {file, checkpoint, replica:
    whether a resume can repair it}, or None (no file of the victim)."""
    for f in failure_process.fired(plan):
        if f.get("kind") == "corrupt" and f["index"] not in done:
            c = newest_committed(root)
            shard = next((x for x in c.shards if x.rank == f["rank"] and x.size), None) if c else None
            file = (locate(shard.path) if locate else shard.path) if shard is not None else None
            done[f["index"]] = None
            if file is not None:
                tensor, where = damage(file, struck_tensor(file, np.random.default_rng([seed, f["index"]])))
                # (on a cluster, named where the comparisons find it: in the files gathered from the disks)
                shown = root.parent.parent / "run" / "checkpoints" / Path(shard.path).relative_to(root) if locate \
                    else shard.path
                done[f["index"]] = {"file": str(shown), "checkpoint": c.name, "tensor": tensor,
                                    "replica": has_replica(c.record, f["rank"], tensor, where)}


def final_state(row: dict, ref: dict) -> dict:
    """The combination's newest committed periodic checkpoint against the fault-free run's at the same step,
    every rank's parameters and optimizer state bit for bit.

    A file the campaign damaged (a `corrupt` failure) may still be there, when no resume needed it: its tensors
    that fail their checksum are compared through a replica (another rank's file holding the same slice), as a
    resume would repair them; with no replica the state is not checked (`equal` None). Any other file that
    fails its checksum is a difference.
    """
    mine = newest_committed_periodic(Path(row["dir"]) / "run" / "checkpoints")
    if mine is None:
        return {"equal": None, "why": "no periodic checkpoint was committed"}
    theirs = next((c for c in scan(Path(ref["dir"]) / "run" / "checkpoints").committed
                   if c.global_step == mine.global_step), None)
    out = {"checkpoint": mine.name, "global_step": mine.global_step}
    if theirs is None:
        return {**out, "equal": None, "why": f"the fault-free run has no checkpoint at step {mine.global_step}"}
    damaged_by_us = {str(Path(p)) for p in row.get("damaged_files") or ()}
    differ, compared, lost = [], set(), []
    ref_files = {x.rank: x.path for x in theirs.shards}
    for shard in mine.shards:
        bad = []
        try:
            a = param_dict_of(read_file(shard.path, damaged=bad))
        except CheckpointError as e:
            differ.append(f"rank {shard.rank}: {e}")
            continue
        if bad and str(Path(shard.path)) not in damaged_by_us:
            differ += [f"rank {shard.rank}: {t} fails its checksum" for t in bad]
        lost += [(shard.rank, shard.path, t) for t in bad]
        b = load_checkpoint(ref_files[shard.rank])
        if set(a.slices) | {t.split("/", 1)[1] for t in bad} != set(b.slices):
            differ.append(f"rank {shard.rank}: other tensors")
        differ += [f"rank {shard.rank}: {k}" for k in a.slices if k in b.slices and not np.array_equal(a[k], b[k])]
        compared |= {(k, where) for k, where in a.slices.items()}
    ours = [(r, path, t) for r, path, t in lost if str(Path(path)) in damaged_by_us]
    unchecked = [f"rank {r}: {t}" for r, path, t in ours
                 if (t.split("/", 1)[1], read_index(path).tensors[t][1]) not in compared]
    out.update(tensors=len(compared), differ=differ[:10], damaged=[f"rank {r}: {t}" for r, _, t in ours])
    if differ:
        return {**out, "equal": False}
    if unchecked:
        return {**out, "equal": None, "why": "damaged by the campaign and held by no other rank: "
                + ", ".join(unchecked)}
    return {**out, "equal": True}


def newest_committed_periodic(directory: Path):
    committed = scan(directory).committed if directory.exists() else []
    return max(committed, key=lambda c: c.global_step, default=None)


def prune_reference(ref: dict, keep_steps: set, spare_newest: bool = False, hosts=None) -> int:
    """Remove the fault-free run's checkpoints no combination is compared with; returns how many.
    spare_newest: while the job runs, its newest checkpoint stays (its next commit record is numbered after it).
    hosts: while it runs on a cluster, its files are on the hosts' disks (the records on node1's)."""
    n = 0
    name = Path(ref["dir"]).name
    directory = hosts.records(name) if hosts else Path(ref["dir"]) / "run" / "checkpoints"
    committed = scan(directory).committed if directory.is_dir() else []
    for c in committed[:-1] if spare_newest else committed:
        if c.global_step in keep_steps:
            continue
        for suffix in (".commit", ".digests"):  # the record first: never a committed checkpoint without files
            (directory / f"{c.name}{suffix}").unlink(missing_ok=True)
        for shard in c.shards:
            Path(shard.path).unlink(missing_ok=True)
        if hosts:
            hosts.prune(name, [shard.path for shard in c.shards])
        n += 1
    return n


def gcd(values) -> int:
    return math.gcd(*values)
