"""The run configuration: YAML in, validated dataclasses out.

The defaults are the default run (configs/default.yaml spells them out): the last-gasp page's Network
on dp2 x mp4 with Momentum, on the built-in synthetic MNIST.

Each section is a small dataclass next to the code it configures, with the rules of its own keys (`validate`):
`parallel` (dsim/parallel/config.py), `model` (dsim/nn/config.py), `optimizer` (dsim/optim/config.py), `data`
(dsim/data/config.py), `train` and `output` (dsim/engine/config.py), `checkpoint` (dsim/checkpoint/config.py),
`fault` (dsim/faults/config.py), `tft` (dsim/ft/config.py). This module composes them into `Config`, loads the
YAML and the `--set` overrides, converts and checks the types, and checks the rules between sections.
`load_config` rejects unknown keys and wrong types with one line naming the key
(`config: unknown key 'parallel.data_paralel'`). Seeds and every random state derive from `seed`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .checkpoint.config import CheckpointSection
from .data.config import DataConfig
from .engine.config import OutputConfig, TrainConfig
from .faults.config import FAULT_RANK_KEYS, FaultConfig
from .ft.config import TFTConfig, apply_tft_env
from .nn.config import ModelConfig, TransformerConfig
from .optim.config import OptimizerConfig, ScheduleConfig
from .parallel.config import ParallelConfig
from .section import ConfigError, key, need

__all__ = ["Config", "ConfigError", "key", "load_config", "config_from_dict", "validate", "check_fault_ranks",
           "check_fault_steps", "apply_tft_env", "ParallelConfig", "ModelConfig", "TransformerConfig",
           "OptimizerConfig", "ScheduleConfig", "DataConfig", "TrainConfig", "OutputConfig", "CheckpointSection",
           "FaultConfig", "TFTConfig"]


@dataclass
class Config:
    """A run: `python -m dsim.train --config FILE --set key.sub=value`."""
    seed: int = key(1, "every random state derives from it: initial weights, data, shuffling", "[0, 2**32)")
    dtype: str = key("float32", "the parameters' and activations' dtype", "float32 | float64")
    parallel: ParallelConfig = key(doc="the parallel layout", factory=ParallelConfig)
    model: ModelConfig = key(doc="the network", factory=ModelConfig)
    optimizer: OptimizerConfig = key(doc="the optimizer", factory=OptimizerConfig)
    data: DataConfig = key(doc="the training data", factory=DataConfig)
    train: TrainConfig = key(doc="how long training runs", factory=TrainConfig)
    output: OutputConfig = key(doc="where the run writes", factory=OutputConfig)
    checkpoint: CheckpointSection = key(doc="periodic checkpoints", factory=CheckpointSection)
    fault: FaultConfig = key(doc="fault injection", factory=FaultConfig)
    tft: TFTConfig = key(doc="fault tolerance", factory=TFTConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """The keys of its own: dtype (seed: validate_seed)."""
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"config: dtype must be float32 or float64, got {self.dtype!r}")


def _convert(value, hint, name):
    """Check value against a type hint (int, float, str, bool, Optional[..], list[..], dataclass)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(value, args[0], name)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config: {name} must be a list, got {value!r}")
        (inner,) = typing.get_args(hint)
        return [_convert(v, inner, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value, name)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ConfigError(f"config: {name} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"config: {name} must be a finite number, got {value!r}")
    return float(value) if hint is float else value


def _from_dict(cls, data, prefix=""):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix or 'the file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in data:
        if name not in names:
            where = f"{prefix}.{name}" if prefix else str(name)
            raise ConfigError(f"config: unknown key '{where}' (known: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value) -> None:
    """Set a dotted key; a mapping set on a section is merged into it (as Hydra's overrides and OmegaConf.merge):
    `model.transformer={vocab_size: 256}` keeps the config file's other transformer keys."""
    keys = dotted.split(".")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"config: cannot set {dotted}: {k} is not a section")
    tree[keys[-1]] = _merged(tree.get(keys[-1]), value)


def _merged(old, new):
    """new over old, sections merged key by key at every depth; anything else replaced."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


def config_from_dict(data: dict) -> Config:
    """A Config from Config.to_dict() output (e.g. sent to a replacement process)."""
    return _from_dict(Config, data)


def load_config(path=None, overrides=()) -> Config:
    """Read a YAML config (or the defaults when path is None) and apply `key.sub=value` overrides."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file not found: {path}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config: {path} is not a text file (not UTF-8)") from None
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping at the top level")
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"config: override {item!r} must look like key.sub=value")
        _set_dotted(data, dotted.strip(), yaml.safe_load(raw))
    cfg = _from_dict(Config, data)
    apply_tft_env(cfg.tft, os.environ.get("MS_ENABLE_TFT"))
    validate(cfg)
    return cfg


INTEGRATED_PIPELINE = ("config: checkpoint.integrated_save with parallel.pipeline_stage={p}: the one file of whole "
                       "tensors is written by rank 0, which holds only the first stage's layers; save sharded "
                       "(integrated_save: false) and merge the shards with python -m dsim.inspect --merge")

def validate(cfg: Config) -> None:
    """Each section's rules, and those between sections (the layout's fit to the world size is checked at launch)."""
    cfg.validate()
    cfg.train.validate()
    cfg.data.validate()
    cfg.output.validate()
    if cfg.data.eval_samples and cfg.parallel.pipeline_stage > 1:
        raise ConfigError("config: data.eval_samples with parallel.pipeline_stage > 1 is not supported yet "
                          "(each stage holds part of the network)")
    if cfg.checkpoint.integrated_save and cfg.parallel.pipeline_stage > 1:
        raise ConfigError(INTEGRATED_PIPELINE.format(p=cfg.parallel.pipeline_stage))
    cfg.tft.validate()
    f = cfg.fault
    f.validate()
    handling = {"last_gasp": ("tft.ttp (the last-gasp save it strikes in)", cfg.tft.ttp),
                "repair": ("tft.arf or tft.uce (a repair in the job, which it strikes in)", cfg.tft.arf or cfg.tft.uce)}
    for name in FAULT_RANK_KEYS:  # a strike inside failure handling the config does not do: never
        needs, on = handling[name.rsplit("_", 1)[0]]
        if getattr(f, name) is not None and f.kind and not on:
            raise ConfigError(f"config: fault.{name} needs {needs}")
    if f.spare_hang and not cfg.tft.spares:
        raise ConfigError("config: fault.spare_hang freezes the warm spares: it needs tft.spares")
    cfg.model.validate()
    cfg.optimizer.validate()
    from .data.factory import NAMES as DATASETS, TOKEN_DATASETS
    tokens = cfg.model.name == "transformer"
    if tokens != (cfg.data.name in TOKEN_DATASETS):
        want = ", ".join(TOKEN_DATASETS) if tokens else ", ".join(n for n in DATASETS if n not in TOKEN_DATASETS)
        raise ConfigError(f"config: model {cfg.model.name} needs data.name {want}, got {cfg.data.name!r}")
    need(0 <= cfg.seed < 2**32, "seed", "in [0, 2**32)", cfg.seed)
    cfg.parallel.validate()
    cfg.checkpoint.validate()
    cfg.data.check_path()


def check_fault_ranks(f: FaultConfig, world_size: int) -> None:
    """Every rank the fault settings name is a training rank of this job (FaultConfig.check_ranks)."""
    f.check_ranks(world_size)


def check_fault_steps(cfg: Config, steps_per_epoch: int) -> None:
    """The step (or epoch) a fault is set for is one the run reaches, and at save or commit one that saves: a fault
    anywhere else would never strike either. (One before the step a resume begins from may have struck already, in
    the run resumed: that one is let be.)"""
    f, epochs = cfg.fault, cfg.train.epochs
    if not f.kind or f.kind == "plan":
        return
    last = epochs * steps_per_epoch
    if f.at == "epoch_end":
        if f.epoch is not None and f.epoch > epochs:
            raise ConfigError(f"config: fault.epoch={f.epoch} is after the last epoch of this run ({epochs}): the "
                              "fault would never strike")
        return
    steps = [s for s in (f.step if isinstance(f.step, list) else [f.step]) if s is not None]
    late = [s for s in steps if s > last]
    if late:
        raise ConfigError(f"config: fault.step={late[0]} is after the last step of this run ({last}: {epochs} "
                          f"epoch(s) x {steps_per_epoch} steps): the fault would never strike")
    if f.at in ("save", "commit"):
        if not cfg.checkpoint.enabled:
            raise ConfigError(f"config: fault.at={f.at} strikes in a checkpoint's save: it needs checkpoint.enabled")
        c = cfg.checkpoint.saver_config()  # when the saver saves
        other = next((s for s in steps if s != last and not c.due(s, steps_per_epoch)), None)  # (the last: saved too)
        if other is not None:
            how = (f"every {c.save_checkpoint_steps} steps" if c.save_checkpoint_steps else
                   f"every {c.save_checkpoint_epochs} epoch(s) of {steps_per_epoch} steps")
            raise ConfigError(f"config: fault.step={other} saves no checkpoint (this run saves {how} and at its last "
                              f"step, {last}): a fault at {f.at} would never strike")
