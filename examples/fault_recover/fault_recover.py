"""The fault-recovery page (fault_recover.md) as a dsim script: LeNet5, a checkpoint every epoch, a fault at the end
of epoch 6; then a script of your own finds the latest checkpoint and training resumes at epoch 7 up to epoch 10.

    $ mpirun -n 8 python examples/fault_recover/fault_recover.py              # fails at the end of epoch 6
    $ ls lenet lenet/rank_0                                                   # lenet-2_1875 ... lenet-6_1875
    $ mpirun -n 8 python examples/fault_recover/fault_recover.py --recover 1  # epochs 7 to 10: lenet_1-7_1875 ...

It reads MNIST_Data/train (the page's download) when that directory exists, else MNIST-shaped digits made from
the seed. --steps N cuts every epoch to N steps (the tests use 2). Each rank holds a slice of LeNet5 (dp4 x mp2:
conv2's channels and fc1's inputs are split over the two model-parallel ranks) and saves only its own slices.
"""
import argparse
import json
import os

import dsim
from dsim import nn
from dsim import Model, CheckpointConfig, ModelCheckpoint, Callback, LossMonitor
from dsim.dataset import MnistDataset, SyntheticMnist
from dsim.nn import Normal

parser = argparse.ArgumentParser(description="the fault-recovery page's LeNet5 script")
parser.add_argument("--recover", type=int, default=0, choices=[0, 1], help="find the latest checkpoint and resume")
parser.add_argument("--data_path", default="MNIST_Data/train")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--steps", type=int, default=None, help="cut every epoch to this many steps")
args_opt = parser.parse_args()

dsim.set_auto_parallel_context(data_parallel=4, model_parallel=2)
dsim.init()


# Create a training dataset
def create_dataset(data_path, batch_size=32):
    if os.path.isdir(data_path):  # Rescale(1.0 / 255.0, 0), Resize(size=(32, 32)), HWC2CHW, labels int
        train_dataset = MnistDataset(data_path, shuffle=False, image_size=32)
    else:
        train_dataset = SyntheticMnist(60000, shuffle=False, image_size=32)
    train_dataset = train_dataset.batch(batch_size, drop_remainder=True)
    return train_dataset


# Load the training dataset
data_path = args_opt.data_path
train_dataset = create_dataset(data_path)
if args_opt.steps:
    train_dataset = train_dataset.take(args_opt.steps)


# Fault during the simulation training
class myCallback(Callback):
    def __init__(self, break_epoch_num=6):
        super(myCallback, self).__init__()
        self.epoch_num = 0
        self.break_epoch_num = break_epoch_num

    def epoch_end(self, run_context):
        self.epoch_num += 1
        if self.epoch_num == self.break_epoch_num:
            raise Exception("Some errors happen.")


class LeNet5(nn.SequentialCell):
    # dsim's layers are named (the parameters' names in the checkpoint) and say how they are sliced over the
    # model-parallel ranks; each ReLU and pooling keeps what its backward needs, so every use is its own layer.
    def __init__(self, num_class=10, num_channel=1):
        super(LeNet5, self).__init__()
        self.conv1 = nn.Conv2d("conv1", num_channel, 6, 5)  # pad_mode="valid", replicated
        self.conv2 = nn.Conv2d("conv2", 6, 16, 5, split="column")  # output channels split
        self.fc1 = nn.Dense("fc1", 16 * 5 * 5, 120, "row", weight_init=Normal(0.02))  # input features split
        self.fc2 = nn.Dense("fc2", 120, 84, weight_init=Normal(0.02))
        self.fc3 = nn.Dense("fc3", 84, num_class, weight_init=Normal(0.02))
        self.flatten = nn.Flatten()
        # construct: the layers in the order of the forward pass (backward runs them in reverse)
        self.layers = [self.conv1, nn.ReLU(), nn.MaxPool2d(kernel_size=2),
                       self.conv2, nn.ReLU(), nn.MaxPool2d(kernel_size=2),
                       self.flatten,
                       self.fc1, nn.ReLU(),
                       self.fc2, nn.ReLU(),
                       self.fc3]


net = LeNet5()  # Model initialization
loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")  # Loss function
optim = nn.Momentum(net.trainable_params(), 0.01, 0.9)  # Optimizer
model = Model(net, loss_fn=loss, optimizer=optim)  # Model encapsulation

# User-defined saved data
append_info = ["epoch_num", "step_num", {"lr": 0.01, "momentum": 0.9}]
# One CheckPoint per epoch (the page's sink mode makes a step of each epoch; here a step is a batch)
config_ck = CheckpointConfig(save_checkpoint_epochs=1, append_info=append_info)
# The CheckPoint file is saved with the prefix "lenet" and is saved in "./lenet" path
ckpoint_cb = ModelCheckpoint(prefix='lenet', directory='./lenet', config=config_ck)
loss_cb = LossMonitor(train_dataset.get_dataset_size())  # the loss at each epoch's end

if not args_opt.recover:
    # Simulation program fault. The default is to fail at the end of the 6th epoch
    my_callback = myCallback()
    model.train(args_opt.epochs, train_dataset, callbacks=[ckpoint_cb, my_callback, loss_cb], dataset_sink_mode=True)
else:
    # User-defined script to find the latest CheckPoint file. A checkpoint exists once its commit record
    # <name>.commit does; each rank reads its own slices, rank_<r>/<name>.h5.
    ckpt_path = "./lenet"
    filenames = os.listdir(ckpt_path)
    # Filter all committed CheckPoints
    ckptnames = [ckpt[:-len(".commit")] for ckpt in filenames if ckpt.endswith(".commit")]
    # Sort them from oldest to newest by the global step their record holds (file times can lie)
    ckptnames.sort(key=lambda ckpt: json.load(open(ckpt_path + "/" + ckpt + ".commit"))["global_step"])
    # Get the latest CheckPoint file path of this rank
    ckpt_file = ckpt_path + "/rank_" + str(dsim.get_rank()) + "/" + ckptnames[-1] + ".h5"

    # Load the model parameters into param_dict: the parameters and the user-defined saved data
    param_dict = dsim.load_checkpoint(ckpt_file)
    # The slices exist once the model is built (the layout decides them): build before loading
    model.build(train_dataset=train_dataset, epoch=args_opt.epochs)
    # Load the parameters into the model, and the optimizer's state (momentum, step counter): an exact resume
    dsim.load_param_into_net(net, param_dict)
    dsim.load_param_into_net(optim, param_dict)

    epoch_num = int(param_dict["epoch_num"])
    step_num = int(param_dict["step_num"])
    lr = float(param_dict["lr"])
    momentum = float(param_dict["momentum"])
    if dsim.get_rank() == 0:
        print(f"resuming from {ckpt_file}: epoch_num {epoch_num}, step_num {step_num}, lr {lr}, momentum {momentum}",
              flush=True)

    # Set the epoch for continued training: epoch is the last epoch of training
    model.train(args_opt.epochs, train_dataset, callbacks=[ckpoint_cb, loss_cb], initial_epoch=epoch_num,
                dataset_sink_mode=True)
