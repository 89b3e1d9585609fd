"""A fault campaign on real jobs (python -m dsim.campaign), its report checked against the jobs' own metrics;
and Ctrl-C in the middle of one."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import launch_env, mpirun, run_command
from dsim.campaign import failures
from dsim.campaign.jobs import carrying

pytestmark = pytest.mark.e2e

SMALL = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640"]
DURATION, MTBF = 26, 12  # seed 49's plan: kills at 8.1 s and 23.6 s
# a restart (kill seen, job relaunched, resumed, one step trained) takes about 3 s here alone, 5.5-7 s beside a
# second test worker, 7-9 s beside that and a busy core, 10-11.5 s with both workers' 8-rank jobs and more (load
# average 20 on 2 cores): the plan leaves room for one of 13 s within the budget
RESTART = 13


def seed_with_a_late_failure():
    """A seed whose plan has two kills: the first after the job is up and has saved, early enough for its
    restart to finish steps even when it takes RESTART seconds; the second after that restart, in the last
    2.5 s of the budget, so its restart (3 s at the least) ends after the budget: the campaign waits for it.
    (A kill due during a restart would strike at the restarted job's first fault point.)"""
    for seed in range(1000):
        plan = failures.draw(seed, MTBF, DURATION, ["kill"], 8)
        if len(plan) != 2:
            continue
        first, second = plan[0].offset, plan[1].offset
        if first >= 7 and second - first >= RESTART + 2 and DURATION - 2.5 <= second <= DURATION - 0.5:
            return seed


def metrics(row, until=None):
    lines = (Path(row["dir"]) / "run" / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["time"] <= (until or row["end"])]


def left_behind(pid):
    """Processes still carrying a job id of the campaign with this pid."""
    return carrying(f"{pid}-", prefix=True)


def test_campaign_report_matches_the_jobs_metrics(tmp_path):
    seed = seed_with_a_late_failure()
    out = tmp_path / "report"
    proc = run_command([sys.executable, "-m", "dsim.campaign", *SMALL, "--mtbf", f"{MTBF}s", "--duration",
                        f"{DURATION}s", "--faults", "kill", "--strategy", "periodic,ttp", "--save-every", "10",
                        "--seed", str(seed), "-o", str(out)], tmp_path, timeout=420, check=0)
    doc = json.loads((out / "report.json").read_text())
    assert doc["finished"] and [(r["strategy"], r["save_every"]) for r in doc["combinations"]] == \
        [("periodic", 10), ("ttp", 10)]
    ref = doc["fault_free"]
    ref_steps = [e for e in metrics(ref) if e["event"] == "step"]
    assert ref["steps"] == ref_steps[-1]["global_step"] and not any(e["event"] == "fault" for e in metrics(ref))
    table = proc.stdout.splitlines()
    for row in doc["combinations"]:
        events, everything = metrics(row), metrics(row, until=row["settled"])
        steps = [e for e in events if e["event"] == "step"]
        faults = [e for e in events if e["event"] == "fault"]
        fired = list((out / f"{row['strategy']}-every10" / "plan.json.fired").iterdir())
        # steps counted, failures injected (the plan's markers) = failures in the job's metrics = seen
        assert row["steps"] == steps[-1]["global_step"]
        assert row["goodput"] == round(row["steps"] / row["seconds"], 3)
        assert row["goodput_fraction"] == pytest.approx(row["goodput"] / ref["fault_free_rate"], abs=1e-3)
        assert len(fired) == len(faults) == row["failures_injected"] == row["failures_seen"] == 2
        # the second failure's restart ended after the budget: the campaign waited for it, then stopped the job
        assert row["survived"] == 2 and row["unrecovered"] == 0 and row["restarts"] == 2
        assert row["end"] < row["failures"][1]["time"] + row["failures"][1]["recovery_s"] <= row["settled"]
        assert row["settled"] < row["end"] + 60
        for f, rec in zip(faults, row["failures"]):
            resumed = next(e for e in everything if e["event"] == "train_begin" and e["time"] > f["time"])
            finished = f["global_step"] - 1  # the fault strikes inside step N
            # what the scheme promises: back to the last multiple of the interval; or nothing lost (the last
            # gasp saves step N itself when the survivors had finished its update)
            want = [finished - finished % 10] if row["strategy"] == "periodic" else [finished, finished + 1]
            assert resumed["global_step"] in want and resumed["global_step"] == rec["resumed_from"], (f, resumed)
            assert rec["steps_lost"] == max(0, finished - resumed["global_step"]) == rec["predicted_lost"]
            assert rec["steps_lost"] == (finished % 10 if row["strategy"] == "periodic" else 0)
            nxt = next(e for e in everything if e["event"] == "step" and e["time"] > resumed["time"]
                       and e["global_step"] == rec["resumed_from"] + 1)
            assert rec["recovery_s"] == pytest.approx(nxt["time"] - f["time"], abs=1e-3)
        # bit for bit: every loss against the fault-free run's, and the final checkpoint's tensors
        assert row["losses"]["differ"] == 0 and row["losses"]["compared"] == len(steps)
        assert row["final_state"]["equal"] is True and row["final_state"]["global_step"] % 10 == 0
        line = next(x for x in table if x.startswith(row["strategy"] + " "))
        assert line.split()[5] == "2/2" and line.endswith("yes")
    assert any(r["checkpoint_overhead"] for r in doc["combinations"])
    # the fault-free run keeps only the checkpoints compared; the others went while it ran (a save every 10
    # steps, about every 2 s), not all at the end, and no record the job listed at its saves was unreadable
    kept = [p.name for p in (Path(ref["dir"]) / "run" / "checkpoints").glob("*.commit")]
    assert len(kept) == len({r["final_state"]["global_step"] for r in doc["combinations"]}) <= 2
    assert ref["pruned_checkpoints"] >= ref["pruned_while_running"] >= 3
    assert "unreadable" not in (Path(ref["dir"]) / "jobs.log").read_text()
    assert {r["ranks"] for r in doc["what_if"]["rows"]} == {1024, 4096, 16384, 65536}
    assert any(x.startswith("  periodic: measured best every 10 steps") and "Young/Daly" in x for x in table)
    pytest.importorskip("matplotlib")
    assert (out / "timeline.png").stat().st_size > 10_000


def test_a_node_failure_kills_the_nodes_ranks_and_arf_heals_them_all_in_the_job(tmp_path):
    # seed 171's plan: a node failure at 6.4 s, victim rank 3 (node 0-3, rank 0 among them), then a kill of rank 2
    # at 14.6 s: one of the two processes spawned together for the node (two warm spares took ranks 0 and 1);
    # Open MPI's runtime tore such a spawned job down whole when one of its processes died, and the job hung
    # (launch/ft.sh: every job recoverable)
    node, kill = failures.draw(171, 10, 22, ["node", "kill"], 8)
    assert (node.rank, node.kind, kill.rank, kill.kind) == (3, "node", 2, "kill") and 6 <= node.offset < kill.offset
    out = tmp_path / "report"
    proc = run_command([sys.executable, "-m", "dsim.campaign", *SMALL, "--mtbf", "10s", "--duration", "22s",
                        "--faults", "node,kill", "--ranks-per-node", "4", "--strategy", "arf", "--save-every", "10",
                        "--seed", "171", "--node-mtbf", "5y", "-o", str(out)], tmp_path, timeout=300, check=0)
    doc = json.loads((out / "report.json").read_text())
    (row,) = doc["combinations"]
    first, second = row["failures"]
    assert doc["settings"]["ranks_per_node"] == 4 and first["ranks"] == [0, 1, 2, 3] and first["kind"] == "node"
    log = (out / "arf-every10" / "jobs.log").read_text()
    # the four died at once: one repair brought all four back, two warm spares and two spawned processes
    assert "node failure: ranks 0-3 die together" in log
    assert ("heal: rank(s) 0, 1, 2, 3 died; repaired in the job" in log and "rank(s) 0, 1 taken by a warm spare, 0 "
            "left; the others spawned" in log), log
    assert "heal: rank(s) 2 died; repaired in the job: rank 2 from rank 6" in log, log
    assert len(row["jobs"]) == 1 and row["restarts"] == 0, proc.stdout
    for f in (first, second):
        assert (f["how"], f["steps_lost"], f["recovered"]) == ("in the job", 0, True), f
    assert row["losses"]["differ"] == 0 and row["final_state"]["equal"] is True
    assert next(x for x in doc["table"] if x.startswith("arf ")).endswith("yes")
    # dp2 x mp4 on nodes of 4: each node one whole model replica, so a lost node's slices all have a copy elsewhere
    assert doc["node_loss"] == [{"node": [0, 3], "fatal_sets": []}, {"node": [4, 7], "fatal_sets": []}]
    assert "  any one of the 2 nodes: survivable (every replica set keeps a rank on another node)" in proc.stdout
    # the what-if at scale with servers failing too (--node-mtbf): more failures, and (the two holders of a slice
    # never on one server at any size) no node failure without a copy
    what_if = doc["what_if"]
    assert what_if["node_mtbf_s"] == doc["settings"]["node_mtbf_s"] == 5 * 365 * 86400 and what_if["ranks_per_node"] == 4
    assert [(r["nodes"], r["node_fatal"]) for r in what_if["rows"]] == [(n // 4, False) for n in (1024, 4096, 16384, 65536)]
    assert "per-node MTBF 5y (nodes of 4 ranks)" in proc.stdout


def test_a_slow_rank_is_found_by_the_straggler_watch_and_healed_in_the_job(tmp_path):
    # seed 3's plan: rank 0 computes 4x slower from 2.9 s on (or from its first step, when 9 processes on busy
    # cores begin training later than that). Rank 0 runs the straggler watch, so it judges itself: it says so, then
    # it is killed, and a warm spare takes its place. A healthy rank past the factor on these busy cores would be
    # killed too (counted as healthy), and healed alike: the run stays exact
    (slow,) = failures.draw(3, 12, 14, ["slow"], 8)
    assert (slow.rank, slow.kind) == (0, "slow") and 2 <= slow.offset <= 3
    out = tmp_path / "report"
    proc = run_command([sys.executable, "-m", "dsim.campaign", *SMALL, "--mtbf", "12s", "--duration", "14s",
                        "--faults", "slow", "--strategy", "arf", "--save-every", "10", "--seed", "3", "-o", str(out)],
                       tmp_path, timeout=300, check=0)
    doc = json.loads((out / "report.json").read_text())
    assert (doc["settings"]["straggler_factor"], doc["settings"]["slowdown"]) == (3.0, 4.0)
    (row,) = doc["combinations"]
    (rec,) = row["failures"]
    log = (out / "arf-every10" / "jobs.log").read_text()
    assert "--set tft.straggler_factor=3 --set tft.straggler_evict=true --set tft.spares=1" in log
    assert "dsim: fault: rank 0 computes 4x slower from now on during the" in log
    assert re.search(r"dsim: straggler watch: rank 0 \(pid \d+\) computes its steps [\d.]+x slower than the other "
                     r"ranks of its stage .*: killed \(SIGKILL\), as a failed rank", log), log
    assert "heal: rank(s) 0 died; repaired in the job: rank 0 from rank 4" in log and "taken by a warm spare" in log
    evicted = next(e for e in metrics(row, row["settled"]) if e["event"] == "straggler" and e["rank"] == 0)
    assert evicted["evicted"] and evicted["global_step"] > rec["step"] and evicted["time"] > rec["time"]
    assert (rec["kind"], rec["how"], rec["steps_lost"], rec["predicted_lost"], rec["recovered"]) == \
        ("slow", "in the job", 0, 0, True)
    assert rec["resumed_from"] >= evicted["global_step"] - 1 and len(row["jobs"]) == 1 and row["restarts"] == 0
    assert row["stragglers_evicted"] == row["healthy_evicted"] + 1
    assert f"  arf-every10: {row['stragglers_evicted']} killed, {row['healthy_evicted']} healthy" in proc.stdout
    assert row["losses"]["differ"] == 0 and row["final_state"]["equal"] is True


def test_ctrl_c_leaves_no_process_and_keeps_the_report(tmp_path):
    out = tmp_path / "report"
    # on 4 ranks (--ranks: the launch scripts' RANK_SIZE; the jobs ran on 8 whatever it said)
    p = subprocess.Popen([sys.executable, "-m", "dsim.campaign", *SMALL, "--set", "parallel.model_parallel=2",
                          "--ranks", "4", "--duration", "8s", "--mtbf", "4s",
                          "--strategy", "periodic,arf", "--save-every", "10", "-o", str(out)], cwd=tmp_path,
                         env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        lines = []
        for line in p.stdout:  # periodic's 8 s, then arf's start
            lines.append(line)
            if line.startswith("campaign: arf-every10:"):
                break
        time.sleep(4)
        assert left_behind(p.pid), "the combination's job should be running"
        os.kill(p.pid, signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, "".join(lines) + rest
    assert "interrupted; every job stopped; the report keeps the 1 combination(s) that finished" in rest
    assert left_behind(p.pid) == []
    doc = json.loads((out / "report.json").read_text())
    assert not doc["finished"] and "fault_free" not in doc
    (row,) = doc["combinations"]
    assert row["strategy"] == "periodic" and row["seconds"] >= 8 and row["losses"]["equal"] is None
    assert row["steps"] == max([e["global_step"] for e in metrics(row) if e["event"] == "step"], default=0)
    assert any(x.startswith("periodic ") and x.endswith("not checked") for x in doc["table"])
    log = (out / "periodic-every10" / "jobs.log").read_text()
    assert "+ RANK_SIZE=4 bash launch/run_parallel_save_ckpt.sh" in log and " -n 4 python -m dsim.train" in log
    assert "dsim: 4 ranks, data_parallel=2 model_parallel=2" in log


def test_a_fault_plan_written_by_hand_with_a_bad_entry_is_one_line_under_mpirun(tmp_path):
    """Every rank checks the plan before training: one line, exit 2, and nothing written (before: a traceback from
    the rank the entry named when it fell due, the others waiting for it)."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"rank": 3, "kind": "slow", "at": "forward", "step": 2, "slowdown": "4x"}]}))
    proc = mpirun(8, ["-m", "dsim.train", *SMALL, "--set", "fault.kind=plan", "--set", "output.dir=run"], cwd=tmp_path,
                  timeout=120, env={"DSIM_FAULT_PLAN": str(plan)})
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dsim:")]
    assert proc.returncode == 2 and lines == [
        f"dsim: error: fault plan {plan}: entry 0 ({{\"rank\": 3, \"kind\": \"slow\", \"at\": \"forward\", \"step\": 2, "
        "\"slowdown\": \"4x\"}): slowdown must be a number > 1 (how many times slower), got '4x'"], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
