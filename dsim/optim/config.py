"""The `optimizer:` section: the optimizer and its learning-rate schedule (dsim.optim builds them)."""
from __future__ import annotations

from dataclasses import dataclass

from ..section import key, need


def _optimizers():
    from .optimizers import OPTIMIZERS
    return OPTIMIZERS


def _schedules():
    from .schedule import LRSchedule
    return LRSchedule.NAMES


@dataclass
class ScheduleConfig:
    """The learning-rate schedule, a function of the global step."""
    name: str = key("constant", "the schedule's shape after warmup", _schedules)
    warmup_steps: int = key(0, "steps of linear warmup from 0 to the learning rate", ">= 0")
    decay_steps: int = key(1000, "cosine: steps from the peak to min_lr; exponential: steps per decay_rate factor",
                           ">= 1")
    decay_rate: float = key(0.9, "exponential: the factor applied every decay_steps", "> 0")
    min_lr: float = key(0.0, "cosine: the learning rate the decay ends at", ">= 0")

    def validate(self) -> None:
        names = _schedules()
        need(self.name in names, "optimizer.schedule.name", f"one of {', '.join(names)}", self.name)
        need(self.warmup_steps >= 0, "optimizer.schedule.warmup_steps", ">= 0", self.warmup_steps)
        need(self.decay_steps >= 1, "optimizer.schedule.decay_steps", ">= 1", self.decay_steps)
        need(self.decay_rate > 0, "optimizer.schedule.decay_rate", "> 0", self.decay_rate)
        need(self.min_lr >= 0, "optimizer.schedule.min_lr", ">= 0", self.min_lr)


@dataclass
class OptimizerConfig:
    """The optimizer (MindSpore's names and semantics)."""
    name: str = key("momentum", "sgd, momentum (ApplyMomentum), adam, or adamweightdecay (MindSpore's: no bias "
                                "correction, no decay on LayerNorm and biases)", _optimizers)
    learning_rate: float = key(0.02, "the peak learning rate", "> 0")
    momentum: float = key(0.9, "momentum: the moment's decay", "[0, 1)")
    beta1: float = key(0.9, "adam, adamweightdecay: first moment's decay", "[0, 1)")
    beta2: float = key(0.999, "adam, adamweightdecay: second moment's decay", "[0, 1)")
    eps: float = key(1e-8, "adam, adamweightdecay: added to the second moment's square root", "> 0")
    weight_decay: float = key(0.0, "adamweightdecay: decoupled weight decay", ">= 0")
    schedule: ScheduleConfig = key(doc="the learning-rate schedule", factory=ScheduleConfig)

    def validate(self) -> None:
        optimizers = _optimizers()
        need(self.name in optimizers, "optimizer.name", f"one of {', '.join(optimizers)}", self.name)
        need(self.learning_rate > 0, "optimizer.learning_rate", "> 0", self.learning_rate)
        for name in ("momentum", "beta1", "beta2"):
            need(0 <= getattr(self, name) < 1, f"optimizer.{name}", "in [0, 1)", getattr(self, name))
        need(self.eps > 0, "optimizer.eps", "> 0", self.eps)
        need(self.weight_decay >= 0, "optimizer.weight_decay", ">= 0", self.weight_decay)
        self.schedule.validate()
