"""The UCE page (uce_fast_recovery.zh.md): UCE_case.py, the page's 3-layer Network with OptTFTWrapper and the
TrainFaultTolerance callback; a rank whose memory fails (an uncorrectable error, UCE) is cleaned and given its
slices back from its replica rank, and training goes on from the next step without restarting the job.

    $ bash examples/uce/msrun.sh --uce_rank 3 --uce_step 6     # MS_ENABLE_TFT='{UCE:1 TTP:1}', fault tolerance on

There is no device here to fail: --uce_rank/--uce_step make dsim's fault injector turn half of that rank's
parameter and optimizer buffers into garbage after that step and report a UCE, as the hardware would. DATA_PATH
names the MNIST idx files (without it, MNIST-shaped digits made from the seed); --epochs and --steps shorten it.
The layout is dp2 x mp4: layer1 column-split, layer2 row-split, layer3 replicated; rank r's replica is r +/- 4.
"""
import argparse
import os

import dsim
from dsim import nn
from dsim.dataset import MnistDataset, SyntheticMnist
from dsim.faults import FaultInjector

parser = argparse.ArgumentParser(description="UCE fast recovery")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps", type=int, default=None, help="cut every epoch to this many steps")
parser.add_argument("--uce_rank", type=int, default=None, help="inject a UCE on this rank...")
parser.add_argument("--uce_step", type=int, default=None, help="...after this global step")
args_opt = parser.parse_args()

dsim.set_auto_parallel_context(data_parallel=2, model_parallel=4)  # ParallelMode.SEMI_AUTO_PARALLEL
dsim.init()


class Network(nn.SequentialCell):
    """
    Network definition.
    """
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense("layer1", 28 * 28, 512, "column", kind="matmul")  # MatMulCell: x @ param
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense("layer2", 512, 512, "row")
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense("layer3", 512, 10)
        # construct
        self.layers = [self.flatten, self.layer1, self.relu1, self.layer2, self.relu2, self.layer3]


net = Network()


def create_dataset(batch_size):
    """create dataset"""
    dataset_path = os.getenv("DATA_PATH")
    if dataset_path:  # Rescale(1.0 / 255.0, 0), Normalize((0.1307,), (0.3081,)), HWC2CHW, labels int
        dataset = MnistDataset(dataset_path)
    else:
        dataset = SyntheticMnist(60000)
    dataset = dataset.batch(batch_size)
    return dataset


dataset = create_dataset(32)
if args_opt.steps:
    dataset = dataset.take(args_opt.steps)

optimizer = nn.SGD(net.trainable_params(), 1e-2)
# the TFT optimizer
optimizer_wrapper = nn.OptTFTWrapper(optimizer)
loss_fn = nn.CrossEntropyLoss()

model = dsim.Model(net, loss_fn=loss_fn, optimizer=optimizer_wrapper)

time_monitor = dsim.TimeMonitor(data_size=1)
loss_cb = dsim.LossMonitor(1)

# the callback: a UCE is repaired in the job (the last-gasp checkpoint stays the fallback)
tft_cb = dsim.TrainFaultTolerance()

callbacks = [time_monitor, loss_cb, tft_cb]
if args_opt.uce_rank is not None:
    callbacks.insert(0, FaultInjector("uce", rank=args_opt.uce_rank, step=args_opt.uce_step))
model.train(args_opt.epochs, dataset, callbacks=callbacks)
