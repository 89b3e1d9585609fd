"""Training with and without checkpoints on every rank, in one job: the time per step of each.

    $ mpirun -n 8 python -m bench.training_ranks --plan none=50,1=10,10=30,a10=30,p10=30,100=100 --repeats 3 --dir /tmp/b --out r.json

For every repeat, in a rotating order, each variant builds a fresh run from the config (default:
configs/default.yaml, dp2 x mp4, 32M parameters) and trains it as `python -m dsim.train` does, with the
standard callbacks (checkpoints every k steps through ModelCheckpoint, keep_checkpoint_max as configured;
or checkpoints disabled). A last callback stamps the end of every step on rank 0; the time per step is
(end of training - end of the first step) / (steps - 1): build time and the first step's warm-up
are left out, every save after the first step is in. --plan gives the steps of each variant: fewer for
small k, whose per-step figure settles sooner, at least k for every k so that it saves every k steps;
aK is every K steps with checkpoint.async_save, pK the same staged in the page cache
(checkpoint.async_staging: page_cache); t is the last gasp alone (tft.ttp) and cK the last gasp with peer copies
every K steps (tft.peer_copy_every: K), neither saving: `--plan t=30,c2=30` gives the copies' cost beside their
baseline, and the copies' own time in their step-end hook (snapshot, exchange, wait). Per variant it also records how long each save held up its
step (ModelCheckpoint.stalls: a synchronous save's whole time, an async save's start), how long the update
after an async save waited for its staging (Optimizer.held), and the peak
resident memory of each rank (VmHWM, reset before the variant through /proc/self/clear_refs) beside the
bytes of its parameters, gradients and optimizer state, and its peak PSS over training alone (the peak reset
again after the build; PSS divides each shared page among the processes that map it: bench.ranks.shared_overcount).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from mpi4py import MPI

from dsim.checkpoint import ModelCheckpoint
from dsim.config import load_config
from dsim.build import build_run
from dsim.engine.callbacks import Callback

from .ranks import peak_rss, release_freed, reset_peak_rss, shared_overcount

ROOT = Path(__file__).resolve().parents[1]


class StepClock(Callback):
    """perf_counter at the end of every step (after the checkpoint callback has saved), and at the end of
    training (after an async save still in flight was waited for)."""

    def __init__(self):
        self.ends = []
        self.finished = None

    def step_end(self, run_context):
        self.ends.append(time.perf_counter())

    def end(self, run_context):
        self.finished = time.perf_counter()


def variants(plan: str):
    """[(label, k or None, steps, async staging or None)] from "none=100,1=20,a10=30,p10=30...": no checkpoints,
    then every k steps (aK: async saves every K steps staged in memory; pK: staged in the page cache; t: the last
    gasp alone, cK: with peer copies every K steps, both without checkpoints)."""
    out = []
    for item in plan.split(","):
        k, steps = item.split("=")
        if k == "none":
            out.append(("none", None, int(steps), None))
        elif k == "t":
            out.append(("ttp", None, int(steps), None))
        elif k.startswith("c"):
            out.append((f"peer copies k={int(k[1:])}", None, int(steps), None))
        elif k.startswith("a"):
            out.append((f"async k={int(k[1:])}", int(k[1:]), int(steps), "memory"))
        elif k.startswith("p"):
            out.append((f"async page_cache k={int(k[1:])}", int(k[1:]), int(steps), "page_cache"))
        else:
            out.append((f"k={int(k)}", int(k), int(steps), None))
    return out


def state_bytes(run) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state."""
    params = run.network.trainable_params()
    return (sum(p.data.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in params)
            + sum(arr.nbytes for _, _, arr in run.optimizer.state_items()))


def tft_overrides(label: str) -> list:
    """The last gasp (t) and peer copies (cK) of a variant's label."""
    if label == "ttp":
        return ["tft.ttp=true"]
    if label.startswith("peer copies k="):
        return ["tft.ttp=true", f"tft.peer_copy_every={label.split('=')[1]}"]
    return []


def train_once(comm, config, overrides, label, k, steps, d: Path, staging=None) -> dict:
    ckpt = ["checkpoint.enabled=false"] if k is None else [
        "checkpoint.enabled=true", f"checkpoint.save_checkpoint_steps={k}", "checkpoint.save_checkpoint_epochs=null",
        f"checkpoint.directory={d / 'checkpoints'}", f"checkpoint.async_save={str(staging is not None).lower()}",
        f"checkpoint.async_staging={staging or 'memory'}"]
    cfg = load_config(config, [*overrides, "train.epochs=1", f"train.steps_per_epoch={steps}",
                               f"data.num_samples={steps * 32}", "data.batch_size=32", "output.progress_bar=false",
                               f"output.loss_every={steps}", f"output.dir={d}", *ckpt, *tft_overrides(label)])
    release_freed()  # the previous variant's run (reference cycles) freed now and its heap given back: not in this peak
    reset = reset_peak_rss()
    run = build_run(cfg, comm)
    clock = StepClock()
    callbacks = run.callbacks([clock])  # what run.train() uses, plus the clock last
    built = peak_rss()
    comm.Barrier()
    reset_peak_rss()  # training's own peak from here (its saves included), for the PSS
    run.model.train(cfg.train.epochs, run.loader, callbacks)
    trained, overcount = peak_rss(), shared_overcount()
    comm.Barrier()
    savers = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    saves = sum(len(c.saved) for c in savers)
    stalls = [s for c in savers for s in c.stalls]
    stall = comm.allreduce(statistics.median(stalls) if stalls else 0.0, op=MPI.MAX)
    held = run.optimizer.held  # how long each update after an async save waited for its staging
    held = comm.allreduce(statistics.median(held) if held else 0.0, op=MPI.MAX)
    rss, state = comm.allgather(max(built, trained)), comm.allgather(state_bytes(run))
    pss = comm.allgather(trained - overcount)
    snapshot = comm.allgather(sum(c.snapshot.bytes() for c in savers))
    copies = run.peer_copies
    copy_s = comm.allreduce(copies.seconds / max(copies.steps, 1) if copies is not None else 0.0, op=MPI.MAX)
    copy_bytes = comm.allgather(2 * copies.own[0].nbytes + 2 * copies.held[0].nbytes if copies is not None and
                                copies.own[0] is not None else 0)
    run.groups.free()
    ends = clock.ends
    return {"copy_s": copy_s, "copy_bytes": copy_bytes, "steps": len(ends), "saves": saves, "step_s": (clock.finished - ends[0]) / (len(ends) - 1),
            "stall_s": stall, "held_s": held, "peak_rss_bytes": rss, "peak_pss_bytes": pss,
            "state_bytes": state, "snapshot_bytes": snapshot,
            "peak_reset": reset}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.training_ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--plan", default="none=50,1=10,10=30,a10=30,p10=30,100=100",
                    help="variants and their steps: none=N (no checkpoints), K=N (every K steps), aK=N (async), "
                         "pK=N (async staged in the page cache)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    base = Path(args.dir)
    todo = variants(args.plan)
    repeats = []
    for rep in range(args.repeats):
        order = todo[rep % len(todo):] + todo[:rep % len(todo)]
        out = {"order": [v[0] for v in order], "variants": {}}
        for label, k, steps, staging in order:
            d = base / f"repeat_{rep}" / label.replace("=", "").replace(" ", "_")
            out["variants"][label] = {"k": k, "async": staging is not None, "staging": staging,
                                      **train_once(comm, args.config, args.overrides, label, k, steps, d, staging)}
            if comm.rank == 0:
                shutil.rmtree(d, ignore_errors=True)
                v = out["variants"][label]
                print(f"repeat {rep + 1}/{args.repeats} {label}: {v['steps']} steps, {v['saves']} saves, "
                      f"{1000 * v['step_s']:.1f} ms/step, stall {1000 * v['stall_s']:.1f} ms, peak RSS "
                      f"{max(v['peak_rss_bytes']) / 2**20:.0f} MiB"
                      + (f", copies {1000 * v['copy_s']:.2f} ms/step in their hook, {max(v['copy_bytes']) / 2**20:.1f} "
                         "MiB of buffers per rank" if v["copy_s"] else ""), flush=True)
            comm.Barrier()
        repeats.append(out)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"ranks": comm.size, "config": args.config, "overrides": args.overrides,
                                              "repeats": repeats}, indent=1))


if __name__ == "__main__":
    main()
