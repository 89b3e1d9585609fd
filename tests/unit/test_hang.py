"""The hang watch (dsim.ft.hang) on real processes: a frozen one (SIGSTOP) is found by its stopped heartbeat
and killed, and so is a stuck one (it beats, but its step makes no progress outside a collective); a running
one, a waiting one, a dead one and one of another world are not."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsim.config import ConfigError, load_config
from dsim.faults import started
from dsim.ft.hang import (HangWatch, deadlocked, find_hung, forget_the_dead, heartbeats, killed_since, settled,
                          still_waiting)
from dsim.ft.orders import file_name
from dsim.parallel import progress
from dsim.runtime import PROCESS, Runtime

BEATING = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from dsim.ft.hang import HangWatch
from dsim.parallel import progress
watch = HangWatch(600, sys.argv[1])
watch.begin(SimpleNamespace(original_args=lambda: SimpleNamespace(rank=int(sys.argv[2]), world_size=int(sys.argv[3]))))
print("up", flush=True)
doing = sys.argv[4]
if doing == "idle":        # between steps
    time.sleep(120)
watch.step_begin(SimpleNamespace(original_args=lambda: SimpleNamespace(cur_step_num=8)))  # step 9
with progress.watched():
    if doing == "stuck":   # in its step, no progress: a deadlock
        time.sleep(120)
    if doing == "waiting":  # in its step, inside a collective (for the stuck one)
        with progress.waiting():
            time.sleep(120)
    while doing == "busy":  # in its step, a layer every 0.2 s (slow, but going on)
        time.sleep(0.2)
        progress.tick()
"""


def context(rank, world_size, step=0):
    return SimpleNamespace(original_args=lambda: SimpleNamespace(rank=rank, world_size=world_size, cur_step_num=step))


def start(tmp_path, rank, world_size, doing="idle"):
    p = subprocess.Popen([sys.executable, "-c", BEATING, str(tmp_path), str(rank), str(world_size), doing],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def watch_a_stalled_step(tmp_path, timeout, world_size, step, victim, within):
    """This process's watch, as rank 0 of world_size, over a step that begins and stalls until `victim` is
    killed (SIGKILL)."""
    watch = HangWatch(timeout, tmp_path)
    watch.begin(context(0, world_size))
    watch.step_begin(context(0, world_size, step=step - 1))
    try:
        with progress.watched(), progress.waiting():  # in its step, inside a collective
            assert victim.wait(timeout=within) == -signal.SIGKILL
    finally:
        watch.end(context(0, world_size))


def test_a_frozen_rank_is_killed_and_no_other(tmp_path, capfd):
    procs = {}
    try:
        procs = {"running": start(tmp_path, 1, 4), "frozen": start(tmp_path, 2, 4), "other world": start(tmp_path, 2, 8),
                 "dead": start(tmp_path, 3, 4)}
        frozen_since = started(procs["frozen"].pid)
        procs["dead"].kill()
        procs["dead"].wait()
        os.kill(procs["frozen"].pid, signal.SIGSTOP)
        os.kill(procs["other world"].pid, signal.SIGSTOP)  # a process of the world before an elastic shrink
        watch_a_stalled_step(tmp_path, 1.0, 4, 7, procs["frozen"], within=10)
        out = capfd.readouterr().out
        assert f"hang watch: rank 2 (pid {procs['frozen'].pid}) has not run for" in out and "step 7" in out
        assert procs["running"].poll() is None and procs["other world"].poll() is None
        assert not (tmp_path / "heartbeats" / file_name(os.getpid())).exists()  # the watch's own, removed at its end
        assert [p.name for p in (tmp_path / "heartbeats").glob("killed-*")] == [
            f"killed-{procs['frozen'].pid}-{frozen_since}"]  # claimed by the one watch that killed it
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_stuck_rank_is_killed_and_no_waiting_or_busy_one(tmp_path, capfd):
    procs = {}
    try:
        procs = {doing: start(tmp_path, rank, 5, doing) for rank, doing in enumerate(["waiting", "stuck", "busy", "idle"], 1)}
        stuck_since = started(procs["stuck"].pid)
        watch_a_stalled_step(tmp_path, 1.5, 5, 9, procs["stuck"], within=15)
        out = capfd.readouterr().out
        assert (f"hang watch: rank 2 (pid {procs['stuck'].pid}) is stuck: its process runs, its step has made no "
                "progress outside a collective for") in out and "(step 9, timeout 1.5 s)" in out, out
        assert all(p.poll() is None for doing, p in procs.items() if doing != "stuck")
        killed, = (tmp_path / "heartbeats").glob("killed-*")
        assert killed.name == f"killed-{procs['stuck'].pid}-{stuck_since}"
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_stuck_is_judged_by_the_process_own_measure_of_its_stall(tmp_path):
    beats = tmp_path / "beats"
    beats.mkdir()
    now = time.time()

    def beat(pid, stalled, age=0.2, world_size=4):
        record = {"pid": pid, "started": started(pid), "rank": 1, "world_size": world_size, "step": 3,
                  "time": now - age, "stalled": stalled}
        (beats / str(pid)).write_text(json.dumps(record))

    me = os.getpid()
    beat(me, 9.0)                        # this process's own: never judged by itself
    beat(os.getppid(), 2.5)              # stalled past the timeout: stuck
    assert [r["pid"] for r in find_hung(beats, 4, now, 2.0)[1]] == [os.getppid()]
    beat(os.getppid(), 1.5)              # not yet
    beat(os.getppid(), None)             # waiting, or between steps
    assert find_hung(beats, 4, now, 2.0)[1] == []
    beat(os.getppid(), 2.5, world_size=8)  # another world's
    assert find_hung(beats, 4, now, 2.0)[1] == []
    beat(os.getppid(), 2.5, age=3.0)     # its heartbeat is old: frozen, not stuck
    frozen, stuck = find_hung(beats, 4, now, 2.0)
    assert stuck == [] and [r["pid"] for r in frozen] == [os.getppid()]


def test_progress_knows_computing_from_waiting():
    progress = Runtime().progress  # a fresh process's marks
    assert progress.stalled_for(time.monotonic()) is None  # between steps
    with progress.watched():
        t = time.monotonic()
        assert 0 <= progress.stalled_for(t) < 1
        assert progress.stalled_for(t + 5) >= 5
        with progress.waiting():
            assert progress.stalled_for(t + 5) is None
            with progress.waiting():  # nested
                pass
            assert progress.stalled_for(t + 5) is None
        progress.tick()
        assert progress.stalled_for(time.monotonic()) < 1
        with progress.watched():  # nested (a save's comparison of replicas): the outer one still watches after it
            pass
        assert progress.stalled_for(time.monotonic() + 5) >= 5
    assert progress.stalled_for(time.monotonic() + 5) is None and progress.waits == 0


def test_fetching_a_batch_and_the_callbacks_between_steps_are_watched():
    """A data loader or a callback that never returns leaves its rank outside every collective while the others
    wait for it in the next step's: it must be work watched, or the watch cannot tell it from a healthy rank."""
    from dsim.engine.model import _call
    progress = PROCESS.progress  # the marks the loop and its callbacks keep (the model's groups' runtime's)
    seen = []

    def loader():
        for i in range(2):
            seen.append((progress.work, progress.stalled_for(time.monotonic() + 5) >= 5))  # inside next()
            yield i

    for i in progress.fetched(loader()):
        assert progress.work is None and progress.stalled_for(time.monotonic() + 5) is None  # between: the loop's
    assert seen == [("data loading", True), ("data loading", True)]
    stop = progress.fetched(loader())
    next(stop)
    stop.close()  # a loop left early (ctx.stop_requested) closes the loader too
    assert progress.work is None

    class Callback:
        def step_end(self, run_context):
            seen.append(progress.work)

    model = SimpleNamespace(groups=SimpleNamespace(runtime=PROCESS))
    _call([Callback()], "step_end", SimpleNamespace(original_args=lambda: SimpleNamespace(model=model)))
    assert seen[-1] == "callback" and progress.work is None and progress.began is None


def test_a_stall_with_every_rank_running_is_only_reported(tmp_path, capfd):
    other = start(tmp_path, 1, 2)
    try:
        watch = HangWatch(1.5, tmp_path)  # (longer than a live heartbeat can lag on a loaded machine)
        watch.begin(context(0, 2))
        watch.step_begin(context(0, 2, step=2))
        with progress.watched(), progress.waiting():
            time.sleep(4.5)  # said once the step has gone on for twice the timeout
        watch.end(context(0, 2))
        out = capfd.readouterr().out
        # once a step, not every heartbeat
        assert out.count("dsim: hang watch: rank 0: step 3 has gone on for") == 1 and "waiting" in out
        assert "waiting (all waiting for 15 s: a deadlock, the job is ended)" in out  # 10 x the timeout
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_heartbeats_of_ended_processes_are_forgotten(tmp_path):
    live = start(tmp_path, 1, 2)
    gone = start(tmp_path, 0, 2)
    try:
        gone.kill()
        gone.wait()
        beats = tmp_path / "heartbeats"
        assert {r["pid"] for r in heartbeats(beats)} == {live.pid, gone.pid}
        (beats / f"killed-{gone.pid}-1").touch()
        assert find_hung(beats, 2, time.time() + 3600, 1.0)[0] == [r for r in heartbeats(beats) if r["pid"] == live.pid]
        forget_the_dead(beats)
        assert sorted(p.name for p in beats.iterdir()) == [file_name(live.pid)]
        # a repair in the job: each rank of the repaired world forgets its host's dead at once, not at the next job;
        # another host's record only its host can judge (a pid means nothing here); the job's marks are rank 0's
        dead = lambda host=None: json.dumps({"pid": 424242, "started": 1, "rank": 1, "world_size": 2,  # noqa: E731
                                             "time": time.time(), **({"host": host} if host else {})}).encode()
        watch = HangWatch(600, tmp_path)
        watch.begin(context(1, 2))
        (beats / file_name(424242)).write_bytes(dead())
        (beats / file_name(424242, "elsewhere")).write_bytes(dead("elsewhere"))
        (beats / "said-3").touch()
        watch.recovered(context(1, 2))
        assert not (beats / file_name(424242)).exists() and (beats / file_name(424242, "elsewhere")).exists()
        assert (beats / "said-3").exists()  # not rank 1's to remove
        watch.recovered(context(0, 2))
        assert not (beats / "said-3").exists() and (beats / file_name(live.pid)).exists()
        watch.end()
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("value, message", [
    ("0", "must be a number of seconds > 0"), ("-5", "must be a number of seconds > 0 \\(or null: off\\), got -5.0"),
    ("true", "must be float"), ("soon", "must be float, got str 'soon'")])
def test_a_hang_timeout_is_seconds(value, message):
    with pytest.raises(ConfigError, match=f"config: tft.hang_timeout {message}"):
        load_config(None, [f"tft.hang_timeout={value}"])
    assert load_config(None, ["tft.hang_timeout=2.5"]).tft.hang_timeout == 2.5


def beat(rank, waiting, at=100.0, role=None):
    return {"pid": 1000 + (rank or 0), "rank": rank, "world_size": 4, "time": at, "waiting": waiting,
            **({"role": role} if role else {})}


def test_a_deadlock_is_every_process_waiting_with_no_progress_past_the_timeout():
    world = [beat(r, 9.0) for r in range(4)]
    assert deadlocked(world, 100.5, 6) == 9.5            # each waited 9 s at its beat, half a second ago
    assert deadlocked(world, 100.5, 10) is None          # not yet past the timeout
    assert deadlocked([*world[:3], beat(3, None)], 100.5, 6) is None   # rank 3 computes (or is between waits)
    assert deadlocked([*world[:3], beat(3, 2.0)], 100.5, 6) is None    # rank 3's wait began 2 s ago: progress
    assert deadlocked([*world, beat(None, None, role="spare")], 100.5, 6) == 9.5  # an idle spare is not in it
    assert deadlocked([*world, beat(None, 1.0, role="newcomer")], 100.5, 6) is None  # a newcomer's wait counts
    assert deadlocked([beat(0, 9.0)], 100.5, 6) is None  # one rank alone waits for nobody


def test_a_deadlocks_break_kills_only_a_process_still_in_a_wait_begun_before_it():
    """The break was marked at 100: a beat tells how its process came out once beaten a second later, and, if it
    still waits since before, SETTLE (3) seconds after its own watch revoked its rank's communicators."""
    def after(rank, waiting, at, revoked=None):
        return {**beat(rank, waiting, at), "revoked": revoked}
    out_of_it = after(0, 0.4, 101.5)                 # a new wait (the shrink) since 101.1: out of the old one
    computing = after(1, None, 101.5)                # not waiting: out of it
    elsewhere = after(3, 13.5, 103.5, revoked=100.2)  # waiting since 90, 3.3 s past its own revoke: still in it
    late = after(7, 11.4, 101.5, revoked=101.0)      # its watch revoked only at 101: not known yet
    slow = after(4, 12.4, 102.4, revoked=100.2)      # 2.2 s past its own revoke: maybe not out yet on a loaded machine
    early = after(2, 0.9, 100.5)                     # beaten too soon after the break
    assert [settled(r, 100.0) for r in (out_of_it, computing, elsewhere, late, early, slow)] == [True, True, True,
                                                                                                False, False, False]
    assert still_waiting([out_of_it, computing, elsewhere], 100.0) == [elsewhere]
    joined = after(5, 1.6, 101.5, revoked=100.1)     # its wait began at 99.9: its watch's revoke ended the old one
    assert settled(joined, 100.0) and still_waiting([joined], 100.0) == []  # (the 0.1 s rounding of a wait)
    assert still_waiting([after(6, 4.0, 103.5, revoked=100.2)], 100.0) == [after(6, 4.0, 103.5, revoked=100.2)]


def test_a_kill_is_no_reason_to_wait_once_it_ended_nothing(tmp_path):
    """A watch that sees nobody frozen or stuck waits when another watch killed someone since its work began (the
    death is on its way); not once that kill is older than the horizon (after a deadlock's break that killed a
    rank whose death did not end the wait, the watches judge again, and end the job)."""
    mark = tmp_path / "killed-123-456"
    mark.touch()
    now = time.time()
    assert killed_since(tmp_path, now - 5, 10) and not killed_since(tmp_path, now + 5, 10)  # killed before it began
    os.utime(mark, (now - 20, now - 20))
    assert not killed_since(tmp_path, now - 30, 10) and killed_since(tmp_path, now - 30, 60)


def test_a_job_that_went_on_alive_after_a_break_is_ended_at_its_next_deadlock(tmp_path, monkeypatch):
    """The mark of a break that left every rank alive (a repair in place followed) stays through the repair's
    forgetting of the dead, so the job's next deadlock ends it; a new job (a restart) forgets it."""
    import dsim.ft.hang as hang
    from dsim.ft import ulfm
    monkeypatch.setattr(ulfm, "unavailable_reason", lambda: None)
    watch = HangWatch(3, tmp_path)
    watch.dir.mkdir()
    watch.model = type("Model", (), {"groups": object()})()
    assert watch._can_break()
    runtime = Runtime()
    runtime.hang = watch
    hang.went_on_alive(runtime)
    assert not watch._can_break()
    forget_the_dead(watch.dir)                  # after a repair in the job
    assert not watch._can_break()
    forget_the_dead(watch.dir, starting=True)   # a job's start
    assert watch._can_break()
    monkeypatch.setattr(ulfm, "unavailable_reason", lambda: "no ULFM")
    assert not watch._can_break()


def test_a_break_explains_only_the_failures_noticed_soon_after_it(tmp_path, monkeypatch):
    """The failure handling saves a last gasp with every rank alive when a deadlock's break explains the failure: its
    mark made before the failure was noticed, at most 2 BREAK_WAIT (20 s) before. A later MPI error of another kind
    in the same job is not the break's (before, any mark left in the job's heartbeats said so)."""
    import dsim.ft.hang as hang
    watch = HangWatch(3, tmp_path)
    watch.dir.mkdir()
    monkeypatch.setattr(PROCESS, "hang", watch)  # (broke_deadlock: the process's runtime unless told another)
    assert not hang.broke_deadlock(time.time())
    mark = watch.dir / "killed-deadlock-job"
    mark.touch()
    os.utime(mark, (1000.0, 1000.0))
    assert [hang.broke_deadlock(t) for t in (999.5, 1000.5, 1019.0, 1021.0, 1500.0)] == [True, True, True, False, False]
    assert not hang.broke_deadlock(998.0)   # noticed before the break: another failure
    monkeypatch.setattr(PROCESS, "hang", None)
    assert not hang.broke_deadlock(1000.5)  # no watch in this process


def test_a_rank_polling_its_collective_is_still_waiting():
    """With in-place UCE repair a rank polls its collective (check_revoked, a tick each time): still a wait with no
    progress, as a deadlock needs (a campaign's arf job went undetected before); outside waits a tick is progress."""
    progress = Runtime().progress
    with progress.waiting():
        time.sleep(0.05)
        progress.tick()
        assert progress.waiting_for(time.monotonic()) >= 0.05
    assert progress.waiting_for(time.monotonic()) is None
    progress.tick()
    assert progress.last > time.monotonic() - 0.01


def test_a_deadlock_timeout_is_seconds_and_needs_the_hang_watch():
    with pytest.raises(ConfigError, match="config: tft.deadlock_timeout must be a number of seconds > 0 \\(or null: "
                                          "10 x tft.hang_timeout\\), got -1.0"):
        load_config(None, ["tft.hang_timeout=3", "tft.deadlock_timeout=-1"])
    with pytest.raises(ConfigError, match="config: tft.deadlock_timeout needs tft.hang_timeout"):
        load_config(None, ["tft.deadlock_timeout=30"])
    assert HangWatch(3, "/nonexistent").deadlock == 30 and HangWatch(3, "/nonexistent", deadlock_timeout=7).deadlock == 7
    assert HangWatch(None, "/nonexistent", straggler_factor=3).deadlock is None
    with pytest.raises(ConfigError, match="config: fault.kind deadlock strikes inside a step's computation"):
        load_config(None, ["fault.kind=deadlock", "fault.rank=1", "fault.step=3", "fault.at=commit"])


def test_a_stuck_fault_strikes_inside_a_step_a_save_or_a_callback():
    with pytest.raises(ConfigError, match="config: fault.kind stuck strikes inside a step's computation, a save or a "
                                          "callback: fault.at must be forward, allreduce, update, save, step_end or "
                                          "epoch_end, got 'commit'"):
        load_config(None, ["fault.kind=stuck", "fault.rank=1", "fault.step=3", "fault.at=commit"])
    for ok in ("update", "save", "step_end"):
        assert load_config(None, ["fault.kind=stuck", "fault.rank=1", "fault.step=3", f"fault.at={ok}"]).fault.at == ok


def test_a_second_failure_during_a_repair_strikes_at_a_point_of_it():
    cfg = load_config(None, ["fault.repair_hang=1", "fault.repair_at=exchange"])
    assert (cfg.fault.repair_hang, cfg.fault.repair_kill, cfg.fault.repair_at) == (1, None, "exchange")
    assert load_config(None, ["fault.repair_kill=2"]).fault.repair_at == "refill"
    with pytest.raises(ConfigError, match="config: fault.repair_at must be refill or exchange, got 'spawn'"):
        load_config(None, ["fault.repair_kill=1", "fault.repair_at=spawn"])


def test_a_process_left_idle_stops_its_watch_and_heartbeat(tmp_path):
    from dsim.ft import hang
    watch = HangWatch(1.0, tmp_path)
    watch.begin(context(5, 8))
    watch.step_begin(context(5, 8, step=11))  # the step an elastic shrink left it out of: never ended
    assert PROCESS.hang is watch and (tmp_path / "heartbeats" / file_name(os.getpid())).exists()
    hang.leave()
    assert PROCESS.hang is None and not watch._thread.is_alive()
    assert not (tmp_path / "heartbeats" / file_name(os.getpid())).exists()
    hang.leave()  # nothing running: nothing to do


SPARE = """
import sys, time
from dsim.ft.hang import standby_heartbeat
beat = standby_heartbeat(sys.argv[1], int(sys.argv[2]), 600, "spare")
print("up", flush=True)
time.sleep(float(sys.argv[3]))  # waiting for a place
beat.end()  # released: leaves its wait (its heartbeat goes), then MPI_Finalize
time.sleep(120)
"""


def test_a_frozen_spare_is_found_and_at_the_end_one_that_never_leaves_is_killed(tmp_path, capfd):
    """A warm spare beats while it waits (rank null, the training world's size): frozen, a training rank's watch
    finds it (a repair waits for it in the pool's shrink); at the end of training rank 0 waits for the released
    spares to leave, and kills one frozen (at once) or one still beating after the timeout (stuck)."""
    from dsim.ft.hang import standby_heartbeat, stop_frozen_spares
    assert standby_heartbeat(tmp_path, 8, None, "spare") is None  # no tft.hang_timeout: no heartbeat

    def spare(world_size, leaves_after):
        p = subprocess.Popen([sys.executable, "-c", SPARE, str(tmp_path), str(world_size), str(leaves_after)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "up"
        return p

    procs = {}
    try:
        procs = {"frozen": spare(8, 120), "leaving": spare(8, 3), "stuck": spare(8, 120), "other world": spare(4, 120)}
        os.kill(procs["frozen"].pid, signal.SIGSTOP)
        time.sleep(2.3)
        frozen, stuck = find_hung(tmp_path / "heartbeats", 8, time.time(), 2.0)
        assert [(r["pid"], r["rank"]) for r in frozen] == [(procs["frozen"].pid, None)] and stuck == []
        t = time.monotonic()
        stop_frozen_spares(tmp_path, 8, 2.0)
        took = time.monotonic() - t
        assert procs["frozen"].wait(5) == procs["stuck"].wait(5) == -signal.SIGKILL
        assert procs["leaving"].poll() is None and procs["other world"].poll() is None  # left its wait; another job's
        assert 1.9 < took < 4, took  # the stuck one: killed after the timeout
        out = capfd.readouterr().out
        assert (f"dsim: hang watch: a warm spare (pid {procs['frozen'].pid}) has not run for " in out and
                f"dsim: hang watch: a warm spare (pid {procs['stuck'].pid}) did not leave within 2 s of its release "
                "(released at the end of training, timeout 2 s): killed (SIGKILL)" in out), out
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_standby_heartbeat_goes_on_until_the_training_one_begins(tmp_path):
    """A spare given a place (or a spawned newcomer) beats from its wait (its join) until its training heartbeat
    replaces it: a repair waiting for it in the state exchange finds it frozen there too."""
    from dsim.ft import hang
    beat = hang.standby_heartbeat(tmp_path, 8, 5, "spare")
    try:
        assert hang.standby_heartbeat(tmp_path, 8, 5, "newcomer") is beat  # the spare takes a place: it goes on
        record, = heartbeats(tmp_path / "heartbeats")
        assert (record["rank"], record["role"], record["world_size"], record["pid"]) == (None, "spare", 8, os.getpid())
        watch = HangWatch(5, tmp_path)
        watch.begin(context(3, 8))
        assert PROCESS.standby is None and not beat._thread.is_alive() and PROCESS.hang is watch
        record, = heartbeats(tmp_path / "heartbeats")
        assert record["rank"] == 3 and "role" not in record
        watch.end()
        assert PROCESS.hang is None and heartbeats(tmp_path / "heartbeats") == []
    finally:
        hang.end_standby()


def test_frozen_spares_need_spares():
    with pytest.raises(ConfigError, match="config: fault.spare_hang freezes the warm spares: it needs tft.spares"):
        load_config(None, ["fault.spare_hang=true"])
    assert load_config(None, ["fault.spare_hang=true", "tft.spares=1"]).fault.spare_hang is True


def record(rank, step_time, world_size=8, timed=10, pid=None, step=12):
    return {"pid": pid or 1000 + rank, "started": 1, "rank": rank, "world_size": world_size, "step": step,
            "time": time.time(), "step_time": step_time, "timed": timed}


def test_a_straggler_is_slower_than_the_others_of_its_stage():
    from dsim.ft.straggler import find_stragglers
    even = [record(r, 0.100 + 0.002 * r) for r in range(8)]
    assert find_stragglers(even, 8, 8, 2.0) == []
    slow = even[:3] + [record(3, 0.45)] + even[4:]
    (found, median), = find_stragglers(slow, 8, 8, 2.0)
    assert found["rank"] == 3 and median == pytest.approx(0.108)
    assert find_stragglers(slow, 8, 8, 5.0) == []                          # not 5x slower
    assert find_stragglers(slow, 4, 4, 2.0) == []                          # another world's records
    assert find_stragglers(slow[:3] + [record(3, None)] + slow[4:], 8, 8, 2.0) == []  # no step measured yet
    # two pipeline stages of 4: stage 1 computes more (the loss) and is no straggler; rank 5 is, within it
    staged = [record(r, 0.1) for r in range(4)] + [record(4, 0.3), record(5, 0.9), record(6, 0.3), record(7, 0.3)]
    assert [(r["rank"], m) for r, m in find_stragglers(staged, 8, 4, 2.0)] == [(5, 0.3)]
    # two ranks in a stage: the slower against the other
    assert [r["rank"] for r, _ in find_stragglers([record(0, 0.1, 2), record(1, 0.25, 2)], 2, 2, 2.0)] == [1]


def test_a_straggler_is_judged_after_steps_past_the_factor_and_once(capfd, tmp_path):
    from dsim.ft.straggler import STEPS, StragglerJudge
    killed, claimed = [], []
    judge = StragglerJudge(2.0, evict=False)
    alive = lambda pid, started: True  # noqa: E731
    world = lambda slow_time, timed: [record(r, 0.1) for r in range(7)] + [record(7, slow_time, timed=timed)]  # noqa: E731
    judge.look(world(0.5, 20), 8, 8, alive, claimed.append)
    judge.look(world(0.5, 20 + STEPS - 1), 8, 8, alive, claimed.append)
    assert capfd.readouterr().out == ""                                    # not yet: STEPS of its steps
    judge.look(world(0.15, 20 + STEPS), 8, 8, alive, claimed.append)       # back under: the count starts again
    judge.look(world(0.5, 30), 8, 8, alive, claimed.append)
    judge.look(world(0.5, 30 + STEPS - 1), 8, 8, alive, claimed.append)
    assert capfd.readouterr().out == ""
    judge.look(world(0.5, 30 + STEPS), 8, 8, alive, claimed.append)
    judge.look(world(0.5, 40), 8, 8, alive, claimed.append)                # once
    out = capfd.readouterr().out
    assert out.count("dsim: straggler watch: rank 7 (pid 1007) computes its steps 5.0x slower than the other ranks "
                     "of its stage (500 ms a step against a median of 100 ms, as of step 12; tft.straggler_factor 2): "
                     "reported (tft.straggler_evict: false)") == 1, out
    assert claimed == []                                                   # reported, not killed

    from dsim.ft.hang import _kill, claim
    victims = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        kill = lambda r: _kill(tmp_path, r)  # noqa: E731  (as the hang watch passes it)
        for victim, frozen_too in zip(victims, (False, True)):
            evicting = StragglerJudge(3.0, evict=True)
            rows = [record(r, 0.1, 4) for r in range(3)] + [record(3, 0.4, 4, pid=victim.pid, timed=0)]
            evicting.look(rows, 4, 4, alive, kill)
            rows[3] = record(3, 0.4, 4, pid=victim.pid, timed=STEPS)
            if frozen_too:  # a hang watch killed and reported it first: killed, not reported twice
                assert claim(tmp_path, rows[3])
            evicting.look(rows, 4, 4, alive, kill)
            assert victim.wait(timeout=10) == -signal.SIGKILL
            assert (tmp_path / f"killed-{victim.pid}-{rows[3]['started']}").exists()
            out = capfd.readouterr().out
            assert out.count("killed (SIGKILL), as a failed rank (tft.straggler_evict)") == (0 if frozen_too else 1), out
    finally:
        for victim in victims:
            victim.kill()
            victim.wait()


def test_rank_0_judged_a_straggler_says_so_before_it_is_killed(tmp_path):
    """The straggler watch runs on rank 0: when rank 0 is the straggler, its line comes before its own kill."""
    code = (f"import os, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_hang import record\nfrom dsim.ft.hang import _kill\nfrom dsim.ft.straggler import STEPS, StragglerJudge\n"
            f"d = {str(tmp_path)!r}\n"
            "rows = [record(0, 0.9, 4, pid=os.getpid(), timed=t) for t in (0, STEPS)]\n"
            "judge = StragglerJudge(3.0, evict=True)\n"
            "for r in rows:\n"
            "    judge.look([r] + [record(k, 0.1, 4) for k in (1, 2, 3)], 4, 4, lambda p, s: True, lambda x: _kill(d, x))\n"
            "print('not killed')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert p.stdout.startswith("dsim: straggler watch: rank 0 (pid ") and "killed (SIGKILL)" in p.stdout, p.stdout
    assert "not killed" not in p.stdout and list(tmp_path.glob("killed-*"))


def test_progress_times_a_step_outside_its_waits():
    progress = Runtime().progress
    before = progress.timed
    with progress.watched("step"):
        time.sleep(0.05)
        with progress.waiting():  # waiting for another rank is not computing
            time.sleep(0.2)
    with progress.watched("save"):  # only steps are timed
        time.sleep(0.1)
    step_time, timed = progress.step_time()
    assert 0.05 <= step_time < 0.15 and timed == before + 1


def test_a_slow_rank_sleeps_what_it_computed_times_the_slowdown_less_one():
    from dsim.parallel import progress as setting  # (fault.kind slow sets the process's slowdown)
    progress = Runtime().progress
    progress.tick()
    t = time.monotonic()
    progress.pace()                       # no slow fault: nothing
    assert time.monotonic() - t < 0.05
    setting.slowdown = 3.0
    try:
        progress.tick()
        time.sleep(0.05)                  # "computing" 50 ms
        t = time.monotonic()
        progress.pace()                   # sleeps 2 x 50 ms
        assert 0.09 <= time.monotonic() - t < 0.5
        with progress.waiting():          # never inside a wait
            t = time.monotonic()
            progress.pace()
            assert time.monotonic() - t < 0.05
    finally:
        setting.slowdown = 1.0


@pytest.mark.parametrize("sets, message", [
    (["tft.straggler_factor=1"], "tft.straggler_factor must be a number > 1 \\(or null: off\\), got 1"),
    (["tft.straggler_evict=true"], "tft.straggler_evict needs tft.straggler_factor"),
    (["fault.kind=slow", "fault.rank=1", "fault.step=3", "fault.at=forward", "fault.slowdown=0.5"],
     "fault.slowdown must be a number > 1 \\(how many times slower\\), got 0.5"),
    (["fault.kind=slow", "fault.rank=1", "fault.step=3", "fault.at=save"],
     "fault.kind slow begins inside a step's computation: fault.at must be forward, allreduce or update, got 'save'")])
def test_straggler_settings_are_checked(sets, message):
    with pytest.raises(ConfigError, match=f"config: {message}"):
        load_config(None, sets)
    cfg = load_config(None, ["tft.straggler_factor=2.5", "tft.straggler_evict=true", "fault.kind=slow", "fault.rank=1",
                             "fault.step=3", "fault.at=forward", "fault.slowdown=3"])
    assert (cfg.tft.straggler_factor, cfg.tft.straggler_evict, cfg.fault.slowdown) == (2.5, True, 3)
