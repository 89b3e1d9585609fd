"""Shared test helpers: small configs, and running mpirun as a user would (always with a timeout)."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCHER = ROOT / "dsim" / "ft" / "launcher.py"  # mpirun watched as the launch scripts watch it
SMALL = ["model.hidden=[64,128,128,64]", "data.num_samples=640", "train.steps_per_epoch=20"]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Under `mpirun pytest --with-mpi` only rank 0 reports; every assertion is agreed across ranks
    # first, so rank 0 fails whenever any rank would.
    if config.getoption("with_mpi", default=False):
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank != 0:
            reporter = config.pluginmanager.getplugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)


def pytest_ignore_collect(collection_path, config):
    # Under `mpirun pytest --with-mpi` only the MPI tests run: the end-to-end files (which launch mpirun
    # themselves) are not even imported by the 8 ranks.
    if config.getoption("with_mpi", default=False) and (collection_path.name == "e2e" or
                                                        collection_path.name.startswith("test_e2e_")):
        return True
    return None


def assert_one_line_error(fn, *needles):
    """fn() raises DatasetError whose message is one line containing every needle."""
    from dsim.data import DatasetError
    with pytest.raises(DatasetError) as info:
        fn()
    msg = str(info.value)
    assert msg and "\n" not in msg, msg
    for needle in needles:
        assert str(needle) in msg, (needle, msg)
    return msg


def small_config(**overrides):
    """A fast float64 config (small widths, 20 steps) with dotted-key overrides."""
    from dsim.config import load_config
    items = SMALL + ["dtype=float64", "output.progress_bar=false"]
    items += [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_config(None, items)


def launch_env():
    """The environment launch/env.sh gives, for subprocesses."""
    out = subprocess.run(["bash", "-c", f". {ROOT}/launch/env.sh && env -0"], capture_output=True, check=True)
    env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def mpirun(n, args, cwd, timeout=180, check=None, ft=False, env=None):
    """Run `mpirun -n N python -m ...args` in cwd, through dsim/ft/launcher.py as the launch scripts run it (a
    launcher stall stopped, exiting with the ranks' status or else 1; a launcher that failed to start started
    again); returns CompletedProcess.

    ft=True runs it as the launch scripts do: with MPI fault tolerance (launch/ft.sh). env: more variables.
    """
    opts, env = [], dict(env or {})
    if ft:
        env.update(ft_env())
        opts = env.pop("DSIM_FT_MPIRUN_ARGS").split()
    return run_command([sys.executable, str(LAUNCHER), str(BIN / "mpirun"), *opts, "-n", str(n), sys.executable, *args],
                       cwd, timeout, check, env)


def dsim_cli(n, args, cwd, timeout=120, check=None):
    """`mpirun -n N python -m ...args`, or with n=None the same command without mpirun (one process).

    For bad input that every rank refuses alike before it uses MPI (a config error): the command the user typed
    after mpirun, checked without starting N ranks. Each such family of errors keeps a case through mpirun.
    """
    if n is None:
        return run_command([sys.executable, *args], cwd, timeout, check)
    return mpirun(n, args, cwd, timeout=timeout, check=check)


def ft_env():
    """The variables launch/ft.sh sets, and its mpirun options as DSIM_FT_MPIRUN_ARGS."""
    out = subprocess.run(["bash", "-c", f". {ROOT}/launch/ft.sh && export DSIM_FT_MPIRUN_ARGS && env -0"],
                         capture_output=True, check=True, env={})
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item and
                not item.startswith(("PWD=", "SHLVL=", "_=")))


def launch(script, args, cwd, timeout=180, check=None, env=None):
    """Run one of launch/*.sh as a user would, with this test's Python environment (plus env)."""
    return run_command(["bash", str(ROOT / "launch" / script), *args], cwd, timeout, check,
                       {"VIRTUAL_ENV": sys.prefix, **(env or {})})


def after_failed_starts(err: str) -> str:
    """A job's stderr without what its launcher's failed starts left (dsim/ft/launcher.py starts mpirun again
    when no rank ran: Open MPI's message, then the launcher's note): the stderr of the start that ran."""
    notes = list(re.finditer(r"^dsim: note: mpirun failed to start .*\n", err, re.M))
    return err[notes[-1].end():] if notes else err


def run_command(cmd, cwd, timeout, check, env=None):
    """Run cmd in its own process group; on timeout kill it with every process below it (mpirun and every rank)
    and fail. Open MPI's launcher faults (a stall, a failed start) are dsim/ft/launcher.py's to handle: mpirun()
    and the launch scripts run mpirun through it."""
    from dsim.ft.launcher import supervise
    got = {}
    with subprocess.Popen(cmd, cwd=cwd, env={**launch_env(), **(env or {})}, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as p:
        how = supervise(p, timeout, wait=lambda: got.update(zip(("out", "err"), p.communicate(timeout=1))),
                        stalls=False)  # a timeout: everything killed, nothing outlives a test
        out, err = (got["out"], got["err"]) if how == "ended" else p.communicate()
    if how == "timeout":
        # (its ranks' stacks, each thread's, printed before the kill: dsim.ft.launcher.ask_for_stacks)
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-3000:]}\n{err[-30000:]}")
    proc = subprocess.CompletedProcess(cmd, p.returncode, out, after_failed_starts(err))
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit {proc.returncode} != {check}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


@contextlib.contextmanager
def mounted(*commands):
    """Run mount commands (the last one's target is unmounted, then each earlier target, on exit); skip the test
    with the reason when mounting is not permitted (not root, or a container without CAP_SYS_ADMIN)."""
    done = []
    try:
        for cmd in commands:
            if os.geteuid() != 0:
                pytest.skip("needs root to mount (tmpfs / read-only bind mount)")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                pytest.skip(f"mount not permitted here: {' '.join(cmd)}: {proc.stderr.strip()}")
            if cmd[-1] not in done:
                done.append(cmd[-1])
        yield
    finally:
        for target in reversed(done):
            subprocess.run(["umount", "-l", target], capture_output=True)


def tmpfs(target, size: str):
    """A tmpfs of `size` (e.g. "2m") mounted on target (created) for the duration of a with block."""
    Path(target).mkdir(parents=True, exist_ok=True)
    return mounted(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)])


def readonly_view(source, target):
    """A read-only bind mount of source on target (created) for the duration of a with block."""
    Path(target).mkdir(parents=True, exist_ok=True)
    return mounted(["mount", "--bind", str(source), str(target)],
                   ["mount", "-o", "remount,ro,bind", str(target)])


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path


def made_once(tmp_path_factory, name, n, args, **kwargs) -> tuple[Path, subprocess.CompletedProcess]:
    """A job (`mpirun(n, args, **kwargs)`) run once per test session in its own directory, and shared by
    pytest-xdist's workers: the first that wants it runs it while the others wait for it (a module's tests run
    on both workers; each made its own copy before). Its users only read the directory, or copy it.
    Returns (directory, the finished process: returncode, stdout, stderr)."""
    import fcntl
    import json
    import shutil
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    d, done = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)  # (a worker that failed half-way: from the start)
            d.mkdir()
            proc = mpirun(n, args, cwd=d, **kwargs)
            done.write_text(json.dumps([proc.returncode, proc.stdout, proc.stderr]))
    code, out, err = json.loads(done.read_text())
    return d, subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture(scope="session")
def ft_reference(tmp_path_factory):
    """Uninterrupted runs of the fault-tolerance tests' job (tests/ftjob.py), per layout, made on first use:
    (loss lines, final checkpoint directory); get(layout, output=True) also gives the run's stdout."""
    from ftjob import LAYOUTS, LOSS, OPTS

    def get(layout, output=False):
        d, proc = made_once(tmp_path_factory, f"ref-{layout}", 8, ["-m", "dsim.train", *OPTS, *LAYOUTS[layout]],
                            check=0)
        out = proc.stdout
        losses = LOSS.findall(out)
        assert len(losses) == 20
        return (losses, d / "run" / "checkpoints", out) if output else (losses, d / "run" / "checkpoints")
    return get


@pytest.fixture(scope="session")
def recovery_reference(tmp_path_factory):
    """The uninterrupted run of the job tests/e2e/test_e2e_recovery.py and tests/e2e/test_e2e_integrity.py damage (the same
    RUN), made once for both: (loss lines, job directory; its checkpoints of steps 7, 14, 21, 28, 30)."""
    from test_e2e_recovery import LOSS, RUN
    d, proc = made_once(tmp_path_factory, "recovery-reference", 8, RUN, check=0)
    losses = LOSS.findall(proc.stdout)
    assert len(losses) == 30
    return losses, d


def flip_byte(path, dataset=None):
    """Flip one byte in the middle of a tensor's data (not the HDF5 metadata), as a bad disk block would.

    dataset: e.g. "params/layer1.param"; by default the first parameter of the file.
    """
    from dsim.campaign.runner import damage
    damage(path, dataset)
