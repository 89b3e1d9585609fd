"""Run: everything one rank needs to train, and the factory that made it.

A run is made by dsim.build (from a config, for the CLI) or by dsim.ft.tft from a script's Model. What remakes a
run (a replacement process, an elastic shrink) and what gives its standard callbacks is the `factory` passed in
by its maker: the fault-tolerance layer receives it with the run instead of importing the builder above it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Factory:
    """How runs are made: build(cfg, comm, initialize=True) -> Run; fit(cfg, world_size) -> ParallelLayout (a
    ConfigError or LayoutError when the config cannot train on that many ranks); callbacks(run, extra) -> the
    standard callbacks followed by extra."""

    build: Callable
    fit: Callable
    callbacks: Callable


@dataclass
class Run:
    """Everything one rank needs to train."""

    cfg: object        # dsim.config.Config
    groups: object     # dsim.parallel.groups.Groups
    network: object
    optimizer: object
    model: object      # dsim.engine.model.Model
    loader: object     # dsim.dataset.Dataset
    spares: object = None  # dsim.ft.spares.SparePool with tft.arf: the job's processes and its idle spares
    eval_dataset: object = None  # data.eval_samples: the held-out samples, evaluated after every epoch
    stop_on_signal: object = None  # dsim.ft.preemption.StopOnSignal with checkpoint.save_on_signal
    lease: object = None  # dsim.checkpoint.lease.Lease on the checkpoint directory (rank 0), from before a resume
    saver: object = None  # the ModelCheckpoint it saves with (its async save in flight is abandoned on a failure)
    peer_copies: object = None  # dsim.ft.peer_copy.PeerCopies with tft.peer_copy_every: what the last gasp saves
    factory: Factory = None  # what made it (dsim.build.FACTORY); None for a script's run, which is not remade

    @property
    def runtime(self):
        """The state of this rank's process (dsim.runtime.Runtime), which its groups carry."""
        return self.groups.runtime

    @property
    def checkpoint_dir(self) -> Path:
        c = self.cfg.checkpoint
        return Path(c.directory) if c.directory else Path(self.cfg.output.dir) / "checkpoints"

    @property
    def ttp_dir(self) -> Path:
        """Where last-gasp checkpoints go (the seed's ttp_checkpoints/), by default inside checkpoint_dir."""
        t = self.cfg.tft.ckpt_save_path
        return Path(t) if t else self.checkpoint_dir / "ttp_checkpoints"

    def callbacks(self, extra=()):
        """The standard callbacks (checkpoint, fault, loss, time, progress, metrics) followed by `extra`."""
        return self.factory.callbacks(self, extra)

    def train(self, extra_callbacks=(), initial_epoch=0, joining=None):
        return self.model.train(self.cfg.train.epochs, self.loader, self.callbacks(extra_callbacks),
                                initial_epoch=initial_epoch, joining=joining)
