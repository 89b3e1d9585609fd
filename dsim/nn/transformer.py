"""The distributed page's encoder-decoder Transformer (the sample `distributed_training_transformer`).

Source and target each have a word embedding and a learned position embedding; `encoder_layers`
encoder blocks (self-attention, feed-forward) and `decoder_layers` decoder blocks (causal
self-attention, cross-attention to the encoder output, feed-forward), pre-LayerNorm with residuals as
MindSpore's nn.transformer; a Linear head without bias to the vocabulary; cross-entropy over the target
tokens that are not padding (the sample's loss with its input mask).

Slicing over the model-parallel group (Megatron-LM): attention heads split (Q, K, V column, projection
row), feed-forward mapping column then projection row, LayerNorm and the biases after row layers
replicated, the head replicated (as the sample shards it), word embeddings replicated
(`vocab_emb_dp: true`) or split along the vocabulary (false); position embeddings are always replicated.
Pipeline stages are not modelled yet: the blocks are kept as separate objects so they can be cut.

Parameters as the sample's MindSpore ones (mindspore.nn.transformer, the page's r2.0): the same names below
the sample's `base1.` and the same shapes: Q, K, V (`dense1..3`) and the head store (out, in); the attention's
output projection and the feed-forward mapping and projection store (in, out), as MindSpore's `_Linear(...,
transpose_b=False)`. Initial values as MindSpore's: every weight 'normal', MindSpore's Normal() = N(0, 0.01^2)
(the `_Linear`s, the head's nn.Dense of r2.0 and VocabEmbedding's tables), biases zeros, LayerNorm gamma ones
and beta zeros.
"""
from __future__ import annotations

import numpy as np

from ..data.translation import PAD
from ..parallel.groups import allreduce_sum
from ..parallel.layout import LayoutError
from .attention import MASKED, MultiHeadAttention
from .cell import Cell, Unit, spread
from .embedding import Embedding
from .layers import GELU, Dense, masked_cross_entropy
from .norm import LayerNorm

NORMAL = ("normal", 0.01)   # MindSpore's 'normal': Normal(sigma=0.01)
ZEROS = ("zeros",)


class FeedForward:
    """mapping (d -> ffn, column split), GELU, projection (ffn -> d, row split): one all-reduce each way.

    Both weights stored (in, out), as MindSpore's FeedForward (transpose_b=False): mapping (d, ffn), projection
    (ffn, d)."""

    def __init__(self, name, d_model, ffn):
        self.mapping = Dense(f"{name}.mapping", d_model, ffn, "column", weight_init=NORMAL, bias_init=ZEROS,
                             transpose_b=False)
        self.act = GELU()
        self.projection = Dense(f"{name}.projection", ffn, d_model, "row", weight_init=NORMAL, bias_init=ZEROS,
                                transpose_b=False)
        self.layers = [self.mapping, self.projection]

    def forward(self, x, mp):
        return self.projection.forward(self.act.forward(self.mapping.forward(x, mp)), mp)

    def backward(self, dy, mp):
        return self.mapping.backward(self.act.backward(self.projection.backward(dy, mp)), mp)


class EncoderLayer:
    """x + attention(layernorm1(x)), then + output(layernorm2(.))."""

    def __init__(self, name, d_model, heads, ffn):
        self.layernorm1 = LayerNorm(f"{name}.layernorm1", d_model)
        self.attention = MultiHeadAttention(f"{name}.attention", d_model, heads, NORMAL)
        self.layernorm2 = LayerNorm(f"{name}.layernorm2", d_model)
        self.output = FeedForward(f"{name}.output", d_model, ffn)
        self.layers = [self.layernorm1, self.attention, self.layernorm2, *self.output.layers]

    def forward(self, x, mask, batch, mp):
        y = self.layernorm1.forward(x)
        h = x + self.attention.forward(y, y, mask, batch, mp)
        return h + self.output.forward(self.layernorm2.forward(h), mp)

    def backward(self, dout, mp):
        dh = dout + self.layernorm2.backward(self.output.backward(dout, mp))
        dy, _ = self.attention.backward(dh, mp)
        return dh + self.layernorm1.backward(dy)


class DecoderLayer:
    """Causal self-attention, cross-attention to the encoder output, feed-forward; each pre-norm with a residual."""

    def __init__(self, name, d_model, heads, ffn):
        self.layernorm1 = LayerNorm(f"{name}.layernorm1", d_model)
        self.attention = MultiHeadAttention(f"{name}.attention", d_model, heads, NORMAL)
        self.cross_attention_layernorm = LayerNorm(f"{name}.cross_attention_layernorm", d_model)
        self.cross_attention = MultiHeadAttention(f"{name}.cross_attention", d_model, heads, NORMAL)
        self.layernorm2 = LayerNorm(f"{name}.layernorm2", d_model)
        self.output = FeedForward(f"{name}.output", d_model, ffn)
        self.layers = [self.layernorm1, self.attention, self.cross_attention_layernorm, self.cross_attention,
                       self.layernorm2, *self.output.layers]

    def forward(self, x, memory, self_mask, memory_mask, batch, mp):
        y = self.layernorm1.forward(x)
        h1 = x + self.attention.forward(y, y, self_mask, batch, mp)
        h2 = h1 + self.cross_attention.forward(self.cross_attention_layernorm.forward(h1), memory, memory_mask,
                                               batch, mp)
        return h2 + self.output.forward(self.layernorm2.forward(h2), mp)

    def backward(self, dout, mp):
        """(dx, dmemory), both full on every mp rank."""
        dh2 = dout + self.layernorm2.backward(self.output.backward(dout, mp))
        dq, dmemory = self.cross_attention.backward(dh2, mp)
        dh1 = dh2 + self.cross_attention_layernorm.backward(dq)
        dy, _ = self.attention.backward(dh1, mp)
        return dh1 + self.layernorm1.backward(dy), dmemory


class Transformer(Cell):
    """Net of the sample: inputs (source ids, target ids), both (batch, len) int64 padded with PAD."""

    input_kind = "tokens"

    def __init__(self, vocab_size=20000, d_model=128, num_heads=8, ffn_hidden_size=None, encoder_layers=1,
                 decoder_layers=1, src_len=10, tgt_len=10, max_position=None, vocab_emb_dp=True):
        super().__init__()
        ffn = ffn_hidden_size or d_model
        self.vocab_size, self.d_model, self.num_heads, self.ffn = vocab_size, d_model, num_heads, ffn
        self.src_len, self.tgt_len = src_len, tgt_len
        self.max_position = max_position or max(src_len, tgt_len)
        for side, length in (("source", src_len), ("target", tgt_len)):
            if length > self.max_position:
                raise LayoutError(f"transformer: the {side} length {length} is longer than the position table "
                                  f"(max_position={self.max_position})")
        if d_model % num_heads:
            raise LayoutError(f"transformer: d_model={d_model} is not divisible by num_heads={num_heads}")
        split = None if vocab_emb_dp else "vocab"
        self.vocab_emb_dp = vocab_emb_dp
        sigma = NORMAL[1]
        self.src_word = Embedding("src_embedding.word_embedding", vocab_size, d_model, split, sigma)
        self.src_position = Embedding("src_embedding.position_embedding", self.max_position, d_model, sigma=sigma)
        self.tgt_word = Embedding("tgt_embedding.word_embedding", vocab_size, d_model, split, sigma)
        self.tgt_position = Embedding("tgt_embedding.position_embedding", self.max_position, d_model, sigma=sigma)
        self.encoder = [EncoderLayer(f"encoder.blocks.{i}", d_model, num_heads, ffn) for i in range(encoder_layers)]
        self.decoder = [DecoderLayer(f"decoder.blocks.{i}", d_model, num_heads, ffn) for i in range(decoder_layers)]
        self.head = Dense("head", d_model, vocab_size, None, has_bias=False, weight_init=NORMAL)  # (vocab, d)
        self.layers = [self.src_word, self.src_position, self.tgt_word, self.tgt_position,
                       *[layer for block in self.encoder + self.decoder for layer in block.layers], self.head]

    def check(self, layout):
        mp = layout.model_parallel
        for what, size in (("num_heads", self.num_heads), ("ffn_hidden_size", self.ffn)) + (
                () if self.vocab_emb_dp else (("vocab_size (vocab_emb_dp: false)", self.vocab_size),)):
            if size % mp:
                raise LayoutError(f"transformer: {what}={size} is not divisible by model_parallel={mp}")
        super().check(layout)

    def build(self, layout, rank, seed, dtype, initialize=True):
        """Cell.build; an embedding is its gradient's sole writer (it zeroes only the rows it wrote:
        Embedding.sole_writer) without data parallel, whose all-reduce writes every row, and without pipeline
        units, whose micro-batches are summed in the gradient (see pipeline_units)."""
        super().build(layout, rank, seed, dtype, initialize)
        self._sole_writers(layout.data_parallel == 1 and getattr(self, "_units", None) is None)
        return self

    def _sole_writers(self, alone: bool) -> None:
        for embedding in (self.src_word, self.src_position, self.tgt_word, self.tgt_position):
            embedding.sole_writer = alone

    def _embed(self, word, position, ids, mp):
        batch, length = ids.shape
        positions = np.broadcast_to(np.arange(length), ids.shape)
        x = word.forward(ids, mp) + position.forward(positions, mp)
        return x.reshape(batch * length, -1)

    def masks(self, inputs):
        """(source key mask (b, 1, 1, S), decoder self-attention mask (b, 1, T, T)), additive, from the ids."""
        src, tgt = inputs
        dtype = self.dtype
        src_keys = np.where(src != PAD, 0.0, MASKED).astype(dtype)[:, None, None, :]     # (b, 1, 1, S)
        tgt_keys = np.where(tgt != PAD, 0.0, MASKED).astype(dtype)[:, None, None, :]
        causal = np.where(np.tri(tgt.shape[1], dtype=bool), 0.0, MASKED).astype(dtype)   # (T, T)
        return src_keys, np.minimum(causal, tgt_keys)

    def forward(self, inputs, mp_comm, halfway=None):
        src, tgt = inputs
        batch = src.shape[0]
        src_keys, self_mask = self.masks(inputs)
        self._token_mask = (tgt != PAD).reshape(-1)
        memory = self._embed(self.src_word, self.src_position, src, mp_comm)
        for block in self.encoder:
            memory = block.forward(memory, src_keys, batch, mp_comm)
        if halfway is not None:
            halfway()
        y = self._embed(self.tgt_word, self.tgt_position, tgt, mp_comm)
        for block in self.decoder:
            y = block.forward(y, memory, self_mask, src_keys, batch, mp_comm)
        return self.head.forward(y, mp_comm)  # (batch * tgt_len, vocab)

    def loss(self, logits, labels, global_batch_size, dp_comm):
        """Mean cross-entropy over the global batch's non-padding target tokens (one small all-reduce over dp)."""
        mask = self._token_mask
        count = allreduce_sum(dp_comm, np.array([mask.sum()], dtype=np.float64))[0]
        return masked_cross_entropy(logits, labels.reshape(-1), mask, max(count, 1.0), out=logits)  # logits: the head's own

    # -- pipeline parallel ---------------------------------------------------------------------------
    def pipeline_units(self) -> list:
        """The embeddings, each encoder block, each decoder block, the head."""
        if getattr(self, "_units", None) is None:
            self._sole_writers(False)  # the pipeline sums the micro-batches' gradients in the bucket
            self._units = [_Embeddings(self), *[_EncoderBlock(self, b) for b in self.encoder],
                           *[_DecoderBlock(self, b) for b in self.decoder], _Head(self.head)]
        return self._units

    def unit_stages(self, stages: int) -> list:
        """Embeddings on the first stage, the head on the last, the blocks spread evenly (as the sample)."""
        blocks = spread(len(self.encoder) + len(self.decoder), stages, "encoder and decoder blocks of the transformer")
        return [0, *blocks, stages - 1]

    def loss_denominator(self, inputs, labels, global_batch_size, dp_comm):
        """The global batch's non-padding target tokens (one small all-reduce over dp)."""
        count = allreduce_sum(dp_comm, np.array([(inputs[1] != PAD).sum()], dtype=np.float64))[0]
        return max(count, 1.0)

    def micro_loss(self, logits, inputs, labels, denominator):
        return masked_cross_entropy(logits, labels.reshape(-1), (inputs[1] != PAD).reshape(-1), denominator, out=logits)

    def backward(self, dlogits, mp_comm):
        dy = self.head.backward(dlogits, mp_comm)
        dmemory = None
        for block in reversed(self.decoder):
            dy, dm = block.backward(dy, mp_comm)
            dmemory = dm if dmemory is None else dmemory + dm
        self.tgt_word.backward(dy)
        self.tgt_position.backward(dy)
        for block in reversed(self.encoder):
            dmemory = block.backward(dmemory, mp_comm)
        self.src_word.backward(dmemory)
        self.src_position.backward(dmemory)

    def describe(self) -> str:
        return (f"encoder {len(self.encoder)} x decoder {len(self.decoder)}, d_model {self.d_model}, "
                f"{self.num_heads} heads, ffn {self.ffn}, vocab {self.vocab_size}, "
                f"vocab_emb_dp={self.vocab_emb_dp}")


class _Embeddings(Unit):
    """Source and target embeddings: the ids to (memory, y)."""

    def __init__(self, net):
        super().__init__([net.src_word, net.src_position, net.tgt_word, net.tgt_position])
        self._embed = net._embed

    def forward(self, carry, inputs, mp):
        src_word, src_position, tgt_word, tgt_position = self.layers
        return (self._embed(src_word, src_position, inputs[0], mp), self._embed(tgt_word, tgt_position, inputs[1], mp))

    def backward(self, dcarry, mp, need_dx=False):
        dmemory, dy = dcarry
        src_word, src_position, tgt_word, tgt_position = self.layers
        tgt_word.backward(dy)
        tgt_position.backward(dy)
        src_word.backward(dmemory)
        src_position.backward(dmemory)
        return None


class _EncoderBlock(Unit):
    """An encoder block on the memory; the decoder stream passes through."""

    def __init__(self, net, block):
        super().__init__([block])
        self.block, self._masks = block, net.masks

    def forward(self, carry, inputs, mp):
        memory, y = carry
        src_keys, _ = self._masks(inputs)
        return self.block.forward(memory, src_keys, inputs[0].shape[0], mp), y

    def backward(self, dcarry, mp, need_dx=True):
        dmemory, dy = dcarry
        return self.block.backward(dmemory, mp), dy


class _DecoderBlock(Unit):
    """A decoder block on the decoder stream, attending to the memory (whose gradient it adds to)."""

    def __init__(self, net, block):
        super().__init__([block])
        self.block, self._masks = block, net.masks

    def forward(self, carry, inputs, mp):
        memory, y = carry
        src_keys, self_mask = self._masks(inputs)
        return memory, self.block.forward(y, memory, self_mask, src_keys, inputs[0].shape[0], mp)

    def backward(self, dcarry, mp, need_dx=True):
        dmemory, dy = dcarry
        dy, dm = self.block.backward(dy, mp)
        return (dm if dmemory is None else dmemory + dm), dy


class _Head(Unit):
    """The vocabulary head on the decoder stream: (memory, y) to logits."""

    def __init__(self, head):
        super().__init__([head])

    def forward(self, carry, inputs, mp):
        return self.layers[0].forward(carry[1], mp)

    def backward(self, dlogits, mp, need_dx=True):
        return None, self.layers[0].backward(dlogits, mp)
