"""The rescue (dsim.ft.rescue, issue 52): which rescue files a resume completes into a last gasp, and which it finds
(pure: no MPI; the files only named). A host's crash rescued end to end: tests/e2e/test_e2e_node_faults.py."""
from dsim.checkpoint.group_info import replica_sets
from dsim.ft.rescue import choices, found
from dsim.parallel.layout import ParallelLayout

SETS = [list(g) for g in replica_sets(ParallelLayout(2, 4, 1))]  # [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_replica_sets_of_dp2_mp4():
    assert sorted(SETS) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_node1s_files_of_two_steps_complete_the_newest_each_rank_reading_its_own():
    # node2 (ranks 4-7) crashed; ranks 0 and 2 had finished step 7, ranks 1 and 3 not: step 6 is the newest whole
    held = {0: (6, 7), 1: (5, 6), 2: (6, 7), 3: (5, 6)}
    everyone = [[(s, r) for s in held[r]] if r in held else [] for r in range(8)]
    (step, readers), = [c for c in choices(everyone, 4, SETS) if c[0] == 6]
    assert readers == {0: 0, 1: 1, 2: 2, 3: 3}
    assert [s for s, _ in choices(everyone, 4, SETS)] == [6]  # 7 and 5 lack ranks 1, 3 / ranks 0, 2


def test_nothing_newer_than_the_newest_commit_is_a_choice():
    everyone = [[(6, r)] if r < 4 else [] for r in range(8)]
    assert choices(everyone, 6, SETS) == [] and choices(everyone, 8, SETS) == []
    assert [s for s, _ in choices(everyone, 5, SETS)] == [6]


def test_a_slice_without_a_file_leaves_its_step_out():
    everyone = [[(6, r)] if r in (0, 1, 2, 4) else [] for r in range(8)]  # set [3, 7]: nobody wrote
    assert choices(everyone, 4, SETS) == []


def test_files_found_by_other_ranks_are_read_by_the_least_loaded_finder():
    # a restart on other hosts: every file is on the disk of ranks 4 and 5 (one host), none on its own rank's
    files = [(6, r) for r in range(4)]
    everyone = [[] for _ in range(8)]
    everyone[4] = everyone[5] = files
    (step, readers), = choices(everyone, 4, SETS)
    assert step == 6 and sorted(readers) == [0, 1, 2, 3]
    assert sorted(readers.values()) == [4, 4, 5, 5]  # two each, not four on one


def test_both_replicas_found_both_read_by_their_own_ranks():
    everyone = [[(6, r)] for r in range(8)]
    (step, readers), = choices(everyone, 4, SETS)
    assert readers == {r: r for r in range(8)}


def test_found_lists_the_rescue_files_on_a_disk_and_nothing_else(tmp_path):
    for rel in ("rescue-step_6/rank_0/ttp_rank_0-2_2.h5", "rescue-step_6/rank_1/ttp_rank_1-2_2.h5",
                "rescue-step_5/rank_1/ttp_rank_1-2_1.h5",
                "rescue-step_6/rank_2/ttp_rank_2-2_2.h5.tmp",        # a writer that never finished
                "rescue-step_6/rank_3/ttp_rank_2-2_2.h5",            # another rank's name in rank 3's directory
                "tft_saved_checkpoints-step_6/rank_0/ttp_rank_0-2_2.h5",  # a last gasp's file
                "rescue-step_x/rank_0/ttp_rank_0-2_2.h5"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    assert [(s, r) for s, r, _ in found(tmp_path)] == [(5, 1), (6, 0), (6, 1)]
    assert found(tmp_path / "absent") == []
