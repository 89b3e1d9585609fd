"""The model registry: `model.name` -> a network, and what its input data must be.

A new model is allowed everywhere (config checks, the CLI) by adding it here.
"""
from __future__ import annotations

from .lenet import LeNet5
from .network import ARCHITECTURES, Network
from .transformer import Transformer

MODELS = ("network", "uce_network", "lenet5", "transformer")


def create_network(name: str, hidden=None, transformer=None, vocab_emb_dp: bool = True):
    """A network by the seeds' name.

    network / uce_network: the MLPs (hidden overrides the widths); lenet5; transformer (transformer: a
    dict of its sizes, see TransformerConfig; vocab_emb_dp as MindSpore's TransformerOpParallelConfig).
    """
    if name in ARCHITECTURES:
        return Network(hidden if hidden is not None else ARCHITECTURES[name])
    if name == "lenet5":
        return LeNet5()
    if name == "transformer":
        return Transformer(**(transformer or {}), vocab_emb_dp=vocab_emb_dp)
    raise ValueError(f"unknown model.name {name!r}; choose from {', '.join(MODELS)}")
