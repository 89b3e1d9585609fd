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
   `<name>.h5.damaged`. When some slices have no healthy holder left (a lost disk without replicas), the next
   older checkpoint is tried, and a resume from it says how many steps go back (the newer ones are kept);
   when none is complete, the error names the slices lost (lost.py), each checkpoint's verdict, and for
   `--resume NAME` the older one that is complete; nothing is written then;
5. the shard is loaded into the built model; step counter, schedule and data position follow from its step.
Nothing is ever deleted.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..log import event, recording, say
from ..parallel.layout import ParallelLayout
from . import commit as cm, record as rec, save as sv
from .errors import CheckpointError
from .format import Shard, read_file
from .group_info import group_info_as, replica_sets, tensor_holders, write_group_info
from .lost import describe as describe_lost, lost_slices, summary as lost_summary
from .survivability import ranks_text
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


def expected_digests(comm, directory, record: dict) -> tuple:
    """(the content digest the record commits for each rank's file, None where it has none; why the digests
    cannot be trusted, or None). Collective: rank 0 reads the digest file, every rank gets the table (a rank may
    read another's file: fetch_moved)."""
    table, why = [None] * comm.size, None
    if comm.rank == 0:
        digests, why = rec.read_digests(directory, record)
        if digests is not None:
            table = [digests.get(cm.digest_key(record, r)) for r in range(comm.size)]
    return comm.bcast((table, why), root=0)


def fetch_moved(comm, directory, record: dict, missing: list, digests: list, hosts=None, log=say) -> tuple:
    """Files that are on another host than their rank's: with node-local disks, a restart that places ranks
    differently (a hostfile without a lost host) leaves rank r's file on a disk where other ranks run now. Each
    rank whose own file is absent from its disk (`missing`, agreed) gets it from a rank that finds it on its own:
    read and verified there (checksums, the committed digest, the record's state), sent whole. Collective.
    Returns (this rank's shard or None, {rank: the rank that sent its file}) for the files that came whole."""
    here = [r for r in missing if r != comm.rank and file_for(directory, record, r).exists()]
    seen = comm.allgather(here)
    readers, load = {}, {}
    for r in missing:
        finders = [q for q in range(comm.size) if r in seen[q]]
        if finders:
            q = min(finders, key=lambda q: (load.get(q, 0), q))
            readers[r], load[q] = q, load.get(q, 0) + 1
    requests = []
    for r, q in sorted(readers.items()):
        if q == comm.rank:
            got, error, _ = read_own(directory, record, r, digests[r])
            whole = got is not None and error is None
            requests.append(comm.isend((got.meta, got.tensors, got.append_info, got.digest) if whole else None,
                                       dest=r, tag=TAG + 1))
    shard = None
    if comm.rank in readers:
        sent = comm.recv(source=readers[comm.rank], tag=TAG + 1)
        if sent is not None:
            meta, tensors, append_info, digest = sent
            shard = Shard(None, meta, tensors, append_info, digest)
    for req in requests:
        req.wait()
    came = comm.allgather(shard is not None)
    moved = {r: q for r, q in readers.items() if came[r]}
    if comm.rank == 0 and moved:
        def on(r):
            return f" on {hosts.names[r]}" if hosts is not None and len(hosts.distinct) > 1 else ""
        for r, q in sorted(moved.items()):
            log(f"dsim: recovery: rank {r}: its file of {record['name']} is not on its disk{on(r)}; rank {q} read it "
                f"on its own{on(q)}, verified, and sent it (the file stays where it is)")
    return shard, moved


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


def repair_file(directory, record: dict, rank: int, layout: ParallelLayout, shard) -> sv.Write:
    """The plan of a repair: rank's file written from a replica's shard (its own rank and group info in the
    attributes), a damaged file in the way kept as `<name>.h5.damaged`, never deleted (save.keep_aside)."""
    info = cm.rank_dir(directory, rank) / "group_info.json"
    if not info.exists():
        write_group_info(info, layout, rank)
    return rank_write(file_for(directory, record, rank), rank, layout, shard, keep=True)


def rank_write(path, rank: int, layout: ParallelLayout, shard, keep: bool = False) -> sv.Write:
    """rank's file at `path` written from a replica's shard: the replica's tensors and attributes, with its own rank
    and group info (a repair; a rescue completed at a resume, dsim.ft.rescue)."""
    # the replica's content in its own format (2 or 3: the record's digest covers the version); format 1, which
    # had no metadata checksums, in today's
    meta = {k: v for k, v in shard.meta.items() if k != "format" and not (k == "format_version" and v < 2)}
    meta.update(rank=rank, group_info=group_info_as(shard.meta.get("group_info"), layout, rank))
    return sv.Write(rank, path, meta, list(shard.tensors.values()), shard.append_info, keep=keep)


@dataclass
class Assessment:
    """One committed checkpoint as tried (collective, agreed on every rank): usable (why is None), or why not."""

    why: str = None
    shard: object = None     # this rank's shard as read (None when its file is unusable)
    plan: TensorPlan = None  # who sends which tensor to whom
    broken: dict = None      # rank -> why its file is unusable or damaged
    damage: dict = None      # rank -> None (whole file unusable) or its damaged tensor names
    lost: list = None        # the slices with no copy left (lost.LostSlice), when that is why


def assess(run, record: dict, into=None) -> Assessment:
    """Read and verify every rank's file of a committed checkpoint of the run's layout, and plan its repair from
    replicas; collective. Reads tensors into `into` (e.g. the run's live arrays), else new arrays; writes nothing."""
    comm, layout = run.groups.world, run.groups.layout
    directory = Path(record["directory"])
    digests, why = expected_digests(comm, directory, record)
    if why:
        return Assessment(why)
    shard, error, damaged = read_own(directory, record, comm.rank, digests[comm.rank], into)
    absent = not file_for(directory, record, comm.rank).exists()
    reports = comm.allgather((error, damaged, absent))
    # a file absent from its rank's disk may be on another rank's (ranks placed on other hosts than when it was
    # saved); one present but damaged is the same file for every rank of that host: not looked for again
    missing = [r for r, (e, _, gone) in enumerate(reports) if e and gone and not record["integrated_save"]]
    if missing:
        fetched, moved = fetch_moved(comm, directory, record, missing, digests, run.groups.hosts)
        if fetched is not None:
            shard, error, damaged = fetched, None, []
        reports = [(None, [], False) if r in moved else x for r, x in enumerate(reports)]
    broken = {r: e for r, (e, _, _) in enumerate(reports) if e}
    damage = {r: (None if d is None else set(d)) for r, (e, d, _) in enumerate(reports) if e}
    if record["integrated_save"]:  # one file of whole tensors: no other holder
        plan = TensorPlan({}, {r: {"every tensor": [0]} for r in damage}, {})
    else:
        plan = plan_tensors(damage, state_names(run), holder_function(run), replica_sets(layout))
    if plan.lost:
        why = _lost_reason(broken, plan.lost, layout, directory, record)
        return Assessment(why, shard, plan, broken, damage, lost_slices(record, damage))
    return Assessment(None, shard, plan, broken, damage)


def recover(run, which: str = "auto", repair: bool = False, log=say, source=None):
    """Load the newest usable committed checkpoint into a built run; returns (record, param_dict).

    source: a directory to resume from instead of the run's checkpoint directory; it is only read.
    Collective. Raises CheckpointError (the same on every rank) when no candidate is usable: its first line says
    why, and when slices have no copy left (a lost disk without replicas) the lines after it name them, tell for
    each checkpoint tried whether it is complete, and which older committed step is (--resume NAME: checked too).
    """
    comm, layout = run.groups.world, run.groups.layout
    rank = comm.rank
    t0 = time.perf_counter()
    where = source or run.checkpoint_dir
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
    tried = []   # (record, its assessment) of every checkpoint not usable, newest first

    def unusable(i, why, found=None):
        """Record why record i cannot be used; rank 0 says so, and names the one tried next."""
        tried.append((record, found or Assessment(why)))
        if rank == 0:
            after = (f"; falling back to the previous committed checkpoint {records[i + 1]['name']}"
                     if i + 1 < len(records) else "")
            log(f"dsim: recovery: checkpoint {record['name']} is not usable: {why}{after}")
            if found is not None and found.lost:
                for line in describe_lost(found.lost, _host_of(record, run)):
                    log(f"dsim: recovery: checkpoint {record['name']}: slices lost, {line}")

    for i in range(count):
        record = comm.bcast(records[i] if rank == 0 else None, root=0)
        directory = Path(record["directory"])
        if not record["integrated_save"] and not same_layout(record, layout, comm.size):
            try:
                loaded = _resharded(run, directory, record, log, t0)
            except CheckpointError as e:
                unusable(i, str(e))
                continue
            _fell_back(run, record, tried, log)
            return record, loaded
        check_compatible(record, layout, comm.size, cm.commit_path(directory, record["name"]))
        found = assess(run, record, live_arrays(run))
        if found.why:
            unusable(i, found.why, found)
            continue
        plan, broken, damage = found.plan, found.broken, found.damage
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
        shard = exchange(comm, plan, found.shard, whole)
        if repair and plan.sources:
            _repair_all(comm, directory, record, layout, plan, shard, log)
        param_dict = load_into(run, param_dict_of(shard))
        if rank == 0 and plan.sources:
            log(f"dsim: recovery: {len(plan.sources)} shard(s) of {record['name']} taken from replicas, "
                f"loaded in {1000 * (time.perf_counter() - t0):.0f} ms")
        _fell_back(run, record, tried, log)
        return record, param_dict
    older = _older_complete(run, which, source, tried) if which != "auto" and tried and tried[0][1].lost else None
    raise CheckpointError(no_usable_message(where, tried, which, older, lambda r: _host_of(r, run)))


def _fell_back(run, record: dict, tried: list, log) -> None:
    """After resuming from an older checkpoint than the newest committed one: one line (rank 0) saying which step
    was lost and how many steps are trained again, and a `fallback` event. Nothing of the newer one is deleted."""
    if not tried or run.groups.world.rank != 0:
        return
    newest = tried[0][0]
    steps = newest["global_step"] - record["global_step"]
    names = ", ".join(r["name"] for r, _ in tried)
    one, many = (("has", "have") if all(a.lost for _, a in tried) else ("is", "are"))
    what = "slices with no copy left" if one == "has" else "not usable"
    which = f", which {one} {what}" if len(tried) == 1 else f"; {names} {many} {what}"
    log(f"dsim: recovery: resuming from {record['name']} (global step {record['global_step']}), not from the newest "
        f"committed checkpoint {newest['name']} (global step {newest['global_step']}){which} (above): the "
        f"{steps} step(s) after global step {record['global_step']} are trained again; nothing of {names} is deleted")
    record_event(run, "fallback", checkpoint=record["name"], global_step=record["global_step"],
                 newest=newest["name"], newest_global_step=newest["global_step"], steps_lost=steps,
                 passed_over=[r["name"] for r, _ in tried],
                 lost_slices=sum(len(a.lost or []) for _, a in tried[:1]))


def _older_complete(run, which: str, source, tried: list):
    """--resume NAME found NAME incomplete: the newest older committed checkpoint of the run's layout that is
    complete (assessed as a resume would, nothing loaded or written), or None. Collective."""
    comm = run.groups.world
    named = tried[0][0]
    older = None
    if comm.rank == 0:
        try:
            every = (candidates(source, "auto", Path(source) / "ttp_checkpoints") if source else
                     candidates(run.checkpoint_dir, "auto", run.ttp_dir))
        except CheckpointError:
            every = []
        key = (named["global_step"], named["time"])
        older = [r for r in every if (r["global_step"], r["time"]) < key and not r["integrated_save"]
                 and same_layout(r, run.groups.layout, comm.size)]
    count = comm.bcast(len(older) if older is not None else 0, root=0)
    for i in range(count):
        record = comm.bcast(older[i] if comm.rank == 0 else None, root=0)
        found = assess(run, record)
        tried.append((record, found))
        if not found.why:
            return record
    return None


def no_usable_message(where, tried: list, which: str, older, host_of) -> str:
    """The error when no committed checkpoint tried is usable: its first line as it always was (each checkpoint
    tried and why not), then, when slices have no copy left, what a person needs: whether each checkpoint
    considered is complete, the slices lost (tensor, slice index, the ranks and hosts that alone held them), which
    older committed step is complete (or none), and that nothing was written. Pure: tried holds (record,
    Assessment) newest first, with --resume NAME the named one first then the older ones checked; older is the
    complete one found among those, or None; host_of(record) gives each rank's host, or None."""
    shown = tried[:1] if which != "auto" else tried
    head = f"no usable committed checkpoint in {where} (tried " + "; ".join(f"{r['name']}: {a.why}" for r, a in shown) + ")"
    if not any(a.lost for _, a in tried):
        return head
    if older is not None:
        verdict = (f"the older committed checkpoint {older['name']} (global step {older['global_step']}) is complete: "
                   f"resume from it with --resume {older['name']}")
    elif which != "auto":
        verdict = "no older committed checkpoint of this layout is complete: none to resume from"
    else:
        verdict = "no committed checkpoint is complete: none to resume from"
    lines = [f"{head}: slices with no copy left; {verdict}; nothing was written"]
    previous = None
    for record, a in tried:
        title = f"  {record['name']} (global step {record['global_step']}): "
        if a.why is None:
            lines.append(title + "complete")
            continue
        if not a.lost:
            lines.append(title + f"not usable: {a.why}")
            continue
        hosts = host_of(record)
        same = [(s.tensor, s.index) for s in a.lost] == previous
        lines.append(title + "incomplete: " + lost_summary(a.lost, hosts) + (" (the same slices as above)" if same else ""))
        if not same:
            lines += [f"    {line}" for line in describe_lost(a.lost, hosts)]
        previous = [(s.tensor, s.index) for s in a.lost]
    complete = (f"{older['name']} (global step {older['global_step']}): --resume {older['name']}" if older is not None
                else "none (bring the lost files back and resume, or train anew in another checkpoint.directory)")
    lines.append(f"  complete committed checkpoint to resume from: {complete}")
    return "\n".join(lines)


def _host_of(record: dict, run):
    """Each rank's host when the record was saved (its `hosts`), else this run's when of the same world size."""
    return rec.hosts_of(record) or (list(run.groups.hosts.names)
                                    if record.get("world_size") == run.groups.world.size else None)


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


def _lost_reason(broken: dict, plan_lost: dict, layout, directory, record) -> str:
    """Why a checkpoint cannot be used when some ranks' slices have no healthy holder: per such rank, its file's
    problem and what nobody else holds; ranks whose files have the same problem (e.g. a lost disk's files: not
    found) told once, their files named by the record's template."""
    alike = {}
    for r, lost in sorted(plan_lost.items()):
        path = str(file_for(directory, record, r))
        generic = path.replace(f"rank_{r}", "rank_{rank}")
        key = (broken[r].replace(path, generic) if generic != path and path in broken[r] else None, len(lost) > 3)
        alike.setdefault(key if key[0] else (r, None), []).append(r)
    parts = []
    for (text, whole), ranks in alike.items():
        if len(ranks) == 1:
            parts.append(_one_lost_reason(broken[ranks[0]], ranks[0], plan_lost[ranks[0]], layout))
        elif whole:
            parts.append(f"{text} for ranks {ranks_text(ranks)}, and no other rank holds their slices (group info "
                         + ", ".join(str(layout.replica_group(r)) for r in ranks) + ")")
        else:
            parts.append(f"{text} for ranks {ranks_text(ranks)}, and no healthy rank holds their slices of "
                         + ", ".join(sorted({n for r in ranks for n in plan_lost[r]})))
    return "; ".join(parts)


def _one_lost_reason(why, rank, lost, layout) -> str:
    if len(lost) > 3:
        return f"{why}, and no other rank holds rank {rank}'s slices (group info {layout.replica_group(rank)})"
    return f"{why}, and no healthy rank holds rank {rank}'s slice of " + ", ".join(
        f"{name} (holders {holders})" for name, holders in sorted(lost.items()))


def _repair_all(comm, directory, record, layout, plan, shard, log):
    """Every repaired rank writes its file back (save.save, nothing to commit); all agree on the outcome."""
    rank = comm.rank
    mine = rank in plan.sources
    outcome = sv.save(sv.World(comm), lambda: [repair_file(directory, record, rank, layout, shard)] if mine else [],
                      describe=lambda e: f"rank {rank}: cannot repair {file_for(directory, record, rank)}: {e}").outcome
    if outcome.failed:
        raise CheckpointError(outcome.failed[min(outcome.failed)])
    if comm.rank == 0:
        for r in sorted(outcome.written):
            kept = outcome.kept.get(r)
            donors = sorted(set(plan.sources[r].values()))
            log(f"dsim: recovery: repaired {file_for(directory, record, r)} from rank {', '.join(map(str, donors))}'s "
                "shard" + (f" (the damaged file is kept as {kept.name})" if kept else ""))


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
