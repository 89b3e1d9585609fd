"""The daily tier, `make check`: every feature covered at least once (one layout, one fault point each) by
its cheapest covering tests, in a few minutes; `make test` runs the whole suite.

FEATURES maps each feature to the MPI-stage and end-to-end tests that cover it (pytest node ids, exact; an id
without its [parameters] takes every parametrization). tests/conftest.py marks them `check`; every serial test
is in the tier too (tests/unit, under a minute). tests/unit/test_tiers.py checks that every id names a test
that exists and that docs/testing.md holds this table (`python tests/tiers.py` prints it).
"""
from __future__ import annotations

E2E = "tests/e2e/"
MPI = "tests/mpi/"

FEATURES = {
    "training equals one process (a sliced layout, the seed models, the API)": [
        MPI + "test_parallel_equivalence.py::test_layout_matches_single_process[2-4-1-adam]",
        MPI + "test_parallel_equivalence.py::test_seed_models_match_single_process[2-4-1-lenet5-sgd]",
        MPI + "test_parallel_equivalence.py::test_seed_models_match_single_process[2-4-1-transformer-adamweightdecay]",
        MPI + "test_api_mpi.py::test_user_network_matches_single_process",
    ],
    "gradient sums (buckets, shared memory)": [
        MPI + "test_buckets_mpi.py::test_bucketed_allreduce_equals_one_reduction_bit_for_bit[8-1024]",
        MPI + "test_shared_mpi.py::test_small_sums_through_shared_memory_are_the_group_order_sums[8]",
    ],
    "the command line: loss lines, a failing rank ends the job": [
        E2E + "test_e2e_train.py::test_train_prints_mindspore_loss_lines_and_loss_falls",
        E2E + "test_e2e_train.py::test_an_exception_on_one_rank_ends_the_job_instead_of_hanging[False]",
    ],
    "config errors (one line, exit 2)": [
        E2E + "test_e2e_train.py::test_bad_input_is_one_line_and_exit_2[args0-config: unknown key 'parallel.bogus'-8]",
    ],
    "sharded save, resume bit-identical": [
        MPI + "test_checkpoint_mpi.py::test_save_load_round_trip[4-2-2-False]",
        E2E + "test_e2e_recovery.py::test_kill_rank_3_then_recover_is_bit_identical",
    ],
    "replica repair of a lost or corrupt shard": [
        E2E + "test_e2e_recovery.py::test_lost_or_corrupt_shard_is_taken_from_its_replica[5-1-flip-True]",
    ],
    "verify, inspect": [
        E2E + "test_e2e_integrity.py::test_verify_names_every_damaged_item",
    ],
    "the last gasp after a kill": [
        E2E + "test_e2e_last_gasp.py::test_kill_then_last_gasp_then_resume_is_bit_identical[dp2xmp4-3-forward-13-12]",
    ],
    "repair in the job: a UCE in place, a spawned replacement, a warm spare": [
        MPI + "test_in_place_mpi.py::test_the_damaged_rank_gets_the_buffers_hit_from_its_replica_bit_for_bit",
        E2E + "test_e2e_inprocess.py::test_uce_in_a_forward_pass_is_repaired_in_place_while_the_others_go_on",
        E2E + "test_e2e_inprocess.py::test_kill_is_healed_by_a_spawned_replacement",
        E2E + "test_e2e_spares.py::test_kill_is_healed_by_a_warm_spare",
    ],
    "elastic (going on with fewer ranks)": [
        E2E + "test_e2e_elastic.py::test_two_kills_continue_on_six_then_four_ranks",
    ],
    "the hang watch (a frozen rank)": [
        E2E + "test_e2e_hang.py::test_a_frozen_rank_is_killed_then_the_last_gasp_and_the_resume_are_bit_identical",
    ],
    "silent data corruption": [
        E2E + "test_e2e_sdc.py::test_a_flipped_bit_is_rolled_back_in_the_job_bit_identically",
    ],
    "preemption, save on a signal": [
        E2E + "test_e2e_preemption.py::test_sigusr2_stops_after_an_agreed_step_saved_and_the_resume_is_bit_identical",
    ],
    "async save": [
        E2E + "test_e2e_async_save.py::test_a_kill_during_an_async_save_abandons_it_and_the_last_gasp_saves",
    ],
    "resharding": [
        E2E + "test_e2e_reshard.py::test_resume_on_another_layout_loads_the_same_state[dp8]",
    ],
    "pipeline stages": [
        MPI + "test_pipeline_equivalence.py::test_pipeline_matches_single_process[mlp-pp2xdp2xmp2k1-m1p-1f1b]",
        E2E + "test_e2e_pipeline.py::test_kill_in_a_middle_stage_last_gasp_then_resume",
    ],
    "the launcher watch: a job's timeout (a stall, a failed start: the serial stage)": [
        E2E + "test_e2e_guard.py::test_a_hung_job_that_times_out_shows_where_each_rank_was",
    ],
    "campaigns, stragglers (a slow rank found and healed)": [
        E2E + "test_e2e_campaign.py::test_a_slow_rank_is_found_by_the_straggler_watch_and_healed_in_the_job",
    ],
    "the test cluster (real hosts) and a node fault": [
        E2E + "test_e2e_cluster.py::test_a_node_failure_in_a_fault_plan_takes_the_victims_real_host",
    ],
    "a host's crash, the survivors' rescue": [
        E2E + "test_e2e_node_faults.py::"
        "test_a_host_crash_in_the_all_reduce_is_rescued_by_the_survivors_and_the_resume_is_bit_identical",
    ],
    "the watches across hosts (a kill ordered to another host)": [
        E2E + "test_e2e_watch_hosts.py::test_a_stuck_rank_alone_on_its_host_is_killed_by_order_and_the_last_gasp_saved",
    ],
    "a network cut (the side with the quorum saves, the other stops)": [
        E2E + "test_e2e_node_faults.py::test_a_network_cut_stops_the_minority_and_the_side_with_the_quorum_saves[2+2]",
    ],
    "old commit records": [
        E2E + "test_e2e_record_formats.py::test_old_records_verify_repair_and_resume_bit_identically",
    ],
}


def check_ids() -> set[str]:
    return {node for nodes in FEATURES.values() for node in nodes}


def in_check(nodeid: str) -> bool:
    ids = check_ids()
    return nodeid in ids or nodeid.split("[", 1)[0] in ids


def table() -> str:
    """The feature -> test table of docs/testing.md."""
    rows = ["| feature | `make check` runs |", "| --- | --- |"]
    for feature, nodes in FEATURES.items():
        rows.append(f"| {feature} | " + "<br>".join(f"`{n.removeprefix('tests/')}`" for n in nodes) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
