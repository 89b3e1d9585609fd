"""One layout's training step, dsim beside torch, in one job: time per step, where it goes, peak memory.

    $ mpirun -n 4 python -m bench.step_ranks --set parallel.data_parallel=4 --set parallel.model_parallel=1 \\
          --steps 10 --repeats 3 --dir /tmp/b --out r.json

Every repeat trains dsim (the default run's model, batch and optimizer; no checkpoints), then, on a pure
data-parallel layout, the same model in torch (nn.Linear layers, the same widths, SGD with momentum;
torch.set_num_threads(1) as every dsim rank has one BLAS thread; DistributedDataParallel on gloo over
the same ranks when there are several). Time per step leaves out the first two steps (warm-up).

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

import argparse
import gc
import json
import socket
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dsim.config import load_config
from dsim.build import build_run
from dsim.engine.callbacks import Callback
from dsim.nn.layers import Dense
from dsim.nn.network import ARCHITECTURES
from dsim.parallel import shared
from dsim.parallel.groups import allreduce_sum, sum_chunks

ROOT = Path(__file__).resolve().parents[1]
TIMED = {"Alltoallv", "Allgatherv", "Allgather", "Allreduce", "Alltoall", "allreduce", "allgather", "Bcast"}
WARMUP = 2


class StepClock(Callback):
    def __init__(self):
        self.ends = []

    def step_end(self, run_context):
        self.ends.append(time.perf_counter())


class TimedComm:
    """A communicator whose collectives add their time to a shared counter (per step, after warm-up)."""

    def __init__(self, comm, clock: dict):
        self._comm, self._clock = comm, clock

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in TIMED:
            return attr
        return timed_call(attr, self._clock)


def timed_call(fn, clock: dict):
    """fn, adding the time of every call to clock["s"]."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock["s"] += time.perf_counter() - t
    return timed


def median_time(fn, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


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


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _kib(path: str, *keys) -> list:
    """The values of `Key:   N kB` lines of a /proc file, in bytes, read at one instant (0 for a key not there)."""
    found = {}
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            found[key] = int(value.split()[0]) * 1024
    return [found.get(k, 0) for k in keys]


def _status(key: str) -> int:
    return _kib("/proc/self/status", key)[0]


def peak_rss() -> int:
    return _status("VmHWM")


def shared_overcount() -> int:
    """RSS - PSS now: what RSS counts of pages shared with other processes beyond this process's share."""
    rss, pss = _kib("/proc/self/smaps_rollup", "Rss", "Pss")
    return rss - pss


BASELINE_RSS = _status("VmRSS")  # the interpreter with numpy, mpi4py, h5py and dsim imported, before any run


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
    apply = run.optimizer.apply

    def timed_apply(*args, **kwargs):
        t = time.perf_counter()
        apply(*args, **kwargs)
        upd["s"] += time.perf_counter() - t
    run.optimizer.apply = timed_apply
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
    step_s = (ends[-1] - ends[WARMUP]) / steps
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


def side_by_side(world, calls: dict, repeats: int) -> dict:
    """Median seconds of each call, made in turn (the order rotating each round), every rank of the job
    starting each call together: every group does the same at the same time, on a shared machine too."""
    names, times = list(calls), {name: [] for name in calls}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            world.Barrier()
            t = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(t)) for name, t in times.items()}


def torch_once(comm, cfg, steps: int, port: int) -> dict:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dp = comm.size
    if dp > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=dp)
    torch.manual_seed(cfg.seed)
    widths = [28 * 28, *(cfg.model.hidden or ARCHITECTURES[cfg.model.name]), 10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1], bias=i > 0))  # layer1 is a MatMulCell: no bias
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers)
    model = torch.nn.parallel.DistributedDataParallel(net) if dp > 1 else net
    opt = torch.optim.SGD(net.parameters(), lr=cfg.optimizer.learning_rate, momentum=cfg.optimizer.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    local = cfg.data.batch_size // dp
    x = torch.randn(local, widths[0])
    y = torch.randint(0, 10, (local,))
    comm.Barrier()
    ends, updates = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
        t = time.perf_counter()
        opt.step()
        ends.append(time.perf_counter())
        updates.append(ends[-1] - t)
    comm.Barrier()
    return {"step_s": (ends[-1] - ends[WARMUP]) / (len(ends) - 1 - WARMUP),
            "update_s": sum(updates[WARMUP + 1:]) / (len(ends) - 1 - WARMUP)}  # the same steps


def free_port(comm) -> int:
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.bcast(port)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.step_ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", action="store_true", help="train the same model in torch beside dsim")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    steps = args.steps
    cfg = load_config(args.config, [*args.overrides, "checkpoint.enabled=false", "train.epochs=1",
                                    f"train.steps_per_epoch={steps}", f"data.num_samples={steps * 32}",
                                    "data.batch_size=32", "output.progress_bar=false", f"output.loss_every={steps}",
                                    f"output.dir={args.dir}"])
    port = free_port(comm) if args.torch else 0
    repeats = []
    for rep in range(args.repeats):
        out = {"dsim": dsim_once(comm, cfg, memory=rep == 0)}
        if args.torch:
            out["torch"] = torch_once(comm, cfg, steps, port)
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
