"""Recovery time from a kill -9 to the next finished training step, and the steps lost, three ways.

1. restart: the job dies (fault tolerance on, last gasp off); a new job resumes from the latest periodic
   checkpoint (`--resume auto`) and redoes the steps since;
2. last gasp: the survivors save the newest consistent step (tft.ttp) and exit; a new job resumes from it;
3. healing: the survivors spawn a replacement and train on in the same job (tft.arf).
Rank 3 is killed in the forward pass of step KILL, with a periodic checkpoint every EVERY steps before it.
Times come from metrics.jsonl: the victim's `fault` event (written just before SIGKILL) and the `step`
events (rank 0, wall clock): of the step after the resume point (the next finished step), and of step KILL
(the progress the job had is regained). Steps lost = the last step finished before the kill (KILL - 1)
minus the step training went on from.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from dsim.ft.launcher import StallWatch

from .harness import BIN, ROOT, launch_env, row, scratch_dir

NAME = "recovery"
TITLE = "Recovery from kill -9 of rank 3 to the next finished step (dp2 x mp4)"
WAYS = ["restart", "last_gasp", "healing"]
LABELS = {"restart": "restart + load of the last periodic checkpoint", "last_gasp": "last gasp + restart",
          "healing": "in-process healing (spawn a replacement)"}
SIZES = {
    "full": {"kill": 35, "every": 20, "repeats": 3, "timeout": 900, "overrides": []},
    "quick": {"kill": 35, "every": 20, "repeats": 3, "timeout": 600, "overrides": ["model.hidden=[128,1024,1024,128]"]},
    "toy": {"kill": 9, "every": 5, "repeats": 1, "timeout": 180,  # the smoke test's: one repeat
            "overrides": ["model.hidden=[16,32,32,16]", "data.num_samples=640"]},
}


def ft_env() -> dict:
    """launch_env() plus what launch/ft.sh sets (ULFM over TCP), and its mpirun options."""
    out = subprocess.run(["bash", "-c", f". {ROOT}/launch/ft.sh && export DSIM_FT_MPIRUN_ARGS && env -0"],
                         capture_output=True, check=True, env={})
    extra = dict(i.split("=", 1) for i in out.stdout.decode().split("\0") if "=" in i and not i.startswith(("PWD=", "SHLVL=", "_=")))
    return {**launch_env(), **extra}


def job(args, cwd, timeout, log):
    """One `mpirun -n 8 python -m dsim.train` under ULFM; returns its exit code (output appended to log)."""
    env = ft_env()
    cmd = [str(BIN / "mpirun"), *env.pop("DSIM_FT_MPIRUN_ARGS").split(), "-n", "8", sys.executable, "-m", "dsim.train",
           *map(str, args)]
    with open(log, "a") as out:
        out.write("+ " + " ".join(cmd) + "\n")
        out.flush()
        with subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True) as p:
            watch, start = StallWatch(p.pid), time.time()
            while True:
                try:
                    return p.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    if watch.stalled(time.time()):  # every rank ended, mpirun did not (dsim.ft.launcher)
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        out.write("(bench: mpirun stalled after every rank had ended; stopped it)\n")
                        return 1
                    if time.time() - start > timeout:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        raise RuntimeError(f"dsim.train timed out after {timeout} s; log {log}")


def measure(way: str, params: dict, d, log) -> dict:
    """Kill, recover one way, and read the times from metrics.jsonl."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    base = ["--config", ROOT / "configs" / "default.yaml", "--set", "output.dir=run", "--set", "output.progress_bar=false",
            "--set", f"checkpoint.save_checkpoint_steps={params['every']}", "--set", "checkpoint.save_checkpoint_epochs=null",
            "--set", "checkpoint.keep_checkpoint_max=2", "--set", f"train.steps_per_epoch={params['kill'] + 5}",
            "--set", "train.epochs=1"]
    for o in params["overrides"]:
        base += ["--set", o]
    tft = {"restart": [], "last_gasp": ["--set", "tft.ttp=true"], "healing": ["--set", "tft.arf=true"]}[way]
    kill = ["--set", "fault.kind=kill", "--set", "fault.rank=3", "--set", "fault.at=forward",
            "--set", f"fault.step={params['kill']}"]
    first = job([*base, *tft, *kill], d, params["timeout"], log)
    if way == "healing":
        assert first == 0, f"the healed job failed ({first}); log {log}"
    else:
        assert first != 0, f"the killed job exited 0; log {log}"
        second = job([*base, *tft, "--resume", "auto"], d, params["timeout"], log)
        assert second == 0, f"the resumed job failed ({second}); log {log}"
    events = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    killed = next(e for e in events if e["event"] == "fault")
    after = [e for e in events if e["time"] > killed["time"]]
    mark = "heal" if way == "healing" else "train_begin"  # the step training went on from
    resumed_from = next(e["global_step"] for e in after if e["event"] == mark)
    steps = {e["global_step"]: e["time"] for e in after if e["event"] == "step"}
    return {"seconds": steps[resumed_from + 1] - killed["time"],      # to the next finished step
            "regained_s": steps[params["kill"]] - killed["time"],     # to the killed step finished after all
            "steps_lost": params["kill"] - 1 - resumed_from, "resumed_from": resumed_from}


def run(params: dict, workdir, opts) -> dict:
    d = scratch_dir(workdir, NAME)
    log = opts.logdir / f"{NAME}.log"
    log.write_text("")
    reps = []
    try:
        for _ in range(params["repeats"]):
            reps.append({way: measure(way, params, d / way, log) for way in WAYS})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return summarize(params, reps)


def summarize(params: dict, reps: list) -> dict:
    secs = {w: [r[w]["seconds"] for r in reps] for w in WAYS}
    lost = {w: [r[w]["steps_lost"] for r in reps] for w in WAYS}
    regained = {w: [r[w]["regained_s"] for r in reps] for w in WAYS}
    rows = [row(f"kill -> next finished step, {LABELS[w]}", secs[w], "s") for w in WAYS]
    rows += [row(f"kill -> step {params['kill']} finished (progress regained), {LABELS[w]}", regained[w], "s")
             for w in WAYS]
    rows += [row(f"steps lost, {LABELS[w]}", lost[w], "steps", target=None if w == "restart" else "0",
                 ok=None if w == "restart" else max(lost[w]) == 0) for w in WAYS]
    healing = [r["restart"]["seconds"] / r["healing"]["seconds"] for r in reps]
    gasp = [r["restart"]["seconds"] / r["last_gasp"]["seconds"] for r in reps]
    rows.append(row("time to the next step: restart from disk / in-process healing", healing, "x",
                    target=">= 20", ok=sorted(healing)[len(healing) // 2] >= 20))
    rows.append(row("time to the next step: restart from disk / last gasp + restart", gasp, "x"))
    rows.append(row("time to regain the progress: restart from disk / last gasp + restart",
                    [r["restart"]["regained_s"] / r["last_gasp"]["regained_s"] for r in reps], "x"))
    rows.append(row("time to regain the progress: restart from disk / in-process healing",
                    [r["restart"]["regained_s"] / r["healing"]["regained_s"] for r in reps], "x"))
    return {"params": params, "figures": {"seconds": secs, "regained_s": regained, "steps_lost": lost,
                                          "restart_over_healing": healing,
                                          "restart_over_last_gasp": gasp},
            "repeats": reps, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["repeats"])["rows"]
