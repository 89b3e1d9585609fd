"""Async save (`checkpoint.async_save: true`, MindSpore's CheckpointConfig(async_save=True)).

The step that triggers a save only starts a thread (`BackgroundWrite`) that stages the state, then writes
and fsyncs the file while training goes on. Where the staged copy lives is `checkpoint.async_staging`:
- `memory` (the default): a snapshot buffer allocated once and reused (`Snapshot`, the host-side analogue of
  a pinned staging buffer): the fastest copy, but as much memory as the state saved, held for the whole run;
- `page_cache`: the file itself. The thread writes the live arrays through the page cache (no direct I/O):
  once the kernel holds the bytes the arrays may change, and the fsync that follows waits for the disk.
  The process holds no copy; the kernel's dirty pages are written out and become reclaimable cache, but
  copying into fresh page-cache pages costs more CPU than into a reused buffer.
The forward and backward of the next step only read the parameters; its optimizer update, the first write
to them, waits until the state is staged (`Optimizer.hold_until`), so the file is the saved step's state
exactly. The thread makes no MPI call (dsim's MPI is not
initialised for threads calling collectives). The commit protocol stays on the main thread: the save path's
`save.Saving.conclude`, which ModelCheckpoint runs:
1. (all ranks) at the save's step: wait for the previous background save and commit it, snapshot, start the thread;
2. (all ranks) at every later step end: agree whether every rank's thread has finished (one small all-reduce);
3. (all ranks) when all have, or at the next save, or at the end of training (which wait): gather each rank's
   outcome; (rank 0) write the commit record only when every file is durable; else the save failed, as a
   synchronous one does (checkpoint.on_save_error).
A kill during the background write leaves files without a commit record: the checkpoint does not exist.
A last gasp or an in-job repair abandons a save in flight (the thread stops between tensors; nothing is
committed), and the log says so.
"""
from __future__ import annotations

import threading

import numpy as np

from .. import aligned
from ..parallel import progress
from .format import Tensor


class Abandoned(Exception):
    """The background save was abandoned (a last gasp or an in-job repair took over)."""


class Snapshot:
    """Buffers as large as the state to save, allocated (and touched) once, refilled at every save."""

    def __init__(self):
        self.buffers = {}

    def bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def take(self, tensors) -> list:
        """Copies of tensors into the reused buffers (new ones only for a new name, shape or dtype)."""
        out, copies = self.plan(tensors)
        for dst, src in copies:
            np.copyto(dst, src)
        return out

    def plan(self, tensors) -> tuple:
        """(tensors on the reused buffers, [(buffer, live array)] still to copy): take() without the copies."""
        out, copies = [], []
        for t in tensors:
            buf = self.buffers.get(t.name)
            if buf is None or buf.shape != t.data.shape or buf.dtype != t.data.dtype:
                buf = self.buffers[t.name] = aligned.empty(t.data.shape, t.data.dtype)  # written with direct I/O
            copies.append((buf, t.data))
            out.append(Tensor(t.kind, t.name, t.global_shape, t.where, buf, t.split, t.opt_sharded))
        return out, copies


class BackgroundWrite:
    """A thread: the copies [(snapshot buffer, live array)] first (then `copied` is set, also when it fails or is
    abandoned), then write(check); `check()` (called between copies and by write between tensors) raises once
    abandoned. With staged_by_write (page-cache staging, no copies) it calls write(check, staged) instead, and
    `copied` is set when write calls staged() (or when it ends without)."""

    def __init__(self, write, copies=(), staged_by_write: bool = False):
        self.result = self.error = None
        self._abandon = threading.Event()
        self.copied = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(write, list(copies), staged_by_write),
                                        name="dsim-async-save")
        self._thread.start()

    def _run(self, write, copies, staged_by_write):
        try:
            if staged_by_write:
                try:
                    self.result = write(self._check, self.copied.set)
                finally:
                    self.copied.set()
                return
            try:
                for dst, src in copies:
                    self._check()
                    np.copyto(dst, src)  # releases the GIL: the next step's forward runs beside it
            finally:
                self.copied.set()
            self.result = write(self._check)
        except BaseException as e:  # noqa: BLE001 - reported on the main thread, as a sync save's error
            self.error = e

    def _check(self):
        progress.tick()  # the write goes on: the main thread waiting for it is not stuck (dsim.parallel.progress)
        if self._abandon.is_set():
            raise Abandoned("abandoned")

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        """Block until the thread ends; returns (result, error)."""
        self._thread.join()
        return self.result, self.error

    def abandon(self):
        """Ask the thread to stop at its next tensor (its temporary file is removed) and wait for it."""
        self._abandon.set()
        return self.wait()
