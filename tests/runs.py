"""What a finished run left, for the end-to-end tests that compare runs: its losses and a checkpoint file's tensors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def steps(run_dir: Path) -> list[tuple[int, float]]:
    """(global step, loss) of every step in a run's metrics.jsonl, in the order logged ([] when there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(e["global_step"], e["loss"]) for e in events if e.get("event") == "step"]


def tensors(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of an HDF5 checkpoint file, by its path in the file."""
    import h5py
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return found
