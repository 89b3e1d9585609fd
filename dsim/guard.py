"""The guard at every entry point: an unexpected exception becomes one line, never a traceback on the terminal.

    dsim: error: internal error on rank R: <Type>: <message> (full traceback in <run dir>/logs/rank_R.err)

The traceback is kept in that file; the process exits 1 at once (without MPI_Finalize), so under mpirun the
other ranks end too rather than wait for this one. DSIM_DEBUG=1 prints the traceback as well, for developers.
Warnings are shown as one line each (`dsim: warning: ...`).
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from .log import ended, leave
from .runtime import PROCESS  # (its run_dir and launcher: read by the last-resort handler and the launcher's watch)


def set_run_dir(path) -> None:
    """Where the traceback of an internal error goes (<path>/logs/rank_R.err): the run's output directory."""
    PROCESS.run_dir = path


def rank() -> int:
    """This process's MPI rank: from mpi4py when MPI is up, else the launcher's environment, else 0."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD.Get_rank()
    except Exception:
        pass
    for var in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _format_warning(message, category, filename, lineno, line=None):
    return f"dsim: warning: {one_line(message, 500)}\n"


def keep_traceback(r: int, text: str, append: bool = False) -> Path:
    """Write (or append) text to <run dir>/logs/rank_R.err (or, when that cannot be written, a temporary file)."""
    run_dir = PROCESS.run_dir
    bases = ([Path(run_dir) / "logs"] if run_dir else []) + [Path(tempfile.gettempdir()) / "dsim-logs"]
    for base in bases:
        try:
            base.mkdir(parents=True, exist_ok=True)
            path = base / f"rank_{r}.err"
            with open(path, "a" if append else "w") as fh:
                fh.write(text)
            return path
        except OSError:
            continue
    return Path("(not kept: no writable directory)")


def report(exc: BaseException) -> str:
    """Keep exc's traceback in this rank's log file; return the one line for the terminal."""
    r = rank()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    path = keep_traceback(r, text)
    if os.environ.get("DSIM_DEBUG") == "1":
        sys.stderr.write(text)
    return (f"dsim: error: internal error on rank {r}: {type(exc).__name__}: {one_line(exc)} "
            f"(full traceback in {path})")


def stacks_on_signal() -> None:
    """`kill -USR1 PID` of this process, or of mpirun (which passes the signal on to every rank), prints the
    Python stack of each of its threads on stderr (faulthandler: even from a thread stuck in MPI): where a rank
    that hangs is. Only where SIGUSR1 was left to its default (ending the process)."""
    import faulthandler
    import signal
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR1, all_threads=True)


START_TIMEOUT = 120.0  # seconds MPI_Init may take (DSIM_START_TIMEOUT) before start_mpi gives up


LAUNCHER_POLL = 0.5  # seconds between looks at whether this rank's launcher (its parent process) is still there


def end_with_launcher() -> None:
    """Under mpirun: end this process within LAUNCHER_POLL seconds of its parent, Open MPI's launcher or daemon
    (prterun, prted), ending. A rank outliving its launcher is a job nobody runs any more: nobody reads its output
    or its exit status, and a job started again in its place (a scheduler's restart) would train beside it. When
    mpirun ends normally its ranks have ended first; when it is killed (or dies with its host's daemon) this is
    how the ranks learn of it. dsim/ft/launcher.py ends mpirun when it is killed itself (PR_SET_PDEATHSIG).
    Does nothing outside mpirun (no PMIx rank in the environment) or when the watch already runs."""
    if PROCESS.launcher is not None or not any(os.environ.get(v) for v in ("PMIX_RANK", "OMPI_COMM_WORLD_RANK")):
        return
    import threading
    import time
    parent = PROCESS.launcher = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL)
        launcher_gone()
    threading.Thread(target=watch, name="dsim-launcher-watch", daemon=True).start()


def launcher_gone() -> None:
    """When this rank's launcher is gone (end_with_launcher): one line in the run's log (its stderr went with the
    launcher), and the process ends at once. Called too where an error may come of the launcher's going (its
    output's pipe broken), so that it is not taken for a bug. Returns while the launcher is there."""
    launcher = PROCESS.launcher
    if launcher is None or os.getppid() == launcher:
        return
    if PROCESS.rescue is not None:  # a host's crash may be why: this rank's state to its disk first (dsim.ft.rescue)
        PROCESS.rescue.launcher_gone()
    line = f"dsim: rank {rank()} (pid {os.getpid()}): its launcher (pid {launcher}) is gone; ending\n"
    keep_traceback(rank(), line, append=True)  # its stderr went with the launcher: the line is in the run's log
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except Exception:
        pass
    leave(1)


def start_mpi() -> None:
    """Initialize MPI (MPI_Init_thread, as importing mpi4py.MPI does) with a deadline: past DSIM_START_TIMEOUT
    seconds (START_TIMEOUT) rank 0 says why in one line and exits 1, every other rank still waiting a second later.

    Under MPI fault tolerance (`mpirun --with-ft ulfm`: the launch scripts, the tests) a process of the job that
    ends before its MPI_Init (a module missing on its node, a broken environment, a crash at start-up) leaves
    every other waiting in MPI_Init for ever; plain mpirun ends the job at once. mpi4py calls MPI_Init_thread
    holding the interpreter's lock, so no thread could run the deadline meanwhile: the call goes through
    ctypes (which releases it) on the library mpi4py loads; mpi4py, imported after, finds MPI initialized and
    sets its error handlers as usual, and MPI_Finalize is called at exit as mpi4py would. Where that library cannot be told (another
    mpi4py), MPI starts the usual way, without the deadline. Does nothing once mpi4py.MPI is imported."""
    end_with_launcher()
    if "mpi4py.MPI" in sys.modules:
        return
    import ctypes
    import threading
    try:
        from mpi4py import _mpiabi
        lib = _mpiabi._dlopen_libmpi(_mpiabi.LIBMPI or os.environ.get("MPI4PY_LIBMPI"))  # as mpi4py's import
        init, initialized = lib.MPI_Init_thread, lib.MPI_Initialized
    except Exception:
        return
    flag, provided = ctypes.c_int(0), ctypes.c_int(0)
    if initialized(ctypes.byref(flag)) != 0 or flag.value:
        return
    try:
        timeout = float(os.environ.get("DSIM_START_TIMEOUT") or START_TIMEOUT)
    except ValueError:
        timeout = START_TIMEOUT
    started = threading.Event()

    def deadline():
        if started.wait(timeout if rank() == 0 else timeout + 1):  # rank 0 first: its line before mpirun's end
            return
        if rank() == 0:
            sys.stderr.write(f"dsim: error: MPI did not start within {timeout:g} s (MPI_Init): a process of this job "
                             "failed to start or cannot be reached (see the lines above); DSIM_START_TIMEOUT sets "
                             "the wait\n")
        leave(1)
    threading.Thread(target=deadline, name="dsim-mpi-start", daemon=True).start()
    try:
        code = init(None, None, 3, ctypes.byref(provided))  # MPI_THREAD_MULTIPLE (3 in both ABIs), mpi4py's default
    finally:
        started.set()
    if code == 0:
        import atexit
        atexit.register(_finalize_mpi)  # as mpi4py does for an MPI it initialized itself (not for this one)


def _finalize_mpi() -> None:
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def run(main, argv=None, run_dir=None) -> None:
    """Run an entry point's main(argv) -> exit code under the guard; never returns.

    run_dir: where the traceback goes until main names the run's own directory (set_run_dir); without one,
    <tmp>/dsim-logs (the tools never write into the directories they read)."""
    set_run_dir(run_dir)
    warnings.formatwarning = _format_warning
    stacks_on_signal()
    try:
        code = main(argv)
    except SystemExit as e:  # (argparse's usage error: 2)
        ended(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
        raise
    except KeyboardInterrupt:
        print("dsim: error: interrupted", file=sys.stderr, flush=True)
        leave(130)
    except BaseException as e:  # a bug (or a failure nobody foresaw): one line, the traceback in the log
        launcher_gone()  # unless it came of the launcher's end (its output's pipe gone): then that is said
        try:
            line = report(e)
        except BaseException as again:  # the guard must not fail into a traceback either
            line = f"dsim: error: internal error on rank {rank()}: {type(e).__name__}: {one_line(e)} ({again})"
        print(line, file=sys.stderr, flush=True)
        leave(1)
    ended(code)  # (for the launcher: dsim.log.ended)
    sys.exit(code)


