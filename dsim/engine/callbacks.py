"""Callbacks in MindSpore's shape: begin, epoch_begin, step_begin, step_end, epoch_end, end.

Each gets a RunContext whose `original_args()` are the cb_params MindSpore users know
(cur_epoch_num, cur_step_num, batch_num, net_outputs, ...). Printing callbacks act on rank 0 only.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ..log import EVENTS, event, say


class RunContext:
    """What a callback sees: cb_params via original_args(), and request_stop()."""

    def __init__(self, cb_params: SimpleNamespace):
        self._params = cb_params
        self.stop_requested = False

    def original_args(self) -> SimpleNamespace:
        return self._params

    def request_stop(self) -> None:
        self.stop_requested = True


class Callback:
    """Base class: override the hooks you need.

    `local`: the hooks use no collective and no other rank. When a failure strikes during a step's end hooks
    and the in-job repair keeps that step (training goes on after it), the local callbacks that had not run
    their step_end (and epoch_end, at an epoch's last step) for it run them then, on the ranks that were in
    them: the step's loss line and metrics event are not lost. The others are not run again (a collective
    would find the newcomers elsewhere); a save due then is ModelCheckpoint's `recovered`.
    """

    local = False
    # A callback that runs the whole training loop inside itself (dsim.ft.tft: MindSpore's TFT callbacks) sets
    # guard_training(model, body, callbacks) -> body()'s result; Model.train uses the first one it finds.
    guard_training = None

    def begin(self, run_context): pass
    def epoch_begin(self, run_context): pass
    def step_begin(self, run_context): pass
    def step_end(self, run_context): pass
    def epoch_end(self, run_context): pass
    def finishing(self, run_context): pass  # the collective work at the end (a failure in it is repaired in the job)
    def end(self, run_context): pass

    def join(self, run_context, joining: dict):
        """begin() for a replacement process entering a running job (dsim.ft.inprocess); `joining` holds the job's
        state. By default the callback begins as at the start."""
        self.begin(run_context)

    def recovered(self, run_context):
        """After an in-job repair (or an elastic shrink) the state is that after cb_params.cur_step_num."""


class LossMonitor(Callback):
    """Rank 0 prints `epoch: 1 step: 77, loss is 7.187697` every per_print_times steps."""

    local = True

    def __init__(self, per_print_times: int = 1):
        self.per_print_times = per_print_times

    def step_end(self, run_context):
        cb = run_context.original_args()
        if cb.rank == 0 and cb.cur_step_in_epoch % self.per_print_times == 0:
            say(f"epoch: {cb.cur_epoch_num} step: {cb.cur_step_in_epoch}, loss is {cb.net_outputs:.6f}")


class TimeMonitor(Callback):
    """Rank 0 prints epoch time and per-step time at each epoch end (data_size: MindSpore's, unused: a step
    is one batch here)."""

    local = True

    def __init__(self, data_size=None):
        self.data_size = data_size

    def epoch_begin(self, run_context):
        self._t0, self._steps = time.perf_counter(), 0

    def step_end(self, run_context):
        self._steps += 1

    def epoch_end(self, run_context):
        cb = run_context.original_args()
        if cb.rank == 0 and self._steps:
            ms = (time.perf_counter() - self._t0) * 1000
            say(f"Train epoch time: {ms:.3f} ms, per step time: {ms / self._steps:.3f} ms")


class EvalMonitor(Callback):
    """Accuracy on a held-out dataset after every `per_epochs` epochs (Model.eval; collective): rank 0 prints
    `epoch: 2 eval accuracy is 0.812500 (320 held-out samples)`, and metrics.jsonl gets an `eval` event."""

    def __init__(self, dataset, per_epochs: int = 1):
        self.dataset, self.per_epochs = dataset, per_epochs

    def epoch_end(self, run_context):
        cb = run_context.original_args()
        if cb.cur_epoch_num % self.per_epochs:
            return
        accuracy = cb.model.eval(self.dataset)["accuracy"]
        samples = self.dataset.get_dataset_size() * self.dataset.batch_size
        if cb.rank == 0:
            say(f"epoch: {cb.cur_epoch_num} eval accuracy is {accuracy:.6f} ({samples} held-out samples)")
        event("eval", epoch=cb.cur_epoch_num, global_step=cb.cur_step_num, accuracy=accuracy, samples=samples)


class ProgressBar(Callback):
    """A tqdm bar on rank 0 (off when stderr is not a terminal). tqdm is imported only where a bar shows: it
    costs every process of every job some 45 ms of CPU to import, most of it for its version lookup."""

    local = True

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar = None

    def epoch_begin(self, run_context):
        cb = run_context.original_args()
        if cb.rank == 0 and self.enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=cb.batch_num, initial=cb.cur_step_in_epoch, desc=f"epoch {cb.cur_epoch_num}",
                             leave=False, disable=None, dynamic_ncols=True)

    def step_end(self, run_context):
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{run_context.original_args().net_outputs:.4f}", refresh=False)
            self._bar.update(1)

    def epoch_end(self, run_context):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    end = epoch_end


class MetricsLog(Callback):
    """Rank 0 appends JSON lines (events and per-step metrics) to a file; runs append, never truncate."""

    local = True

    def __init__(self, path):
        self.path = Path(path)
        self._file = None
        self.rank = None
        self._handler = _EventHandler(self)  # dsim.log.event's records, while training runs

    def log(self, event: str, any_rank: bool = False, **fields) -> None:
        line = json.dumps({"event": event, "time": time.time(), "rank": self.rank, **fields}) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        elif any_rank:  # a rank other than 0 (e.g. the lowest survivor): this line only, the file not kept open
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as fh:
                fh.write(line)

    def _open(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def begin(self, run_context):
        cb = run_context.original_args()
        self.rank = cb.rank
        EVENTS.addHandler(self._handler)
        if cb.rank == 0:
            self._open()
            self.log("train_begin", epoch=cb.cur_epoch_num, global_step=cb.cur_step_num,
                     world_size=cb.world_size, layout=cb.layout)

    def recovered(self, run_context):
        """After an in-job repair or an elastic shrink: this process's rank may be new (rank 0 writes)."""
        cb = run_context.original_args()
        self.rank = cb.rank
        if cb.rank == 0 and self._file is None:
            self._open()

    def step_end(self, run_context):
        cb = run_context.original_args()
        self.log("step", epoch=cb.cur_epoch_num, step=cb.cur_step_in_epoch, global_step=cb.cur_step_num,
                 loss=float(cb.net_outputs), lr=cb.lr)

    def end(self, run_context):
        cb = run_context.original_args()
        self.log("train_end", epoch=cb.cur_epoch_num, global_step=cb.cur_step_num)
        EVENTS.removeHandler(self._handler)
        if self._file is not None:
            self._file.close()
            self._file = None


class _EventHandler(logging.Handler):
    """dsim.log.event's records into a MetricsLog's file."""

    def __init__(self, metrics: MetricsLog):
        super().__init__()
        self.metrics = metrics

    def emit(self, record):
        self.metrics.log(record.getMessage(), any_rank=getattr(record, "dsim_any_rank", False),
                         **getattr(record, "dsim_fields", {}))
