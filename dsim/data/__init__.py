"""Datasets (synthetic and real MNIST, toy and file translation pairs) and the data-parallel sampler."""
from __future__ import annotations


class DatasetError(ValueError):
    """Bad dataset input (path, file contents or batch sizes); the message is one line."""


from .synthetic import SyntheticMNIST  # noqa: E402  (modules below import DatasetError from here)
from .mnist import MnistDataset, write_idx  # noqa: E402
from .translation import EOT, PAD, UNK, TextTranslation, ToyTranslation, write_pairs  # noqa: E402
from .sampler import DistributedSampler  # noqa: E402
from .factory import create_dataset  # noqa: E402

__all__ = ["DatasetError", "SyntheticMNIST", "MnistDataset", "DistributedSampler", "write_idx",
           "create_dataset", "ToyTranslation", "TextTranslation", "write_pairs", "UNK", "PAD", "EOT"]
