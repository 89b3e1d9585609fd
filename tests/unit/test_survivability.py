"""Survivability from replica sets, checked against brute force over every subset of ranks."""
import itertools
import time
from math import comb

import pytest

from dsim.checkpoint import replica_sets
from dsim.checkpoint.survivability import parse_layout, survivability
from dsim.parallel.layout import LayoutError, ParallelLayout

SMALL = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (4, 2, 2), (8, 1, 4), (8, 1, 8), (3, 3, 1), (6, 2, 3),
         (4, 3, 2), (12, 1, 3)]


def brute_force(sets, n):
    """Survivable failure sets by checking every subset: a set survives unless it holds a whole replica set."""
    count, best = {}, 0
    for c in range(n + 1):
        ok = sum(1 for f in itertools.combinations(range(n), c) if not any(set(s) <= set(f) for s in sets))
        count[c] = ok
        if ok:
            best = c
    always = max(c for c in range(n + 1) if count[c] == comb(n, c))
    return count, always, best


@pytest.mark.parametrize("dp,mp,k", SMALL)
def test_matches_brute_force(dp, mp, k):
    layout = ParallelLayout(dp, mp, k)
    sets = replica_sets(layout)
    count, always, best = brute_force(sets, layout.world_size)
    s = survivability(layout, rows=layout.world_size)
    assert (s.always, s.at_best) == (always, best)
    assert sorted(map(tuple, sets)) == s.fatal_sets
    for c, v in s.survivors.items():
        assert v == count[c], c
    assert sorted(s.survivors) == list(range(always + 1, min(best + 1, layout.world_size) + 1))
    for c in range(1, layout.world_size + 1):
        assert s.fraction(c) == count[c] / comb(layout.world_size, c), c
    for f in itertools.chain.from_iterable(itertools.combinations(range(layout.world_size), c) for c in (1, 2, 3)):
        assert s.survives(f) == (not any(set(x) <= set(f) for x in sets))


def test_overlapping_holder_sets_use_minimal_ones():
    # {0,1} holds one piece, {0,1,2} another: losing {0,1} is fatal, the superset adds nothing
    sets = [[0, 1], [0, 1, 2], [2, 3], [1, 3]]
    s = survivability(sets)
    assert s.fatal_sets == [(0, 1), (1, 3), (2, 3)]
    count, always, best = brute_force(s.fatal_sets, 4)
    assert (s.always, s.at_best) == (always, best) == (1, 2)
    assert s.survivors[2] == count[2] == 3


def test_description_of_dp2_mp4():
    s = survivability(ParallelLayout(2, 4, 1))
    assert s.lines() == [
        "any single rank",
        "any two ranks except {0,4}, {1,5}, {2,6}, {3,7} (24 of 28 survive)",
        "any three ranks except those containing {0,4}, {1,5}, {2,6}, {3,7} (32 of 56 survive)",
        "any four ranks except those containing {0,4}, {1,5}, {2,6}, {3,7} (16 of 70 survive)",
        "5 or more ranks: never (some replica set is then wholly lost)"]
    assert s.survives([0, 1, 2, 3]) and not s.survives([1, 5])


def test_no_replica_survives_nothing():
    s = survivability(ParallelLayout(8, 1, 8))
    assert (s.always, s.at_best) == (0, 0)
    assert s.lines() == ["1 or more ranks: never (some replica set is then wholly lost)"]


def test_scales_to_65536_ranks_without_enumerating():
    layout = ParallelLayout(1024, 64, 2)   # replica sets of 512 ranks
    t0 = time.perf_counter()
    s = survivability(layout, rows=2 * 512 - 511)
    assert (s.always, s.at_best, len(s.fatal_sets)) == (511, 65536 - 128, 128)
    assert s.fraction(511) == 1.0   # below the smallest fatal set every failure set survives
    # one more failure: exactly the sets equal to a whole replica set are fatal
    assert s.survivors[512] == comb(65536, 512) - 128
    # two replica sets share no rank: 1024 failures hold both in C(128, 2) ways
    assert s.survivors[1024] == comb(65536, 1024) - 128 * comb(65536 - 512, 512) + comb(128, 2)
    one = survivability(ParallelLayout(65536, 1, 1))   # a single replica set of every rank
    assert (one.always, one.at_best, one.survivors) == (65535, 65535, {65536: 0})
    two = survivability(ParallelLayout(2, 32768, 1))
    assert (two.always, two.at_best, two.survivors[2]) == (1, 32768, comb(65536, 2) - 32768)
    assert time.perf_counter() - t0 < 30  # milliseconds really; generous on a shared 2-core machine


def test_parse_layout():
    assert parse_layout("dp=2,mp=4,k=1") == ParallelLayout(2, 4, 1)
    assert parse_layout("mp=8") == ParallelLayout(1, 8, 1)
    assert parse_layout("pp=2,dp=2,mp=2") == ParallelLayout(2, 2, 1, pipeline_stage=2)
    with pytest.raises(ValueError, match="expected items like"):
        parse_layout("dp=2,tp=4")
    with pytest.raises(LayoutError):
        parse_layout("dp=4,k=3")


@pytest.mark.parametrize("layout, node_size, fatal", [
    (ParallelLayout(2, 4), 4, [[], []]),                      # a whole model replica a node, the other elsewhere
    (ParallelLayout(4, 2), 4, [[], []]),                      # dp replicas 0, 1 here, 2, 3 on the next node
    (ParallelLayout(2, 2, pipeline_stage=2), 4, [[[0, 2], [1, 3]], [[4, 6], [5, 7]]]),  # a stage a node
    (ParallelLayout(2, 4, optimizer_shard=2), 2, [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]]]),  # k = dp
    (ParallelLayout(4, 2, optimizer_shard=2), 4, [[], []]),  # dp 0 and 2 hold shard 0: ranks 0 and 4
    (ParallelLayout(2, 4), 8, [[[0, 4], [1, 5], [2, 6], [3, 7]]]),  # one node for the whole job
    (ParallelLayout(3, 1), 2, [[], []]),                      # the last node is smaller: ranks 2 alone
])
def test_a_lost_node_is_fatal_when_a_replica_set_lies_wholly_on_it(layout, node_size, fatal):
    nodes = survivability(layout).nodes(node_size)
    assert [x["fatal_sets"] for x in nodes] == fatal
    assert all(survivability(layout).survives(range(a, b + 1)) == (not f) for (a, b), f in
               ((x["node"], x["fatal_sets"]) for x in nodes))


def test_node_lines():
    assert survivability(ParallelLayout(2, 4)).node_lines(4) == [
        "any one of the 2 nodes: survivable (every replica set keeps a rank on another node)"]
    lines = survivability(ParallelLayout(64, 1, optimizer_shard=64)).node_lines(8, show=2)
    assert lines == ["node 0 (ranks 0-7): fatal (every rank of {0}, {1} and 6 more is on it)",
                     "node 1 (ranks 8-15): fatal (every rank of {8}, {9} and 6 more is on it)",
                     "and 6 more of the 8 nodes"]
