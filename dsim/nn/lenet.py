"""LeNet5, the fault-recovery page's network, on 32x32 single-channel images.

Conv2d(1->6, 5x5, valid), ReLU, MaxPool 2x2, Conv2d(6->16, 5x5), ReLU, MaxPool, Flatten,
Dense 400->120, ReLU, Dense 120->84, ReLU, Dense 84->10.

Initial values as the page's MindSpore (r2.1) version: the page sets Normal(0.02) on the Dense weights only; the
rest keep MindSpore's defaults, HeUniform(negative_slope=sqrt(5)) for the convolutions (uniform within
+-1/sqrt(fan_in), fan_in = in_channels x 5 x 5: 25 and 150) and Uniform(1/sqrt(fan_in)) for the Dense biases
(fan_in 400, 120, 84); the convolutions have no bias (has_bias=False, their default).

Model parallel: conv1 is replicated (6 channels, tiny); conv2 splits its 16 output channels over mp, so
after pooling and the channel-major flatten each rank holds a contiguous block of the 400 features, which
fc1 takes row-split (one all-reduce); fc2 and fc3 are replicated. mp must divide 16.
"""
from __future__ import annotations

from ..parallel.layout import LayoutError
from .cell import Sequential
from .conv import Conv2d, Flatten, MaxPool2d
from .layers import Dense, ReLU

NORMAL = ("normal", 0.02)


class LeNet5(Sequential):
    """LeNet5 as on the page (num_class 10, num_channel 1)."""

    image_size = 32

    def __init__(self, num_class=10, num_channel=1):
        super().__init__()
        self.layers = [
            Conv2d("conv1", num_channel, 6, 5), ReLU(), MaxPool2d(2),
            Conv2d("conv2", 6, 16, 5, split="column"), ReLU(), MaxPool2d(2), Flatten(),
            Dense("fc1", 16 * 5 * 5, 120, "row", weight_init=NORMAL), ReLU(),
            Dense("fc2", 120, 84, weight_init=NORMAL), ReLU(),
            Dense("fc3", 84, num_class, weight_init=NORMAL),
        ]

    def check(self, layout):
        if 16 % layout.model_parallel:
            raise LayoutError(f"lenet5: conv2's 16 output channels are not divisible by "
                              f"model_parallel={layout.model_parallel}")
        super().check(layout)

    def describe(self) -> str:
        return "conv6-conv16-120-84-10"
