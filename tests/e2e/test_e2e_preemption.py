"""checkpoint.save_on_signal end to end: a scheduler's notice (SIGUSR2 to the launcher, which passes it to mpirun
and mpirun to every process, a warm spare too; SIGTERM to one rank's own process) stops training after a step every rank agrees on,
that step is saved and committed, the job exits 128 + the signal, and `--resume auto` goes on bit-identical to an
uninterrupted run. Every job has a timeout."""
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from conftest import BIN, LAUNCHER, ROOT, launch_env, mpirun
from dsim.ft.launcher import descendants, kill_tree
from ftjob import LOSS, OPTS, events, final_state_equal

pytestmark = pytest.mark.e2e
SAVE_ON_SIGNAL = ["--set", "checkpoint.save_on_signal=true"]
STOPPED = re.compile(r"^dsim: (SIG\w+): training stopped after step (\d+) \(epoch (\d+) step (\d+)\), saved as "
                     r"(\S+); resume with --resume auto \(exit status (\d+)\)$", re.M)


def signalled(cwd, when: str, send, script=False, extra=(), timeout=120):
    """Run the ft job with save_on_signal (plus `extra`): through the launcher, or with script=True through the
    launch script (MPI fault tolerance, a spare from the config's tft.spares); once a stdout line contains `when`,
    call send(pid of the launcher or the script)."""
    env = launch_env()
    if script:
        cmd = ["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), str(ROOT / "configs" / "default.yaml"),
               "run/checkpoints", *OPTS, *SAVE_ON_SIGNAL, *extra]
        env["VIRTUAL_ENV"] = sys.prefix
    else:
        cmd = [sys.executable, str(LAUNCHER), str(BIN / "mpirun"), "-n", "8", sys.executable, "-m", "dsim.train",
               *OPTS, *SAVE_ON_SIGNAL, *extra]
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = [], []
    drain = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    drain.start()
    timer = threading.Timer(timeout, kill_tree, [p.pid])  # nothing outlives a test
    timer.start()
    try:
        for line in p.stdout:
            out.append(line)
            if when is not None and when in line:
                send(p.pid)
                when = None
        p.wait()
    finally:
        timer.cancel()
    drain.join(5)
    return p.returncode, "".join(out), "".join(err)


def test_sigusr2_stops_after_an_agreed_step_saved_and_the_resume_is_bit_identical(ft_reference, tmp_path):
    """Through the launch script, as a batch system signals it (Slurm's --signal=B:USR2@120): the script passes it
    to the launcher, the launcher to mpirun, mpirun to every process, the warm spare too (held: test_api), which
    leaves with the job."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    code, out, err = signalled(tmp_path, "epoch: 1 step: 3,", lambda pid: os.kill(pid, signal.SIGUSR2), script=True,
                               extra=["--set", "tft.spares=1"])
    assert "+ mpirun --with-ft ulfm --stdin none -n 9 python -m dsim.train" in err
    assert code == 140, (out, err)
    assert "signal 12" not in err and "spare: every training process" not in err, err
    stopped = STOPPED.findall(out)
    assert len(stopped) == 1, out
    what, step, epoch, in_epoch, name, status = stopped[0]
    step = int(step)
    assert (what, status) == ("SIGUSR2", "140") and 3 <= step < 20 and name == f"network-{epoch}_{in_epoch}", out
    assert LOSS.findall(out) == ref_losses[:step]  # every step up to it, none after
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / f"{name}.commit").exists()  # saved and committed before the exit
    event, = events(tmp_path, "stopped_on_signal")
    assert (event["signal"], event["global_step"], event["checkpoint"]) == ("SIGUSR2", step, name)
    assert "Traceback" not in err and "internal error" not in err
    resumed = mpirun(8, ["-m", "dsim.train", *OPTS, *SAVE_ON_SIGNAL, "--resume", "auto"], cwd=tmp_path, check=0)
    assert f"dsim: resumed from run/checkpoints/rank_0/{name}.h5" in resumed.stdout, resumed.stdout
    assert LOSS.findall(resumed.stdout) == ref_losses[step:]
    final_state_equal(ref_ckpt, ckpt)


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """The signal reaches rank processes at different times, or only some of them (here one): the ranks take the
    largest note at each step's end, so all stop together; SIGTERM exits 143."""
    def one_rank(pid):
        ranks = [p for p in descendants(pid) if os.path.basename(os.readlink(f"/proc/{p}/exe")).startswith("python")]
        assert len(ranks) == 8
        os.kill(max(ranks), signal.SIGTERM)

    code, out, err = signalled(tmp_path, "epoch: 1 step: 2,", one_rank)
    assert code == 143, (out, err)
    (what, step, _, _, name, status), = STOPPED.findall(out)
    assert (what, status) == ("SIGTERM", "143") and 2 <= int(step) < 20
    assert (tmp_path / "run" / "checkpoints" / f"{name}.commit").exists()
    assert "Traceback" not in err and "internal error" not in err


def test_sigterm_to_the_launch_script_is_a_notice_to_the_ranks_and_the_resume_is_bit_identical(ft_reference, tmp_path):
    """A preempting scheduler's SIGTERM before its SIGKILL, sent to the launch script: the script passes it to the
    launcher, which passes it to the ranks themselves, not to mpirun (Open MPI's launcher would kill them at once,
    as it did before 2026-11-28): they stop after the same step, saved, exit 143, and the resume is bit-identical."""
    ref_losses, ref_ckpt = ft_reference("dp2xmp4")
    code, out, err = signalled(tmp_path, "epoch: 1 step: 3,", lambda pid: os.kill(pid, signal.SIGTERM), script=True)
    assert code == 143, (out, err)
    (what, step, epoch, in_epoch, name, status), = STOPPED.findall(out)
    step = int(step)
    assert (what, status) == ("SIGTERM", "143") and 3 <= step < 20 and name == f"network-{epoch}_{in_epoch}", out
    assert LOSS.findall(out) == ref_losses[:step]
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / f"{name}.commit").exists()
    assert "Traceback" not in err and "internal error" not in err
    resumed = mpirun(8, ["-m", "dsim.train", *OPTS, *SAVE_ON_SIGNAL, "--resume", "auto"], cwd=tmp_path, check=0)
    assert LOSS.findall(resumed.stdout) == ref_losses[step:]
    final_state_equal(ref_ckpt, ckpt)
