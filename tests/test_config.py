"""Config loading and validation (no MPI)."""
import pytest

from conftest import ROOT
from dsim.config import ConfigError, load_config
from dsim.engine.builder import resolve_layout


def test_default_yaml_is_the_builtin_default():
    from_file = load_config(ROOT / "configs" / "default.yaml")
    builtin = load_config(None)
    assert resolve_layout(from_file, 8) == resolve_layout(builtin, 8)
    builtin.parallel.data_parallel = 2
    assert from_file == builtin


def test_overrides_are_typed():
    cfg = load_config(None, ["optimizer.name=adam", "model.hidden=[8, 16]", "optimizer.learning_rate=1"])
    assert cfg.optimizer.name == "adam" and cfg.model.hidden == [8, 16]
    assert cfg.optimizer.learning_rate == 1.0 and isinstance(cfg.optimizer.learning_rate, float)


@pytest.mark.parametrize("text,msg", [
    ("parallel: {data_paralel: 2}", "unknown key 'parallel.data_paralel'"),
    ("bogus: 1", "unknown key 'bogus'"),
    ("parallel: {model_parallel: two}", "parallel.model_parallel must be int, got str 'two'"),
    ("data: {shuffle: 3}", "data.shuffle must be bool"),
    ("model: {hidden: 5}", "model.hidden must be a list"),
    ("dtype: float16", "dtype must be float32 or float64"),
    ("train: {epochs: 0}", "train.epochs must be >= 1"),
    ("data: {name: mnist}", "data.path is required"),
    ("data: {name: mnist, path: /no/such/MNIST_Data/train}", "data.path not found: /no/such/MNIST_Data/train"),
    ("- a list", "must hold a mapping"),
    ("a: [unclosed", "not valid YAML"),
])
def test_bad_configs_give_one_line(tmp_path, text, msg):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert msg in str(err.value) and "\n" not in str(err.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="file not found: nope.yaml"):
        load_config("nope.yaml")
