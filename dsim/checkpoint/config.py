"""CheckpointConfig: when to save, how many to keep, and what to add (MindSpore's names); and CheckpointSection,
the `checkpoint:` section of a run's config, which adds where, under which name and what a failed save does, and
gives the saver its CheckpointConfig (saver_config).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ..section import ConfigError, key, need
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
                for name, value in item.items():
                    ok = isinstance(value, (bool, int, float, str, np.ndarray, list))
                    if not isinstance(name, str) or not ok:
                        raise CheckpointError(f"checkpoint: append_info entry {name!r}: {value!r} must be str -> "
                                              "int/float/bool/str/array")
            elif item not in ("epoch_num", "step_num"):
                raise CheckpointError(f"checkpoint: append_info takes 'epoch_num', 'step_num' or a dict, got {item!r}")


@dataclass
class CheckpointSection:
    """Periodic checkpoints (MindSpore's CheckpointConfig and ModelCheckpoint)."""
    enabled: bool = key(True, "save checkpoints")
    prefix: str = key("network", "file name prefix: <prefix>-<epoch>_<step>; a prefix in use gets _1, _2, ...",
                      "a plain file name (no '/')")
    directory: Optional[str] = key(None, "where checkpoints go; null: <output.dir>/checkpoints",
                                   "a writable directory or null")
    save_checkpoint_steps: Optional[int] = key(None, "save every N steps (set this or save_checkpoint_epochs; "
                                                     "neither: every step)", ">= 1 or null")
    save_checkpoint_epochs: Optional[int] = key(1, "save at the end of every N-th epoch", ">= 1 or null")
    keep_checkpoint_max: int = key(5, "committed checkpoints kept; the oldest is removed after a new one commits",
                                   ">= 1")
    integrated_save: bool = key(False, "one file of whole tensors instead of each rank saving only its own slices")
    append_info: list[Any] = key(doc="extra values saved in every file: epoch_num, step_num and {name: value} "
                                     "mappings", allowed="'epoch_num', 'step_num' or {str: number | bool | str}",
                                 factory=lambda: ["epoch_num", "step_num"])
    group_info_file: Optional[str] = key(None, "also write the rank's group info here ({rank} becomes the rank); "
                                               "$GROUP_INFO_FILE sets it too", "a path or null")
    on_save_error: str = key("stop", "a save the storage refuses: stop (exit 1) or continue (warn, try again at the "
                                     "next save)", "stop | continue")
    async_save: bool = key(False, "write the files in a background thread; commit once every rank's file is durable")
    async_staging: str = key("memory", "where an async save stages the state: memory (a reused buffer) or "
                                       "page_cache (the file itself)", ASYNC_STAGING)
    save_on_signal: bool = key(False, "on SIGUSR2 or SIGTERM, stop after a step every rank agrees on, save it, and "
                                      "exit 128 + the signal", "needs enabled")

    def saver_config(self) -> CheckpointConfig:
        """The saver's CheckpointConfig of this section (raises CheckpointError for values it cannot save with)."""
        return CheckpointConfig(self.save_checkpoint_steps, self.save_checkpoint_epochs, self.keep_checkpoint_max,
                                self.integrated_save, self.append_info, self.async_save, self.async_staging)

    def validate(self) -> None:
        if self.on_save_error not in ("stop", "continue"):
            raise ConfigError(f"config: checkpoint.on_save_error must be stop or continue, got {self.on_save_error!r}")
        if self.save_on_signal and not self.enabled:
            raise ConfigError("config: checkpoint.save_on_signal saves the step training stops at: it needs "
                              "checkpoint.enabled")
        p = self.prefix
        prefix_ok = bool(p) and p not in (".", "..") and not any(ch in p for ch in "/\\\0")
        need(prefix_ok, "checkpoint.prefix", "a plain file name (no '/')", p)
        if self.group_info_file is not None:
            need(bool(self.group_info_file.strip()), "checkpoint.group_info_file", "a path or null",
                 self.group_info_file)
        d = self.directory
        need(d is None or (d and "\0" not in d), "checkpoint.directory", "a path or null", d)
        if self.enabled:
            try:
                self.saver_config()
            except CheckpointError as e:
                raise ConfigError(f"config: {e}") from None
