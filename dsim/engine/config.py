"""The `train:` and `output:` sections: how long the loop trains, and where it writes and what it prints."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..section import ConfigError, key, need


@dataclass
class TrainConfig:
    """How long training runs."""
    epochs: int = key(2, "epochs to train (the last epoch, on a resume)", ">= 1")
    steps_per_epoch: Optional[int] = key(None, "cut every epoch to this many steps; null: the whole dataset",
                                         ">= 1 or null")

    def validate(self) -> None:
        for name in ("epochs", "steps_per_epoch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"config: train.{name} must be >= 1, got {value}")


@dataclass
class OutputConfig:
    """Where a run writes, and what it prints."""
    dir: str = key("runs/default", "metrics.jsonl, logs/ and (by default) checkpoints/ go here", "a path")
    progress_bar: bool = key(True, "a tqdm progress bar on rank 0 when stderr is a terminal")
    loss_every: int = key(10, "LossMonitor prints the loss every N steps", ">= 1")

    def validate(self) -> None:
        if self.loss_every < 1:
            raise ConfigError(f"config: output.loss_every must be >= 1, got {self.loss_every}")
        need(bool(self.dir) and "\0" not in self.dir, "output.dir", "a path", self.dir)
