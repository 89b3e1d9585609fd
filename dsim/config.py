"""The run configuration: YAML in, validated dataclasses out.

The defaults are the default run (configs/default.yaml spells them out): the last-gasp page's Network
on dp2 x mp4 with Momentum, on the built-in synthetic MNIST.

Every section is a small dataclass; `load_config` rejects unknown keys and wrong types with one line
naming the key (`config: unknown key 'parallel.data_paralel'`). Seeds and every random state derive
from `seed`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be run."""


def key(default=dataclasses.MISSING, doc: str = "", allowed=None, *, factory=None):
    """A config key: its default, one line of meaning, and its allowed values when the type leaves them open (a
    string, or a function giving the names of a registry). `python -m dsim.config --reference` prints them all."""
    meta = {"doc": doc, "allowed": allowed}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _models():
    from .nn.models import MODELS
    return MODELS


def _optimizers():
    from .optim import OPTIMIZERS
    return OPTIMIZERS


def _datasets():
    from .data.factory import NAMES
    return NAMES


def _schedules():
    from .optim.schedule import LRSchedule
    return LRSchedule.NAMES


def _pipeline_schedules():
    from .parallel.pipeline import SCHEDULES
    return SCHEDULES


def _fault_points():
    from .faults import POINTS
    return POINTS


def _stagings():
    from .checkpoint.config import ASYNC_STAGING
    return ASYNC_STAGING


@dataclass
class ParallelConfig:
    """How the ranks share the model (MindSpore's device matrix, model parallel innermost)."""
    data_parallel: Optional[int] = key(None, "data-parallel replicas; null: the world size / (model_parallel x "
                                             "pipeline_stage)", ">= 1 or null")
    model_parallel: int = key(4, "ranks that split each layer (Megatron-style column / row slices)", ">= 1")
    optimizer_shard: int = key(1, "ranks of a data-parallel group that each update 1/k of a weight and its "
                                  "optimizer state (MindSpore's optimizer_weight_shard_size)", "1, a divisor of dp, or dp")
    vocab_emb_dp: bool = key(True, "transformer: word embeddings whole on every rank (false: vocabulary split over mp)")
    pipeline_stage: int = key(1, "pipeline stages, each a block of dp x mp consecutive ranks (MindSpore's "
                                 "pipeline_stages)", ">= 1, dividing the world")
    micro_batch_num: int = key(1, "micro-batches each rank's part of the global batch is cut into "
                                  "(MindSpore's PipelineCell(net, micro_batch_num))", ">= pipeline_stage")
    pipeline_schedule: str = key("1f1b", "order of micro-batch forwards and backwards: 1f1b (MindSpore's) or gpipe "
                                         "(all forwards, then all backwards)", _pipeline_schedules)


@dataclass
class TransformerConfig:
    """The distributed page's sample Transformer (its defaults)."""
    vocab_size: int = key(20000, "vocabulary size of each side (source and target)", ">= 4")
    d_model: int = key(128, "width of the embeddings and of every block", ">= 1")
    num_heads: int = key(8, "attention heads (divisible by model_parallel)", ">= 1")
    ffn_hidden_size: Optional[int] = key(None, "width of the feed-forward layer; null: d_model, as the sample",
                                         ">= 1 or null")
    encoder_layers: int = key(1, "encoder blocks", ">= 1")
    decoder_layers: int = key(1, "decoder blocks", ">= 1")
    src_len: int = key(10, "source sequence length in tokens", ">= 1")
    tgt_len: int = key(10, "target sequence length in tokens", ">= 1")
    max_position: Optional[int] = key(None, "size of the position table; null: the longer of src_len and tgt_len",
                                      ">= 1 or null")


@dataclass
class ModelConfig:
    """Which network is trained."""
    name: str = key("network", "the network: the last-gasp page's MLP (network), the UCE page's (uce_network), "
                               "LeNet5 or the distributed page's Transformer", _models)
    hidden: Optional[list[int]] = key(None, "MLPs: the hidden widths instead of the model's, e.g. [64, 128, 128, 64]",
                                      "widths 1 to 65536, or null")
    transformer: TransformerConfig = key(doc="the Transformer's sizes (model.name: transformer)",
                                         factory=TransformerConfig)


@dataclass
class ScheduleConfig:
    """The learning-rate schedule, a function of the global step."""
    name: str = key("constant", "the schedule's shape after warmup", _schedules)
    warmup_steps: int = key(0, "steps of linear warmup from 0 to the learning rate", ">= 0")
    decay_steps: int = key(1000, "cosine: steps from the peak to min_lr; exponential: steps per decay_rate factor",
                           ">= 1")
    decay_rate: float = key(0.9, "exponential: the factor applied every decay_steps", "> 0")
    min_lr: float = key(0.0, "cosine: the learning rate the decay ends at", ">= 0")


@dataclass
class OptimizerConfig:
    """The optimizer (MindSpore's names and semantics)."""
    name: str = key("momentum", "sgd, momentum (ApplyMomentum), adam, or adamweightdecay (MindSpore's: no bias "
                                "correction, no decay on LayerNorm and biases)", _optimizers)
    learning_rate: float = key(0.02, "the peak learning rate", "> 0")
    momentum: float = key(0.9, "momentum: the moment's decay", "[0, 1)")
    beta1: float = key(0.9, "adam, adamweightdecay: first moment's decay", "[0, 1)")
    beta2: float = key(0.999, "adam, adamweightdecay: second moment's decay", "[0, 1)")
    eps: float = key(1e-8, "adam, adamweightdecay: added to the second moment's square root", "> 0")
    weight_decay: float = key(0.0, "adamweightdecay: decoupled weight decay", ">= 0")
    schedule: ScheduleConfig = key(doc="the learning-rate schedule", factory=ScheduleConfig)


@dataclass
class DataConfig:
    """The training data; every random state derives from `seed`."""
    name: str = key("synthetic", "synthetic (MNIST-shaped, generated), mnist (idx files), translation (the "
                                 "transformer's toy task) or text (a source<TAB>target file)", _datasets)
    path: Optional[str] = key(None, "mnist: the idx files' directory (e.g. MNIST_Data/train); text: the pairs file",
                              "a path; required for mnist and text")
    num_samples: int = key(1920, "synthetic and translation: samples generated", ">= 1")
    batch_size: int = key(32, "the global batch, split over the data-parallel ranks", ">= 1")
    shuffle: bool = key(True, "shuffle every epoch (from the seed)")
    eval_samples: int = key(0, "held-out samples (after the training ones; of a file, its last), evaluated after "
                               "every epoch", ">= 0; 0 with pipeline_stage > 1")


@dataclass
class TrainConfig:
    """How long training runs."""
    epochs: int = key(2, "epochs to train (the last epoch, on a resume)", ">= 1")
    steps_per_epoch: Optional[int] = key(None, "cut every epoch to this many steps; null: the whole dataset",
                                         ">= 1 or null")


@dataclass
class CheckpointSection:
    """Periodic checkpoints (MindSpore's CheckpointConfig and ModelCheckpoint)."""
    enabled: bool = key(True, "save checkpoints")
    prefix: str = key("network", "file name prefix: <prefix>-<epoch>_<step>; a prefix in use gets _1, _2, ...",
                      "a plain file name (no '/')")
    directory: Optional[str] = key(None, "where checkpoints go; null: <output.dir>/checkpoints",
                                   "a writable directory or null")
    save_checkpoint_steps: Optional[int] = key(None, "save every N steps (set this or save_checkpoint_epochs; "
                                                     "neither: every step)", ">= 1 or null")
    save_checkpoint_epochs: Optional[int] = key(1, "save at the end of every N-th epoch", ">= 1 or null")
    keep_checkpoint_max: int = key(5, "committed checkpoints kept; the oldest is removed after a new one commits",
                                   ">= 1")
    integrated_save: bool = key(False, "one file of whole tensors instead of each rank saving only its own slices")
    append_info: list[Any] = key(doc="extra values saved in every file: epoch_num, step_num and {name: value} "
                                     "mappings", allowed="'epoch_num', 'step_num' or {str: number | bool | str}",
                                 factory=lambda: ["epoch_num", "step_num"])
    group_info_file: Optional[str] = key(None, "also write the rank's group info here ({rank} becomes the rank); "
                                               "$GROUP_INFO_FILE sets it too", "a path or null")
    on_save_error: str = key("stop", "a save the storage refuses: stop (exit 1) or continue (warn, try again at the "
                                     "next save)", "stop | continue")
    async_save: bool = key(False, "write the files in a background thread; commit once every rank's file is durable")
    async_staging: str = key("memory", "where an async save stages the state: memory (a reused buffer) or "
                                       "page_cache (the file itself)", _stagings)
    save_on_signal: bool = key(False, "on SIGUSR2 or SIGTERM, stop after a step every rank agrees on, save it, and "
                                      "exit 128 + the signal", "needs enabled")


@dataclass
class FaultConfig:
    """Fault injection, to practise recovery."""
    kind: Optional[str] = key(None, "what fails: null (nothing), exception, kill (SIGKILL), uce (a memory error), "
                                    "hang (SIGSTOP), stuck (main thread stops), deadlock, unmatched, slow, sdc (a "
                                    "flipped bit) or plan ($DSIM_FAULT_PLAN)",
                              "null | exception | kill | uce | hang | stuck | deadlock | unmatched | slow | sdc | plan")
    rank: Any = key(None, "the rank that fails; a list for several; null: every rank", "a rank, a list of ranks, or null")
    last_gasp_kill: Optional[int] = key(None, "also kill this rank half-way through its last-gasp writes",
                                        "a training rank or null; needs tft.ttp")
    last_gasp_stuck: Optional[int] = key(None, "this rank's last-gasp write never returns (found by tft.hang_timeout)",
                                         "a training rank or null; needs tft.ttp")
    repair_kill: Optional[int] = key(None, "also kill this rank during a repair in the job (at repair_at)",
                                     "a training rank or null; needs tft.arf or tft.uce")
    repair_hang: Optional[int] = key(None, "this rank freezes (SIGSTOP) during a repair in the job (at repair_at)",
                                     "a training rank or null; needs tft.arf or tft.uce")
    repair_stuck: Optional[int] = key(None, "this rank's repair stops while its process runs (at repair_at)",
                                      "a training rank or null; needs tft.arf or tft.uce")
    repair_at: str = key("refill", "where in a repair the repair_* faults strike: refill (the dead rank's place not "
                                   "filled yet) or exchange (filled, state not moved yet)", "refill | exchange")
    spare_hang: bool = key(False, "the warm spares freeze (SIGSTOP) as they begin to wait", "needs tft.spares")
    step: Any = key(None, "the global step (1-based) the fault strikes at; a list gives one per rank of a rank list",
                    "a step >= 1 up to the run's last, or a list")
    epoch: Optional[int] = key(None, "the epoch, with at: epoch_end", ">= 1 up to the run's last, or null")
    at: str = key("step_end", "where in the step it strikes", _fault_points)
    slowdown: float = key(4.0, "kind slow: how many times slower the rank computes from then on", "> 1")


@dataclass
class TFTConfig:
    """Fault tolerance (MindSpore's MS_ENABLE_TFT='{TTP:1,UCE:1,ARF:1}' sets the same switches)."""
    ttp: bool = key(False, "when a rank dies, the survivors save a last-gasp checkpoint of the newest step")
    uce: bool = key(False, "repair a rank's memory error (UCE) in the job from a replica (implies ttp)")
    uce_in_place: bool = key(True, "with uce, a UCE found in a forward pass is repaired by that rank alone while the "
                                   "others go on")
    arf: bool = key(False, "replace a dead process in the job by a spawned one (implies ttp)")
    spares: int = key(0, "warm spare processes started with the job, beyond the layout's ranks (implies arf)",
                      ">= 0")
    elastic: bool = key(False, "no replacement for a dead rank: go on with fewer ranks, lower dp (implies ttp)")
    hang_timeout: Optional[float] = key(None, "seconds a frozen or stuck rank is waited for before it is killed",
                                        "> 0 or null (off)")
    deadlock_timeout: Optional[float] = key(None, "seconds every rank may wait, none progressing, before the "
                                                  "deadlock is broken; null: 10 x hang_timeout",
                                            "> 0 or null; needs hang_timeout")
    straggler_factor: Optional[float] = key(None, "a rank computing its steps this many times slower than its "
                                                  "stage's median is a straggler", "> 1 or null (off)")
    straggler_evict: bool = key(False, "kill a straggler, then as a dead rank (a spare takes its place)",
                                "needs straggler_factor")
    sdc_check_every: Optional[int] = key(None, "steps between two comparisons of the replicas (and before every "
                                               "save): silent data corruption", ">= 1 or null (off)")
    sdc_rollback: bool = key(True, "corruption found: roll back in the job to the newest checkpoint (false: stop)")
    ckpt_save_path: Optional[str] = key(None, "where last-gasp checkpoints go; null: <checkpoint dir>/ttp_checkpoints",
                                        "a writable directory or null")


@dataclass
class OutputConfig:
    """Where a run writes, and what it prints."""
    dir: str = key("runs/default", "metrics.jsonl, logs/ and (by default) checkpoints/ go here", "a path")
    progress_bar: bool = key(True, "a tqdm progress bar on rank 0 when stderr is a terminal")
    loss_every: int = key(10, "LossMonitor prints the loss every N steps", ">= 1")


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


def _convert(value, hint, key):
    """Check value against a type hint (int, float, str, bool, Optional[..], list[..], dataclass)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _convert(value, args[0], key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        (inner,) = typing.get_args(hint)
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value, key)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if not ok:
        raise ConfigError(f"config: {key} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    if hint is float and not math.isfinite(value):
        raise ConfigError(f"config: {key} must be a finite number, got {value!r}")
    return float(value) if hint is float else value


def _from_dict(cls, data, prefix=""):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: {prefix or 'the file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
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
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"config: override {item!r} must look like key.sub=value")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    cfg = _from_dict(Config, data)
    apply_tft_env(cfg.tft, os.environ.get("MS_ENABLE_TFT"))
    validate(cfg)
    return cfg


def apply_tft_env(tft: TFTConfig, value) -> None:
    """Switches from MindSpore's MS_ENABLE_TFT, e.g. '{TTP:1}' or '{UCE:1 TTP:1}' (UCE and ARF imply TTP)."""
    if value:
        pairs = re.findall(r"([A-Za-z]+)\s*:\s*([01])", value)
        known = {"TTP", "UCE", "ARF"}
        if not pairs or any(k.upper() not in known for k, _ in pairs):
            raise ConfigError(f"MS_ENABLE_TFT={value!r}: expected e.g. '{{TTP:1,UCE:1,ARF:1}}'")
        for k, v in pairs:
            setattr(tft, k.lower(), v == "1")
    if isinstance(tft.spares, int) and tft.spares > 0:
        tft.arf = True  # a spare is only ever used to replace a dead rank
    if tft.uce or tft.arf or tft.elastic:  # (a straggler killed, as a rank the hang watch kills, is a death like
        tft.ttp = True                      # any other: what follows it is what this config does for one)


INTEGRATED_PIPELINE = ("config: checkpoint.integrated_save with parallel.pipeline_stage={p}: the one file of whole "
                       "tensors is written by rank 0, which holds only the first stage's layers; save sharded "
                       "(integrated_save: false) and merge the shards with python -m dsim.inspect --merge")


def validate(cfg: Config) -> None:
    """Checks that need more than one field (the layout's fit to the world size is checked at launch)."""
    if cfg.dtype not in ("float32", "float64"):
        raise ConfigError(f"config: dtype must be float32 or float64, got {cfg.dtype!r}")
    positive = {"train.epochs": cfg.train.epochs, "data.batch_size": cfg.data.batch_size,
                "data.num_samples": cfg.data.num_samples, "output.loss_every": cfg.output.loss_every}
    if cfg.train.steps_per_epoch is not None:
        positive["train.steps_per_epoch"] = cfg.train.steps_per_epoch
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config: {key} must be >= 1, got {value}")
    if cfg.data.eval_samples < 0:
        raise ConfigError(f"config: data.eval_samples must be >= 0, got {cfg.data.eval_samples}")
    if cfg.data.eval_samples and cfg.parallel.pipeline_stage > 1:
        raise ConfigError("config: data.eval_samples with parallel.pipeline_stage > 1 is not supported yet "
                          "(each stage holds part of the network)")
    if cfg.checkpoint.integrated_save and cfg.parallel.pipeline_stage > 1:
        raise ConfigError(INTEGRATED_PIPELINE.format(p=cfg.parallel.pipeline_stage))
    if cfg.tft.spares < 0:
        raise ConfigError(f"config: tft.spares must be >= 0, got {cfg.tft.spares}")
    n = cfg.tft.sdc_check_every
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError(f"config: tft.sdc_check_every must be a number of steps >= 1 (or null: off), got {n!r}")
    h = cfg.tft.hang_timeout
    if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float)) or not h > 0):
        raise ConfigError(f"config: tft.hang_timeout must be a number of seconds > 0 (or null: off), got {h!r}")
    d = cfg.tft.deadlock_timeout
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 0):
        raise ConfigError(f"config: tft.deadlock_timeout must be a number of seconds > 0 (or null: 10 x "
                          f"tft.hang_timeout), got {d!r}")
    if d is not None and h is None:
        raise ConfigError("config: tft.deadlock_timeout needs tft.hang_timeout (the hang watch finds a deadlock)")
    x = cfg.tft.straggler_factor
    if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 1):
        raise ConfigError(f"config: tft.straggler_factor must be a number > 1 (or null: off), got {x!r}")
    if cfg.tft.straggler_evict and x is None:
        raise ConfigError("config: tft.straggler_evict needs tft.straggler_factor (how much slower is a straggler)")
    f = cfg.fault
    kinds = ("exception", "kill", "uce", "hang", "stuck", "deadlock", "unmatched", "slow", "sdc", "plan")
    if f.kind not in (None, *kinds):
        raise ConfigError(f"config: fault.kind must be {', '.join(kinds[:-1])} or {kinds[-1]}, got {f.kind!r}")
    d = f.slowdown
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not d > 1:
        raise ConfigError(f"config: fault.slowdown must be a number > 1 (how many times slower), got {d!r}")
    if f.kind == "plan" and not Path(os.environ.get("DSIM_FAULT_PLAN") or "/nonexistent/").is_file():
        raise ConfigError("config: fault.kind plan needs $DSIM_FAULT_PLAN, a fault plan file (python -m dsim.campaign "
                          f"writes one), got {os.environ.get('DSIM_FAULT_PLAN')!r}")
    if f.kind == "plan":
        from .faults import plan_error
        wrong = plan_error(os.environ["DSIM_FAULT_PLAN"])
        if wrong:
            raise ConfigError(f"fault plan {os.environ['DSIM_FAULT_PLAN']}: {wrong}")
    ranks = f.rank if isinstance(f.rank, list) else [f.rank]
    if f.rank is not None and not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise ConfigError(f"config: fault.rank must be a rank, a list of ranks or null, got {f.rank!r}")
    handling = {"last_gasp": ("tft.ttp (the last-gasp save it strikes in)", cfg.tft.ttp),
                "repair": ("tft.arf or tft.uce (a repair in the job, which it strikes in)", cfg.tft.arf or cfg.tft.uce)}
    for key in FAULT_RANK_KEYS:
        r = getattr(f, key)
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ConfigError(f"config: fault.{key} must be a rank (>= 0) or null, got {r!r}")
        needs, on = handling[key.rsplit("_", 1)[0]]
        if r is not None and f.kind and not on:  # a strike inside failure handling the config does not do: never
            raise ConfigError(f"config: fault.{key} needs {needs}")
    if isinstance(f.step, list) and not (isinstance(f.rank, list) and len(f.rank) == len(f.step)):
        raise ConfigError(f"config: a list of fault.step needs a list of fault.rank as long, got {f.rank!r}")
    steps = f.step if isinstance(f.step, list) else [f.step]
    if f.step is not None and not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps):
        raise ConfigError(f"config: fault.step must be a step (>= 1) or a list of steps, got {f.step!r}")
    if cfg.checkpoint.on_save_error not in ("stop", "continue"):
        raise ConfigError(f"config: checkpoint.on_save_error must be stop or continue, got {cfg.checkpoint.on_save_error!r}")
    from .faults import PLAN_POINTS, POINTS, STUCK_POINTS
    if f.at not in POINTS:
        raise ConfigError(f"config: fault.at must be one of {', '.join(POINTS)}, got {f.at!r}")
    if f.repair_at not in ("refill", "exchange"):
        raise ConfigError(f"config: fault.repair_at must be refill or exchange, got {f.repair_at!r}")
    if cfg.checkpoint.save_on_signal and not cfg.checkpoint.enabled:
        raise ConfigError("config: checkpoint.save_on_signal saves the step training stops at: it needs checkpoint.enabled")
    if f.spare_hang and not cfg.tft.spares:
        raise ConfigError("config: fault.spare_hang freezes the warm spares: it needs tft.spares")
    if f.kind in ("stuck", "deadlock", "unmatched") and f.at not in STUCK_POINTS:  # inside work the hang watch judges
        raise ConfigError(f"config: fault.kind {f.kind} strikes inside a step's computation, a save or a callback: "
                          f"fault.at must be {', '.join(STUCK_POINTS[:-1])} or {STUCK_POINTS[-1]}, got {f.at!r}")
    if f.kind == "slow" and f.at not in PLAN_POINTS:  # from a point of a step on
        raise ConfigError(f"config: fault.kind slow begins inside a step's computation: fault.at must be "
                          f"{', '.join(PLAN_POINTS[:-1])} or {PLAN_POINTS[-1]}, got {f.at!r}")
    if f.kind and f.kind != "plan" and (f.epoch if f.at == "epoch_end" else f.step) is None:
        raise ConfigError(f"config: fault at {f.at} needs fault.{'epoch' if f.at == 'epoch_end' else 'step'}")
    from .data.factory import NAMES as DATASETS, TOKEN_DATASETS
    from .nn.models import MODELS
    from .optim import OPTIMIZERS
    for key, value, allowed in (("model.name", cfg.model.name, MODELS), ("optimizer.name", cfg.optimizer.name, OPTIMIZERS),
                                ("data.name", cfg.data.name, DATASETS)):
        if value not in allowed:
            raise ConfigError(f"config: {key} must be one of {', '.join(allowed)}, got {value!r}")
    if cfg.model.hidden is not None and not all(w >= 1 for w in cfg.model.hidden):
        raise ConfigError(f"config: model.hidden widths must be >= 1, got {cfg.model.hidden}")
    t = cfg.model.transformer
    for key in ("vocab_size", "d_model", "num_heads", "ffn_hidden_size", "encoder_layers", "decoder_layers",
                "src_len", "tgt_len", "max_position"):
        value = getattr(t, key)
        if value is not None and value < (4 if key == "vocab_size" else 1):
            raise ConfigError(f"config: model.transformer.{key} must be >= {4 if key == 'vocab_size' else 1}, "
                              f"got {value}")
    tokens = cfg.model.name == "transformer"
    if tokens != (cfg.data.name in TOKEN_DATASETS):
        want = ", ".join(TOKEN_DATASETS) if tokens else ", ".join(n for n in DATASETS if n not in TOKEN_DATASETS)
        raise ConfigError(f"config: model {cfg.model.name} needs data.name {want}, got {cfg.data.name!r}")
    ranges(cfg)
    if cfg.data.name in ("mnist", "text"):
        if not cfg.data.path:
            raise ConfigError(f"config: data.path is required when data.name is {cfg.data.name}")
        if not Path(cfg.data.path).exists():
            raise ConfigError(f"config: data.path not found: {cfg.data.path}")


# each one rank, struck inside the last gasp or a repair in the job
FAULT_RANK_KEYS = ("last_gasp_kill", "last_gasp_stuck", "repair_kill", "repair_hang", "repair_stuck")


def check_fault_ranks(f: FaultConfig, world_size: int) -> None:
    """Every rank the fault settings name is a training rank of this job (0 .. world_size - 1, warm spares not
    counted): a fault meant for rank 9 of 8 would never strike, and the run would look like one that survived it.
    Only with fault.kind set, the settings that act then (a plan's entries name their own ranks)."""
    if not f.kind:
        return
    named = [] if f.kind == "plan" else [("rank", r) for r in (f.rank if isinstance(f.rank, list) else [f.rank])]
    named += [(key, getattr(f, key)) for key in FAULT_RANK_KEYS]
    for key, r in named:
        if r is not None and r >= world_size:
            raise ConfigError(f"config: fault.{key}={r} is not a rank of this job: it trains on {world_size} rank(s), "
                              f"0-{world_size - 1}")


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
        from .checkpoint import CheckpointConfig
        if not cfg.checkpoint.enabled:
            raise ConfigError(f"config: fault.at={f.at} strikes in a checkpoint's save: it needs checkpoint.enabled")
        c = CheckpointConfig(cfg.checkpoint.save_checkpoint_steps, cfg.checkpoint.save_checkpoint_epochs)  # the saver's
        other = next((s for s in steps if s != last and not c.due(s, steps_per_epoch)), None)  # (the last: saved too)
        if other is not None:
            how = (f"every {c.save_checkpoint_steps} steps" if c.save_checkpoint_steps else
                   f"every {c.save_checkpoint_epochs} epoch(s) of {steps_per_epoch} steps")
            raise ConfigError(f"config: fault.step={other} saves no checkpoint (this run saves {how} and at its last "
                              f"step, {last}): a fault at {f.at} would never strike")


MAX_WIDTH = 1 << 16  # a wider layer would not fit in memory on any machine dsim runs on


def _need(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise ConfigError(f"config: {key} must be {allowed}, got {value!r}")


def ranges(cfg: Config) -> None:
    """Ranges and allowed values of the keys the type checks leave open (one line naming key, value, allowed)."""
    _need(0 <= cfg.seed < 2**32, "seed", "in [0, 2**32)", cfg.seed)
    o = cfg.optimizer
    _need(o.learning_rate > 0, "optimizer.learning_rate", "> 0", o.learning_rate)
    for key in ("momentum", "beta1", "beta2"):
        _need(0 <= getattr(o, key) < 1, f"optimizer.{key}", "in [0, 1)", getattr(o, key))
    _need(o.eps > 0, "optimizer.eps", "> 0", o.eps)
    _need(o.weight_decay >= 0, "optimizer.weight_decay", ">= 0", o.weight_decay)
    from .optim.schedule import LRSchedule
    s = o.schedule
    _need(s.name in LRSchedule.NAMES, "optimizer.schedule.name", f"one of {', '.join(LRSchedule.NAMES)}", s.name)
    _need(s.warmup_steps >= 0, "optimizer.schedule.warmup_steps", ">= 0", s.warmup_steps)
    _need(s.decay_steps >= 1, "optimizer.schedule.decay_steps", ">= 1", s.decay_steps)
    _need(s.decay_rate > 0, "optimizer.schedule.decay_rate", "> 0", s.decay_rate)
    _need(s.min_lr >= 0, "optimizer.schedule.min_lr", ">= 0", s.min_lr)
    h = cfg.model.hidden
    if h is not None:
        _need(len(h) >= 1, "model.hidden", "a list of one or more widths", h)
        _need(all(w <= MAX_WIDTH for w in h), "model.hidden", f"widths <= {MAX_WIDTH}", h)
    p = cfg.parallel
    for key in ("data_parallel", "model_parallel", "optimizer_shard", "pipeline_stage", "micro_batch_num"):
        value = getattr(p, key, None)
        if value is not None:
            _need(isinstance(value, int) and value >= 1, f"parallel.{key}", "an integer >= 1", value)
    from .parallel.pipeline import SCHEDULES
    _need(p.pipeline_schedule in SCHEDULES, "parallel.pipeline_schedule", f"one of {', '.join(SCHEDULES)}",
          p.pipeline_schedule)
    _need(p.micro_batch_num >= p.pipeline_stage, "parallel.micro_batch_num",
          f">= parallel.pipeline_stage={p.pipeline_stage} (MindSpore requires micro_batch_num >= pipeline stages)",
          p.micro_batch_num)
    c = cfg.checkpoint
    prefix_ok = bool(c.prefix) and c.prefix not in (".", "..") and not any(ch in c.prefix for ch in "/\\\0")
    _need(prefix_ok, "checkpoint.prefix", "a plain file name (no '/')", c.prefix)
    if c.group_info_file is not None:
        _need(bool(c.group_info_file.strip()), "checkpoint.group_info_file", "a path or null", c.group_info_file)
    for key in ("directory", "path"):
        value = getattr(c if key == "directory" else cfg.data, key)
        _need(value is None or (value and "\0" not in value), f"{'checkpoint' if key == 'directory' else 'data'}.{key}",
              "a path or null", value)
    _need(bool(cfg.output.dir) and "\0" not in cfg.output.dir, "output.dir", "a path", cfg.output.dir)
    if c.enabled:
        from .checkpoint import CheckpointConfig, CheckpointError
        try:
            CheckpointConfig(c.save_checkpoint_steps, c.save_checkpoint_epochs, c.keep_checkpoint_max,
                             c.integrated_save, c.append_info, c.async_save, c.async_staging)
        except CheckpointError as e:
            raise ConfigError(f"config: {e}") from None

