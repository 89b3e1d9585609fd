"""Group info: which ranks hold identical slices of all parameters and optimizer state (replica sets).

A pure function of the layout. Two ranks are replicas when they have the same model-parallel index and
the same optimizer-shard index; with optimizer shard k = dp a rank has no replica but itself.

A replica set is an arithmetic progression, `range(stage * S + shard * mp + m, (stage + 1) * S, mp * k)` with
S = dp x mp the ranks of a pipeline stage (without stages: `range(shard * mp + m, world, mp * k)`), stored as one
(progression.py): in every checkpoint file's `group_info` attribute and in `rank_<r>/group_info.json`, so
neither grows with the world size. `restore_group_info_list` still returns MindSpore's full list of ranks,
expanded from it; group info written before (format `dsim-group-info/1`, a list of ranks) still reads.
`replica_ranges` gives every replica set once in O(p x mp x k); `replica_sets` lists their ranks (O(world)).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..parallel.layout import ParallelLayout, is_opt_sharded
from . import progression
from .errors import CheckpointError

FORMAT = "dsim-group-info/2"
OLD_FORMAT = "dsim-group-info/1"   # group_info a list of ranks


def group_info(layout: ParallelLayout, rank: int) -> list[int]:
    """The ranks (including rank) whose checkpoint shard can replace rank's: e.g. dp2 x mp4, rank 0 -> [0, 4]."""
    return layout.replica_group(rank)


def group_range(layout: ParallelLayout, rank: int) -> range:
    """rank's group info as a progression (canonical form): dp2 x mp4, rank 0 -> range(0, 5, 4), i.e. [0, 4]."""
    c = layout.coords(rank)
    return _replica_range(layout, c.stage, c.shard, c.mp)


def _replica_range(layout: ParallelLayout, stage: int, shard: int, mp: int) -> range:
    stage_ranks = layout.stage_ranks(stage)
    period = layout.model_parallel * layout.optimizer_shard
    return progression.canonical(range(stage_ranks.start + shard * layout.model_parallel + mp, stage_ranks.stop, period))


def group_info_attr(layout: ParallelLayout, rank: int) -> dict:
    """What a checkpoint file stores as its `group_info` attribute: the progression {start, stop, step}."""
    return progression.to_json(group_range(layout, rank))


def group_info_as(stored, layout: ParallelLayout, rank: int):
    """rank's group info in the form `stored` (another rank's) has: a list of ranks for a file written before
    the progression form, so a file repaired from its replica keeps the content its commit record pinned."""
    return group_info(layout, rank) if isinstance(stored, list) else group_info_attr(layout, rank)


def group_info_list(value) -> list[int]:
    """The ranks of a stored group info: a progression {start, stop, step}, or (written before) a list of ranks.

    Raises CheckpointError (one line) for anything else.
    """
    if isinstance(value, dict):
        return list(progression.from_json(value, "group info"))
    if isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        return list(value)
    raise CheckpointError(f"group info {value!r} is neither a progression nor a list of ranks")


def replica_ranges(layout: ParallelLayout) -> list[range]:
    """Every replica set once as a progression, ordered by its first rank (the set index
    (stage * k + s) * mp + m)."""
    mp, k = layout.model_parallel, layout.optimizer_shard
    return [_replica_range(layout, stage, s, m) for stage in range(layout.pipeline_stage)
            for s in range(k) for m in range(mp)]


def replica_sets(layout: ParallelLayout) -> list[list[int]]:
    """Every replica set once, ordered by its first rank; together they partition the ranks."""
    return [list(r) for r in replica_ranges(layout)]


def write_group_info(path, layout: ParallelLayout, rank: int) -> Path:
    """Write rank's group info as a small JSON file (atomically); returns the path written."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise CheckpointError(f"group info: rank {rank!r} is not a rank number")
    path = Path(str(path).replace("{rank}", str(rank)))  # digits only
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "rank": rank, "group_info": group_info_attr(layout, rank),
                               "layout": layout.to_dict()}) + "\n")
    os.replace(tmp, path)
    return path


def restore_group_info_list(path) -> list[int]:
    """The list of replica ranks stored in a group-info file (MindSpore's restore_group_info_list).

    Reads both formats: a progression (dsim-group-info/2), a list of ranks (dsim-group-info/1).
    """
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") not in (FORMAT, OLD_FORMAT):
            raise ValueError
        return group_info_list(data["group_info"])
    except FileNotFoundError:
        raise CheckpointError(f"group info file not found: {path}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError, CheckpointError):
        raise CheckpointError(f"not a dsim group info file: {path}") from None


def tensor_holders(spec, layout: ParallelLayout, rank: int) -> list[int]:
    """The ranks (including rank) whose owned slice of a parameter (and of its optimizer state) equals rank's.

    The replica set for slices split over mp and sliced by optimizer shard; more for tensors replicated
    beyond it: a tensor replicated over mp (LayerNorm, a row layer's bias, a dp embedding) is held by
    ranks of every mp index, one that optimizer shard leaves whole by every rank of the dp group. All of them
    in the parameter's pipeline stage (rank must be one of its ranks).
    """
    c = layout.coords(rank)
    mps = [c.mp] if spec.mp_axis is not None else range(layout.model_parallel)
    dps = range(c.shard, layout.data_parallel, layout.optimizer_shard) if is_opt_sharded(spec, layout) else \
        range(layout.data_parallel)
    return sorted(layout.rank_of(d, m, c.stage) for d in dps for m in mps)


def holder_sets(specs, layout: ParallelLayout) -> dict:
    """Every distinct holder set of any slice of any parameter -> the names of the tensors with such slices."""
    out = {}
    for spec in specs:
        for rank in layout.stage_ranks(spec.stage):
            out.setdefault(tuple(tensor_holders(spec, layout, rank)), set()).add(spec.name)
    return {h: sorted(names) for h, names in sorted(out.items())}
