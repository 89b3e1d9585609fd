"""The run's time per step and the bytes each host sent to the others, on the hosts of a cluster (bench.cluster).

    $ python -m dsim.cluster run --hosts 2 --slots 4 -- mpirun --hostfile /var/tmp/dsim-cluster/dsim/hostfile \\
          --map-by slot -n 8 python -m bench.cluster_ranks --steps 6 --dir /tmp/r --out /tmp/r.json

Trains the config (default: configs/default.yaml; no checkpoints, global batch 32) as `python -m dsim.train` does, with
the standard callbacks. The time per step is bench.training_ranks': (end of training - end of the first step) /
(steps - 1). At the end of the first step and at the end of training, after a barrier, each rank reads the bytes its
host's interfaces (all but lo) have sent and received, from /proc/net/dev, which shows the network namespace of the
process that reads it: its host's. The first rank of each host gives the host's counters; rank 0 writes them, with
each rank's host name.
"""
from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

from mpi4py import MPI

from dsim.build import build_run
from dsim.config import load_config
from dsim.engine.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


def net_bytes() -> dict:
    """{"tx": bytes sent, "rx": bytes received} over this network namespace's interfaces but lo."""
    tx = rx = 0
    with open("/proc/net/dev") as fh:
        for line in fh.readlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() != "lo":
                values = fields.split()
                rx, tx = rx + int(values[0]), tx + int(values[8])
    return {"tx": tx, "rx": rx}


class Meter(Callback):
    """The host's counters and perf_counter at the end of the first step, once every rank has ended it (a barrier:
    no host has begun the next step's sums when the others read theirs), perf_counter at the end of every step,
    and both at the end of training."""

    def __init__(self, comm):
        self.comm, self.ends, self.first, self.last, self.finished = comm, [], None, None, None

    def step_end(self, run_context):
        if self.first is None:
            self.comm.Barrier()
            self.first = net_bytes()
        self.ends.append(time.perf_counter())

    def end(self, run_context):
        self.finished = time.perf_counter()
        self.comm.Barrier()
        self.last = net_bytes()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    cfg = load_config(args.config, [*args.overrides, "train.epochs=1", f"train.steps_per_epoch={args.steps}",
                                    f"data.num_samples={args.steps * 32}", "data.batch_size=32",
                                    "checkpoint.enabled=false", "output.progress_bar=false",
                                    f"output.loss_every={args.steps}", f"output.dir={args.dir}"])
    run = build_run(cfg, comm)
    meter = Meter(comm)
    callbacks = run.callbacks([meter])
    comm.Barrier()
    run.model.train(cfg.train.epochs, run.loader, callbacks)
    comm.Barrier()
    run.groups.free()
    hosts = comm.gather(socket.gethostname())
    counters = comm.gather((meter.first, meter.last))
    if comm.rank == 0:
        per_host = {}
        for host, (first, last) in zip(hosts, counters):
            per_host.setdefault(host, {"tx": last["tx"] - first["tx"], "rx": last["rx"] - first["rx"]})
        steps = len(meter.ends)
        Path(args.out).write_text(json.dumps({
            "ranks": comm.size, "hosts": hosts, "steps": steps,
            "step_s": (meter.finished - meter.ends[0]) / (steps - 1),
            "bytes": per_host, "measured_steps": steps - 1}, indent=1))


if __name__ == "__main__":
    main()
