"""Hosts (issue 51, part 3): each rank's host as MPI found it (dsim.parallel.hosts), the header's hosts x ranks, the
commit record's compact `hosts`, which single host's loss loses a slice, and the warning for a slice held on one
host only. Pure: host maps are given, no MPI."""
from __future__ import annotations

import pytest

from dsim.checkpoint import record as rec
from dsim.checkpoint.plan import commit_record, save_plan
from dsim.checkpoint.survivability import host_losses, host_warning, ranks_text, single_host_slices, survivability
from dsim.nn.models import create_network
from dsim.parallel.hosts import Hosts, discover, named
from dsim.parallel.layout import ParallelLayout

SPECS = create_network("network", [64, 128, 128, 64]).specs
DP2_MP4 = ParallelLayout(data_parallel=2, model_parallel=4)
SLOT = ["node1"] * 4 + ["node2"] * 4     # mpirun --map-by slot on 2 hosts x 4: ranks 0-3, 4-7
NODE = ["node1", "node2"] * 4            # --map-by node: round robin


def test_the_header_names_hosts_only_when_there_are_several():
    assert Hosts(("box",) * 8).describe() == "8 ranks"   # the one-host header is unchanged
    assert Hosts(tuple(SLOT)).describe() == "8 ranks on 2 hosts (4 + 4)"
    assert Hosts(("a", "a", "a", "b", "b", "c")).describe() == "6 ranks on 3 hosts (3 + 2 + 1)"
    assert Hosts(tuple(f"n{r // 2}" for r in range(32))).describe() == "32 ranks on 16 hosts (2 each)"
    assert Hosts(tuple(NODE)).distinct == ["node1", "node2"] and Hosts(tuple(NODE)).ranks("node2") == [1, 3, 5, 7]


def test_a_world_of_one_rank_needs_no_mpi():
    class One:
        size, rank = 1, 0
    assert len(discover(One()).names) == 1


def test_two_nodes_reporting_one_hostname_stay_two_hosts():
    """(first rank of the rank's node, its hostname) per rank: the node is what MPI split, the name only labels it."""
    assert named([(0, "n1"), (0, "n1"), (2, "n2"), (2, "n2")]) == ("n1", "n1", "n2", "n2")
    assert named([(0, "box"), (0, "box"), (2, "box"), (2, "box")]) == ("box@0", "box@0", "box@2", "box@2")


def test_the_commit_records_hosts_are_a_few_progressions_whatever_the_world_size():
    for host_of, progressions in ((SLOT, 1), (NODE, 1)):
        hosts = rec.hosts_json(host_of, 4)
        assert list(hosts) == ["node1", "node2"] and all(len(p) == progressions for p in hosts.values())
        assert rec.hosts_of({"world_size": 8, "hosts": hosts}) == host_of
    big = [f"node{r // 8}" for r in range(65536)]   # 8,192 hosts of 8 consecutive ranks: one progression each
    assert all(len(p) == 1 for p in rec.hosts_json(big, 4).values())
    record = commit_record("network-1_4", "network", save_plan(DP2_MP4, SPECS), 1, 4, 4, 1, host_of=NODE)
    assert record["hosts"] == {"node1": [{"start": 0, "stop": 7, "step": 2}],
                               "node2": [{"start": 1, "stop": 8, "step": 2}]}
    assert "hosts" not in commit_record("network-1_4", "network", save_plan(DP2_MP4, SPECS), 1, 4, 4, 1)


@pytest.mark.parametrize("hosts", [None, [], {"a": "x"}, {"a": [{"start": 0, "stop": 4, "step": 1}]},
                                   {"a": [{"start": 0, "stop": 8, "step": 1}], "b": [{"start": 0, "stop": 1, "step": 1}]},
                                   {"a": [{"start": 0, "stop": 9, "step": 1}]}])
def test_a_record_without_usable_hosts_reads_as_none(hosts):
    """Written before hosts were recorded, or damaged (a rank without a host, on two, past the world): no hosts."""
    assert rec.hosts_of({"world_size": 8, **({} if hosts is None else {"hosts": hosts})}) is None


def test_which_single_host_loss_loses_a_slice():
    """dp2 x mp4: replicas r and r + 4. --map-by slot puts each pair on both hosts; --map-by node puts {0,4} and
    {2,6} on node1, {1,5} and {3,7} on node2: losing either host loses slices."""
    s = survivability(DP2_MP4)
    assert host_losses(s.fatal_sets, SLOT) == {}
    assert host_losses(s.fatal_sets, NODE) == {"node1": [(0, 4), (2, 6)], "node2": [(1, 5), (3, 7)]}
    assert s.host_lines(SLOT) == ["any one of the 2 hosts: survivable (every replica set keeps a rank on another host)"]
    tensors = {"layer1.param": [[0, 4], [1, 5], [2, 6], [3, 7]], "moments.layer1.param": [[0, 4]],
               "layer5.bias": [[0, 1, 2, 3, 4, 5, 6, 7]]}
    assert s.host_lines(NODE, tensors) == [
        "node1 (ranks 0,2,4,6): fatal (every rank of {0,4}, {2,6} is on it: layer1.param)",
        "node2 (ranks 1,3,5,7): fatal (every rank of {1,5}, {3,7} is on it: layer1.param)"]
    assert [x["fatal_sets"] for x in s.hosts(NODE)] == [[[0, 4], [2, 6]], [[1, 5], [3, 7]]]


def test_the_warning_names_the_first_slice_held_on_one_host_and_its_host():
    assert host_warning(DP2_MP4, SPECS, SLOT) is None
    assert host_warning(DP2_MP4, SPECS, ["box"] * 8) is None   # one host: nothing to spread over
    line = host_warning(DP2_MP4, SPECS, NODE)
    assert line.startswith("dsim: warning: every rank holding a slice of layer1.param ({0,4}) is on host node1: "
                           "losing node1 loses it (and ")
    assert "\n" not in line and "replicas sit on different hosts" in line
    # a tensor replicated over mp (layer2.bias) is held by all 8 ranks: never on one host here
    assert {name for name, _, _ in single_host_slices(DP2_MP4, SPECS, NODE)} == {
        s.name for s in SPECS if s.mp_axis is not None}


def test_a_layout_without_replicas_is_not_the_hosts_warning():
    """optimizer_shard = data_parallel: no rank has a replica, so any host's loss loses state whatever the mapping
    (the save warns of that), though the tensors replicated over mp (held by one mp group: {0,1,2,3}) sit on node1."""
    k2 = ParallelLayout(data_parallel=2, model_parallel=4, optimizer_shard=2)
    assert host_warning(k2, SPECS, SLOT) is None
    assert ("layer2.bias", [0, 1, 2, 3], "node1") in single_host_slices(k2, SPECS, SLOT)
    k2_of_4 = ParallelLayout(data_parallel=4, model_parallel=2, optimizer_shard=2)   # replicas {0,4}, {1,5}, ...
    assert host_warning(k2_of_4, SPECS, SLOT) is None
    assert "({0,4}) is on host node1" in host_warning(k2_of_4, SPECS, ["node1"] * 6 + ["node2"] * 2)


def test_a_pipeline_stage_on_one_host_holds_its_replicas_there():
    """pp2 x dp2 x mp2 with --map-by slot: stage 0 (ranks 0-3) is node1's, and so are its replica pairs."""
    specs = create_network("network", [64, 128, 128, 64]).specs
    layout = ParallelLayout(data_parallel=2, model_parallel=2, pipeline_stage=2)
    assert host_warning(layout, specs, SLOT).startswith(
        "dsim: warning: every rank holding a slice of layer1.param ({0,2}) is on host node1")


def test_ranks_text():
    assert ranks_text(range(4)) == "0-3" and ranks_text([0, 2, 4, 6]) == "0,2,4,6" and ranks_text([0, 1, 5]) == "0,1,5"
    assert ranks_text(range(0, 40, 2)).endswith(",… (20 ranks)")


def test_a_records_slices_name_every_holder_without_the_files():
    """Survivability from the commit record alone: on node-local disks one host's directory lacks the other's files."""
    from dsim.checkpoint.catalog import record_holder_sets
    holders = record_holder_sets(commit_record("network-1_4", "network", save_plan(DP2_MP4, SPECS, ("moments",)),
                                               1, 4, 4, 1))
    assert holders["layer1.param"] == [[0, 4], [1, 5], [2, 6], [3, 7]] == holders["moments.layer1.param"]
    assert holders["layer2.bias"] == [list(range(8))]
    assert record_holder_sets({"format": "dsim-commit/1"}) == {} == record_holder_sets({"slices": [{"tensor": "x"}]})


def test_a_node_failure_takes_the_victims_host_when_there_are_several():
    """faults.node_of: on real hosts the ranks MPI found on the victim's host, whatever their numbers; on one host (or
    hosts unknown, or another world's) node_size consecutive ranks, as before."""
    from dsim.faults import node_of
    assert node_of(5, 4, 8, Hosts(tuple(NODE))) == [1, 3, 5, 7]
    assert node_of(5, 4, 8, Hosts(tuple(SLOT))) == [4, 5, 6, 7]
    assert node_of(5, 2, 8, Hosts(("box",) * 8)) == [4, 5] == node_of(5, 2, 8) == node_of(5, 2, 8, Hosts(tuple(NODE[:6])))
