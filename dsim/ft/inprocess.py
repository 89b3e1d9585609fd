"""In-process fast recovery: repair a rank from its replica without restarting the job.

Two faults are repaired in the running job (tft.uce, tft.arf), in the same processes:
- an uncorrectable memory error (UCE, MindSpore's UCE fast recovery): the rank's parameter and optimizer
  buffers are garbage, but the process lives;
- a dead process (MindSpore's ARF, process-level rebuild): the survivors spawn a replacement and merge it
  into a world of the full size again.

On every rank, at the first MPI call that fails (or the UCE itself):
1. revoke every communicator (all ranks stop at a safe point: their current or next MPI call) and shrink;
2. agree, as the last gasp does, on the newest step every replica set holds consistently (the damaged rank
   offers nothing); no such step means no repair: the caller falls back to the last-gasp checkpoint, and
   that failing too, to the periodic one;
3. with a dead rank, give its place to a warm spare (tft.spares, see spares), or spawn a replacement when no
   spare is left, and order the new world as the old one; a newcomer builds its model without initial
   values (step 4 fills every slice);
4. every rank that lacks the agreed state ("clean": fresh buffers) receives its owned slices of parameters
   and optimizer state from a replica chosen by the plan, point to point; the others roll back to it;
5. the interrupted step is redone and training goes on; the log names the ranks, the replica and the times.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .. import faults
from ..checkpoint.group_info import group_info, replica_sets
from ..config import ConfigError, FaultConfig, config_from_dict
from ..log import event, say
from ..faults import UCEError
from ..parallel.groups import Groups
from ..parallel.layout import LayoutError
from ..runtime import PROCESS
from . import cut, elastic, quorum, spares as warm, ulfm
from .hang import went_on_alive
from .in_place import InPlace
from .last_gasp import survey, unverified_sets
from .sdc import not_compared

TAG = 0xAF


class CannotRepair(Exception):
    """The fault cannot be repaired in the job; the message says why. Every living rank raises it alike."""

    def __init__(self, message: str, lead: bool):
        super().__init__(message)
        self.lead = lead  # the lowest living rank, which reports it


class RepairInterrupted(CannotRepair):
    """Another rank failed during a repair in the job: every living rank falls back to the last gasp alike, whose
    lowest living rank says so (only the last gasp knows who lives then)."""

    def __init__(self, what: str, failed: list):
        super().__init__(f"{what}; another rank failed during the repair", lead=False)
        self.what, self.failed = what, failed


class FailedAtTheEnd(Exception):
    """A rank that had finished training learnt, in the shrink that ends it (InProcessRecovery.leave), that
    another failed: it joins the repair the ranks that noticed inside the loop began, from the same shrunk world
    and survey (every living rank holds the same)."""

    def __init__(self, comm, failed: list, seen):
        super().__init__(describe(failed, seen.damaged) + ", at the end of training")
        self.comm, self.failed, self.seen = comm, failed, seen


class InProcessRecovery:
    """Model.recovery: repairs UCEs (tft.uce) and dead ranks (tft.arf) inside the training loop."""

    def __init__(self, run):
        self.run = run
        self.pending = None  # (time of the fault, what, whether this rank says it) until the next step finishes
        self.idle = []       # (comm, its ranks left over) of every elastic shrink: released at the end
        self.watches = ulfm.unavailable_reason() is None  # ranks stop at their next layer once the world is revoked
        self.in_place = None
        if run.cfg.tft.uce and run.cfg.tft.uce_in_place and self.watches:
            self.in_place = InPlace(run, lambda t: setattr(self, "pending", (t, "uce", True)))

    @property
    def serve(self):
        """What answers a damaged replica's request at every layer (None: no rank repairs in place)."""
        return self.in_place.serve if self.in_place is not None and self.in_place.armed() else None

    def handles(self, exc) -> bool:
        """Faults it may repair: a UCE, or any MPI error (a dead rank shows as several kinds), under ULFM, and a
        pickled collective that a death cut short (ulfm.cut_short: its unpickling error is a death's, so the rank
        joins the repair instead of crashing). With nobody dead, the repair raises it again as it was (not a fault
        to repair)."""
        return (isinstance(exc, (UCEError, MPI.Exception, FailedAtTheEnd)) and ulfm.unavailable_reason() is None
                or ulfm.cut_short(exc))

    def leave(self) -> None:
        """Training ended on this rank (the loop and the `finishing` hooks): every living rank agrees before any
        goes past. A rank that dies in the last step or the final save is noticed by some ranks inside and not
        by those past it (a collective may complete on some ranks and fail on others); those inside begin a
        repair, whose first collective, the shrink of the world, is this one's: the same survey then tells the
        ranks here to join it (FailedAtTheEnd). Nothing failed: a shrink and an all-gather, once a train()."""
        t, world, runtime = time.time(), self.run.groups.world, self.run.runtime
        comm, failed = cut.survivors(world, runtime)
        seen = survey(comm, world.rank, self.run.optimizer.states(), t)
        if failed or seen.damaged:
            raise FailedAtTheEnd(comm, failed, seen)
        comm.Free()

    def step_finished(self, global_step: int) -> None:
        """Log the time from a repaired fault to the next finished step (once)."""
        if self.pending is not None:
            t, what, speaks = self.pending
            self.pending = None
            seconds = time.time() - t
            if speaks:
                say(f"dsim: {what}: step {global_step} finished {seconds * 1000:.0f} ms after the fault")
                event("recovered", any_rank=True, global_step=global_step, seconds=round(seconds, 4), fault=what)

    def recover(self, exc, callbacks) -> int:
        """Repair the job in place; returns the global step training goes on from. Collective over the living.

        Work watched (tft.hang_timeout: dsim.ft.hang), its collectives waits: a rank frozen during the repair, or
        stuck in it (its process runs, its repair does not), is killed, and the repair, like one that another death
        interrupts, falls back to the last gasp (RepairInterrupted). The repair is work and its collectives are
        waits, not one long wait: a rank stuck in it is then judged stuck, also where the others wait for it in the
        exchange's MPI_Comm_agree, which no revoke ends (a deadlock's break could not free them there)."""
        with self.run.runtime.progress.watched("repair"):
            return self._recover(exc, callbacks)

    def _recover(self, exc, callbacks) -> int:
        t = time.time()
        run, cfg = self.run, self.run.cfg.tft
        old, runtime = run.groups, run.runtime
        ulfm.revoke_groups(old)
        if isinstance(exc, FailedAtTheEnd):  # past the loop: the world shrunk and surveyed already, with the others
            comm, failed, seen = exc.comm, exc.failed, exc.seen
        else:
            comm, failed = cut.survivors(old.world, runtime)  # (a shrink; after a network cut, its side)
            seen = survey(comm, old.world.rank, run.optimizer.states(), t)  # a memory-failed rank offers nothing
        quorum.check(old, comm)  # a side of a network cut without a quorum of the hosts stops: no repair, no gasp
        if runtime.cut_at is not None:  # the other side's ranks live on unreachable: no world is made without them
            raise CannotRepair("a network cut: the hosts cut off are not failed to MPI, so no repaired world can be "
                               "made without them", comm.rank == 0)
        damaged, t_fault = seen.damaged, seen.first_noticed
        if not failed and not damaged and not seen.deadlock:
            raise exc  # an MPI error with every rank alive and whole: not a fault to repair
        what = describe(failed, damaged) or "a deadlock was broken, every rank alive"
        lead = comm.rank == 0
        if failed and not cfg.arf and not cfg.elastic:
            raise CannotRepair(f"{what}; replacing a dead process is off (tft.arf)", lead)
        if damaged and not cfg.uce:
            raise CannotRepair(f"{what}; repairing a memory error is off (tft.uce)", lead)
        layout = old.layout
        p = seen.plan(replica_sets(layout))
        if p.step is None:
            sets = "; ".join(f"ranks {g}" for g in p.lost)
            raise CannotRepair(f"{what}; it cannot be repaired: no healthy rank holds the slices of {sets}", lead)
        if failed and not cfg.arf:   # tft.elastic: go on with fewer ranks
            return self._continue_smaller(comm, failed, p, t_fault, what, lead)
        t0 = time.time()
        world, filled = comm, None
        try:
            faults.during_repair(old.world.rank, p.step, "refill", runtime)
            if failed:  # (a spawn, the pool's collectives)
                filled = runtime.collective(self._refill, comm, failed, p, callbacks, t_fault)
                world = filled.world
            groups = runtime.collective(Groups, world, layout, runtime)  # (the new groups' splits)
            faults.during_repair(old.world.rank, p.step, "exchange", runtime)
        except (MPI.Exception, warm.RefillFailed):
            ulfm.revoke(comm, world)  # another failure during the repair: nobody may wait on the new world
            raise RepairInterrupted(what, failed) from None  # (the caller falls back to the last gasp)
        if not restore(groups, p.writers, run.optimizer, p.step):
            ulfm.revoke(comm)
            raise RepairInterrupted(what, failed)
        run.groups = run.model.groups = groups
        self.pending = (t_fault, "heal" if failed else "uce" if damaged else "deadlock", groups.world.rank == 0)
        if not failed and not damaged:  # the same job deadlocking again is ended, not broken (dsim.ft.hang)
            went_on_alive(runtime)
        if lead:  # the lowest survivor (a replacement may be rank 0 now)
            donors = ", ".join(f"rank {r} from rank {w} (group info {group_info(layout, r)})"
                               for r, w in sorted(p.writers.items()) if w != r) or "every rank from its own state"
            size = f"; world size back to {world.size}" if failed else ""
            if filled is not None and filled.by_spare:
                size += (f" (rank(s) {', '.join(map(str, filled.by_spare))} taken by a warm spare, "
                         f"{len(filled.pool.spares)} left{'; the others spawned' if filled.spawned else ''})")
            alone = unverified_sets(run, seen, replica_sets(layout), p.step)  # (with tft.sdc_check_every)
            say(f"dsim: {self.pending[1]}: {what}; repaired in the job: {donors}{size}; training goes on after "
                f"step {p.step} (repair took {1000 * (time.time() - t0):.0f} ms)"
                + (f"; {not_compared(alone)}" if alone else ""))
            event("heal" if failed else "uce_repair" if damaged else "deadlock_repair", any_rank=True, failed=failed,
                  damaged=damaged, global_step=p.step, donors={str(r): w for r, w in p.writers.items() if w != r},
                  world_size=world.size, repair_ms=round(1000 * (time.time() - t0), 1),
                  **({"unverified": alone} if alone else {}),
                  **({"by_spare": filled.by_spare, "spawned": filled.spawned, "spares_left": len(filled.pool.spares)}
                     if filled is not None else {}))
        return p.step

    def _continue_smaller(self, comm, failed, p, t_fault, what, lead) -> int:
        """tft.elastic (dsim.ft.elastic): the living go on in a smaller layout; those left over wait idle."""
        run, t0 = self.run, time.time()
        old, old_ranks = run.groups.layout, ulfm.world_ranks(comm, run.groups.world)
        try:
            new, fresh = run.runtime.collective(elastic.continue_smaller, run, comm, p,
                                                lambda layout: elastic.new_config(run.cfg, layout))
        except (LayoutError, ConfigError) as e:
            raise CannotRepair(f"{what}; it cannot go on with fewer ranks: {e}", lead) from None
        except MPI.Exception:
            ulfm.revoke(comm)  # another failure during the move: the caller falls back to the last gasp
            raise RepairInterrupted(what, failed) from None
        idle = list(range(new.world_size, comm.size))
        if fresh is None:
            raise elastic.Idle(comm)
        self.idle.append((comm, idle))
        elastic.adopt(run, fresh, elastic.new_config(run.cfg, new))
        self.pending = (t_fault, "elastic", run.groups.world.rank == 0)
        if lead:
            ms = elastic.elapsed_ms(t0)
            waiting = (f"; rank(s) {', '.join(str(old_ranks[r]) for r in idle)} of the living wait "
                       f"idle" if idle else "")
            say(f"dsim: elastic: {what}; no replacement: going on with {new.world_size} of {comm.size} living ranks as "
                f"{new.describe()} (was {old.describe()} on {old.world_size}){waiting}; training goes on after step "
                f"{p.step} (took {ms:.0f} ms)")
            event("elastic", any_rank=True, failed=failed, global_step=p.step, layout=new.to_dict(), old_layout=old.to_dict(),
                  world_size=new.world_size, living=comm.size, idle=len(idle), ms=round(ms, 1))
        return p.step

    def release_idle(self) -> None:
        """At the end of training, rank 0 lets the processes left over by elastic shrinks go."""
        if self.idle and self.run.groups.world.rank == 0:
            elastic.release_idle(self.idle)

    def _refill(self, comm, failed, p, callbacks, t_fault):
        """Fill the dead ranks' places from the warm spares, else by spawning, and order the new world (ARF)."""
        run = self.run
        joining = {"cfg": run.cfg.to_dict(), "ranks": failed, "world_size": run.groups.world.size,
                   "step": p.step, "writers": p.writers,
                   "fault_time": t_fault,
                   "callbacks": {type(c).__name__: c.join_state() for c in callbacks if hasattr(c, "join_state")}}
        pool = run.spares
        living = comm if pool.comm is run.groups.world else None  # that pool is revoked and shrunk already
        if living is None:
            pool.revoke()  # wakes the waiting spares
        filled = warm.refill(pool, run.groups.world.rank, joining, living)
        run.spares = filled.pool
        return filled


def describe(failed, damaged) -> str:
    parts = []
    if failed:
        parts.append(f"rank(s) {', '.join(map(str, failed))} died")
    if damaged:
        parts.append(f"rank(s) {', '.join(map(str, damaged))} had an uncorrectable memory error (UCE)")
    return " and ".join(parts)


def restore(groups, writers: dict, optimizer, step: int) -> bool:
    """Every rank of the new world holds `step`'s state (exchange, then whole model-parallel slices from the owned
    parts), or none goes on: whether it worked, the same answer on every living rank (MPI_Comm_agree), even when
    a rank dies during it. A rank whose exchange failed revokes the world first: nobody waits for its messages.
    A wait (for the writers, or the receivers, and the agreement): a deadlock here is every process waiting, and a
    rank stuck outside it is judged stuck (dsim.ft.hang)."""
    return groups.runtime.collective(_restore, groups, writers, optimizer, step)


def _restore(groups, writers: dict, optimizer, step: int) -> bool:
    ok = 1
    try:
        exchange(groups, writers, optimizer, step)
        optimizer.sync(groups.shard)
    except MPI.Exception:
        ok = 0
        ulfm.revoke_groups(groups)
    try:
        return bool(ulfm.agree(groups.world, ok))
    except MPI.Exception:
        ulfm.revoke_groups(groups)
        return False


def exchange(groups, writers: dict, optimizer, step: int) -> None:
    """Ranks that lack `step`'s state get fresh buffers and receive their owned slices from their writer.

    The others roll back to `step` (it is one of their states) and send. A rank whose memory failed outside
    an update keeps the buffers the error did not hit (OptTFTWrapper.intact) and receives only the others:
    each receiver first tells its writer which arrays it needs (a mask). Arrays go in the order of
    OptTFTWrapper.owned_arrays, which replicas share, one message each. Nothing is pickled: a pickled receive is
    a matched probe (MPI_Mprobe) in mpi4py, whose failure handling in Open MPI's ob1 lags a plain receive's.
    """
    comm, me = groups.world, groups.world.rank
    requests, staged = [], []  # (staged: a non-contiguous array received into a buffer, then copied)
    writes = writers.get(me, me) == me
    if writes:
        optimizer.restore(step)
        owned = [arr for _, arr in optimizer.owned_arrays()]
        wanted = np.empty(len(owned), dtype=np.uint8)
        for r, w in sorted(writers.items()):
            if w == me and r != me:
                ulfm.complete([comm.Irecv(wanted, source=r, tag=TAG - 1)], comm)
                for i in np.flatnonzero(wanted):
                    requests.append(comm.Isend(np.ascontiguousarray(owned[i]), dest=r, tag=TAG + int(i)))
    else:
        keep = optimizer.intact(step)
        optimizer.reallocate(keep)
        owned = list(optimizer.owned_arrays())
        needed = [(i, arr) for i, (name, arr) in enumerate(owned) if name not in keep]
        mask = np.array([name not in keep for name, _ in owned], dtype=np.uint8)
        requests.append(comm.Isend(mask, dest=writers[me], tag=TAG - 1))
        for i, arr in needed:
            into = arr if arr.flags.c_contiguous else np.empty(arr.shape, dtype=arr.dtype)
            requests.append(comm.Irecv(into, source=writers[me], tag=TAG + i))
            if into is not arr:
                staged.append((arr, into))
    ulfm.complete(requests, comm)  # (not blocking calls: ulfm.complete says why)
    for arr, into in staged:
        arr[...] = into
    if not writes:
        optimizer.received(step)


def join_spawned(parent, factory):
    """A replacement spawned by the survivors of a dead rank (no spare was left): (run, step, joining); factory: how
    runs are made (dsim.engine.run.Factory)."""
    warm.connected_to_spawned()
    merged = parent.Merge(high=True)
    joining = merged.bcast(None, root=0)
    warm.connect_all(merged)
    rank = joining["assign"][merged.rank]
    world = merged.Split(0, key=rank)
    return take_place(world, warm.SparePool(merged, joining["spares"]), joining, factory)


def take_place(world, pool, joining, factory):
    """A newcomer (a spare, or spawned) takes a dead rank's place in `world`: (run, step, joining).

    Its model is built without initial values: every owned slice is received from a replica. Its joining is work
    watched (dsim.parallel.progress) from its heartbeat on: a newcomer stuck before the exchange (its process runs) is
    found by the survivors' watches as a stuck rank is (a newcomer waits for no one, so it would make no deadlock
    for the watch to break either).
    """
    with PROCESS.progress.watched("repair"):  # (the process's: it has no run yet)
        return _take_place(world, pool, joining, factory)


def _take_place(world, pool, joining, factory):
    from .hang import standby_heartbeat
    cfg = config_from_dict(joining["cfg"])
    # watched from now until its training heartbeat begins (a spare's goes on): frozen here, it is killed
    standby_heartbeat(cfg.output.dir, joining["world_size"], cfg.tft.hang_timeout, "newcomer")
    f = cfg.fault
    # a new, healthy process: a fault of a rank (fault.rank) was its predecessor's, not its own; a fault plan's
    # entries fire once in the whole campaign, and a fault of every rank (the LeNet page's exception at the end
    # of epoch 6) is the job's: the newcomer keeps those, or it trains on alone when the others stop
    job_wide = f.kind == "plan" or (f.kind == "exception" and f.rank is None)
    cfg.fault = f if job_wide else FaultConfig()
    run = PROCESS.collective(factory.build, cfg, world, initialize=False)  # (its groups' splits, with the survivors')
    run.spares = pool
    step = joining["step"]
    faults.newcomer_in_repair(f, world.rank, step)
    if not restore(run.groups, joining["writers"], run.optimizer, step):
        raise RepairInterrupted(f"rank(s) {', '.join(map(str, joining['ranks']))} died", joining["ranks"])
    run.loader.set_init_step(step)
    run.model.recovery.pending = (joining["fault_time"], "heal", run.groups.world.rank == 0)
    return run, step, joining
