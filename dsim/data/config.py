"""The `data:` section: the training data (dsim.data.factory makes the dataset)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..section import ConfigError, key, need


def _datasets():
    from .factory import NAMES
    return NAMES


@dataclass
class DataConfig:
    """The training data; every random state derives from `seed`."""
    name: str = key("synthetic", "synthetic (MNIST-shaped, generated), mnist (idx files), translation (the "
                                 "transformer's toy task) or text (a source<TAB>target file)", _datasets)
    path: Optional[str] = key(None, "mnist: the idx files' directory (e.g. MNIST_Data/train); text: the pairs file",
                              "a path; required for mnist and text")
    num_samples: int = key(1920, "synthetic and translation: samples generated", ">= 1")
    batch_size: int = key(32, "the global batch, split over the data-parallel ranks", ">= 1")
    shuffle: bool = key(True, "shuffle every epoch (from the seed)")
    eval_samples: int = key(0, "held-out samples (after the training ones; of a file, its last), evaluated after "
                               "every epoch", ">= 0; 0 with pipeline_stage > 1")

    def validate(self) -> None:
        for name in ("batch_size", "num_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config: data.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_samples < 0:
            raise ConfigError(f"config: data.eval_samples must be >= 0, got {self.eval_samples}")
        datasets = _datasets()
        need(self.name in datasets, "data.name", f"one of {', '.join(datasets)}", self.name)
        need(self.path is None or (self.path and "\0" not in self.path), "data.path", "a path or null", self.path)

    def check_path(self) -> None:
        """The file the dataset reads is there (mnist, text), after every rule on the values (validate)."""
        if self.name in ("mnist", "text"):
            if not self.path:
                raise ConfigError(f"config: data.path is required when data.name is {self.name}")
            if not Path(self.path).exists():
                raise ConfigError(f"config: data.path not found: {self.path}")
