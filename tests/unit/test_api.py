"""The public API in one process (MPI.COMM_SELF): context, datasets, losses, optimizers binding at build, Model's
run context, the fault-tolerance callbacks' checks, and a script's exception as one line."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import dsim
from conftest import ROOT, launch_env
from dsim import nn
from dsim.config import ConfigError
from dsim.context import fit_layout
from dsim.data import DatasetError
from dsim.nn.layers import softmax_cross_entropy
from dsim.optim import LRSchedule
from dsim.parallel.layout import LayoutError


@pytest.fixture
def context():
    """A fresh context on COMM_SELF, and the interpreter's exception hook back afterwards."""
    saved = (sys.excepthook, dict(vars(dsim.get_context())))
    dsim.init(MPI.COMM_SELF)
    dsim.set_auto_parallel_context(data_parallel=1, model_parallel=1)
    dsim.set_context(dtype="float64")
    yield dsim.get_context()
    sys.excepthook = saved[0]
    vars(dsim.get_context()).update(saved[1])


def test_docs_show_the_fault_recovery_example_whole():
    page = (ROOT / "docs" / "api.md").read_text()  # "Writing your own script"
    assert "```python\n" + (ROOT / "examples" / "fault_recover" / "fault_recover.py").read_text() + "```" in page


def test_layout_fits_the_world():
    assert fit_layout(8, None, 4, 1).data_parallel == 2
    with pytest.raises(LayoutError, match="model_parallel=3 does not divide the world size 8"):
        fit_layout(8, None, 3, 1)
    with pytest.raises(LayoutError, match="= 4 ranks does not fit the world size 8"):
        fit_layout(8, 2, 2, 1)


def test_dataset_batch_take_split(context):
    data = dsim.dataset.SyntheticMnist(100)
    train, held_out = data.split([0.8, 0.2])
    assert (len(train.source), len(held_out.source)) == (80, 20)
    assert np.array_equal(held_out.source.get([0, 1])[0], data.source.get([80, 81])[0])  # disjoint, in order
    assert train.batch(16).get_dataset_size() == 5 and train.batch(16).take(3).get_dataset_size() == 3
    with pytest.raises(DatasetError, match="call .batch"):
        train.get_dataset_size()
    with pytest.raises(DatasetError, match="drop the remainder"):
        train.batch(16, drop_remainder=False)
    with pytest.raises(DatasetError, match="do not add up to the 100 samples"):
        data.split([50, 40])
    bound = train.batch(16).bind(1, 0, seed=1)
    with pytest.raises(DatasetError, match="in use by a model"):
        bound.take(2)


def test_losses_and_optimizers_by_mindspore_names():
    logits, labels = np.random.default_rng(0).normal(size=(4, 10)), np.array([1, 2, 3, 4])
    loss, grad = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")(logits, labels, 8)
    want = softmax_cross_entropy(logits, labels, 8)
    assert loss == want[0] and np.array_equal(grad, want[1])
    with pytest.raises(ValueError, match="sparse=True, reduction='mean' only"):
        nn.SoftmaxCrossEntropyWithLogits(sparse=False)
    optim = nn.Momentum([], 0.01, 0.9)  # as a script makes it, before the network is built
    assert optim.params == [] and optim.learning_rate == LRSchedule(0.01) and optim.current_lr() == 0.01


def test_model_builds_binds_and_passes_the_run_context(context):
    seen = []

    class Record(dsim.Callback):
        def step_end(self, run_context):
            cb = run_context.original_args()
            seen.append((cb.cur_epoch_num, cb.cur_step_in_epoch, cb.cur_step_num, cb.batch_num, cb.epoch_num,
                         round(float(cb.net_outputs), 12), cb.train_network is net, cb.device_number))

    net = nn.Network([16])
    optim = nn.OptTFTWrapper(nn.Adam(net.trainable_params(), learning_rate=0.01))
    assert net.trainable_params() == [] and optim.params == []
    model = dsim.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=optim)
    dataset = dsim.dataset.SyntheticMnist(64).batch(16).take(2)
    model.train(2, dataset, callbacks=Record())
    assert [s[:5] for s in seen] == [(1, 1, 1, 2, 2), (1, 2, 2, 2, 2), (2, 1, 3, 2, 2), (2, 2, 4, 2, 2)]
    assert all(s[6] and s[7] == 1 for s in seen) and len({s[5] for s in seen}) == 4
    assert [p.name for p in optim.params] == [p.name for p in net.trainable_params()] != []
    assert optim.global_step == 4 and set(optim.state) == {"moment1", "moment2"}
    assert 0 <= model.eval(dsim.dataset.SyntheticMnist(32).batch(16))["accuracy"] <= 1
    model.groups.free()


class Failure(Exception):
    """A failure the fake repair below handles; its argument: the step training goes on after."""


class Repair:
    """What Model's training loop uses of an in-job repair (dsim.ft.inprocess): it handles Failure and says
    training goes on after the step the failure names."""
    watches = False

    def __init__(self, seen: list):
        self.seen = seen

    def step_finished(self, step):
        pass

    def handles(self, e):
        return isinstance(e, Failure)

    def recover(self, e, callbacks):
        self.seen.append(("repair", e.args[0]))
        return e.args[0]


@pytest.mark.parametrize("failing_step", [3, 2])
def test_a_step_end_cut_short_by_a_repaired_failure_is_finished_by_the_local_callbacks(context, failing_step):
    """A failure in a callback at a step's end (a rank dying in the save's collectives) that the in-job repair
    keeps the step of: the local callbacks after the failing one (loss line, metrics) still run for that step,
    and for the epoch's end at its last step (step 2 of 2); the others do not run again, and the epoch the
    repair falls in is not begun again (TimeMonitor times it whole)."""
    seen = []

    class Saver(dsim.Callback):
        def step_end(self, run_context):
            step = run_context.original_args().cur_step_num
            if step == failing_step and ("repair", step) not in seen:
                raise Failure(step)

    class Record(dsim.Callback):
        def __init__(self, name, local):
            self.name, self.local = name, local

        def epoch_begin(self, run_context):
            seen.append((self.name, "epoch_begin", run_context.original_args().cur_epoch_num))

        def step_end(self, run_context):
            cb = run_context.original_args()
            seen.append((self.name, "step_end", cb.cur_epoch_num, cb.cur_step_in_epoch, cb.cur_step_num))

        def epoch_end(self, run_context):
            seen.append((self.name, "epoch_end", run_context.original_args().cur_epoch_num))

    net = nn.Network([16])
    model = dsim.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01))
    model.build(dsim.dataset.SyntheticMnist(64).batch(16).take(2))
    model.recovery = Repair(seen)
    model.train(2, dsim.dataset.SyntheticMnist(64).batch(16).take(2),
                callbacks=[Record("before", True), Saver(), Record("other", False), Record("local", True)])
    assert ("local", "step_end", 1, 1, 1) in seen
    after = seen[seen.index(("repair", failing_step)):]
    epoch, in_epoch = (failing_step - 1) // 2 + 1, (failing_step - 1) % 2 + 1
    assert after[1] == ("local", "step_end", epoch, in_epoch, failing_step)  # once, after the repair
    assert [x for x in seen if x[1:2] == ("step_end",) and x[0] == "local"] == [
        ("local", "step_end", e, s, 2 * (e - 1) + s) for e in (1, 2) for s in (1, 2)]
    assert [x for x in seen if x[1:2] == ("step_end",) and x[0] == "other"] == [
        ("other", "step_end", e, s, 2 * (e - 1) + s) for e, s in [(1, 1), (1, 2), (2, 1), (2, 2)]
        if 2 * (e - 1) + s != failing_step]
    for name in ("before", "local"):  # each epoch begun and ended once
        assert [x[1:] for x in seen if x[0] == name and x[1] != "step_end"] == [
            ("epoch_begin", 1), ("epoch_end", 1), ("epoch_begin", 2), ("epoch_end", 2)]
    assert [x[1:] for x in seen if x[0] == "other" and x[1] != "step_end"] == [
        ("epoch_begin", 1), *([("epoch_end", 1)] if failing_step != 2 else []), ("epoch_begin", 2), ("epoch_end", 2)]
    model.groups.free()


def test_a_repair_back_to_the_end_of_the_epoch_before_numbers_the_redone_step_in_the_epoch_going_on(context):
    """A failure in step 3 (epoch 2's first) repaired back to step 2 (epoch 1's end): step 3 is redone as epoch 2
    step 1, in the epoch begun already (not begun again)."""
    seen = []

    class Strike(dsim.Callback):
        def epoch_begin(self, run_context):
            seen.append(("epoch_begin", run_context.original_args().cur_epoch_num))

        def step_begin(self, run_context):
            cb = run_context.original_args()
            seen.append(("step_begin", cb.cur_epoch_num, cb.cur_step_in_epoch))
            if cb.cur_step_num == 2 and ("repair", 2) not in seen:
                raise Failure(2)  # going on after step 2, epoch 1's last

        def step_end(self, run_context):
            cb = run_context.original_args()
            seen.append((cb.cur_epoch_num, cb.cur_step_in_epoch, cb.cur_step_num))

    net = nn.Network([16])
    model = dsim.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01))
    model.build(dsim.dataset.SyntheticMnist(64).batch(16).take(2))
    model.recovery = Repair(seen)
    model.train(2, dsim.dataset.SyntheticMnist(64).batch(16).take(2), callbacks=[Strike()])
    assert seen == [("epoch_begin", 1), ("step_begin", 1, 0), (1, 1, 1), ("step_begin", 1, 1), (1, 2, 2),
                    ("epoch_begin", 2), ("step_begin", 2, 0), ("repair", 2), ("step_begin", 2, 0), (2, 1, 3),
                    ("step_begin", 2, 1), (2, 2, 4)]
    model.groups.free()


def test_a_signal_stops_training_after_the_step_it_came_in(context):
    """checkpoint.save_on_signal's callback: SIGUSR2 during step 3 stops training after it (the ranks' notes
    agreed at the step's end), the handler is the default again afterwards; it needs checkpoints to save."""
    import signal

    from dsim.ft.preemption import StopOnSignal

    class Notice(dsim.Callback):
        def step_begin(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                os.kill(os.getpid(), signal.SIGUSR2)  # a scheduler's notice, in the middle of step 3

    net = nn.Network([16])
    model = dsim.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=nn.Momentum(net.trainable_params(), 0.01))
    stop = StopOnSignal()
    cb = model.train(3, dsim.dataset.SyntheticMnist(64).batch(16).take(2), callbacks=[Notice(), stop])
    assert (stop.stopped, cb.cur_step_num, model.optimizer.global_step) == (signal.SIGUSR2, 3, 3)
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    model.groups.free()
    # a warm spare holds the notice (mpirun passes it to every process): it lives, and should it take a place,
    # its StopOnSignal starts from it
    from dsim.ft import preemption
    from dsim.runtime import PROCESS
    try:
        preemption.hold_signals()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert PROCESS.held_signal == signal.SIGUSR2
        held = StopOnSignal()
        held.begin(None)
        assert held.received == signal.SIGUSR2 and signal.getsignal(signal.SIGUSR2) == held._note
    finally:
        for s in preemption.SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        PROCESS.held_signal = 0
    with pytest.raises(ConfigError, match="checkpoint.save_on_signal saves the step training stops at: it needs "
                                          "checkpoint.enabled"):
        dsim.config.load_config(None, ["checkpoint.save_on_signal=true", "checkpoint.enabled=false"])


def test_fault_tolerance_callbacks_need_the_wrapped_optimizer(context):
    net = nn.Network([16])
    model = dsim.Model(net, optimizer=nn.SGD(net.trainable_params(), 0.1))
    with pytest.raises(ConfigError, match=r"TFTRegister needs the optimizer wrapped: nn.OptTFTWrapper\(optimizer\)"):
        model.train(1, dsim.dataset.SyntheticMnist(32).batch(16), callbacks=[dsim.TFTRegister()])
    model.groups.free()


def test_an_exception_that_ends_a_script_is_one_line(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import dsim\ndsim.init()\nraise Exception('Some errors happen.')\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=launch_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1
    assert p.stderr.splitlines()[-1] == "dsim: error: rank 0: Some errors happen. (traceback in logs/rank_0.err)"
    assert "Traceback" not in p.stderr and "Exception: Some errors happen." in Path(tmp_path / "logs" / "rank_0.err").read_text()


def test_eval_of_a_token_model_counts_the_target_tokens_that_are_not_padding(context):
    net = nn.Transformer(vocab_size=64, d_model=16, num_heads=2, ffn_hidden_size=32)
    model = dsim.Model(net, optimizer=nn.AdamWeightDecay(net.trainable_params(), 0.01))
    held_out = dsim.dataset.TranslationDataset(32, vocab_size=64).batch(16)
    got = model.eval(held_out)["accuracy"]
    hits = tokens = 0
    for step in range(2):
        (src, tgt), labels = held_out.source.get(np.arange(16 * step, 16 * step + 16))
        predicted = net.forward((src, tgt), model.groups.mp).argmax(axis=1)
        keep = labels.reshape(-1) != dsim.data.PAD
        hits, tokens = hits + (predicted == labels.reshape(-1))[keep].sum(), tokens + keep.sum()
    assert tokens < 32 * 10 and got == hits / tokens  # padding left out
    model.groups.free()
