"""Run dsim's benchmarks, print a table, write bench/results/latest.json.

    $ make bench                      # full size (a 2 GiB sharded checkpoint on 8 ranks, ...)
    $ make bench BENCH_QUICK=1        # smaller sizes, a few minutes
    $ python -m bench --size toy --no-dcp --no-torch --out /tmp/toy.json   # seconds: the smoke test's run

Each suite is one module (see bench/harness.py for what it provides); SUITES lists them in order.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from . import harness
from .page_cache import drop_all_permitted

SUITES = ["step", "update", "save_load", "planning", "training", "recovery", "models", "seed_torch", "pipeline",
          "cluster"]  # modules of bench/, run in this order
DEFAULT_OUT = harness.ROOT / "bench" / "results" / "latest.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["full", "quick", "toy"], default="full")
    ap.add_argument("--only", help=f"comma-separated suites out of {','.join(SUITES)}")
    ap.add_argument("--no-dcp", action="store_true", help="leave torch.distributed.checkpoint out")
    ap.add_argument("--no-torch", action="store_true", help="leave torch out of every suite (dsim's figures alone)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON (default %(default)s)")
    ap.add_argument("--retable", type=Path, metavar="RESULTS",
                    help="measure nothing: rebuild the rows and table of a results file from its stored values")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where benchmark files go (default: bench/.work on the work disk); removed when done")
    return ap.parse_args(argv)


def retable(path: Path) -> int:
    """Rows and table of a results file, rebuilt from its measurements by today's summaries."""
    results = json.loads(path.read_text())
    for name, suite in results["suites"].items():
        module = importlib.import_module(f"bench.{name}")
        suite["rows"] = module.rows_again(suite)
    results["table"] = harness.table(results)
    results["retabled"] = harness.now()  # the rows changed; every measured value is as the run left it
    harness.write_json(path, results)
    print(results["table"])
    return 0


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.retable:
        return retable(opts.retable)
    names = opts.only.split(",") if opts.only else SUITES
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        print(f"bench: error: unknown suite {', '.join(unknown)} (known: {', '.join(SUITES)})", file=sys.stderr)
        return 2
    base = opts.workdir or harness.ROOT / "bench" / ".work"
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dsim-bench-", dir=base) as tmp:
        workdir = Path(tmp)
        opts.logdir = opts.out.with_name(opts.out.stem + "-logs")
        opts.logdir.mkdir(parents=True, exist_ok=True)
        results = {"command": shlex.join([Path(sys.executable).name, "-m", "bench", *(argv or sys.argv[1:])]),
                   "invoked_as": os.environ.get("BENCH_COMMAND"),
                   "size": opts.size, "started": harness.now(), "machine": harness.machine_facts(workdir),
                   "versions": harness.versions(), "suites": {}}
        results["machine"]["drop_caches_writable"] = drop_all_permitted()
        print(f"bench: size {opts.size}; files in {workdir} ({harness.disk_free(workdir) / harness.GiB:.0f} GiB free); "
              f"logs in {opts.logdir}", flush=True)
        for name in names:
            suite = importlib.import_module(f"bench.{name}")
            params = suite.SIZES[opts.size]
            t0 = time.perf_counter()
            print(f"bench: {suite.TITLE} ...", flush=True)
            result = suite.run(params, workdir, opts)
            results["suites"][name] = {"title": suite.TITLE, "seconds": time.perf_counter() - t0, **result}
            print(f"bench: {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        results["finished"] = harness.now()
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
    text = harness.table(results)
    results["table"] = text
    harness.write_json(opts.out, results)
    print(text)
    print(f"bench: wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
