"""How a group cuts a flat buffer into one contiguous chunk per rank (each rank sums its chunk)."""


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries that cut n items into `parts` near-equal contiguous chunks."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds
