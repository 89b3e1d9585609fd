"""Peer copies in memory (dsim.ft.peer_copy): who keeps whose copy, which step the last gasp saves from them, and one
rank's copies made step by step (double-buffered, nothing parameter-sized allocated).

Serial tests; the copies between hosts and the last gasp from them are in tests/e2e/test_e2e_peer_copies.py.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mpi4py import MPI

from conftest import small_config
from dsim.build import build_run
from dsim.checkpoint.group_info import replica_sets
from dsim.config import ConfigError, load_config
from dsim.engine.state import owned_pieces
from dsim.ft.peer_copy import PeerCopies, keepers, plan
from dsim.parallel.layout import ParallelLayout


def same_host(hosts, keeper):
    return [r for r, k in enumerate(keeper) if hosts[k] == hosts[r]]


def same_slice(sets, keeper):
    set_of = {r: i for i, g in enumerate(sets) for r in g}
    return [r for r, k in enumerate(keeper) if set_of[k] == set_of[r]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=24))
def test_keepers_are_a_permutation_on_other_hosts_wherever_the_hosts_allow(host_of):
    hosts = [f"node{h}" for h in host_of]
    keeper = keepers(hosts)
    n = len(hosts)
    assert sorted(keeper) == list(range(n))  # each rank keeps exactly one copy
    if n > 1:
        assert all(k != r for r, k in enumerate(keeper))
    largest = max(hosts.count(h) for h in set(hosts))
    if len(set(hosts)) > 1:  # the ranks of the largest host beyond half the world must stay home; no other rank does
        assert len(same_host(hosts, keeper)) == max(0, 2 * largest - n)


@pytest.mark.parametrize("hosts,dp,mp", [
    (["node1"] * 4 + ["node2"] * 4, 2, 4),   # a replica of each slice on each host: the plain shift pairs replicas
    (["node1"] * 4 + ["node2"] * 4, 4, 2),
    (["node1"] * 2 + ["node2"] * 2 + ["node3"] * 2 + ["node4"] * 2, 4, 2),
    (["node1", "node2"] * 4, 2, 4),           # --map-by node
    (["node1"] * 8, 2, 4),                    # one host
    (["node1"] * 4 + ["node2"] * 4, 1, 8),
])
def test_no_keeper_holds_a_replica_of_its_origins_slice_where_avoidable(hosts, dp, mp):
    sets = replica_sets(ParallelLayout(dp, mp, 1))
    keeper = keepers(hosts, sets)
    assert sorted(keeper) == list(range(8)) and all(k != r for r, k in enumerate(keeper))
    assert same_slice(sets, keeper) == []
    assert same_host(hosts, keeper) == ([] if len(set(hosts)) > 1 else list(range(8)))


def test_keepers_from_hosts_not_rank_numbers():
    hosts = ["b", "a", "b", "a"]  # rank 0 on b: the pairing follows the hosts, whatever the numbering
    keeper = keepers(hosts)
    assert all(hosts[k] != hosts[r] for r, k in enumerate(keeper))
    assert keepers(["a"]) == [0] and keepers([]) == []
    # two replicas on two hosts of one rank each: the other rank is the only keeper there is
    assert keepers(["a", "b"], [[0, 1]]) == [1, 0]


def test_plan_saves_the_newest_step_every_ranks_state_is_held_at():
    sets = [[0], [1], [2], [3]]  # data_parallel = 1: no replicas
    # ranks 2 and 3 died; 0 keeps 2's copies of steps 4 and 6, 1 keeps 3's of step 4 only (6 was in flight)
    own = {0: {4, 6, 7}, 1: {4, 6, 7}}
    kept = {0: (2, {4, 6}), 1: (3, {4})}
    p = plan(own, kept, sets, 4)
    assert (p.step, p.writers, p.copied) == (4, {0: 0, 1: 1, 2: 0, 3: 1}, {2: 0, 3: 1})
    kept[1] = (3, {4, 6})
    assert plan(own, kept, sets, 4).step == 6
    # a survivor without its own state of that step (its snapshot overwritten): the older step
    own[1] = {6, 7, 8}
    assert plan(own, {0: (2, {4, 6}), 1: (3, {6})}, sets, 4).step == 6
    assert plan({0: {4}, 1: {6}}, {0: (2, {4}), 1: (3, {6})}, sets, 4) is None
    # a dead rank whose keeper died too: nothing
    assert plan({0: {4, 6}, 1: {4, 6}}, {0: (2, {4, 6}), 1: (3, {4, 6})}, sets, 5) is None


def test_plan_takes_a_living_replica_before_a_copy():
    sets = [[0, 2], [1, 3]]
    own = {0: {4, 6}, 1: {4, 6}, 3: {4}}
    p = plan(own, {0: (2, {4, 6}), 1: (3, {6}), 3: (1, set())}, sets, 4)
    assert p.step == 6 and p.writers == {0: 0, 1: 1, 2: 0, 3: 1} and p.copied == {}  # 2 from its replica 0


def test_the_key_needs_the_last_gasp_and_no_repair_in_the_job():
    assert load_config(None, ["tft.ttp=true", "tft.peer_copy_every=2"]).tft.peer_copy_every == 2
    for items, needle in ((["tft.peer_copy_every=2"], "needs tft.ttp"),
                          (["tft.ttp=true", "tft.peer_copy_every=0"], ">= 1"),
                          (["tft.ttp=true", "tft.peer_copy_every=true"], "must be int"),
                          (["tft.uce=true", "tft.peer_copy_every=2"], "does not go with a repair in the job"),
                          (["tft.spares=1", "tft.peer_copy_every=2"], "does not go with a repair in the job")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, items)


def one_process(tmp_path, every=2, **overrides):
    """A run on one process whose copies go to itself (COMM_SELF: keeper and origin rank 0), set up as begin would."""
    cfg = small_config(**{"parallel.data_parallel": 1, "parallel.model_parallel": 1, "output.dir": str(tmp_path),
                          "checkpoint.enabled": False, "tft.ttp": True, "tft.peer_copy_every": every, **overrides})
    run = build_run(cfg, MPI.COMM_SELF)
    copies = PeerCopies(run, every)
    copies.setup(MPI.COMM_SELF.Dup(), 0, 0)
    images, labels = run.loader.source.get(np.arange(32))
    return run, copies, lambda: (run.model.train_step(images, labels), copies.step_end(None))


def state(run) -> dict:
    return {name: arr.copy() for name, _, _, arr in owned_pieces(run.network, run.optimizer)}


def test_a_copy_is_complete_at_the_next_step_end_and_never_overwrites_the_last_complete_one(tmp_path):
    run, copies, step = one_process(tmp_path)
    step()                                     # step 1: nothing
    assert copies.flight is None and copies.own_steps == [None, None]
    step()                                     # step 2: snapshot, exchange in flight
    at2 = state(run)
    assert copies.flight[0] == 2 and copies.held_steps == [None, None]
    step()                                     # step 3: the copy of step 2 complete
    assert copies.flight is None and copies.held_steps == [2, None]
    step()                                     # step 4: its copy in flight into the other buffer
    assert copies.held_steps == [2, None] and copies.flight[:2] == (4, 1)
    got = {t.name: t.data for t in copies.copy_tensors(2)}  # step 2's still complete and whole
    assert got.keys() == at2.keys() and all(np.array_equal(got[k], at2[k]) for k in at2)
    step()
    step()                                     # step 6: into buffer 0, step 4's copy the last complete one
    at6 = state(run)
    assert copies.held_steps == [None, 4] and copies.own_steps == [6, 4]
    step()
    own, (origin, kept) = copies.offer(run.optimizer.states())
    assert copies.held_steps == [6, 4] and origin == 0 and kept == {4, 6} and own == {4, 6, 7}
    got = {t.name: t.data for t in copies.copy_tensors(6)}
    assert got.keys() == at6.keys() and all(np.array_equal(got[k], at6[k]) for k in at6)
    assert all(np.array_equal(copies.snapshot(6)[k], at6[k]) for k in at6)
    assert not any(np.array_equal(at2[k], at6[k]) for k in at6)  # (the state moved on)
    copies.end(None)
    assert copies.comm is None


def test_a_copy_and_its_exchange_allocate_nothing_parameter_sized(tmp_path):
    run, copies, step = one_process(tmp_path, every=1, **{"model.hidden": [64, 1024, 1024, 64],
                                                          "dtype": "float32"})
    for _ in range(3):  # buffers are made at the first steps
        step()
    largest = max(p.data.nbytes for p in run.network.trainable_params())
    tracemalloc.start()
    try:
        copies.step_end(None)  # (the same step: waits for the copy in flight, snapshots nothing new)
        run.optimizer.optimizer.global_step += 1
        copies.step_end(None)  # a snapshot of every parameter and moment, its exchange started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert copies.flight is not None and largest == 1024 * 1024 * 4
    assert peak < largest / 4, f"a copy allocated {peak} bytes at its peak; the largest parameter has {largest}"
    copies.end(None)
