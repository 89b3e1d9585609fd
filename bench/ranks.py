"""What the benchmarks' worker modules (run under mpirun) share: a step clock, a rotating order, a free port.

    clock = StepClock(); run.model.train(1, run.loader, run.callbacks([clock])); clock.step_s()
    for name in rotated(["dsim", "torch"], repeat): ...
"""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import numpy as np

from dsim.engine.callbacks import Callback

WARMUP = 2   # steps left out of a time per step (the first calls allocate, fill caches)


class StepClock(Callback):
    """perf_counter at the end of every step."""

    def __init__(self):
        self.ends = []

    def step_end(self, run_context):
        self.ends.append(time.perf_counter())

    def step_s(self) -> float:
        """Mean time per step, the first WARMUP steps left out."""
        return per_step(self.ends)


def worker_parser(prog: str, doc: str, steps: int, config: str = None) -> argparse.ArgumentParser:
    """The options every worker takes: the config (and --set overrides), steps and repeats, --torch (the same model
    in torch beside dsim), its directory and the JSON it writes."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.splitlines()[0])
    ap.add_argument("--config", default=config, required=config is None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch", action="store_true", help="train the same model in torch beside dsim")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    return ap


def per_step(ends) -> float:
    """Mean seconds per step from the end times of the steps, the first WARMUP left out."""
    return (ends[-1] - ends[WARMUP]) / (len(ends) - 1 - WARMUP)


def rotated(names: list, repeat: int) -> list:
    """names in the order of this repeat: each starts one repeat in turn (who runs first pays the warm-up)."""
    k = repeat % len(names)
    return names[k:] + names[:k]


def median_time(fn, repeats=5) -> float:
    """Median seconds of fn() over repeats calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def side_by_side(world, calls: dict, repeats: int) -> dict:
    """Median seconds of each call, made in turn (the order rotating each round), every rank of the job
    starting each call together: every group does the same at the same time, on a shared machine too."""
    names, times = list(calls), {name: [] for name in calls}
    for i in range(repeats):
        for name in rotated(names, i):
            world.Barrier()
            t = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(t)) for name, t in times.items()}


def timed_call(fn, clock: dict):
    """fn, adding the time of every call to clock["s"]."""
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock["s"] += time.perf_counter() - t
    return timed


def free_port(comm) -> int:
    """A TCP port on 127.0.0.1 free on rank 0 a moment ago, the same on every rank (torch's rendezvous)."""
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return comm.bcast(port)


# -- memory: peak RSS, and PSS (each shared page divided among the processes that map it) ---------------------------
def release_freed() -> None:
    """Give the heap's freed memory back to the kernel (glibc's malloc_trim) after a garbage collection: a
    measurement that follows an earlier one in the same process then starts as a fresh process would, not
    on the pages the earlier one freed but the heap kept resident."""
    import ctypes
    import gc
    gc.collect()
    from dsim import libc
    trim = libc.function("malloc_trim", [ctypes.c_size_t])
    if trim is not None:
        trim(0)


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (VmHWM) to its current size (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _kib(path: str, *keys) -> list:
    """The values of `Key:   N kB` lines of a /proc file, in bytes, read at one instant (0 for a key not there)."""
    found = {}
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            found[key] = int(value.split()[0]) * 1024
    return [found.get(k, 0) for k in keys]


def status(key: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM, ...) in bytes."""
    return _kib("/proc/self/status", key)[0]


def peak_rss() -> int:
    """Peak resident set size (VmHWM) of this process in bytes, since the last reset_peak_rss."""
    return status("VmHWM")


def shared_overcount() -> int:
    """RSS - PSS now: what RSS counts of pages shared with other processes beyond this process's share. The kernel
    keeps no peak PSS; peak RSS less this, read at the end of a measurement (the shared pages no longer change
    then), is the peak PSS."""
    rss, pss = _kib("/proc/self/smaps_rollup", "Rss", "Pss")
    return rss - pss
