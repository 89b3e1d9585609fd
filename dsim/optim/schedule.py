"""Learning-rate schedules: pure functions of the global step, so the step counter is their whole state."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for step = 0, 1, ...: linear warmup, then constant, cosine or exponential decay.

    constant:    base_lr
    cosine:      min_lr + (base_lr - min_lr) * (1 + cos(pi * t / decay_steps)) / 2, t capped at decay_steps
    exponential: base_lr * decay_rate ** (t / decay_steps)   (MindSpore's ExponentialDecayLR)
    where t counts steps after warmup.
    """

    base_lr: float
    name: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 1000
    decay_rate: float = 0.9
    min_lr: float = 0.0

    NAMES = ("constant", "cosine", "exponential")

    def __post_init__(self):
        if self.name not in self.NAMES:
            raise ValueError(f"unknown schedule {self.name!r}; choose from {list(self.NAMES)}")
        if self.decay_steps < 1 or self.warmup_steps < 0:
            raise ValueError("schedule decay_steps must be >= 1 and warmup_steps >= 0")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        t = step - self.warmup_steps
        if self.name == "cosine":
            t = min(t, self.decay_steps)
            return self.min_lr + (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * t / self.decay_steps)) / 2
        if self.name == "exponential":
            return self.base_lr * self.decay_rate ** (t / self.decay_steps)
        return self.base_lr

    def to_dict(self) -> dict:
        return {"base_lr": self.base_lr, "name": self.name, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "decay_rate": self.decay_rate, "min_lr": self.min_lr}
