"""Checkpoints: MindSpore's CheckpointConfig / ModelCheckpoint semantics on sharded HDF5 files.

save:    saver.ModelCheckpoint (when, retention, a failed save) -> save.save, the one save path of every saver
         (plan -> format.write_file per file -> gather -> commit.write_commit last; record: what the
         commit record holds, O(distinct slices); progression: rank sets as ranges)
plan:    group_info (which ranks hold identical slices), survivability (which failures leave a full copy)
tools:   merge (virtual HDF5 of whole tensors); `python -m dsim.inspect` lists, verifies, merges
load:    loader.latest_committed -> loader.load_checkpoint -> loader.load_param_into_net / restore
"""
from .commit import checkpoint_name, committed
from .config import CheckpointConfig
from .errors import CheckpointError
from .group_info import group_info, replica_sets, restore_group_info_list
from .loader import latest_committed, load_checkpoint, load_param_into_net, restore
from .saver import ModelCheckpoint
from .survivability import Survivability, survivability

__all__ = ["CheckpointConfig", "CheckpointError", "ModelCheckpoint", "checkpoint_name", "committed",
           "group_info", "replica_sets", "restore_group_info_list", "latest_committed", "load_checkpoint",
           "load_param_into_net", "restore", "Survivability", "survivability"]
