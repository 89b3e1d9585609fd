"""A seed model (LeNet5, the Transformer) in dsim and in torch, in one job: time per step, the update's share.

    $ mpirun -n 4 python -m bench.seed_torch_ranks --config configs/lenet5.yaml --set parallel.data_parallel=4 \\
          --set parallel.model_parallel=1 --steps 20 --repeats 3 --torch --dir /tmp/b --out r.json

Every repeat trains dsim (the config's model, batch and optimizer; no checkpoints) and the same model in torch
(bench.torch_peers: one thread per rank, DistributedDataParallel on gloo over several ranks) on this rank's
first batch of dsim's loader, in a rotating order. Time per step leaves out the first two steps; each
framework's optimizer update is timed inside its steps as well, and dsim's drawing of its batches (torch
reuses one). --parts also times, in one process, the layers
whose kernels numpy cannot match alone (LeNet5's convolutions and poolings: forward and backward of dsim's
beside torch's on the same input) -- what bounds dsim's step beside torch's.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
from mpi4py import MPI

from dsim.build import build_run
from dsim.config import load_config
from dsim.engine.callbacks import Callback
from dsim.nn.conv import Conv2d, MaxPool2d

from .ranks import WARMUP, StepClock, free_port, per_step, rotated, side_by_side, timed_call, worker_parser

ROOT = Path(__file__).resolve().parents[1]


def dsim_once(comm, cfg) -> dict:
    gc.collect()
    run = build_run(cfg, comm)
    clock, upd, data, counted = StepClock(), {"s": 0.0}, {"s": 0.0}, {}
    run.optimizer.apply = timed_call(run.optimizer.apply, upd)
    run.loader.source.get = timed_call(run.loader.source.get, data)   # drawing the synthetic batch

    class Mark(Callback):  # the update's and the batches' time over the measured steps only
        def step_end(self, run_context):
            if len(clock.ends) == WARMUP + 1:
                counted.update(start=upd["s"], data_start=data["s"])
    comm.Barrier()
    run.model.train(cfg.train.epochs, run.loader, run.callbacks([clock, Mark()]))
    comm.Barrier()
    run.groups.free()
    steps = len(clock.ends) - 1 - WARMUP
    return {"step_s": clock.step_s(), "update_s": (upd["s"] - counted["start"]) / steps,
            "data_s": (data["s"] - counted["data_start"]) / steps}


def torch_once(comm, cfg, batch, steps: int, port: int) -> dict:
    from . import torch_peers
    net = torch_peers.peer(cfg)
    opt = torch_peers.optimizer(cfg, net.named_parameters())
    t = torch_peers.train(comm, torch_peers.data_parallel(comm, net, port), opt, batch, steps)
    return {"step_s": per_step(t["ends"]), "update_s": sum(t["updates"][WARMUP + 1:]) / (steps - 1 - WARMUP)}


def first_batch(comm, cfg):
    """This rank's first batch of dsim's loader: (inputs, labels)."""
    run = build_run(cfg, comm)
    _, _, inputs, labels = next(run.loader.batches(1))
    run.groups.free()
    return inputs, labels


def layer_parts(comm, cfg, with_torch: bool) -> dict:
    """Seconds of forward + backward of each convolution and pooling of the network alone, dsim's beside
    torch's (conv2d with the same weight, max_pool2d; the same input and output gradient; the first layer's input
    gradient left out, as in the step), medians of 20 calls made in turn, keyed by the layer's place in the
    network."""
    run = build_run(cfg, comm)
    _, _, x, _ = next(run.loader.batches(1))
    mp, out = run.groups.mp, {}
    for i, layer in enumerate(run.network.layers):
        y = layer.forward(x, mp)
        if isinstance(layer, (Conv2d, MaxPool2d)):
            dy = np.random.default_rng(i).standard_normal(y.shape).astype(y.dtype)
            need_dx = i > 0   # as in the step: the first layer's input needs no gradient
            calls = {"dsim": lambda layer=layer, x=x, dy=dy, need_dx=need_dx: (layer.forward(x, mp),
                                                                                layer.backward(dy, mp, need_dx))}
            if with_torch:
                calls["torch"] = torch_layer(layer, x, dy, need_dx)
            out[f"{i}: {layer!r}"] = side_by_side(comm, calls, 21)
        x = y
    run.groups.free()
    return out


def torch_layer(layer, x, dy, need_dx=True):
    """torch's forward and backward (the input's gradient unless need_dx is false, and the weight's) of a dsim
    Conv2d or MaxPool2d on these arrays, as a call."""
    import torch
    import torch.nn.functional as F
    xt, dyt = torch.from_numpy(x).requires_grad_(need_dx or not isinstance(layer, Conv2d)), torch.from_numpy(dy)
    if isinstance(layer, Conv2d):
        wt = torch.from_numpy(layer.params[0].data.copy()).requires_grad_()
        forward = lambda: F.conv2d(xt, wt)  # noqa: E731
    else:
        wt, forward = xt, lambda: F.max_pool2d(xt, layer.k)  # noqa: E731

    def call():
        xt.grad = wt.grad = None
        forward().backward(dyt)
    return call


def main(argv=None):
    ap = worker_parser("bench.seed_torch_ranks", __doc__, steps=20)
    ap.add_argument("--parts", action="store_true", help="time the convolutions and poolings alone, dsim's and torch's")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    steps = args.steps
    cfg = load_config(args.config, [*args.overrides, "checkpoint.enabled=false", "train.epochs=1",
                                    f"train.steps_per_epoch={steps}", "output.progress_bar=false",
                                    f"output.loss_every={steps}", f"output.dir={args.dir}"])
    if args.torch:
        import torch
        torch.set_num_threads(1)
    port = free_port(comm) if args.torch else 0
    batch = first_batch(comm, cfg) if args.torch else None
    frameworks = ["dsim", "torch"] if args.torch else ["dsim"]
    repeats = []
    for rep in range(args.repeats):
        out = {"order": rotated(frameworks, rep)}
        for name in out["order"]:
            out[name] = dsim_once(comm, cfg) if name == "dsim" else torch_once(comm, cfg, batch, steps, port)
        per_rank = comm.gather(out)
        if comm.rank == 0:
            repeats.append({"ranks": per_rank})
            print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{n} {1000 * out[n]['step_s']:.2f} ms/step"
                                                              for n in frameworks), flush=True)
    parts = layer_parts(comm, cfg, args.torch) if args.parts else None
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": comm.size, "config": args.config, "overrides": args.overrides,
                                              "repeats": repeats, "parts": parts}, indent=1))


if __name__ == "__main__":
    main()
