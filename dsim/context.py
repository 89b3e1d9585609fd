"""The parallel context of a user's script: MPI world, layout, seed and dtype (MindSpore's init / set_context).

    import dsim
    dsim.set_auto_parallel_context(data_parallel=2, model_parallel=4)   # before or after init()
    dsim.init()                                                          # mindspore.communication.init()
    rank, size = dsim.get_rank(), dsim.get_group_size()

One context per process. `Model.build` reads it to make this rank's slices of the network; `python -m
dsim.train` fills it from the config's `parallel`, `seed` and `dtype`, so both ways are wired alike.
`init()` also makes an exception that ends the script one line per rank (traceback in the run's logs/)
and ends the process without MPI_Finalize, so the other ranks see it go instead of waiting for it.
"""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field

import numpy as np

from .log import leave
from .parallel.layout import LayoutError, ParallelLayout


@dataclass
class Context:
    """What every rank of a job agrees on before building: the world and how it is cut."""

    comm: object = None                  # the world communicator (MPI.COMM_WORLD after init())
    data_parallel: object = None         # None: world size / model_parallel
    model_parallel: int = 1
    optimizer_shard: int = 1             # MindSpore's optimizer_weight_shard_size
    pipeline_stage: int = 1              # p stages of dp x mp ranks (MindSpore's pipeline_stages)
    micro_batch_num: int = 1             # micro-batches per step (MindSpore's PipelineCell(net, micro_batch_num))
    pipeline_schedule: str = "1f1b"      # 1f1b | gpipe
    vocab_emb_dp: bool = True            # the transformer's word embeddings whole on every rank
    seed: int = 1
    dtype: np.dtype = field(default_factory=lambda: np.dtype("float32"))
    output_dir: str = "."                # where logs/ (tracebacks) and metrics go

    def layout(self) -> ParallelLayout:
        """The layout on this world (raises LayoutError naming the numbers when it does not fit)."""
        return fit_layout(self.comm.size, self.data_parallel, self.model_parallel, self.optimizer_shard,
                          self.pipeline_stage)


def fit_layout(world_size: int, data_parallel, model_parallel: int, optimizer_shard: int,
               pipeline_stage: int = 1) -> ParallelLayout:
    """p stages of dp x mp on world_size ranks (data_parallel None: the rest of the world); LayoutError when it
    does not fit."""
    dp = data_parallel
    if dp is None:
        per_stage = model_parallel * pipeline_stage
        if world_size % per_stage:
            what = (f"pipeline_stage={pipeline_stage} x model_parallel={model_parallel} = {per_stage}"
                    if pipeline_stage > 1 else f"model_parallel={model_parallel}")
            raise LayoutError(f"layout: {what} does not divide the world size {world_size}")
        dp = world_size // per_stage
    layout = ParallelLayout(dp, model_parallel, optimizer_shard, pipeline_stage)
    layout.check_world_size(world_size)
    return layout


_context = Context()


def get_context() -> Context:
    """The process's context (init() first when the world is needed)."""
    return _context


def init(comm=None) -> Context:
    """Join the job's world (MPI.COMM_WORLD, or comm) as mindspore.communication.init() does; idempotent."""
    if comm is None:
        from . import guard
        guard.start_mpi()
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    _context.comm = comm
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _one_line_per_rank
    return _context


def use(comm, **fields) -> Context:
    """Set the whole context at once, without init()'s exception hook (the CLI's builder, from its config)."""
    _context.comm = comm
    for key, value in fields.items():
        if not hasattr(_context, key):
            raise AttributeError(f"the context has no {key!r}")
        setattr(_context, key, np.dtype(value) if key == "dtype" else value)
    return _context


def get_rank() -> int:
    """This process's rank in the world."""
    return _world().rank


def get_group_size() -> int:
    """The number of ranks in the world."""
    return _world().size


def _world():
    return (_context.comm if _context.comm is not None else init().comm)


def set_auto_parallel_context(data_parallel=None, model_parallel=None, optimizer_shard=None, vocab_emb_dp=None,
                              pipeline_stages=None, micro_batch_num=None, pipeline_schedule=None,
                              optimizer_weight_shard_size=None) -> None:
    """The layout: pipeline_stages x data_parallel x model_parallel ranks (data_parallel None: the rest of the
    world), optimizer_shard (or MindSpore's optimizer_weight_shard_size) ranks sharing the optimizer state,
    micro_batch_num micro-batches per step in the pipeline_schedule ("1f1b" or "gpipe")."""
    if optimizer_weight_shard_size is not None:
        optimizer_shard = optimizer_weight_shard_size
    for key, value in (("data_parallel", data_parallel), ("model_parallel", model_parallel),
                       ("optimizer_shard", optimizer_shard), ("vocab_emb_dp", vocab_emb_dp),
                       ("pipeline_stage", pipeline_stages), ("micro_batch_num", micro_batch_num),
                       ("pipeline_schedule", pipeline_schedule)):
        if value is not None:
            setattr(_context, key, value)
    if data_parallel is None and (model_parallel is not None or pipeline_stages is not None):
        _context.data_parallel = None


def set_seed(seed: int) -> None:
    """The seed every random state derives from: initial weights (per parameter name), data, shuffling."""
    if not (isinstance(seed, int) and 0 <= seed < 2 ** 32):
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    _context.seed = seed


def set_context(dtype=None, output_dir=None) -> None:
    """dtype of parameters and data (float32 or float64); output_dir: where logs/ and metrics.jsonl go."""
    if dtype is not None:
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
        _context.dtype = dt
    if output_dir is not None:
        _context.output_dir = str(output_dir)


def _one_line_per_rank(kind, exc, tb):
    """sys.excepthook after init(): `dsim: error: rank R: <message>` and the traceback in <output_dir>/logs/."""
    from . import guard
    rank = _context.comm.rank if _context.comm is not None else guard.rank()
    guard.set_run_dir(_context.output_dir)
    path = guard.keep_traceback(rank, "".join(traceback.format_exception(kind, exc, tb)))
    if os.environ.get("DSIM_DEBUG") == "1":
        traceback.print_exception(kind, exc, tb)
    name = "" if kind in (Exception, RuntimeError) else f"{kind.__name__}: "
    print(f"dsim: error: rank {rank}: {name}{guard.one_line(exc)} (traceback in {path})", file=sys.stderr, flush=True)
    leave(1)  # not MPI_Finalize: a rank that failed alone must look dead to the others
