"""A kill matrix across real hosts (issue 52): random host, random point, random scheme; what each case recovered.

    $ python -m bench.kill_matrix --cases 24 --seed 1          # as root, on the test cluster (dsim.cluster)

Each case runs the default model (dp2 x mp4, small widths, 4 epochs of 4 steps, a checkpoint at each epoch's end,
node-local disks) on a cluster of 4 hosts x 2 ranks (each slice's two holders on two hosts), plus a host of its own
for the warm spares of the `arf` scheme, through the launch scripts as a user runs them. A fault plan
($DSIM_FAULT_PLAN) strikes once, drawn from the seed:
- the host: one of node2..node4 (node1 runs mpirun: its loss is the launch node's, the job's end with nothing on it
  left to watch);
- the kind: `host`, the host crashes (its Open MPI daemon, prted, and its ranks SIGKILLed at once), or `node`, its
  ranks die at once and the daemon lives;
- the point: in a step (forward, allreduce, update), in a save (half-way through the victim's file) or before the
  commit, at a step drawn at random;
- the scheme (dsim.campaign.strategies): periodic (restart from the last periodic checkpoint), ttp (the last gasp),
  arf (warm spares take the dead ranks' places in the job), elastic (go on with fewer ranks).
When the job ends unfinished, the recover script resumes on the hosts left (a host crash: the hostfile without it,
8 ranks on its 3 hosts' slots; otherwise the same hosts), from the newest committed checkpoint on their disks; when
none was committed yet, the save script starts over.

Per case: whether it recovered (training reached its last step; for the schemes that promise it, every step's loss
and the final checkpoint's tensors equal to an uninterrupted run's, bit for bit), the steps lost (steps computed
more than once across the case's jobs: the work redone), whether any job hung (stopped at its timeout), what was left
running on any host after each job, and the exit status and the `dsim: error:` line of the first job. With Open MPI
5.0 a host crash ends the job whatever the scheme (docs/design/node-faults.md): every scheme then restarts.

Writes kill-matrix.json in the output directory (-o) and prints a table; exits 1 when a case did not recover or hung.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "default.yaml"
STEPS = 16
ARGS = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640", "--set", "train.steps_per_epoch=4",
        "--set", "train.epochs=4", "--set", "output.progress_bar=false"]
HOSTS, SLOTS, RANKS = 4, 2, 8   # training hosts; the arf scheme's spares get a host of their own (host 5)
KINDS = ("host", "node", "kill")  # a host's crash, its ranks lost (daemon alive), or one rank killed (--kinds)
POINTS = ("forward", "allreduce", "update", "save", "commit")
SCHEMES = ("periodic", "ttp", "arf", "elastic")
JOB_TIMEOUT = 240


def draw(seed: int, cases: int, kinds=KINDS[:2]) -> list[dict]:
    """The cases, from the seed: each a victim host and rank, a kind, a point, a step and a scheme. The schemes
    and kinds go round (every one met as often as the count allows); host, rank, point and step are random."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(cases):
        host = int(rng.integers(2, HOSTS + 1))
        point = POINTS[int(rng.integers(len(POINTS)))]
        # a save's points strike at the next save at or after the step (every 4 steps): steps 2..13 leave one
        step = int(rng.integers(2, 14))
        out.append({"case": i + 1, "host": host, "rank": (host - 1) * SLOTS + int(rng.integers(SLOTS)),
                    "kind": kinds[(i // len(SCHEMES)) % len(kinds)], "point": point, "step": step,
                    "scheme": SCHEMES[i % len(SCHEMES)]})
    return out


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def metrics(run_dir: Path) -> list[tuple[int, float]]:
    return [(e["global_step"], e["loss"]) for e in events(run_dir) if e.get("event") == "step"]


def seconds_lost(runs: list) -> float | None:
    """From the fault (its event's time) to the first step after the recovery: in the same job, the first step logged
    after its `recovered` event (a repair in the job, an elastic shrink); else the first step of the job after (a
    restart). (Rank 0 may log the step it was in after the fault struck elsewhere: a step then redone.)"""
    first = events(runs[0])
    fault = next((e["time"] for e in first if e.get("event") == "fault"), None)
    recovered = next((e["time"] for e in first if e.get("event") == "recovered" and fault and e["time"] >= fault), None)
    if fault is None:
        return None
    if recovered is not None:
        after = [e["time"] for e in first if e.get("event") == "step" and e["time"] >= recovered]
    else:
        after = [e["time"] for r in runs[1:] for e in events(r) if e.get("event") == "step"]
    return round(min(after) - fault, 1) if after else None


def tensors(path: Path) -> dict:
    import h5py
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, item: found.__setitem__(name, item[()]) if isinstance(item, h5py.Dataset) else None)
    return found


def reference(workdir: Path, env: dict) -> tuple[Path, dict]:
    """The uninterrupted run on one host: its directory and {step: loss}."""
    d = workdir / "reference"
    if not (d / "run" / "metrics.jsonl").exists():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        subprocess.run(["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), str(CONFIG), str(d / "ckpt"),
                        *ARGS, "--set", "output.dir=run"], cwd=d, env={**env, "HOSTFILE": ""}, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=JOB_TIMEOUT)
    return d, dict(metrics(d / "run"))


def job(cluster, script: str, args: list, cwd: Path, env: dict, timeout: float = JOB_TIMEOUT) -> dict:
    """One launch script run on node1 (its own process group), stopped at its timeout: its status, stderr, time."""
    import signal
    t0 = time.monotonic()
    proc = subprocess.Popen(cluster.command(1, ["bash", str(ROOT / "launch" / script), *map(str, args)], cwd),
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        hung = True
    name = str(args[-1]).split("=", 1)[-1]  # (the last argument: output.dir=NAME)
    (Path(cwd) / f"{name}.out").write_text(out)
    (Path(cwd) / f"{name}.err").write_text(err)
    return {"status": proc.returncode, "hung": hung, "seconds": round(time.monotonic() - t0, 1), "stdout": out,
            "stderr": err}


def left_running(cluster, hosts, wait: float = 10.0) -> dict:
    """{host: pids} of the processes still on the hosts (other than their namespace keepers), after `wait` s."""
    until = time.monotonic() + wait
    while True:
        left = {h: [p for p in cluster.processes(h) if p != cluster.keepers[h]] for h in hosts}
        left = {h: p for h, p in left.items() if p}
        if not left or time.monotonic() > until:
            return left
        time.sleep(0.2)


def final_files(cluster, hosts) -> dict:
    """rank -> its newest file of the last step (network*-4_4.h5) over the hosts' disks."""
    found = {}
    for h in hosts:
        for path in (cluster.disk(h) / "ckpt").glob("rank_*/*-4_4.h5"):
            r = int(path.parent.name.split("_")[1])
            if r not in found or path.stat().st_mtime > found[r].stat().st_mtime:
                found[r] = path
    return found


def run_case(cluster, case: dict, ref_dir: Path, ref_losses: dict, workdir: Path, env: dict) -> dict:
    """One case on a cluster of HOSTS + 1 hosts (made by the caller, its disks emptied here first)."""
    from dsim.campaign.strategies import STRATEGIES
    d = workdir / f"case{case['case']}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    all_hosts = list(range(1, HOSTS + 2))
    for h in all_hosts:
        shutil.rmtree(cluster.disk(h) / "ckpt", ignore_errors=True)
    plan = d / "plan.json"
    plan.write_text(json.dumps({"faults": [{"rank": case["rank"], "kind": case["kind"], "at": case["point"],
                                            "step": case["step"], **({"node_size": SLOTS} if case["kind"] == "node"
                                                                     else {})}]}))
    scheme = STRATEGIES[case["scheme"]]
    settings = [x for s in scheme.settings for x in ("--set", s)]
    if scheme.spares:
        settings += ["--set", f"tft.spares={SLOTS}"]
    training = [f"{cluster.hostname(h)} slots={SLOTS}" for h in range(1, HOSTS + 1)]
    hostfile = d / "hostfile"  # the training hosts, then the spares' own host
    hostfile.write_text("\n".join(training + [f"{cluster.hostname(HOSTS + 1)} slots={SLOTS}"]) + "\n")
    ckpt = f"{cluster.disk_path}/ckpt"
    base = {**env, **cluster.env(), "VIRTUAL_ENV": sys.prefix, "HOSTFILE": str(hostfile)}
    first = job(cluster, "run_parallel_save_ckpt.sh", [CONFIG, ckpt, *ARGS, *settings, "--set", "fault.kind=plan",
                                                       "--set", "output.dir=first"],
                d, {**base, "DSIM_FAULT_PLAN": str(plan)})
    fired = list(Path(f"{plan}.fired").glob("*"))
    lost_host = case["kind"] == "host" and first["status"] != 0
    hosts_left = [h for h in all_hosts if not (lost_host and h == case["host"])]
    errors = [x for x in first["stderr"].splitlines() if x.startswith("dsim: error:")]
    # the job's verdict: the launcher's on a lost host (said last: before it, a survivor on mpirun's host that saw every
    # other host's ranks gone at once, as Open MPI ended them, may have said it was cut off from the majority), else
    # the first rank's
    lost = [x for x in errors if x.startswith("dsim: error: host ") and " lost: " in x]
    row = {**case, "fired": bool(fired), "first": {k: first[k] for k in ("status", "hung", "seconds")},
           "line": (lost or errors or [""])[0], "errors": errors, "left": {}, "jobs": 1}
    if lost_host:  # what is left of the crashed host goes with it (its namespaces' keeper and disk stay)
        row["crashed_host_left"] = len(cluster.kill_host(case["host"]))
    row["left"].update({str(h): p for h, p in left_running(cluster, hosts_left).items()})
    # the survivors' rescue files (dsim.ft.rescue) on each disk left: what the resume completes
    row["rescue_files"] = {str(h): sorted(str(p.relative_to(cluster.disk(h) / "ckpt")) for p in
                                          (cluster.disk(h) / "ckpt").glob("ttp_checkpoints/rescue-step_*/rank_*/*.h5"))
                           for h in hosts_left}
    runs = [d / "first"]
    if first["status"] != 0 and not first["hung"]:
        # on the hosts left: the training hosts' slots widened so that 8 ranks fit, the spares' host as before
        left = [h for h in range(1, HOSTS + 1) if h in hosts_left]
        per = math.ceil(RANKS / len(left))
        hostfile2 = d / "hostfile-left"
        hostfile2.write_text("\n".join([f"{cluster.hostname(h)} slots={per}" for h in left] +
                                       [f"{cluster.hostname(HOSTS + 1)} slots={SLOTS}"]) + "\n")
        second = job(cluster, "run_parallel_recover_ckpt.sh", [CONFIG, ckpt, *ARGS, *settings,
                                                                "--set", "output.dir=second"],
                     d, {**base, "HOSTFILE": str(hostfile2)})
        if second["status"] != 0 and "dsim: error: no committed checkpoint in " in second["stderr"]:
            # struck before the first checkpoint was committed: nothing to resume from, so start over, as a user would
            shutil.rmtree(d / "second", ignore_errors=True)
            second = job(cluster, "run_parallel_save_ckpt.sh", [CONFIG, ckpt, *ARGS, *settings,
                                                                 "--set", "output.dir=second"],
                         d, {**base, "HOSTFILE": str(hostfile2)})
            row["started_over"] = True
        row["second"] = {k: second[k] for k in ("status", "hung", "seconds")}
        row["jobs"] = 2
        if second["status"] != 0:
            row["second_line"] = next((x for x in second["stderr"].splitlines() if x.startswith("dsim: error:")),
                                      second["stderr"][-300:])
        runs.append(d / "second")
        for h, p in left_running(cluster, hosts_left).items():
            row["left"][str(h)] = row["left"].get(str(h), []) + p
    logged = [s for r in runs for s in metrics(r)]
    last = {}
    for step, loss in logged:
        last[step] = loss  # a step redone: its last value
    row["steps_lost"] = len(logged) - len(set(s for s, _ in logged))
    row["seconds_lost"] = seconds_lost(runs)
    row["hung"] = first["hung"] or row.get("second", {}).get("hung", False)
    finished = sorted(last) == list(range(1, STEPS + 1))
    exact = None
    if finished and scheme.exact:
        files = final_files(cluster, hosts_left)
        same = [r in files and all(np.array_equal(a, b) for a, b in zip(
            tensors(ref_dir / "ckpt" / f"rank_{r}" / "network-4_4.h5").values(), tensors(files[r]).values()))
            for r in range(RANKS)]
        exact = last == ref_losses and all(same)
    row["exact"] = exact
    row["recovered"] = bool(row["fired"] and finished and exact is not False and not row["hung"])
    return row


def table(rows: list) -> str:
    head = ("case", "host", "kind", "point", "step", "scheme", "1st exit", "jobs", "steps lost", "s lost",
            "recovered", "exact", "left")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join(map(str, (
            r["case"], f"node{r['host']}", r["kind"], r["point"], r["step"], r["scheme"],
            "hung" if r["first"]["hung"] else r["first"]["status"], r["jobs"], r["steps_lost"],
            "-" if r.get("seconds_lost") is None else r["seconds_lost"],
            "yes" if r["recovered"] else "NO", {None: "-", True: "yes", False: "NO"}[r["exact"]],
            sum(len(p) for p in r["left"].values())))))
    return "\n".join(lines)


def by_scheme(rows: list) -> str:
    """Per kind and scheme: cases, recovered, steps lost (mean, max) and seconds from the fault to the next step
    (median)."""
    head = ("kind", "scheme", "cases", "recovered", "steps lost (mean / max)", "s to the next step (median)")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for kind in KINDS:
        for scheme in SCHEMES:
            some = [r for r in rows if (r["kind"], r["scheme"]) == (kind, scheme)]
            if not some:
                continue
            lost = [r["steps_lost"] for r in some]
            secs = sorted(r["seconds_lost"] for r in some if r.get("seconds_lost") is not None)
            lines.append(" | ".join(map(str, (
                kind, scheme, len(some), sum(r["recovered"] for r in some),
                f"{sum(lost) / len(lost):.1f} / {max(lost)}", f"{secs[len(secs) // 2]:.1f}" if secs else "-"))))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kill_matrix", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=24)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default="host,node", help=f"the kinds of fault that go round, among {','.join(KINDS)} "
                   "(default host,node)")
    p.add_argument("--only", default="", help="comma-separated case numbers to run (of those drawn)")
    p.add_argument("-o", "--output", default="kill-matrix", help="the output directory (default kill-matrix)")
    args = p.parse_args(argv)
    from dsim.cluster import Cluster, leftovers, unavailable
    why = unavailable()
    if why:
        print(f"kill_matrix: error: no cluster of namespaces here: {why}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import launch_env
    env = launch_env()
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    kinds = tuple(args.kinds.split(","))
    if not kinds or any(k not in KINDS for k in kinds):
        p.error(f"--kinds: among {','.join(KINDS)}, got {args.kinds!r}")
    cases = draw(args.seed, args.cases, kinds)
    if args.only:
        keep = {int(x) for x in args.only.split(",")}
        cases = [c for c in cases if c["case"] in keep]
    ref_dir, ref_losses = reference(out, env)
    rows = []
    name = f"km{os.getpid()}"
    with Cluster(hosts=HOSTS + 1, slots=SLOTS, name=name) as cluster:
        for case in cases:
            row = run_case(cluster, case, ref_dir, ref_losses, out, env)
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            (out / "kill-matrix.json").write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=1))
    assert leftovers(name) == [], leftovers(name)
    print(table(rows))
    print()
    print(by_scheme(rows))
    bad = [r["case"] for r in rows if not r["recovered"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases recovered; steps lost {sum(r['steps_lost'] for r in rows)} "
          f"in all (max {max((r['steps_lost'] for r in rows), default=0)}); hung: "
          f"{sum(r['hung'] for r in rows)}" + (f"; not recovered: cases {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
