"""Config loading and validation (no MPI)."""
import pytest

from conftest import ROOT
from dsim.config import ConfigError, check_fault_ranks, check_fault_steps, load_config, validate
from dsim.build import resolve_layout


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


def test_a_mapping_override_merges_into_its_section():
    """As Hydra's overrides: the config file's other keys of the section stay (the pipeline sample's 2 + 2 blocks)."""
    cfg = load_config(ROOT / "configs" / "transformer_pipeline.yaml",
                      ["model.transformer={vocab_size: 256, d_model: 32}", "parallel={micro_batch_num: 8}"])
    t = cfg.model.transformer
    assert (t.vocab_size, t.d_model, t.num_heads, t.encoder_layers, t.decoder_layers) == (256, 32, 8, 2, 2)
    assert (cfg.parallel.micro_batch_num, cfg.parallel.pipeline_stage, cfg.parallel.model_parallel) == (8, 2, 2)
    assert load_config(None, ["model.hidden=[8]", "model.hidden=[4, 4]"]).model.hidden == [4, 4]  # lists: replaced
    with pytest.raises(ConfigError, match="unknown key 'model.transformer.nope'"):
        load_config(ROOT / "configs" / "transformer.yaml", ["model.transformer={nope: 1}"])


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


@pytest.mark.parametrize("overrides,msg", [
    (["fault.repair_stuck=-1"], "fault.repair_stuck must be a rank (>= 0) or null, got -1"),
    (["fault.last_gasp_kill=-3"], "fault.last_gasp_kill must be a rank (>= 0) or null, got -3"),
    (["fault.kind=kill", "fault.step=3", "fault.rank=8"], "fault.rank=8 is not a rank of this job: it trains on 8 "
                                                          "rank(s), 0-7"),
    (["fault.kind=kill", "fault.step=[1, 2]", "fault.rank=[1, 9]"], "fault.rank=9 is not a rank of this job"),
    (["fault.kind=kill", "fault.step=3", "fault.rank=2", "tft.arf=true", "fault.repair_hang=8"],
     "fault.repair_hang=8 is not a rank"),
    # strikes inside failure handling the config does not do
    (["fault.kind=kill", "fault.step=3", "fault.rank=2", "fault.repair_kill=1"],
     "fault.repair_kill needs tft.arf or tft.uce (a repair in the job, which it strikes in)"),
    (["fault.kind=kill", "fault.step=3", "fault.rank=2", "fault.last_gasp_stuck=1"],
     "fault.last_gasp_stuck needs tft.ttp (the last-gasp save it strikes in)"),
])
def test_a_fault_for_a_rank_the_job_does_not_have_is_refused(overrides, msg):
    with pytest.raises(ConfigError) as err:
        cfg = load_config(None, overrides)
        validate(cfg)
        check_fault_ranks(cfg.fault, 8)
    assert msg in str(err.value) and "\n" not in str(err.value)
    # the highest rank is one; with no fault, leftover ranks act on nothing and are let be
    check_fault_ranks(load_config(None, ["fault.kind=kill", "fault.step=3", "fault.rank=7", "tft.spares=1",
                                         "fault.repair_kill=7", "fault.last_gasp_kill=0"]).fault, 8)  # (spares: arf, ttp)
    check_fault_ranks(load_config(None, ["fault.repair_kill=9"]).fault, 8)


def test_a_fault_after_the_runs_last_step_or_epoch_is_refused():
    def check(*overrides):
        check_fault_steps(load_config(None, ["fault.kind=kill", "fault.rank=[1, 2]", "train.epochs=2", *overrides]), 10)
    check("fault.step=[20, 20]")  # the last step
    with pytest.raises(ConfigError, match=r"^config: fault.step=21 is after the last step of this run \(20: 2 epoch"):
        check("fault.step=[3, 21]")
    check("fault.at=epoch_end", "fault.epoch=2")
    with pytest.raises(ConfigError, match=r"^config: fault.epoch=3 is after the last epoch of this run \(2\)"):
        check("fault.at=epoch_end", "fault.epoch=3")
    check_fault_steps(load_config(None, ["fault.step=99"]), 10)  # no fault: nothing acts on it
    # at save or commit: a step that saves (every 7 steps; every epoch of 10; the last, 20, always)
    every7 = ["checkpoint.save_checkpoint_steps=7", "checkpoint.save_checkpoint_epochs=null"]
    check("fault.at=save", "fault.step=[14, 20]", *every7)
    check("fault.at=commit", "fault.step=[10, 20]")
    with pytest.raises(ConfigError, match=r"^config: fault.step=13 saves no checkpoint \(this run saves every 7 steps "
                                          r"and at its last step, 20\): a fault at save would never strike$"):
        check("fault.at=save", "fault.step=[14, 13]", *every7)
    with pytest.raises(ConfigError, match=r"saves every 1 epoch\(s\) of 10 steps and at its last step, 20"):
        check("fault.at=save", "fault.step=[14, 14]")
    # neither set: the saver saves every step (MindSpore's default), so any step saves
    check("fault.at=save", "fault.step=[13, 13]", "checkpoint.save_checkpoint_epochs=null")
    with pytest.raises(ConfigError, match="fault.at=commit strikes in a checkpoint's save: it needs checkpoint.enabled"):
        check("fault.at=commit", "fault.step=[10, 10]", "checkpoint.enabled=false")
