"""dsim: distributed deep-learning training on real MPI ranks, and its recovery from faults.

Data flow: config -> parallel layout -> model/optimizer -> data -> training loop.
"""
__version__ = "0.1.0"

from .checkpoint import (CheckpointConfig, ModelCheckpoint, load_checkpoint, load_param_into_net,  # noqa: E402
                         restore_group_info_list)

__all__ = ["CheckpointConfig", "ModelCheckpoint", "load_checkpoint", "load_param_into_net", "restore_group_info_list"]
