"""Every layer's hand-written backward against finite differences (float64, one process), and layer shapes."""
import numpy as np
import pytest
from mpi4py import MPI

from dsim.nn import GELU, Conv2d, LayerNorm, MaxPool2d, ReLU, create_network
from dsim.parallel.layout import LayoutError, ParallelLayout

SELF = MPI.COMM_SELF
TINY_TRANSFORMER = dict(vocab_size=40, d_model=16, num_heads=4, ffn_hidden_size=24, encoder_layers=2,
                        decoder_layers=2, src_len=6, tgt_len=5)


def lenet_batch(rng):
    return rng.normal(size=(3, 1, 32, 32)), rng.integers(0, 10, 3)


def translation_batch(rng):
    src, tgt = rng.integers(3, 40, (3, 6)), rng.integers(3, 40, (3, 5))
    src[0, 4:], tgt[1, 3:], tgt[2, 4:] = 1, 1, 1  # padding, masked in attention and in the loss
    return (src, tgt), rng.integers(0, 40, (3, 5))


def check_gradients(net, inputs, labels, per_param=6, seed=0):
    """Central differences at a few entries of every parameter against the backward pass."""
    def loss():
        return net.loss(net.forward(inputs, SELF), labels, len(labels), SELF)[0]
    _, dout = net.loss(net.forward(inputs, SELF), labels, len(labels), SELF)
    net.backward(dout, SELF)
    rng = np.random.default_rng(seed)
    for p in net.trainable_params():
        analytic = p.grad.copy()
        for _ in range(per_param):
            i = tuple(int(rng.integers(n)) for n in p.data.shape)
            old = p.data[i]
            p.data[i] = old + 1e-6
            up = loss()
            p.data[i] = old - 1e-6
            down = loss()
            p.data[i] = old
            numeric = (up - down) / 2e-6
            assert np.isclose(analytic[i], numeric, rtol=1e-5, atol=1e-8), (p.name, i, analytic[i], numeric)


def test_lenet5_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    net = create_network("lenet5").build(ParallelLayout(), 0, seed=2, dtype=np.float64)
    check_gradients(net, *lenet_batch(rng))


@pytest.mark.parametrize("vocab_emb_dp", [True, False])
def test_transformer_backward_matches_finite_differences(vocab_emb_dp):
    rng = np.random.default_rng(2)
    net = create_network("transformer", transformer=TINY_TRANSFORMER, vocab_emb_dp=vocab_emb_dp)
    net.build(ParallelLayout(), 0, seed=3, dtype=np.float64)
    (src, tgt), labels = translation_batch(rng)
    check_gradients(net, (src, tgt), labels)
    # embedding rows of tokens in the batch get gradient, others none
    table = net.src_word.params[0].grad
    unused = sorted(set(range(40)) - set(src.ravel().tolist()))
    assert np.all(table[unused] == 0) and np.any(table[src[0, 0]] != 0)


def test_transformer_loss_ignores_padding():
    rng = np.random.default_rng(3)
    net = create_network("transformer", transformer=TINY_TRANSFORMER).build(ParallelLayout(), 0, 1, np.float64)
    (src, tgt), labels = translation_batch(rng)
    loss = net.loss(net.forward((src, tgt), SELF), labels, 3, SELF)[0]
    other = labels.copy()
    other[tgt == 1] = 7  # labels under padding do not matter
    assert net.loss(net.forward((src, tgt), SELF), other, 3, SELF)[0] == loss
    # padding in the source is not attended to: changing a padded source token changes nothing
    src2 = src.copy()
    logits = net.forward((src, tgt), SELF)
    net.src_word.params[0].data[1] += 5.0  # the PAD row
    assert np.allclose(net.forward((src2, tgt), SELF)[:5], logits[:5])  # sample 0 has source padding


def test_decoder_is_causal():
    rng = np.random.default_rng(4)
    net = create_network("transformer", transformer=TINY_TRANSFORMER).build(ParallelLayout(), 0, 1, np.float64)
    (src, tgt), _ = translation_batch(rng)
    tgt[0] = [5, 6, 7, 8, 9]
    a = net.forward((src, tgt), SELF)[:5]
    tgt[0, 3] = 11
    b = net.forward((src, tgt), SELF)[:5]
    assert np.array_equal(a[:3], b[:3]) and not np.allclose(a[3:], b[3:])


def test_single_layers():
    rng = np.random.default_rng(5)
    conv = Conv2d("c", 2, 3, 3).build if False else Conv2d("c", 2, 3, 3)
    from dsim.nn.parameter import Parameter
    spec = conv.specs[0]
    w = rng.normal(size=spec.shape)
    conv.params = [Parameter(spec, ParallelLayout(), 0, w)]
    x = rng.normal(size=(2, 2, 6, 7))
    y = conv.forward(x, SELF)
    direct = np.zeros((2, 3, 4, 5))
    for i in range(4):
        for j in range(5):
            direct[:, :, i, j] = np.einsum("ncij,ocij->no", x[:, :, i:i + 3, j:j + 3], w)
    assert np.allclose(y, direct)
    pool = MaxPool2d(2)
    x = rng.normal(size=(2, 3, 4, 6))
    assert np.array_equal(pool.forward(x), x.reshape(2, 3, 2, 2, 3, 2).max(axis=(3, 5)))
    dx = pool.backward(np.ones((2, 3, 2, 3)))
    assert dx.sum() == 2 * 3 * 2 * 3 and set(np.unique(dx)) == {0.0, 1.0}
    g = GELU()
    assert np.isclose(g.forward(np.array([1.0]))[0], 0.841192, atol=1e-6)
    ln = LayerNorm("ln", 4)
    ln.params = [Parameter(s, ParallelLayout(), 0, np.ones(4) if s.name.endswith("gamma") else np.zeros(4))
                 for s in ln.specs]
    out = ln.forward(rng.normal(size=(3, 4)))
    assert np.allclose(out.mean(-1), 0) and np.allclose(out.std(-1), 1, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_is_np_where_bit_for_bit(dtype):
    # the bitwise and of dsim.nn.layers.kept: 0.0 for a -0.0 or a NaN as np.where(x > 0, x, 0), on a strided input
    x = np.random.default_rng(3).normal(size=(4, 5, 6, 3)).astype(dtype).transpose(0, 3, 1, 2)
    x[0, 0, 0, :5] = [-0.0, np.nan, 0.0, -np.inf, np.inf]
    dy = np.random.default_rng(4).normal(size=x.shape).astype(dtype)
    dy[0, 0, 0, 0] = np.nan
    relu = ReLU()
    y = relu.forward(x, SELF)
    assert y.dtype == dtype and y.tobytes() == np.where(x > 0, x, 0).tobytes()
    assert relu.backward(dy, SELF).tobytes() == np.where(x > 0, dy, 0).tobytes()


@pytest.mark.parametrize("k, shape", [(2, (3, 2, 6, 8)), (2, (2, 3, 7, 9)), (3, (2, 2, 9, 10))])
def test_max_pooling_takes_the_first_maximum_of_each_window_bit_for_bit(k, shape):
    # ties everywhere (rounded values, zeros of both signs, as after a ReLU): the value and the gradient are
    # those of the first maximum in row-major order, as a loop over windows with an argmax gives them
    rng = np.random.default_rng(k)
    x = np.round(rng.normal(size=shape)).astype(np.float32) * (rng.random(shape) > 0.4)
    x[rng.random(shape) > 0.7] = -0.0
    dy = rng.normal(size=(shape[0], shape[1], shape[2] // k, shape[3] // k)).astype(np.float32)
    dy[0, 0, 0, 0] = -0.0
    want_y, want_dx = np.zeros(dy.shape, np.float32), np.zeros(shape, np.float32)
    for idx in np.ndindex(dy.shape):
        n, c, i, j = idx
        window = x[n, c, i * k:(i + 1) * k, j * k:(j + 1) * k]
        a, b = divmod(int(np.argmax(window)), k)
        want_y[idx] = window[a, b]
        want_dx[n, c, i * k + a, j * k + b] = dy[idx]
    pool = MaxPool2d(k)
    assert pool.forward(x).tobytes() == want_y.tobytes()
    assert pool.backward(dy).tobytes() == want_dx.tobytes()


@pytest.mark.parametrize("model, options, mp, message", [
    ("lenet5", {}, 3, "conv2's 16 output channels are not divisible by model_parallel=3"),
    ("transformer", dict(num_heads=6, d_model=24), 4, "num_heads=6 is not divisible by model_parallel=4"),
    ("transformer", dict(ffn_hidden_size=30), 4, "ffn_hidden_size=30 is not divisible by model_parallel=4"),
    ("transformer", dict(vocab_size=1001, vocab_emb_dp=False), 2, "vocab_size (vocab_emb_dp: false)=1001"),
])
def test_layouts_a_model_cannot_take_are_named(model, options, mp, message):
    options = dict(options)
    emb = options.pop("vocab_emb_dp", True)
    net = create_network(model, transformer=options or None, vocab_emb_dp=emb)
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        net.build(ParallelLayout(1, mp), 0, 1, np.float64)


def test_sequence_longer_than_the_position_table():
    with pytest.raises(LayoutError, match="the source length 12 is longer than the position table"):
        create_network("transformer", transformer=dict(src_len=12, max_position=10))


@pytest.mark.parametrize("init", [("he_uniform", 512), ("bias_uniform", 7), ("normal", 0.02), ("zeros",), ("ones",)])
@pytest.mark.parametrize("shape,axis,parts", [((37, 11), 1, 1), ((37, 11), 0, 1), ((40, 12), 1, 4), ((40, 12), 0, 4),
                                              ((24, 3, 5), 0, 2), ((24, 3, 5), 2, 5), ((300,), 0, 3)])
def test_a_slice_is_drawn_without_the_whole_tensor_the_same_bits(monkeypatch, init, shape, axis, parts):
    """initial_slice, drawing rows a few at a time, gives each model-parallel slice exactly the bits that
    slicing the whole tensor gives (float64 and float32), whatever the piece size."""
    from dsim.nn import parameter
    from dsim.parallel.layout import ParamSpec, mp_slice
    spec = ParamSpec("layer.weight", shape, mp_axis=axis if parts > 1 else None)
    whole = parameter.initial_value(spec, 3, init)
    layout = ParallelLayout(data_parallel=1, model_parallel=parts)
    for elems in (1, 7, 64, 1 << 20):   # pieces of one row, a few rows, the whole tensor at once
        monkeypatch.setattr(parameter, "DRAW_ELEMS", elems)
        for rank in range(parts):
            where = mp_slice(spec, layout, rank)
            for dtype in (np.float64, np.float32):
                out = np.full(where.extents, np.nan, dtype)
                parameter.initial_slice(spec, 3, init, where, out)
                assert out.tobytes() == whole[where.index].astype(dtype).tobytes(), (elems, rank, dtype)
