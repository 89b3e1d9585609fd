"""Datasets as a script holds them (MindSpore's mindspore.dataset): samples, batched, split, each rank's part.

    train, held_out = dsim.dataset.MnistDataset("MNIST_Data/train", shuffle=False, image_size=32).split([0.9, 0.1])
    train = train.batch(32)            # the global batch; every data-parallel rank reads its contiguous part
    train.get_dataset_size()           # steps per epoch
    train.set_init_step(n)             # start the next epoch iteration at global step n (a resume)

A Dataset becomes this rank's part of every global batch when the model is built (`bind`, from the
layout); until then it only knows its samples and its batch size. Data and shuffling are pure functions of
the seed (the context's, see dsim.set_seed), so a resumed or re-sliced run reads exactly the same batches.
"""
from __future__ import annotations

import copy

import numpy as np

from .data import DatasetError, DistributedSampler
from .data.factory import create_dataset
from .data.loader import DataLoader


class Subset:
    """Samples [start, stop) of a source: a held-out split reads samples the training part never sees."""

    def __init__(self, source, start: int, stop: int):
        if not 0 <= start < stop <= len(source):
            raise DatasetError(f"split [{start}, {stop}) outside the {len(source)} samples of {source!r}")
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def get(self, indices):
        return self.source.get(self.start + np.asarray(indices, dtype=np.int64))

    def __repr__(self) -> str:
        return f"{self.source!r}[{self.start}:{self.stop}]"


class Dataset(DataLoader):
    """Samples of `source` in global batches, cut into this data-parallel rank's part once bound.

    source: anything with len() and get(indices) -> (inputs, labels), e.g. dsim.data's datasets.
    shuffle: a new order every epoch (from the seed); num_steps: cut every epoch to that many steps.
    """

    def __init__(self, source, shuffle: bool = True, batch_size=None, num_steps=None, seed=None):
        self.source, self.shuffle, self.batch_size = source, shuffle, batch_size
        self.num_steps, self.seed = num_steps, seed
        self.sampler, self.init_step = None, 0

    # -- building it, as MindSpore's dataset methods do (each returns a new dataset) -----------------------
    def batch(self, batch_size: int, drop_remainder: bool = True) -> "Dataset":
        """Global batches of batch_size samples (the last partial one dropped, as drop_remainder=True)."""
        if not drop_remainder:
            raise DatasetError("dsim batches drop the remainder: every rank must step the same number of times")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DatasetError(f"batch size must be a positive integer, got {batch_size!r}")
        return self._with(batch_size=batch_size)

    def take(self, count: int) -> "Dataset":
        """Every epoch cut to its first `count` steps (after batch)."""
        return self._with(num_steps=int(count))

    def split(self, sizes) -> list:
        """Consecutive parts, by sample counts or fractions summing to 1 (MindSpore's split, not randomized):
        e.g. split([0.9, 0.1]) -> [the first 90 %, a held-out 10 %]."""
        n = len(self.source)
        if all(isinstance(s, float) for s in sizes):
            if abs(sum(sizes) - 1) > 1e-9:
                raise DatasetError(f"split fractions must sum to 1, got {sizes}")
            counts = [int(round(s * n)) for s in sizes[:-1]]
            counts.append(n - sum(counts))
        else:
            counts = [int(s) for s in sizes]
            if sum(counts) != n:
                raise DatasetError(f"split sizes {counts} do not add up to the {n} samples")
        parts, start = [], 0
        for c in counts:
            parts.append(self._with(source=Subset(self.source, start, start + c)))
            start += c
        return parts

    def _with(self, **changes) -> "Dataset":
        if self.sampler is not None:
            raise DatasetError("a dataset in use by a model cannot be changed; make the new one before training")
        out = copy.copy(self)
        out.__dict__.update(changes)
        return out

    # -- this rank's part ----------------------------------------------------------------------------------
    def bind(self, data_parallel: int, dp_rank: int, seed: int) -> "Dataset":
        """Read this data-parallel rank's contiguous part of every global batch (done by Model.build)."""
        if self.batch_size is None:
            raise DatasetError("the dataset has no batch size: call .batch(batch_size) first")
        self.sampler = DistributedSampler(len(self.source), self.batch_size, data_parallel, dp_rank,
                                          shuffle=self.shuffle, seed=seed if self.seed is None else self.seed)
        return self

    @property
    def steps_per_epoch(self) -> int:
        if self.batch_size is None:
            raise DatasetError("the dataset has no batch size: call .batch(batch_size) first")
        full = len(self.source) // self.batch_size
        return full if self.num_steps is None else min(self.num_steps, full)

    def batches(self, end_epoch: int):
        if self.sampler is None:
            raise DatasetError("the dataset is not bound to a layout yet: model.build(dataset) or model.train does it")
        return super().batches(end_epoch)

    def __repr__(self) -> str:
        return f"Dataset({self.source!r}, batch_size={self.batch_size}, shuffle={self.shuffle})"


def _dtype():
    from .context import get_context
    return get_context().dtype


def _seed():
    from .context import get_context
    return get_context().seed


def MnistDataset(dataset_dir, shuffle: bool = True, image_size=None) -> Dataset:
    """MNIST idx files in dataset_dir (train-images-idx3-ubyte, train-labels-idx1-ubyte, optionally .gz);
    images in [0, 1] (Rescale(1/255)), resized to image_size x image_size when given (LeNet5's Resize(32, 32)),
    else normalized as the last-gasp page's Normalize((0.1307,), (0.3081,)); int labels."""
    return Dataset(create_dataset("mnist", dataset_dir, dtype=_dtype(), image_size=image_size), shuffle)


def SyntheticMnist(num_samples: int = 60000, shuffle: bool = True, image_size=None) -> Dataset:
    """A deterministic MNIST-shaped dataset from the seed (nothing to download); image_size as MnistDataset."""
    return Dataset(create_dataset("synthetic", num_samples=num_samples, seed=_seed(), dtype=_dtype(),
                                  image_size=image_size), shuffle)


def TranslationDataset(num_samples: int = 1920, src_len: int = 10, tgt_len: int = 10, vocab_size: int = 20000,
                       shuffle: bool = True, path=None) -> Dataset:
    """The transformer's data: the toy translation task from the seed, or `source<TAB>target` lines of path."""
    return Dataset(create_dataset("text" if path else "translation", path, num_samples=num_samples, seed=_seed(),
                                  src_len=src_len, tgt_len=tgt_len, vocab_size=vocab_size), shuffle)


__all__ = ["Dataset", "Subset", "MnistDataset", "SyntheticMnist", "TranslationDataset", "DatasetError"]
