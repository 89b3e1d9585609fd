"""The Transformer's whole-vocabulary work (issue 53, target 3): its step before and after the sparse embedding
gradient, and vocab_emb_dp false against true at mp4.

    $ git worktree add --detach /tmp/vocab-before <the commit before the change>
    $ python -m bench.vocab --before /tmp/vocab-before            # 10-20 minutes on 2 cores
    $ git worktree remove /tmp/vocab-before

Each variant is a job of its own (`mpirun -n <ranks>`, launch/env.sh's settings) training configs/transformer.yaml
without checkpoints on one layout, with one checkout's dsim (--before, --after: this one by default). Its time per
step is the median of rank 0's step times after the first (the build and the first step's warm-up left out; the
median, not the mean, as other jobs share the machine and come in bursts; the mean is kept beside it). A repeat
runs every variant once, in an order rotated from the repeat before; a ratio is taken inside a repeat (its
variants ran back to back), and the figure is the median over repeats. Each job also hashes its ranks' final
parameters and optimizer state and keeps its losses: the two checkouts must agree bit for bit on every layout
(`identical`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/transformer.yaml"
OUT = ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-vocab.json"
# key: (label, ranks, overrides). One process; mp4 alone with the word embeddings replicated or split along the
# vocabulary; the config's own dp2 x mp4 (its data-parallel all-reduce writes every row: the dense zeroing stays).
LAYOUTS = {
    "1": ("1 process", 1, ["parallel.data_parallel=1", "parallel.model_parallel=1"]),
    "mp4": ("mp4, vocab_emb_dp true", 4, ["parallel.data_parallel=1", "parallel.model_parallel=4",
                                          "parallel.vocab_emb_dp=true"]),
    "mp4-split": ("mp4, vocab_emb_dp false", 4, ["parallel.data_parallel=1", "parallel.model_parallel=4",
                                                 "parallel.vocab_emb_dp=false"]),
    "dp2xmp4": ("dp2 x mp4, vocab_emb_dp true", 8, ["parallel.data_parallel=2", "parallel.model_parallel=4",
                                                    "parallel.vocab_emb_dp=true"]),
}


def worker(config: str, steps: int, overrides: list, out: str) -> None:
    """One job's training (run under mpirun with the checkout's dsim first on PYTHONPATH): time per step, losses,
    and a hash of every rank's final parameters and optimizer state, written to `out` by rank 0."""
    import numpy as np
    from mpi4py import MPI

    import dsim
    from dsim.build import build_run
    from dsim.config import load_config
    from dsim.engine.callbacks import Callback

    class Clock(Callback):
        def __init__(self):
            self.ends, self.losses = [], []

        def step_end(self, run_context):
            self.ends.append(time.perf_counter())
            self.losses.append(float(run_context.original_args().net_outputs))

    comm = MPI.COMM_WORLD
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(config, [*overrides, "checkpoint.enabled=false", "train.epochs=1", f"train.steps_per_epoch={steps}",
                                   f"data.num_samples={steps * 32}", "data.batch_size=32",
                                   "output.progress_bar=false", f"output.loss_every={steps}", f"output.dir={d}"])
        run = build_run(cfg, comm)
        clock = Clock()
        comm.Barrier()
        run.model.train(1, run.loader, run.callbacks([clock]))
        comm.Barrier()
    digest = hashlib.sha256()
    for p in run.network.trainable_params():
        digest.update(p.name.encode() + np.ascontiguousarray(p.data).tobytes())
    for name, _, arr in run.optimizer.state_items():
        digest.update(name.encode() + np.ascontiguousarray(arr).tobytes())
    digests = comm.gather(digest.hexdigest())
    run.groups.free()
    if comm.rank == 0:
        Path(out).write_text(json.dumps({
            "step_s": statistics.median(np.diff(clock.ends)), "mean_step_s": (clock.ends[-1] - clock.ends[0]) / (steps - 1),
            "steps_s": np.diff(clock.ends).tolist(), "losses": clock.losses,
            "state_sha256": hashlib.sha256("".join(digests).encode()).hexdigest(), "dsim": dsim.__file__}))


def job(tree: Path, config: str, ranks: int, overrides: list, steps: int, log: Path) -> dict:
    """One variant as its own mpirun job in `tree`, importing that checkout's dsim."""
    from .harness import launch_env
    env = {**launch_env(), "PYTHONPATH": str(tree)}
    out = log.with_suffix(".json")
    cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", str(ranks), sys.executable, str(Path(__file__).resolve()),
           "--worker", "--config", config, "--steps", str(steps), "--out", str(out), *[a for o in overrides for a in ("--set", o)]]
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT, check=True, timeout=1800)
    return json.loads(out.read_text())


def median_ratio(repeats, a: str, b: str) -> dict:
    """a's step over b's, per repeat (the two ran back to back), and their median."""
    values = [r[a]["step_s"] / r[b]["step_s"] for r in repeats]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vocab", description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a checkout of the code before the change (e.g. a git worktree)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the checkout with the change (default: this one)")
    ap.add_argument("--config", default=CONFIG, help="relative to each checkout (default %(default)s)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", help=f"comma-separated layouts out of {','.join(LAYOUTS)} (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.config, args.steps, args.overrides, str(args.out))
        return 0
    trees = {"after": args.after.resolve(), **({"before": args.before.resolve()} if args.before else {})}
    layouts = [LAYOUTS[key] for key in (args.only.split(",") if args.only else LAYOUTS)]
    variants = [(f"{name} / {label}", tree, ranks, overrides)
                for label, ranks, overrides in layouts for name, tree in trees.items()]
    repeats, logs = [], Path(tempfile.mkdtemp(prefix="bench-vocab-"))
    started, load = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg()
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        results = {}
        for i, (key, tree, ranks, overrides) in enumerate(order):
            results[key] = job(tree, args.config, ranks, overrides, args.steps, logs / f"r{rep}-{i}.log")
            print(f"repeat {rep + 1}/{args.repeats} {key}: {1000 * results[key]['step_s']:.1f} ms/step", flush=True)
        repeats.append(results)
    shutil.rmtree(logs)  # the jobs' logs and results, kept only when one failed (check=True raised)
    figures = {}
    for label, _, _ in layouts:
        if "before" in trees:
            a, b = f"after / {label}", f"before / {label}"
            figures[f"{label}: after / before"] = median_ratio(repeats, a, b)
            figures[f"{label}: identical"] = all(r[a]["losses"] == r[b]["losses"] and
                                                 r[a]["state_sha256"] == r[b]["state_sha256"] for r in repeats)
    for name in trees:
        t, f = f"{name} / mp4, vocab_emb_dp true", f"{name} / mp4, vocab_emb_dp false"
        if t in repeats[0] and f in repeats[0]:
            figures[f"{name}: mp4 vocab_emb_dp false / true"] = median_ratio(repeats, f, t)
    for key in repeats[0]:
        figures[f"{key}: ms per step"] = {"median": 1000 * statistics.median(r[key]["step_s"] for r in repeats),
                                          "values": [1000 * r[key]["step_s"] for r in repeats]}
    git = {name: subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True,
                                text=True).stdout.strip() for name, tree in trees.items()}
    result = {"started": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": args.config,
              "steps": args.steps, "repeats_count": args.repeats, "trees": {k: str(v) for k, v in trees.items()},
              "git": git, "cores": os.cpu_count(), "load_average": {"start": load, "end": os.getloadavg()},
              "command": " ".join(["python -m bench.vocab", *(argv if argv is not None else sys.argv[1:])]),
              "figures": figures, "repeats": repeats}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, value in figures.items():
        print(f"{key}: {value['median']:.3f} {value['values']}" if isinstance(value, dict) else f"{key}: {value}")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
