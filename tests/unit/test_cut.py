"""A network cut's sides found without MPI (dsim.ft.cut): probes and the agreement, between listeners of this
process standing for ranks (the end-to-end cases, on real hosts cut apart: tests/e2e/test_e2e_node_faults.py)."""
import socket
import threading

from dsim.ft import cut


class World:
    def __init__(self, rank):
        self.rank = rank


def links_of(n, names=None, silent=()):
    """n ranks' Links, each with a listener of its own on this host; ranks in `silent` answer with another job's
    identity (as a process that is not theirs would: not UP)."""
    listeners = [cut.Listener() for _ in range(n)]
    for r, listener in enumerate(listeners):
        listener.identity = f"{'other' if r in silent else 'tok'}:{r}".encode()
    peers = {r: ("127.0.0.1", listener.port) for r, listener in enumerate(listeners)}
    names = tuple(names or [f"node{r + 1}" for r in range(n)])
    return [cut.Links(World(r), None, names, peers, "tok", listeners[r]) for r in range(n)]


def test_a_probe_tells_a_rank_that_answers_from_one_refused_and_one_that_is_not_it():
    links = links_of(3, silent=(2,))
    with socket.socket() as closed:  # a port nobody listens on refuses: a rank's process that died, its host there
        closed.bind(("127.0.0.1", 0))
        links[0].peers[1] = closed.getsockname()
    assert links[0].probe(1.0) == {0: cut.UP, 1: cut.GONE, 2: cut.SILENT}
    assert links[0].silent_hosts({0: cut.UP, 1: cut.GONE, 2: cut.SILENT}) == ["node3"]


def run_sides(links, who, **kwargs):
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, cut.side(links[r], **kwargs))) for r in who]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_ranks_that_reach_each_other_agree_on_one_side():
    links = links_of(4, silent=(3,))  # rank 3: not reached (the other side of a cut)
    sides = run_sides(links, [0, 1, 2], seconds=0.5)
    assert sides == {r: ([0, 1, 2], []) for r in (0, 1, 2)}


def test_a_rank_that_answers_but_never_takes_part_is_left_out_after_the_grace():
    """Its main thread stuck in MPI: its listener answers, it sends no view. Before the grace the others wait for it
    (no agreement without it); after, the side is agreed without it and names it, to be ended."""
    links = links_of(3)
    assert run_sides(links, [0, 1], grace=5.0, limit=2.0, seconds=0.3) == {0: None, 1: None}
    links = links_of(3)
    assert run_sides(links, [0, 1], grace=1.0, limit=10.0, seconds=0.3) == {0: ([0, 1], [2]), 1: ([0, 1], [2])}


def test_two_sides_of_a_cut_cannot_both_hold_the_quorum():
    from dsim.ft.quorum import decide
    names = ["node1", "node1", "node2", "node2", "node3", "node3", "node4", "node4"]
    assert decide(names, [0, 1, 2, 3]).holds and not decide(names, [4, 5, 6, 7]).holds  # 2+2: rank 0's host wins
    assert decide(names, [2, 3, 4, 5, 6, 7]).holds and not decide(names, [0, 1]).holds  # 3+1: the majority


def test_the_last_gasp_line_after_a_cut_names_the_ranks_unreachable_and_says_a_network_cut():
    """Its line carries "network cut": the launcher then stops mpirun once its host's ranks ended (launcher.CUT_MARK);
    a cut found and healed before the side was agreed leaves every rank in it."""
    from pathlib import Path

    from dsim.ft.last_gasp import Outcome
    from dsim.ft.launcher import CUT_MARK
    out = Outcome([4, 5], step=8, directory=Path("ckpt"), name="ttp-2_4", survivors=4, cut=True)
    assert out.message().startswith("rank(s) 4, 5 unreachable (a network cut, or a host gone silent; this side holds "
                                    "the quorum of the hosts); last-gasp checkpoint ttp-2_4 (global step 8) committed")
    healed = Outcome([], step=8, directory=Path("ckpt"), name="ttp-2_4", survivors=8, cut=True).message()
    assert healed.startswith("a network cut was found, and every rank answers again; last-gasp checkpoint")
    assert CUT_MARK.decode() in out.message() and CUT_MARK.decode() in healed
    assert Outcome([4], step=8, directory=Path("ckpt"), name="x").message().startswith("rank(s) 4 failed; last-gasp")


def test_after_a_cut_the_launcher_waits_for_the_ranks_below_mpirun_to_end_but_not_for_a_stopped_one():
    """launcher.across_cut, on a tree like a test cluster's after a cut: a shell standing for mpirun and its agent,
    below it a rank (PMIX_RANK in its environment) that ends 1 s later and a rank stopped (SIGSTOP: a host gone
    silent), which is not waited for; the wait ends once the first has ended, well before its bound."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from dsim.ft.launcher import across_cut, descendants, kill_tree
    env = {**os.environ, "PMIX_RANK": "3"}
    ends = f"{sys.executable} -c 'import time; time.sleep(1)'"
    stops = f"{sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGSTOP)'"
    tree = subprocess.Popen(["sh", "-c", f"{ends} & {stops} & wait"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(descendants(tree.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.monotonic()
        across_cut(tree.pid, seconds=20)
        waited = time.monotonic() - start
        assert 0.3 < waited < 10, waited
        (stopped,) = descendants(tree.pid)   # the stopped rank is left for the launcher's stop
        assert open(f"/proc/{stopped}/stat").read().rsplit(")", 1)[1].split()[0] == "T"
    finally:
        kill_tree(tree.pid)
        tree.wait()
        assert tree.returncode == -signal.SIGKILL
