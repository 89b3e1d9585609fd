"""A fault campaign on real hosts (python -m dsim.campaign --cluster, issue 52): host crashes drawn from a host MTBF
strike node2 of a test cluster of 2 hosts x 2 (dp2 x mp2: every slice on both hosts), the restart runs on node1
alone, and the periodic and peer schemes both end bit for bit where the fault-free run does."""
import json
import sys
from pathlib import Path

import pytest

from conftest import run_command
from dsim.campaign import failures, hosts
from dsim.campaign.jobs import carrying
from dsim.cluster import PREFIX, leftovers, namespaces, teardown, unavailable

pytestmark = pytest.mark.e2e

SMALL = ["--set", "parallel.model_parallel=2", "--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640"]
DURATION, HOST_MTBF, SAVE_EVERY = 18, 20, 5


def seed_with_one_crash():
    """A seed whose plan crashes node2 once, late enough for the first job to be up and to have saved a checkpoint
    (a job's first steps come 8-13 s after its start on 2 cores at load 30-45), early enough to leave the budget's
    last seconds to the restart."""
    for seed in range(1000):
        plan = hosts.on_cluster(failures.draw(seed, 365 * 86400, DURATION, ["kill"], 4), seed, HOST_MTBF, DURATION,
                                2, 2)
        if len(plan) == 1 and 12 <= plan[0].offset <= 15:
            return seed


def left_behind(pid):
    """Processes still carrying a job id of the campaign with this pid."""
    return carrying(f"{pid}-", prefix=True)


def test_host_crashes_restart_on_the_hosts_left_bit_identical(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(f"no cluster of namespaces here: {why}")
    seed = seed_with_one_crash()
    out = tmp_path / "report"
    try:
        run_command([sys.executable, "-m", "dsim.campaign", "--cluster", "2x2", *SMALL, "--mtbf", "1y", "--host-mtbf",
                     f"{HOST_MTBF}s", "--duration", f"{DURATION}s", "--strategy", "periodic,peer", "--save-every",
                     str(SAVE_EVERY), "--seed", str(seed), "-o", str(out)], tmp_path, timeout=300, check=0)
    finally:  # a campaign killed at the timeout could not tear its cluster down: the test does
        for ns in namespaces(f"{PREFIX}camp"):
            name = ns[len(PREFIX):].rsplit("-", 1)[0]
            if not Path(f"/proc/{name[len('camp'):]}").exists():
                teardown(name)
    doc = json.loads((out / "report.json").read_text())
    name = doc["cluster"]["name"]
    assert leftovers(name) == [] and left_behind(name[len("camp"):]) == []
    assert doc["settings"]["cluster"] == "2x2" and doc["settings"]["host_mtbf_s"] == HOST_MTBF
    assert [(r["strategy"], r["save_every"]) for r in doc["combinations"]] == [("periodic", SAVE_EVERY),
                                                                                ("peer", SAVE_EVERY)]
    assert doc["finished"] and [f["kind"] for f in doc["plan"]] == ["host"]
    assert "--set tft.peer_copy_every=1" in (out / f"peer-every{SAVE_EVERY}" / "jobs.log").read_text(errors="replace")
    for row in [doc["fault_free"], *doc["combinations"]]:
        assert 0 < row["goodput_fraction"] <= 1, row["strategy"]
    for row in doc["combinations"]:
        # node2 crashed (never node1, mpirun's): its job ended; the restart ran on node1 alone, then node2's disk
        # was a new one
        (crash,) = row["failures"]
        assert crash["kind"] == "host" and crash["host"] == "node2" and crash["ranks"] == [2, 3]
        assert crash["how"] == "restart" and crash["recovered"] and crash["restart_hosts"] == ["node1"]
        assert crash["steps_lost"] == crash["predicted_lost"], (row["strategy"], crash)
        struck = [j for j in row["jobs"] if j["crashed"]]
        assert [j["crashed"] for j in struck] == [["node2"]] and struck[0]["hosts"] == ["node1", "node2"]
        after = row["jobs"][row["jobs"].index(struck[0]) + 1]
        assert after["hosts"] == ["node1"] and after["started"] >= struck[0]["ended"]
        assert all(j["left_running"] == {} for j in row["jobs"])
        # exact: every loss and the newest periodic checkpoint equal to the fault-free run's (on a machine so loaded
        # that the crash struck before the first checkpoint and the restart committed none before the budget's end,
        # the report says there was none to compare)
        assert row["losses"]["differ"] == 0 and row["losses"]["compared"] > 0
        committed = any(e["event"] == "checkpoint_committed" for e in map(json.loads, (
            Path(row["dir"]) / "run" / "metrics.jsonl").read_text().splitlines()))
        if committed:
            assert row["final_state"]["equal"] is True, row["final_state"]
        else:
            assert crash["step"] <= SAVE_EVERY and row["final_state"] == {
                "equal": None, "why": "no periodic checkpoint was committed"}
