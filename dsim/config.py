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


@dataclass
class ParallelConfig:
    data_parallel: Optional[int] = None  # None: world size / model_parallel
    model_parallel: int = 4
    optimizer_shard: int = 1
    vocab_emb_dp: bool = True      # transformer: word embeddings whole on every rank (false: split over mp)
    pipeline_stage: int = 1        # p stages of dp x mp ranks each (MindSpore's pipeline_stages)
    micro_batch_num: int = 1       # micro-batches per step (MindSpore's PipelineCell(net, micro_batch_num)), >= p
    pipeline_schedule: str = "1f1b"  # 1f1b (MindSpore's) | gpipe (all forwards, then all backwards)


@dataclass
class TransformerConfig:
    """The distributed page's sample Transformer (its defaults)."""
    vocab_size: int = 20000
    d_model: int = 128
    num_heads: int = 8
    ffn_hidden_size: Optional[int] = None   # None: d_model, as the sample
    encoder_layers: int = 1
    decoder_layers: int = 1
    src_len: int = 10
    tgt_len: int = 10
    max_position: Optional[int] = None      # position table size; None: the longer of src_len, tgt_len


@dataclass
class ModelConfig:
    name: str = "network"          # network | uce_network | lenet5 | transformer
    hidden: Optional[list[int]] = None  # MLPs: override the hidden widths, e.g. [64, 128, 128, 64]
    transformer: TransformerConfig = field(default_factory=TransformerConfig)


@dataclass
class ScheduleConfig:
    name: str = "constant"         # constant | cosine | exponential
    warmup_steps: int = 0
    decay_steps: int = 1000
    decay_rate: float = 0.9
    min_lr: float = 0.0


@dataclass
class OptimizerConfig:
    name: str = "momentum"         # sgd | momentum | adam | adamweightdecay
    learning_rate: float = 0.02
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class DataConfig:
    name: str = "synthetic"        # synthetic | mnist (idx files) | translation (toy task) | text (pairs file)
    path: Optional[str] = None     # mnist: e.g. MNIST_Data/train; text: a file of source<TAB>target lines
    num_samples: int = 1920        # synthetic and translation (generated on demand)
    batch_size: int = 32           # the global batch, split over the data-parallel ranks
    shuffle: bool = True
    eval_samples: int = 0          # held-out samples (after the training ones; of a file, its last): accuracy per epoch


@dataclass
class TrainConfig:
    epochs: int = 2
    steps_per_epoch: Optional[int] = None  # cut epochs short (None: the whole dataset)


@dataclass
class CheckpointSection:
    enabled: bool = True
    prefix: str = "network"
    directory: Optional[str] = None          # default: <output.dir>/checkpoints
    save_checkpoint_steps: Optional[int] = None
    save_checkpoint_epochs: Optional[int] = 1
    keep_checkpoint_max: int = 5
    integrated_save: bool = False            # False: each rank saves only its own slices
    append_info: list[Any] = field(default_factory=lambda: ["epoch_num", "step_num"])
    group_info_file: Optional[str] = None    # also $GROUP_INFO_FILE; "{rank}" is replaced by the rank
    on_save_error: str = "stop"              # stop (exit 1) | continue (warn, retry at the next save)
    async_save: bool = False                 # write in a background thread from a snapshot; commit when all are durable
    async_staging: str = "memory"            # the snapshot: memory (a reused buffer) | page_cache (the file itself)
    save_on_signal: bool = False             # SIGUSR2 / SIGTERM: stop after a step all ranks agree on, saved (exit 128+sig)


@dataclass
class FaultConfig:
    kind: Optional[str] = None               # null (off) | exception | kill | uce (memory error) | hang | stuck | deadlock
                                             # | unmatched | slow | sdc | plan ($DSIM_FAULT_PLAN)
    rank: Any = None                         # null: every rank; or a rank, or a list of ranks
    last_gasp_kill: Optional[int] = None     # also kill this rank half-way through its last-gasp writes
    last_gasp_stuck: Optional[int] = None    # this rank's last-gasp write never returns (found by tft.hang_timeout)
    repair_kill: Optional[int] = None        # also kill this rank during a repair in the job (at repair_at)
    repair_hang: Optional[int] = None        # this rank freezes (SIGSTOP) during a repair in the job (at repair_at)
    repair_stuck: Optional[int] = None       # this rank's repair stops, its process runs (at repair_at; found stuck by
                                             # tft.hang_timeout's watch)
    repair_at: str = "refill"                # refill (the dead rank's place not filled yet) | exchange (filled)
    spare_hang: bool = False                 # the warm spares (tft.spares) freeze (SIGSTOP) as they begin to wait
    step: Any = None                         # global step (1-based); or one per rank of a rank list
    epoch: Optional[int] = None              # with at: epoch_end
    at: str = "step_end"                     # step_end | epoch_end | forward | allreduce | update | save | commit
    slowdown: float = 4.0                    # kind slow: from then on the rank computes this many times slower


@dataclass
class TFTConfig:
    """Fault tolerance (MindSpore's MS_ENABLE_TFT='{TTP:1,UCE:1,ARF:1}' sets the same switches)."""
    ttp: bool = False                        # last-gasp checkpoint from the survivors when a rank dies
    uce: bool = False                        # repair a rank's memory error in the job from a replica (implies ttp)
    uce_in_place: bool = True                # with uce, one found in a forward pass: only that rank repairs, the others go on
    arf: bool = False                        # replace a dead process in the job (respawn; implies ttp)
    spares: int = 0                          # warm spare processes started with the job (mpirun -n ranks + spares; implies arf)
    elastic: bool = False                    # no replacement for a dead rank: go on with fewer ranks (lower dp; implies ttp)
    hang_timeout: Optional[float] = None     # seconds a frozen or stuck rank is waited for, then killed (dsim.ft.hang)
    deadlock_timeout: Optional[float] = None  # seconds every rank may wait, none progressing, before it is broken
                                             # as deadlocked (default: 10 x hang_timeout; needs hang_timeout)
    straggler_factor: Optional[float] = None  # a rank computing its steps this many times slower than the median is a straggler
    straggler_evict: bool = False            # a straggler is killed, then as a dead rank (a spare takes its place)
    sdc_check_every: Optional[int] = None    # steps between two comparisons of the replicas (and before every save)
    sdc_rollback: bool = True                # corruption found: roll back in the job to the newest checkpoint (else stop)
    ckpt_save_path: Optional[str] = None     # default: <checkpoint dir>/ttp_checkpoints


@dataclass
class OutputConfig:
    dir: str = "runs/default"      # metrics.jsonl and (later) checkpoints go here
    progress_bar: bool = True
    loss_every: int = 10           # LossMonitor prints every N steps


@dataclass
class Config:
    seed: int = 1
    dtype: str = "float32"         # float32 | float64
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fault: FaultConfig = field(default_factory=FaultConfig)
    tft: TFTConfig = field(default_factory=TFTConfig)

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
