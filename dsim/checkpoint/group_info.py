"""Group info: which ranks hold identical slices of all parameters and optimizer state (replica sets).

A pure function of the layout. Two ranks are replicas when they have the same model-parallel index and
the same optimizer-shard index; with optimizer shard k = dp a rank has no replica but itself.
Planning is O(world size): `replica_sets` lists each set once, for any number of ranks.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..parallel.layout import ParallelLayout, is_opt_sharded
from .errors import CheckpointError

FORMAT = "dsim-group-info/1"


def group_info(layout: ParallelLayout, rank: int) -> list[int]:
    """The ranks (including rank) whose checkpoint shard can replace rank's: e.g. dp2 x mp4, rank 0 -> [0, 4]."""
    return layout.replica_group(rank)


def replica_sets(layout: ParallelLayout) -> list[list[int]]:
    """Every replica set once, ordered by its first rank; together they partition the ranks."""
    mp, k, dp = layout.model_parallel, layout.optimizer_shard, layout.data_parallel
    return [[d * mp + m for d in range(s, dp, k)] for s in range(k) for m in range(mp)]


def write_group_info(path, layout: ParallelLayout, rank: int) -> Path:
    """Write rank's group info as a small JSON file (atomically); returns the path written."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise CheckpointError(f"group info: rank {rank!r} is not a rank number")
    path = Path(str(path).replace("{rank}", str(rank)))  # digits only
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "rank": rank, "group_info": group_info(layout, rank),
                               "layout": layout.to_dict()}) + "\n")
    os.replace(tmp, path)
    return path


def restore_group_info_list(path) -> list[int]:
    """The list of replica ranks stored in a group-info file (MindSpore's restore_group_info_list)."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise ValueError
        return [int(r) for r in data["group_info"]]
    except FileNotFoundError:
        raise CheckpointError(f"group info file not found: {path}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError):
        raise CheckpointError(f"not a dsim group info file: {path}") from None


def tensor_holders(spec, layout: ParallelLayout, rank: int) -> list[int]:
    """The ranks (including rank) whose owned slice of a parameter (and of its optimizer state) equals rank's.

    The replica set for slices split over mp and sliced by optimizer shard; more for tensors replicated
    beyond it: a tensor replicated over mp (LayerNorm, a row layer's bias, a dp embedding) is held by
    ranks of every mp index, one that optimizer shard leaves whole by every rank of the dp group.
    """
    c = layout.coords(rank)
    mps = [c.mp] if spec.mp_axis is not None else range(layout.model_parallel)
    dps = range(c.shard, layout.data_parallel, layout.optimizer_shard) if is_opt_sharded(spec, layout) else \
        range(layout.data_parallel)
    return sorted(layout.rank_of(d, m) for d in dps for m in mps)


def holder_sets(specs, layout: ParallelLayout) -> dict:
    """Every distinct holder set of any slice of any parameter -> the names of the tensors with such slices."""
    out = {}
    for spec in specs:
        for rank in range(layout.world_size):
            out.setdefault(tuple(tensor_holders(spec, layout, rank)), set()).add(spec.name)
    return {h: sorted(names) for h, names in sorted(out.items())}
