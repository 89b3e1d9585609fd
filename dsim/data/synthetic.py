"""A deterministic MNIST-shaped dataset generated on demand, so nothing has to be downloaded.

Sample i is drawn from its own counter-based generator seeded with (seed, i), so any rank can produce
any sample without generating the others, and a resumed run sees exactly the same data.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .errors import DatasetError
from .mnist import normalize
from .transforms import check_image_size, resize_bilinear

SIDE = 28
_SHIFT = 2            # max translation in pixels, each axis
_NOISE = 0.5          # std of the per-pixel gaussian noise, in [0, 1] intensity units
_STROKES = 3          # strokes per class prototype
_SHARED_STROKES = 2   # strokes common to every class: classes overlap, so they are not trivially apart
_PROTO_TAG = 0x5EED0  # separate the prototype stream from the per-sample streams
_SAMPLE_TAG = 0x5A3D1


def _draw_strokes(rng: np.random.Generator, count: int) -> np.ndarray:
    """Smooth line strokes with soft gaussian edges, summed into one SIDE x SIDE image."""
    yy, xx = np.mgrid[0:SIDE, 0:SIDE].astype(np.float64)
    img = np.zeros((SIDE, SIDE))
    for _ in range(count):
        # keep strokes inside the frame even after the largest shift
        (y0, x0), (y1, x1) = rng.uniform(6, SIDE - 6, size=(2, 2))
        width = rng.uniform(1.0, 1.8)
        dy, dx = y1 - y0, x1 - x0
        t = np.clip(((yy - y0) * dy + (xx - x0) * dx) / (dy * dy + dx * dx + 1e-9), 0.0, 1.0)
        dist2 = (yy - (y0 + t * dy)) ** 2 + (xx - (x0 + t * dx)) ** 2
        img = np.maximum(img, np.exp(-dist2 / (2 * width * width)))
    return img


def make_prototypes(seed: int) -> np.ndarray:
    """The 10 class prototypes (10, SIDE, SIDE) in [0, 1] that a seed defines."""
    rng = np.random.default_rng([seed, _PROTO_TAG])
    shared = _draw_strokes(rng, _SHARED_STROKES)
    return np.stack([np.maximum(shared, _draw_strokes(rng, _STROKES)) for _ in range(10)])


class SyntheticMNIST:
    """MNIST-shaped samples (1x28x28 image, label 0..9): class prototype + noise + shift, normalized.

    image_size=32 resizes every image to 32x32 (bilinear) and leaves it in [0, 1]: the LeNet5 page's transforms.
    """

    def __init__(self, num_samples: int = 60000, seed: int = 0, dtype=np.float32, image_size=None):
        if int(num_samples) <= 0:
            raise DatasetError(f"synthetic dataset needs num_samples > 0, got {num_samples}")
        if int(seed) < 0:
            raise DatasetError(f"synthetic dataset needs seed >= 0, got {seed}")
        self.num_samples, self.seed, self.dtype = int(num_samples), int(seed), np.dtype(dtype)
        self.image_size = check_image_size(image_size)
        # padded so that a shift is a plain slice (no wrap-around like np.roll)
        protos = make_prototypes(self.seed).astype(np.float32)
        self._padded = np.pad(protos, ((0, 0), (_SHIFT, _SHIFT), (_SHIFT, _SHIFT)))

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        size = "" if self.image_size is None else f", image_size={self.image_size}"
        return f"SyntheticMNIST(num_samples={self.num_samples}, seed={self.seed}{size})"

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(1, side, side) of one image."""
        side = SIDE if self.image_size is None else self.image_size
        return (1, side, side)

    def get(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Images (n, 1, side, side) in self.dtype and int64 labels (n,) of the given sample indices."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise DatasetError(f"sample index out of range [0, {self.num_samples}): "
                               f"{idx[(idx < 0) | (idx >= self.num_samples)][0]}")
        images, labels = self._images(idx)
        np.clip(images, 0.0, 1.0, out=images)
        if self.image_size is not None:
            # the fault-recovery page's LeNet5 pipeline: Rescale(1/255), Resize(32, 32), no Normalize
            return resize_bilinear(images, self.image_size, self.image_size).astype(self.dtype), labels
        return normalize(images, self.dtype), labels

    def _images(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unclipped images (n, 1, SIDE, SIDE) (about [0, 1]) and labels of samples idx, sample i drawn from the
        (seed, i) stream only: its label, shift, contrast and noise, in that order; the arithmetic on the batch."""
        n = idx.size
        labels, shifts = np.empty(n, dtype=np.int64), np.empty((n, 2), dtype=np.int64)
        contrast = np.empty(n, dtype=np.float32)
        noise = np.empty((n, 1, SIDE, SIDE), dtype=np.float32)
        for k, i in enumerate(idx.tolist()):
            rng = np.random.default_rng([self.seed, _SAMPLE_TAG, i])
            labels[k] = rng.integers(10)
            shifts[k] = rng.integers(0, 2 * _SHIFT + 1, size=2)
            contrast[k] = rng.uniform(0.6, 1.2)
            rng.standard_normal(dtype=np.float32, out=noise[k, 0])
        # each image: its prototype shifted, times its contrast, plus the noise's share
        shifted = sliding_window_view(self._padded, (SIDE, SIDE), axis=(1, 2))[labels, shifts[:, 0], shifts[:, 1]]
        images = np.multiply(shifted[:, None], contrast[:, None, None, None])
        noise *= np.float32(_NOISE)
        images += noise
        return images, labels
