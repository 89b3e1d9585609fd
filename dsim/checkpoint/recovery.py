"""Recovery: resume from the newest usable committed checkpoint, repairing lost or damaged shards from replicas.

Collective on every rank. Each decision is agreed (bcast or allgather) before any rank acts on it, so a
bad file gives the same message on every rank and never a hang.

1. candidates: the committed checkpoints, newest first by global step (never by file time), or the one named;
2. the checkpoint must have been saved with the built run's layout and world size (else one clear error);
3. every rank reads and verifies its own file: it exists, is HDF5, every checksum matches, and it holds
   this rank's shard of the committed step;
4. a rank whose file is lost or damaged receives the shard from a healthy rank of its group info (MPI point
   to point). With repair=True it also writes the shard back in place, keeping the damaged file as
   `<name>.h5.damaged`. When some rank has no healthy replica, the next older checkpoint is tried;
5. the shard is loaded into the built model; step counter, schedule and data position follow from its step.
Nothing is ever deleted.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..engine import callbacks
from ..engine.callbacks import say
from ..parallel.layout import ParallelLayout
from . import commit as cm
from .errors import CheckpointError
from .format import read_file, write_file
from .group_info import group_info, replica_sets, write_group_info
from .loader import candidates, check_compatible, file_for, load_into, param_dict_of

TAG = 0x5EED


@dataclass
class RepairPlan:
    """Who receives its shard from whom, and which ranks' slices no healthy rank holds."""

    donors: dict    # broken rank -> the healthy replica that sends it the shard
    lost: dict      # broken rank -> its replica set, when no member is healthy


def plan_repair(broken: Iterable[int], sets: Iterable[Iterable[int]]) -> RepairPlan:
    """Pair every broken rank with a healthy member of its replica set, spreading the sends round robin."""
    broken = set(broken)
    donors, lost = {}, {}
    for group in sets:
        group = list(group)
        healthy = [r for r in group if r not in broken]
        for i, r in enumerate(r for r in group if r in broken):
            if healthy:
                donors[r] = healthy[i % len(healthy)]
            else:
                lost[r] = group
    return RepairPlan(donors, lost)


def read_own(directory, record: dict, rank: int):
    """(shard, None) when rank's file of the committed checkpoint is whole and really rank's; else (None, why).

    Whole: every checksum matches (tensors and metadata), its content digest is the one the commit record
    names (when the record has digests), and its scalar state (global step, epoch, data position, optimizer
    step) is the record's.
    """
    path = file_for(directory, record, rank)
    try:
        shard = read_file(path, verify=True)
    except CheckpointError as e:
        return None, str(e)
    meta = shard.meta
    digest = record.get("digests", {}).get(cm.digest_key(record, rank))
    if digest is not None and shard.digest != digest:
        return None, (f"{path} is not the file committed (its content digest differs from the commit record's; "
                      f"it holds rank {meta.get('rank')}'s shard of global step {meta.get('global_step')})")
    mismatch = cm.state_mismatch(meta, record)
    if mismatch:
        return None, f"{path} {mismatch}"
    if not record["integrated_save"] and meta.get("rank") != rank:
        return None, f"{path} holds rank {meta.get('rank')}'s shard"
    return shard, None


def exchange(comm, donors: dict, shard):
    """Each donor sends its shard to the ranks it repairs; returns the shard this rank should load."""
    for r, donor in sorted(donors.items()):
        if comm.rank == donor:
            comm.send(shard, dest=r, tag=TAG)
    if comm.rank in donors:
        shard = comm.recv(source=donors[comm.rank], tag=TAG)
    return shard


def _free_name(path: Path) -> Path:
    if not (path.exists() or path.is_symlink()):
        return path
    n = 1
    while Path(f"{path}.{n}").exists():
        n += 1
    return Path(f"{path}.{n}")


def repair_file(directory, record: dict, rank: int, layout: ParallelLayout, shard) -> tuple:
    """Write a replica's shard as rank's file (its own rank and group info in the attributes).

    A damaged file in the way is renamed to `<name>.h5.damaged`, never deleted. Returns (path, kept).
    """
    path = file_for(directory, record, rank)
    kept = None
    if path.exists() or path.is_symlink():
        kept = _free_name(path.with_name(path.name + ".damaged"))
        os.replace(path, kept)
    meta = {k: v for k, v in shard.meta.items() if k not in ("format", "format_version")}
    meta.update(rank=rank, group_info=group_info(layout, rank))
    write_file(path, meta, shard.tensors.values(), shard.append_info)
    info = cm.rank_dir(directory, rank) / "group_info.json"
    if not info.exists():
        write_group_info(info, layout, rank)
    return path, kept


def recover(run, which: str = "auto", repair: bool = False, log=say, source=None):
    """Load the newest usable committed checkpoint into a built run; returns (record, param_dict).

    source: a directory to resume from instead of the run's checkpoint directory; it is only read.
    Collective. Raises CheckpointError (the same on every rank) when no candidate is usable.
    """
    comm, layout = run.groups.world, run.groups.layout
    rank = comm.rank
    t0 = time.perf_counter()
    records, error = None, None
    if rank == 0:
        try:
            records = (candidates(source, which, Path(source) / "ttp_checkpoints") if source else
                       candidates(run.checkpoint_dir, which, run.ttp_dir))
        except CheckpointError as e:
            error = str(e)
    records, error = comm.bcast((records, error), root=0)
    if error:
        raise CheckpointError(error)
    tried = []
    for i, record in enumerate(records):
        directory = Path(record["directory"])
        check_compatible(record, layout, comm.size, cm.commit_path(directory, record["name"]))
        shard, error = read_own(directory, record, rank)
        broken = {r: e for r, e in enumerate(comm.allgather(error)) if e}
        sets = [range(comm.size)] if record["integrated_save"] else replica_sets(layout)  # layout checked above
        plan = plan_repair(broken, sets)
        if plan.lost:
            reason = "; ".join(f"{broken[r]}, and no other rank holds rank {r}'s slices (group info {g})"
                               for r, g in sorted(plan.lost.items()))
            tried.append(f"{record['name']}: {reason}")
            if rank == 0:
                after = (f"; falling back to the previous committed checkpoint {records[i + 1]['name']}"
                         if i + 1 < len(records) else "")
                log(f"dsim: recovery: checkpoint {record['name']} is not usable: {reason}{after}")
            continue
        if rank == 0:
            for r, donor in sorted(plan.donors.items()):
                log(f"dsim: recovery: rank {r}: {broken[r]}; using the replica on rank {donor} "
                    f"(group info {layout.replica_group(r)})")
                record_event(run, "repair", rank=r, donor=donor, checkpoint=record["name"],
                             global_step=record["global_step"], reason=broken[r], written_back=repair)
        shard = exchange(comm, plan.donors, shard)
        if repair and plan.donors:
            _repair_all(comm, directory, record, layout, plan, shard, log)
        param_dict = load_into(run, param_dict_of(shard))
        if rank == 0 and plan.donors:
            log(f"dsim: recovery: {len(plan.donors)} shard(s) of {record['name']} taken from replicas, "
                f"loaded in {1000 * (time.perf_counter() - t0):.0f} ms")
        return record, param_dict
    raise CheckpointError(f"no usable committed checkpoint in {source or run.checkpoint_dir} (tried {'; '.join(tried)})")


def _repair_all(comm, directory, record, layout, plan, shard, log):
    """Every repaired rank writes its file back; all agree on the outcome."""
    done, error = None, None
    if comm.rank in plan.donors:
        try:
            done = repair_file(directory, record, comm.rank, layout, shard)
        except (OSError, CheckpointError) as e:
            error = f"rank {comm.rank}: cannot repair {file_for(directory, record, comm.rank)}: {e}"
    results = comm.allgather((done, error))
    errors = [e for _, e in results if e]
    if errors:
        raise CheckpointError(errors[0])
    if comm.rank == 0:
        for r, (done, _) in enumerate(results):
            if done:
                path, kept = done
                log(f"dsim: recovery: repaired {path} from rank {plan.donors[r]}'s shard"
                    + (f" (the damaged file is kept as {kept.name})" if kept else ""))


def resume(run, which: str = "auto", repair: bool = False, source=None) -> int:
    """Restore every rank for `--resume` (from source, `--resume-from`, if given); returns initial_epoch
    (the data position may be mid-epoch)."""
    record, _ = recover(run, which, repair, source=source)
    step = run.loader.init_step
    if run.groups.world.rank == 0:
        epoch, in_epoch = run.loader.position(step)
        record_event(run, "resume", checkpoint=record["name"], global_step=step, epoch=epoch + 1, step_in_epoch=in_epoch)
        say(f"dsim: resumed from {file_for(record['directory'], record, 0)} "
            f"(global step {step}: epoch {epoch + 1} step {in_epoch})")
    return step // run.loader.get_dataset_size()


def record_event(run, name: str, **fields) -> None:
    """Record an event in the run's metrics.jsonl from rank 0, also before training began.

    callbacks.event() needs the MetricsLog of a running training; a resume happens before it starts,
    so the line (in MetricsLog's shape) is then appended directly.
    """
    if callbacks._metrics is not None:
        callbacks.event(name, **fields)
        return
    path = Path(run.cfg.output.dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"event": name, "time": time.time(), "rank": run.groups.world.rank, **fields}) + "\n")
