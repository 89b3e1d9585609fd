"""The watches across hosts (dsim.ft.orders): a pid of another host's heartbeat is never signalled here; it gets an
order, which that host's watches carry out once they made sure the pid is still that process; a record of another
host is judged stuck only while it beats, never frozen; a deadlock needs every rank's heartbeat."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsim.faults import started
from dsim.ft.hang import _kill, deadlocked, find_hung, heartbeats
from dsim.ft.orders import HOST, file_name, here, obey, running, send, unseen


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def record(pid, host=None, age=0.1, stalled=None, rank=1, world_size=4, waiting=None, start=None):
    return {"pid": pid, "started": started(pid) if start is None else start, "rank": rank, "world_size": world_size,
            "step": 3, "time": time.time() - age, "stalled": stalled, "waiting": waiting,
            **({"host": host} if host else {})}


def write(d, r):
    (d / file_name(r["pid"], r.get("host", HOST))).write_text(json.dumps(r))


def test_another_hosts_process_is_signalled_by_order_only(tmp_path, sleeper):
    there = record(sleeper.pid, "node9")  # a pid of node9's that happens to name a process here
    assert not here(there) and here(record(sleeper.pid)) and here(record(sleeper.pid, HOST))
    assert send(tmp_path, there, signal.SIGKILL)
    assert _kill(tmp_path, there) and not _kill(tmp_path, there)  # claimed once: one watch reports it
    time.sleep(0.2)
    assert sleeper.poll() is None  # nothing signalled here
    orders = sorted(p.name for p in tmp_path.glob("order-*"))
    assert orders == [f"order-{int(signal.SIGKILL)}-{sleeper.pid}-{there['started']}@node9"]
    obey(tmp_path)  # this host's watch: not its order
    assert sleeper.poll() is None and sorted(p.name for p in tmp_path.glob("order-*")) == orders


def test_a_hosts_watch_carries_out_its_orders_for_the_same_process_only(tmp_path, sleeper):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        send(tmp_path, record(sleeper.pid, "x"), signal.SIGKILL)
        for p in tmp_path.glob("order-*"):  # as node x's watch would find it: addressed to this host
            p.rename(tmp_path / p.name.replace("@x", f"@{HOST}"))
        stale = {**record(other.pid, "x"), "started": started(other.pid) - 1}  # that pid, given to another process
        send(tmp_path, stale, signal.SIGKILL)
        for p in tmp_path.glob("order-*@x"):
            p.rename(tmp_path / p.name.replace("@x", f"@{HOST}"))
        obey(tmp_path)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
        time.sleep(0.2)
        assert other.poll() is None  # not the process the order meant
        assert list(tmp_path.glob("order-*")) == []  # both done with
    finally:
        other.kill()
        other.wait()


def test_another_hosts_record_is_stuck_while_it_beats_and_never_frozen(tmp_path, sleeper):
    now = time.time()
    write(tmp_path, record(sleeper.pid, "node9", age=30))              # stale: frozen or dead, its host's to tell
    write(tmp_path, record(424242, "node8", age=0.2, stalled=5.0))     # beats, no progress for 5 s: stuck
    write(tmp_path, record(424243, "node7", age=30, stalled=5.0))      # stalled, but stale: not judged here
    frozen, stuck = find_hung(tmp_path, 4, now, 2.0)
    assert frozen == [] and [r["pid"] for r in stuck] == [424242]
    assert running(record(424242, "node8", age=0.5), now) and not running(record(424242, "node8", age=30), now)
    assert running(record(sleeper.pid), now) and not running(record(sleeper.pid, start=1), now)


def test_a_deadlock_needs_every_ranks_heartbeat():
    now = time.time()
    waits = [{**record(1000 + r, "node1" if r < 2 else "node2", rank=r, waiting=30.0)} for r in range(4)]
    assert deadlocked(waits, now, 10.0) is not None
    # a node-local heartbeat directory: node1's watch sees ranks 0 and 1 only, both waiting (for node2's, computing)
    assert deadlocked(waits[:2], now, 10.0) is None and unseen(waits[:2], 4) == 2 and unseen(waits, 4) is None


def test_a_heartbeat_names_its_host_and_two_hosts_pids_do_not_collide(tmp_path):
    from types import SimpleNamespace

    from dsim.ft.hang import HangWatch
    watch = HangWatch(600, tmp_path)
    watch.begin(SimpleNamespace(original_args=lambda: SimpleNamespace(rank=0, world_size=2)))
    try:
        beats = tmp_path / "heartbeats"
        write(beats, record(os.getpid(), "node9", rank=1, world_size=2))  # another host's rank with this pid
        mine = [r for r in heartbeats(beats) if here(r)]
        assert [(r["pid"], r["host"], r["rank"]) for r in mine] == [(os.getpid(), HOST, 0)]
        assert sorted(p.name for p in beats.iterdir()) == sorted([file_name(os.getpid()),
                                                                  file_name(os.getpid(), "node9")])
        assert find_hung(beats, 2, time.time() + 3600, 1.0) == ([], [])  # neither itself nor node9's, stale
    finally:
        watch.end()
