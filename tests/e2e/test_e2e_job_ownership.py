"""A job belongs to its launcher and owns its checkpoint directory, end to end under mpirun -n 8.

kill -9 of dsim/ft/launcher.py or of a launch script ends mpirun and every rank within a few seconds (the ranks
watch their launcher: dsim.guard.end_with_launcher), and the directory's lease dies with the job, so the job started
again resumes at once. A second job on a directory a living job writes is refused in one line naming the first,
before it touches anything, and the first goes on unharmed. Every job has a timeout; nothing outlives a test.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import BIN, LAUNCHER, ROOT, after_failed_starts, launch_env, mpirun
from dsim.ft.launcher import alive, descendants
from ftjob import LOSS, OPTS

pytestmark = pytest.mark.e2e
LONG = [*OPTS, "--set", "train.epochs=400"]  # 8,000 steps: still training whenever the test acts
GONE_WITHIN = 10.0  # seconds: a launcher polls its caller every 0.25 s, a rank its launcher every 0.5 s (+ load)


def started(cwd, script: bool, extra=()):
    """The long job through the launcher, or with script=True through the launch script; returns the Popen."""
    env = launch_env()
    if script:
        cmd = ["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), str(ROOT / "configs" / "default.yaml"),
               "run/checkpoints", *LONG, *extra]
        env["VIRTUAL_ENV"] = sys.prefix
    else:
        cmd = [sys.executable, str(LAUNCHER), str(BIN / "mpirun"), "-n", "8", sys.executable, "-m", "dsim.train",
               *LONG, *extra]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def until_line(p, text: str, timeout: float = 120) -> list:
    """Read p's stdout until a line contains text (or the timeout, or the end); returns the lines read."""
    lines, timer = [], threading.Timer(timeout, lambda: os.killpg(p.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in p.stdout:
            lines.append(line)
            if text in line:
                break
    finally:
        timer.cancel()
    return lines


def end_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("script", [False, True], ids=["launcher", "launch-script"])
def test_kill_9_of_the_launcher_ends_the_job_and_a_restart_resumes(tmp_path, script):
    p = started(tmp_path, script)
    job = []
    try:
        out = until_line(p, "epoch: 1 step: 9,")
        assert out and "epoch: 1 step: 9," in out[-1], "".join(out) + p.stderr.read()
        job = descendants(p.pid)  # the launcher (under the script), mpirun and the 8 ranks
        ranks = [pid for pid in job if os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")]
        assert len(ranks) >= 8, job
        p.kill()
        killed = time.monotonic()
        while any(alive(pid) for pid in job) and time.monotonic() - killed < GONE_WITHIN:
            time.sleep(0.1)
        left = [pid for pid in job if alive(pid)]
        took = time.monotonic() - killed
        assert not left, f"{len(left)} of the job's {len(job)} processes still running {GONE_WITHIN} s after the kill"
        _, err = p.communicate(timeout=30)
    finally:
        end_all(job)
        p.kill()
        p.wait()
    print(f"every process of the job ended {took:.2f} s after the kill")
    if script:  # the launcher saw its caller go, and stopped mpirun and the ranks
        assert re.search(r"^dsim: error: the launcher's caller \(pid \d+\) is gone; stopping mpirun and its ranks$",
                         err, re.M), err
    else:  # mpirun went with the launcher (PR_SET_PDEATHSIG), and each rank saw it go
        logs = [f.read_text() for f in (tmp_path / "run" / "logs").glob("rank_*.err")]
        assert len([t for t in logs if re.search(r"its launcher \(pid \d+\) is gone; ending", t)]) == 8, logs
    # the job started again at once resumes: its lease died with it
    again = mpirun(8, ["-m", "dsim.train", *OPTS, "--resume", "auto"], cwd=tmp_path, check=0)
    assert "dsim: resumed from run/checkpoints/rank_0/network-1_7.h5 (global step 7: epoch 1 step 7)" in again.stdout
    assert [int(s) for _, s, _ in LOSS.findall(again.stdout)][:3] == [8, 9, 10], again.stdout


def test_a_second_job_on_a_directory_in_use_is_refused_and_the_first_goes_on(tmp_path):
    p = started(tmp_path, script=False, extra=["--set", "checkpoint.save_on_signal=true"])
    try:
        out = until_line(p, "epoch: 1 step: 9,")
        assert out and "epoch: 1 step: 9," in out[-1], "".join(out) + p.stderr.read()
        second = mpirun(8, ["-m", "dsim.train", *OPTS, "--resume", "auto"], cwd=tmp_path, timeout=120)
        errors = [line for line in second.stderr.splitlines() if line.startswith("dsim: ")]
        assert second.returncode == 2 and len(errors) == 1, second.stdout + second.stderr
        first = " ".join(["python -m dsim.train", *LONG, "--set", "checkpoint.save_on_signal=true"])
        assert re.fullmatch(rf"dsim: error: the checkpoint directory run/checkpoints is in use by another job \(pid "
                            rf"\d+ on {re.escape(os.uname().nodename)}, since [-0-9]+ [:0-9]+: {re.escape(first)}\): two "
                            r"jobs must not write one directory; wait for it to end or stop it, or save elsewhere "
                            r"\(checkpoint.directory\)", errors[0]), errors[0]
        assert "resumed" not in second.stdout and not LOSS.findall(second.stdout)
        p.send_signal(signal.SIGUSR2)  # the first job stops after a step it saves (checkpoint.save_on_signal)
        rest, err = p.communicate(timeout=120)
    finally:
        p.kill()
        p.wait()
    out = "".join(out) + rest
    assert p.returncode == 140, out + err
    # no save of it failed (a failed start of mpirun, which the launcher starts again, is not the job's)
    assert not [line for line in after_failed_starts(err).splitlines() if line.startswith("dsim: ")], err
    steps = [int(s) + 10 * (int(e) - 1) for e, s, _ in LOSS.findall(out)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 9, out
    verify = mpirun(1, ["-m", "dsim.inspect", "run/checkpoints", "--verify"], cwd=tmp_path)
    assert verify.returncode == 0 and "run/checkpoints: clean" in verify.stdout, verify.stdout + verify.stderr
    name = re.search(r"saved as (\S+);", out).group(1)
    assert f"verify {name}: ok (8 files" in verify.stdout, verify.stdout
