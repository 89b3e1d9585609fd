"""Warm spares' pure parts (no MPI job): the config, the count of training ranks, who takes which dead rank,
when a waiting spare is orphaned, the launchers' count, and building a model without initial values."""
import numpy as np
import pytest

from dsim.config import ConfigError, load_config
from dsim.ft.spare_count import config_options, spares
from dsim.build import resolve_layout
from dsim.ft.spares import assign, died_since, orphaned, training_ranks
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout


def test_spares_imply_healing_and_are_counted_from_zero():
    cfg = load_config(None, ["tft.spares=2"])
    assert (cfg.tft.spares, cfg.tft.arf, cfg.tft.ttp) == (2, True, True)
    assert load_config(None, []).tft.spares == 0 and not load_config(None, []).tft.arf
    with pytest.raises(ConfigError, match=r"tft.spares must be >= 0, got -1"):
        load_config(None, ["tft.spares=-1"])
    with pytest.raises(ConfigError, match=r"tft.spares must be int"):
        load_config(None, ["tft.spares=one"])


def test_the_last_processes_are_the_spares_and_the_rest_must_fit_the_layout():
    cfg = load_config(None, ["tft.spares=1", "parallel.data_parallel=2"])
    assert training_ranks(cfg, 9, resolve_layout) == 8
    assert training_ranks(load_config(None, []), 8, resolve_layout) == 8
    with pytest.raises(ConfigError) as e:
        training_ranks(cfg, 8, resolve_layout)
    assert str(e.value) == ("tft.spares=1: mpirun -n 8 leaves 7 training rank(s) beside the spare(s), and layout "
                            "data_parallel=2 x model_parallel=4 = 8 ranks does not fit the world size 7; launch "
                            "mpirun -n 9 (8 training ranks + 1 spare(s))")
    with pytest.raises(ConfigError, match=r"tft.spares=2 leaves no training rank in a job of 2 process\(es\)"):
        training_ranks(load_config(None, ["tft.spares=2"]), 2, resolve_layout)


def test_spares_take_the_dead_ranks_lowest_first_and_the_rest_are_spawned():
    roles = [0, 1, 2, 4, 5, 6, 7, None, None]  # rank 3 died; pool ranks 7 and 8 are spares
    assert assign(roles, [3]) == ({7: 3}, [], [8])
    assert assign(roles, [5, 3]) == ({7: 3, 8: 5}, [], [])
    assert assign([0, 2, None], [3, 1, 5]) == ({2: 1}, [3, 5], [])
    assert assign(list(range(8)), []) == ({}, [], [])


def test_a_training_rank_gone_from_the_refill_that_was_not_to_be_replaced_died_during_the_repair():
    # rank 3 died; the survivors agreed to replace it; rank 1 died before the pool's shrink, which left it out
    assert died_since(8, [3], [0, 2, 4, 5, 6, 7, None]) == [1]
    assert died_since(8, [3], [0, 1, 2, 4, 5, 6, 7, None]) == []
    assert died_since(8, [1, 6], [0, 2, 3, 4, 5, 7, None, None]) == []
    assert died_since(4, [0], [None, 3, 2]) == [1]  # the order of the pool is not the world's


def test_a_spare_is_orphaned_only_when_every_training_process_beside_it_is_gone():
    watched = [("a", 10), ("a", 11), ("b", 12)]
    assert orphaned(watched, "a", lambda pid: pid == 11, None, 5.0) is None
    assert orphaned(watched, "a", lambda pid: False, None, 5.0) == 5.0
    assert orphaned(watched, "a", lambda pid: False, 3.0, 5.0) == 3.0  # gone since the first time it saw so
    assert orphaned(watched, "c", lambda pid: False, None, 5.0) is None  # nothing to watch on this host


def test_the_launchers_count_spares_from_the_config_and_its_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("tft:\n  spares: 2\n")
    argv = ["--config", str(config), "--resume", "auto", "--repair", "--set", "seed=3"]
    assert config_options(argv) == ["--config", str(config), "--set", "seed=3"]
    assert spares(argv) == 2
    assert spares([*argv, "--set", "tft.spares=1"]) == 1
    assert spares(["--set", "tft.spares=x"]) == 0  # the run itself reports the bad config


def test_a_newcomer_builds_zeros_of_the_same_shapes_and_later_builds_are_initialised():
    layout = ParallelLayout(2, 4, 1)
    blank = create_network("network", [16, 32, 32, 16]).build(layout, 3, 1, np.float32, initialize=False)
    real = create_network("network", [16, 32, 32, 16]).build(layout, 3, 1, np.float32)
    assert [p.data.shape for p in blank.params] == [p.data.shape for p in real.params]
    assert all(p.data.dtype == np.float32 and not p.data.any() and p.data.flags.writeable for p in blank.params)
    assert all(p.data.any() for p in real.params if "weight" in p.name)
