"""The hang watch over real hosts (dsim.ft.orders), on the test cluster: 2 hosts, 4 ranks mapped by slot, ranks 0-2 on
node1 and rank 3 alone on node2 (dp2 x mp2: rank 3's replica is rank 1, on node1).

- The output directory shared by the hosts (the test's directory): rank 3 is stuck in step 6; only node1's watches see
  it (rank 3 is alone on node2), and a pid of node2's means nothing on node1, so the first of them to claim it orders
  its kill, and rank 3's own watch thread carries the order out. The last gasp of the survivors follows.
- Rank 3 frozen (SIGSTOP) in step 6: its host-mates would kill it, and it has none; its heartbeat stops, which
  node1's watches do not judge (another host's stale record may as well be a dead process's). Its host answers no
  probe (its listener is frozen with it): the ranks of node1 find node2 silent (dsim.ft.cut), agree on their side
  (rank 0's host, half the hosts) and save the last gasp from rank 3's replica.
- The output directory node-local (on each host's own disk): rank 0 sees the heartbeats of node1's ranks only, and
  says once what the watches cannot do then; the job trains on and ends as without it.

Needs root and iproute2 (CI runs as root): skipped, with the reason, where namespaces cannot be made.
"""
from __future__ import annotations

import re
import sys

import pytest

from conftest import BIN, LAUNCHER, cluster_of, ft_env, run_command
from dsim.cluster import DISK_PATH
from ftjob import LOSS, OPTS, events, fault

pytestmark = pytest.mark.e2e

ARGS = ["-m", "dsim.train", *OPTS, "--set", "parallel.model_parallel=2", "--set", "tft.ttp=true",
        "--set", "tft.hang_timeout=3"]


@pytest.fixture(scope="module")
def cluster():
    yield from cluster_of(2, 3, "wh")


def on_cluster(cluster, args, cwd):
    """`mpirun -n 4` with the launch scripts' fault tolerance (launch/ft.sh), from node1, through the launcher."""
    env = ft_env()
    ft = env.pop("DSIM_FT_MPIRUN_ARGS").split()
    cmd = [sys.executable, str(LAUNCHER), str(BIN / "mpirun"), *ft, *cluster.mpirun_args("slot"), "-n", "4",
           sys.executable, *args]
    return run_command(cluster.command(1, cmd, cwd), cwd, 150, None, {**env, **cluster.env()})


def test_a_stuck_rank_alone_on_its_host_is_killed_by_order_and_the_last_gasp_saved(cluster, tmp_path):
    proc = on_cluster(cluster, [*ARGS, *fault("stuck", 3, "allreduce", 6)], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsim: fault: rank 3 is stuck (its training stops, its process runs) during the allreduce of step 6" \
        in proc.stdout, proc.stdout
    # said by a watch of node1, which names rank 3's host: its pid is node2's
    assert re.search(r"dsim: hang watch: rank 3 \(pid \d+ on node2\) is stuck: its process runs, its step has made no "
                     r"progress outside a collective for \d+\.\d s \(step 6, timeout 3 s\): killed \(SIGKILL\), as a "
                     r"failed rank", proc.stdout), proc.stdout
    hang, = events(tmp_path, "hang")
    assert (hang["rank"], hang["how"], hang["host"], hang["ordered"]) == (3, "stuck", "node2", True)
    assert hang["by"] in (0, 1, 2)
    assert list((tmp_path / "run" / "heartbeats").glob("order-*")) == []  # carried out on node2
    gasp, = events(tmp_path, "last_gasp_saved")
    assert gasp["failed"] == [3] and gasp["global_step"] == 5
    errors = [x for x in proc.stderr.splitlines() if x.startswith("dsim: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "dsim: error: rank(s) 3 failed; last-gasp checkpoint ttp-1_5 (global step 5) committed"), proc.stderr


def test_a_frozen_rank_alone_on_its_host_is_found_silent_and_the_others_save_the_last_gasp(cluster, tmp_path):
    proc = on_cluster(cluster, [*ARGS, *fault("hang", 3, "allreduce", 6)], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dsim: fault: rank 3 stops (SIGSTOP) during the allreduce of step 6" in proc.stdout, proc.stdout
    assert "dsim: warning: rank 0: no answer from host(s) node2 (none of their ranks takes a TCP connection) while " \
        "this rank waits in a collective" in proc.stdout, proc.stdout
    assert events(tmp_path, "hang") == []  # (nobody judges it frozen: no watch of node2 runs)
    seen, = events(tmp_path, "cut_seen")
    assert (seen["rank"], seen["silent"]) == (0, ["node2"]) and seen["waited"] > 3, seen
    side, = events(tmp_path, "cut_side")
    assert (side["ranks"], side["left_out"], side["hosts"]) == ([0, 1, 2], [3], ["node1"]), side
    gasp, = events(tmp_path, "last_gasp_saved")
    assert gasp["failed"] == [3] and gasp["global_step"] == 5, gasp
    assert "dsim: error: rank(s) 3 unreachable (a network cut, or a host gone silent; this side holds the quorum of " \
        "the hosts); last-gasp checkpoint ttp-1_5 (global step 5) committed" in proc.stderr, proc.stderr


def test_a_node_local_output_directory_is_said_once_and_the_job_trains_on(cluster, tmp_path):
    job = f"watch-{tmp_path.name}"  # (on each host's own disk: node1's holds rank 0's metrics)
    local = f"{DISK_PATH}/{job}/run"
    # (40 epochs of 10 steps: 3.6 s and more; rank 0 looks 2 s in)
    proc = on_cluster(cluster, [*ARGS, "--set", f"output.dir={local}", "--set", "checkpoint.enabled=false", "--set",
                                "train.epochs=40", "--set", "output.loss_every=10"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warned = [x for x in proc.stdout.splitlines() if x.startswith("dsim: warning: hang watch:")]
    assert warned == [f"dsim: warning: hang watch: rank 0 sees no heartbeat of 1 of the 4 ranks in {local}/heartbeats "
                      "(not shared by the job's hosts): a frozen or stuck rank is found by the ranks of its own host "
                      "only; a deadlock, a straggler or a rank alone on its host is not (put output.dir on a file "
                      "system every host shares: docs/cluster.md)"], proc.stdout
    assert len(LOSS.findall(proc.stdout)) == 40
    unseen, = events(cluster.disk(1) / job, "heartbeats_unseen")
    assert (unseen["missing"], unseen["world_size"]) == (1, 4)
