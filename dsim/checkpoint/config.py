"""CheckpointConfig: when to save, how many to keep, and what to add (MindSpore's names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .errors import CheckpointError

ASYNC_STAGING = ("memory", "page_cache")  # an async save's snapshot: a reused buffer, or the file's page cache


@dataclass
class CheckpointConfig:
    """save_checkpoint_steps / save_checkpoint_epochs (one of them), keep_checkpoint_max, integrated_save,
    append_info: ["epoch_num", "step_num", {str: int | float | bool | str | array}], async_save (write the
    files in a background thread from a snapshot; commit once every rank's file is durable), async_staging
    (where an async save's snapshot lives: "memory", a reused buffer, or "page_cache", the file itself)."""

    save_checkpoint_steps: Optional[int] = None
    save_checkpoint_epochs: Optional[int] = None
    keep_checkpoint_max: int = 5
    integrated_save: bool = False
    append_info: list = field(default_factory=list)
    async_save: bool = False
    async_staging: str = "memory"

    def due(self, step: int, steps_per_epoch: int) -> bool:
        """Whether global step `step` (1-based) ends with a periodic save: every save_checkpoint_steps steps, or at
        the end of every save_checkpoint_epochs-th epoch. (ModelCheckpoint also saves the last step of training.)"""
        n, e = self.save_checkpoint_steps, self.save_checkpoint_epochs
        return bool(n and step % n == 0 or e and step % steps_per_epoch == 0 and (step // steps_per_epoch) % e == 0)

    def __post_init__(self):
        if self.save_checkpoint_steps is None and self.save_checkpoint_epochs is None:
            self.save_checkpoint_steps = 1  # MindSpore's default
        if self.save_checkpoint_steps is not None and self.save_checkpoint_epochs is not None:
            raise CheckpointError("checkpoint: set save_checkpoint_steps or save_checkpoint_epochs, not both")
        for name in ("save_checkpoint_steps", "save_checkpoint_epochs", "keep_checkpoint_max"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise CheckpointError(f"checkpoint: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.async_save, bool):
            raise CheckpointError(f"checkpoint: async_save must be true or false, got {self.async_save!r}")
        if self.async_staging not in ASYNC_STAGING:
            raise CheckpointError(f"checkpoint: async_staging must be {' or '.join(ASYNC_STAGING)}, "
                                  f"got {self.async_staging!r}")
        for item in self.append_info:
            if isinstance(item, dict):
                for key, value in item.items():
                    ok = isinstance(value, (bool, int, float, str, np.ndarray, list))
                    if not isinstance(key, str) or not ok:
                        raise CheckpointError(f"checkpoint: append_info entry {key!r}: {value!r} must be str -> "
                                              "int/float/bool/str/array")
            elif item not in ("epoch_num", "step_num"):
                raise CheckpointError(f"checkpoint: append_info takes 'epoch_num', 'step_num' or a dict, got {item!r}")
