"""Recovery from a fault of rank 3 to the next finished training step, and the steps and time lost, five ways.

1. restart: the job dies (fault tolerance on, last gasp off); a new job resumes from the latest periodic
   checkpoint (`--resume auto`) and redoes the steps since;
2. last gasp: the survivors save the newest consistent step (tft.ttp) and exit; a new job resumes from it;
3. healing: the survivors spawn a replacement and train on in the same job (tft.arf);
4. spares: a warm spare started with the job (tft.spares: 1, mpirun -n 9) takes the dead rank's place;
5. uce: rank 3's memory fails (fault.kind=uce) and is repaired from its replica in the job (tft.uce): in place,
   while the other ranks go on (tft.uce_in_place, the default: the fault strikes in a forward pass).
Rank 3 is killed (or its memory damaged) in the forward pass of step KILL, with a periodic checkpoint every
EVERY steps before it (KILL itself not a step that saves); training ends one step after KILL, as no figure
needs a later step. Times come from metrics.jsonl: the victim's `fault` event (written just before SIGKILL)
and the `step` events (rank 0, wall clock). Per way:
- to the next finished step: from the fault to the step after the one training went on from;
- progress regained: from the fault to step KILL finished (the job is where it would have been);
- time lost: step KILL's finish minus step KILL-1's, less one ordinary step (the median step of the job
  before the fault): what the fault cost, whatever part of step KILL had run before it;
- steps lost: the last step finished before the fault (KILL - 1) minus the step training went on from.
The targets (issue 21) compare the time lost: restart / healing with a spare >= 20, restart / UCE repair >= 100;
an in-job way's time lost counts there as at least its repair's own time (`repair took`): repaired in place,
the faulted step can take no longer than an ordinary one, within the steps' noise.
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

from dsim.ft.launcher import supervise

from .harness import BIN, ROOT, launch_env, row, scratch_dir

NAME = "recovery"
TITLE = "Recovery from kill -9 (or a UCE) of rank 3 to the next finished step (dp2 x mp4)"
WAYS = ["restart", "last_gasp", "healing", "spares", "uce"]
LABELS = {"restart": "restart + load of the last periodic checkpoint", "last_gasp": "last gasp + restart",
          "healing": "in-process healing (spawn a replacement)", "spares": "in-process healing (a warm spare)",
          "uce": "UCE repaired in place"}
TARGETS = {"spares": 20, "uce": 100}  # restart's time lost / this way's, at least (issue 21, target 6)
SIZES = {  # full and quick: the default model (configs/default.yaml)
    "full": {"kill": 31, "every": 16, "repeats": 3, "timeout": 900, "overrides": []},  # a restart redoes 14 steps
    "quick": {"kill": 15, "every": 10, "repeats": 3, "timeout": 600, "overrides": []},
    "toy": {"kill": 9, "every": 5, "repeats": 1, "timeout": 180,  # the smoke test's: one repeat
            "overrides": ["model.hidden=[16,32,32,16]", "data.num_samples=640"]},
}


def ft_env() -> dict:
    """launch_env() plus what launch/ft.sh sets (ULFM over TCP), and its mpirun options."""
    out = subprocess.run(["bash", "-c", f". {ROOT}/launch/ft.sh && export DSIM_FT_MPIRUN_ARGS && env -0"],
                         capture_output=True, check=True, env={})
    extra = dict(i.split("=", 1) for i in out.stdout.decode().split("\0") if "=" in i and not i.startswith(("PWD=", "SHLVL=", "_=")))
    return {**launch_env(), **extra}


def job(args, cwd, timeout, log, processes=8):
    """One `mpirun -n 8 python -m dsim.train` under ULFM; returns its exit code (output appended to log)."""
    env = ft_env()
    cmd = [sys.executable, str(ROOT / "dsim" / "ft" / "launcher.py"),  # as the launch scripts run it: a failed start retried
           str(BIN / "mpirun"), *env.pop("DSIM_FT_MPIRUN_ARGS").split(), "-n", str(processes), sys.executable,
           "-m", "dsim.train", *map(str, args)]
    with open(log, "a") as out:
        out.write("+ " + " ".join(cmd) + "\n")
        out.flush()
        with subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True) as p:
            how = supervise(p, timeout, stalls=False)  # a launcher stall: the launcher stops it
            p.wait()
    if how == "timeout":
        raise RuntimeError(f"dsim.train timed out after {timeout} s; log {log}")
    return p.returncode


def measure(way: str, params: dict, d, log) -> dict:
    """Kill, recover one way, and read the times from metrics.jsonl."""
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    base = ["--config", ROOT / "configs" / "default.yaml", "--set", "output.dir=run", "--set", "output.progress_bar=false",
            "--set", f"checkpoint.save_checkpoint_steps={params['every']}", "--set", "checkpoint.save_checkpoint_epochs=null",
            "--set", "checkpoint.keep_checkpoint_max=2", "--set", f"train.steps_per_epoch={params['kill'] + 1}",
            "--set", "train.epochs=1"]
    for o in params["overrides"]:
        base += ["--set", o]
    tft = {"restart": [], "last_gasp": ["--set", "tft.ttp=true"], "healing": ["--set", "tft.arf=true"],
           "spares": ["--set", "tft.spares=1"], "uce": ["--set", "tft.uce=true"]}[way]
    kill = ["--set", f"fault.kind={'uce' if way == 'uce' else 'kill'}", "--set", "fault.rank=3",
            "--set", "fault.at=forward", "--set", f"fault.step={params['kill']}"]
    first = job([*base, *tft, *kill], d, params["timeout"], log, 9 if way == "spares" else 8)
    if way in IN_JOB:
        assert first == 0, f"the {way} job failed ({first}); log {log}"
    else:
        assert first != 0, f"the killed job exited 0; log {log}"
        second = job([*base, *tft, "--resume", "auto"], d, params["timeout"], log)
        assert second == 0, f"the resumed job failed ({second}); log {log}"
    events = [json.loads(line) for line in (d / "run" / "metrics.jsonl").read_text().splitlines()]
    killed = next(e for e in events if e["event"] == "fault")
    before = [e for e in events if e["event"] == "step" and e["time"] < killed["time"]]
    after = [e for e in events if e["time"] > killed["time"]]
    resumed_from = next(e["global_step"] for e in after if e["event"] == IN_JOB.get(way, "train_begin"))
    steps = {e["global_step"]: e["time"] for e in after if e["event"] == "step"}
    ordinary = statistics.median(b["time"] - a["time"] for a, b in zip(before[1:], before[2:]))  # not the first
    previous = before[-1]["time"]  # step KILL - 1 finished
    repaired = next((e for e in after if e["event"] in ("heal", "uce_repair")), None)
    return {"seconds": steps[resumed_from + 1] - killed["time"],      # to the next finished step
            "regained_s": steps[params["kill"]] - killed["time"],     # to the killed step finished after all
            "lost_s": steps[params["kill"]] - previous - ordinary,    # what the fault cost
            "step_s": ordinary, "repair_ms": repaired and repaired.get("repair_ms"),
            "before_fault_s": killed["time"] - previous,              # the faulted step's work, lost by every way
            **({"to_repaired_s": repaired["time"] - killed["time"]} if repaired else {}),  # noticed, agreed, repaired
            "steps_lost": params["kill"] - 1 - resumed_from, "resumed_from": resumed_from}


IN_JOB = {"healing": "heal", "spares": "heal", "uce": "uce_repair"}  # ways that stay in the job: the event of the repair


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
    ways = [w for w in WAYS if all(w in r for r in reps)]  # results stored before a way existed lack it
    figure = {k: {w: [r[w][k] for r in reps] for w in ways if k in reps[0][w]}
              for k in ("seconds", "regained_s", "lost_s", "steps_lost")}
    rows = [row(f"kill -> next finished step, {LABELS[w]}", figure["seconds"][w], "s") for w in ways]
    rows += [row(f"kill -> step {params['kill']} finished (progress regained), {LABELS[w]}", figure["regained_s"][w], "s")
             for w in ways]
    rows += [row(f"time lost (step {params['kill']} took longer than an ordinary step by), {LABELS[w]}",
                 figure["lost_s"][w], "s") for w in figure["lost_s"]]
    rows += [row(f"steps lost, {LABELS[w]}", figure["steps_lost"][w], "steps", target=None if w == "restart" else "0",
                 ok=None if w == "restart" else max(figure["steps_lost"][w]) == 0) for w in ways]
    ratios = {}
    for w in ways[1:]:
        if w in figure["lost_s"] and "restart" in figure["lost_s"]:
            # an in-job way's time lost is taken as at least its repair's own time: a repair in place can leave
            # the faulted step no longer than an ordinary one, within the steps' noise, and a ratio to that is noise
            ratios[w] = [r["restart"]["lost_s"] / max(r[w]["lost_s"], (r[w].get("repair_ms") or 1) / 1000)
                         for r in reps]
            want = TARGETS.get(w)
            floor = " (time lost at least the repair's own)" if all(r[w].get("repair_ms") for r in reps) else ""
            rows.append(row(f"time lost: restart from disk / {LABELS[w]}{floor}", ratios[w], "x",
                            target=f">= {want}" if want else None,
                            ok=statistics.median(ratios[w]) >= want if want else None))
    repaired = [w for w in ways if all(r[w].get("repair_ms") for r in reps)]  # the ways that stay in the job
    rows += [row(f"the repair alone (agreement to training going on: `repair took`), {LABELS[w]}",
                 [r[w]["repair_ms"] for r in reps], "ms") for w in repaired]
    rows += [row(f"the faulted step's work before the fault (lost where the step is redone: all but in place), {LABELS[w]} "
                 "(diagnostic)", [r[w]["before_fault_s"] * 1000 for r in reps], "ms")
             for w in repaired if all("before_fault_s" in r[w] for r in reps)]
    rows += [row(f"of the time lost, from the fault to the repair's end (noticed, agreed, repaired), {LABELS[w]} "
                 "(diagnostic)", [r[w]["to_repaired_s"] * 1000 for r in reps], "ms")
             for w in repaired if all("to_repaired_s" in r[w] for r in reps)]
    rows += [row(f"time lost: restart from disk / the repair alone, {LABELS[w]} (diagnostic)",
                 [r["restart"]["lost_s"] * 1000 / r[w]["repair_ms"] for r in reps], "x") for w in repaired
             if "restart" in figure["lost_s"]]
    for w in ways[1:]:
        rows.append(row(f"time to regain the progress: restart from disk / {LABELS[w]}",
                        [r["restart"]["regained_s"] / r[w]["regained_s"] for r in reps], "x"))
    return {"params": params, "figures": {**figure, "restart_over": ratios}, "repeats": reps, "rows": rows}


def rows_again(suite: dict) -> list:
    """Rows of a stored result (python -m bench --retable)."""
    return summarize(suite["params"], suite["repeats"])["rows"]
