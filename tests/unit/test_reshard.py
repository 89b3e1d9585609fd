"""Resharding's pure parts: boxes that meet, and a target layout's checks."""
import pytest

from dsim.checkpoint.reshard import intersect
from dsim.parallel.layout import ParallelLayout, Slice
from dsim.reshard import UsageError, target_layout


def test_intersect_gives_the_common_box_or_none():
    a, b = Slice((0, 0), (4, 8)), Slice((2, 4), (4, 8))
    assert intersect(a, b) == Slice((2, 4), (2, 4))
    assert intersect(a, Slice((4, 0), (2, 8))) is None          # touching is not meeting
    assert intersect(Slice((0,), (10,)), Slice((3,), (2,))) == Slice((3,), (2,))


def test_target_layout_from_the_world_and_its_errors():
    source = ParallelLayout(2, 4)
    assert target_layout("mp=2", 6, source) == ParallelLayout(3, 2)
    assert target_layout("dp=4,mp=2,k=2", None, source) == ParallelLayout(4, 2, 2)
    with pytest.raises(UsageError, match="--world 7 is not a multiple of model_parallel x pipeline_stage = 2"):
        target_layout("mp=2", 7, source)
    with pytest.raises(UsageError, match="does not fit the world size 6"):
        target_layout("dp=2,mp=2", 6, source)
    with pytest.raises(UsageError, match="the source has pipeline_stage=1"):
        target_layout("pp=2,dp=2,mp=2", None, source)
    with pytest.raises(UsageError, match="expected items like dp=2,mp=4,k=1"):
        target_layout("dp=two", None, source)


def test_a_target_layout_without_pp_keeps_the_sources_stages():
    # a pipeline checkpoint (pp=2 of dp2 x mp2) to dp=1,mp=2 is 4 ranks, 2 a stage; asking for pp=1 is refused
    source = ParallelLayout(2, 2, 1, 2)
    assert target_layout("dp=1,mp=2", None, source) == ParallelLayout(1, 2, 1, 2)
    assert target_layout("mp=1", 8, source) == ParallelLayout(4, 1, 1, 2)
    with pytest.raises(UsageError, match="--world 6 is not a multiple of model_parallel x pipeline_stage = 4"):
        target_layout("mp=2", 6, source)
    with pytest.raises(UsageError, match="the source has pipeline_stage=2"):
        target_layout("dp=1,mp=1,pp=1", None, source)
