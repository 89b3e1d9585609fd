"""Real digit shapes without a download: the digits 0-9 of the fonts matplotlib ships, distorted like handwriting.

MNIST itself cannot be fetched here (no network at test time) and no installed package ships it. These are the
glyphs of the TrueType fonts in matplotlib's mpl-data (DejaVu Sans, Sans Mono and Serif, STIX, Computer Modern;
matplotlib is dsim's `plot` extra), each rendered with a random affine (rotation, shear, aspect), stroke width
and an elastic distortion (Simard et al., 2003), then laid out as MNIST is: the digit fitted into 20x20,
anti-aliased, centred by its centre of mass in 28x28, uint8, white on black. Sample i is a pure function of
(seed, i). `write_digits` writes them as `MNIST_Data/train`'s idx files, so dsim.dataset.MnistDataset, the CLI
(data.name: mnist) and examples/fault_recover read them as they read the real set.

    python -m dsim.data.glyphs MNIST_Data/train 4000      # train-images-idx3-ubyte, train-labels-idx1-ubyte
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from .errors import DatasetError
from .mnist import write_idx

FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
         "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
         "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
         "DejaVuSerif-BoldItalic.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf",
         "STIXGeneralBolIta.ttf", "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmb10.ttf", "cmti10.ttf")
CANVAS = 64          # pixels of the rendering, before the MNIST layout shrinks it
_TAG = 0xD161750     # the digit stream, apart from the synthetic set's


def _font_files() -> list:
    try:
        import matplotlib
        from PIL import ImageFont
    except ImportError as e:
        raise DatasetError(f"the glyph digits need matplotlib and Pillow (pip install 'dsim[plot]'): {e}") from None
    ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    found = [ImageFont.truetype(str(ttf / name), CANVAS * 2 // 3) for name in FONTS if (ttf / name).is_file()]
    if not found:
        raise DatasetError(f"no font of {', '.join(FONTS[:3])}, ... in {ttf}")
    return found


def _blur_matrix(n: int, sigma: float) -> np.ndarray:
    """S (n x n) such that S @ f @ S.T is f blurred by a gaussian of sigma (reflected edges): two products."""
    radius = int(3 * sigma)
    k = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    k /= k.sum()
    s = np.zeros((n, n))
    for i in range(n):
        for t, w in zip(range(-radius, radius + 1), k):
            j = abs(i + t)
            s[i, (2 * (n - 1) - j) if j > n - 1 else j] += w
    return s


_BLUR = {}


def _smooth(field: np.ndarray, sigma: float) -> np.ndarray:
    """A gaussian blur of a square 2-D field."""
    key = (field.shape[0], sigma)
    if key not in _BLUR:
        _BLUR[key] = _blur_matrix(*key)
    s = _BLUR[key]
    return s @ field @ s.T


def _sample_at(img: np.ndarray, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """img read at real coordinates (bilinear, zero outside)."""
    h, w = img.shape
    y0, x0 = np.floor(y).astype(int), np.floor(x).astype(int)
    fy, fx = y - y0, x - x0
    out = np.zeros_like(y)
    for dy, wy in ((0, 1 - fy), (1, fy)):
        for dx, wx in ((0, 1 - fx), (1, fx)):
            yy, xx = y0 + dy, x0 + dx
            ok = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
            out += np.where(ok, img[np.clip(yy, 0, h - 1), np.clip(xx, 0, w - 1)], 0) * wy * wx
    return out


def _render(font, digit: int, rng: np.random.Generator) -> np.ndarray:
    """One distorted digit on the CANVAS x CANVAS canvas, float in [0, 255]."""
    from PIL import Image, ImageDraw, ImageFilter
    img = Image.new("L", (CANVAS, CANVAS), 0)
    ImageDraw.Draw(img).text((CANVAS / 2, CANVAS / 2), str(digit), fill=255, font=font, anchor="mm")
    if rng.integers(2):                               # strokes as drawn, or thicker
        img = img.filter(ImageFilter.MaxFilter(3))
    a = np.asarray(img, dtype=np.float64)
    # affine: rotation, shear, aspect; then the elastic field
    angle, shear = np.radians(rng.uniform(-15, 15)), rng.uniform(-0.3, 0.3)
    sy, sx = rng.uniform(0.85, 1.15, size=2)
    c, s = np.cos(angle), np.sin(angle)
    m = np.array([[c, -s], [s, c]]) @ np.array([[1, shear], [0, 1]]) @ np.diag([sy, sx])
    yy, xx = np.mgrid[0:CANVAS, 0:CANVAS].astype(np.float64) - CANVAS / 2
    inv = np.linalg.inv(m)
    y = inv[0, 0] * yy + inv[0, 1] * xx + CANVAS / 2
    x = inv[1, 0] * yy + inv[1, 1] * xx + CANVAS / 2
    alpha, sigma = rng.uniform(0.45, 0.9) * CANVAS, CANVAS / 12   # the elastic field's strength and smoothness
    y += alpha * _smooth(rng.uniform(-1, 1, (CANVAS, CANVAS)), sigma)
    x += alpha * _smooth(rng.uniform(-1, 1, (CANVAS, CANVAS)), sigma)
    return _sample_at(a, y, x)


def _mnist_layout(a: np.ndarray) -> np.ndarray:
    """MNIST's layout of a digit image: fitted into 20x20 (aspect kept, anti-aliased), centred by its centre of
    mass in 28x28, uint8."""
    from PIL import Image
    rows, cols = np.nonzero(a > 8)
    if rows.size == 0:
        return np.zeros((28, 28), np.uint8)
    crop = a[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    h, w = crop.shape
    scale = 20.0 / max(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    small = np.asarray(Image.fromarray(np.clip(crop, 0, 255).astype(np.uint8)).resize(size, Image.LANCZOS),
                       dtype=np.float64)
    out = np.zeros((28, 28))
    total = small.sum()
    cy = (small.sum(axis=1) @ np.arange(small.shape[0])) / total
    cx = (small.sum(axis=0) @ np.arange(small.shape[1])) / total
    top, left = int(round(14 - cy)), int(round(14 - cx))
    top, left = min(max(top, 0), 28 - small.shape[0]), min(max(left, 0), 28 - small.shape[1])
    out[top:top + small.shape[0], left:left + small.shape[1]] = small
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def make_digits(n: int, seed: int = 0) -> tuple:
    """(images (n, 28, 28) uint8, labels (n,) uint8): labels cycle 0..9 in a shuffled order from the seed."""
    if int(n) <= 0:
        raise DatasetError(f"glyph digits need n > 0, got {n}")
    fonts = _font_files()
    labels = np.random.default_rng([seed, _TAG]).permutation(np.arange(n) % 10).astype(np.uint8)
    images = np.empty((n, 28, 28), np.uint8)
    for i in range(n):
        rng = np.random.default_rng([seed, _TAG, i])
        images[i] = _mnist_layout(_render(fonts[rng.integers(len(fonts))], int(labels[i]), rng))
    return images, labels


def write_digits(directory, n: int, seed: int = 0, prefix: str = "train") -> Path:
    """Write n glyph digits as <prefix>-images-idx3-ubyte and <prefix>-labels-idx1-ubyte in directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    images, labels = make_digits(n, seed)
    write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
    write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels)
    return directory


def main(argv=None) -> int:
    """python -m dsim.data.glyphs DIR N [SEED]: write N digits into DIR as MNIST's train idx files."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3):
        print("usage: python -m dsim.data.glyphs DIR N [SEED]", file=sys.stderr)
        return 2
    try:
        path = write_digits(argv[0], int(argv[1]), int(argv[2]) if len(argv) == 3 else 0)
    except (DatasetError, ValueError, OSError) as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        return 2
    print(f"{argv[1]} glyph digits in {os.fspath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
