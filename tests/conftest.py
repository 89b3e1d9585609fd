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


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that took the most CPU: the test process's own and its finished child "
                          "processes' (mpirun and its ranks), setup and teardown included; 0 for every test. On a "
                          "loaded machine a test's wall time grows with the load, its CPU much less")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # each phase's CPU (setup: the shared jobs a fixture made; call; teardown) on its report, for --cpu-durations
    outcome = yield
    if item.config.getoption("cpu_durations", default=None) is None:
        return
    import resource
    now = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    before = item.stash.get(CPU_MARK, None)
    item.stash[CPU_MARK] = now
    if before is None and call.when != "setup":
        return
    outcome.get_result().user_properties.append(("cpu_s", round(now - before, 3) if before is not None else None))


CPU_MARK = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("cpu_durations", default=None) is not None:
        import resource
        item.stash[CPU_MARK] = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
                                                                                 resource.RUSAGE_CHILDREN)
                                   for f in ("ru_utime", "ru_stime"))


def pytest_runtest_logreport(report):
    cpu = dict(report.user_properties).get("cpu_s")
    if cpu is not None:
        cpu_seen.setdefault(report.nodeid, [0.0, 0.0])
        cpu_seen[report.nodeid][0] += cpu
        cpu_seen[report.nodeid][1] += report.duration
        if report.when == "teardown" and os.environ.get("DSIM_TEST_CPU_LOG") and \
                not os.environ.get("PYTEST_XDIST_WORKER"):  # each test as it ends (a long run's figures so far)
            with open(os.environ["DSIM_TEST_CPU_LOG"], "a") as log:
                log.write(f"{cpu_seen[report.nodeid][0]:.2f} {cpu_seen[report.nodeid][1]:.2f} {report.nodeid}\n")


cpu_seen: dict[str, list[float]] = {}  # nodeid -> [CPU seconds, wall seconds], for --cpu-durations


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("cpu_durations", default=None)
    if n is None or not cpu_seen:
        return
    rows = sorted(cpu_seen.items(), key=lambda kv: -kv[1][0])
    total_cpu, total_wall = sum(v[0] for v in cpu_seen.values()), sum(v[1] for v in cpu_seen.values())
    terminalreporter.write_sep("=", f"slowest {n or len(rows)} CPU durations (all {len(rows)} tests: CPU "
                                    f"{total_cpu:.0f} s, wall {total_wall:.0f} s)")
    for nodeid, (cpu, wall) in rows[:n or None]:
        terminalreporter.write_line(f"{cpu:8.2f}s CPU {wall:8.2f}s wall  {nodeid}")


# The end-to-end stage's longest tests, started first: with two pytest-xdist workers the stage ends when its last
# test does, and a long one dispatched last leaves the other worker idle for most of it. Seconds of wall time at
# two workers (CI's 2-core VM, and --durations here), only to order by; an id without [parameters] takes every
# parametrization. The tests of a module with a module-scoped cluster of hosts are not here (moved apart from the
# rest of their module, each part would make its own cluster). Every other test keeps its collection order.
LONG_FIRST = {
    "tests/e2e/test_e2e_campaign.py::test_campaign_report_matches_the_jobs_metrics": 94,
    "tests/e2e/test_e2e_campaign_hosts.py::test_host_crashes_restart_on_the_hosts_left_bit_identical": 57,
    "tests/e2e/test_e2e_tools.py::test_readme_tutorial_runs_as_shown": 66,
    "tests/e2e/test_e2e_bench.py::test_bench_runs_at_toy_size": 57,
    "tests/e2e/test_e2e_campaign.py::test_a_node_failure_kills_the_nodes_ranks_and_arf_heals_them_all_in_the_job": 50,
    "tests/e2e/test_e2e_node_faults.py::test_a_crashed_host_ends_the_job_non_zero_and_the_host_left_resumes_bit_identical": 45,
    "tests/e2e/test_e2e_checkpoint.py::test_seed_scenario_fault_at_epoch_6_then_resume_is_bit_identical": 40,
    "tests/e2e/test_e2e_campaign.py::test_a_slow_rank_is_found_by_the_straggler_watch_and_healed_in_the_job": 35,
    "tests/e2e/test_e2e_examples.py::test_fault_recover_example": 30,
    "tests/e2e/test_e2e_models.py::test_transformer_pipeline_uces_in_both_stages_are_repaired_in_place": 30,
    "tests/e2e/test_e2e_examples.py::test_distributed_examples": 30,
}


def long_first(nodeid: str) -> float:
    return LONG_FIRST.get(nodeid, LONG_FIRST.get(nodeid.split("[", 1)[0], 0))


def pytest_collection_modifyitems(config, items):
    # The daily tier (`make check`, tests/tiers.py): every serial test, and the MPI and end-to-end tests it names.
    from tiers import in_check
    for item in items:
        if in_check(item.nodeid) or not any(m.name in ("mpi", "e2e") for m in item.iter_markers()):
            item.add_marker(pytest.mark.check)
    items.sort(key=lambda item: -long_first(item.nodeid))  # (stable: the others keep their order)


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


FAILED_START = re.compile(r"^dsim: note: mpirun failed to start .*\n", re.M)  # the launcher's note after each


def after_failed_starts(err: str) -> str:
    """A job's stderr without what its launcher's failed starts left (dsim/ft/launcher.py starts mpirun again
    when no rank ran: Open MPI's message, then the launcher's note): the stderr of the start that ran."""
    notes = list(FAILED_START.finditer(err))
    if not notes:
        return err
    # but the launch scripts' echo of the command (`+ mpirun ...`, launch/common.sh), printed before the first start
    before = err[:notes[-1].start()].splitlines(keepends=True)
    return "".join(line for line in before if line.startswith("+ mpirun ")) + err[notes[-1].end():]


BOX = re.compile(r"\A\x00?(-{20,})\n(?:.*\n)*?\1\n\x00?")  # an Open MPI message at the head of the output


def out_after_failed_starts(out: str, err: str) -> str:
    """A job's stdout without what its launcher's failed starts left there: prterun prints a daemon that "failed to
    report back" on stdout, one message a start, before any rank ran; those come first (see after_failed_starts)."""
    for _ in FAILED_START.finditer(err):
        box = BOX.match(out)
        if box is None:
            break
        out = out[box.end():]
    return out


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
    proc = subprocess.CompletedProcess(cmd, p.returncode, out_after_failed_starts(out, err), after_failed_starts(err))
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


def cluster_of(hosts: int, slots: int, tag: str):
    """The body of a module-scoped fixture of a test cluster (dsim.cluster): `yield from cluster_of(2, 4, "ld")`.
    Skipped, with the reason, where namespaces cannot be made; torn down after the module's tests whatever
    happened, and checked to have left nothing. Its name: tag and this process's pid (each xdist worker its own)."""
    from dsim.cluster import Cluster, leftovers, unavailable
    why = unavailable()
    if why:
        pytest.skip(f"no cluster of namespaces here: {why}")
    name = f"{tag}{os.getpid()}"
    with Cluster(hosts=hosts, slots=slots, name=name) as c:
        yield c
    assert leftovers(name) == []


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


@pytest.fixture(scope="session")
def lenet_reference(tmp_path_factory):
    """The uninterrupted run of configs/lenet5.yaml, epochs cut to 2 steps (tests/e2e/test_e2e_models.py's LENET),
    made once for the fault-recovery page's two tests: the CLI's (test_e2e_models) and the script's in examples/
    (test_e2e_examples). (loss lines, checkpoint directory: lenet-6_2 ... lenet-10_2)."""
    from ftjob import LOSS
    from test_e2e_models import LENET
    d, proc = made_once(tmp_path_factory, "lenet-reference", 8, LENET, check=0)
    losses = LOSS.findall(proc.stdout)
    assert len(losses) == 20
    return losses, d / "run" / "checkpoints"


def flip_byte(path, dataset=None):
    """Flip one byte in the middle of a tensor's data (not the HDF5 metadata), as a bad disk block would.

    dataset: e.g. "params/layer1.param"; by default the first parameter of the file.
    """
    from dsim.campaign.runner import damage
    damage(path, dataset)
