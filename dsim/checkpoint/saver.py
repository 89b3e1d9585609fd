"""ModelCheckpoint: the callback that saves sharded (or integrated) checkpoints: when to save, retention, and what a
failed save does (checkpoint.on_save_error). The saving itself (plan, write, commit) is save.save's."""
from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .. import faults
from ..engine.callbacks import Callback
from ..log import event, say
from ..parallel import progress
from . import commit as cm, lease
from .config import CheckpointConfig
from .errors import CheckpointError
from .async_save import Snapshot
from .group_info import group_info, write_group_info
from .plan import graph_meta, save_plan
from .save import (Background, Commit, Saving, World, append_info, epoch_and_step, error_text, integrated,  # noqa: F401
                   resume_meta, save, slots, state_file, state_tensors)  # (append_info, epoch_and_step, resume_meta: as before)


class SaveError(CheckpointError):
    """A checkpoint that could not be written (disk full, read-only, permission...): one line, nothing committed."""


ON_SAVE_ERROR = ("stop", "continue")


def _size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def free_space(directory) -> str:
    """'1.2 MiB free of 2.0 MiB' on the file system of directory (or of its nearest existing parent)."""
    p = Path(directory).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return "free space unknown"
    return f"{_size_text(usage.free)} free of {_size_text(usage.total)}"


def _ranks_text(ranks) -> str:
    """0-7, or 0, 3, 5."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def check_writable(directory) -> None:
    """Raise SaveError (one line) unless a file can be created in directory (made if missing).

    Called before training so a run that would save into a read-only, vanished or forbidden directory
    says so before its first step.
    """
    directory = Path(directory)
    probe = directory / f".dsim-write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise SaveError(f"cannot save checkpoints in {directory}: {error_text(e)} ({free_space(directory)}); "
                        f"save elsewhere (checkpoint.directory), and to resume from its checkpoints, --resume-from "
                        f"{directory}") from None


@dataclass
class _Pending:
    """A save started and not yet committed: its name and step, and the save in flight (save.Saving)."""

    name: str
    epoch: int
    step_in_epoch: int
    step: int
    started: float
    saving: Optional[Saving] = None


class ModelCheckpoint(Callback):
    """Save checkpoints into `directory` as `prefix-{epoch}_{step}` (MindSpore's callback).

    integrated_save=False: <dir>/rank_<r>/<name>.h5 per rank, with only that rank's slices;
    integrated_save=True: <dir>/<name>.h5 with full tensors, written by rank 0.
    Either way <dir>/<name>.commit, written last, is what makes the checkpoint exist.
    """

    def __init__(self, prefix: str = "CKP", directory=None, config: CheckpointConfig = None,
                 group_info_file=None, on_save_error: str = "stop", lease=None):
        if on_save_error not in ON_SAVE_ERROR:
            raise CheckpointError(f"checkpoint: on_save_error must be stop or continue, got {on_save_error!r}")
        self.on_save_error = on_save_error
        self.requested_prefix = prefix
        self.directory = Path(directory or ".")
        self.config = config or CheckpointConfig()
        self.group_info_file = group_info_file or os.environ.get("GROUP_INFO_FILE")
        self.prefix = None
        self.last_saved_step = None    # the step of the newest save committed or in flight
        self.committed_step = None     # the step of the newest save committed
        self.last_failed_step = None   # a save refused by the storage (on_save_error: continue) is not retried at once
        self.saved = []
        self.pending = None            # async_save: the save in flight (async_save._Pending), not yet committed
        self.snapshot = Snapshot()     # async_save: the reused copy of the state the thread writes from
        self.stalls = []               # seconds each save held up its step (sync: all of it; async: the snapshot)
        self.rank = None
        self.begun_step = None         # the global step training began from (no save of it at the end: not trained)
        self.lease = lease             # rank 0: the directory's lease (lease.py), taken at begin when not given
        self.before_save = []          # collective checks f(cb) every save runs first (dsim.ft.sdc.SdcCheck.check)
        self.own_lease = False         # taken by this callback: given back at the end of training
        self.records = {}              # rank 0: the commit records listed at the last save (commit.committed's cache)

    # -- callback hooks ------------------------------------------------------------------------------
    def begin(self, run_context):
        cb = run_context.original_args()
        comm, layout = cb.model.groups.world, cb.model.groups.layout
        self.rank = cb.rank
        if self.config.integrated_save and layout.pipeline_stage > 1:  # (every rank alike, before any collective)
            raise CheckpointError(f"integrated_save with {layout.pipeline_stage} pipeline stages: the one file of "
                                  "whole tensors is written by rank 0, which holds only the first stage's layers; "
                                  "save sharded and merge the shards (python -m dsim.inspect --merge)")
        self.begun_step = cb.cur_step_num
        prefix, names, in_use = None, None, None
        if cb.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.lease is None or not self.lease.covers(self.directory):
                try:  # another job writing here: nothing is touched (the leftovers cleaned below may be its files)
                    self.lease, self.own_lease = lease.take(self.directory), True
                except lease.DirectoryInUse as e:
                    in_use = str(e)
            if in_use is None:
                prefix = cm.unique_prefix(self.directory, self.requested_prefix)
                names = {r["name"] for r in cm.committed(self.directory, self.records)}
        self.prefix, names, in_use = comm.bcast((prefix, names, in_use), root=0)  # one rank reads the records
        if in_use:
            raise lease.DirectoryInUse(in_use)
        error = None
        try:
            cm.clean_leftovers(self.directory, cb.rank, names)
            write_group_info(cm.rank_dir(self.directory, cb.rank) / "group_info.json", layout, cb.rank)
            if self.group_info_file:
                write_group_info(self.group_info_file, layout, cb.rank)
            if cb.rank == 0:
                cm.write_json_atomic(self.directory / f"{self.prefix}-graph.meta",
                                     graph_meta(self.prefix, layout, cb.network.specs, slots(cb.optimizer)))
        except OSError as e:  # every rank must learn of it, or the others wait in the barrier forever
            error = error_text(e)
        failed = {r: e for r, e in enumerate(comm.allgather(error)) if e}
        if failed:
            raise SaveError(f"cannot write to the checkpoint directory {self.directory}: "
                            + self._summary(failed) + f" ({free_space(self.directory)})")
        if self._staging() == "memory":  # the snapshot buffer, touched now
            for t in self.snapshot.take(state_tensors(cb.network, cb.optimizer)):
                t.data.fill(0)

    def join_state(self) -> dict:
        """What a replacement process needs to save with this job (see dsim.ft.inprocess)."""
        return {"prefix": self.prefix, "last_saved_step": self.committed_step, "saved": list(self.saved)}

    def join(self, run_context, joining: dict) -> None:
        """begin() for a replacement process entering a running job: take the job's state, no collectives."""
        state = joining["callbacks"][type(self).__name__]
        self.prefix, self.last_saved_step, self.saved = state["prefix"], state["last_saved_step"], state["saved"]
        self.committed_step = self.last_saved_step
        cb = run_context.original_args()
        self.rank = cb.rank
        self.begun_step = None  # the job it joins began training before: its last step saves as the others' does
        write_group_info(cm.rank_dir(self.directory, cb.rank) / "group_info.json", cb.model.groups.layout, cb.rank)

    def recovered(self, run_context):
        """After an in-job repair back to a step whose checkpoint was due but interrupted: save it now.

        An async save still in flight is abandoned first (the job it was started in is gone)."""
        cb = run_context.original_args()
        note = self.abandon("an in-job repair took over")
        if cb.rank != self.rank:  # an elastic shrink renumbered the ranks: this rank's group info is new
            self.rank = cb.rank
            write_group_info(cm.rank_dir(self.directory, cb.rank) / "group_info.json", cb.model.groups.layout, cb.rank)
        # every rank of the repaired world is here (a replacement too, which had no save in flight): rank 0 says it
        notes = [n for n in cb.model.groups.world.allgather(note) if n]
        if notes and cb.rank == 0:
            say(notes[0])
        if cb.cur_step_num and self.config.due(cb.cur_step_num, cb.batch_num) and not self._committed_before(cb):
            self.save(cb)

    def _committed_before(self, cb) -> bool:
        """Whether the checkpoint of the step a repair went back to was committed before the failure, alike on
        every rank of the repaired world (collective): the commit record decides, read by rank 0. What each rank
        saw of it may differ: the failure may stop some ranks inside the commit's last collective that others
        had left (a collective may complete on some ranks and fail on others), and a newcomer saw nothing; each
        redoing the save or not by its own view, some went on to the next step while the others waited in the save."""
        name = cm.checkpoint_name(self.prefix, cb.cur_epoch_num, cb.cur_step_in_epoch)
        done = None
        if cb.rank == 0:
            done = any(r["name"] == name and r["global_step"] == cb.cur_step_num
                       for r in cm.committed(self.directory, self.records))
        groups = cb.model.groups
        done = groups.runtime.collective(groups.world.bcast, done, root=0)
        if done:
            self.committed_step = self.last_saved_step = cb.cur_step_num
            if name not in self.saved:
                self.saved.append(name)
        else:  # (set to this step only by its commit, or by an async save in flight: abandoned above)
            self.last_saved_step = self.committed_step
        return done

    def step_end(self, run_context):
        cb = run_context.original_args()
        self.poll(cb)
        n = self.config.save_checkpoint_steps
        if n and cb.cur_step_num % n == 0:
            self.save(cb)

    def epoch_end(self, run_context):
        cb = run_context.original_args()
        n = self.config.save_checkpoint_epochs
        if n and cb.cur_epoch_num % n == 0:
            self.save(cb)

    def finishing(self, run_context):
        """At the end of training, where a failure is still repaired in the job (Model._wind_up)."""
        cb = run_context.original_args()
        if cb.cur_step_num and self.last_saved_step != cb.cur_step_num and cb.cur_step_num != self.begun_step:
            self.save(cb)  # like MindSpore, the last step is always saved (a step this training call trained)
        self.finish(cb)  # an async save still in flight is waited for and committed
        self._check_last_saved(cb)

    def _check_last_saved(self, cb) -> None:
        """With on_save_error: continue, the last save refused leaves no next save to try again: the steps since the
        newest commit exist nowhere, so training ends with SaveError (one line, exit status 1), not success. Every
        rank knows alike (a refused save is gathered from all of them)."""
        step = cb.cur_step_num
        if not step or step == self.begun_step or self.committed_step == step:
            return
        first = max(self.committed_step or 0, self.begun_step or 0) + 1
        latest = (f"the latest checkpoint is {self.saved[-1]} (global step {self.committed_step})" if self.saved
                  else f"no checkpoint of this run is committed in {self.directory}")
        steps = f"global step {step} exists" if first == step else f"global steps {first}-{step} exist"
        raise SaveError(f"the last save was refused (checkpoint.on_save_error: continue): {steps} in no "
                        f"checkpoint; {latest}")

    def end(self, run_context):
        self.finishing(run_context)  # (done already when Model.train ran it: nothing left to save or commit)
        if self.own_lease:
            self.lease.release()
            self.lease, self.own_lease = None, False

    # -- the save itself -----------------------------------------------------------------------------
    def save(self, cb) -> str:
        """Write this step's checkpoint on every rank and commit it; returns its name.

        With async_save the files are written by a thread from a snapshot, and committed at a later step
        end (see async_save); a save still in flight is first waited for and committed. Its progress is
        watched (tft.hang_timeout: a rank whose write never returns is stuck, the others wait in collectives).
        """
        with progress.watched("save"):
            return self._save(cb)

    def _save(self, cb) -> str:
        t0 = time.perf_counter()
        if self.last_saved_step == cb.cur_step_num:
            return self.pending.name if self.pending is not None else self.saved[-1]
        if self.last_failed_step == cb.cur_step_num:
            return None
        self.finish(cb)
        for check in self.before_save:  # e.g. tft.sdc_check_every: replicas compared, none saved damaged
            check(cb)
        groups = cb.model.groups
        comm, rank, step = groups.world, cb.rank, cb.cur_step_num
        name = cm.checkpoint_name(self.prefix, cb.cur_epoch_num, cb.cur_step_in_epoch)
        runtime = groups.runtime
        half = (lambda: faults.at_point("save", step, runtime)) if faults.armed("save", runtime) else None

        def plan():  # this rank's file, or with integrated_save rank 0's of whole tensors
            own = state_file(cm.shard_path(self.directory, rank, name), cb.model,
                             list(state_tensors(cb.network, cb.optimizer)), rank, step, cb.cur_epoch_num, self.prefix,
                             self.config.append_info, self.config.integrated_save)
            own.on_half_written = half
            if self.config.integrated_save:
                return integrated(comm, own, cm.integrated_path(self.directory, name))
            return [own]

        commit = Commit(self.directory, name, self.prefix, cb.cur_epoch_num, cb.cur_step_in_epoch, step,
                        lambda: self._plan(cb), self.config.integrated_save, host_of=groups.hosts.names,
                        records=self.records, before=lambda: faults.at_point("commit", step, runtime))
        background = Background(self._staging(), self.snapshot) if self.config.async_save else None
        pending = _Pending(name, cb.cur_epoch_num, cb.cur_step_in_epoch, step, t0)
        pending.saving = save(World(comm, runtime), plan, commit, background)
        if self.config.async_save:
            if pending.saving.copied is not None:
                cb.optimizer.hold_until(pending.saving.copied)  # the next update waits until the state is staged
                if faults.strikes("save", step, runtime):  # the rank dies in its writer before its next step starts, so
                    pending.saving.wait()         # where the others stop does not depend on thread timing
            self.pending, self.last_saved_step = pending, step
            self.stalls.append(time.perf_counter() - t0)
            return name
        name = self._conclude(cb, pending, pending.saving.outcome)
        self.stalls.append(time.perf_counter() - t0)
        return name

    def _staging(self):
        """Where an async per-rank save stages this rank's state (checkpoint.async_staging: "memory", the reused
        snapshot buffer, or "page_cache", the file itself); None for synchronous or integrated saves (rank 0's
        gathered full tensors are new arrays, their own snapshot)."""
        c = self.config
        return c.async_staging if c.async_save and not c.integrated_save else None

    def poll(self, cb) -> None:
        """At a step end: commit the save in flight once every rank's background write has finished
        (collective: one small all-reduce per step while a save is in flight)."""
        if self.pending is None:
            return
        from mpi4py import MPI
        done = np.array(self.pending.saving.done(), np.int32)
        # Allreduce on the world itself: mpi4py's pickled allreduce runs on a hidden duplicate of the
        # communicator, which a revoke of the world does not reach (a rank blocked in it would never learn
        # of a failure the others are already recovering from).
        groups = cb.model.groups
        with progress.watched("save"):  # (a rank stuck in its save: the others wait here)
            groups.runtime.collective(groups.world.Allreduce, MPI.IN_PLACE, done, op=MPI.MIN)
        if done:
            self.finish(cb)

    def finish(self, cb) -> None:
        """Wait for the save in flight (if any) on every rank, then commit it or report its failure (collective).
        Watched as a save is: the wait for this rank's writer goes on while it writes (each tensor is progress)."""
        p = self.pending
        if p is None:
            return
        with progress.watched("save"):
            self._finish(cb, p)

    def _finish(self, cb, p) -> None:
        self.pending = None
        self._conclude(cb, p, p.saving.conclude())

    def copying(self) -> bool:
        """Whether an async save in flight is still copying the live state into its snapshot (or the page cache)."""
        copied = self.pending.saving.copied if self.pending is not None else None
        return copied is not None and not copied.is_set()

    def abandon(self, why: str):
        """Drop the save in flight without committing it (no MPI: a last gasp or an in-job repair takes over);
        returns the line to log, or None when no save was in flight."""
        p = self.pending
        if p is None:
            return None
        self.pending, self.last_saved_step = None, self.committed_step
        p.saving.abandon()
        if not self.config.integrated_save and self.rank is not None:
            cm.shard_path(self.directory, self.rank, p.name).unlink(missing_ok=True)  # uncommitted: never loaded
        return f"dsim: the async save of {p.name} (global step {p.step}) was in flight: abandoned, not committed ({why})"

    def _conclude(self, cb, p, outcome):
        """The policy once every rank's outcome is known (save.Saving.conclude): committed, or what a failure does."""
        groups = cb.model.groups
        comm, rank, name = groups.world, cb.rank, p.name
        if outcome.failed:
            self.last_saved_step = self.committed_step
            if outcome.storage:  # the storage failed: the policy decides
                return self._failed(cb, name, p.step, outcome.failed, outcome.what)
            raise CheckpointError(f"checkpoint {name} not saved; failed on rank(s) {outcome.failed}")
        self.committed_step = self.last_saved_step = p.step
        self.saved.append(name)
        self._retain(comm, rank, groups.runtime)
        if rank == 0:
            event("checkpoint_committed", checkpoint=name, global_step=p.step)
            total = sum(w.size for w in outcome.written.values())
            ms = 1000 * (time.perf_counter() - p.started)
            how = (f"{ms:.0f} ms in the background, the step stalled {1000 * self.stalls[-1]:.0f} ms"
                   if self.config.async_save and self.stalls else f"{ms:.0f} ms")
            say(f"checkpoint saved: {self.directory / name} ({total / 2**20:.1f} MiB in "
                f"{1 if self.config.integrated_save else comm.size} file(s), {how})")
            if not self.config.integrated_save and len(group_info(groups.layout, 0)) == 1:
                k, dp = groups.layout.optimizer_shard, groups.layout.data_parallel
                warnings.warn(("data_parallel=1" if dp == 1 else f"optimizer_shard={k} = data_parallel") +
                              ": no rank has a replica, a lost shard cannot be repaired from another rank")
        return name

    @staticmethod
    def _summary(failed: dict) -> str:
        """'No space left on device on rank(s) 0-7', one part per distinct error."""
        by_error = {}
        for r, e in sorted(failed.items()):
            by_error.setdefault(e, []).append(r)
        return "; ".join(f"{e} on rank(s) {_ranks_text(rs)}" for e, rs in by_error.items())

    def _failed(self, cb, name: str, step: int, failed: dict, what: str = "its files"):
        """A save the storage refused: remove what this save wrote (nothing is committed), then one line from
        rank 0 and the policy: stop (raise SaveError) or continue (warn, record an event, try at the next save)."""
        comm, rank = cb.model.groups.world, cb.rank
        own = cm.integrated_path(self.directory, name) if self.config.integrated_save else cm.shard_path(
            self.directory, rank, name)
        if rank == 0 or not self.config.integrated_save:
            for p in (own, own.with_name(own.name + ".tmp")):
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
        runtime = cb.model.groups.runtime
        runtime.collective(comm.Barrier)  # every rank has removed its part before anyone goes on
        records = cm.committed(self.directory, self.records) if rank == 0 else []
        latest = records[-1]["name"] if records else None
        message = (f"checkpoint {name} (global step {step}) not saved in {self.directory}: "
                   f"{what} could not be written: {self._summary(failed)} ({free_space(self.directory)}); "
                   + (f"the latest checkpoint is still {latest}" if latest else "no checkpoint is committed"))
        if self.on_save_error == "stop":
            message = runtime.collective(comm.bcast, message, root=0)
            raise SaveError(message)
        self.last_failed_step = step
        if rank == 0:
            print(f"dsim: warning: {message}; training goes on and the next save tries again "
                  "(checkpoint.on_save_error: continue)", file=sys.stderr, flush=True)
            event("checkpoint_save_failed", checkpoint=name, global_step=step,
                  directory=str(self.directory), errors={str(r): e for r, e in failed.items()},
                  free=free_space(self.directory))
        return None

    def _plan(self, cb):
        """The save plan of this run's layout and state (the commit record's slices), made once."""
        layout = cb.model.groups.layout
        if getattr(self, "_plan_of", (None,))[0] != layout:
            self._plan_of = (layout, save_plan(layout, cb.network.specs, slots(cb.optimizer)))
        return self._plan_of[1]

    def _retain(self, comm, rank, runtime):
        """Drop the oldest committed checkpoints of this prefix beyond keep_checkpoint_max. Each rank removes its
        own file; rank 0 also those of ranks this world no longer has (saved before an elastic shrink: no process
        trains as them now, and nobody else would)."""
        drop = []
        if rank == 0:
            drop = [(r["name"], r.get("world_size") or comm.size) for r in cm.to_drop(
                cm.committed(self.directory, self.records), self.prefix, self.config.keep_checkpoint_max)]
            for name, _ in drop:
                cm.uncommit(self.directory, name)  # the commit record first
                cm.integrated_path(self.directory, name).unlink(missing_ok=True)
        drop = runtime.collective(comm.bcast, drop, root=0)
        for name, world in drop:
            for r in [rank, *(range(comm.size, world) if rank == 0 else ())]:
                cm.shard_path(self.directory, r, name).unlink(missing_ok=True)
