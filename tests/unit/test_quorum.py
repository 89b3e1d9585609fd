"""The quorum rule after a failure (dsim.ft.quorum): which side of a cut may commit or go on."""
from __future__ import annotations

import pytest

from dsim.ft.quorum import decide


def sides(names, *parts):
    """The verdict of each side, a side given by its hosts."""
    return [decide(names, [r for r, h in enumerate(names) if h in part]) for part in parts]


def test_two_hosts_against_one_the_two_hold_it():
    names = ["a", "a", "b", "b", "c", "c"]
    two, one = sides(names, {"a", "b"}, {"c"})
    assert two.holds and not two.even and not one.holds
    assert one.reachable == ("c",) and one.hosts == ("a", "b", "c")
    assert one.line() == ("dsim: error: cut off from the majority of hosts (1 of 3 reachable: c; no strict majority): "
                          "stopping without a checkpoint; the other side goes on or saves (docs/fault-tolerance.md: a "
                          "network cut)")
    # whichever host is cut off, rank 0's among them
    assert [v.holds for v in sides(names, {"a"}, {"b", "c"})] == [False, True]


@pytest.mark.parametrize("names", [["a", "a", "b", "b", "c", "c", "d", "d"], ["a", "b", "c", "d"] * 2])
def test_an_even_split_goes_to_the_side_of_rank_0s_host(names):
    with0, without = sides(names, {"a", "c"}, {"b", "d"})
    assert with0.even and with0.holds and without.even and not without.holds
    assert "an even split, and rank 0's host a is on the other side" in without.line()
    assert [v.holds for v in sides(names, {"c", "d"}, {"a", "b"})] == [False, True]


def test_one_against_one_is_an_even_split_too():
    names = ["n1"] * 4 + ["n2"] * 4
    assert [v.holds for v in sides(names, {"n1"}, {"n2"})] == [True, False]


def test_three_ways_apart_nobody_holds_it():
    names = ["a", "b", "c"] * 2
    assert [v.holds for v in sides(names, {"a"}, {"b"}, {"c"})] == [False, False, False]


def test_hosts_count_not_ranks():
    names = ["big"] * 6 + ["s1", "s2"]
    big, small = sides(names, {"big"}, {"s1", "s2"})
    assert not big.holds and small.holds  # 1 of 3 hosts, though 6 of 8 ranks
    names = ["s1", "big", "big", "big", "big", "s2", "s3"]
    assert [v.holds for v in sides(names, {"big", "s2"}, {"s1", "s3"})] == [False, True]  # 2 of 4: rank 0 is on s1
    assert [v.holds for v in sides(names, {"s1", "s2"}, {"big", "s3"})] == [True, False]


def test_a_host_with_one_living_rank_is_reachable_and_dead_ranks_alone_change_nothing():
    names = ["a", "a", "b", "b", "c", "c"]
    assert decide(names, [1, 3, 5]).holds and decide(names, [1, 3, 5]).reachable == ("a", "b", "c")
    assert decide(names, [0, 1, 2, 3]).holds   # every rank of c dead (a crash, or cut off): 2 of 3
    assert decide(["only"] * 8, [3]).holds     # one host: any survivor holds it
