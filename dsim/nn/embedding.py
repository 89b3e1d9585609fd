"""Embedding tables: replicated (MindSpore's vocab_emb_dp=True) or vocabulary-parallel over mp.

Vocabulary-parallel (split="vocab"): rank m of the mp group holds rows [m*V/mp, (m+1)*V/mp) of the
table; the lookup takes the rows it holds, zeros for the others, and one all-reduce over mp sums the
pieces (Megatron's VocabParallelEmbedding). The gradient of the table needs no communication: the
output gradient is full on every mp rank, and each adds it into the rows it holds.
"""
from __future__ import annotations

import numpy as np

from ..parallel.groups import allreduce_sum
from ..parallel.layout import ParamSpec
from .layers import Layer


class Embedding(Layer):
    """MindSpore's VocabEmbedding: `embedding_table` (vocab_size, embedding_size), 'normal': Normal(0.01)."""

    def __init__(self, name: str, vocab_size: int, embedding_size: int, split=None, sigma=0.01):
        super().__init__()
        self.name, self.split = name, split
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.specs = [ParamSpec(f"{name}.embedding_table", (vocab_size, embedding_size),
                                0 if split == "vocab" else None)]
        self.inits = {self.specs[0].name: ("normal", sigma)}

    def forward(self, ids, mp_comm):
        p = self.params[0]
        table = p.data
        if self.split != "vocab":
            self._ids, self._mask = ids, None
            return table[ids]
        start = p.mp.offsets[0]
        local = ids - start
        mask = (local >= 0) & (local < table.shape[0])
        local = np.where(mask, local, 0)
        self._ids, self._mask = local, mask
        out = table[local] * mask[..., None].astype(table.dtype)
        return allreduce_sum(mp_comm, out, inplace=True)

    def backward(self, dy, mp_comm=None, need_dx=False):
        p = self.params[0]
        grad = p.grad_out()
        if grad is None:
            grad = np.zeros_like(p.data)
        else:
            grad[...] = 0
        ids = self._ids if self._mask is None else self._ids[self._mask]
        rows = dy.reshape(self._ids.shape + (-1,))
        rows = rows.reshape(-1, rows.shape[-1]) if self._mask is None else rows[self._mask]
        np.add.at(grad, ids.reshape(-1), rows)
        p.grad = grad
        return None

    def __repr__(self):
        return f"Embedding({self.name}, {self.vocab_size}x{self.embedding_size}, split={self.split})"
