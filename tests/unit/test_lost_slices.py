"""Lost slices (issue 52, part 3): which slices of a committed checkpoint have no usable copy left, given the ranks whose
files are gone or damaged; the same verdict as recovery's repair plan, named by tensor, slice index, ranks and host;
and the error a resume gives when no committed checkpoint is complete (pure: no MPI, no files)."""
import random

import pytest

from dsim.checkpoint.group_info import replica_sets, tensor_holders
from dsim.checkpoint.lost import describe, lost_slices, summary
from dsim.checkpoint.plan import commit_record, save_plan
from dsim.checkpoint.recovery import Assessment, no_usable_message, plan_tensors
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout

SPECS = create_network("network").specs
SLOTS = ("moments",)
TWO_HOSTS = ["node1"] * 4 + ["node2"] * 4   # 2 hosts x 4, --map-by slot


def record_of(layout, name="network-2_4", step=8, host_of=TWO_HOSTS):
    return commit_record(name, "network", save_plan(layout, SPECS, SLOTS), 2, 4, step, 2, host_of=host_of)


def names():
    params = [s.name for s in SPECS]
    return params + [f"{slot}.{n}" for slot in SLOTS for n in params]


def planned_lost(layout, damage):
    """What recovery's repair plan finds no healthy holder for: {(tensor, holders)}."""
    specs = {s.name: s for s in SPECS}

    def holders_of(rank, name):
        return tensor_holders(specs.get(name) or specs[name.split(".", 1)[1]], layout, rank)
    plan = plan_tensors(damage, names(), holders_of, replica_sets(layout))
    return {(n, tuple(h)) for lost in plan.lost.values() for n, h in lost.items()}


def test_mp8_on_two_hosts_loses_node2s_slices_of_every_split_tensor_and_nothing_replicated():
    layout = ParallelLayout(1, 8, 1)
    lost = lost_slices(record_of(layout), {r: None for r in range(4, 8)})
    split = [s.name for s in SPECS if s.mp_axis is not None]
    assert {(s.tensor, s.index) for s in lost if s.kind == "params"} == {(n, i) for n in split for i in range(4, 8)}
    assert {(s.tensor, s.index) for s in lost if s.kind == "optimizer"} == {(f"moments.{n}", i) for n in split
                                                                            for i in range(4, 8)}
    assert all(s.count == 8 and s.holders == (s.index,) for s in lost)   # slice i of 8 is rank i's alone
    # a tensor replicated over mp (a row layer's bias) keeps its copies on node1
    assert not [s for s in lost if s.tensor in {p.name for p in SPECS if p.mp_axis is None}]
    assert summary(lost, TWO_HOSTS) == (f"{len(lost)} slice(s) of {2 * len(split)} tensor(s) have no copy left: every "
                                        "one was held only by ranks 4-7 on node2")
    line, = describe(lost, TWO_HOSTS)
    assert line == (f"held only by ranks 4-7 on node2 ({len(lost)} slice(s), one rank a slice; slices numbered from 0): "
                    f"{', '.join(split)}: slices 4-7 of 8; and the same slices of their optimizer state (moments)")


def test_replicas_on_the_other_host_leave_nothing_lost():
    assert lost_slices(record_of(ParallelLayout(2, 4, 1)), {r: None for r in range(4, 8)}) == []


def test_a_damaged_tensor_loses_only_that_tensors_slice():
    layout = ParallelLayout(2, 4, 2)   # optimizer_shard = data_parallel: a weight's shards have one holder each
    lost = lost_slices(record_of(layout), {3: {"layer2.weight"}})
    assert [(s.kind, s.tensor, s.holders) for s in lost] == [("params", "layer2.weight", (3,))]
    assert describe(lost) == ["held only by rank 3 (1 slice(s), one rank a slice; slices numbered from 0): "
                              f"layer2.weight: slice {lost[0].index} of {lost[0].count}"]


@pytest.mark.parametrize("layout", [ParallelLayout(1, 8, 1), ParallelLayout(2, 4, 1), ParallelLayout(2, 4, 2),
                                    ParallelLayout(4, 2, 4), ParallelLayout(8, 1, 8), ParallelLayout(4, 2, 1)], ids=str)
def test_the_same_verdict_as_recoverys_repair_plan(layout):
    """For random sets of unusable files (whole, or some tensors), the record's slices found lost are exactly those
    recovery's plan finds no healthy holder for (the plan by rank, the record by slice)."""
    record = record_of(layout, host_of=None)
    rng = random.Random(52)
    for _ in range(40):
        ranks = rng.sample(range(8), rng.randint(1, 6))
        damage = {r: (None if rng.random() < 0.6 else set(rng.sample(names(), 3))) for r in ranks}
        found = {(s.tensor, s.holders) for s in lost_slices(record, damage)}
        assert found == planned_lost(layout, damage), (layout, damage)


def _assessed(record, lost):
    return record, Assessment("checkpoint file not found ...", lost=lost)


def test_the_error_names_each_checkpoint_the_lost_slices_and_no_complete_step():
    layout = ParallelLayout(1, 8, 1)
    new, old = record_of(layout), record_of(layout, "network-1_4", 4)
    gone = {r: None for r in range(4, 8)}
    tried = [_assessed(new, lost_slices(new, gone)), _assessed(old, lost_slices(old, gone))]
    lines = no_usable_message("/ckpt", tried, "auto", None, lambda r: TWO_HOSTS).splitlines()
    assert lines[0] == ("no usable committed checkpoint in /ckpt (tried network-2_4: checkpoint file not found ...; "
                        "network-1_4: checkpoint file not found ...): slices with no copy left; no committed checkpoint "
                        "is complete: none to resume from; nothing was written")
    assert lines[1].startswith("  network-2_4 (global step 8): incomplete: 40 slice(s) of 10 tensor(s) have no copy "
                               "left: every one was held only by ranks 4-7 on node2")
    assert lines[2].startswith("    held only by ranks 4-7 on node2 (40 slice(s)")
    assert lines[3].endswith("ranks 4-7 on node2 (the same slices as above)") and lines[3].startswith("  network-1_4 ")
    assert lines[4] == ("  complete committed checkpoint to resume from: none (bring the lost files back and resume, "
                        "or train anew in another checkpoint.directory)")


def test_the_error_for_a_named_checkpoint_names_the_older_complete_one():
    layout = ParallelLayout(1, 8, 1)
    new, old = record_of(layout), record_of(layout, "network-1_4", 4)
    tried = [_assessed(new, lost_slices(new, {5: None})), (old, Assessment(None))]
    lines = no_usable_message("/ckpt", tried, "network-2_4", old, lambda r: TWO_HOSTS).splitlines()
    assert lines[0] == ("no usable committed checkpoint in /ckpt (tried network-2_4: checkpoint file not found ...): "
                        "slices with no copy left; the older committed checkpoint network-1_4 (global step 4) is "
                        "complete: resume from it with --resume network-1_4; nothing was written")
    assert lines[-2:] == ["  network-1_4 (global step 4): complete",
                          "  complete committed checkpoint to resume from: network-1_4 (global step 4): --resume "
                          "network-1_4"]


def test_without_lost_slices_the_error_is_the_one_line_it_always_was():
    record = record_of(ParallelLayout(2, 4, 1))
    assert no_usable_message("d", [(record, Assessment("its digest file is missing"))], "auto", None,
                             lambda r: None) == ("no usable committed checkpoint in d (tried network-2_4: its digest file "
                                                 "is missing)")
