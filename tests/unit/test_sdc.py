"""Silent data corruption (dsim.ft.sdc): which replicas differ, and the flipped bit itself."""
from types import SimpleNamespace

import numpy as np
import pytest

from dsim.config import ConfigError, load_config
from dsim.faults import flip_bit
from dsim.ft.sdc import SilentCorruption, differing, differing_in_sets, digests


def test_the_odd_replica_out_is_named_and_two_that_differ_are_both():
    same = {("params", "w"): 1, ("params", "b"): 2}
    odd = {("params", "w"): 1, ("params", "b"): 99}
    assert differing([(0, 0, same), (2, 0, same), (4, 0, same)]) == []
    assert differing([(0, 0, same), (2, 0, odd), (4, 0, same)]) == [
        {"tensor": "params/b", "ranks": [2], "holders": [0, 2, 4], "majority": True}]
    assert differing([(1, 0, same), (5, 0, odd)]) == [
        {"tensor": "params/b", "ranks": [1, 5], "holders": [1, 5], "majority": False}]


def test_optimizer_state_is_compared_within_its_shard_index_only():
    # dp4 x k2: ranks of shard index 0 hold one slice of the moments, those of index 1 another
    a, b = {("state", "m.w"): 10}, {("state", "m.w"): 20}
    assert differing([(0, 0, a), (1, 1, b), (2, 0, a), (3, 1, b)]) == []
    assert differing([(0, 0, a), (1, 1, b), (2, 0, b), (3, 1, b)]) == [
        {"tensor": "optimizer/m.w", "ranks": [0, 2], "holders": [0, 2], "majority": False}]


def test_a_flipped_bit_changes_one_element_by_one_bit_and_its_crc():
    p = SimpleNamespace(name="layer1.param", data=np.linspace(-1, 1, 1000, dtype=np.float32))
    opt = SimpleNamespace(params=[p], state_items=lambda: iter(()))
    before, copy = digests(opt), p.data.copy()
    where = flip_bit(opt, 3)
    changed = np.flatnonzero(p.data.view(np.uint32) != copy.view(np.uint32))
    assert len(changed) == 1 and where.startswith(f"layer1.param, element {changed[0]}, bit ")
    diff = int(p.data.view(np.uint32)[changed[0]] ^ copy.view(np.uint32)[changed[0]])
    assert diff & (diff - 1) == 0 and where.endswith(f"bit {diff.bit_length() - 1}")
    assert digests(opt) != before
    flip_bit(opt, 3)  # the same draw: the same bit back
    assert np.array_equal(p.data.view(np.uint32), copy.view(np.uint32))


def test_the_last_gasp_compares_the_surviving_holders_of_each_replica_set():
    sets = [[0, 2, 4], [1, 3, 5]]
    same = {"w": 11, "m": 22}
    held = {0: same, 2: same, 4: {"w": 11, "m": 23}, 1: {"w": 5, "m": 6}, 5: {"w": 5, "m": 6}}  # rank 3 dead
    assert differing_in_sets(held, sets) == [{"tensor": "m", "ranks": [4], "holders": [0, 2, 4], "majority": True}]
    held[5] = {"w": 7, "m": 6}  # two holders left that differ: either may be damaged
    assert differing_in_sets(held, sets)[1] == {"tensor": "w", "ranks": [1, 5], "holders": [1, 5], "majority": False}
    assert differing_in_sets({0: same, 1: same}, sets) == []  # one holder each: nothing to compare


def test_the_message_names_the_slices():
    e = SilentCorruption(12, [{"tensor": "params/b", "ranks": [2], "holders": [0, 2, 4], "majority": True}])
    assert str(e).startswith("silent data corruption found at step 12: rank(s) 2 hold(s) a params/b that differs "
                             "from the other replicas' (holders [0, 2, 4]); no last gasp")
    assert str(SilentCorruption(3, e.found, "nothing to roll back to")).endswith("[0, 2, 4]); nothing to roll back to")


@pytest.mark.parametrize("value, message", [("0", "must be a number of steps >= 1"), ("2.5", "must be int")])
def test_sdc_check_every_is_a_step_count(value, message):
    with pytest.raises(ConfigError, match=f"config: tft.sdc_check_every {message}"):
        load_config(None, [f"tft.sdc_check_every={value}"])
    assert load_config(None, ["tft.sdc_check_every=50"]).tft.sdc_check_every == 50
