"""Model: one training step across the parallel groups, and MindSpore's Model.train loop around it."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Protocol

import numpy as np

from .. import guard
from ..parallel.buckets import GradientBuckets
from ..parallel.groups import Groups
from .callbacks import RunContext


class Recovery(Protocol):
    """What the loop asks of a repair in the job (Model.recovery: dsim.ft.inprocess.InProcessRecovery). Model.rollback
    (dsim.ft.sdc.Rollback) has handles and recover(error) only. The loop knows no more of fault tolerance."""

    watches: bool  # whether the world is watched for failures during a step (dsim.runtime.Runtime.watch)

    def serve(self) -> None: ...                          # answers the others' requests while this rank waits
    def handles(self, error: BaseException) -> bool: ...  # whether it repairs this failure
    def recover(self, error: BaseException, callbacks: list) -> int: ...  # repairs; the step training goes on after
    def step_finished(self, global_step: int) -> None: ...  # a step ended on this rank, before its end hooks
    def leave(self) -> None: ...                          # every living rank agrees that training ended


class Model:
    """A network, its optimizer and the groups it trains on.

    One step, on every rank:
    1. forward on this rank's part of the global batch (mp all-reduces inside row-split layers);
    2. backward (mp all-reduces inside column-split layers);
    3. the all-reduce over the dp group of all gradients plus the loss, in place in the gradient buckets
       (each gradient is a view into one flat buffer: dsim.parallel.buckets);
    4. optimizer update of the owned slices, then all-gather over the optimizer-shard group.
    """

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None, *, groups: Groups = None,
                 global_batch_size: int = None, micro_batch_num: int = None, pipeline_schedule: str = None):
        """MindSpore's Model(network, loss_fn, optimizer, metrics). A script leaves the rest out: build() takes
        the groups, micro_batch_num and pipeline_schedule from the context (dsim.init, set_auto_parallel_context)
        and the batch size from the dataset."""
        self.network = network
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.metrics = metrics
        self.groups = groups
        self.global_batch_size = global_batch_size
        self.seed, self.loader = None, None  # the run's seed, and the dataset it trains on (checkpoints record both)
        self.recovery = None  # a Recovery (above): dsim.ft.inprocess.InProcessRecovery when tft.uce or tft.arf is on
        self.rollback = None  # a Recovery: dsim.ft.sdc.Rollback with tft.sdc_rollback
        self.points = []  # observers of a step's named points, f(point, global_step): "forward", "allreduce" and
        #                   "update", each reached halfway through that part (dsim.faults.FaultInjector adds one)
        self._buckets = None
        self._epoch_open = None  # the epoch (0-based) whose epoch_begin ran and epoch_end not yet
        self._ending = None  # while a step's end hooks run: _Ending (what ran, for an in-job repair then)
        self.pipeline = None  # dsim.parallel.pipeline.Pipeline with pipeline stages or micro-batches
        self._pipeline_options = (micro_batch_num, pipeline_schedule)
        if groups is not None:
            self._make_pipeline()

    def _make_pipeline(self) -> None:
        """The pipeline (stages, micro-batches) of the built layout, when it has one."""
        from ..context import get_context
        ctx = get_context()
        micro_batch_num, schedule = self._pipeline_options
        micro_batch_num = micro_batch_num or ctx.micro_batch_num
        if self.groups.layout.pipeline_stage > 1 or micro_batch_num > 1:
            from ..parallel.pipeline import Pipeline
            self.pipeline = Pipeline(self.network, self.groups.layout, self.groups.rank, micro_batch_num,
                                     schedule or ctx.pipeline_schedule, self.groups.runtime)

    def train_step(self, inputs, labels: np.ndarray) -> float:
        """One training step; returns the global-batch mean loss (identical on every rank).

        inputs: what the network's forward takes (images, or the transformer's (source, target) ids).
        """
        net, groups = self.network, self.groups
        step = self.optimizer.global_step + 1
        watching = self.recovery is not None and self.recovery.watches
        groups.runtime.watch(groups.world if watching else None, self.recovery.serve if watching else None, groups.dp)
        buckets = self.buckets  # before backward: the layers write the gradients into it
        if self.pipeline is not None:
            return self._pipelined_step(inputs, labels, buckets, step)
        # forward
        logits = net.forward(inputs, groups.mp, halfway=lambda: self.reach("forward", step))
        loss, dlogits = net.loss(logits, labels, self.global_batch_size, groups.dp)
        # backward
        net.backward(dlogits, groups.mp)
        # gradient (and loss) reduction over data parallel, in place in the gradient buckets
        buckets.loss[0] = loss
        buckets.allreduce(groups.dp, between=lambda: self.reach("allreduce", step))
        # update
        self.optimizer.apply(halfway=lambda: self.reach("update", step))
        self.optimizer.sync(groups.shard)
        return float(buckets.loss[0])

    def _pipelined_step(self, inputs, labels, buckets, step) -> float:
        """The step with micro-batches through the pipeline stages (dsim.parallel.pipeline), then as above:
        the dp reduction of the summed gradients and the loss, the update, the optimizer-shard sync."""
        groups = self.groups
        buckets.loss[0] = self.pipeline.run(groups.world, groups.mp, groups.dp, inputs, labels, buckets.flat[:-1],
                                            self.global_batch_size, halfway=lambda: self.reach("forward", step))
        buckets.allreduce(groups.dp, between=lambda: self.reach("allreduce", step))
        # the loss to every rank before the update, as without stages: a rank that finishes its update then has
        # nothing left to wait for in this step (a fault in another rank's update cannot hide the step's loss)
        loss = self.pipeline.share_loss(groups.world, float(buckets.loss[0]))
        self.optimizer.apply(halfway=lambda: self.reach("update", step))
        self.optimizer.sync(groups.shard)
        return loss

    def reach(self, point: str, step: int) -> None:
        """The step's part `point` is halfway: tell the observers (self.points)."""
        for observe in self.points:
            observe(point, step)

    @property
    def buckets(self) -> GradientBuckets:
        """The flat gradient buffer the network's gradients live in (made at the first step, and again
        whenever the network's parameters were rebuilt)."""
        params = self.network.trainable_params()
        if self._buckets is None or not self._buckets.serves(params):
            self._buckets = GradientBuckets(params, params[0].data.dtype)
        return self._buckets

    def build(self, train_dataset=None, valid_dataset=None, sink_size: int = -1, epoch: int = 1) -> "Model":
        """Make this rank's slices of the network (MindSpore compiles here; in dsim the layout decides the
        slices), bind the optimizer to them, and the datasets to this rank's data-parallel part.

        Collective (it makes the parallel groups). Needed before load_param_into_net, as on the distributed
        page; train() and eval() call it. A network already built (the CLI's builder) is left as it is.
        """
        if self.groups is None:
            from ..context import get_context, init
            ctx = get_context()
            if ctx.comm is None:
                init()
            layout = ctx.layout()
            if not self.network.trainable_params():
                self.network.build(layout, ctx.comm.rank, ctx.seed, ctx.dtype)  # LayoutError before any collective
            if self.optimizer is None:
                raise ValueError("Model needs an optimizer to train: Model(net, loss_fn, optimizer=...)")
            if not self.optimizer.params:
                self.optimizer.bind(self.network.trainable_params())
            if self.loss_fn is not None:
                self.network.loss = self.loss_fn  # what train_step calls
            self.seed = ctx.seed if self.seed is None else self.seed
            self.groups = Groups(ctx.comm, layout)
            self._make_pipeline()
        for dataset in (train_dataset, valid_dataset):
            if dataset is not None and getattr(dataset, "sampler", "bound") is None:
                dataset.bind(self.groups.layout.data_parallel, self.groups.coords.dp, self.seed or 0)
        if train_dataset is not None:
            self.loader = train_dataset
            self.global_batch_size = train_dataset.sampler.global_batch_size
        return self

    def eval(self, valid_dataset, callbacks=None, dataset_sink_mode: bool = True) -> dict:
        """{"accuracy": ...} on valid_dataset, every sample once: the share of samples (for a token model, of
        target tokens that are not padding) whose largest output is the label. Collective; the same on every rank.

        The outputs must be whole on every model-parallel rank (dsim's networks end in a row-split or
        replicated layer); only the dp group's counts are summed.
        """
        from mpi4py import MPI

        from ..data.translation import PAD
        self.build(valid_dataset=valid_dataset)
        if self.groups.layout.pipeline_stage > 1:
            raise ValueError("Model.eval with pipeline stages is not supported: each stage holds part of the network")
        counts = np.zeros(2)
        sampler, source = valid_dataset.sampler, valid_dataset.source
        runtime = self.groups.runtime
        with runtime.progress.watched("evaluation"):  # (tft.hang_timeout: dsim.ft.hang)
            for step in range(valid_dataset.get_dataset_size()):
                inputs, labels = source.get(sampler.batch_indices(0, step))
                logits = self.network.forward(inputs, self.groups.mp)
                labels = np.asarray(labels).reshape(-1)
                keep = (labels != PAD if getattr(self.network, "input_kind", "image") == "tokens"
                        else np.ones(labels.shape, bool))
                counts += ((logits.argmax(axis=1) == labels)[keep].sum(), keep.sum())
            runtime.collective(self.groups.dp.Allreduce, MPI.IN_PLACE, counts)
        return {"accuracy": float(counts[0] / max(counts[1], 1))}

    def train(self, epoch: int, train_dataset, callbacks=None, dataset_sink_mode: bool = True, sink_size: int = -1,
              initial_epoch: int = 0, joining=None):
        """Train through epoch `epoch` (1-based, inclusive), starting after `initial_epoch`.

        As in MindSpore, `epoch` is the last epoch and `initial_epoch` the number already done; a
        dataset position set with set_init_step (a mid-epoch resume) wins when it is further on.
        dataset_sink_mode and sink_size are MindSpore's and change nothing here (a step is one batch).
        With `self.recovery` set (dsim.ft.inprocess), a failure inside the loop is repaired in the job and
        training goes on from the step the ranks agreed on. `joining` is given to a replacement process
        that enters a running job: its callbacks join (take the job's state) instead of beginning.
        A fault-tolerance callback (dsim.ft.tft: TFTRegister, TrainFaultTolerance) among the callbacks turns
        on the last gasp and the in-job repair for a script, as MS_ENABLE_TFT and the config do for the CLI.
        """
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [] if callbacks is None else [callbacks]
        guard.stacks_on_signal()  # a script's ranks too: kill -USR1 prints where each thread is
        self.build(train_dataset)
        tft = next((c for c in callbacks if c.guard_training is not None), None)
        if tft is not None:
            return tft.guard_training(self, lambda: self._train(epoch, train_dataset, callbacks, initial_epoch,
                                                                joining), callbacks)
        return self._train(epoch, train_dataset, callbacks, initial_epoch, joining)

    def _train(self, epoch, train_dataset, callbacks, initial_epoch, joining):
        spe = train_dataset.get_dataset_size()
        train_dataset.set_init_step(max(train_dataset.init_step, initial_epoch * spe))
        first_epoch, first_step = train_dataset.position(train_dataset.init_step)
        cb = SimpleNamespace(
            rank=self.groups.rank, world_size=self.groups.world.size, layout=self.groups.layout.to_dict(),
            epoch_num=epoch, batch_num=spe, cur_epoch_num=first_epoch + 1, cur_step_in_epoch=first_step,
            cur_step_num=train_dataset.init_step, net_outputs=None, lr=self.optimizer.current_lr(),
            network=self.network, optimizer=self.optimizer, model=self,
            train_network=self.network, train_dataset=train_dataset, device_number=self.groups.world.size,
        )
        ctx = RunContext(cb)
        self._epoch_open = None  # a train() call begins its first epoch (an earlier call may have stopped in one)
        if joining is not None:
            for c in callbacks:
                c.join(ctx, joining)
            _recovered(callbacks, ctx, train_dataset, train_dataset.init_step)
        else:
            self._begin(callbacks, ctx, train_dataset)
        while True:
            try:
                self._loop(epoch, train_dataset, callbacks, ctx)
                self._wind_up(callbacks, ctx)
                break
            except Exception as e:
                ending, self._ending = self._ending, None
                if self.rollback is not None and self.rollback.handles(e):  # silent corruption (dsim.ft.sdc)
                    step = self.rollback.recover(e)
                elif self.recovery is None or not self.recovery.handles(e):
                    raise
                else:
                    step = self.recovery.recover(e, callbacks)  # raises when it cannot repair: the caller falls back
                self._went_back(cb, train_dataset, step)
                _recovered(callbacks, ctx, train_dataset, step)
                if ending is not None and ending.global_step == step:  # training goes on after that step
                    self._finish(ending, callbacks, ctx)
        train_dataset.set_init_step(cb.cur_step_num)
        _call(callbacks, "end", ctx)
        return cb

    def _begin(self, callbacks, ctx, train_dataset):
        """The callbacks' begin hooks. A rank slow to begin may learn of a death in one of their collectives (the
        checkpoint's) while the others, past it, are in the first step: it joins their repair in the job, then
        runs the hooks it had not run (those after the checkpoint's only set up this process), and goes on with
        them. It must join the others' repair rather than fall back to the last gasp alone: its collectives would
        then match none of theirs, and every rank would wait for ever (docs/design/repair-in-the-job.md)."""
        for i, c in enumerate(callbacks):
            try:
                c.begin(ctx)
            except Exception as e:
                if self.recovery is None or not self.recovery.handles(e):
                    raise
                step = self.recovery.recover(e, callbacks)  # raises when it cannot repair: the caller falls back
                self._went_back(ctx.original_args(), train_dataset, step)
                for later in callbacks[i + 1:]:
                    later.begin(ctx)
                _recovered(callbacks, ctx, train_dataset, step)
                return

    def _went_back(self, cb, train_dataset, step: int) -> None:
        """After a repair in the job: this rank's place (renumbered by an elastic shrink), and the step to redo."""
        cb.rank, cb.world_size, cb.layout = self.groups.rank, self.groups.world.size, self.groups.layout.to_dict()
        cb.network, cb.optimizer = self.network, self.optimizer  # new ones after an elastic shrink
        train_dataset.set_init_step(step)

    def _loop(self, epoch, train_dataset, callbacks, ctx):
        """Train from the dataset's position. After an in-job repair in the middle of an epoch this process had
        begun, that epoch goes on: its epoch_begin hooks do not run again (TimeMonitor times the whole epoch)."""
        cb, spe = ctx.original_args(), train_dataset.get_dataset_size()
        progress = self.groups.runtime.progress  # where this process is, for its hang watch (tft.hang_timeout)
        for ep, step, images, labels in progress.fetched(train_dataset.batches(epoch)):
            cb.cur_epoch_num, cb.cur_step_in_epoch = ep + 1, step  # (after a repair: where it went back to)
            if ep != self._epoch_open:
                self._epoch_open = ep
                _call(callbacks, "epoch_begin", ctx)
            cb.lr = self.optimizer.current_lr()
            _call(callbacks, "step_begin", ctx)
            with progress.watched("step"):  # its progress watched (tft.hang_timeout: dsim.ft.hang)
                cb.net_outputs = self.train_step(images, labels)
            cb.cur_step_in_epoch, cb.cur_step_num = step + 1, cb.cur_step_num + 1
            if self.recovery is not None:
                self.recovery.step_finished(cb.cur_step_num)
            self._ending = ending = _Ending(cb.cur_step_num, step + 1 == spe)
            _call(callbacks, "step_end", ctx, ending.step_end)
            if ending.epoch_end is not None:
                _call(callbacks, "epoch_end", ctx, ending.epoch_end)
                self._epoch_open = None
            self._ending = None
            if ctx.stop_requested:
                break

    def _wind_up(self, callbacks, ctx) -> None:
        """The end of training that the in-job repair still covers: the callbacks' collective work at the end
        (`finishing`: ModelCheckpoint saves the last step and commits a save in flight), then, with the repair on,
        every living rank agrees that training ended before any goes past (InProcessRecovery.leave). A rank that
        dies in the last step is noticed by some ranks inside the loop and not by those past it: without that
        agreement, these began the last gasp while the others began a repair, and each waited for the other."""
        _call(callbacks, "finishing", ctx)
        if self.recovery is not None and self.recovery.watches:
            with self.groups.runtime.progress.watched("callback"):
                self.recovery.leave()

    def _finish(self, ending: "_Ending", callbacks, ctx) -> None:
        """The end hooks of the step a failure interrupted, kept by the repair: those of the local callbacks
        (Callback.local) that had not run for it."""
        local = [c for c in callbacks if c.local]
        _call([c for c in local if c not in ending.step_end], "step_end", ctx)
        if ending.epoch_end is not None:
            _call([c for c in local if c not in ending.epoch_end], "epoch_end", ctx)
            self._epoch_open = None


class _Ending:
    """A step's end hooks on their way: its global step, the callbacks whose step_end ran, and at an epoch's
    last step those whose epoch_end ran (None otherwise)."""

    def __init__(self, global_step: int, last_of_epoch: bool):
        self.global_step, self.step_end, self.epoch_end = global_step, [], [] if last_of_epoch else None


def _recovered(callbacks, ctx, train_dataset, step):
    """After an in-job repair the state is that after `step`: tell the callbacks that care (e.g. a save due then)."""
    cb = ctx.original_args()
    cb.cur_step_num = step
    if step:
        epoch, in_epoch = train_dataset.position(step - 1)  # of the step that finished last
        cb.cur_epoch_num, cb.cur_step_in_epoch = epoch + 1, in_epoch + 1
    for c in callbacks:
        c.recovered(ctx)


def _call(callbacks, hook, ctx, done: list = None):
    """Run `hook` of each callback in turn; `done` gets each callback whose hook returned."""
    progress = ctx.original_args().model.groups.runtime.progress
    with progress.watched("callback"):  # a callback that never returns is judged too (tft.hang_timeout)
        for c in callbacks:
            getattr(c, hook)(ctx)
            if done is not None:
                done.append(c)
