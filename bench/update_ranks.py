"""dsim's optimizer update beside torch's optimizer.step() on the same parameters, in one process.

    $ mpirun -n 1 python -m bench.update_ranks --optimizers momentum,adam,adamweightdecay --torch --out r.json

For each optimizer the default run's model (configs/default.yaml, one process: every parameter whole) is built
and trained one step, so every gradient is there; then dsim's Optimizer.apply() and torch's optimizer.step()
(bench.torch_peers.optimizer: SGD with momentum, Adam, AdamW, one thread; torch's default implementation and its
fused one) on copies of the same parameters and gradients are called in turn, the order rotating each round.
The figures are medians of --calls calls, --repeats times. Without --torch only dsim's update is timed.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

from mpi4py import MPI

from dsim.build import build_run
from dsim.config import load_config

from .ranks import side_by_side

ROOT = Path(__file__).resolve().parents[1]
DECAY = {"adamweightdecay": ["optimizer.weight_decay=0.1"]}   # the Transformer's: the decay group's work is in


def torch_step(cfg, params, fused=None):
    """torch's optimizer.step() on copies of these dsim parameters and their gradients, as a call (fused: its
    fused implementation; None: its default)."""
    import torch
    from . import torch_peers
    torch.set_num_threads(1)
    named = []
    for p in params:
        t = torch.from_numpy(p.data.copy())
        t.grad = torch.from_numpy(p.grad.copy())
        named.append((p.name, t))
    return torch_peers.optimizer(cfg, named, fused).step


def once(comm, config, overrides, name: str, calls: int, repeats: int, with_torch: bool) -> dict:
    """{framework: [median seconds of `calls` calls, per repeat]}, the frameworks taking turns."""
    cfg = load_config(config, [*overrides, f"optimizer.name={name}", *DECAY.get(name, []),
                               "parallel.data_parallel=1", "parallel.model_parallel=1", "parallel.optimizer_shard=1",
                               "checkpoint.enabled=false", "train.epochs=1", "train.steps_per_epoch=1",
                               "output.progress_bar=false", "output.dir=/tmp"])
    gc.collect()
    run = build_run(cfg, comm)
    run.model.train(1, run.loader, run.callbacks([]))   # the gradients of a step
    params = run.network.trainable_params()
    timed = {"dsim": run.optimizer.apply}
    if with_torch:
        timed.update(torch=torch_step(cfg, params), torch_fused=torch_step(cfg, params, fused=True))
    medians = [side_by_side(comm, timed, calls) for _ in range(repeats)]
    out = {k: [m[k] for m in medians] for k in timed}
    out["parameters"] = sum(p.data.size for p in params)
    run.groups.free()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.update_ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--optimizers", default="momentum,adam,adamweightdecay")
    ap.add_argument("--calls", type=int, default=5, help="calls of each update per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", action="store_true", help="time torch's optimizer.step() beside dsim's update")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", help="unused: every worker of bench gets one")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    result = {name: once(comm, args.config, args.overrides, name, args.calls, args.repeats, args.torch)
              for name in args.optimizers.split(",")}
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"overrides": args.overrides, "optimizers": result}, indent=1))


if __name__ == "__main__":
    main()
