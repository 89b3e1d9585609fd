"""Bad config values are one line naming the key, the value and what is allowed (issue 22, items 1 and 2)."""
import pytest

from dsim.config import ConfigError, load_config
from dsim.writable import check_places

BAD = {
    "optimizer.name=rmsprop": "optimizer.name must be one of sgd, momentum, adam",
    "seed=-1": "seed must be in [0, 2**32), got -1",
    "optimizer.learning_rate=-1": "optimizer.learning_rate must be > 0",
    "optimizer.beta1=2": "optimizer.beta1 must be in [0, 1)",
    "optimizer.eps=0": "optimizer.eps must be > 0",
    "optimizer.eps=.inf": "optimizer.eps must be a finite number, got inf",
    "optimizer.learning_rate=.nan": "optimizer.learning_rate must be a finite number, got nan",
    "optimizer.schedule.name=x": "optimizer.schedule.name must be one of constant, cosine, exponential, got 'x'",
    "optimizer.schedule.decay_steps=0": "optimizer.schedule.decay_steps must be >= 1, got 0",
    "model.hidden=[]": "model.hidden must be a list of one or more widths",
    "model.hidden=[0]": "model.hidden widths must be >= 1",
    "model.hidden=[100000000]": "model.hidden must be widths <= 65536",
    "parallel.data_parallel=0": "parallel.data_parallel must be an integer >= 1, got 0",
    "checkpoint.prefix=a/b": "checkpoint.prefix must be a plain file name (no '/'), got 'a/b'",
    "checkpoint.prefix='..'": "checkpoint.prefix must be a plain file name",
    "checkpoint.keep_checkpoint_max=0": "keep_checkpoint_max must be a positive integer, got 0",
    "checkpoint.append_info=[x]": "append_info takes 'epoch_num', 'step_num' or a dict, got 'x'",
}


@pytest.mark.parametrize("item", sorted(BAD))
def test_bad_value_is_one_line_naming_key_value_and_allowed(item):
    with pytest.raises(ConfigError) as e:
        load_config(None, [item])
    assert BAD[item] in str(e.value) and "\n" not in str(e.value)


def test_a_config_file_that_is_not_text(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="is not a text file"):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("key", ["output.dir", "checkpoint.directory", "checkpoint.group_info_file"])
def test_places_must_be_writable_directories(tmp_path, key):
    (tmp_path / "file").write_text("x")
    value = str(tmp_path / "file" / ("g_{rank}.json" if key.endswith("file") else "d"))
    cfg = load_config(None, [f"output.dir={tmp_path / 'out'}", f"{key}={value}"])
    with pytest.raises(ConfigError) as e:
        check_places(cfg)
    assert str(e.value).startswith(f"config: {key} '{tmp_path / 'file'}") and "Not a directory" in str(e.value)


def test_creatable_places_pass_and_nothing_is_left(tmp_path):
    cfg = load_config(None, [f"output.dir={tmp_path / 'a' / 'b'}"])
    check_places(cfg)
    assert list(tmp_path.iterdir()) == []
