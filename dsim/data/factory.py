"""Build a dataset from its config name, as the CLI and configs spell it."""
from __future__ import annotations

import numpy as np

from .errors import DatasetError
from .mnist import MnistDataset
from .synthetic import SyntheticMNIST
from .translation import TextTranslation, ToyTranslation

NAMES = ("synthetic", "mnist", "translation", "text")
TOKEN_DATASETS = ("translation", "text")  # what the transformer reads; the others are images


def create_dataset(name: str, path=None, num_samples: int = 60000, seed: int = 0, dtype=np.float32,
                   image_size=None, src_len: int = 10, tgt_len: int = 10, vocab_size: int = 20000):
    """The dataset `name` (one of NAMES); options that do not apply to it are ignored.

    'synthetic': SyntheticMNIST(num_samples, seed), 'mnist': MnistDataset(path) (images resized to
    image_size when set), 'translation': ToyTranslation(num_samples, seed), 'text': TextTranslation(path)
    (both translations sized by src_len, tgt_len and vocab_size).
    """
    key = str(name).lower()
    if key == "synthetic":
        return SyntheticMNIST(num_samples=num_samples, seed=seed, dtype=dtype, image_size=image_size)
    if key == "translation":
        return ToyTranslation(num_samples, src_len=src_len, tgt_len=tgt_len, vocab_size=vocab_size,
                              seed=seed)
    if key in ("mnist", "text") and path is None:
        example = "MNIST_Data/train" if key == "mnist" else "data/pairs.txt"
        raise DatasetError(f"dataset {key!r} needs a path (e.g. {example})")
    if key == "mnist":
        return MnistDataset(path, dtype=dtype, image_size=image_size)
    if key == "text":
        return TextTranslation(path, src_len=src_len, tgt_len=tgt_len, vocab_size=vocab_size)
    raise DatasetError(f"unknown dataset {name!r}: expected one of {', '.join(NAMES)}")
