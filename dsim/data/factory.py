"""Build a dataset from its config name, as the CLI and configs spell it."""
from __future__ import annotations

import numpy as np

from . import DatasetError
from .mnist import MnistDataset
from .synthetic import SyntheticMNIST

NAMES = ("synthetic", "mnist")


def create_dataset(name: str, path=None, num_samples: int = 60000, seed: int = 0, dtype=np.float32,
                   image_size=None):
    """SyntheticMNIST(num_samples, seed) for 'synthetic', MnistDataset(path) for 'mnist'."""
    key = str(name).lower()
    if key == "synthetic":
        return SyntheticMNIST(num_samples=num_samples, seed=seed, dtype=dtype, image_size=image_size)
    if key == "mnist":
        if path is None:
            raise DatasetError("dataset 'mnist' needs a path (e.g. MNIST_Data/train)")
        return MnistDataset(path, dtype=dtype, image_size=image_size)
    raise DatasetError(f"unknown dataset {name!r}: expected one of {', '.join(NAMES)}")
