"""Image transforms of the LeNet5 pipeline, on whole batches: bilinear resize (MindSpore's Resize).

Bilinear interpolation is separable and linear, so resizing is two small matrix products,
out = Ry @ img @ Rx.T, over every image of the batch at once.
"""
from __future__ import annotations

import numpy as np

from .errors import DatasetError


def interpolation_matrix(size_in: int, size_out: int, dtype=np.float64) -> np.ndarray:
    """The (size_out, size_in) bilinear weights with half-pixel centres (align_corners=False).

    Output pixel o samples input coordinate (o + 0.5) * size_in / size_out - 0.5, clamped to the
    edge pixels as OpenCV's INTER_LINEAR does; each row sums to 1.
    """
    coord = (np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5
    coord = np.clip(coord, 0.0, size_in - 1)
    lo = np.floor(coord).astype(np.int64)
    hi = np.minimum(lo + 1, size_in - 1)
    frac = coord - lo
    weights = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    np.add.at(weights, (rows, lo), 1.0 - frac)
    np.add.at(weights, (rows, hi), frac)
    return weights.astype(dtype)


def resize_bilinear(images, height: int, width: int) -> np.ndarray:
    """images (..., H, W) resized to (..., height, width); float inputs keep their dtype."""
    x = np.asarray(images)
    if x.ndim < 2:
        raise DatasetError(f"resize needs images of shape (..., H, W), got shape {x.shape}")
    if int(height) < 1 or int(width) < 1:
        raise DatasetError(f"resize needs a positive size, got {height}x{width}")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    h, w = x.shape[-2:]
    if (h, w) == (int(height), int(width)):
        return x.copy()
    ry = interpolation_matrix(h, int(height), x.dtype)
    rx = interpolation_matrix(w, int(width), x.dtype)
    return np.matmul(np.matmul(ry, x), rx.T)


def check_image_size(image_size) -> int | None:
    """image_size as an int side (None = keep the native size); a DatasetError unless it is >= 1."""
    if image_size is None:
        return None
    try:
        side = int(image_size)
    except (TypeError, ValueError):
        side = 0
    if side < 1 or side != image_size:
        raise DatasetError(f"image_size must be a positive integer or None, got {image_size!r}")
    return side
