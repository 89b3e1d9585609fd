"""dsim: distributed deep-learning training on real MPI ranks, and its recovery from faults.

Data flow: context (world, layout) -> network/optimizer -> data -> Model.build -> Model.train.

The public API, with the seed pages' names (docs/api.md, "Writing your own script"):

    import dsim
    from dsim import nn
    dsim.set_auto_parallel_context(data_parallel=2, model_parallel=4); dsim.init()
    net = nn.LeNet5()                                    # or a Cell of your own from dsim.nn's layers
    optim = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    model = dsim.Model(net, loss_fn=nn.SoftmaxCrossEntropyWithLogits(), optimizer=optim)
    dataset = dsim.dataset.SyntheticMnist(1920, image_size=32).batch(32)
    model.train(10, dataset, callbacks=[dsim.ModelCheckpoint("lenet", "./lenet", dsim.CheckpointConfig()),
                                        dsim.LossMonitor()])
"""
__version__ = "0.1.0"

from . import dataset, nn  # noqa: E402
from .checkpoint import (CheckpointConfig, ModelCheckpoint, committed, latest_committed,  # noqa: E402
                         load_checkpoint, load_param_into_net, restore_group_info_list)
from .context import (get_context, get_group_size, get_rank, init, set_auto_parallel_context,  # noqa: E402
                      set_context, set_seed)
from .engine.callbacks import Callback, EvalMonitor, LossMonitor, MetricsLog, RunContext, TimeMonitor  # noqa: E402
from .engine.model import Model  # noqa: E402
from .ft.preemption import StopOnSignal  # noqa: E402
from .ft.tft import TFTRegister, TrainFaultTolerance  # noqa: E402
from .ft.wrapper import OptTFTWrapper  # noqa: E402

__all__ = ["dataset", "nn", "CheckpointConfig", "ModelCheckpoint", "committed", "latest_committed",
           "load_checkpoint", "load_param_into_net", "restore_group_info_list", "get_context", "get_group_size",
           "get_rank", "init", "set_auto_parallel_context", "set_context", "set_seed", "Callback", "EvalMonitor", "LossMonitor",
           "MetricsLog", "RunContext", "StopOnSignal", "TimeMonitor", "Model", "TFTRegister", "TrainFaultTolerance", "OptTFTWrapper"]
