"""The embeddings' sparse gradient against the dense one it replaced (np.add.at into a zeroed table), bit for bit.

The dense reference is main's backward before the change: the whole table zeroed, then np.add.at of dy's rows
at the ids (those in this rank's vocabulary range when the table is split). The sparse backward must give the
same bits at every step, with repeated ids, in a gradient bucket reused across steps (where it zeroes only the
rows it wrote when it is the bucket's sole writer), and when micro-batch sums or a data-parallel reduction
write the bucket between steps.
"""
import numpy as np
import pytest
from mpi4py import MPI

from dsim.nn import create_network
from dsim.nn.embedding import sums_per_id
from dsim.parallel.buckets import GradientBuckets
from dsim.parallel.layout import ParallelLayout

SELF = MPI.COMM_SELF
VOCAB, D = 64, 8
TINY = dict(vocab_size=VOCAB, d_model=D, num_heads=4, ffn_hidden_size=8, encoder_layers=1, decoder_layers=1,
            src_len=6, tgt_len=5)


def bits(a):
    return a.view(np.uint8)


def dense_gradient(table_shape, start, ids, dy, dtype):
    """main's backward before the change: zeros, then np.add.at of the rows of the ids this rank holds."""
    local = ids.reshape(-1) - start
    held = (local >= 0) & (local < table_shape[0])
    grad = np.zeros(table_shape, dtype)
    np.add.at(grad, local[held], dy.reshape(-1, dy.shape[-1])[held])
    return grad


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sums_per_id_added_to_zeros_are_add_at_bits(dtype):
    rng = np.random.default_rng(0)
    for trial in range(200):
        rows_in_table, n, d = int(rng.integers(1, 50)), int(rng.integers(0, 300)), int(rng.integers(1, 20))
        ids = rng.integers(0, rows_in_table, n)
        ids[: n // 3] = ids[0] if n else 0        # one id met many times, as the padding id is
        rows = (rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-4, 4, (n, 1))).astype(dtype)
        rows[rng.random((n, d)) < 0.1] = -0.0      # zero sums whose sign np.add.at settles
        expected = np.zeros((rows_in_table, d), dtype)
        np.add.at(expected, ids, rows)
        got = np.zeros_like(expected)
        distinct, sums = sums_per_id(ids, rows)
        got[distinct] += sums
        assert np.array_equal(distinct, np.unique(ids))
        assert np.array_equal(bits(got), bits(expected)), trial


def built(vocab_emb_dp, data_parallel, model_parallel, rank, dtype=np.float32):
    """The tiny transformer as `rank` of the layout builds it, its gradients bound to a bucket."""
    layout = ParallelLayout(data_parallel=data_parallel, model_parallel=model_parallel)
    net = create_network("transformer", transformer=TINY, vocab_emb_dp=vocab_emb_dp)
    net.build(layout, rank, seed=1, dtype=dtype)
    return net, GradientBuckets(net.trainable_params(), dtype)


def steps_of(rng, count, batch=7, length=6):
    """(ids, dy) of `count` steps; ids repeat within a step (a padding id, a frequent one) and across steps."""
    for _ in range(count):
        ids = rng.integers(0, VOCAB, (batch, length))
        ids[:, -2:] = 1                                # padding
        ids[0, :3] = 9                                 # a repeated word
        yield ids, rng.standard_normal((batch * length, D)).astype(np.float32)


@pytest.mark.parametrize("vocab_emb_dp", [True, False])
@pytest.mark.parametrize("writers", ["alone", "data parallel", "micro-batches"])
def test_bucketed_sparse_gradient_is_the_dense_one_at_every_step(vocab_emb_dp, writers):
    """Every step's gradient equals the dense reference bit for bit, in a bucket written between steps as a
    training step writes it: by nothing else (dp 1: the layer zeroes only its rows), by a data-parallel
    all-reduce (dp 2: rows this rank never wrote), or by the sum of micro-batches (a network cut into pipeline
    units: the rows an earlier micro-batch wrote)."""
    mp = 1 if vocab_emb_dp else 4
    rng = np.random.default_rng(7)
    for rank in range(mp):
        net, buckets = built(vocab_emb_dp, 2 if writers == "data parallel" else 1, mp, rank)  # dp index 0
        if writers == "micro-batches":
            net.pipeline_units()
        for layer in (net.src_word, net.src_position, net.tgt_word, net.tgt_position):
            assert layer.sole_writer == (writers == "alone")
        word = net.src_word
        p = word.params[0]
        assert p.data.shape[0] == VOCAB // mp
        earlier = np.zeros_like(p.data)
        for step, (ids, dy) in enumerate(steps_of(rng, 12)):
            word.forward(ids, SELF)
            word.backward(dy)
            expected = dense_gradient(p.data.shape, p.mp.offsets[0], ids, dy, np.float32)
            assert np.shares_memory(p.grad, buckets.flat)
            assert np.array_equal(bits(p.grad), bits(expected)), (rank, step)
            if writers == "data parallel":
                p.grad[rng.random(p.grad.shape[0]) < 0.5] += 1.0   # the other replica's rows, summed in
            elif writers == "micro-batches":
                p.grad += earlier                                   # the last micro-batch holds the sum
                earlier = expected


def test_a_sole_writer_zeroes_only_the_rows_it_wrote():
    """With dp 1 and no pipeline a backward zeroes the rows the last one wrote, nothing else (those are zero):
    a mark in another row survives, which shows the whole table was not touched."""
    net, _ = built(True, 1, 1, 0)
    word = net.tgt_word
    p = word.params[0]
    word.forward(np.array([[3, 3, 4]]), SELF)
    word.backward(np.ones((3, D), np.float32))   # the first backward into the bucket zeroes all of it
    p.grad[40] = 5.0                              # a row no backward wrote
    word.forward(np.array([[6, 4, 4]]), SELF)
    word.backward(np.ones((3, D), np.float32))
    assert np.all(p.grad[40] == 5.0) and np.all(p.grad[3] == 0.0)
    assert np.all(p.grad[4] == 2.0) and np.all(p.grad[6] == 1.0)


def test_unbound_gradient_is_a_new_dense_array_each_time():
    """Outside a bucket (a layer used alone) every backward gives its own array, as before."""
    net = create_network("transformer", transformer=TINY).build(ParallelLayout(), 0, seed=1, dtype=np.float64)
    word = net.src_word
    ids = np.array([[5, 5, 6]])
    word.forward(ids, SELF)
    word.backward(np.ones((3, D)))
    first = word.params[0].grad
    word.backward(2 * np.ones((3, D)))
    assert first is not word.params[0].grad
    assert np.all(first[5] == 2.0) and np.all(word.params[0].grad[5] == 4.0) and np.count_nonzero(first[7:]) == 0
