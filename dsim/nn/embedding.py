"""Embedding tables: replicated (MindSpore's vocab_emb_dp=True) or vocabulary-parallel over mp.

Vocabulary-parallel (split="vocab"): rank m of the mp group holds rows [m*V/mp, (m+1)*V/mp) of the
table; the lookup takes the rows it holds, zeros for the others, and one all-reduce over mp sums the
pieces (Megatron's VocabParallelEmbedding). The gradient of the table needs no communication: the
output gradient is full on every mp rank, and each adds it into the rows it holds.

The gradient of a table is sparse: only the rows of the ids in the batch get any. backward sums the
output-gradient rows of each id (`sums_per_id`: the same bits as np.add.at into zeros, faster) and adds the
sums into the gradient's rows, all of which must be zero before. The gradient itself stays dense, a view into
the data-parallel bucket (the all-reduce and the optimizer read every row: Adam's moments and weight decay
change rows without gradient too), so zeroing it is what is left of the whole table. When nothing but this
layer's backward writes that view (`sole_writer`: no data-parallel reduction into it, no sum of micro-batches),
the rows its last backward wrote are the only ones to zero.
"""
from __future__ import annotations

import numpy as np

from ..parallel.groups import allreduce_sum
from ..parallel.layout import ParamSpec
from .layers import Layer


def sums_per_id(ids: np.ndarray, rows: np.ndarray):
    """(the distinct ids ascending, each one's rows summed in batch order): np.add.at(zeros, ids, rows) sparse.

    A stable sort puts each id's rows together in batch order; an id met once keeps its row, one met more
    often gets its rows added one after another (np.add.accumulate: np.add.at's order, where np.add.reduceat
    would sum pairwise), with the other ids met as often (the positions: all in one). Added into a zero row, a
    sum gives np.add.at's bits: (0 + r1) + r2 and 0 + (r1 + r2) differ at most in the sign of a zero partial
    sum, which the final 0 + s settles as np.add.at does."""
    if ids.size == 0:
        return ids, rows
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    counts = np.diff(starts, append=ids.size)
    sums = rows[order[starts]]
    for count in np.unique(counts[counts > 1]):  # the ids met `count` times, together: (ids, count, features)
        which = np.flatnonzero(counts == count)
        runs = order[starts[which, None] + np.arange(count)]
        sums[which] = np.add.accumulate(rows[runs], axis=1)[:, -1]
    return ordered[starts], sums


class Embedding(Layer):
    """MindSpore's VocabEmbedding: `embedding_table` (vocab_size, embedding_size), 'normal': Normal(0.01)."""

    def __init__(self, name: str, vocab_size: int, embedding_size: int, split=None, sigma=0.01):
        super().__init__()
        self.name, self.split = name, split
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.specs = [ParamSpec(f"{name}.embedding_table", (vocab_size, embedding_size),
                                0 if split == "vocab" else None)]
        self.inits = {self.specs[0].name: ("normal", sigma)}
        self.sole_writer = False  # set by the network: nothing but this backward writes the gradient view
        self._view = self._rows = None   # the view the last backward wrote, and the rows it wrote there

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
        """The table's gradient: dy's rows summed per id into rows zeroed first (see the module's doc)."""
        p = self.params[0]
        ids, rows = self._ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
        if self._mask is not None:
            mask = self._mask.reshape(-1)
            ids, rows = ids[mask], rows[mask]
        rows_of, sums = sums_per_id(ids, rows)
        grad = self._zeroed(p.grad_out(), rows_of)
        grad[rows_of] += sums
        p.grad = grad
        return None

    def _zeroed(self, view, rows_of):
        """The gradient to add `rows_of` into, every row zero: `view` (a bucket's) or, unbound, a new array.
        A sole writer zeroes only the rows its last backward wrote into this view, and records `rows_of` before
        writing them (an exception on the way leaves no row unrecorded)."""
        if view is None:
            return np.zeros_like(self.params[0].data)
        if self.sole_writer and view is self._view:
            view[self._rows] = 0
        else:
            view[...] = 0
        self._view, self._rows = view, rows_of
        return view

    def __repr__(self):
        return f"Embedding({self.name}, {self.vocab_size}x{self.embedding_size}, split={self.split})"
