"""The training state one rank holds, as named slices: what checkpoints save and tests compare."""
from __future__ import annotations


def owned_pieces(network, optimizer):
    """(name, global shape, owned Slice, array) for every parameter and optimizer-state slice on this rank."""
    params = {p.name: p for p in network.trainable_params()}
    for p in params.values():
        yield p.name, p.spec.shape, p.owned, p.owned_data
    for state_name, param_name, arr in optimizer.state_items():
        p = params[param_name]
        yield state_name, p.spec.shape, p.owned, arr
