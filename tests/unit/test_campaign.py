"""Fault campaigns without MPI: the failure process, fault plans firing once, the analysis of a job's
metrics, the strategy table, the what-if at scale, the report and the command line's bad input."""
import json
import math
import re
import signal
import subprocess
import sys

import numpy as np

import pytest

from dsim.campaign import analysis, failures, report, scale, strategies
from dsim.campaign.__main__ import main
from dsim.config import ConfigError, load_config
from dsim.faults import FaultPlan, fired_marker
from dsim.parallel.layout import ParallelLayout


def test_durations():
    assert [failures.parse_duration(t) for t in ("30s", "10m", "1.5h", "2d", "1y", "45")] == \
        [30, 600, 5400, 172800, 365 * 86400, 45]
    for bad in ("0s", "-3s", "3x", "", "m"):
        with pytest.raises(ValueError, match="not a duration"):
            failures.parse_duration(bad)


def test_failure_process_is_seeded_and_exponential():
    a = failures.draw(7, 30.0, 3000.0, ["kill", "uce"], 8)
    assert a == failures.draw(7, 30.0, 3000.0, ["kill", "uce"], 8)
    assert a != failures.draw(8, 30.0, 3000.0, ["kill", "uce"], 8)
    offsets = [f.offset for f in a]
    assert offsets == sorted(offsets) and offsets[-1] < 3000
    gaps = np.diff([0.0] + offsets)
    assert 20 < gaps.mean() < 40  # about 100 gaps of mean 30 s
    assert {f.kind for f in a} == {"kill", "uce"} and {f.rank for f in a} == set(range(8))
    assert {f.at for f in a} == {"forward", "allreduce", "update"}


def plan_file(tmp_path, entries):
    return failures.write_plan(tmp_path / "plan.json",
                               [failures.Failure(*e) for e in entries], start=0.0)


FIRE = """
import sys
from dsim.faults import FaultPlan
plan = FaultPlan.load(sys.argv[1], int(sys.argv[2]))
class Injector: optimizer = None
plan.strike("update", 5, Injector())    # not this entry's point: nothing
plan.strike("forward", 5, Injector())   # kills this process
print("survived")
"""


def test_a_plan_entry_fires_once_across_processes(tmp_path):
    path = plan_file(tmp_path, [(1.0, 3, "kill", "forward"), (2.0, 5, "kill", "forward")])
    fire = [sys.executable, "-c", FIRE, str(path), "3"]
    first = subprocess.run(fire, capture_output=True, text=True, timeout=60)
    assert first.returncode == -signal.SIGKILL and "killing rank 3 (SIGKILL) during the forward of step 5" in first.stdout
    marker = json.loads(fired_marker(path, 0).read_text())
    assert (marker["index"], marker["rank"], marker["planned_rank"], marker["global_step"]) == (0, 3, 3, 5)
    again = subprocess.run(fire, capture_output=True, text=True, timeout=60)  # a restart, or a newcomer as rank 3
    assert again.returncode == 0 and again.stdout.strip() == "survived"
    assert [f["index"] for f in failures.fired(path)] == [0]
    assert [i for i, _ in FaultPlan.load(path, 5).entries] == [1]
    # after an elastic shrink to 4 ranks training, rank 5's failure strikes rank 1
    assert [i for i, _ in FaultPlan.load(path, 1, world_size=4).entries] == [1]
    assert FaultPlan.load(path, 1).entries == [] and FaultPlan.load(path, 5, world_size=4).entries == []


MATE = """
import sys, time
from dsim.faults import FaultPlan
FaultPlan.load(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))  # registers this process as that rank
print("up", flush=True)
time.sleep(60)
"""


def test_a_node_failure_kills_every_rank_of_the_victims_node_at_once(tmp_path):
    path = failures.write_plan(tmp_path / "plan.json", [failures.Failure(1.0, 5, "node", "forward")], start=0.0,
                               node_size=4)
    assert json.loads(path.read_text())["faults"][0]["node_size"] == 4
    mates = {}
    for rank in (4, 6, 7, 3):  # rank 3 is on the first node (ranks 0-3): it lives
        mates[rank] = subprocess.Popen([sys.executable, "-c", MATE, str(path), str(rank), "8"],
                                       stdout=subprocess.PIPE, text=True)
    try:
        assert all(p.stdout.readline().strip() == "up" for p in mates.values())
        victim = subprocess.run([sys.executable, "-c", FIRE.replace("int(sys.argv[2]))", "int(sys.argv[2]), 8)"),
                                 str(path), "5"], capture_output=True, text=True, timeout=60)
        assert victim.returncode == -signal.SIGKILL
        assert "node failure: ranks 4-7 die together during the forward of step 5" in victim.stdout
        assert {r: p.wait(timeout=10) for r, p in mates.items() if r != 3} == {4: -9, 6: -9, 7: -9}
        assert mates[3].poll() is None
    finally:
        for p in mates.values():
            p.kill()
            p.wait()


HOST_VICTIM = """
import sys, types
from dsim.faults import FaultPlan
from dsim.parallel.hosts import Hosts
plan = FaultPlan.load(sys.argv[1], int(sys.argv[2]), 4)
hosts = Hosts(("node1", "node1", "node2", "node2"))
injector = types.SimpleNamespace(optimizer=None, model=types.SimpleNamespace(groups=types.SimpleNamespace(hosts=hosts)))
assert plan.strikes_at("save") and not plan.strikes_at("commit")
plan.strike("forward", 5, injector)  # not this entry's point: nothing
plan.strike("save", 5, injector)     # a host crash: the daemon, the host's other rank, then this process
print("survived")
"""


def test_a_host_failure_kills_the_hosts_daemon_and_its_ranks(tmp_path):
    """A plan's `host` entry (dsim.faults.plan.crash_host): the victim SIGKILLs its parent when it is Open MPI's daemon
    (a process named prted), the other ranks MPI found on its host (rank 2's mate, rank 3), then itself; a rank of
    another host lives. Its point may be a save's (PLAN_AT)."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": [{"rank": 2, "kind": "host", "at": "save", "step": 4}]}))
    daemon = tmp_path / "prted"  # a script's process is named after its file: the victim's parent is "prted"
    daemon.write_text(f'#!/bin/sh\n"{sys.executable}" -c "$1" "$2" 2 > "$3"\nsleep 60\n')
    daemon.chmod(0o755)
    mates = {r: subprocess.Popen([sys.executable, "-c", MATE, str(path), str(r), "4"], stdout=subprocess.PIPE,
                                 text=True) for r in (1, 3)}  # rank 1 on node1, rank 3 on node2 with the victim
    try:
        assert all(p.stdout.readline().strip() == "up" for p in mates.values())
        parent = subprocess.Popen([str(daemon), HOST_VICTIM, str(path), str(tmp_path / "victim.out")])
        assert parent.wait(timeout=60) == -signal.SIGKILL  # the "daemon", killed before it could sleep out its 60 s
        assert mates[3].wait(timeout=10) == -signal.SIGKILL and mates[1].poll() is None
        out = (tmp_path / "victim.out").read_text()
        assert "host node2 crashes (Open MPI's daemon there, prted pid" in out and "ranks 2-3)" in out, out
        assert "during the save of step 5" in out and "survived" not in out, out
    finally:
        for p in mates.values():
            p.kill()
            p.wait()


def test_a_node_failure_kills_only_the_processes_registered_now(tmp_path):
    from dsim.faults import kill_registered, node_of, register
    path = plan_file(tmp_path, [])
    assert node_of(5, 4, 8) == [4, 5, 6, 7] and node_of(5, 4, 6) == [4, 5] and node_of(2, 2, 8) == [2, 3]
    old = subprocess.run([sys.executable, "-c", f"from dsim.faults import register; register({str(path)!r}, 1, 8)"],
                         timeout=60)
    assert old.returncode == 0  # rank 1's registration is of a process that ended (a job before a restart)
    register(path, 2, 8)  # the caller itself
    sleeper = subprocess.Popen([sys.executable, "-c", MATE, str(path), "3", "6"], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "up"
        # rank 3 registered while 6 ranks trained: not rank 3 of 8 (an elastic shrink renumbered it)
        assert kill_registered(path, [1, 2, 3], 8, wait=0.3) == []
        assert sleeper.poll() is None
        assert kill_registered(path, [3], 6, wait=0.3) == [3] and sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_campaign_claims_the_entries_not_fired_at_the_end_of_its_budget(tmp_path):
    path = plan_file(tmp_path, [(1.0, 3, "kill", "forward"), (2.0, 5, "kill", "forward")])
    fire = [sys.executable, "-c", FIRE, str(path), "3"]
    assert subprocess.run(fire, capture_output=True, text=True, timeout=60).returncode == -signal.SIGKILL
    plan = FaultPlan.load(path, 5)  # a job that loaded entry 1 before the budget ran out
    assert failures.claim_unfired(path) == [1] and failures.claim_unfired(path) == []
    plan.strike("forward", 7, None)  # due, but claimed: it does not strike (the injector is not even needed)
    assert [f["index"] for f in failures.fired(path)] == [0] and FaultPlan.load(path, 5).entries == []


def test_a_plan_ignores_the_configured_point(tmp_path):
    # configs/lenet5.yaml keeps the page's fault.at: epoch_end, epoch: 6 for --set fault.kind=exception; a campaign
    # sets fault.kind=plan over it, and every rank raised at the end of epoch 6 (a failure not in the plan)
    from types import SimpleNamespace
    from dsim.faults import FaultInjector
    injector = FaultInjector("plan", epoch=6, at="epoch_end")
    injector.my_rank = 0
    injector.epoch_end(SimpleNamespace(original_args=lambda: SimpleNamespace(cur_epoch_num=6, cur_step_num=600)))
    assert not injector.fired


def test_a_due_entry_waits_for_its_point_and_time(tmp_path):
    path = failures.write_plan(tmp_path / "plan.json", [failures.Failure(1e11, 0, "kill", "forward")], start=0.0)
    plan = FaultPlan.load(path, 0)
    plan.strike("forward", 1, None)  # due in the year 5138: nothing happens
    assert not fired_marker(path, 0).exists() and len(plan.entries) == 1


def test_in_a_repair_only_a_due_failure_that_stops_a_process_strikes(tmp_path):
    # (a kill, corrupt, hang or stuck one: tests/e2e/test_e2e_inprocess.py kills a rank so, in a real repair)
    path = failures.write_plan(tmp_path / "plan.json", [failures.Failure(0, 0, "uce", "forward"),
                                                        failures.Failure(0, 0, "sdc", "update"),
                                                        failures.Failure(0, 0, "slow", "forward"),
                                                        failures.Failure(1e11, 0, "kill", "update")], start=0.0)
    plan = FaultPlan.load(path, 0)
    plan.strike("refill", 13, None, repair=True)
    plan.strike("exchange", 13, None, repair=True)
    assert not any(fired_marker(path, i).exists() for i in range(4)) and len(plan.entries) == 4


def test_a_plan_entry_with_a_step_waits_for_that_step(tmp_path):
    from types import SimpleNamespace
    path = tmp_path / "plan.json"  # written by hand: no time, a step
    path.write_text(json.dumps({"faults": [{"rank": 0, "kind": "sdc", "at": "forward", "step": 9}]}))
    w = np.zeros(8, dtype=np.float32)
    injector = SimpleNamespace(optimizer=SimpleNamespace(params=[SimpleNamespace(name="w", data=w)]))
    plan = FaultPlan.load(path, 0)
    plan.strike("forward", 8, injector)
    plan.strike("update", 9, injector)
    assert not fired_marker(path, 0).exists() and not w.any()
    plan.strike("forward", 9, injector)
    assert fired_marker(path, 0).exists() and np.count_nonzero(w) == 1 and not plan.entries


def test_fault_kind_plan_needs_the_plan_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DSIM_FAULT_PLAN", raising=False)
    with pytest.raises(ConfigError, match=r"fault.kind plan needs \$DSIM_FAULT_PLAN"):
        load_config(None, ["fault.kind=plan"])
    monkeypatch.setenv("DSIM_FAULT_PLAN", str(plan_file(tmp_path, [])))
    assert load_config(None, ["fault.kind=plan"]).fault.kind == "plan"


@pytest.mark.parametrize("text, error", [
    ("nope", "cannot be read as JSON"),
    ('[{"rank": 1}]', 'must be a JSON object with a list "faults"'),
    ('{"faults": [7]}', "entry 0 must be an object, got 7"),
    ('{"faults": [{"rank": 1, "kind": "slow", "at": "forward", "slowdown": "fast"}]}',
     "entry 0 (.*): slowdown must be a number > 1 .* got 'fast'"),
    ('{"faults": [{"rank": 1, "kind": "slow", "at": "forward", "slowdown": 1}]}', "slowdown must be a number > 1"),
    ('{"faults": [{"rank": 0, "kind": "kill", "at": "forward"}, {"rank": 1, "kind": "kil", "at": "forward"}]}',
     "entry 1 .*kind must be one of kill, uce, corrupt, node, host, hang, stuck, deadlock, unmatched, sdc, slow, got "
     "'kil'"),
    ('{"faults": [{"rank": -1, "kind": "kill", "at": "forward"}]}', r"rank must be a rank \(>= 0\), got -1"),
    ('{"faults": [{"rank": 1, "kind": "kill", "at": "step_end"}]}', "at must be one of forward, allreduce, update, save, commit"),
    ('{"faults": [{"rank": 1, "kind": "kill", "at": "update", "step": 0}]}', "step must be a step"),
    ('{"faults": [{"rank": 1, "kind": "kill", "at": "update", "time": "now"}]}', "time must be Unix seconds"),
    ('{"faults": [{"rank": 1, "kind": "node", "at": "update"}]}', "a node failure needs node_size"),
    ('{"faults": [{"rank": 1, "kind": "kill", "at": "update", "when": 3}]}', "unknown key.* when"),
])
def test_a_bad_fault_plan_is_one_line_before_training(tmp_path, monkeypatch, text, error):
    """A plan written by hand is checked whole when the config is (every rank alike, exit 2), not when an entry
    falls due on the rank it names (a traceback there, before)."""
    path = tmp_path / "plan.json"
    path.write_text(text)
    monkeypatch.setenv("DSIM_FAULT_PLAN", str(path))
    with pytest.raises(ConfigError, match=f"^fault plan {re.escape(str(path))}: (entry 0 .*)?{error}"):
        load_config(None, ["fault.kind=plan"])


def test_the_campaigns_own_plans_pass_the_check(tmp_path, monkeypatch):
    path = failures.write_plan(tmp_path / "plan.json", [failures.Failure(1.5, 3, "node", "forward"),
                                                        failures.Failure(2.5, 1, "slow", "update")],
                               start=1e9, node_size=4, slowdown=8)
    monkeypatch.setenv("DSIM_FAULT_PLAN", str(path))
    assert load_config(None, ["fault.kind=plan"]).fault.kind == "plan"


def ev(name, t, **f):
    return {"event": name, "time": float(t), "rank": 0, **f}


def steps(first, last, t0, dt=1.0, loss=lambda g: g / 1000):
    return [ev("step", t0 + (g - first) * dt, global_step=g, loss=loss(g)) for g in range(first, last + 1)]


def test_a_restart_from_the_periodic_checkpoint():
    # steps 1-13 at t=1..13, checkpoints of steps 5 and 10 committed, rank 2 killed inside step 14, a restart
    # from step 10 at t=30
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 13, 1) +
              [ev("checkpoint_committed", 5.1, global_step=5), ev("checkpoint_committed", 10.1, global_step=10),
               ev("fault", 13.5, rank=2, kind="kill", at="forward", global_step=14, plan_index=0),
               ev("train_begin", 30, global_step=10)] + steps(11, 20, 31))
    (rec,) = analysis.failures(events, end=100, restarts=[29])
    assert rec["seen"] and rec["how"] == "restart" and rec["resumed_from"] == 10
    assert rec["steps_lost"] == 3 == rec["predicted_lost"]  # steps 11-13
    assert rec["recovered"] and rec["recovery_s"] == 17.5   # step 11 finished at t=31
    row = analysis.summarize([rec], events, start=0, end=100, save_every=5, fault_free_rate=1.0)
    assert (row["steps"], row["restarts"], row["failures_seen"], row["survived"]) == (20, 1, 1, 1)
    assert analysis.failures(events, end=100)[0]["how"] is None  # no job started after it
    assert row["goodput"] == 0.2 and row["goodput_fraction"] == 0.2
    assert analysis.progress(events, end=35) == 15


def test_an_async_save_still_in_flight_is_not_promised():
    # the async save of step 10 commits at the end of step 12; rank 3 is killed inside step 12: the promise is
    # the restart from step 5, the newest committed
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 11, 1) +
              [ev("checkpoint_committed", 7.1, global_step=5),
               ev("fault", 11.5, rank=3, kind="kill", at="forward", global_step=12, plan_index=0),
               ev("train_begin", 30, global_step=5)] + steps(6, 12, 31))
    (rec,) = analysis.failures(events, end=100, restarts=[29])
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["predicted_lost"]) == ("restart", 5, 6, 6)


def test_a_checkpoint_whose_record_is_written_just_after_the_failure_is_promised():
    # a host crash fired by node2's rank inside step 11 while rank 0, on node1, was still writing the record of
    # step 10's checkpoint (every shard written: it commits): the restart resumes from step 10, as promised
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 10, 1) +
              [ev("checkpoint_committed", 5.1, global_step=5),
               ev("fault", 10.2, rank=2, kind="host", at="forward", global_step=11, plan_index=0, ranks=[2, 3]),
               ev("checkpoint_committed", 10.25, global_step=10),
               ev("train_begin", 30, global_step=10)] + steps(11, 15, 31))
    (rec,) = analysis.failures(events, end=100, restarts=[29])
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["predicted_lost"]) == ("restart", 10, 0, 0)


def test_a_hosts_crash_met_by_the_survivors_rescue_files_is_promised_their_step():
    # peer copies: node2 crashed inside step 7, mpirun ended the job at once; the survivors' rescue files of step 6
    # were found whole by the resume (rescue_completed, logged before its train_begin): 0 steps lost, as promised;
    # had the rescue not completed, the restart would go back to step 5's checkpoint
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 6, 1) +
              [ev("checkpoint_committed", 5.1, global_step=5),
               ev("fault", 6.5, rank=2, kind="host", at="forward", global_step=7, plan_index=0, ranks=[2, 3])])
    rescued = [ev("rescue_completed", 29.5, global_step=6, checkpoint="ttp-2_1", missing=[2, 3], before=5),
               ev("train_begin", 30, global_step=6)] + steps(7, 10, 31)
    (rec,) = analysis.failures(events + rescued, end=100, restarts=[29])
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["predicted_lost"]) == ("restart", 6, 0, 0)
    (rec,) = analysis.failures(events + [ev("train_begin", 30, global_step=5)] + steps(6, 10, 31), end=100,
                               restarts=[29])
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["predicted_lost"]) == ("restart", 5, 1, 1)


def test_a_checkpoint_a_corrupt_failure_broke_is_not_promised():
    # rank 0's file of the checkpoint of step 10 damaged with no replica (broken): the restart falls back to
    # step 5, for this failure and the next
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 11, 1) +
              [ev("checkpoint_committed", 5.1, checkpoint="a-5", global_step=5),
               ev("checkpoint_committed", 10.1, checkpoint="a-10", global_step=10),
               ev("fault", 11.5, rank=0, kind="corrupt", at="forward", global_step=12, plan_index=0),
               ev("train_begin", 20, global_step=5)] + steps(6, 13, 21) +
              [ev("fault", 28.5, rank=2, kind="kill", at="forward", global_step=14, plan_index=1),
               ev("train_begin", 40, global_step=5)] + steps(6, 7, 41))
    recs = analysis.failures(events, end=100, restarts=[19, 39], broken={0: "a-10"})
    assert [(r["steps_lost"], r["predicted_lost"]) for r in recs] == [(6, 6), (8, 8)]
    recs = analysis.failures(events, end=100, restarts=[19, 39])  # not broken: step 10 is promised
    assert [(r["steps_lost"], r["predicted_lost"]) for r in recs] == [(6, 1), (8, 3)]


@pytest.mark.parametrize("layout, replica", [((2, 4, 1), True), ((1, 8, 1), False), ((2, 4, 2), False),
                                             ((4, 2, 2), True)])
def test_whether_a_damaged_slice_has_a_replica(layout, replica):
    # rank 1's slice of the first parameter; a file holds its optimizer shard's part of a parameter: with
    # optimizer_shard = data_parallel no other file holds it
    from dsim.campaign.runner import has_replica
    from dsim.checkpoint.plan import commit_record, save_plan
    from dsim.nn import create_network
    from dsim.parallel.layout import ParallelLayout, Slice
    layout = ParallelLayout(*layout)
    plan = save_plan(layout, create_network("network").specs, ("moments",))
    record = commit_record("n-1_1", "n", plan, 1, 1, 1, 1)
    (mine,) = [p for p in plan.slices if p.kind == "params" and 1 in plan.holders(p)[0]
               and p.name == plan.slices[0].name]
    assert has_replica(record, 1, f"params/{mine.name}", mine.where) is replica
    assert has_replica({}, 1, f"params/{mine.name}", mine.where)  # an older record without slices: assumed
    assert has_replica(record, 1, f"params/{mine.name}", Slice((0, 0), (1, 1))) is True


def test_a_corrupt_failure_strikes_a_tensor_in_proportion_to_its_bytes(tmp_path):
    # a bad block lands anywhere in the file: parameters or optimizer state, the larger the likelier
    from dsim.campaign.runner import damage, struck_tensor
    from dsim.checkpoint.errors import CheckpointError
    from dsim.checkpoint.format import Tensor, read_file, write_file
    from dsim.parallel.layout import Slice
    small, large = np.ones((2, 3)), np.ones((30, 30))  # 6 and 900 elements
    path = tmp_path / "rank_0" / "n-1_1.h5"
    write_file(path, {"rank": 0}, [Tensor("params", "w", (2, 3), Slice((0, 0), (2, 3)), small),
                                   Tensor("optimizer", "moment1.v", (30, 30), Slice((0, 0), (30, 30)), large)], {})
    draws = [struck_tensor(path, np.random.default_rng([7, i])) for i in range(300)]
    assert set(draws) == {"params/w", "optimizer/moment1.v"} and draws.count("params/w") < 15
    assert draws == [struck_tensor(path, np.random.default_rng([7, i])) for i in range(300)]  # the same draw
    tensor, where = damage(path, "optimizer/moment1.v")
    assert (tensor, where) == ("optimizer/moment1.v", Slice((0, 0), (30, 30)))
    with pytest.raises(CheckpointError, match="checksum mismatch in .*n-1_1.h5: optimizer/moment1.v"):
        read_file(path)


def test_a_last_gasp_loses_nothing_and_an_in_job_repair_restarts_nothing():
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 6, 1) +
              [ev("fault", 6.5, rank=1, kind="kill", global_step=7, plan_index=0),
               ev("last_gasp_saved", 7, failed=[1], global_step=6),
               ev("train_begin", 20, global_step=6)] + steps(7, 9, 21) +
              [ev("fault", 23.5, rank=4, kind="uce", global_step=10, plan_index=1),
               ev("uce_repair", 23.6, failed=[], damaged=[4], global_step=9)] + steps(10, 12, 24))
    gasp, uce = analysis.failures(events, end=100, restarts=[19])
    assert (gasp["how"], gasp["steps_lost"], gasp["predicted_lost"]) == ("restart", 0, 0)
    assert (uce["how"], uce["steps_lost"], uce["predicted_lost"], uce["recovery_s"]) == ("in the job", 0, 0, 0.5)


def test_a_step_a_last_gasp_saved_was_finished():
    # restarted from step 10, rank 0 (which logs steps) dies inside the update of step 11, which its replicas
    # finished: no step event for step 11, but the last gasp saved it
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 10, 1) +
              [ev("fault", 10.5, rank=6, kind="kill", global_step=11, plan_index=0),
               ev("last_gasp_saved", 11, failed=[6], global_step=10, noticed_at=10.6),
               ev("train_begin", 20, global_step=10),
               ev("fault", 21.5, rank=0, kind="kill", at="update", global_step=11, plan_index=1),
               ev("last_gasp_saved", 23, failed=[0], global_step=11, noticed_at=21.6),
               ev("train_begin", 30, global_step=11)] + steps(12, 13, 31))
    first, second = analysis.failures(events, end=100, restarts=[19, 29])
    assert (first["recovered"], first["recovery_s"], first["steps_lost"]) == (True, 11.1, 0)
    assert (second["recovered"], second["recovery_s"], second["resumed_from"]) == (True, 9.5, 11)


def test_a_step_an_elastic_shrink_went_on_after_was_finished():
    # restarted from step 10; rank 0 (which logs steps) dies inside the update of step 11, which its replicas
    # finished; the survivors shrink and go on, and the new rank 0 logs step 12 first: the restart's recovery
    # ends there (it was counted unrecovered, and the campaign waited its whole 60 s for it)
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 10, 1) +
              [ev("fault", 10.5, rank=0, kind="uce", global_step=11, plan_index=0),
               ev("train_begin", 14, global_step=10),
               ev("fault", 14.1, rank=0, kind="corrupt", at="update", global_step=11, plan_index=1),
               ev("elastic", 14.2, failed=[0], global_step=11),
               ev("recovered", 14.3, global_step=12)] + steps(12, 13, 14.3))
    restart, shrink = analysis.failures(events, end=100, restarts=[13])
    assert (restart["how"], restart["resumed_from"], restart["recovered"], restart["recovery_s"]) == \
        ("restart", 10, True, 3.8)
    assert (shrink["how"], shrink["resumed_from"], shrink["recovered"], shrink["recovery_s"]) == \
        ("in the job", 11, True, 0.2)


def test_a_newcomer_is_not_a_restart():
    # rank 0 dies; a warm spare takes its place and, as rank 0, logs train_begin before the heal is logged
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 4, 1) +
              [ev("fault", 4.5, rank=0, kind="kill", global_step=5, plan_index=0),
               ev("train_begin", 4.7, global_step=4), ev("heal", 4.8, failed=[0], damaged=[], global_step=4)]
              + steps(5, 8, 5))
    (rec,) = analysis.failures(events, end=100)
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["recovery_s"]) == ("in the job", 4, 0, 0.5)


def test_a_failure_recovered_after_the_budget_counts_when_the_campaign_waited_for_it():
    events = ([ev("train_begin", 0, global_step=0)] + steps(1, 5, 1)
              + [ev("fault", 5.5, rank=0, kind="kill", global_step=6, plan_index=0),
                 ev("train_begin", 9.0, global_step=5)] + steps(6, 7, 9.5))
    (cut,) = analysis.failures(events, end=8, restarts=[7.0])
    assert cut["seen"] is False and not cut["recovered"]
    (rec,) = analysis.failures(events, end=8, restarts=[7.0], until=20)
    assert (rec["how"], rec["resumed_from"], rec["recovered"], rec["recovery_s"]) == ("restart", 5, True, 4.0)
    assert analysis.failures(events, end=5, restarts=[7.0], until=20) == []  # struck after the budget: not counted


def test_a_failure_the_budget_left_no_time_for():
    events = [ev("train_begin", 0, global_step=0)] + steps(1, 5, 1) + [ev("fault", 5.5, rank=0, global_step=6,
                                                                          kind="kill", plan_index=0)]
    (rec,) = analysis.failures(events, end=8)
    assert not rec["seen"] and not rec["recovered"] and rec["steps_lost"] is None


def test_a_silent_corruption_is_rolled_back_in_the_job_and_its_steps_are_lost():
    # a bit flips in step 13 (rank 3); the check at step 16 finds it; the job rolls back to step 10 (committed
    # before), trains 11-16 again: 16 - 10 = 6 steps lost (not 12 - 10: the steps on the damage count), as promised
    events = steps(1, 15, 1.0) + [ev("checkpoint_committed", 10.5, global_step=10)]
    events += [ev("fault", 13.5, plan_index=0, rank=3, kind="sdc", at="forward", global_step=13)]
    events += [ev("step", 16.0, global_step=16, loss=99.0),  # trained on the damage: its loss differs
               ev("sdc", 16.1, global_step=16, found=[{"ranks": [3], "tensor": "params/w"}]),
               ev("sdc_rollback", 16.3, global_step=10, checkpoint="n-1_10", found_at=16, damaged=[3])]
    events += steps(11, 20, 17.0)
    (rec,) = analysis.failures(sorted(events, key=lambda e: e["time"]), end=100)
    assert (rec["how"], rec["resumed_from"], rec["steps_lost"], rec["predicted_lost"]) == ("in the job", 10, 6, 6)
    assert rec["recovered"] and rec["recovery_s"] == pytest.approx(17.0 - 13.5)
    # the losses of steps 11-16 trained on the damage are not compared; those trained again are
    ref = {g: g / 1000 for g in range(1, 21)}
    got = analysis.losses_equal(sorted(events, key=lambda e: e["time"]), 100, ref)
    assert (got["discarded"], got["differ"], got["compared"]) == (6, 0, 10 + 10)  # 1-10, then 11-20 again


def test_a_silent_corruption_a_restart_wiped_out_is_lost_to_the_restart():
    # a bit flips in step 13 (rank 3) and rank 6 is killed in step 15, before any check: the job restarts from
    # step 10 (compared before it was saved) and the damage is gone. A later flip (rank 5, step 17) found at step
    # 18 is not the first one's finding: the first lost 12 - 10 = 2 steps, to the restart
    events = [ev("train_begin", 0.0, global_step=0)] + steps(1, 12, 1.0)
    events += [ev("checkpoint_committed", 10.5, global_step=10),
               ev("fault", 12.5, plan_index=0, rank=3, kind="sdc", at="forward", global_step=13)]
    events += steps(13, 14, 13.0, loss=lambda g: 99.0)  # trained on the damage: their losses differ
    events += [ev("fault", 14.5, plan_index=1, rank=6, kind="kill", at="update", global_step=15),
               ev("train_begin", 20.0, global_step=10)] + steps(11, 16, 21.0)
    events += [ev("fault", 26.5, plan_index=2, rank=5, kind="sdc", at="forward", global_step=17),
               ev("step", 27.0, global_step=17, loss=99.0), ev("step", 28.0, global_step=18, loss=99.0),
               ev("sdc", 28.1, global_step=18, found=[{"ranks": [5], "tensor": "params/w"}]),
               ev("sdc_rollback", 28.3, global_step=10, checkpoint="n-1_10", found_at=18, damaged=[5])]
    events += steps(11, 20, 29.0)
    events.sort(key=lambda e: e["time"])
    first, kill, second = analysis.failures(events, end=100, restarts=[20.0])
    assert (first["how"], first["resumed_from"], first["steps_lost"], first["predicted_lost"]) == ("restart", 10, 2, 2)
    assert (second["how"], second["steps_lost"]) == ("in the job", 8)
    # the damaged losses (13, 14 before the restart; 17, 18 before the rollback) and those of the steps logged
    # before the second finding, trained again after its rollback (11-16), are left out; the rest match
    ref = {g: g / 1000 for g in range(1, 21)}
    got = analysis.losses_equal(events, 100, ref)
    assert (got["discarded"], got["differ"]) == (2 + 8, 0) and got["compared"] == 12 + 10


def test_a_silent_corruption_is_not_met_by_the_repair_of_another_failure():
    # rank 0 is killed in step 1 and healed in the job; a bit of rank 5 flips during that step (its `recovered`
    # event comes after the flip); the check before the save of step 10 finds it with nothing committed to roll
    # back to: the job stops and restarts from scratch, 10 steps lost, as promised
    events = [ev("train_begin", 0.0, global_step=0), ev("fault", 0.02, plan_index=0, rank=0, kind="kill",
                                                         at="forward", global_step=1),
              ev("heal", 0.1, failed=[0], damaged=[], global_step=0),
              ev("fault", 0.13, plan_index=1, rank=5, kind="sdc", at="allreduce", global_step=1),
              ev("recovered", 0.14, global_step=1, fault="heal")] + steps(1, 9, 1.0)
    events += [ev("sdc", 10.1, global_step=10, found=[{"ranks": [1, 5], "tensor": "params/w"}]),
               ev("train_begin", 15.0, global_step=0)] + steps(1, 12, 16.0)
    kill, flip = analysis.failures(events, end=100, restarts=[15.0])
    assert (kill["how"], kill["steps_lost"]) == ("in the job", 0)
    assert (flip["how"], flip["resumed_from"], flip["steps_lost"], flip["predicted_lost"]) == ("restart", 0, 10, 10)


def test_a_slow_rank_is_met_once_the_straggler_watch_kills_it():
    # rank 5 computes 4x slower from step 13 (t=12.5); the watch kills it as of its step 17 (t=20); a warm spare
    # takes its place and training goes on after step 17: nothing lost in the job, the recovery from the onset.
    # Another failure's repair before the kill (rank 2 killed in step 15) does not meet it
    events = steps(1, 12, 1.0) + [ev("fault", 12.5, plan_index=0, rank=5, kind="slow", at="forward", global_step=13)]
    events += steps(13, 14, 14.0, dt=2.0)
    events += [ev("fault", 15.5, plan_index=1, rank=2, kind="kill", at="update", global_step=15),
               ev("heal", 15.8, failed=[2], damaged=[], global_step=14), ev("recovered", 16.5, global_step=15,
                                                                                fault="heal")]
    events += steps(15, 17, 16.5, dt=2.0)
    events += [ev("straggler", 20.0, rank=5, global_step=18, evicted=True),  # (in step 18, as its heartbeat said)
               ev("heal", 20.3, failed=[5], damaged=[], global_step=17)] + steps(18, 20, 21.0)
    slow, kill = analysis.failures(sorted(events, key=lambda e: e["time"]), end=100)
    assert (kill["how"], kill["resumed_from"], kill["steps_lost"]) == ("in the job", 14, 0)
    assert (slow["kind"], slow["how"], slow["resumed_from"], slow["steps_lost"], slow["predicted_lost"]) == \
        ("slow", "in the job", 17, 0, 0)
    assert slow["recovered"] and slow["recovery_s"] == pytest.approx(21.0 - 12.5)
    # the same kill with no warm spare: the last gasp of step 17, a restart from it
    events = steps(1, 12, 1.0) + [ev("checkpoint_committed", 10.5, global_step=10),
                                  ev("fault", 12.5, plan_index=0, rank=5, kind="slow", at="forward", global_step=13)]
    events += steps(13, 17, 14.0, dt=2.0) + [ev("checkpoint_committed", 15.5, global_step=15),
                                             ev("straggler", 22.5, rank=5, global_step=18, evicted=True),
                                             ev("last_gasp_saved", 23.0, failed=[5], global_step=17),
                                             ev("train_begin", 30.0, global_step=17)] + steps(18, 20, 31.0)
    events.sort(key=lambda e: e["time"])
    (slow,) = analysis.failures(events, end=100, restarts=[29.0])
    assert (slow["how"], slow["resumed_from"], slow["steps_lost"], slow["predicted_lost"]) == ("restart", 17, 0, 0)
    # periodic: back to step 15 (committed after its onset, before the kill): 2 steps lost, as promised
    events = [e for e in events if e["event"] != "last_gasp_saved"]
    events = [dict(e, global_step=15) if e["event"] == "train_begin" else e for e in events]
    (slow,) = analysis.failures(events, end=100, restarts=[29.0])
    assert (slow["how"], slow["resumed_from"], slow["steps_lost"], slow["predicted_lost"]) == ("restart", 15, 2, 2)
    # a healthy rank past the factor killed too (a false alarm), within the budget
    events += [ev("straggler", 40.0, rank=1, global_step=22, evicted=True)]
    row = analysis.summarize([slow], events, start=0, end=100, save_every=5, fault_free_rate=1.0)
    assert (row["stragglers_evicted"], row["healthy_evicted"]) == (2, 1)
    assert analysis.evictions([slow], events, end=30.0) == (1, 0)
    # the slow rank struck within the budget is killed after it, while the campaign waits for its recovery: still
    # its kill (a job slow to begin training on busy cores); the false alarm after the budget is not counted
    assert analysis.evictions([slow], events, end=20.0) == (1, 0)
    assert analysis.evictions([], events, end=30.0) == (1, 1)
    # reported, not killed (tft.straggler_evict off): seen, never met, still slow at the end
    events = steps(1, 12, 1.0) + [ev("fault", 12.5, plan_index=0, rank=5, kind="slow", at="forward", global_step=13)]
    events += steps(13, 30, 14.0, dt=2.0) + [ev("straggler", 22.5, rank=5, global_step=17, evicted=False),
                                             ev("recovered", 23.0, global_step=18, fault="heal")]
    (slow,) = analysis.failures(sorted(events, key=lambda e: e["time"]), end=100)
    assert slow["seen"] and (slow["how"], slow["recovered"], slow["steps_lost"]) == (None, False, None)


def test_a_slow_plan_entry_slows_its_rank_until_its_process_ends(tmp_path):
    from dsim.parallel import progress
    path = failures.write_plan(tmp_path / "plan.json", [failures.Failure(0, 1, "slow", "update")], start=0.0,
                               slowdown=3.0)
    assert json.loads(path.read_text())["faults"][0]["slowdown"] == 3.0
    plan = FaultPlan.load(path, 1)
    try:
        plan.strike("forward", 4, None)
        assert progress.slowdown == 1.0 and plan.entries
        plan.strike("update", 4, None)
        assert progress.slowdown == 3.0 and fired_marker(path, 0).exists() and not plan.entries
    finally:
        progress.slowdown = 1.0


@pytest.mark.parametrize("extra, factor, slowdown", [([], 3.0, 4.0), (["--straggler-factor", "0"], None, 4.0),
                                                     (["--straggler-factor", "3", "--slowdown", "8"], 3.0, 8.0)])
def test_slow_failures_arm_every_jobs_straggler_watch(tmp_path, extra, factor, slowdown):
    from dsim.campaign.__main__ import parse_args, settings_from
    settings, _ = settings_from(parse_args(["--faults", "kill,slow", *extra, "-o", str(tmp_path / "out")]))
    assert (settings.straggler_factor, settings.slowdown) == (factor, slowdown)
    settings, _ = settings_from(parse_args(["--faults", "kill", *extra, "-o", str(tmp_path / "out")]))
    assert (settings.straggler_factor, settings.slowdown) == (None, None)


def test_a_flipped_bit_no_check_can_find_is_not_waited_for():
    # an elastic shrink to dp=1 at t=5: no replica left to compare; a flip at t=8 is never found (the campaign does
    # not wait past its budget for it); one at t=3, in the dp2 world, is findable
    events = [ev("train_begin", 0.0, global_step=0, layout={"data_parallel": 2, "model_parallel": 4})]
    events += steps(1, 4, 1.0) + [ev("fault", 3.5, plan_index=0, rank=1, kind="sdc", at="forward", global_step=4),
                                  ev("elastic", 5.0, global_step=4, layout={"data_parallel": 1, "model_parallel": 4}),
                                  ev("fault", 8.0, plan_index=1, rank=2, kind="sdc", at="update", global_step=7),
                                  ev("fault", 8.5, plan_index=2, rank=0, kind="kill", at="update", global_step=7)]
    events.sort(key=lambda e: e["time"])
    early, late, kill = analysis.failures(events, end=100)
    assert (early["findable"], late["findable"], kill["findable"]) == (True, False, True)
    assert analysis.layout_at(events, 4.9)["data_parallel"] == 2 and analysis.layout_at(events, -1) is None


def test_checkpoint_cost_and_losses():
    # ordinary steps of 1 s, a save every 5 steps adds 0.5 s
    t, events = 0.0, []
    for g in range(1, 21):
        t += 1.0 + (0.5 if g % 5 == 0 else 0.0)
        events += [ev("checkpoint_committed", t - 0.01, global_step=g)] if g % 5 == 0 else []
        events.append(ev("step", t, global_step=g, loss=float(g)))
    cost = analysis.checkpoint_cost(events, end=100, save_every=5)
    assert cost["step_s"] == 1.0 and cost["save_s"] == pytest.approx(0.5) and cost["rate"] == pytest.approx(1.0)
    ref = {g: float(g) for g in range(1, 16)}
    ref[12] = 12.000001
    assert analysis.losses_equal(events, 100, ref) == {"compared": 15, "differ": 1, "first_difference": 12,
                                                       "beyond_reference": 5, "discarded": 0}
    assert analysis.percentile([1, 2, 3, 4], 50) == 2.5 and analysis.percentile([], 90) is None


def test_an_async_save_costs_the_steps_its_write_runs_beside():
    # ordinary steps of 1 s; a save every 5 steps stalls its step 0.1 s and slows the two after it by 0.2 s
    # each, until it is committed inside the second of them
    t, events = 0.0, []
    for g in range(1, 31):
        slow = {0: 0.1, 1: 0.2, 2: 0.2}.get(g % 5, 0.0) if g > 5 else 0.1 * (g == 5)
        t += 1.0 + slow
        if g % 5 == 2 and g > 5:
            events.append(ev("checkpoint_committed", t - 0.05, global_step=g - 2))
        events.append(ev("step", t, global_step=g, loss=float(g)))
    cost = analysis.checkpoint_cost(events, end=100, save_every=5)
    assert cost["step_s"] == pytest.approx(1.0) and cost["rate"] == pytest.approx(1.0)
    # 0.1 + 0.2 + 0.2, not the stall alone (the save of step 30, still running at the end, costs 0.1)
    assert cost["saves"] == 6 and cost["save_s"] == pytest.approx(0.5)
    # a save never committed (its job killed) costs its own step; the steps after it count as ordinary
    cut = [e for e in events if e["event"] != "checkpoint_committed" or e["global_step"] in (5, 10)]
    cost = analysis.checkpoint_cost(cut, end=100, save_every=5)
    assert cost["saves"] == 6 and cost["save_s"] == pytest.approx(0.1) and cost["step_s"] == pytest.approx(1.0)


def test_the_strategy_table():
    assert [s.name for s in strategies.parse("ttp,periodic,ttp")] == ["ttp", "periodic"]
    with pytest.raises(ValueError, match="unknown strategy 'restart'"):
        strategies.parse("restart")
    assert strategies.unavailable(strategies.STRATEGIES["arf"], None) is None
    assert strategies.unavailable(strategies.STRATEGIES["elastic"], None) is None   # tft.elastic exists
    missing = strategies.Strategy("future", "a scheme of a later dsim", ("tft.future=true",), needs="tft.future")
    assert strategies.unavailable(missing, None).startswith("strategy future needs tft.future, which this dsim "
                                                            "does not have (config: unknown key 'tft.future')")


def test_what_if_at_scale():
    assert scale.at_size(1024, 4, 2)[0] == 2 and scale.at_size(1024, 4, 256)[0] == 256
    # a measured dp3 (6 ranks, mp2): 3 holders do not divide dp512; 2 do (the report crashed on
    # optimizer_shard=170); mp3 makes dp341, of divisors 1, 11, 31, ...
    assert scale.at_size(1024, 2, 3)[0] == 2 and scale.at_size(1024, 3, 3)[0] == 1
    costs = {"periodic": {"save_s": 1.0, "down_s": 10.0}, "ttp": {"save_s": 1.0, "down_s": 12.0},
             "arf": {"save_s": 1.0, "down_s": 0.5}}
    rows = scale.table(365 * 86400, costs, model_parallel=4, per_slice=2)
    assert [r["ranks"] for r in rows] == [1024, 4096, 16384, 65536]
    for r in rows:
        g = {k: v["goodput_fraction"] for k, v in r["strategies"].items()}
        assert g["arf"] > g["ttp"] > g["periodic"] > 0
        assert r["strategies"]["periodic"]["fallback"] == 1.0
        assert r["strategies"]["periodic"]["interval_s"] == pytest.approx(math.sqrt(2 * 1.0 * r["job_mtbf_s"]))
    goodput = [r["strategies"]["periodic"]["goodput_fraction"] for r in rows]
    assert goodput == sorted(goodput, reverse=True)  # more ranks, more failures
    # one holder per slice (optimizer shard = dp): every failure falls back to the periodic checkpoint
    alone = scale.expected(1024, 365 * 86400, costs, h=1)
    assert alone["ttp"]["fallback"] == 1.0 and alone["arf"]["goodput_fraction"] < alone["periodic"]["goodput_fraction"]
    # the waste of saving, C / tau, against Young's tau; and a save that costs nothing (async saves measured so)
    m = 365 * 86400 / 1024
    assert 1 - alone["periodic"]["goodput_fraction"] == pytest.approx(1 / math.sqrt(2 * m) + (10 + math.sqrt(2 * m) / 2) / m)
    free = scale.expected(1024, 365 * 86400, {"periodic": {"save_s": 0.0, "down_s": 10.0}}, h=2)["periodic"]
    assert free["interval_s"] == 0 and free["goodput_fraction"] == pytest.approx(1 - 10 / m)


def test_what_if_with_node_failures():
    costs = {"periodic": {"save_s": 1.0, "down_s": 10.0}, "ttp": {"save_s": 1.0, "down_s": 12.0}}
    year = 365 * 86400
    ranks_only = scale.table(year, costs, model_parallel=4, per_slice=2)
    assert "node_fatal" not in ranks_only[0]
    # servers of 8 ranks failing every 5 years each: more failures, but the two holders of a slice (0 and 512 of
    # 1,024) are never on one server, so the last gasp still has a copy
    rows = scale.table(year, costs, model_parallel=4, per_slice=2, node_mtbf=5 * year, node_size=8)
    for r, alone in zip(rows, ranks_only):
        assert r["nodes"] == r["ranks"] // 8 and not r["node_fatal"]
        assert r["job_mtbf_s"] == pytest.approx(1 / (r["ranks"] / year + r["nodes"] / (5 * year)))
        assert r["job_mtbf_s"] < alone["job_mtbf_s"]
        assert r["strategies"]["ttp"]["fallback"] < 1e-4
        assert r["strategies"]["periodic"]["goodput_fraction"] < alone["strategies"]["periodic"]["goodput_fraction"]
    # a server as large as the job holds every copy: a node failure always falls back to the periodic checkpoint,
    # a share of all failures in proportion to the rates
    (big,) = scale.table(year, costs, model_parallel=4, per_slice=2, sizes=[1024], node_mtbf=year / 100,
                         node_size=1024)
    assert big["nodes"] == 1 and big["node_fatal"]
    rank_rate, node_rate = 1024 / year, 100 / year
    p_rank = (1 - math.exp(-12.0 / year)) ** (2 - 1)
    assert big["strategies"]["ttp"]["fallback"] == pytest.approx((rank_rate * p_rank + node_rate) / (rank_rate + node_rate))
    lines = report.scale_lines(rows, "1y")
    assert "holders      a node" in lines[0] and all(" survivable " in x for x in lines[1:])


def test_what_if_keeps_the_pipeline_stages():
    """A pipelined job (pp4 x dp2, mp1) at 8 ranks: a stage's two holders are neighbours, one server of 4 holds
    both (fatal, as campaign n2 saw). At 1,024 ranks the stages keep, dp grows inside each (256 ranks a stage):
    the two holders of a slice are 128 apart, no server of 8 holds both."""
    assert scale.layout_at(1024, 1, 2, stages=4) == ParallelLayout(256, 1, 128, 4)
    assert scale.at_size(8, 1, 2, node_size=4, stages=4) == (2, True)
    assert scale.at_size(1024, 1, 2, node_size=8, stages=4) == (2, False)
    assert scale.at_size(1024, 1, 2, node_size=256, stages=4) == (2, True)  # a server as large as a stage
    from dsim.campaign.__main__ import what_if
    costs = {"save_s": 0.5}
    rows = [{"strategy": "fault-free"}, {"strategy": "ttp", "save_s": 0.5, "failures": [
        {"recovery_s": 4.0, "recovered": True, "kind": "kill"}]}]
    begin = [{"event": "train_begin", "layout": {"data_parallel": 2, "model_parallel": 1, "optimizer_shard": 1,
                                                 "pipeline_stage": 4}}]
    got = what_if(rows, costs, 365 * 86400, begin, node_mtbf=5 * 365 * 86400, node_size=8)
    assert got["pipeline_stage"] == 4 and [r["node_fatal"] for r in got["rows"]] == [False] * 4
    # servers of 256: one holds a whole stage of 1,024 ranks (both holders), not of 4,096 (holders 512 apart)
    big = what_if(rows, costs, 365 * 86400, begin, node_mtbf=5 * 365 * 86400, node_size=256)
    assert [r["node_fatal"] for r in big["rows"]] == [True, False, False, False]


def test_report_table():
    rows = [{"strategy": "fault-free", "save_every": 10, "steps": 900, "goodput": 30.0, "goodput_fraction": 0.9},
            {"strategy": "periodic", "save_every": 10, "steps": 600, "goodput": 20.0, "goodput_fraction": 0.6,
             "failures_injected": 3, "failures_seen": 3, "survived": 3, "unrecovered": 0,
             "steps_lost_per_failure": 4.3, "steps_lost_predicted": [4, 5, 4], "recovery_median_s": 7.1,
             "recovery_p90_s": 9.0, "checkpoint_overhead": 0.12, "exact_required": True,
             "losses": {"differ": 0}, "final_state": {"equal": True}}]
    lines = report.table(rows)
    assert lines[0].split()[:3] == ["strategy", "every", "steps"]
    assert lines[2].split() == ["periodic", "10", "600", "20.0", "0.60", "3/3", "3", "0", "4.3", "(4.3)",
                                "7.1/9.0", "12.0%", "yes"]
    rows[1]["final_state"] = {"equal": False}
    assert report.table(rows)[2].endswith("NO")


@pytest.mark.parametrize("argv, message", [
    (["--strategy", "periodic,restart"], "--strategy: unknown strategy 'restart'"),
    (["--duration", "ten"], "--duration: 'ten' is not a duration"),
    (["--faults", "kill,meteor"], "--faults: unknown kind 'meteor'"),
    (["--faults", "node", "--ranks", "6"], "--ranks-per-node 4 must divide --ranks 6"),
    (["--faults", "sdc", "--sdc-check-every", "0"], "--sdc-check-every must be >= 1 step"),
    (["--faults", "hang", "--hang-timeout", "soon"], "--hang-timeout: 'soon' is not a duration"),
    (["--faults", "slow", "--slowdown", "1"], "--slowdown must be a number > 1"),
    (["--faults", "slow", "--straggler-factor", "0.5"], "--straggler-factor must be a number > 1 (or 0: not watched)"),
    (["--node-mtbf", "soon"], "--node-mtbf: 'soon' is not a duration"),
    (["--save-every", "10,x"], "--save-every: '10,x' is not a list"),
    (["--set", "model.hiden=[4]"], "config: unknown key 'model.hiden'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"dsim: error: {message}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("faults, timeout", [("kill", None), ("hang", 4.0), ("kill,stuck", 4.0), ("deadlock", 4.0),
                                            ("unmatched", 4.0)])
def test_frozen_and_stuck_failures_arm_every_jobs_hang_watch(tmp_path, faults, timeout):
    from dsim.campaign.__main__ import parse_args, settings_from
    settings, _ = settings_from(parse_args(["--faults", faults, "--hang-timeout", "4s", "-o", str(tmp_path / "out")]))
    assert settings.kinds == faults.split(",") and settings.hang_timeout == timeout


def test_a_report_dir_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "report.json").write_text("{}")
    assert main(["-o", str(tmp_path)]) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "report.json").read_text() == "{}"


def test_the_report_says_which_nodes_hold_every_copy_of_some_slices():
    from dsim.campaign.__main__ import node_loss
    begin = [{"event": "train_begin", "time": 0.0,
              "layout": {"data_parallel": 2, "model_parallel": 2, "optimizer_shard": 1, "pipeline_stage": 2}}]
    assert [x["fatal_sets"] for x in node_loss(begin).nodes(4)] == [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]
    assert node_loss([]) is None


def test_the_what_if_takes_the_recoveries_of_rank_failures_not_of_rollbacks():
    from dsim.campaign.__main__ import what_if
    rows = [{"strategy": "fault-free"},
            {"strategy": "periodic", "save_s": 0.5, "failures": [
                {"kind": "sdc", "recovered": True, "recovery_s": 0.2},  # rolled back in the job, whatever the scheme
                {"kind": "slow", "recovered": True, "recovery_s": 9.0},  # its slow steps before the kill counted
                {"kind": "kill", "recovered": True, "recovery_s": 5.0}]}]
    got = what_if(rows, {"save_s": 0.5}, 365 * 86400, [])
    assert got["costs"]["periodic"] == {"save_s": 0.5, "down_s": 5.0}


# --- on real hosts (--cluster HxS) and the peer scheme ---

from dsim.campaign import hosts  # noqa: E402


def test_a_cluster_is_hosts_x_slots():
    assert hosts.parse_shape("4x2") == (4, 2) and hosts.parse_shape(" 2 x 4 ") == (2, 4)
    for bad in ("4", "4x", "x2", "0x2", "4x0", "4*2", "four x two"):
        with pytest.raises(ValueError, match="is not HOSTSxSLOTS"):
            hosts.parse_shape(bad)


def test_the_hostfile_of_the_hosts_left_fits_every_rank():
    assert hosts.hostfile_text([1, 2, 3, 4], 8, 2) == "node1 slots=2\nnode2 slots=2\nnode3 slots=2\nnode4 slots=2\n"
    # node3 crashed: 8 ranks on 3 hosts, 3 slots each, node1's filled first (--map-by slot)
    assert hosts.hostfile_text([1, 2, 4], 8, 2) == "node1 slots=3\nnode2 slots=3\nnode4 slots=3\n"
    assert hosts.placement([1, 2, 4], 8, 2) == {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2, 6: 4, 7: 4}
    # 2 hosts x 4, node2 crashed: every rank on node1; the spares' own host stays as it was
    assert hosts.hostfile_text([1], 8, 4, spares=2, spares_host=3) == "node1 slots=8\nnode3 slots=2\n"
    assert set(hosts.placement([1], 8, 4).values()) == {1}
    # fewer ranks than slots: the hosts keep their slots
    assert hosts.placement([1, 2], 6, 4) == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}


@pytest.mark.parametrize("n, slots", [(2, 4), (4, 2), (3, 3), (5, 1)])
def test_a_host_crash_never_strikes_node1_and_strikes_its_host_wherever_it_is_up(n, slots):
    ranks = n * slots
    for rank in range(ranks):
        host = hosts.target_host(rank, n, slots)
        assert 2 <= host <= n
        if rank // slots + 1 != 1:
            assert host == rank // slots + 1  # the drawn rank's own host
        every = list(range(1, n + 1))
        for up in [every] + [[h for h in every if h != x] for x in every[1:]]:
            victim = hosts.aimed_rank(host, up, ranks, slots)
            on = hosts.placement(up, ranks, slots)[victim]
            if len(set(hosts.placement(up, ranks, slots).values())) > 1:
                assert on != 1 and (on == host or host not in hosts.placement(up, ranks, slots).values())
                assert victim == min(r for r, h in hosts.placement(up, ranks, slots).items() if h == on)
            else:
                assert victim == ranks - 1  # node1 alone: a host failure on one host kills that rank alone


def test_on_a_cluster_a_node_failure_is_a_host_crash_and_the_host_mtbf_crashes_hosts():
    drawn = failures.draw(5, 10.0, 300.0, ["kill", "node"], 8)
    plain = hosts.on_cluster(drawn, 5, None, 300.0, 4, 2)
    assert [(f.offset, f.rank, f.at) for f in plain] == [(f.offset, f.rank, f.at) for f in drawn]
    assert [f.kind for f in plain] == [{"node": "host"}.get(f.kind, f.kind) for f in drawn]
    assert "node" in {f.kind for f in drawn} and failures.draw(5, 10.0, 300.0, ["kill", "node"], 8) == drawn
    crashes = hosts.draw_host_crashes(5, 60.0, 6000.0, 4, 2)
    assert crashes == hosts.draw_host_crashes(5, 60.0, 6000.0, 4, 2)
    assert {f.kind for f in crashes} == {"host"} and {f.rank // 2 + 1 for f in crashes} == {2, 3, 4}
    assert 200 < len(crashes) < 400  # 3 hosts crashing every 60 s each in 6,000 s: about 300
    both = hosts.on_cluster(drawn, 5, 60.0, 300.0, 4, 2)
    assert [f.offset for f in both] == sorted(f.offset for f in both) and len(both) > len(drawn)
    assert hosts.draw_host_crashes(5, 60.0, 300.0, 1, 8) == []  # no host but node1


class FakeCluster:
    """What CampaignCluster uses of dsim.cluster.Cluster, recorded."""
    name, disk_path = "camp1", "/var/tmp/dsim-node"

    def __init__(self, tmp_path, n):
        self.tmp, self.killed, self.replaced, self.keepers = tmp_path, [], [], {h: 1000 + h for h in range(1, n + 1)}

    def hostname(self, h):
        return f"node{h}"

    def env(self):
        return {"PRTE_MCA_plm_ssh_agent": "agent", "HOSTFILE": "all"}

    def processes(self, h):
        return [self.keepers[h]] + ([4242] if h == 3 else [])  # something left on node3

    def kill_host(self, h):
        self.killed.append(h)
        return [4242] if h == 3 else []

    def replace_disk(self, h):
        self.replaced.append(h)

    def disk(self, h):
        return self.tmp / f"node{h}"


def test_after_a_host_crash_the_restart_runs_on_the_hosts_left_and_the_replaced_host_comes_back(tmp_path):
    fake = FakeCluster(tmp_path, 4)
    c = hosts.CampaignCluster(fake, 4, 2, 8)
    env, up = c.start(tmp_path, 0)
    assert up == [1, 2, 3, 4] and env["HOSTFILE"] == str(tmp_path / "hostfile-0")
    plan = [failures.Failure(3.0, 5, "host", "forward"), failures.Failure(4.0, 1, "kill", "update")]
    assert [f.rank for f in c.aim(plan, up)] == [4, 1]  # node3's first rank; a kill stays where it was drawn
    job = {"started": 0.0, "ended": 9.0, "hosts": [c.name(h) for h in up]}
    c.after_job([{"index": 0, "kind": "host", "rank": 4}, {"index": 1, "kind": "kill", "rank": 1}], job)
    assert fake.replaced == [3] and job["crashed"] == ["node3"] and job["left_running"] == {}
    env, up = c.start(tmp_path, 1)
    assert up == [1, 2, 4] and (tmp_path / "hostfile-1").read_text() == "node1 slots=3\nnode2 slots=3\nnode4 slots=3\n"
    assert [f.rank for f in c.aim(plan, up)] == [6, 1]  # node3 out: the next host up, node4 (ranks 6, 7)
    job = {"started": 10.0, "ended": 20.0, "hosts": [c.name(h) for h in up]}
    c.after_job([{"index": 0, "kind": "host", "rank": 4}, {"index": 1, "kind": "kill", "rank": 1}], job)
    assert fake.replaced == [3] and job["crashed"] == []  # (entry 0 was met in the job before)
    assert job["left_running"] == {"node3": 1}
    assert c.start(tmp_path, 2)[1] == [1, 2, 3, 4]  # the replaced machine is back
    # a host failure that struck node1 (only node1 left) crashes nothing: mpirun's own host
    job = {"started": 30.0, "ended": 40.0, "hosts": ["node1"]}
    c.after_job([{"index": 2, "kind": "host", "rank": 7}], job)
    assert job["crashed"] == [] and 1 not in fake.replaced


def test_each_failure_names_its_host_and_the_hosts_its_restart_ran_on():
    jobs = [{"started": 0.0, "hosts": ["node1", "node2", "node3", "node4"]},
            {"started": 10.0, "hosts": ["node1", "node2", "node4"]},
            {"started": 20.0, "hosts": ["node1", "node2", "node3", "node4"]}]
    recs = [{"time": 5.0, "rank": 5, "how": "restart"}, {"time": 15.0, "rank": 5, "how": "restart"},
            {"time": 25.0, "rank": 0, "how": None}]
    hosts.annotate(recs, jobs, 8, 2)
    assert [(r["host"], r["restart_hosts"]) for r in recs] == [
        ("node3", ["node1", "node2", "node4"]), ("node2", ["node1", "node2", "node3", "node4"]), ("node1", None)]


def test_the_peer_scheme():
    peer = strategies.STRATEGIES["peer"]
    assert peer.settings == ("tft.ttp=true", f"tft.peer_copy_every={strategies.PEER_COPY_EVERY}")
    assert peer.exact and not peer.spares and peer.needs.startswith("tft.peer_copy_every")
    assert strategies.unavailable(peer, None) is None
    every3 = strategies.with_peer_copy_every(peer, 3)
    assert every3.settings == ("tft.ttp=true", "tft.peer_copy_every=3") and "every 3 step(s)" in every3.summary
    cfg = load_config(None, list(every3.settings))
    assert cfg.tft.ttp and cfg.tft.peer_copy_every == 3
    assert strategies.with_peer_copy_every(strategies.STRATEGIES["ttp"], 3) is strategies.STRATEGIES["ttp"]
    from dsim.campaign.__main__ import parse_args, settings_from
    s, _ = settings_from(parse_args(["--strategy", "periodic,peer", "--peer-copy-every", "4", "-o", "/nonexistent/x"]))
    assert [x.settings for x in s.strategies] == [(), ("tft.ttp=true", "tft.peer_copy_every=4")]
    assert s.peer_copy_every == 4 and s.cluster is None and s.ranks == 8 and s.ranks_per_node == 4
    s, _ = settings_from(parse_args(["-o", "/nonexistent/x"]))
    assert s.peer_copy_every is None  # (no peer scheme: the report's settings as before)


@pytest.mark.parametrize("argv, message", [
    (["--peer-copy-every", "0", "--strategy", "peer"], "--peer-copy-every must be >= 1 step"),
    (["--cluster", "4y2"], "--cluster: '4y2' is not HOSTSxSLOTS"),
    (["--cluster", "1x8", "--faults", "node"], "--cluster 1x8: a host crash needs a host other than node1"),
    (["--cluster", "4x2", "--ranks-per-node", "4"], "--ranks-per-node 4: on a cluster a node is a host"),
    (["--cluster", "2x4", "--ranks", "16"], "--ranks 16 must fit --cluster 2x4's 8 slots"),
    (["--host-mtbf", "60s"], "--host-mtbf crashes the hosts of a cluster: it needs --cluster"),
    (["--cluster", "2x4", "--host-mtbf", "soon"], "--host-mtbf: 'soon' is not a duration"),
])
def test_bad_cluster_and_peer_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert main([*argv, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"dsim: error: {message}")
    assert not (tmp_path / "out").exists()


def test_young_daly_on_a_cluster_counts_the_host_crashes():
    assert hosts.job_mtbf(30.0, None, 4) == 30.0 and hosts.job_mtbf(30.0, 60.0, 1) == 30.0
    # 3 hosts but node1 crashing every 60 s each, beside rank failures every 30 s: a failure every 12 s
    assert hosts.job_mtbf(30.0, 60.0, 4) == pytest.approx(12.0)


def test_a_resume_that_finds_no_complete_checkpoint_is_told_from_other_bad_input(tmp_path):
    from dsim.campaign.runner import nothing_to_resume
    log = tmp_path / "jobs.log"
    log.write_text("+ bash launch/run_parallel_recover_ckpt.sh\ndsim: error: config: unknown key 'x'\n")
    start = log.stat().st_size
    assert not nothing_to_resume(log, 0)
    with open(log, "a") as f:
        f.write("+ bash launch/run_parallel_recover_ckpt.sh\ndsim: error: no usable committed checkpoint in "
                "/var/tmp/dsim-node/peer-every20 (tried network-2_20: ...): no committed checkpoint is complete: none "
                "to resume from; nothing was written\n")
    assert nothing_to_resume(log, start) and not nothing_to_resume(log, log.stat().st_size)


def test_steps_trained_before_a_start_over_are_not_progress():
    events = [{"event": "step", "time": float(t), "global_step": t} for t in range(1, 21)]
    events += [{"event": "train_begin", "time": 30.0, "global_step": 0}, {"event": "step", "time": 40.0, "global_step": 1}]
    assert analysis.progress(events, 35.0) == 20  # (as before: a restart's steps not redone yet still count)
    assert analysis.progress(events, 35.0, over=[25.0]) == 0  # started over at 25 s, no step since: none is left
    assert analysis.progress(events, 50.0, over=[25.0]) == analysis.progress(events, 50.0) == 1
    assert analysis.progress(events, 20.0, over=[25.0]) == 20
