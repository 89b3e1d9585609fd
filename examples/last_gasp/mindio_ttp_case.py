"""The last-gasp page (last_gasp_checkpoint_ttp.zh.md): mindio_ttp_case.py, the page's 5-layer Network trained data
parallel with OptTFTWrapper and the TFTRegister callback; when a rank is killed the survivors save a last-gasp
checkpoint of the newest step, and --is_recover=1 resumes from it at the next step.

    $ bash examples/last_gasp/msrun.sh                  # MS_ENABLE_TFT='{TTP:1}', mpirun -n 8 with fault tolerance
    $ kill -9 <pid of a training process>              # ttp_checkpoints/tft_saved_checkpoints-step_{n}/rank_{r}/...
    $ bash examples/last_gasp/msrun-resume.sh           # the same with --is_recover=1: goes on from step n + 1

DATA_PATH names the MNIST idx files (the page's MNIST_Data/train/); without it, MNIST-shaped digits made from the
seed. --epochs, --steps and --hidden shorten it (the tests: --hidden 64 128 128 64). Unlike MindIO, dsim has no
controller process on rank 0: the survivors agree among themselves, so killing rank 0 saves too.
"""
import argparse
import os

import dsim
from dsim import nn
from dsim.dataset import MnistDataset, SyntheticMnist

parser = argparse.ArgumentParser(description="Mindio TTP test arguments")
parser.add_argument("--is_recover",
                    type=int,
                    default=0,
                    choices=[1, 0],
                    help="Only used for resume from Mindio TTP checkpoint, default false.")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps", type=int, default=None, help="cut every epoch to this many steps")
parser.add_argument("--hidden", type=int, nargs=4, default=[512, 5120, 5120, 512], help="the hidden widths")
args_opt = parser.parse_args()

dsim.set_auto_parallel_context(model_parallel=1)  # ParallelMode.DATA_PARALLEL: every rank a replica of the others
dsim.init()


class Network(nn.SequentialCell):
    """
    Network definition.
    """
    def __init__(self, hidden=(512, 5120, 5120, 512)):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense("layer1", 28 * 28, hidden[0], kind="matmul")  # MatMulCell: x @ param, HeUniform
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense("layer2", hidden[0], hidden[1])
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense("layer3", hidden[1], hidden[2])
        self.relu3 = nn.ReLU()
        self.layer4 = nn.Dense("layer4", hidden[2], hidden[3])
        self.relu4 = nn.ReLU()
        self.layer5 = nn.Dense("layer5", hidden[3], 10)
        # construct
        self.layers = [self.flatten, self.layer1, self.relu1, self.layer2, self.relu2, self.layer3, self.relu3,
                       self.layer4, self.relu4, self.layer5]


net = Network(args_opt.hidden)


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
# the TFT optimizer: reports each update's progress, and keeps the state from before it
optimizer_wrapper = nn.OptTFTWrapper(optimizer)
loss_fn = nn.CrossEntropyLoss()
model = dsim.Model(net, loss_fn=loss_fn, optimizer=optimizer_wrapper)

time_monitor = dsim.TimeMonitor(data_size=1)
loss_cb = dsim.LossMonitor(1)

# the TFT callback: the last-gasp checkpoint goes to ./ttp_checkpoints/
tft_cb = dsim.TFTRegister(0, "127.0.0.1", 30051, "./ttp_checkpoints/")

init_epoch = 0

if bool(args_opt.is_recover):
    # The page sets these by hand from the saved file's name; here: the newest committed last gasp
    saved = [r for d in os.listdir("./ttp_checkpoints") for r in dsim.committed(f"./ttp_checkpoints/{d}")]
    newest = max(saved, key=lambda r: r["global_step"])
    cur_epoch = newest["epoch"]  # the epoch of the saved step
    cur_step = newest["step_in_epoch"]  # the step of the saved step in its epoch
    ckpt_step = (cur_epoch - 1) * dataset.get_dataset_size() + cur_step
    # data parallel: every rank's file holds the same, as on the page rank 0's is read
    cur_rank = 0
    new_ckpt_file = f"./ttp_checkpoints/tft_saved_checkpoints-step_{ckpt_step}/rank_{cur_rank}/ttp_rank_{cur_rank}-{cur_epoch}_{cur_step}.h5"
    param_dict = dsim.load_checkpoint(new_ckpt_file)
    model.build(train_dataset=dataset)  # the slices exist once the model is built
    dsim.load_param_into_net(net, param_dict)
    dsim.load_param_into_net(optimizer, param_dict)  # the step counter too
    dataset.set_init_step(int(param_dict["step_num"]))
    init_epoch = int(param_dict["epoch_num"]) - 1
    if dsim.get_rank() == 0:
        print(f"resuming from {new_ckpt_file} (global step {ckpt_step})", flush=True)

model.train(args_opt.epochs, dataset, callbacks=[time_monitor, loss_cb, tft_cb], initial_epoch=init_epoch)
