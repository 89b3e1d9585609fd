"""Datasets (synthetic and real MNIST, toy and file translation pairs) and the data-parallel sampler."""
from __future__ import annotations

from .errors import DatasetError
from .synthetic import SyntheticMNIST
from .mnist import MnistDataset, write_idx
from .translation import EOT, PAD, UNK, TextTranslation, ToyTranslation, write_pairs
from .sampler import DistributedSampler
from .factory import create_dataset

__all__ = ["DatasetError", "SyntheticMNIST", "MnistDataset", "DistributedSampler", "write_idx",
           "create_dataset", "ToyTranslation", "TextTranslation", "write_pairs", "UNK", "PAD", "EOT"]
