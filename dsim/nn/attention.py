"""Multi-head attention with heads split over the model-parallel group (Megatron-LM).

Q, K and V (`dense1`, `dense2`, `dense3`, weights (out, in)) are column-split: each mp rank computes
num_heads / mp heads; the output `projection` (weight (in, out), MindSpore's transpose_b=False) is row-split,
so one all-reduce over mp gives the full output, then the replicated bias is added. Backward sums the partial
input gradients of Q, K and V before one all-reduce (two for cross-attention: the query side and the memory
side). Masks are additive (0 or -10000 as in MindSpore) with shape (batch, 1, q_len, k_len), shared by every
head.
"""
from __future__ import annotations

import numpy as np

from ..parallel.groups import allreduce_sum
from ..parallel.layout import LayoutError
from .layers import Dense, Layer

MASKED = -10000.0


class MultiHeadAttention(Layer):
    """Self- or cross-attention over (batch*len, d_model) activations."""

    def __init__(self, name: str, d_model: int, num_heads: int, weight_init=("normal", 0.01), bias_init=("zeros",)):
        super().__init__()
        if d_model % num_heads:
            raise LayoutError(f"{name}: d_model={d_model} is not divisible by num_heads={num_heads}")
        self.name, self.d_model, self.num_heads = name, d_model, num_heads
        self.head_dim = d_model // num_heads
        dense = lambda sub, split, transpose_b=True: Dense(  # noqa: E731
            f"{name}.{sub}", d_model, d_model, split, weight_init=weight_init, reduce_dx=False, bias_init=bias_init,
            transpose_b=transpose_b)
        self.q, self.k, self.v = dense("dense1", "column"), dense("dense2", "column"), dense("dense3", "column")
        self.out = dense("projection", "row", transpose_b=False)
        self.parts = [self.q, self.k, self.v, self.out]
        self.specs = [s for d in self.parts for s in d.specs]
        self.inits = {k: v for d in self.parts for k, v in d.inits.items()}

    def check(self, mp: int) -> None:
        if self.num_heads % mp:
            raise LayoutError(f"{self.name}: num_heads={self.num_heads} is not divisible by model_parallel={mp}")

    def bind(self):
        """Hand the bound parameters to the four Dense parts (Cell.build binds them to this layer)."""
        i = 0
        for d in self.parts:
            d.params = self.params[i:i + len(d.specs)]
            i += len(d.specs)

    def _heads(self, x, batch):
        """(batch*len, local heads*head_dim) -> (batch, local heads, len, head_dim)."""
        return x.reshape(batch, -1, x.shape[-1] // self.head_dim, self.head_dim).transpose(0, 2, 1, 3)

    def forward(self, x, memory, mask, batch, mp_comm):
        """x: queries (batch*q_len, d); memory: keys/values (batch*k_len, d), or x itself; mask additive."""
        self.bind()
        self._self = memory is x
        q = self._heads(self.q.forward(x, mp_comm), batch)
        k = self._heads(self.k.forward(memory, mp_comm), batch)
        v = self._heads(self.v.forward(memory, mp_comm), batch)
        dt = x.dtype.type
        scores = (q @ k.transpose(0, 1, 3, 2)) * dt(1.0 / np.sqrt(self.head_dim)) + mask.astype(x.dtype)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = probs @ v  # (batch, heads, q_len, head_dim)
        self._q, self._k, self._v, self._probs, self._batch = q, k, v, probs, batch
        flat = ctx.transpose(0, 2, 1, 3).reshape(x.shape[0], -1)
        return self.out.forward(flat, mp_comm)

    def backward(self, dy, mp_comm):
        """Parameter gradients; returns (dx, dmemory), each all-reduced over mp (dmemory None for self-attention)."""
        batch, q, k, v, probs = self._batch, self._q, self._k, self._v, self._probs
        dt = dy.dtype.type
        dctx = self._heads(self.out.backward(dy, mp_comm), batch)
        dprobs = dctx @ v.transpose(0, 1, 3, 2)
        dv = probs.transpose(0, 1, 3, 2) @ dctx
        dscores = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True)) * dt(1.0 / np.sqrt(self.head_dim))
        dq = dscores @ k
        dk = dscores.transpose(0, 1, 3, 2) @ q
        flat = lambda t: t.transpose(0, 2, 1, 3).reshape(-1, t.shape[1] * t.shape[3])  # noqa: E731
        dx = self.q.backward(flat(dq), mp_comm)
        dmem = self.k.backward(flat(dk), mp_comm) + self.v.backward(flat(dv), mp_comm)
        # The key bias adds q.b to every score of a query: softmax ignores it, its gradient is exactly zero.
        # Computed, it is rounding noise, which Adam would normalise into steps: keep it exact.
        self.k.params[1].grad[...] = 0
        if self._self:
            return allreduce_sum(mp_comm, dx + dmem, inplace=True), None
        return allreduce_sum(mp_comm, dx, inplace=True), allreduce_sum(mp_comm, dmem, inplace=True)

    def __repr__(self):
        return f"MultiHeadAttention({self.name}, d_model={self.d_model}, heads={self.num_heads})"
