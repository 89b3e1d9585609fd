"""One save path: plan -> write -> commit, for every writer of checkpoint files.

`save` is the one function that writes checkpoint files. Its callers keep only what is theirs:
`ModelCheckpoint` (saver.py) when to save, retention and what a failed save does; the last gasp
(dsim/ft/last_gasp.py) which step the survivors save and who writes whose file; recovery's `--repair`
(recovery.py) which files a replica rewrites. The protocol, with who runs each step:

1. plan   (every rank)  `plan()`, the caller's: the files this rank writes (`Write`: whose file, where, its
                        attributes, tensors and append_info); none, one, or several (a survivor writing for a
                        dead rank). `state_file` plans a rank's file of the live state, as every save writes it;
2. write  (every rank)  each file under a temporary name, fsync, rename into place (format.write_file); on this
                        thread, or with `background` by a thread that stages the state first (async_save.py),
                        concluded later by `Saving.conclude` at a step end;
3. gather (every rank)  every rank's outcome to every rank (the sizes and content digests of the files it wrote,
                        or its error), through the caller's collective: `World` (a whole communicator) or the
                        last gasp's survivors (MPI_Comm_agree first);
4. commit (rank 0)      only when no rank failed: the digest file, then the commit record (`Commit`: the fields of
                        plan.commit_record; commit.write_commit, each by temporary name, fsync, rename), its error
                        shared with every rank. The checkpoint exists from that rename on. A repair commits
                        nothing (its checkpoint's record exists).
An error anywhere in 1-4 reaches every rank alike (`Outcome.failed`), so no rank waits for another in a
collective it will never enter (PyTorch DCP's _DistWrapper does the same for its save).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..engine.state import owned_pieces
from ..parallel import progress
from ..parallel.groups import gather_full
from ..parallel.layout import Slice
from ..runtime import PROCESS
from . import commit as cm
from .async_save import BackgroundWrite
from .format import Tensor, write_file
from .group_info import group_info_attr
from .plan import SavePlan, commit_record


# -- 1. plan: what a rank writes -------------------------------------------------------------------------------
@dataclass
class Write:
    """One file a rank writes: `rank`'s file in the commit record (not always the writer's own: the last gasp)."""

    rank: int
    path: Path
    meta: dict
    tensors: list
    append_info: dict
    on_half_written: Optional[Callable] = None  # called once half of the tensors are in the file (a fault point)
    keep: bool = False  # a file in the way is renamed to <name>.damaged (.1, ...), never deleted (the repair)


def state_tensors(network, optimizer, arrays=None):
    """This rank's owned slices of parameters and optimizer state, as checkpoint tensors.

    arrays (name -> array), if given, replaces the live data: e.g. the state kept from before an update.
    """
    params = {p.name: p for p in network.trainable_params()}
    for name, shape, where, arr in owned_pieces(network, optimizer):
        kind = "params" if name in params else "optimizer"
        p = params[name if kind == "params" else name.split(".", 1)[1]]  # state names are <slot>.<param>
        yield Tensor(kind, name, shape, where, arr if arrays is None else arrays[name], p.spec.split, p.opt_sharded)


def slots(optimizer) -> list:
    """The optimizer's state slots (moments, ...), each holding a slice of every parameter."""
    return sorted({s.split(".", 1)[0] for s, _, _ in optimizer.state_items()})


def epoch_and_step(global_step: int, steps_per_epoch: int) -> tuple:
    """(epoch, step in epoch), 1-based as in checkpoint names, of the state after global_step steps; before the
    first step (a last gasp when a rank dies in step 1) epoch 1 step 0, as the resume line says it (not 0_20)."""
    if global_step == 0:
        return 1, 0
    return (global_step - 1) // steps_per_epoch + 1, (global_step - 1) % steps_per_epoch + 1


def resume_meta(model, global_step: int, rank: int) -> dict:
    """What an exact resume needs besides the tensors: counters, lr schedule, data position, seed.

    Describes rank's file of the state after global_step steps of the model's run.
    """
    opt, layout, loader = model.optimizer, model.groups.layout, model.loader
    spe = loader.get_dataset_size()
    epoch, in_epoch = epoch_and_step(global_step, spe)
    return {
        "epoch": epoch, "step_in_epoch": in_epoch, "global_step": global_step,
        "rank": rank, "world_size": layout.world_size, "layout": layout.to_dict(),
        "optimizer": {"name": opt.name, "global_step": global_step,
                      "learning_rate": opt.learning_rate(global_step), **opt.hyperparams()},
        "schedule": opt.learning_rate.to_dict(),
        "data": {"global_step": global_step, "steps_per_epoch": spe, "batch_size": model.global_batch_size},
        "random_state": "none: initial weights, data and shuffling are pure functions of seed",
        "seed": getattr(model, "seed", 0), "dtype": str(next(iter(opt.params)).data.dtype),
    }


def append_info(items, epoch: int, global_step: int) -> dict:
    """The append_info values of a checkpoint: epoch_num, step_num and the user's dict entries."""
    out = {}
    for item in items:
        if item == "epoch_num":
            out["epoch_num"] = np.int64(epoch)
        elif item == "step_num":
            out["step_num"] = np.int64(global_step)
        else:
            out.update({k: np.asarray(v) for k, v in item.items()})
    return out


def state_file(path, model, tensors, rank: int, step: int, epoch: int, prefix: str, append_items=(),
               integrated_save: bool = False, **more) -> Write:
    """rank's file of the state after global step `step` (of epoch `epoch`), as every save writes it: the tensors
    (state_tensors), the scalars an exact resume needs (resume_meta), the prefix and rank's group info; more:
    further attributes (the last gasp's `last_gasp`)."""
    meta = {**resume_meta(model, step, rank), "prefix": prefix, "integrated_save": integrated_save,
            "group_info": group_info_attr(model.groups.layout, rank), **more}
    return Write(rank, Path(path), meta, tensors, append_info(append_items, epoch, step))


def integrated(comm, write: Write, path) -> list:
    """The plan of an integrated save from every rank's file of its own slices (collective): rank 0 writes the whole
    tensors (gathered, new arrays) in one file at path, the others nothing."""
    tensors = list(write.tensors)
    full = gather_full(comm, [(t.name, t.global_shape, t.where, t.data) for t in tensors])
    if comm.rank != 0:
        return []
    whole = [Tensor(t.kind, t.name, t.global_shape, Slice((0,) * len(t.global_shape), t.global_shape), full[t.name],
                    t.split, False) for t in tensors]
    return [replace(write, path=Path(path), tensors=whole)]


# -- 2. write ------------------------------------------------------------------------------------------------------
@dataclass
class Background:
    """Write in a thread while training goes on (checkpoint.async_save: async_save.py), staged by `staging`:
    "memory" (copied into `snapshot`'s reused buffers first), "page_cache" (the file itself) or None (the tensors
    are the writer's own already: an integrated save's gathered ones)."""

    staging: Optional[str] = None
    snapshot: object = None  # async_save.Snapshot, for "memory"

    def start(self, writes: list) -> BackgroundWrite:
        if self.staging == "page_cache":  # the live arrays straight into the page cache
            return BackgroundWrite(lambda check, staged: _write_all(writes, check, direct=False, on_staged=staged),
                                   staged_by_write=True)
        copies = []
        if self.staging == "memory":  # copied by the thread, before the next update
            staged = []
            for w in writes:
                tensors, more = self.snapshot.plan(w.tensors)
                staged.append(replace(w, tensors=tensors))
                copies += more
            writes = staged
        return BackgroundWrite(lambda check: _write_all(writes, check), copies)


def _write_all(writes: list, after_each, direct: bool = True, on_staged=None) -> tuple:
    """Write each file (format.write_file); returns (rank -> Written, rank -> where a file in the way was kept)."""
    written, kept = {}, {}
    for i, w in enumerate(writes):
        if w.keep:
            kept[w.rank] = keep_aside(w.path)
        written[w.rank] = write_file(w.path, w.meta, w.tensors, w.append_info, w.on_half_written, after_each=after_each,
                                     direct=direct, on_staged=on_staged if i == len(writes) - 1 else None)
    return written, kept


def keep_aside(path: Path) -> Optional[Path]:
    """Rename a file in the way to `<name>.damaged` (or .damaged.1, ...: never over another); returns where, or None."""
    if not (path.exists() or path.is_symlink()):
        return None
    kept = path.with_name(path.name + ".damaged")
    n = 1
    while kept.exists() or kept.is_symlink():
        kept = Path(f"{path}.damaged.{n}")
        n += 1
    os.replace(path, kept)
    return kept


# -- 3. gather: the collective phases -----------------------------------------------------------------------------
class World:
    """A save's collective phases over a whole communicator, every rank of it alive: each a wait the hang watch
    knows of (dsim.parallel.progress)."""

    def __init__(self, comm, runtime=PROCESS):
        self.comm, self.runtime = comm, runtime
        self.rank = comm.rank

    def gather(self, report) -> list:
        """Every rank's report, on every rank, in rank order."""
        return self.runtime.collective(self.comm.allgather, report)

    def ready(self) -> None:
        """Every rank is past the point before the commit (a fault point there)."""
        self.runtime.collective(self.comm.Barrier)

    def share(self, error):
        """The committer's error (or None) on every rank."""
        return self.runtime.collective(self.comm.bcast, error, root=0)


def error_text(e: BaseException) -> str:
    """The errno text of a storage error ('No space left on device'), else the exception in one line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


# -- 4. commit -----------------------------------------------------------------------------------------------------
@dataclass
class Commit:
    """What makes the files a checkpoint: the fields of its commit record (plan.commit_record), written by the
    committer (rank 0 of the collective) once every file is in place."""

    directory: Path
    name: str
    prefix: str
    epoch: int
    step_in_epoch: int
    global_step: int
    plan: Callable[[], SavePlan]  # the saved layout's plan (the record's slices and replica sets), made by the committer
    integrated_save: bool = False
    template: Optional[str] = None  # rank's file relative to directory ({rank} for the rank); else <name>.h5's
    host_of: Optional[list] = None  # each rank's host (the record's `hosts`), when known
    extra: dict = field(default_factory=dict)  # more fields (the last gasp's `last_gasp`), after the plan's
    records: Optional[dict] = None  # commit.committed's cache of the directory's records (the saver keeps one)
    before: Optional[Callable] = None  # every rank, before the commit (the `commit` fault point)

    def write(self, written: dict) -> Path:
        """The digest file and the record (commit.write_commit), numbered after the directory's newest."""
        records = cm.committed(self.directory, self.records)
        record = commit_record(self.name, self.prefix, self.plan(), self.epoch, self.step_in_epoch, self.global_step,
                               max([r["sequence"] for r in records], default=0) + 1, self.integrated_save,
                               time.time(), host_of=self.host_of)
        if self.template is not None:
            record["files"]["template"] = self.template
        record.update(self.extra)
        return cm.write_commit(self.directory, record, {r: (w.size, w.digest) for r, w in written.items()})


# -- the one function ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What every rank learns of a save (the same on each)."""

    failed: dict            # rank of the collective -> its error text; empty when the save succeeded
    storage: bool = True    # every failure was the storage's (an OSError): the saver's policy decides
    what: str = "its files"  # what failed: "its files", or "its commit record"
    written: dict = field(default_factory=dict)  # file rank -> format.Written (size, content digest)
    kept: dict = field(default_factory=dict)     # file rank -> where the file in its way was kept (Write.keep)
    committed: bool = False


class Saving:
    """A save whose files are being written (by a thread, with `background`) and not yet gathered and committed."""

    def __init__(self, dist, commit: Optional[Commit], describe, error, written, writer):
        self.dist, self.commit, self.describe = dist, commit, describe
        self.error, self.written, self.writer = error, written, writer
        self.outcome = None

    @property
    def copied(self):
        """The thread's event set once the state is staged (the next update waits for it); None without a thread."""
        return None if self.writer is None else self.writer.copied

    def done(self) -> bool:
        """Whether this rank's writing is over (no MPI)."""
        return self.writer is None or self.writer.done()

    def wait(self) -> None:
        """Until this rank's thread ends (no MPI)."""
        if self.writer is not None:
            self.writer.wait()

    def abandon(self) -> None:
        """Stop this rank's thread at its next tensor (its temporary removed); nothing is gathered or committed."""
        if self.writer is not None:
            self.writer.abandon()

    def conclude(self) -> Outcome:
        """Steps 3-4 (collective): wait for this rank's files, gather every rank's outcome, commit when all succeeded."""
        if self.outcome is None:
            self.outcome = self._conclude()
        return self.outcome

    def _conclude(self) -> Outcome:
        error, storage = self.error
        written, kept = self.written
        if self.writer is not None:
            result, e = self.writer.wait()
            if e is not None and error is None:
                error, storage = self.describe(e), isinstance(e, OSError)
            elif result is not None:
                written, kept = result
        reports = self.dist.gather((error, storage, written, kept))
        failed = {r: e for r, (e, _, _, _) in enumerate(reports) if e}
        written = {f: w for _, _, ws, _ in reports for f, w in ws.items()}
        kept = {f: k for _, _, _, ks in reports for f, k in ks.items()}
        if failed:
            return Outcome(failed, all(st for e, st, _, _ in reports if e), written=written, kept=kept)
        if self.commit is None:
            return Outcome({}, written=written, kept=kept)
        if self.commit.before is not None:
            self.commit.before()
        self.dist.ready()
        error = None
        if self.dist.rank == 0:
            try:
                self.commit.write(written)
            except Exception as e:  # every rank must learn of it, or the others wait forever
                error = (self.describe(e), isinstance(e, OSError))
        error = self.dist.share(error)
        if error is not None:
            return Outcome({0: error[0]}, error[1], "its commit record", written, kept)
        return Outcome({}, written=written, kept=kept, committed=True)


def save(dist, plan: Callable[[], list], commit: Optional[Commit] = None, background: Optional[Background] = None,
         describe: Callable[[BaseException], str] = error_text) -> Saving:
    """Plan, write and commit a checkpoint (collective over dist: World, or the last gasp's survivors).

    plan() returns this rank's `Write`s (it may gather: an integrated save); commit None writes files of a checkpoint
    committed before (a repair). Without `background` the save is concluded when this returns
    (`Saving.outcome`); with it, this rank's files are written by a thread and the caller concludes the save
    later (`Saving.conclude`, on every rank). An error of any rank's plan, write or commit (describe(e): its
    text) is in every rank's outcome; nothing is committed then.
    """
    error, written, writer = (None, True), ({}, {}), None
    try:
        writes = plan()
        if background is None:
            written = _write_all(writes, progress.tick)
        elif writes:
            writer = background.start(writes)
    except Exception as e:  # every rank must learn of it, or the others wait forever
        error = (describe(e), isinstance(e, OSError))
    saving = Saving(dist, commit, describe, error, written, writer)
    if background is None:
        saving.conclude()
    return saving
