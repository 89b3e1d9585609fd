"""The training step's hot path: gradients in one flat buffer, in-place updates, nothing parameter-sized allocated.

Serial tests (one process); the bucketed all-reduce over real ranks is in test_buckets_mpi.py.
"""
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from dsim.build import build_run
from dsim.optim import LRSchedule, create_optimizer
from dsim.optim.optimizers import CHUNK
from dsim.parallel.buckets import GradientBuckets


def one_process_run(tmp_path, **overrides):
    cfg = small_config(**{"parallel.data_parallel": 1, "parallel.model_parallel": 1, "output.dir": str(tmp_path),
                          "checkpoint.enabled": False, **overrides})
    return build_run(cfg, MPI.COMM_SELF)


def batch(run, n=32):
    images, labels = run.loader.source.get(np.arange(n))
    return images, labels


def test_every_gradient_is_a_view_of_the_flat_buffer_after_a_step(tmp_path):
    run = one_process_run(tmp_path)
    run.model.train_step(*batch(run))
    flat = run.model.buckets.flat
    offset = 0
    for p in run.network.trainable_params():
        assert np.shares_memory(p.grad, flat), p.name
        assert p.grad.shape == p.data.shape
        assert np.array_equal(p.grad.reshape(-1), flat[offset:offset + p.grad.size]), p.name
        offset += p.grad.size
    assert offset == flat.size - 1  # the last slot is the loss
    first = run.model.buckets
    run.model.train_step(*batch(run))
    assert run.model.buckets is first  # reused, not rebuilt


@pytest.mark.parametrize("optimizer", ["momentum", "adam", "sgd"])
def test_a_step_allocates_nothing_parameter_sized(tmp_path, optimizer):
    run = one_process_run(tmp_path, **{"model.hidden": [64, 1024, 1024, 64], "optimizer.name": optimizer,
                                       "dtype": "float32"})
    images, labels = batch(run)
    for _ in range(2):  # buffers are made at the first steps
        run.model.train_step(images, labels)
    largest = max(p.data.nbytes for p in run.network.trainable_params())
    tracemalloc.start()
    try:
        run.model.train_step(images, labels)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert largest == 1024 * 1024 * 4
    assert peak < largest / 4, f"a step allocated {peak} bytes at its peak; the largest parameter has {largest}"


class _P:
    """A parameter owning all of its data (as in one process)."""

    def __init__(self, name, w, g):
        self.name, self.data, self.grad, self.opt_sharded = name, w, g, False
        self.owned = type("S", (), {"extents": w.shape})()
        self.owned_index = (slice(None),)

    @property
    def owned_data(self):
        return self.data


def reference_update(name, kind, w, g, state, lr, step, wd, h):
    """The whole-array formulas the block-wise updates must reproduce bit for bit."""
    dt = w.dtype.type
    if wd and kind != "adamweightdecay":
        g = g + dt(wd) * w
    if kind == "sgd":
        w -= dt(lr) * g
    elif kind == "momentum":
        v = state["moments"]
        v *= dt(h["momentum"])
        v += g
        w -= dt(lr) * v
    else:
        m, v = state["moment1"], state["moment2"]
        m *= dt(h["beta1"])
        m += dt(1 - h["beta1"]) * g
        v *= dt(h["beta2"])
        v += dt(1 - h["beta2"]) * g * g
        if kind == "adam":
            lr_t = lr * (1 - h["beta2"] ** step) ** 0.5 / (1 - h["beta1"] ** step)
            w -= dt(lr_t) * m / (np.sqrt(v) + dt(h["eps"]))
        else:
            update = m / (np.sqrt(v) + dt(h["eps"]))
            if wd and "bias" not in name:
                update += dt(wd) * w
            w -= dt(lr) * update


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "adamweightdecay"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blockwise_updates_are_bit_identical_to_whole_array_formulas(kind, wd, dtype):
    rng = np.random.default_rng(7)
    shapes = {"a.weight": (3, CHUNK // 2 + 5), "a.bias": (17,), "b.weight": (2 * CHUNK + 3,)}  # across block edges
    params = [_P(n, rng.standard_normal(s).astype(dtype), None) for n, s in shapes.items()]
    ref = {p.name: p.data.copy() for p in params}
    h = {"momentum": 0.9, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6}
    kwargs = {"momentum": {"momentum": 0.9}, "adam": {"eps": 1e-6}, "adamweightdecay": {"eps": 1e-6}}.get(kind, {})
    opt = create_optimizer(kind, params, LRSchedule(0.01), weight_decay=wd, **kwargs)
    ref_state = {p.name: {s: np.zeros_like(p.data) for s in opt.slots} for p in params}
    for step in range(1, 4):
        for p in params:
            p.grad = rng.standard_normal(p.data.shape).astype(dtype)
            reference_update(p.name, kind, ref[p.name], p.grad, ref_state[p.name], 0.01, step, wd, h)
        opt.apply()
        for p in params:
            assert np.array_equal(p.data, ref[p.name]), (p.name, step)
            for s in opt.slots:
                assert np.array_equal(opt.state[s][p.name], ref_state[p.name][s]), (s, p.name, step)


def test_a_bound_gradient_takes_copies_and_layers_write_in_place():
    from dsim.nn import create_network
    from dsim.parallel.layout import ParallelLayout
    net = create_network("network", [8, 16, 16, 8]).build(ParallelLayout(), 0, seed=1, dtype=np.float64)
    buckets = GradientBuckets(net.trainable_params(), np.float64)
    p = net.trainable_params()[1]
    view = p.grad
    p.grad = np.full(p.data.shape, 3.0)
    assert p.grad is view and np.all(view == 3.0)
    before = [q.grad for q in net.trainable_params()]
    rng = np.random.default_rng(0)
    logits = net.forward(rng.standard_normal((4, 784)), MPI.COMM_SELF)
    net.backward(np.ones_like(logits), MPI.COMM_SELF)
    for q, view in zip(net.trainable_params(), before):
        assert q.grad is view and np.shares_memory(q.grad, buckets.flat)
    assert np.count_nonzero(buckets.flat[:-1]) > buckets.flat.size // 2


def test_the_first_step_applies_its_own_gradients(tmp_path):
    """Step 1 of a fresh run and a step after a resume both use the gradients they compute (SGD: w - lr g)."""
    run = one_process_run(tmp_path, **{"optimizer.name": "sgd"})
    images, labels = batch(run)
    net = run.network
    before = {p.name: p.data.copy() for p in net.trainable_params()}
    logits = net.forward(images, MPI.COMM_SELF)   # the gradients computed apart from the Model
    _, dlogits = net.loss(logits, labels, len(labels), MPI.COMM_SELF)
    net.backward(dlogits, MPI.COMM_SELF)
    grads = {p.name: p.grad.copy() for p in net.trainable_params()}
    run.model.train_step(images, labels)
    lr = run.cfg.optimizer.learning_rate
    for p in net.trainable_params():
        assert np.array_equal(p.data, before[p.name] - lr * grads[p.name]), p.name
