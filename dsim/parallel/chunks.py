"""How a group cuts a flat buffer into one contiguous chunk per rank, and how a rank sums its chunk.

Every path that sums over a group (groups.sum_chunks through MPI, shared.SharedGroup through shared memory)
sums with sum_in_order, so each element gets the same operations in the same order: the same bits.
"""
import numpy as np


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries that cut n items into `parts` near-equal contiguous chunks."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def sum_in_order(parts, out) -> None:
    """out = ((parts[0] + parts[1]) + parts[2]) + ...: the contributions in group order (at least two)."""
    np.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out += part
