"""End to end on real hosts, made on this machine by dsim.cluster (namespaces; issue 51): the default run on 2 hosts
x 4 ranks gives the losses of 1 host x 8 bit for bit, and so do the default run on 4 hosts x 2, LeNet5 and the
Transformer on both shapes and the pipeline Transformer with a stage a host; shared-memory sums stay within a host
(a model-parallel group split over hosts sums through MPI); with node-local checkpoints, one host's disk replaced
by an empty one, the launch scripts' resume (HOSTFILE) takes that host's shards from replicas on the other and is
bit-identical; each rank's host comes from MPI: the header, the warning for replicas on one host, the commit record's hosts,
`inspect --survivability`, a sequential hostfile's placement, a fault plan's node failure; and a cluster leaves
nothing on the machine after a pass, a failure, a timeout, Ctrl-C, or its maker killed.

Needs root and iproute2 (CI runs as root): skipped, with the reason, where namespaces cannot be made.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, LAUNCHER, ROOT, cluster_of, launch_env, made_once, run_command
from runs import steps as losses, tensors

from dsim.cluster import DISK_PATH, STATE_ROOT, Cluster, leftovers, unavailable

pytestmark = pytest.mark.e2e

DEFAULT = str(ROOT / "configs" / "default.yaml")
# the default run (data parallel 2 x model parallel 4, momentum, synthetic data) at small widths: 2 epochs of 4 steps,
# a checkpoint at each epoch's end (the default network's 32M parameters took 30-40 s a job here, 2 steps)
SMALL_ARGS = ["--set", "model.hidden=[64,128,128,64]", "--set", "data.num_samples=640", "--set",
              "train.steps_per_epoch=4", "--set", "output.progress_bar=false"]
RUN = ["-m", "dsim.train", "--config", DEFAULT, *SMALL_ARGS, "--set", "output.dir=run"]
SHARED = "sums in shared memory: mp"


def skip_without_namespaces():
    why = unavailable()
    if why:
        pytest.skip(f"no cluster of namespaces here: {why}")


@pytest.fixture(scope="module")
def cluster():
    """2 hosts x 4 slots, shared by this module's tests (each leaves it as it found it), torn down after them
    whatever happened, and checked to have left nothing."""
    yield from cluster_of(2, 4, "t")


def on_cluster(cluster, n, args, cwd, map_by="slot", timeout=150):
    """`mpirun --hostfile ... -n N python ARGS` run on node1 as a user would, through dsim/ft/launcher.py; every rank
    first writes its host's name to cwd/host.<rank>."""
    record = 'hostname > host.$OMPI_COMM_WORLD_RANK && exec "$0" "$@"'
    cmd = [sys.executable, str(LAUNCHER), str(BIN / "mpirun"), *cluster.mpirun_args(map_by), "-n", str(n),
           "sh", "-c", record, sys.executable, *args]
    return run_command(cluster.command(1, cmd, cwd), cwd, timeout, 0, cluster.env())


def hosts_of_ranks(d: Path, n: int) -> list[str]:
    return [(d / f"host.{r}").read_text().strip() for r in range(n)]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The run on 1 host x 8 ranks: (its directory, its losses, its header line)."""
    d, proc = made_once(tmp_path_factory, "cluster-ref", 8, RUN, check=0)
    return d, losses(d / "run"), proc.stdout.splitlines()[0]


def test_default_run_on_2_hosts_x_4_is_bit_identical_to_1_host_x_8(cluster, one_host, tmp_path):
    _, ref, header = one_host
    proc = on_cluster(cluster, 8, [*RUN, "--set", "checkpoint.enabled=false"], tmp_path)
    assert hosts_of_ranks(tmp_path, 8) == ["node1"] * 4 + ["node2"] * 4
    assert len(ref) == 8 and losses(tmp_path / "run") == ref
    # each model-parallel group (ranks 0-3, 4-7) on one host: its sums through that host's shared memory, as on one
    assert SHARED in header and SHARED in proc.stdout.splitlines()[0]
    # the header names the hosts MPI found (the rest as on one host); each replica pair (r, r + 4) is on both: no warning
    assert header.startswith("dsim: 8 ranks, data_parallel=2 ")
    assert proc.stdout.splitlines()[0] == header.replace("dsim: 8 ranks, ", "dsim: 8 ranks on 2 hosts (4 + 4), ")
    assert "every rank holding a slice" not in proc.stderr


def test_a_model_parallel_group_split_over_hosts_sums_through_mpi(cluster, one_host, tmp_path):
    """Ranks round robin over the hosts: each model-parallel group has ranks on both, so its sums leave shared memory
    (the header drops it) for MPI over TCP between the hosts; the same bits. And each replica pair (r, r + 4) is on one
    host: rank 0 warns once at start, the commit record keeps the hosts, and `inspect --survivability` names the hosts
    whose loss loses slices."""
    _, ref, _ = one_host
    proc = on_cluster(cluster, 8, RUN, tmp_path, map_by="node")
    assert hosts_of_ranks(tmp_path, 8) == ["node1", "node2"] * 4
    assert "sums in shared memory" not in proc.stdout
    assert losses(tmp_path / "run") == ref
    assert proc.stdout.startswith("dsim: 8 ranks on 2 hosts (4 + 4), data_parallel=2 model_parallel=4 ")
    warned = [line for line in proc.stderr.splitlines() if "every rank holding a slice" in line]
    assert warned == ["dsim: warning: every rank holding a slice of layer1.param ({0,4}) is on host node1: losing node1 "
                      "loses it (and 19 more slice(s) held on one host only); map ranks to hosts so that replicas sit "
                      "on different hosts (docs/cluster.md: which mapping)"], proc.stderr

    ckpt = tmp_path / "run" / "checkpoints"
    record = json.loads((ckpt / "network-2_4.commit").read_text())
    assert record["hosts"] == {"node1": [{"start": 0, "stop": 7, "step": 2}], "node2": [{"start": 1, "stop": 8, "step": 2}]}
    inspect = [sys.executable, "-m", "dsim.inspect", "--survivability", str(ckpt)]
    out = subprocess.run(inspect, capture_output=True, text=True, timeout=60, check=True, cwd=ROOT).stdout
    assert "  hosts (the commit record's): node1 (ranks 0,2,4,6), node2 (ranks 1,3,5,7)\n" in out, out
    assert "  replica sets by host: {0,4}: node1, node1; {1,5}: node2, node2; {2,6}: node1, node1; {3,7}: node2, node2\n" \
        in out, out
    assert ("    node1 (ranks 0,2,4,6): fatal (every rank of {0,4}, {2,6} is on it: layer1.param, layer2.weight, "
            "layer3.bias, …)\n") in out, out
    assert "    node2 (ranks 1,3,5,7): fatal (every rank of {1,5}, {3,7} is on it: " in out, out


@pytest.fixture(scope="module")
def cluster4():
    """4 hosts x 2 slots, for this module's tests on four hosts; torn down after them, checked to leave nothing."""
    yield from cluster_of(4, 2, "q")


# The seed configs, short (3 steps, no checkpoints): the losses of 1 host x 8 are the reference for each
SHORT = ["--set", "train.epochs=1", "--set", "train.steps_per_epoch=3", "--set", "checkpoint.enabled=false",
         "--set", "output.progress_bar=false", "--set", "output.dir=run"]
CONFIGS = {name: ["-m", "dsim.train", "--config", str(ROOT / "configs" / f"{name}.yaml"), *SHORT]
           for name in ("lenet5", "transformer", "transformer_pipeline")}


@pytest.mark.parametrize("config,shape", [("default", "cluster4"), ("lenet5", "cluster"), ("lenet5", "cluster4"),
                                          ("transformer", "cluster"), ("transformer", "cluster4"),
                                          ("transformer_pipeline", "cluster")])
def test_each_config_on_each_shape_of_hosts_gives_the_losses_of_one_host(config, shape, one_host, request,
                                                                        tmp_path_factory, tmp_path):
    """The default, LeNet5 (dp4 x mp2) and Transformer (dp2 x mp4) configs on 2 hosts x 4 and 4 hosts x 2 ranks
    (--map-by slot; the default on 2 x 4: above), and the pipeline Transformer (pp2 x dp2 x mp2) with a stage a host:
    the losses of 1 host x 8, bit for bit; the header names the hosts, and keeps the shared-memory sums exactly
    when every model-parallel group is on one host."""
    c = request.getfixturevalue(shape)
    if config == "default":
        ref, header = one_host[1], one_host[2]
        args = [*RUN, "--set", "checkpoint.enabled=false"]
    else:
        d, proc = made_once(tmp_path_factory, f"cluster-ref-{config}", 8, CONFIGS[config], check=0)
        ref, header, args = losses(d / "run"), proc.stdout.splitlines()[0], CONFIGS[config]
    proc = on_cluster(c, 8, args, tmp_path)
    assert hosts_of_ranks(tmp_path, 8) == [f"node{1 + r // c.slots}" for r in range(8)]
    assert len(ref) >= 3 and losses(tmp_path / "run") == ref
    mp = int(re.search(r"model_parallel=(\d+)", header).group(1))
    on_one_host = c.slots % mp == 0
    assert header.endswith(f"; {SHARED}")  # one host: every model-parallel group's sums in its shared memory
    hosts = " + ".join([str(c.slots)] * c.hosts)
    want = header.replace("dsim: 8 ranks, ", f"dsim: 8 ranks on {c.hosts} hosts ({hosts}), ")
    if not on_one_host:  # a model-parallel group over two hosts sums through MPI
        want = want.removesuffix(f"; {SHARED}")
    assert proc.stdout.splitlines()[0] == want, (proc.stdout.splitlines()[0], want)


def test_node_local_checkpoints_one_disk_replaced_resume_bit_identical(cluster, one_host, tmp_path):
    """The launch scripts with HOSTFILE, each host saving to its own disk (the same path on both); host 2's disk is
    then replaced by an empty one, and the recover script's resume takes ranks 4-7's shards from their replicas on
    host 1: the losses and every tensor saved after equal an uninterrupted run's on one host, bit for bit."""
    ref, ref_losses, _ = one_host
    env = {**cluster.env(), "VIRTUAL_ENV": sys.prefix}  # HOSTFILE: the cluster's

    def script(name, *args):
        cmd = ["bash", str(ROOT / "launch" / name), DEFAULT, f"{DISK_PATH}/ckpt", *SMALL_ARGS, *args]
        return run_command(cluster.command(1, cmd, tmp_path), tmp_path, 150, 0, env)
    proc = script("run_parallel_save_ckpt.sh", "--set", "train.epochs=1", "--set", "output.dir=first")
    assert f"--hostfile {cluster.hostfile} --map-by slot" in proc.stderr
    for host, ranks in ((1, range(0, 4)), (2, range(4, 8))):
        assert sorted(p.name for p in (cluster.disk(host) / "ckpt").glob("rank_*")) == [f"rank_{r}" for r in ranks]
    assert list((cluster.disk(1) / "ckpt").glob("*.commit"))  # rank 0's commit record, on host 1's disk only
    # host 1's disk alone (ranks 0-3's files and the records) says where every replica is: either host may be lost
    inspect = [sys.executable, "-m", "dsim.inspect", "--survivability", str(cluster.disk(1) / "ckpt")]
    out = subprocess.run(inspect, capture_output=True, text=True, timeout=60, check=True, cwd=ROOT).stdout
    assert "  replica sets by host: {0,4}: node1, node2; {1,5}: node1, node2; {2,6}: node1, node2; {3,7}: node1, node2\n" \
        in out, out
    assert "    any one of the 2 hosts: survivable (every replica set keeps a rank on another host)\n" in out, out

    new = cluster.replace_disk(2)
    assert list(new.iterdir()) == []
    proc = script("run_parallel_recover_ckpt.sh", "--set", "train.epochs=2", "--set", "output.dir=second")
    assert "4 shard(s) of network-1_4 taken from replicas" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert losses(tmp_path / "first") + losses(tmp_path / "second") == ref_losses
    for r in range(8):
        saved, = (cluster.disk(1 if r < 4 else 2) / "ckpt" / f"rank_{r}").glob("*-2_4.h5")
        want, got = tensors(ref / "run" / "checkpoints" / f"rank_{r}" / "network-2_4.h5"), tensors(saved)
        assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want), r


def test_a_sequential_hostfile_puts_each_pipeline_stages_replicas_on_both_hosts(cluster, tmp_path):
    """docs/cluster.md's way to any placement: a hostfile of a line a rank read with MAP_BY=seq, through the launch
    script. pp2 x dp2 x mp2 with `slot` holds stage 0 (ranks 0-3) and both its replica pairs on node1 (the warning:
    tests/unit/test_hosts.py); here each model-parallel pair shares a host and its replica is on the other: no warning,
    and the checkpoint survives either host's loss."""
    ranks = tmp_path / "ranks.txt"
    ranks.write_text("node1\nnode1\nnode2\nnode2\nnode1\nnode1\nnode2\nnode2\n")
    env = {**cluster.env(), "VIRTUAL_ENV": sys.prefix, "HOSTFILE": str(ranks), "MAP_BY": "seq"}
    pipeline = ["--set", "parallel.pipeline_stage=2", "--set", "parallel.data_parallel=2", "--set",
                "parallel.model_parallel=2", "--set", "parallel.micro_batch_num=2"]
    cmd = ["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), DEFAULT, str(tmp_path / "ckpt"), *SMALL_ARGS,
           "--set", "train.epochs=1", "--set", "output.dir=run", *pipeline]
    proc = run_command(cluster.command(1, cmd, tmp_path), tmp_path, 150, 0, env)
    assert f"--hostfile {ranks} --map-by seq" in proc.stderr
    assert proc.stdout.startswith("dsim: 8 ranks on 2 hosts (4 + 4), data_parallel=2 model_parallel=2 optimizer_shard=1 "
                                  "pipeline_stage=2 "), proc.stdout
    assert "every rank holding a slice" not in proc.stderr, proc.stderr
    record = json.loads((tmp_path / "ckpt" / "network-1_4.commit").read_text())
    assert record["hosts"] == {"node1": [{"start": 0, "stop": 2, "step": 1}, {"start": 4, "stop": 6, "step": 1}],
                               "node2": [{"start": 2, "stop": 4, "step": 1}, {"start": 6, "stop": 8, "step": 1}]}
    inspect = [sys.executable, "-m", "dsim.inspect", "--survivability", str(tmp_path / "ckpt")]
    out = subprocess.run(inspect, capture_output=True, text=True, timeout=60, check=True, cwd=ROOT).stdout
    assert "  replica sets by host: {0,2}: node1, node2; {1,3}: node1, node2; {4,6}: node1, node2; {5,7}: node1, node2\n" \
        in out, out
    assert "    any one of the 2 hosts: survivable (every replica set keeps a rank on another host)\n" in out, out


def test_a_node_failure_in_a_fault_plan_takes_the_victims_real_host(cluster, tmp_path):
    """A fault plan's `node` failure on real hosts kills the ranks MPI found on the victim's host (node2: ranks 4-7),
    not node_size consecutive ranks (2 here); the survivors on node1 hold a replica of every slice and commit the last
    gasp, its record naming the hosts."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"faults": [{"rank": 5, "kind": "node", "node_size": 2, "at": "forward", "step": 3}]}))
    env = {**cluster.env(), "VIRTUAL_ENV": sys.prefix, "DSIM_FAULT_PLAN": str(plan)}
    cmd = ["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), DEFAULT, str(tmp_path / "ckpt"), *SMALL_ARGS,
           "--set", "output.dir=run", "--set", "fault.kind=plan", "--set", "tft.ttp=true"]
    proc = run_command(cluster.command(1, cmd, tmp_path), tmp_path, 150, 1, env)
    assert "dsim: fault: node failure: ranks 4-7 (host node2) die together during the forward of step 3" in proc.stdout
    assert "rank(s) 4, 5, 6, 7 failed; last-gasp checkpoint ttp-1_2 (global step 2) committed" in proc.stderr
    record, = (tmp_path / "ckpt" / "ttp_checkpoints").glob("*/ttp-1_2.commit")
    assert json.loads(record.read_text())["hosts"] == {"node1": [{"start": 0, "stop": 4, "step": 1}],
                                                       "node2": [{"start": 4, "stop": 8, "step": 1}]}


def test_a_sigterm_notice_to_the_launch_script_saves_on_both_hosts(cluster, tmp_path):
    """A scheduler's SIGTERM to the launch script: the launcher passes it to the ranks on node1 only, not to the agent
    that holds node2's daemon (ending that ended the job unsaved); node2's ranks learn of it from the step's
    all-reduce, and every rank stops after the same step, saved on its own host's disk, exit 143."""
    cmd = ["bash", str(ROOT / "launch" / "run_parallel_save_ckpt.sh"), DEFAULT, f"{DISK_PATH}/notice", *SMALL_ARGS,
           "--set", "train.epochs=25", "--set", "checkpoint.save_on_signal=true", "--set", "output.dir=run"]
    env = {**launch_env(), **cluster.env(), "VIRTUAL_ENV": sys.prefix}
    proc = subprocess.Popen(cluster.command(1, cmd, tmp_path), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "metrics.jsonl").exists() or len(losses(tmp_path / "run")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, out + err
    stopped = [line for line in out.splitlines() if "SIGTERM: training stopped after step" in line]
    assert stopped, out + err
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert 3 <= step < 100 and losses(tmp_path / "run")[-1][0] == step
    name = re.search(r"saved as (\S+);", stopped[0]).group(1)  # (a periodic save may have come before, under load)
    for host, ranks in ((1, range(0, 4)), (2, range(4, 8))):
        for r in ranks:  # each rank's file of the step stopped at, on its own host's disk
            assert (cluster.disk(host) / "notice" / f"rank_{r}" / f"{name}.h5").is_file(), (host, r, name)


def test_the_launchers_timeout_ends_the_ranks_on_every_host(cluster, tmp_path):
    """dsim/ft/launcher.py --timeout on a job over both hosts: exit 124, and no rank left on either host."""
    record = 'hostname > host.$OMPI_COMM_WORLD_RANK && exec sleep 300'
    cmd = [sys.executable, str(LAUNCHER), "--timeout", "6", str(BIN / "mpirun"), *cluster.mpirun_args(), "-n", "8",
           "sh", "-c", record]
    proc = run_command(cluster.command(1, cmd, tmp_path), tmp_path, 60, 124, cluster.env())
    assert hosts_of_ranks(tmp_path, 8) == ["node1"] * 4 + ["node2"] * 4, proc.stderr
    deadline = time.monotonic() + 5
    while any(cluster.processes(h) != [cluster.keepers[h]] for h in (1, 2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [cluster.processes(h) for h in (1, 2)] == [[cluster.keepers[1]], [cluster.keepers[2]]]


# Nothing left behind. A job of two ranks on two hosts, each rank writing a file then sleeping; the cluster made by
# `python -m dsim.cluster run` for it, which then ends one of four ways.
SLEEPER = "import os, time; open('started.' + os.environ['OMPI_COMM_WORLD_RANK'], 'w').close(); time.sleep(313.25)"


def processes_with(marker: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("end", ["pass", "failure", "timeout", "interrupt", "maker_killed"])
def test_a_cluster_leaves_nothing_behind(end, tmp_path):
    skip_without_namespaces()
    name = f"e{os.getpid()}{end[:3]}"
    marker = f"{SLEEPER} # {name}"
    job = {"pass": ["true"], "failure": ["sh", "-c", "exit 3"]}.get(end) or [
        "mpirun", "--hostfile", str(STATE_ROOT / name / "hostfile"), "--map-by", "slot", "-n", "2",
        sys.executable, "-c", marker]
    cmd = [sys.executable, "-m", "dsim.cluster", "run", "--name", name, "--hosts", "2", "--slots", "1",
           *(["--timeout", "6"] if end == "timeout" else []), "--", *job]
    env = {**launch_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if end in ("interrupt", "maker_killed"):
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"started.{r}").exists() for r in range(2)):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT if end == "interrupt" else signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    expected = {"pass": 0, "failure": 3, "timeout": 124, "interrupt": 130, "maker_killed": -signal.SIGKILL}[end]
    assert proc.returncode == expected, err
    if end == "timeout":
        assert all((tmp_path / f"started.{r}").exists() for r in range(2))  # the job ran on both hosts
    if end == "maker_killed":  # nobody tore it down: `down` finds it by its name
        assert leftovers(name)
        run_command([sys.executable, "-m", "dsim.cluster", "down", "--name", name], tmp_path, 60, 0, env)
    assert leftovers(name) == []
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    deadline = time.monotonic() + 5  # the launcher's ranks end within a second of it (dsim.guard)
    while processes_with(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(name) == []


# 10 MB from node2's server to whoever connects: the time it takes tells the link's rate
SERVER = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('0.0.0.0', 5000)); s.listen()\n"
          "while True:\n    c, _ = s.accept(); c.sendall(b'x' * 10_000_000); c.close()")
CLIENT = ("import socket, time\nt = time.time(); s = socket.create_connection(('node2', 5000), timeout=1); n = 0\n"
          "while (b := s.recv(1 << 20)): n += len(b)\nprint(n, time.time() - t)")


def test_the_node_faults_a_cluster_makes(tmp_path):
    """What the node-fault tests use: a link shaped with tc tbf carries 10 MB in about 0.8 s at 100 Mbit/s; a cut
    link carries nothing until restored; killing a host kills every process on it but the host itself."""
    skip_without_namespaces()
    with Cluster(hosts=2, slots=1, name=f"f{os.getpid()}", rate="100mbit") as c:
        server = subprocess.Popen(c.command(2, [sys.executable, "-c", SERVER], tmp_path))

        def fetch():
            for _ in range(50):  # the server may still be starting
                p = subprocess.run(c.command(1, [sys.executable, "-c", CLIENT], tmp_path), capture_output=True,
                                   text=True, timeout=30)
                if "ConnectionRefused" not in p.stderr:
                    return p
                time.sleep(0.1)
        got = fetch()
        assert got.returncode == 0 and got.stdout.split()[0] == "10000000", got.stderr
        assert float(got.stdout.split()[1]) > 0.6  # 80 Mbit at 100 Mbit/s: 0.8 s; unshaped here 0.06 s
        c.cut(2)
        assert "timed out" in fetch().stderr
        c.restore(2)
        assert fetch().returncode == 0
        assert server.pid in c.processes(2)
        assert server.pid in c.kill_host(2) and c.processes(2) == [c.keepers[2]]
        assert server.wait(timeout=10) == -signal.SIGKILL
    assert leftovers(c.name) == []
