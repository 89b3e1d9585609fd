"""Loading: find the latest committed checkpoint, read a file, put its slices into a built model."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..engine.state import owned_pieces
from ..parallel.groups import allgather_axis0
from ..parallel.layout import Slice
from . import commit as cm, record as rec
from .errors import CheckpointError
from .format import read_file
from .paths import inside


class ParamDict(dict):
    """name -> array (parameters, optimizer state, append_info values), plus the file's attributes."""

    meta: dict = {}
    slices: dict = {}
    path = None


def load_checkpoint(path, verify: bool = True, into=None) -> ParamDict:
    """Read one checkpoint file into a dict of name -> array (MindSpore's load_checkpoint).

    Keys: parameter names (`layer2.weight`), optimizer state (`moment1.layer2.weight`), `global_step`,
    `learning_rate`, and the append_info values (`epoch_num`, `step_num`, user keys).
    into: name -> existing array to read that tensor into (see format.read_file), e.g. live_arrays(run).
    """
    return param_dict_of(read_file(path, verify=verify, into=into))


def live_arrays(run) -> dict:
    """name -> the array a run trains in place, for every owned slice (parameters, optimizer state):
    where a load reads straight into, so it allocates and copies nothing."""
    return {name: arr for name, _, _, arr in owned_pieces(run.network, run.optimizer)}


def param_dict_of(shard) -> ParamDict:
    """The ParamDict of a checkpoint file already read (format.Shard)."""
    out = ParamDict({name: t.data for name, t in shard.tensors.items()})
    out["global_step"] = np.array(shard.meta["global_step"])
    out["learning_rate"] = np.array(shard.meta["optimizer"]["learning_rate"])
    out.update({k: np.asarray(v) for k, v in shard.append_info.items()})
    out.meta, out.path = shard.meta, shard.path
    out.slices = {name: t.where for name, t in shard.tensors.items()}
    return out


def _assign(name, target_owned, owned, value, global_shape, saved_slice=None):
    """Place value (a full tensor or exactly the owned slice) into target_owned; else raise naming the difference.

    saved_slice, when the file says where its slice sits in the global tensor, must be the owned slice.
    """
    full = Slice((0,) * len(global_shape), tuple(global_shape))
    if saved_slice is not None and saved_slice not in (owned, full):
        raise CheckpointError(f"{name}: checkpoint holds the slice at offsets {saved_slice.offsets} extents "
                              f"{saved_slice.extents}, this rank needs offsets {owned.offsets} extents {owned.extents}")
    if value.shape == tuple(owned.extents):
        if not _same_memory(value, target_owned):  # read straight into it (live_arrays): nothing to copy
            target_owned[...] = value
    elif value.shape == tuple(global_shape):
        target_owned[...] = value[owned.index]
    else:
        raise CheckpointError(f"{name}: checkpoint shape {value.shape} matches neither this rank's slice "
                              f"{tuple(owned.extents)} nor the global shape {tuple(global_shape)} of the built layout")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are the same bytes seen the same way (e.g. two views made alike)."""
    return (a.shape == b.shape and a.dtype == b.dtype and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def load_param_into_net(net, param_dict) -> list:
    """Load parameters into a built network's owned slices (MindSpore's load_param_into_net).

    Accepts a sharded file's slices or an integrated file's full tensors; every shape is checked against
    the built layout and a mismatch names the parameter. Returns the names not found (raises if any).
    Given an optimizer (as MindSpore's "into the network or optimizer"), loads its state slices and step
    counter instead, so the learning-rate schedule and the moments go on exactly.
    """
    if hasattr(net, "state_items"):
        load_optimizer_state(net, param_dict)
        return []
    missing = [p.name for p in net.trainable_params() if p.name not in param_dict]
    if missing:
        raise CheckpointError(f"parameters missing from the checkpoint: {', '.join(missing)}")
    for p in net.trainable_params():
        _assign(p.name, p.owned_data, p.owned, np.asarray(param_dict[p.name]), p.spec.shape, _where(param_dict, p.name))
    return []


def _where(param_dict, name):
    return getattr(param_dict, "slices", {}).get(name)


def load_optimizer_state(optimizer, param_dict) -> None:
    """Load optimizer state slices and the step counter (the learning-rate schedule follows from it)."""
    params = {p.name: p for p in optimizer.params}
    for state_name, param_name, arr in optimizer.state_items():
        if state_name not in param_dict:
            raise CheckpointError(f"optimizer state missing from the checkpoint: {state_name}")
        p = params[param_name]
        _assign(state_name, arr, p.owned, np.asarray(param_dict[state_name]), p.spec.shape,
                _where(param_dict, state_name))
    optimizer.global_step = int(param_dict.meta["optimizer"]["global_step"])


TTP_PATTERN = "tft_saved_checkpoints-step_*"


def candidates(directory, which: str = "auto", ttp_dir=None) -> list[dict]:
    """Commit records to try, newest first by global step (never by file time): all for "auto", else the one named.

    Besides the periodic checkpoints in directory, the last-gasp ones under ttp_dir
    (`tft_saved_checkpoints-step_{n}/`) count too. Each record gets a "directory" key: where it lives.
    """
    dirs = [Path(directory)] + (sorted(Path(ttp_dir).glob(TTP_PATTERN)) if ttp_dir else [])
    records = [{**r, "directory": str(d)} for d in dirs if d.is_dir() for r in cm.committed(d)]
    records.sort(key=lambda r: (r["global_step"], r["time"]))
    if which == "auto":
        if not records:
            raise CheckpointError(f"no committed checkpoint in {directory}")
        return records[::-1]
    matches = [r for r in records if r["name"] == which]
    if not matches:
        raise CheckpointError(f"no committed checkpoint named {which} in {directory}")
    return matches[-1:]


def latest_committed(directory) -> dict:
    """The newest committed checkpoint's record in directory."""
    return candidates(directory)[0]


def file_for(directory, record: dict, rank: int) -> Path:
    """The file rank reads from a committed checkpoint in directory."""
    if record["integrated_save"]:
        return cm.integrated_path(directory, record["name"])
    return inside(directory, rec.file_of(record, rank), f"files[{rank}] of commit record {record['name']}")


def check_compatible(meta: dict, layout, world_size: int, path) -> None:
    """Raise naming the difference when a checkpoint was saved with another layout or world size."""
    if meta.get("integrated_save"):
        return  # full tensors re-slice to any layout
    if meta["world_size"] != world_size:
        raise CheckpointError(f"{path} was saved by {meta['world_size']} ranks, this run has {world_size}")
    saved, current = dict(meta["layout"]), layout.to_dict()
    saved.setdefault("pipeline_stage", 1)   # layouts without stages leave it out
    current.setdefault("pipeline_stage", 1)
    for key in ("pipeline_stage", *current):
        if saved.get(key) != current[key]:
            raise CheckpointError(f"{path} was saved with {key}={saved.get(key)}, this run has {key}={current[key]}")


def restore(run, path) -> ParamDict:
    """Load a checkpoint file into a built run: parameters, optimizer state, counters, data position.

    Collective: every rank reads its own file, then all agree before any rank goes on, so one bad file
    is one error on every rank rather than a hang.
    """
    error, param_dict = None, None
    try:
        param_dict = load_checkpoint(path, into=live_arrays(run))
    except CheckpointError as e:
        error = str(e)
    return load_into(run, param_dict, error)


def whole_slices(network, shard_comm) -> None:
    """Rebuild every optimizer-sharded parameter's whole mp slice from the owned parts (collective over
    the optimizer-shard group): after its owned parts were loaded, resharded or received."""
    for p in network.trainable_params():
        if p.opt_sharded:
            p.data[...] = allgather_axis0(shard_comm, np.ascontiguousarray(p.owned_data))


def load_into(run, param_dict, error=None) -> ParamDict:
    """Put a read checkpoint into a built run (collective; any rank's error, given or found, raises on all).

    Checks the layout and every slice against the built model first (one clear error naming the
    difference), then restores parameters, optimizer state, step counter and data position.
    """
    groups = run.groups
    if error is None:
        try:
            check_compatible(param_dict.meta, groups.layout, groups.world.size, param_dict.path)
            load_param_into_net(run.network, param_dict)
            load_optimizer_state(run.optimizer, param_dict)
        except CheckpointError as e:
            error = str(e)
    errors = [e for e in groups.world.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    whole_slices(run.network, groups.shard)
    run.loader.set_init_step(int(param_dict.meta["global_step"]))
    return param_dict
