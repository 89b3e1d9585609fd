"""Real MNIST from idx files laid out like MindSpore's `MNIST_Data/train`, and an idx writer.

idx format: big-endian int32 magic `0x0000 <dtype> <ndim>` (2051 = uint8 3-D images, 2049 = uint8
1-D labels), then ndim big-endian uint32 sizes, then the raw bytes.
"""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np

from .errors import DatasetError
from .transforms import check_image_size, resize_bilinear

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
_PREFIXES = ("train", "t10k")  # the train files win when both sets are present


def normalize(images01: np.ndarray, dtype=np.float32) -> np.ndarray:
    """MindSpore's Normalize(mean=0.1307, std=0.3081) on [0, 1] images, as the seeds do for MNIST."""
    x = np.asarray(images01, dtype=dtype)
    return (x - x.dtype.type(MNIST_MEAN)) / x.dtype.type(MNIST_STD)


def _read_bytes(path: str) -> bytes:
    """The (decompressed) contents of path."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"cannot read {path}: {e}") from None


def read_idx(path: str, magic: int) -> np.ndarray:
    """The uint8 array stored in idx file path, whose magic must be `magic`."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise DatasetError(f"truncated idx file {path}: {len(data)} bytes, no header")
    (found,) = struct.unpack(">i", data[:4])
    if found != magic:
        raise DatasetError(f"bad magic in {path}: expected {magic}, got {found}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"truncated idx file {path}: {len(data)} bytes, header needs {header}")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise DatasetError(f"wrong size for idx file {path}: header {shape} needs {expected} bytes, "
                           f"file has {len(data)}")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def _find(path: str, name: str) -> str | None:
    """path/name or path/name.gz, whichever exists (uncompressed first)."""
    for candidate in (name, name + ".gz"):
        full = os.path.join(path, candidate)
        if os.path.isfile(full):
            return full
    return None


def _locate(path: str) -> tuple[str, str]:
    """The images and labels files of the first split (train, then t10k) found in directory path."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset path not found: {path}")
    if not os.path.isdir(path):
        raise DatasetError(f"dataset path is not a directory: {path}")
    for prefix in _PREFIXES:
        images = _find(path, f"{prefix}-images-idx3-ubyte")
        if images is None:
            continue
        labels = _find(path, f"{prefix}-labels-idx1-ubyte")
        if labels is None:
            raise DatasetError(f"labels file missing: {os.path.join(path, prefix + '-labels-idx1-ubyte')}"
                               f"[.gz] (images are {images})")
        return images, labels
    raise DatasetError(f"no MNIST images file in {path}: expected train-images-idx3-ubyte[.gz] "
                       f"or t10k-images-idx3-ubyte[.gz]")


class MnistDataset:
    """Real MNIST from the idx files in directory `path`; same len/get API as SyntheticMNIST.

    image_size=32 resizes every image to 32x32 (bilinear) and leaves it in [0, 1]: the LeNet5 page's transforms.
    """

    def __init__(self, path, dtype=np.float32, image_size=None):
        self.path, self.dtype = os.fspath(path), np.dtype(dtype)
        self.image_size = check_image_size(image_size)
        self.images_file, self.labels_file = _locate(self.path)
        self._images = read_idx(self.images_file, IMAGES_MAGIC)
        self._labels = read_idx(self.labels_file, LABELS_MAGIC)
        if len(self._images) != len(self._labels):
            raise DatasetError(f"count mismatch in {self.path}: {len(self._images)} images but "
                               f"{len(self._labels)} labels")
        if len(self._images) == 0:
            raise DatasetError(f"empty dataset: {self.images_file} holds 0 images")

    def __len__(self) -> int:
        return len(self._labels)

    def __repr__(self) -> str:
        return f"MnistDataset({self.path!r}, n={len(self)})"

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(1, rows, cols) of one image, after any resize."""
        if self.image_size is not None:
            return (1, self.image_size, self.image_size)
        return (1,) + self._images.shape[1:]

    def get(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Images (n, 1, rows, cols) in self.dtype and int64 labels (n,) of the given sample indices."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise DatasetError(f"sample index out of range [0, {n}): {idx[(idx < 0) | (idx >= n)][0]}")
        images = self._images[idx].astype(self.dtype) / self.dtype.type(255)
        if self.image_size is not None:
            # the fault-recovery page's LeNet5 pipeline: Rescale(1/255), Resize(32, 32), no Normalize
            images = resize_bilinear(images, self.image_size, self.image_size)
            return images[:, None].astype(self.dtype), self._labels[idx].astype(np.int64)
        return normalize(images[:, None], self.dtype), self._labels[idx].astype(np.int64)


def write_idx(path, array) -> None:
    """Write a uint8 array (3-D images or 1-D labels) to path in idx format, gzipped if path ends in .gz."""
    path = os.fspath(path)
    arr = np.asarray(array)
    if arr.ndim not in (1, 3):
        raise DatasetError(f"write_idx {path}: need a 1-D (labels) or 3-D (images) array, got {arr.ndim}-D")
    if arr.dtype != np.uint8:
        # accept any integer array whose values fit, so users can pass plain label lists
        if arr.dtype.kind not in "iub" or (arr.size and (arr.min() < 0 or arr.max() > 255)):
            raise DatasetError(f"write_idx {path}: values must be uint8 (0..255), got dtype {arr.dtype}")
        arr = arr.astype(np.uint8)
    header = struct.pack(f">i{arr.ndim}I", 0x0800 | arr.ndim, *arr.shape)
    payload = header + np.ascontiguousarray(arr).tobytes()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)
