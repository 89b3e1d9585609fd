"""One layout's training step, dsim beside torch, in one job: time per step, where it goes, peak memory.

    $ mpirun -n 4 python -m bench.step_ranks --set parallel.data_parallel=4 --set parallel.model_parallel=1 \\
          --steps 10 --repeats 3 --dir /tmp/b --out r.json

Every repeat trains dsim (the default run's model, batch and optimizer; no checkpoints) and, on a pure
data-parallel layout, the same model in torch (bench.torch_peers: nn.Linear layers, the same widths, SGD with
momentum; torch.set_num_threads(1) as every dsim rank has one BLAS thread; DistributedDataParallel on gloo over
the same ranks when there are several), in a rotating order (dsim first in the first repeat: its memory). Time per step leaves out the first two steps (warm-up).

dsim's step is split, per rank, into
- collectives: time inside MPI calls during the steps (the communicators are wrapped by a timer), and
  inside the mp group's sums through shared memory where it has them (dsim.parallel.shared);
- matrix products: every Dense layer's products of one step (forward x @ W, the weight gradient, the
  input gradient) on this rank's slice shapes, timed alone in the same process (a floor);
- the optimizer update (elementwise, in place; bound by memory bandwidth), timed in the step;
- the rest: step - collectives - matrix products (the update, other elementwise work, Python, waiting).
torch's optimizer.step() is timed on its own too: the same update (SGD with momentum on the same parameters)
in another framework, beside dsim's step, shows how much of the rest no in-place update can avoid.
Bandwidth of the data-parallel gradient reduction is compared with a raw mpi4py Allreduce of the same
bytes, and the model-parallel activation all-reduce with a raw Allreduce of the same bytes.
Peak RSS is measured over training only (VmHWM, reset after the build), in the first repeat (a fresh
process), beside the bytes of this rank's parameters, gradients and optimizer state. RSS counts every page
of the shared libraries in every rank of the node; PSS divides each shared page among the processes that
map it. The kernel keeps no peak PSS, so the peak is estimated as peak RSS less the pages RSS counts over PSS
at the end of training (RSS - PSS, from /proc/self/smaps_rollup; the shared pages no longer change then).
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dsim.config import load_config
from dsim.build import build_run
from dsim.engine.callbacks import Callback
from dsim.nn.layers import Dense
from dsim.parallel import shared
from dsim.parallel.groups import allreduce_sum, sum_chunks

from .ranks import (WARMUP, StepClock, free_port, median_time, peak_rss, per_step, reset_peak_rss, rotated,
                    shared_overcount, side_by_side, status, timed_call, worker_parser)

ROOT = Path(__file__).resolve().parents[1]
TIMED = {"Alltoallv", "Allgatherv", "Allgather", "Allreduce", "Alltoall", "allreduce", "allgather", "Bcast"}


class TimedComm:
    """A communicator whose collectives add their time to a shared counter (per step, after warm-up)."""

    def __init__(self, comm, clock: dict):
        self._comm, self._clock = comm, clock

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in TIMED:
            return attr
        return timed_call(attr, self._clock)


def matmul_floor(network, local_batch: int) -> float:
    """Seconds of one step's Dense products on this rank's slices, timed alone."""
    total = 0.0
    dense = [layer for layer in network.layers if isinstance(layer, Dense)]
    for i, layer in enumerate(dense):
        w = layer.params[0].data
        wio = w if layer.kind == "matmul" else w.T          # (in, out) as forward uses it
        x = np.random.default_rng(i).standard_normal((local_batch, wio.shape[0])).astype(w.dtype)
        dy = np.random.default_rng(i + 100).standard_normal((local_batch, wio.shape[1])).astype(w.dtype)
        grad = np.empty_like(w)
        total += median_time(lambda: x @ wio)
        if layer.kind == "matmul":
            total += median_time(lambda: np.matmul(x.T, dy, out=grad))
        else:
            total += median_time(lambda: np.matmul(dy.T, x, out=grad))
        if i > 0:
            total += median_time(lambda: dy @ wio.T)
    return total


BASELINE_RSS = status("VmRSS")  # the interpreter with numpy, mpi4py, h5py and dsim imported, before any run


def dsim_once(comm, cfg, memory: bool) -> dict:
    """memory: report peak RSS (the first repeat only, before torch or an earlier run has used memory)."""
    gc.collect()
    run = build_run(cfg, comm)
    state_bytes = sum(2 * p.data.nbytes for p in run.network.trainable_params())  # parameters and gradients
    state_bytes += sum(arr.nbytes for _, _, arr in run.optimizer.state_items())
    clock, coll, upd = StepClock(), {"s": 0.0}, {"s": 0.0}
    g = run.groups
    mp_shared = shared.of(g.mp)
    g.dp, g.mp, g.shard = (TimedComm(c, coll) for c in (g.dp, g.mp, g.shard))
    if mp_shared is not None:   # sums through shared memory are collectives too (their barriers go to the
        mp_shared.sum = timed_call(mp_shared.sum, coll)   # communicator itself, not through the timer)
    run.optimizer.apply = timed_call(run.optimizer.apply, upd)
    counted = {}

    class Mark(Callback):  # collective and update time of the measured steps only
        def step_end(self, run_context):
            if len(clock.ends) == WARMUP + 1:
                counted.update(start=coll["s"], update_start=upd["s"])
    comm.Barrier()
    reset_peak_rss()
    run.model.train(cfg.train.epochs, run.loader, run.callbacks([clock, Mark()]))
    rss, overcount = peak_rss(), shared_overcount()
    comm.Barrier()
    ends = clock.ends
    steps = len(ends) - 1 - WARMUP
    step_s = clock.step_s()
    coll_s = (coll["s"] - counted["start"]) / steps
    update_s = (upd["s"] - counted["update_start"]) / steps
    layout = g.layout
    mm_s = matmul_floor(run.network, cfg.data.batch_size // layout.data_parallel)
    bw = bandwidth(run, g)
    g.dp, g.mp, g.shard = g.dp._comm, g.mp._comm, g.shard._comm
    g.free()
    return {"step_s": step_s, "collectives_s": coll_s, "matmul_s": mm_s, "update_s": update_s,
            **({"peak_rss": rss, "baseline_rss": BASELINE_RSS, "shared_overcount": overcount} if memory else {}),
            "state_bytes": state_bytes, **bw}


def bandwidth(run, g) -> dict:
    """dsim's reductions beside raw mpi4py Allreduce calls on the same bytes (seconds, medians). Where the mp
    group sums through shared memory (dsim.parallel.shared), dsim's MPI path is timed beside them too."""
    out = {}
    dp, mp = g.dp._comm, g.mp._comm
    if dp.size > 1:
        buckets = run.model.buckets
        raw = np.ones_like(buckets.flat)
        calls = {"dp_dsim_s": lambda: buckets.allreduce(dp), "dp_raw_s": lambda: dp.Allreduce(MPI.IN_PLACE, raw)}
        out.update(side_by_side(g.world, calls, 5), dp_bytes=buckets.flat.nbytes)
    if mp.size > 1:
        widest = max(layer.out_features for layer in run.network.layers if isinstance(layer, Dense))
        act = np.ones((run.model.global_batch_size // run.groups.layout.data_parallel, widest), dtype=np.float32)
        raw = act.copy()
        calls = {"mp_dsim_s": lambda: allreduce_sum(mp, act, inplace=True),   # as the layers call it
                 "mp_raw_s": lambda: mp.Allreduce(MPI.IN_PLACE, raw)}
        if shared.of(mp) is not None:
            flat, receive = act.reshape(-1), np.empty(act.size, act.dtype)
            calls["mp_mpi_s"] = lambda: sum_chunks(mp, flat, flat, lambda n: receive[:n])
        out.update(side_by_side(g.world, calls, 41), mp_bytes=act.nbytes)
    return out


def torch_once(comm, cfg, steps: int, port: int) -> dict:
    from . import torch_peers
    net = torch_peers.peer(cfg)
    opt = torch_peers.optimizer(cfg, net.named_parameters())
    local = cfg.data.batch_size // comm.size
    rng = np.random.default_rng(cfg.seed)
    batch = (rng.standard_normal((local, 28 * 28)).astype(cfg.dtype), rng.integers(0, 10, local))
    t = torch_peers.train(comm, torch_peers.data_parallel(comm, net, port), opt, batch, steps)
    return {"step_s": per_step(t["ends"]),   # and the update's time over the same steps
            "update_s": sum(t["updates"][WARMUP + 1:]) / (steps - 1 - WARMUP)}


def main(argv=None):
    default = str(ROOT / "configs" / "default.yaml")
    args = worker_parser("bench.step_ranks", __doc__, steps=10, config=default).parse_args(argv)
    comm = MPI.COMM_WORLD
    steps = args.steps
    cfg = load_config(args.config, [*args.overrides, "checkpoint.enabled=false", "train.epochs=1",
                                    f"train.steps_per_epoch={steps}", f"data.num_samples={steps * 32}",
                                    "data.batch_size=32", "output.progress_bar=false", f"output.loss_every={steps}",
                                    f"output.dir={args.dir}"])
    port = free_port(comm) if args.torch else 0
    repeats = []
    for rep in range(args.repeats):
        out = {}
        for name in rotated(["dsim", "torch"] if args.torch else ["dsim"], rep):  # dsim first in the first repeat
            out[name] = dsim_once(comm, cfg, memory=rep == 0) if name == "dsim" else torch_once(comm, cfg, steps, port)
        per_rank = comm.gather(out)
        if comm.rank == 0:
            repeats.append({"ranks": per_rank})
            t = f", torch {1000 * out['torch']['step_s']:.1f} ms/step" if args.torch else ""
            print(f"repeat {rep + 1}/{args.repeats}: dsim {1000 * out['dsim']['step_s']:.1f} ms/step{t}", flush=True)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": comm.size, "overrides": args.overrides, "repeats": repeats},
                                             indent=1))


if __name__ == "__main__":
    main()
