"""The last-gasp checkpoint (MindSpore's TTP, try-to-persist): when a rank dies, the survivors save one.

On every survivor, after an MPI call failed (see ulfm):
1. revoke every communicator of the job, so every rank stops at its next (or current) MPI call;
2. shrink the world to the living ranks; there is no fixed controller: the lowest living rank commits;
3. agree on a step: each survivor offers the steps whose owned state it holds consistently (OptTFTWrapper:
   the last finished step and the one before it), and the newest step that every replica set still holds
   is chosen (plan); when that is older than the newest a survivor holds (the only surviving replica of a dead
   rank was still in that step's sum when the rank died), its line and event say which survivors held it back;
4. for every rank of the full layout, dead ones included, one surviving holder of its slices (from the group
   info) writes that rank's file, in the normal format, under
   `ttp_checkpoints/tft_saved_checkpoints-step_{n}/rank_{r}/ttp_rank_{r}-{epoch}_{step}.h5`;
5. all agree (MPI_Comm_agree: the same answer on every survivor, even through further failures) that every
   file is written; then the committer writes the commit record, and the checkpoint exists.
With tft.sdc_check_every, the surviving holders of each replica set first compare the CRC-32 of the state of
that step (dsim.ft.sdc): replicas that differ mean a bit flipped since the last check, and through the
gradients every replica may carry it, so nothing is saved (the last periodic checkpoint was compared before
it was saved); without it, a damaged last gasp would be the newest checkpoint, resumed and rolled back to.
A failure during steps 3-5 starts again from 2 with those still alive; a slice nobody alive holds means no
checkpoint at all (nothing partial is ever committed), and resume falls back to the last periodic one.
With tft.peer_copy_every (dsim.ft.peer_copy), a slice nobody alive holds can still be saved from the copy of a dead
rank's state that its keeper holds: the survivors then save the newest step at which every rank's state is held
(their snapshots, their replicas, the keepers' complete copies), an older step than the newest, and say how many
steps that loses.
After the hang watch broke a deadlock (dsim.ft.hang: it revoked the communicators), every rank may be alive and
whole: the last gasp is saved all the same, each rank writing its own file.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mpi4py import MPI

from .. import faults
from ..checkpoint import commit as cm, save as sv
from ..checkpoint.group_info import replica_sets
from ..checkpoint.plan import save_plan
from ..checkpoint.record import RANK
from ..checkpoint.save import epoch_and_step, slots, state_file, state_tensors
from ..log import event
from ..parallel import progress
from ..runtime import PROCESS
from . import quorum
from .hang import broke_deadlock
from .cut import survivors
from .ulfm import agree, revoke, revoke_groups

PREFIX = "ttp"
ATTEMPTS = 4


@dataclass
class Plan:
    """The step to save, who writes each rank's file, and the replica sets that cannot be saved."""

    step: Optional[int]
    writers: dict = field(default_factory=dict)  # rank whose file -> surviving rank that writes it
    lost: list = field(default_factory=list)     # replica sets with no living holder of a common step
    copied: dict = field(default_factory=dict)   # with peer copies: rank whose file comes from a copy -> its keeper


def plan(offers: dict, sets) -> Plan:
    """Choose the newest step every replica set can provide, and a writer for every rank's file.

    offers: surviving rank -> the steps whose state it holds. Each holder writes its own file; the files of
    the other members of its set (dead, or holding other steps) are spread over the holders round robin.
    """
    sets = [list(g) for g in sets]
    dead_sets = [g for g in sets if not any(r in offers for r in g)]
    if dead_sets:
        return Plan(None, lost=dead_sets)
    steps = sorted(set().union(*offers.values()), reverse=True)
    for step in steps:
        holders_of = [[r for r in g if step in offers.get(r, ())] for g in sets]
        if all(holders_of):
            writers = {}
            for g, holders in zip(sets, holders_of):
                others = [r for r in g if r not in holders]
                writers.update({r: r for r in holders})
                writers.update({r: holders[i % len(holders)] for i, r in enumerate(others)})
            return Plan(step, writers)
    newest = steps[0] if steps else None
    return Plan(None, lost=[g for g in sets if not any(newest in offers.get(r, ()) for r in g)])


def held_back(offers: dict, sets) -> tuple[Optional[int], list]:
    """(the newest step a survivor holds, the survivors that had not finished it and are the only living holders of
    some replica set's slices: why an older step is saved). offers: surviving rank -> the steps it holds."""
    newest = max((max(s) for s in offers.values() if s), default=None)
    return newest, sorted(r for g in sets if not any(newest in offers.get(x, ()) for x in g)
                          for r in g if offers.get(r))


def checkpoint_dir(ttp_dir, step: int) -> Path:
    """The seed's directory of the last-gasp checkpoint of a step: tft_saved_checkpoints-step_{n}."""
    return Path(ttp_dir) / f"tft_saved_checkpoints-step_{step}"


def file_name(rank: int, epoch: int, step_in_epoch: int) -> str:
    """rank_{r}/ttp_rank_{r}-{epoch}_{step}.h5, as the seed names it (with .h5 for .ckpt)."""
    return f"rank_{rank}/ttp_rank_{rank}-{epoch}_{step_in_epoch}.h5"


@dataclass
class Survey:
    """What the living ranks told each other after a fault (every one of them holds the same)."""

    offers: dict          # living rank -> the steps whose owned state it holds (none after a UCE)
    damaged: list         # living ranks that offer nothing: their memory failed
    first_noticed: float  # when the first of them noticed the fault (time.time())
    deadlock: bool = False  # the hang watch broke a deadlock (dsim.ft.hang): a fault, if nobody died

    def plan(self, sets) -> Plan:
        return plan({r: steps for r, steps in self.offers.items() if steps}, sets)


def survey(comm, me: int, states: dict, noticed_at: float) -> Survey:
    """Every living rank tells the others what it can offer (collective over comm, the shrunk world)."""
    fault = broke_deadlock(noticed_at) or PROCESS.cut_at is not None  # (a cut healed since: every rank alive)
    reports = PROCESS.collective(comm.allgather, (me, sorted(states), noticed_at, fault))
    offers = {r: set(steps) for r, steps, _, _ in reports}
    return Survey(offers, sorted(r for r, steps in offers.items() if not steps), min(t for _, _, t, _ in reports),
                  any(b for *_, b in reports))


@dataclass
class Outcome:
    """What the survivors agreed happened; every survivor returns the same one."""

    failed: list
    damaged: list = field(default_factory=list)  # ranks alive whose memory failed (UCE): they offer nothing
    step: Optional[int] = None
    directory: Optional[Path] = None
    name: Optional[str] = None
    lost: list = field(default_factory=list)
    stages: list = field(default_factory=list)  # with pipeline stages: "pipeline stage s: names" per lost set
    corrupt: list = field(default_factory=list)  # replicas that differ (dsim.ft.sdc.differing_in_sets): no gasp
    unverified: list = field(default_factory=list)  # with sdc checks: sets saved from one surviving holder
    survivors: int = 0
    ms: float = 0.0        # from the first survivor noticing the failure to the commit
    existing: bool = False  # the step's last gasp was committed before (by the job that failed before this one)
    copied: dict = field(default_factory=dict)  # with peer copies: rank saved from a copy -> the survivor keeping it
    newest: Optional[int] = None  # the newest step a survivor had, when `step` is older (peer copies, unfinished)
    unfinished: list = field(default_factory=list)  # survivors that had not finished `newest`, the only ones
    # holding some replica set's slices: why `step` is older (a replica still in its sum when its peer died)
    other_error: bool = False  # every rank alive and whole, no deadlock broken: an MPI error of another kind
    lead: bool = False     # this rank reports it (the lowest living rank)
    cut: bool = False      # the ranks left out were cut off by a network cut (dsim.ft.cut), not found dead

    def message(self) -> str:
        gone = ("unreachable (a network cut, or a host gone silent; this side holds the quorum of the hosts)"
                if self.cut else "failed")
        who = "; ".join(
            ([f"rank(s) {', '.join(map(str, self.failed))} {gone}"] if self.failed else []) +
            ([f"rank(s) {', '.join(map(str, self.damaged))} had an uncorrectable memory error (UCE)"]
             if self.damaged else [])) or ("a network cut was found, and every rank answers again" if self.cut else
                                            "a deadlock was broken, every rank alive")
        if self.corrupt:
            from .sdc import describe
            return (f"{who}; no last-gasp checkpoint: {describe(self.corrupt)} (silent data corruption since the "
                    "last check: every replica may carry it through the gradients); resume (--resume auto) falls "
                    "back to the last periodic checkpoint, compared before it was saved")
        if self.step is None and not self.lost:
            return (f"{who}; the last-gasp checkpoint is off (tft.ttp, or MS_ENABLE_TFT='{{TTP:1}}'); "
                    "resume (--resume auto) from the last periodic checkpoint")
        if self.step is None:
            sets = "; ".join(f"the slices of ranks {g}" + (f" ({where})" if where else "")
                             for g, where in zip(self.lost, self.stages or [None] * len(self.lost)))
            return (f"{who}; no last-gasp checkpoint: {sets} have no surviving holder; resume (--resume auto) "
                    "falls back to the last periodic checkpoint")
        if self.existing:
            return (f"{who}; last-gasp checkpoint {self.name} (global step {self.step}) was already committed in "
                    f"{self.directory}; resume (--resume auto) continues at step {self.step + 1}")
        from .sdc import not_compared
        alone = not_compared(self.unverified)
        return (f"{who}; last-gasp checkpoint {self.name} (global step {self.step}) committed in "
                f"{self.directory} by {self.survivors} survivors, {self.ms:.0f} ms after the failure was noticed; "
                + (f"{alone}; " if alone else "") + (f"{self.from_copies()}; " if self.copied else "")
                + (f"step {self.newest} not saved: rank(s) {', '.join(map(str, self.unfinished))} had not finished "
                   "it, the only survivors holding their slices; " if self.unfinished else "")
                + f"resume (--resume auto) continues at step {self.step + 1}")

    def from_copies(self) -> str:
        """Which ranks' state came from peer copies, and the steps that lost."""
        ranks, keepers = sorted(self.copied), [self.copied[r] for r in sorted(self.copied)]
        lost = self.newest - self.step
        return (f"the state of rank(s) {', '.join(map(str, ranks))} from peer copies in the memory of rank(s) "
                f"{', '.join(map(str, keepers))}, {lost} step(s) lost (the survivors had step {self.newest})")


def lost_stages(run, lost) -> list:
    """With pipeline stages, what each lost replica set held: "pipeline stage s: its parameters"."""
    layout = run.groups.layout
    if layout.pipeline_stage == 1:
        return []
    out = []
    for ranks in lost:
        stage = layout.coords(ranks[0]).stage
        names = [spec.name for spec in run.network.specs if spec.stage == stage]
        out.append(f"pipeline stage {stage}: " + ", ".join(names[:4]) + (f", … ({len(names)} parameters)"
                                                                         if len(names) > 4 else ""))
    return out


def without_checkpoint(run, damaged: bool, noticed_at: float) -> Outcome:
    """With the last gasp off: the survivors only agree on who failed, and whose memory failed (damaged: this
    rank's), so that one line says it (collective over the living ranks)."""
    revoke_groups(run.groups)
    comm, failed = survivors(run.groups.world, run.runtime)
    quorum.check(run.groups, comm)  # a side of a network cut without a quorum of the hosts stops here
    me = run.groups.world.rank
    reports = comm.allgather((me, bool(damaged), broke_deadlock(noticed_at)))
    hit = sorted(r for r, d, _ in reports if d)
    return Outcome(failed, hit, survivors=comm.size, lead=comm.rank == 0, cut=run.runtime.cut_at is not None,
                   other_error=not failed and not hit and not any(b for *_, b in reports) and run.runtime.cut_at is None)


def save(run, noticed_at: float) -> Outcome:
    """Write and commit the last-gasp checkpoint from the survivors (collective over the living ranks). Its
    progress is watched (tft.hang_timeout): a survivor frozen or stuck in it (a write that never returns) is
    killed, and the others start again without it."""
    with progress.watched("last gasp"):
        copies = run.peer_copies if run.cfg.tft.peer_copy_every else None
        if copies is not None and copies.comm is not None:
            copies.settle()  # a copy whose data all arrived is complete; then its communicator is revoked too
            revoke(copies.comm)
        revoke_groups(run.groups)
        states = run.optimizer.states()
        sets = replica_sets(run.groups.layout)
        for attempt in range(ATTEMPTS):
            comm, failed = survivors(run.groups.world, run.runtime)  # (a shrink; after a network cut, its side)
            quorum.check(run.groups, comm)  # before anything is written: a side of a cut without the quorum stops
            try:
                out = _attempt(run, comm, failed, states, sets, noticed_at)
                out.cut = run.runtime.cut_at is not None  # (its line says so: the launcher reads it, launcher.CUT_MARK)
                return out
            except MPI.Exception:
                if attempt == ATTEMPTS - 1:
                    raise
                revoke(comm)  # another rank died during the last gasp: everyone starts again from the shrink
        raise AssertionError("unreachable")


def _attempt(run, comm, failed, states, sets, noticed_at) -> Outcome:
    me = run.groups.world.rank
    seen = survey(comm, me, states, noticed_at)
    damaged = seen.damaged
    if not failed and not damaged and not seen.deadlock:  # everyone alive and whole: an MPI error of another kind
        return Outcome(failed, survivors=comm.size, lead=comm.rank == 0, other_error=True)
    p = seen.plan(sets)
    copies = run.peer_copies if run.cfg.tft.peer_copy_every else None
    if p.step is None and p.lost and copies is not None and copies.comm is not None:
        p = plan_from_copies(run, comm, me, copies, states, sets) or p
    corrupt = compare_replicas(run, comm, me, states, sets, p.step) if p.step is not None else []
    if corrupt:
        agree(comm, 1)
        if comm.rank == 0:
            event("sdc", any_rank=True, global_step=p.step, found=corrupt, at="last_gasp")
            event("last_gasp_lost", any_rank=True, failed=failed, lost=[f["holders"] for f in corrupt])
        return Outcome(failed, damaged, corrupt=corrupt, survivors=comm.size, lead=comm.rank == 0)
    if p.step is None:
        agree(comm, 1)  # nothing is written: just agree that all know
        out = Outcome(failed, damaged, lost=p.lost, stages=lost_stages(run, p.lost), survivors=comm.size,
                      lead=comm.rank == 0)
        if comm.rank == 0:
            event("last_gasp_lost", any_rank=True, failed=failed, lost=p.lost)
        return out
    unverified = unverified_sets(run, seen, sets, p.step)
    spe = run.loader.get_dataset_size()
    epoch, in_epoch = epoch_and_step(p.step, spe)
    directory = checkpoint_dir(run.ttp_dir, p.step)
    name = f"{PREFIX}-{epoch}_{in_epoch}"
    record_path = cm.commit_path(directory, name)
    if record_path.exists():  # saved before (a failure in the first step after resuming from it, or the
        # committer died after committing): never overwrite it
        agree(comm, 1)
        return Outcome(failed, damaged, p.step, directory, name, survivors=comm.size, lead=comm.rank == 0,
                       existing=True)
    writes = [r for r, writer in sorted(p.writers.items()) if writer == me]
    layout = run.groups.layout
    newest, unfinished = held_back(seen.offers, sets)
    if p.copied:
        unfinished = []  # (the copies' own line says it)
    elif not unfinished:
        newest = None
    from_copies = {"peer_copies": {"ranks": {str(r): k for r, k in sorted(p.copied.items())}, "newest_step": newest,
                                   "steps_lost": newest - p.step}} if p.copied else {}
    commit = sv.Commit(directory, name, PREFIX, epoch, in_epoch, p.step,
                       lambda: save_plan(layout, run.network.specs, slots(run.optimizer)),
                       template=file_name(RANK, epoch, in_epoch), host_of=_hosts(run.groups),
                       extra={"last_gasp": {"failed": failed,
                                            "writers": {str(r): w for r, w in sorted(p.writers.items())},
                                            **({"unverified": unverified} if unverified else {}), **from_copies}})
    outcome = sv.save(Survivors(comm), lambda: [_write(run, directory, r, p.step, *_source(run, states, r, p))
                                                for r in writes],
                      commit, describe=lambda e: f"rank {me}: {type(e).__name__}: {e}").outcome
    if outcome.failed:  # a disk error (of a file, or of the commit record): every survivor knows it
        raise RuntimeError(f"last-gasp checkpoint of step {p.step} not saved: {outcome.failed[min(outcome.failed)]}")
    out = Outcome(failed, damaged, p.step, directory, name, survivors=comm.size,
                  ms=1000 * (time.time() - seen.first_noticed),
                  lead=comm.rank == 0, unverified=unverified, copied=p.copied, newest=newest, unfinished=unfinished)
    if comm.rank == 0:
        event("last_gasp_saved", any_rank=True, failed=failed, global_step=p.step, checkpoint=name,
              directory=str(directory), ms=round(out.ms, 1), noticed_at=seen.first_noticed,
              **({"unverified": unverified} if unverified else {}), **from_copies,
              **({"unfinished": {"ranks": unfinished, "newest_step": newest}} if unfinished else {}))
    return out


def _hosts(groups):
    """Each rank's host before the failure (the record's `hosts`: record.py), when known; else None."""
    hosts = getattr(groups, "hosts", None)
    if hosts is None or len(hosts.names) != groups.layout.world_size:
        return None
    return hosts.names


class Survivors(sv.World):
    """The save's collective phases over the survivors (the shrunk world): each outcome is agreed first
    (MPI_Comm_agree: the same answer on every survivor, even through further failures); a failure of one of
    them raises MPI.Exception, and the last gasp starts again from the shrink."""

    def gather(self, report) -> list:
        agree(self.comm, int(report[0] is None))  # (the reports then bring the files' sizes and digests, or errors)
        return super().gather(report)

    def ready(self) -> None:
        """Nothing: the agreement and the gather were the last collectives before the commit."""

    def share(self, error):
        """The committer's error, or None once every survivor agreed that it is past the commit."""
        if agree(self.comm, int(error is None)):
            return None
        return super().share(error)


def compare_replicas(run, comm, me: int, states: dict, sets, step: int) -> list:
    """With tft.sdc_check_every: the slices of `step` whose surviving holders differ (collective over comm);
    [] without it, or when they agree."""
    if not run.cfg.tft.sdc_check_every:
        return []
    from .sdc import differing_in_sets, state_digests
    mine = state_digests(run.optimizer, states[step]) if step in states else None
    held = {r: digests for r, digests in run.runtime.collective(comm.allgather, (me, mine)) if digests is not None}
    return differing_in_sets(held, sets)


def unverified_sets(run, seen: Survey, sets, step: int) -> list:
    """With tft.sdc_check_every: the replica sets whose slices of `step` only one survivor holds (one whose memory
    failed holds nothing). Nothing can be compared for them: a bit flipped there since the last check is saved
    (or, by a repair in the job, copied) with them, and stays unfound (its one replica is gone; the state
    restored from it is the same on every holder after the resume or the repair)."""
    if not run.cfg.tft.sdc_check_every:
        return []
    return [g for g in sets if len(g) > 1 and sum(step in seen.offers.get(r, ()) for r in g) == 1]


def plan_from_copies(run, comm, me, copies, states, sets) -> Optional[Plan]:
    """With peer copies, when some slice has no living holder: the newest step at which every rank's state is held,
    by itself (its live state or a snapshot), a living replica, or the living keeper of its copy (dsim.ft.peer_copy.plan;
    collective over comm), or None."""
    from .peer_copy import plan as copy_plan
    offers = run.runtime.collective(comm.allgather, (me, copies.offer(states)))
    found = copy_plan({r: own for r, (own, _) in offers}, {r: kept for r, (_, kept) in offers}, sets,
                      run.groups.layout.world_size)
    return Plan(found.step, found.writers, copied=found.copied) if found is not None else None


def _source(run, states, rank, p) -> tuple:
    """(arrays, tensors) rank's file is written from: this survivor's state of the step (live or a snapshot: rank's
    slices = this rank's), or the copy of rank's state it keeps."""
    if rank in p.copied:
        return None, run.peer_copies.copy_tensors(p.step)
    return (states[p.step] if p.step in states else run.peer_copies.snapshot(p.step)), None


def _write(run, directory, rank, step, arrays, tensors=None) -> sv.Write:
    """rank's file of the state after `step`, from this survivor's memory (rank's slices = this rank's), or from
    `tensors` (the copy of rank's state it keeps: dsim.ft.peer_copy)."""
    epoch, in_epoch = epoch_and_step(step, run.loader.get_dataset_size())
    me = run.groups.world.rank
    w = state_file(directory / file_name(rank, epoch, in_epoch), run.model,
                   tensors if tensors is not None else state_tensors(run.network, run.optimizer, arrays), rank, step,
                   epoch, PREFIX, run.cfg.checkpoint.append_info, last_gasp=True)
    w.on_half_written = lambda: faults.during_last_gasp(me, step, run.runtime)
    return w
