"""The layout and its slice function, without MPI."""
import numpy as np
import pytest

from dsim.nn import create_network
from dsim.parallel.layout import (LayoutError, ParallelLayout, ParamSpec, is_opt_sharded, mp_slice,
                                   owned_slice)

LAYOUTS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (4, 2, 1), (4, 2, 2), (8, 1, 4), (8, 1, 8)]


def test_seed_example_rank_mapping():
    layout = ParallelLayout(2, 4)
    assert layout.coords(4).dp == 1 and layout.coords(4).mp == 0
    assert layout.replica_group(0) == [0, 4]
    assert layout.dp_group(1) == [1, 5]
    assert layout.mp_group(5) == [4, 5, 6, 7]


def test_groups_with_optimizer_shard():
    layout = ParallelLayout(8, 1, 4)
    assert layout.shard_group(5) == [4, 5, 6, 7]
    assert layout.replica_group(5) == [1, 5]
    assert ParallelLayout(8, 1, 8).replica_group(3) == [3]


@pytest.mark.parametrize("dp,mp,k", LAYOUTS)
def test_owned_slices_tile_every_parameter_once_per_replica(dp, mp, k):
    layout = ParallelLayout(dp, mp, k)
    for spec in create_network("network", [64, 128, 128, 64]).specs:
        for replica in range(dp // k):
            cover = np.zeros(spec.shape, dtype=int)
            # one replica set = the ranks whose shard index is fixed; take the replica'th member of each
            for rank in range(layout.world_size):
                if layout.replica_group(rank).index(rank) == replica:
                    cover[owned_slice(spec, layout, rank).index] += 1
            # held whole by every rank of the mp group / of the shard group unless split there
            expect = (1 if spec.mp_axis is not None else mp) * (1 if is_opt_sharded(spec, layout) else k)
            assert cover.min() == cover.max() == expect, (spec.name, replica)


def test_owned_is_inside_mp_slice():
    layout = ParallelLayout(4, 2, 2)
    spec = ParamSpec("w", (16, 8), mp_axis=1)
    for rank in range(8):
        mp, own = mp_slice(spec, layout, rank), owned_slice(spec, layout, rank)
        assert own.extents == (8, 4)
        assert mp.extents == (16, 4)
        assert own.offsets[1] == mp.offsets[1]
        assert own.offsets[0] == layout.coords(rank).shard * 8


def test_indivisible_first_axis_is_not_optimizer_sharded():
    layout = ParallelLayout(8, 1, 8)
    spec = ParamSpec("layer5.bias", (10,))
    assert owned_slice(spec, layout, 3).extents == (10,)


@pytest.mark.parametrize("args,msg", [
    ((3, 1, 2), "must divide"), ((0, 1, 1), "positive integer"), ((2, 1, 1.5), "positive integer")])
def test_bad_layouts(args, msg):
    with pytest.raises(LayoutError, match=msg):
        ParallelLayout(*args)


def test_world_size_mismatch_and_indivisible_mp():
    with pytest.raises(LayoutError, match="does not fit the world size 8"):
        ParallelLayout(2, 2).check_world_size(8)
    net = create_network("network", [60, 64])
    with pytest.raises(LayoutError, match="not divisible by model_parallel=8"):
        net.build(ParallelLayout(1, 8), 0, 1, np.float64)
