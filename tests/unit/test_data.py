"""Tests of dsim.data: synthetic and idx MNIST datasets, the distributed sampler, the factory."""
from __future__ import annotations

import gzip
import math
import os

import numpy as np
import pytest

from conftest import assert_one_line_error

from dsim.data import (DistributedSampler, MnistDataset, SyntheticMNIST, create_dataset,
                       write_idx)
from dsim.data.transforms import interpolation_matrix, resize_bilinear

LOW, HIGH = (0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081  # normalized black and white


# ---- SyntheticMNIST ----

def test_synthetic_shapes_dtypes_and_range():
    ds = SyntheticMNIST(num_samples=500, seed=0)
    assert len(ds) == 500
    x, y = ds.get(np.arange(500))
    assert x.shape == (500, 1, 28, 28) and x.dtype == np.float32
    assert y.shape == (500,) and y.dtype == np.int64
    assert LOW - 1e-5 <= x.min() and x.max() <= HIGH + 1e-5
    # clipping to [0, 1] happens, so both ends of the normalized range are reached
    assert np.isclose(x.min(), LOW, atol=1e-5) and np.isclose(x.max(), HIGH, atol=1e-5)
    assert set(y.tolist()) == set(range(10))
    x64, _ = SyntheticMNIST(num_samples=10, seed=0, dtype=np.float64).get([0, 1])
    assert x64.dtype == np.float64
    np.testing.assert_allclose(x64, x[:2], atol=1e-5)


def test_synthetic_is_deterministic_per_seed():
    a = SyntheticMNIST(num_samples=100, seed=3).get(np.arange(20))
    b = SyntheticMNIST(num_samples=100, seed=3).get(np.arange(20))
    c = SyntheticMNIST(num_samples=100, seed=4).get(np.arange(20))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[1], c[1])


def test_synthetic_sample_depends_only_on_seed_and_index():
    ds = SyntheticMNIST(num_samples=100, seed=1)
    x5, y5 = ds.get([5])
    x, y = ds.get([3, 5, 7])
    np.testing.assert_array_equal(x5[0], x[1])
    assert y5[0] == y[1]
    # the dataset size does not change a sample either
    xb, yb = SyntheticMNIST(num_samples=60000, seed=1).get([7])
    np.testing.assert_array_equal(xb[0], x[2])
    assert yb[0] == y[2]
    # repeated and unordered indices are fine
    xr, _ = ds.get([7, 3, 7])
    np.testing.assert_array_equal(xr[0], xr[2])
    np.testing.assert_array_equal(xr[1], x[0])


def test_synthetic_bad_input():
    assert_one_line_error(lambda: SyntheticMNIST(num_samples=10).get([10]), "10")
    assert_one_line_error(lambda: SyntheticMNIST(num_samples=10).get([-1]), "-1")
    assert_one_line_error(lambda: SyntheticMNIST(num_samples=0), "0")


def _softmax_loss(logits, y):
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return float(-np.log(p[np.arange(len(y)), y]).mean()), p


def test_synthetic_is_learnable_but_not_trivial():
    ds = SyntheticMNIST(num_samples=60000, seed=0)
    x_eval, y_eval = ds.get(np.arange(59000, 60000))
    x_eval = x_eval.reshape(len(x_eval), -1)
    w, b = np.zeros((784, 10), np.float32), np.zeros(10, np.float32)
    initial, _ = _softmax_loss(x_eval @ w + b, y_eval)
    assert initial == pytest.approx(math.log(10), rel=1e-5)

    sampler = DistributedSampler(59000, 32, seed=0)
    for _, step, idx in sampler.iterate(end_epoch=1):
        if step == 100:
            break
        x, y = ds.get(idx)
        x = x.reshape(len(x), -1)
        _, p = _softmax_loss(x @ w + b, y)
        p[np.arange(len(y)), y] -= 1  # d(loss)/d(logits), times the batch size
        w -= 0.05 * x.T @ p / len(y)
        b -= 0.05 * p.sum(axis=0) / len(y)
    final, p = _softmax_loss(x_eval @ w + b, y_eval)
    accuracy = float((p.argmax(axis=1) == y_eval).mean())
    assert final < 0.7 * initial, (initial, final)
    # learnt well above chance, but a linear model is not perfect: the classes overlap
    assert 0.5 < accuracy < 0.99, accuracy


# ---- DistributedSampler ----

@pytest.mark.parametrize("replicas,batch", [(1, 32), (2, 32), (4, 32), (8, 64), (3, 12), (5, 5)])
def test_sampler_replicas_partition_the_global_batch(replicas, batch):
    n = 1000
    samplers = [DistributedSampler(n, batch, replicas, r, seed=7) for r in range(replicas)]
    single = DistributedSampler(n, batch, seed=7)
    assert all(s.steps_per_epoch == n // batch for s in samplers)
    for epoch in (0, 2):
        seen = []
        for step in range(n // batch):
            parts = [s.batch_indices(epoch, step) for s in samplers]
            assert all(len(p) == batch // replicas for p in parts)
            glob = np.concatenate(parts)
            np.testing.assert_array_equal(glob, samplers[0].global_batch(epoch, step))
            np.testing.assert_array_equal(glob, single.batch_indices(epoch, step))
            seen.append(glob)
        seen = np.concatenate(seen)
        # an epoch visits distinct samples and drops only the remainder
        assert len(np.unique(seen)) == len(seen) == (n // batch) * batch
        assert seen.min() >= 0 and seen.max() < n


def test_sampler_resume_yields_the_tail_of_a_full_iteration():
    s = DistributedSampler(100, 8, num_replicas=2, rank=1, seed=3)
    full = list(s.iterate(end_epoch=3))
    assert len(full) == 3 * s.steps_per_epoch
    assert [(e, st) for e, st, _ in full[:2]] == [(0, 0), (0, 1)]
    resumed = list(DistributedSampler(100, 8, num_replicas=2, rank=1, seed=3)
                   .iterate(start_epoch=1, start_step=3, end_epoch=3))
    tail = full[s.steps_per_epoch + 3:]
    assert len(resumed) == len(tail)
    for (e1, s1, i1), (e2, s2, i2) in zip(resumed, tail):
        assert (e1, s1) == (e2, s2)
        np.testing.assert_array_equal(i1, i2)
    assert resumed[0][:2] == (1, 3) and resumed[-1][:2] == (2, s.steps_per_epoch - 1)


def test_sampler_iterate_without_end_keeps_going():
    it = DistributedSampler(10, 5).iterate(start_epoch=4, start_step=1)
    assert [next(it)[:2] for _ in range(4)] == [(4, 1), (5, 0), (5, 1), (6, 0)]


def test_sampler_shuffle():
    s = DistributedSampler(200, 10, seed=0)
    e0, e1 = s.global_batch(0, 0), s.global_batch(1, 0)
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(np.sort(s.permutation(0)), s.permutation(0))
    np.testing.assert_array_equal(np.sort(s.permutation(1)), np.arange(200))
    np.testing.assert_array_equal(e0, DistributedSampler(200, 10, seed=0).global_batch(0, 0))
    assert not np.array_equal(e0, DistributedSampler(200, 10, seed=1).global_batch(0, 0))
    ordered = DistributedSampler(200, 10, num_replicas=2, rank=1, shuffle=False)
    np.testing.assert_array_equal(ordered.batch_indices(3, 2), np.arange(25, 30))


def test_sampler_bad_sizes():
    uneven = [DistributedSampler(100, 10, num_replicas=4, rank=r, shuffle=False) for r in range(4)]  # 3/3/2/2
    assert [list(s.batch_indices(0, 1)) for s in uneven] == [[10, 11, 12], [13, 14, 15], [16, 17], [18, 19]]
    assert_one_line_error(lambda: DistributedSampler(100, 2, num_replicas=4), "2", "4")
    assert_one_line_error(lambda: DistributedSampler(100, 0), "0")
    assert_one_line_error(lambda: DistributedSampler(10, 32), "10", "32")
    assert_one_line_error(lambda: DistributedSampler(100, 8, num_replicas=2, rank=2), "2")
    assert_one_line_error(lambda: DistributedSampler(100, 8, num_replicas=0), "0")
    s = DistributedSampler(100, 8)
    assert_one_line_error(lambda: s.iterate(start_step=12), "12")
    assert_one_line_error(lambda: s.batch_indices(0, 12), "12")


# ---- MnistDataset and write_idx ----

def _write_mnist(directory, n_images=50, n_labels=None, prefix="train", gz=False, rows=28, cols=28,
                 seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n_images, rows, cols), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n_images if n_labels is None else n_labels).astype(np.uint8)
    os.makedirs(directory, exist_ok=True)
    ext = ".gz" if gz else ""
    write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte{ext}"), images)
    write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte{ext}"), labels)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_round_trip(tmp_path, gz):
    images, labels = _write_mnist(tmp_path, gz=gz)
    ds = MnistDataset(tmp_path)
    assert len(ds) == 50
    x, y = ds.get(np.arange(50))
    assert x.shape == (50, 1, 28, 28) and x.dtype == np.float32
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, labels)
    expected = (images[:, None].astype(np.float64) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x, expected, atol=1e-5)
    x1, y1 = ds.get([7])
    np.testing.assert_array_equal(x1[0], x[7])
    assert y1[0] == labels[7]


def test_mnist_file_format_matches_the_idx_layout(tmp_path):
    path = tmp_path / "labels"
    write_idx(path, np.array([3, 1, 4], dtype=np.uint8))
    assert path.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 3, 1, 4])
    write_idx(tmp_path / "labels.gz", [3, 1, 4])  # plain int lists are accepted
    assert gzip.decompress((tmp_path / "labels.gz").read_bytes()) == path.read_bytes()


def test_mnist_t10k_fallback_and_other_image_sizes(tmp_path):
    images, labels = _write_mnist(tmp_path, n_images=6, prefix="t10k", rows=7, cols=9)
    ds = MnistDataset(tmp_path, dtype=np.float64)
    x, y = ds.get([0, 5])
    assert x.shape == (2, 1, 7, 9) and x.dtype == np.float64
    np.testing.assert_array_equal(y, labels[[0, 5]])
    # train files win over t10k ones
    _write_mnist(tmp_path, n_images=4, prefix="train")
    assert len(MnistDataset(tmp_path)) == 4


def test_mnist_missing_paths(tmp_path):
    missing = tmp_path / "MNIST_Data" / "train"
    assert_one_line_error(lambda: MnistDataset(missing), "dataset path not found", str(missing))
    (tmp_path / "afile").write_bytes(b"")
    assert_one_line_error(lambda: MnistDataset(tmp_path / "afile"), str(tmp_path / "afile"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(lambda: MnistDataset(empty), str(empty), "train-images-idx3-ubyte")
    _write_mnist(tmp_path / "nolabels")
    os.remove(tmp_path / "nolabels" / "train-labels-idx1-ubyte")
    assert_one_line_error(lambda: MnistDataset(tmp_path / "nolabels"), "train-labels-idx1-ubyte")


def test_mnist_bad_contents(tmp_path):
    # labels written where the images should be: wrong magic
    _write_mnist(tmp_path / "magic")
    images_file = tmp_path / "magic" / "train-images-idx3-ubyte"
    write_idx(images_file, np.zeros(50, dtype=np.uint8))
    assert_one_line_error(lambda: MnistDataset(tmp_path / "magic"), str(images_file), "2051", "2049")

    _write_mnist(tmp_path / "short")
    images_file = tmp_path / "short" / "train-images-idx3-ubyte"
    images_file.write_bytes(images_file.read_bytes()[:-100])
    assert_one_line_error(lambda: MnistDataset(tmp_path / "short"), str(images_file), "39216")
    images_file.write_bytes(b"\x00\x00\x08")
    assert_one_line_error(lambda: MnistDataset(tmp_path / "short"), str(images_file))
    images_file.write_bytes(b"\x00\x00\x08\x03\x00\x00")
    assert_one_line_error(lambda: MnistDataset(tmp_path / "short"), str(images_file))

    _write_mnist(tmp_path / "counts", n_images=50, n_labels=49)
    assert_one_line_error(lambda: MnistDataset(tmp_path / "counts"), "50", "49")

    _write_mnist(tmp_path / "gz", gz=True)
    labels_file = tmp_path / "gz" / "train-labels-idx1-ubyte.gz"
    labels_file.write_bytes(labels_file.read_bytes()[:-6])
    assert_one_line_error(lambda: MnistDataset(tmp_path / "gz"), str(labels_file))

    assert_one_line_error(lambda: MnistDataset(tmp_path / "counts").get([50]), "50")


def test_write_idx_rejects_bad_arrays(tmp_path):
    assert_one_line_error(lambda: write_idx(tmp_path / "x", np.zeros((2, 3))), "2-D")
    assert_one_line_error(lambda: write_idx(tmp_path / "x", np.array([256])), "uint8")
    assert_one_line_error(lambda: write_idx(tmp_path / "x", np.array([0.5])), "uint8")


# ---- create_dataset ----

def test_create_dataset(tmp_path):
    ds = create_dataset("synthetic", num_samples=30, seed=2)
    assert isinstance(ds, SyntheticMNIST) and len(ds) == 30 and ds.seed == 2
    _write_mnist(tmp_path, n_images=5)
    mn = create_dataset("mnist", path=tmp_path, dtype=np.float64)
    assert isinstance(mn, MnistDataset) and len(mn) == 5 and mn.get([0])[0].dtype == np.float64
    assert_one_line_error(lambda: create_dataset("mnist"), "path")
    assert_one_line_error(lambda: create_dataset("cifar"), "cifar")


# ---- resize (LeNet5's 32x32 input) ----

def test_interpolation_matrix_rows_sum_to_one_and_same_size_is_identity():
    for n_in, n_out in [(28, 32), (32, 28), (5, 5), (1, 4), (7, 3)]:
        r = interpolation_matrix(n_in, n_out)
        assert r.shape == (n_out, n_in)
        np.testing.assert_allclose(r.sum(axis=1), 1.0)
    np.testing.assert_array_equal(interpolation_matrix(6, 6), np.eye(6))


def test_resize_same_size_and_constant_images():
    x = np.random.default_rng(0).random((3, 1, 28, 28)).astype(np.float32)
    np.testing.assert_array_equal(resize_bilinear(x, 28, 28), x)
    const = np.full((2, 28, 28), 0.37, dtype=np.float64)
    for h, w in [(32, 32), (10, 40), (1, 1)]:
        np.testing.assert_allclose(resize_bilinear(const, h, w), 0.37, rtol=1e-12)


def test_resize_linear_ramp_matches_half_pixel_formula():
    ramp = np.tile(np.arange(28, dtype=np.float64), (28, 1))  # value = column
    for out in (32, 10, 57):
        expected = np.clip((np.arange(out) + 0.5) * 28 / out - 0.5, 0, 27)
        got = resize_bilinear(ramp, 28, out)
        assert got.shape == (28, out)
        np.testing.assert_allclose(got, np.tile(expected, (28, 1)), atol=1e-12)
        got_t = resize_bilinear(ramp.T, out, 28)  # value = row, resized along rows
        np.testing.assert_allclose(got_t, np.tile(expected, (28, 1)).T, atol=1e-12)


def test_resize_2x2_to_4x4_by_hand():
    # sample coordinates (o + 0.5) / 2 - 0.5 = -0.25, 0.25, 0.75, 1.25, clamped to [0, 1]
    x = np.array([[0.0, 4.0], [8.0, 12.0]])
    expected = np.array([[0, 1, 3, 4],
                         [2, 3, 5, 6],
                         [6, 7, 9, 10],
                         [8, 9, 11, 12]], dtype=np.float64)
    np.testing.assert_allclose(resize_bilinear(x, 4, 4), expected, atol=1e-12)


def test_resize_bad_input():
    assert_one_line_error(lambda: resize_bilinear(np.zeros(5), 4, 4), "(5,)")
    assert_one_line_error(lambda: resize_bilinear(np.zeros((2, 2)), 0, 4), "0x4")
    assert_one_line_error(lambda: SyntheticMNIST(10, image_size=0), "image_size", "0")
    assert_one_line_error(lambda: SyntheticMNIST(10, image_size=2.5), "image_size", "2.5")


def test_synthetic_image_size_32():
    ds = SyntheticMNIST(num_samples=100, seed=1, image_size=32)
    assert ds.image_shape == (1, 32, 32)
    x, y = ds.get([3, 5, 7])
    assert x.shape == (3, 1, 32, 32) and x.dtype == np.float32
    x5, y5 = SyntheticMNIST(num_samples=100, seed=1, image_size=32).get([5])
    np.testing.assert_array_equal(x5[0], x[1])
    # same labels and the same pixels as the native images, resized and left in [0, 1] (the page's transforms)
    native, y28 = SyntheticMNIST(num_samples=100, seed=1).get([3, 5, 7])
    np.testing.assert_array_equal(y, y28)
    native01 = native.astype(np.float64) * 0.3081 + 0.1307
    np.testing.assert_allclose(x, resize_bilinear(native01, 32, 32), atol=1e-5)
    assert 0 <= x.min() and x.max() <= 1
    x64, _ = SyntheticMNIST(num_samples=100, seed=1, image_size=32, dtype=np.float64).get([3, 5, 7])
    assert x64.dtype == np.float64
    np.testing.assert_allclose(x64, x, atol=1e-5)


def test_mnist_image_size_32(tmp_path):
    images, labels = _write_mnist(tmp_path, n_images=8)
    ds = MnistDataset(tmp_path, image_size=32)
    assert ds.image_shape == (1, 32, 32)
    x, y = ds.get(np.arange(8))
    assert x.shape == (8, 1, 32, 32) and x.dtype == np.float32
    np.testing.assert_array_equal(y, labels)
    np.testing.assert_allclose(x, resize_bilinear(images[:, None] / 255.0, 32, 32), atol=1e-6)
    np.testing.assert_array_equal(MnistDataset(tmp_path, image_size=32).get([6])[0][0], x[6])
    # image_size=None keeps the native images
    assert MnistDataset(tmp_path).get([0])[0].shape == (1, 1, 28, 28)


def test_create_dataset_image_size(tmp_path):
    assert create_dataset("synthetic", num_samples=4, image_size=32).get([0])[0].shape == (1, 1, 32, 32)
    _write_mnist(tmp_path, n_images=3)
    assert create_dataset("mnist", tmp_path, image_size=32).get([0])[0].shape == (1, 1, 32, 32)
