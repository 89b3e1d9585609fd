"""The straggler watch by host (issue 52, part 5): a host all of whose ranks are slow is one straggler, reported and
evicted as a host; a slow link is judged from the job's pace and the host whose interfaces hold packets back (pure,
no MPI: heartbeat records as rank 0's watch reads them)."""
import os
import time

import pytest

from dsim.ft.straggler import (HELD, STEPS, Pace, StragglerJudge, egress_held, host_groups, ranks_text,
                               slow_link)

TWO = ["node1"] * 4 + ["node2"] * 4
alive = lambda pid, started: True  # noqa: E731


def record(rank, step_time, timed=10, step=12, link=None, t=None, world_size=8):
    return {"pid": 1000 + rank, "started": 1, "rank": rank, "world_size": world_size, "step": step,
            "time": time.time() if t is None else t, "step_time": step_time, "timed": timed,
            **({} if link is None else {"link": link})}


def test_host_groups():
    assert host_groups([4, 5, 6, 7], TWO) == ([("node2", [4, 5, 6, 7])], [])
    assert host_groups([5, 6, 7], TWO) == ([], [5, 6, 7])                       # not the whole host: ranks
    assert host_groups([1, 4, 5, 6, 7], TWO) == ([("node2", [4, 5, 6, 7])], [1])
    assert host_groups([4, 5, 6, 7], None) == ([], [4, 5, 6, 7])                # hosts unknown
    assert host_groups([0, 1], ["vm"] * 2) == ([], [0, 1])                      # one host: ranks, as before
    assert host_groups([2], ["a", "b", "c"]) == ([], [2])                       # a host of one rank: the rank
    scattered = ["node1", "node2"] * 4                                          # --map-by node: ranks 1, 3, 5, 7
    assert host_groups([1, 3, 5, 7], scattered) == ([("node2", [1, 3, 5, 7])], [])
    assert ranks_text([4, 5, 6, 7]) == "ranks 4-7" and ranks_text([1, 3]) == "ranks 1, 3" and ranks_text([2]) == "rank 2"


def test_a_host_slow_as_a_whole_is_reported_once_as_the_host(capfd):
    judge = StragglerJudge(2.0, evict=False)
    def world(timed):
        return [record(r, 0.1) for r in range(4)] + [record(r, 0.5, timed=timed) for r in range(4, 8)]
    claimed = []
    judge.look(world(20), 8, 8, alive, claimed.append, TWO)
    judge.look(world(20 + STEPS - 1), 8, 8, alive, claimed.append, TWO)
    assert capfd.readouterr().out == ""
    judge.look(world(20 + STEPS), 8, 8, alive, claimed.append, TWO)
    judge.look(world(30), 8, 8, alive, claimed.append, TWO)
    out = capfd.readouterr().out
    assert out == ("dsim: straggler watch: host node2 (ranks 4-7) computes its steps 5.0x slower than the other ranks "
                   "of their stage (500 ms a step against a median of 100 ms, as of step 12; tft.straggler_factor 2): "
                   "reported (tft.straggler_evict: false)\n"), out
    assert claimed == []
    # without hosts the same ranks are four stragglers, as before
    judge = StragglerJudge(2.0, evict=False)
    judge.look(world(0), 8, 8, alive, claimed.append)
    judge.look(world(STEPS), 8, 8, alive, claimed.append)
    assert capfd.readouterr().out.count("dsim: straggler watch: rank ") == 4


def test_a_host_is_judged_when_its_last_rank_is():
    """Its ranks past the factor a step apart: none judged alone before the whole host is."""
    judge, claimed = StragglerJudge(2.0, evict=True), []
    kill = lambda r: claimed.append(r["rank"]) or True  # noqa: E731
    rows = [record(r, 0.1) for r in range(4)] + [record(r, 0.5, timed=0) for r in range(4, 8)]
    judge.look(rows, 8, 8, alive, kill, TWO)
    rows[4:7] = [record(r, 0.5, timed=STEPS) for r in range(4, 7)]   # rank 7 one step behind
    judge.look(rows, 8, 8, alive, kill, TWO)
    assert claimed == []
    rows[7] = record(7, 0.5, timed=STEPS)
    judge.look(rows, 8, 8, alive, kill, TWO)
    judge.look(rows, 8, 8, alive, kill, TWO)
    assert claimed == [4, 5, 6, 7]                                    # all of them, once


def test_rank_0s_host_evicted_kills_rank_0_last():
    judge, order = StragglerJudge(2.0, evict=True), []
    rows = [record(r, 0.5, timed=t) for r in range(4) for t in (0,)] + [record(r, 0.1) for r in range(4, 8)]
    rows[0]["pid"] = os.getpid()
    judge.look(rows, 8, 8, alive, lambda r: order.append(r["rank"]) or True, TWO)
    for r in rows[:4]:
        r["timed"] = STEPS
    judge.look(rows, 8, 8, alive, lambda r: order.append(r["rank"]) or True, TWO)
    assert order == [1, 2, 3, 0]


def test_slow_link():
    held = {"node1": 0, "node2": 30}
    assert slow_link(0.3, 0.1, held, 2.0) == "node2"
    assert slow_link(0.15, 0.1, held, 2.0) is None                              # not 2x slower than before
    assert slow_link(0.3, None, held, 2.0) is None                              # no baseline yet
    assert slow_link(0.3, 0.1, {"node1": 20, "node2": 30}, 2.0) is None         # both hosts hold back: no one link
    assert slow_link(0.3, 0.1, {"node1": 0, "node2": HELD - 1}, 2.0) is None    # too few packets to be its link
    assert slow_link(0.3, 0.1, {"node2": 30}, 2.0) is None                      # one host
    assert slow_link(0.3, 0.1, {"a": 1, "b": 40, "c": 2}, 2.0) == "b"


def test_pace_over_the_last_steps_and_the_fastest_seen():
    pace = Pace()
    assert pace.add(0.0, 0, {"a": 0, "b": 0}) is None
    for step in range(1, STEPS + 1):
        got = pace.add(0.1 * step, step, {"a": 0, "b": 0})
    assert got == (pytest.approx(0.1), {"a": 0, "b": 0}) and pace.best == pytest.approx(0.1)
    t, counter = 0.1 * STEPS, 0
    for step in range(STEPS + 1, 3 * STEPS + 1):   # 4x slower, b holding back 20 packets a step
        t, counter = t + 0.4, counter + 20
        got = pace.add(t, step, {"a": 0, "b": counter})
    assert got == (pytest.approx(0.4), {"a": 0, "b": pytest.approx(20)}) and pace.best == pytest.approx(0.1)
    got = pace.add(t + 0.4, 3 * STEPS + 1, {"a": 0, "b": 5})   # b's qdisc replaced: its counter from 0
    assert got[1]["b"] == pytest.approx(((STEPS - 1) * 20 + 5) / STEPS)


def test_a_slow_link_is_reported_once_naming_the_host_and_evicted_as_a_host(capfd):
    judge, killed = StragglerJudge(2.0, evict=True), []
    kill = lambda r: killed.append(r["rank"]) or True  # noqa: E731
    t, held = 1000.0, 0

    def beat(step, took, grew):
        nonlocal t, held
        t, held = t + took, held + grew
        rows = [record(r, 0.002, step=step, t=t, link=0 if r < 4 else held) for r in range(8)]
        judge.look(rows, 8, 8, alive, kill, TWO)
    for step in range(1, 12):
        beat(step, 0.1, 0)
    assert capfd.readouterr().out == "" and killed == []
    for step in range(12, 20):
        beat(step, 0.5, 40)
    out = capfd.readouterr().out
    assert out.count("dsim: straggler watch: host node2 (ranks 4-7): its link holds the job back: steps take ") == 1, out
    assert "while the slowest rank computes 2 ms a step, and node2's network interface held back 40 packets a step on " \
           "their way out, " \
           "the other hosts' 0 (tft.straggler_factor 2): its ranks killed (SIGKILL), as failed ranks " \
           "(tft.straggler_evict)\n" in out, out
    assert killed == [4, 5, 6, 7]


def test_a_link_is_judged_though_a_rank_is_preempted_and_not_when_computing_explains_the_pace(capfd):
    def run(noisy_ms):
        judge, t, held = StragglerJudge(2.0, evict=False), 1000.0, 0
        for step in range(1, 25):
            took, grew = (0.1, 0) if step < 12 else (0.5, 40)
            t, held = t + took, held + grew
            rows = [record(r, 0.002, step=step, t=t, link=0 if r < 4 else held) for r in range(8)]
            rows[1]["step_time"] = noisy_ms / 1000   # rank 1 past the factor: a straggler of its own
            judge.look(rows, 8, 8, alive, lambda r: True, TWO)
        return capfd.readouterr().out
    assert "host node2 (ranks 4-7): its link holds the job back" in run(20)   # 20 ms: no part of a 500 ms step
    assert "host node2" not in run(300)        # 300 ms of computing a step: the rank explains the pace, not the link


def test_a_job_slower_everywhere_names_no_link(capfd):
    judge = StragglerJudge(2.0, evict=False)
    t = 0.0
    for step in range(1, 30):
        t += 0.1 if step < 12 else 0.5
        judge.look([record(r, 0.002, step=step, t=t, link=0) for r in range(8)], 8, 8, alive, lambda r: True, TWO)
    assert capfd.readouterr().out == ""


def test_egress_held_reads_this_hosts_queueing_disciplines():
    held = egress_held()
    assert held is None or (isinstance(held, int) and held >= 0)
