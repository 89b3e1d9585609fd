"""Hand-written backward against finite differences, optimizers against textbook formulas (one process)."""
import numpy as np
from mpi4py import MPI

from dsim.nn import create_network, masked_cross_entropy, softmax_cross_entropy
from dsim.optim import LRSchedule, create_optimizer
from dsim.parallel.layout import ParallelLayout


def loss_of(net, x, y):
    logits = net.forward(x, MPI.COMM_SELF)
    return softmax_cross_entropy(logits, y, len(y))


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    net = create_network("network", [6, 8, 8, 6])
    net.layers[0] = type(net.layers[0])("layer1", 12, 6, "column", "matmul")
    net.build(ParallelLayout(), 0, seed=3, dtype=np.float64)
    x, y = rng.normal(size=(5, 12)), rng.integers(0, 10, 5)
    _, dlogits = loss_of(net, x, y)
    net.backward(dlogits, MPI.COMM_SELF)
    for p in net.trainable_params():
        analytic = p.grad.copy()
        numeric = np.zeros_like(p.data)
        for i in np.ndindex(p.data.shape):
            old = p.data[i]
            p.data[i] = old + 1e-6
            up = loss_of(net, x, y)[0]
            p.data[i] = old - 1e-6
            down = loss_of(net, x, y)[0]
            p.data[i] = old
            numeric[i] = (up - down) / 2e-6
        assert np.allclose(analytic, numeric, rtol=1e-5, atol=1e-8), p.name


def test_loss_is_cross_entropy_of_softmax():
    logits = np.array([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])
    loss, grad = softmax_cross_entropy(logits, np.array([2, 0]), 2)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert np.isclose(loss, -(np.log(p[0, 2]) + np.log(p[1, 0])) / 2)
    assert np.allclose(grad.sum(1), 0)


def test_cross_entropy_into_the_logits_themselves_gives_the_same_bits():
    """out=logits (the Transformer's head output, of no further use) writes the gradient over the logits:
    every bit as a new array, and the masked loss counts only the unmasked rows."""
    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((64, 500))).astype(np.float32)
    labels, mask = rng.integers(0, 500, 64), rng.random(64) > 0.25
    for fn, args in ((softmax_cross_entropy, (labels, 64)), (masked_cross_entropy, (labels, mask, 50.0))):
        loss, grad = fn(logits, *args)
        mine = logits.copy()
        loss_in, grad_in = fn(mine, *args, out=mine)
        assert grad_in is mine and loss_in == loss and np.array_equal(grad_in, grad)
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    loss, grad = masked_cross_entropy(logits, labels, mask, 50.0)
    assert np.isclose(loss, -np.log(p[np.arange(64), labels])[mask].sum() / 50.0, rtol=1e-5)
    assert not grad[~mask].any() and np.allclose(grad[mask].sum(1), 0, atol=1e-6)


class _P:
    """A stand-in parameter owning all of its data."""
    def __init__(self, w, g):
        self.name, self.data, self.grad, self.opt_sharded = "w", w, g, False
        self.owned = type("S", (), {"extents": w.shape})()
        self.owned_index = (slice(None),)

    @property
    def owned_data(self):
        return self.data


def test_adam_and_momentum_follow_their_formulas():
    g = np.array([0.5, -1.0, 2.0])
    for name, expect in [
        ("momentum", lambda w: w - 0.1 * (0.9 * g + g)),  # second step: v = 0.9 g + g
        ("adam", None),
    ]:
        w0 = np.array([1.0, 2.0, 3.0])
        p = _P(w0.copy(), g)
        opt = create_optimizer(name, [p], LRSchedule(0.1), **({"momentum": 0.9} if name == "momentum" else {}))
        opt.step(None)
        w1 = p.data.copy()
        opt.step(None)
        if name == "momentum":
            assert np.allclose(w1, w0 - 0.1 * g) and np.allclose(p.data, expect(w1))
        else:
            m, v = 0.1 * g, 0.001 * g * g
            assert np.allclose(w1, w0 - 0.1 * np.sqrt(1 - 0.999) / (1 - 0.9) * m / (np.sqrt(v) + 1e-8))
            assert opt.global_step == 2


def test_schedules():
    assert LRSchedule(0.1)(500) == 0.1
    cos = LRSchedule(0.1, "cosine", warmup_steps=10, decay_steps=100)
    assert np.isclose(cos(0), 0.01) and np.isclose(cos(9), 0.1) and np.isclose(cos(110), 0.0)
    assert np.isclose(LRSchedule(1.0, "exponential", decay_steps=10, decay_rate=0.5)(20), 0.25)
