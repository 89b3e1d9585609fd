"""The seeds' models start where MindSpore's start, and store every tensor in MindSpore's shape (issue 55).

The values each test checks against are MindSpore's documentation's (the r2.1 API pages for nn.Dense and
nn.Conv2d, mindspore.common.initializer, and the transformer sample's mindspore.nn.transformer layers):
- nn.Dense / nn.Conv2d, weight_init=None: HeUniform(negative_slope=sqrt(5)), U(-b, b) with
  b = sqrt(6 / ((1 + 5) * fan_in)) = 1 / sqrt(fan_in) (fan_in = in_channels x kh x kw for a convolution);
- nn.Dense, bias_init=None: Uniform(1 / sqrt(fan_in)), whatever weight_init is;
- Normal(sigma): N(0, sigma^2); the string 'normal' is Normal() = N(0, 0.01^2) (the sample's _Linear and
  VocabEmbedding, and r2.0's nn.Dense head); biases of _Linear 'zeros'; LayerNorm gamma ones, beta zeros.
"""
import numpy as np
import pytest

from dsim.nn import Conv2d, Dense, LeNet5, Normal, Sequential, Transformer
from dsim.parallel.layout import ParallelLayout

SEED = 7


def built(net):
    return {p.name: p.data for p in net.build(ParallelLayout(1, 1), 0, SEED, np.float64).params}


class One(Sequential):
    """A network of a single layer, to see that layer's initial tensors."""

    def __init__(self, layer):
        super().__init__()
        self.layers = [layer]


def assert_uniform(values, bound, what):
    """All within +-bound, reaching near it, spread as a uniform (std bound/sqrt(3)), centred."""
    v = values.ravel()
    n = v.size
    assert np.abs(v).max() <= bound, what
    assert np.abs(v).max() >= bound * (1 - 12.0 / n), f"{what}: max {np.abs(v).max()} for bound {bound}"
    std = bound / np.sqrt(3)
    assert abs(v.std() - std) <= 6 * std / np.sqrt(n) + 1e-12, f"{what}: std {v.std()} not {std}"
    assert abs(v.mean()) <= 6 * std / np.sqrt(n), what


def assert_normal(values, sigma, what):
    """N(0, sigma^2): std and mean within 6 standard errors, and tails a uniform would not have."""
    v = values.ravel()
    n = v.size
    assert abs(v.std() - sigma) <= 6 * sigma / np.sqrt(2 * n), f"{what}: std {v.std()} not {sigma}"
    assert abs(v.mean()) <= 6 * sigma / np.sqrt(n), what
    if n >= 1000:
        assert np.abs(v).max() > 2.5 * sigma, f"{what}: no tail"


@pytest.mark.parametrize("cin,cout,k", [(1, 6, 5), (6, 16, 5), (3, 64, 3)])
def test_conv2d_default_is_he_uniform_over_the_fan_in(cin, cout, k):
    w = built(One(Conv2d("c", cin, cout, k)))["c.weight"]
    assert w.shape == (cout, cin, k, k)   # MindSpore's (out, in, kh, kw); no bias (has_bias=False)
    assert_uniform(w, 1 / np.sqrt(cin * k * k), "conv weight")


@pytest.mark.parametrize("fan_in,out", [(400, 120), (120, 84), (84, 10), (512, 512)])
def test_dense_defaults_are_he_uniform_and_a_uniform_bias(fan_in, out):
    p = built(One(Dense("d", fan_in, out)))
    assert p["d.weight"].shape == (out, fan_in) and p["d.bias"].shape == (out,)
    assert_uniform(p["d.weight"], 1 / np.sqrt(fan_in), "dense weight")
    assert_uniform(p["d.bias"], 1 / np.sqrt(fan_in), "dense bias")


def test_a_dense_weight_init_leaves_the_bias_default():
    """nn.Dense(400, 120, weight_init=Normal(0.02)): the weight N(0, 0.02^2), the bias still Uniform(1/sqrt(400))."""
    p = built(One(Dense("d", 400, 120, weight_init=Normal(0.02))))
    assert_normal(p["d.weight"], 0.02, "dense weight")
    assert_uniform(p["d.bias"], 1 / np.sqrt(400), "dense bias")


def test_lenet5_starts_as_the_pages_mindspore_version():
    """The page sets Normal(0.02) on fc1..fc3's weights only; the rest are MindSpore r2.1's defaults."""
    p = built(LeNet5())
    assert sorted(p) == ["conv1.weight", "conv2.weight", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight",
                         "fc3.bias", "fc3.weight"]
    assert_uniform(p["conv1.weight"], 1 / 5, "conv1")                    # fan_in 1 x 5 x 5
    assert_uniform(p["conv2.weight"], 1 / np.sqrt(150), "conv2")         # fan_in 6 x 5 x 5
    for name, fan_in in (("fc1", 400), ("fc2", 120), ("fc3", 84)):
        assert_normal(p[f"{name}.weight"], 0.02, name)
        assert_uniform(p[f"{name}.bias"], 1 / np.sqrt(fan_in), f"{name}.bias")


SMALL = dict(vocab_size=64, d_model=32, num_heads=4, ffn_hidden_size=48, encoder_layers=1, decoder_layers=1,
             src_len=6, tgt_len=6)


def mindspore_shapes(vocab, d, ffn, length):
    """The sample's parameters (mindspore.nn.transformer, model.py's Net) and their shapes, below `base1.`."""
    attention = {"dense1.weight": (d, d), "dense1.bias": (d,), "dense2.weight": (d, d), "dense2.bias": (d,),
                 "dense3.weight": (d, d), "dense3.bias": (d,),
                 "projection.weight": (d, d), "projection.bias": (d,)}   # projection: _Linear(transpose_b=False)
    norm = {"gamma": (d,), "beta": (d,)}
    output = {"mapping.weight": (d, ffn), "mapping.bias": (ffn,),     # FeedForward: both transpose_b=False,
              "projection.weight": (ffn, d), "projection.bias": (d,)}  # weights (in, out)
    shapes = {f"{side}_embedding.{kind}_embedding.embedding_table": (n, d)
              for side in ("src", "tgt") for kind, n in (("word", vocab), ("position", length))}
    blocks = {"encoder": ("layernorm1", "attention", "layernorm2", "output"),
              "decoder": ("layernorm1", "attention", "cross_attention_layernorm", "cross_attention", "layernorm2",
                          "output")}
    for stack, cells in blocks.items():
        for cell in cells:
            table = norm if "layernorm" in cell else output if cell == "output" else attention
            shapes.update({f"{stack}.blocks.0.{cell}.{k}": v for k, v in table.items()})
    shapes["head.weight"] = (vocab, d)   # nn.Dense(hidden, vocab, has_bias=False): (out, in)
    return shapes


def test_transformer_tensors_have_mindspores_shapes():
    p = built(Transformer(**SMALL))
    want = mindspore_shapes(64, 32, 48, 6)
    assert {n: a.shape for n, a in p.items()} == want


def test_transformer_starts_as_mindspores():
    """Every weight and embedding table N(0, 0.01^2) (MindSpore's 'normal'), biases and beta zeros, gamma ones."""
    p = built(Transformer(**{**SMALL, "d_model": 64, "ffn_hidden_size": 64}))
    for name, value in p.items():
        if name.endswith((".weight", ".embedding_table")):
            assert_normal(value, 0.01, name)
        elif name.endswith((".bias", ".beta")):
            assert not value.any(), name
        else:
            assert name.endswith(".gamma") and (value == 1).all(), name


def _downgrade(path, version):
    """Make a file as an older dsim wrote it: its format_version, and a metadata table that matches."""
    import json

    import h5py
    from dsim.checkpoint.format import META_ATTR, meta_table
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = version
        f.attrs[META_ATTR] = json.dumps(meta_table(f), sort_keys=True)


@pytest.mark.parametrize("name", ["encoder.blocks.0.output.mapping.weight", "decoder.blocks.1.output.projection.weight",
                                  "decoder.blocks.0.cross_attention.projection.weight"])
def test_an_older_checkpoint_with_a_relaid_tensor_is_refused_in_one_line(tmp_path, name):
    """Format 2 stored these (out, in): with d_model = ffn they have the same shape, so loading would silently
    transpose them. read_file (every load, recovery and restore) refuses the file in one line."""
    from dsim.checkpoint.errors import CheckpointError
    from dsim.checkpoint.format import VERSION, Tensor, read_file, write_file
    from dsim.parallel.layout import Slice
    w = np.arange(16.0).reshape(4, 4)
    path = tmp_path / "t-1_1.h5"
    write_file(path, {"epoch": 1}, [Tensor("params", name, (4, 4), Slice((0, 0), (4, 4)), w)], {})
    assert read_file(path).meta["format_version"] == VERSION == 3
    _downgrade(path, 2)
    with pytest.raises(CheckpointError) as e:
        read_file(path)
    assert str(e.value) == (f"{path} is a checkpoint of an older dsim (format 2): its {name} is stored (out, in), "
                            "dsim now stores it (in, out) as MindSpore does; resume it with the dsim that wrote it, "
                            "or train from the start")


def test_an_older_checkpoint_without_one_still_loads(tmp_path):
    """The MLPs' and LeNet5's tensors kept their layout: their format 2 (and 1) files load as before."""
    from dsim.checkpoint.format import Tensor, read_file, write_file
    from dsim.parallel.layout import Slice
    path = tmp_path / "t-1_1.h5"
    ts = [Tensor("params", n, (2, 3), Slice((0, 0), (2, 3)), np.ones((2, 3))) for n in ("fc1.weight", "layer2.weight")]
    write_file(path, {"epoch": 1}, ts, {})
    _downgrade(path, 2)
    assert sorted(read_file(path).tensors) == ["fc1.weight", "layer2.weight"]
