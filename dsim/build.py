"""From a config and a communicator to a ready-to-train Model: config -> layout -> model/optimizer -> data.

The CLI wires a run with the public API a script uses (dsim.context, dsim.dataset, Model.build), from
its config: one way things are wired.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import Config, ConfigError
from .context import fit_layout, use
from .data import create_dataset
from .dataset import Dataset
from .nn import create_network
from .optim import LRSchedule, create_optimizer
from .parallel.layout import LayoutError, ParallelLayout
from .engine.callbacks import EvalMonitor, LossMonitor, MetricsLog, ProgressBar, TimeMonitor
from .engine.model import Model
from .engine.run import Factory, Run


def resolve_layout(cfg: Config, world_size: int) -> ParallelLayout:
    """The layout of the config on world_size ranks (data_parallel may be left out: the rest of the world)."""
    p = cfg.parallel
    try:
        layout = fit_layout(world_size, p.data_parallel, p.model_parallel, p.optimizer_shard, p.pipeline_stage)
    except LayoutError as e:
        if p.data_parallel is None and "does not divide" in str(e):
            raise ConfigError(str(e)) from None
        raise
    dp = layout.data_parallel
    local = cfg.data.batch_size // dp
    if p.micro_batch_num > 1 and cfg.data.batch_size % dp:
        raise ConfigError(f"layout: micro_batch_num={p.micro_batch_num} needs data.batch_size={cfg.data.batch_size} "
                          f"divisible by data_parallel={dp}")
    if local % p.micro_batch_num:
        raise ConfigError(f"layout: micro_batch_num={p.micro_batch_num} does not divide the batch of "
                          f"{local} per data-parallel rank (data.batch_size={cfg.data.batch_size} / "
                          f"data_parallel={dp})")
    return layout


def build_run(cfg: Config, comm, initialize: bool = True) -> Run:
    """Build layout, groups, sharded network, optimizer and this rank's data for `comm`.

    initialize=False builds the parameters as zeros (see Cell.build): for a newcomer that receives them.
    """
    layout = resolve_layout(cfg, comm.size)
    p = cfg.parallel
    use(comm, data_parallel=layout.data_parallel, model_parallel=p.model_parallel, optimizer_shard=p.optimizer_shard,
        pipeline_stage=p.pipeline_stage, micro_batch_num=p.micro_batch_num, pipeline_schedule=p.pipeline_schedule,
        vocab_emb_dp=p.vocab_emb_dp, seed=cfg.seed, dtype=cfg.dtype, output_dir=cfg.output.dir)
    m = cfg.model
    try:
        network = create_network(m.name, m.hidden, vars(m.transformer), cfg.parallel.vocab_emb_dp)
    except LayoutError as e:
        raise ConfigError(f"config: {e}") from None
    dtype = np.dtype(cfg.dtype)
    network.build(layout, comm.rank, cfg.seed, dtype, initialize)  # raises LayoutError before any collective
    o = cfg.optimizer
    schedule = LRSchedule(o.learning_rate, **vars(o.schedule))
    adam = {"beta1": o.beta1, "beta2": o.beta2, "eps": o.eps}
    kwargs = {"sgd": {}, "momentum": {"momentum": o.momentum}, "adam": adam, "adamweightdecay": adam}.get(o.name, {})
    optimizer = create_optimizer(o.name, network.trainable_params(), schedule, weight_decay=o.weight_decay, **kwargs)
    if cfg.tft.ttp:
        from .ft import OptTFTWrapper
        optimizer = OptTFTWrapper(optimizer)  # keeps the state before each update, for the last gasp
    d = cfg.data
    t = m.transformer
    # a generated dataset draws sample i from (seed, i): the held-out samples are those after the training ones
    source = create_dataset(d.name, d.path, num_samples=d.num_samples + d.eval_samples, seed=cfg.seed, dtype=dtype,
                            image_size=network.image_size, src_len=t.src_len, tgt_len=t.tgt_len,
                            vocab_size=t.vocab_size)
    dataset, held_out = Dataset(source, shuffle=d.shuffle, num_steps=cfg.train.steps_per_epoch), None
    if d.eval_samples:
        dataset, held_out = dataset.split([len(source) - d.eval_samples, d.eval_samples])
        held_out = held_out._with(shuffle=False, num_steps=None).batch(min(d.batch_size, d.eval_samples))
    dataset = dataset.batch(d.batch_size)
    model = Model(network, optimizer=optimizer).build(dataset, held_out)  # the groups, this rank's part of the data
    run = Run(cfg, model.groups, network, optimizer, model, dataset, eval_dataset=held_out, factory=FACTORY)
    if cfg.tft.uce or cfg.tft.arf or cfg.tft.elastic:
        from .ft.inprocess import InProcessRecovery
        model.recovery = InProcessRecovery(run)
    if cfg.tft.sdc_check_every and cfg.tft.sdc_rollback:
        from .ft.sdc import Rollback
        model.rollback = Rollback(run)
    return run


def standard_callbacks(run: Run, extra=()):
    """The standard callbacks (checkpoint, fault, loss, time, progress, metrics) followed by `extra`.

    The checkpoint callback runs first so a fault at the end of a step or epoch finds it saved.
    """
    from .checkpoint import ModelCheckpoint
    from .faults import FaultInjector
    cfg, out = run.cfg, run.cfg.output
    cbs, saver, sdc = [], None, None
    if cfg.tft.sdc_check_every:  # first: the replicas are compared before a save at the same step
        from .ft.sdc import SdcCheck
        sdc = SdcCheck(cfg.tft.sdc_check_every)
        cbs.append(sdc)
    c = cfg.checkpoint
    if c.enabled:
        saver = ModelCheckpoint(c.prefix, run.checkpoint_dir, c.saver_config(), c.group_info_file, c.on_save_error,
                                lease=run.lease)
        if sdc is not None:  # a checkpoint is saved only from replicas found identical
            saver.before_save.append(sdc.check)
        cbs.append(saver)
    run.saver = saver
    if cfg.fault.kind:
        f = cfg.fault
        cbs.append(FaultInjector(f.kind, f.rank, f.step, f.epoch, f.at, f.last_gasp_kill, f.slowdown,
                                 f.last_gasp_stuck, f.repair_kill, f.repair_hang,
                                 f.repair_at, f.repair_stuck))
    t = cfg.tft
    if t.hang_timeout or t.straggler_factor:
        from .ft.hang import HangWatch
        cbs.append(HangWatch(t.hang_timeout, out.dir, t.straggler_factor, t.straggler_evict, t.deadlock_timeout))
    if t.peer_copy_every:  # each rank's state in another host's memory, for the last gasp
        from .ft.peer_copy import PeerCopies
        run.peer_copies = PeerCopies(run, t.peer_copy_every)
        cbs.append(run.peer_copies)
    if c.save_on_signal:  # after the checkpoint (its end saves the step), before the metrics (its event)
        from .ft.preemption import StopOnSignal
        run.stop_on_signal = StopOnSignal(saver)
        cbs.append(run.stop_on_signal)
    evaluate = [EvalMonitor(run.eval_dataset)] if run.eval_dataset is not None else []
    return cbs + [LossMonitor(out.loss_every), TimeMonitor(), *evaluate, ProgressBar(out.progress_bar),
                  MetricsLog(Path(out.dir) / "metrics.jsonl"), *extra]


FACTORY = Factory(build=build_run, fit=resolve_layout, callbacks=standard_callbacks)
