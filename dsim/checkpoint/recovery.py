"""Recovery: resume from the newest usable committed checkpoint, repairing lost or damaged shards from replicas.

Collective on every rank. Each decision is agreed (bcast or allgather) before any rank acts on it, so a
bad file gives the same message on every rank and never a hang.

1. candidates: the committed checkpoints, newest first by global step (never by file time), or the one named;
2. the checkpoint must have been saved with the built run's layout and world size (else one clear error);
3. every rank reads and verifies its own file: it exists, is HDF5, every checksum matches, its content
   digest is the one committed (the digest file, read on rank 0 and scattered: each rank gets its own), and
   it holds this rank's shard of the committed step; a digest file missing or not the one committed makes
   the checkpoint unusable, as a damaged commit record would;
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

from ..log import event, recording, say
from ..parallel.layout import ParallelLayout
from . import commit as cm, record as rec
from .errors import CheckpointError
from .format import Shard, read_file, write_file
from .group_info import group_info_as, replica_sets, tensor_holders, write_group_info
from .loader import candidates, check_compatible, file_for, live_arrays, load_into, param_dict_of

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


@dataclass
class TensorPlan:
    """Per damaged rank, which healthy holder sends each tensor it lacks, and the tensors nobody can send."""

    sources: dict   # damaged rank -> {tensor name -> the healthy rank that sends it}
    lost: dict      # damaged rank -> {tensor name -> its holders}, when none of them is healthy
    preferred: dict  # damaged rank -> the replica with a whole healthy file that sends what it can


def plan_tensors(damage: dict, names, holders_of, sets) -> TensorPlan:
    """Pick a healthy holder for every tensor a damaged rank lacks.

    damage: rank -> None (its whole file is unusable) or the names of its damaged tensors. A replica with a
    whole healthy file (group info) sends everything when there is one, as before; otherwise each tensor
    comes from any healthy rank holding the same slice (holders_of(rank, name)): a tensor replicated
    beyond the replica set (LayerNorm, biases after row layers, a replicated embedding) survives the loss of
    the whole replica set.
    """
    def bad(r, name):
        return r in damage and (damage[r] is None or name in damage[r])

    preferred = plan_repair(set(damage), sets).donors
    sources, lost = {}, {}
    for r, d in sorted(damage.items()):
        for name in (names if d is None else sorted(d)):
            if r in preferred:
                sources.setdefault(r, {})[name] = preferred[r]
                continue
            holders = holders_of(r, name)
            healthy = [h for h in holders if h != r and not bad(h, name)]
            if healthy:
                sources.setdefault(r, {})[name] = healthy[r % len(healthy)]
            else:
                lost.setdefault(r, {})[name] = holders
    return TensorPlan(sources, lost, preferred)


def expected_digest(comm, directory, record: dict) -> tuple:
    """(the content digest the record commits for this rank's file, or None when it has none; why the digests
    cannot be trusted, or None). Collective: rank 0 reads the digest file, every rank gets its own entry."""
    table, why = [None] * comm.size, None
    if comm.rank == 0:
        digests, why = rec.read_digests(directory, record)
        if digests is not None:
            table = [digests.get(cm.digest_key(record, r)) for r in range(comm.size)]
    why = comm.bcast(why, root=0)
    return comm.scatter(table, root=0), why


def read_own(directory, record: dict, rank: int, digest: str = None, into=None):
    """(shard, None, []) when rank's file of the committed checkpoint is whole and really rank's; (shard, why,
    damaged tensor names) when only some tensors' data is damaged; (None, why, None) when the file cannot be used.

    Whole: every checksum matches (tensors and metadata), its content digest is `digest` (the one the commit
    record names, when it has digests), and its scalar state (global step, epoch, data position, optimizer
    step) is the record's. into: where to read the tensors (format.read_file), e.g. the run's live arrays.
    """
    path = file_for(directory, record, rank)
    damaged = []
    try:
        shard = read_file(path, verify=True, damaged=damaged, into=into)
    except CheckpointError as e:
        return None, str(e), None
    meta = shard.meta
    if digest is not None and shard.digest != digest:
        return None, (f"{path} is not the file committed (its content digest differs from the commit record's; "
                      f"it holds rank {meta.get('rank')}'s shard of global step {meta.get('global_step')})"), None
    mismatch = cm.state_mismatch(meta, record)
    if mismatch:
        return None, f"{path} {mismatch}", None
    if not record["integrated_save"] and meta.get("rank") != rank:
        return None, f"{path} holds rank {meta.get('rank')}'s shard", None
    if damaged:
        return shard, f"checksum mismatch in {path}: {', '.join(damaged)}", [d.split("/", 1)[1] for d in damaged]
    return shard, None, []


def exchange(comm, plan: TensorPlan, shard, whole: set):
    """Every source sends the tensors it was asked for (and, to a rank whose file is gone, the file's
    attributes); returns the shard this rank should load, completed."""
    from mpi4py import MPI  # noqa: F401  (mpi4py requests)
    requests = []
    for r, names in sorted(plan.sources.items()):
        mine = [n for n, src in names.items() if src == comm.rank]
        if mine:
            head = (shard.meta, shard.append_info) if r in whole else None
            requests.append(comm.isend((head, {n: shard.tensors[n] for n in mine}), dest=r, tag=TAG))
    if comm.rank in plan.sources:
        for src in sorted(set(plan.sources[comm.rank].values())):
            head, tensors = comm.recv(source=src, tag=TAG)
            if shard is None:
                meta = {**head[0], "rank": comm.rank}
                shard = Shard(None, meta, {}, dict(head[1]))
            shard.tensors.update(tensors)
    for req in requests:
        req.wait()
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
    # the replica's content in its own format (2 or 3: the record's digest covers the version); format 1, which
    # had no metadata checksums, in today's
    meta = {k: v for k, v in shard.meta.items() if k != "format" and not (k == "format_version" and v < 2)}
    meta.update(rank=rank, group_info=group_info_as(shard.meta.get("group_info"), layout, rank))
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
    # rank 0 sends each record when it is tried (usually only the newest): the others never unpickle them all
    count, error = comm.bcast((len(records) if records is not None else 0, error), root=0)
    if error:
        raise CheckpointError(error)
    tried = []

    def unusable(i, why):
        """Record why record i cannot be used; rank 0 says so, and names the one tried next."""
        tried.append(f"{record['name']}: {why}")
        if rank == 0:
            after = (f"; falling back to the previous committed checkpoint {records[i + 1]['name']}"
                     if i + 1 < len(records) else "")
            log(f"dsim: recovery: checkpoint {record['name']} is not usable: {why}{after}")

    for i in range(count):
        record = comm.bcast(records[i] if rank == 0 else None, root=0)
        directory = Path(record["directory"])
        if not record["integrated_save"] and not same_layout(record, layout, comm.size):
            try:
                return record, _resharded(run, directory, record, log, t0)
            except CheckpointError as e:
                unusable(i, str(e))
                continue
        check_compatible(record, layout, comm.size, cm.commit_path(directory, record["name"]))
        digest, why = expected_digest(comm, directory, record)
        if why:
            unusable(i, why)
            continue
        shard, error, damaged = read_own(directory, record, rank, digest, live_arrays(run))
        reports = comm.allgather((error, damaged))
        broken = {r: e for r, (e, _) in enumerate(reports) if e}
        damage = {r: (None if d is None else set(d)) for r, (e, d) in enumerate(reports) if e}
        if record["integrated_save"]:  # one file of whole tensors: no other holder
            plan = TensorPlan({}, {r: {"every tensor": [0]} for r in damage}, {})
        else:
            plan = plan_tensors(damage, state_names(run), holder_function(run), replica_sets(layout))
        if plan.lost:
            unusable(i, "; ".join(_lost_reason(broken[r], r, lost, layout) for r, lost in sorted(plan.lost.items())))
            continue
        if rank == 0:
            for r, sources in sorted(plan.sources.items()):
                donors = sorted(set(sources.values()))
                if r in plan.preferred:
                    log(f"dsim: recovery: rank {r}: {broken[r]}; using the replica on rank {plan.preferred[r]} "
                        f"(group info {layout.replica_group(r)})")
                else:
                    taken = "; ".join(f"{', '.join(n for n, s in sources.items() if s == d)} from rank {d}"
                                      for d in donors)
                    log(f"dsim: recovery: rank {r}: {broken[r]}; no replica in its group info "
                        f"{layout.replica_group(r)} is whole, taking {taken} (other holders of the same slices)")
                record_event(run, "repair", rank=r, donor=donors[0] if len(donors) == 1 else donors,
                             checkpoint=record["name"], global_step=record["global_step"], reason=broken[r],
                             tensors=sorted(sources), written_back=repair)
        whole = {r for r, d in damage.items() if d is None}
        shard = exchange(comm, plan, shard, whole)
        if repair and plan.sources:
            _repair_all(comm, directory, record, layout, plan, shard, log)
        param_dict = load_into(run, param_dict_of(shard))
        if rank == 0 and plan.sources:
            log(f"dsim: recovery: {len(plan.sources)} shard(s) of {record['name']} taken from replicas, "
                f"loaded in {1000 * (time.perf_counter() - t0):.0f} ms")
        return record, param_dict
    raise CheckpointError(f"no usable committed checkpoint in {source or run.checkpoint_dir} (tried {'; '.join(tried)})")


def same_layout(record: dict, layout: ParallelLayout, world_size: int) -> bool:
    """Whether a checkpoint was saved by this layout on this many ranks (else it is resharded on load)."""
    try:
        check_compatible(record, layout, world_size, "")
        return True
    except CheckpointError:
        return False


def _resharded(run, directory, record, log, t0) -> dict:
    """Load a checkpoint of another layout or world size (reshard.load_resharded) and say so on rank 0."""
    from .reshard import load_resharded
    saved = ParallelLayout(**record["layout"])
    meta = load_resharded(run, directory, record)
    layout, comm = run.groups.layout, run.groups.world
    if comm.rank == 0:
        for r, why in sorted(meta["passed_over"].items()):
            log(f"dsim: recovery: rank {r}'s file of {record['name']} not used: {why}; its slices read from other holders")
        ms = 1000 * (time.perf_counter() - t0)
        log(f"dsim: resharded {record['name']} from {saved.describe()} on {record['world_size']} ranks to "
            f"{layout.describe()} on {comm.size} ranks in {ms:.0f} ms")
        record_event(run, "reshard", checkpoint=record["name"], global_step=record["global_step"],
                     source_layout=saved.to_dict(), layout=layout.to_dict(), world_size=comm.size,
                     source_world_size=record["world_size"], ms=round(ms, 1))
    return meta


def state_names(run) -> list:
    """The tensors every rank's file holds: parameters, then optimizer state (<slot>.<parameter>)."""
    return [p.name for p in run.network.trainable_params()] + [n for n, _, _ in run.optimizer.state_items()]


def holder_function(run):
    """holders_of(rank, tensor name): the ranks holding the same slice of that tensor as rank."""
    specs = {p.name: p.spec for p in run.network.trainable_params()}
    layout = run.groups.layout

    def holders_of(rank, name):
        spec = specs.get(name) or specs[name.split(".", 1)[1]]  # optimizer state: <slot>.<parameter>
        return tensor_holders(spec, layout, rank)
    return holders_of


def _lost_reason(why, rank, lost, layout) -> str:
    if len(lost) > 3:
        return f"{why}, and no other rank holds rank {rank}'s slices (group info {layout.replica_group(rank)})"
    return f"{why}, and no healthy rank holds rank {rank}'s slice of " + ", ".join(
        f"{name} (holders {holders})" for name, holders in sorted(lost.items()))


def _repair_all(comm, directory, record, layout, plan, shard, log):
    """Every repaired rank writes its file back; all agree on the outcome."""
    done, error = None, None
    if comm.rank in plan.sources:
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
                donors = sorted(set(plan.sources[r].values()))
                log(f"dsim: recovery: repaired {path} from rank {', '.join(map(str, donors))}'s shard"
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

    log.event() needs the MetricsLog of a running training; a resume happens before it starts,
    so the line (in MetricsLog's shape) is then appended directly.
    """
    if recording():
        event(name, **fields)
        return
    path = Path(run.cfg.output.dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps({"event": name, "time": time.time(), "rank": run.groups.world.rank, **fields}) + "\n")
