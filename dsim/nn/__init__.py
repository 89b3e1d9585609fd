"""Networks, layers and parameters (numpy, hand-written backward); layers declare how they are sliced."""
from .attention import MultiHeadAttention
from .cell import Cell, Sequential
from .conv import Conv2d, Flatten, MaxPool2d
from .embedding import Embedding
from .layers import GELU, Dense, Layer, ReLU, masked_cross_entropy, softmax_cross_entropy
from .initializer import Normal, One, Zero
from .losses import CrossEntropyLoss, SoftmaxCrossEntropyWithLogits
from .lenet import LeNet5
from .models import MODELS, create_network
from .network import ARCHITECTURES, Network
from .norm import LayerNorm
from .parameter import Parameter
from .transformer import Transformer

__all__ = ["MultiHeadAttention", "Cell", "Conv2d", "Flatten", "MaxPool2d", "Embedding", "GELU", "Dense", "Layer",
           "ReLU", "masked_cross_entropy", "softmax_cross_entropy", "LeNet5", "MODELS", "create_network",
           "ARCHITECTURES", "Network", "LayerNorm", "Parameter", "Transformer", "Sequential", "SequentialCell",
           "CrossEntropyLoss", "SoftmaxCrossEntropyWithLogits", "SGD", "Momentum", "Adam", "AdamWeightDecay",
           "OptTFTWrapper", "Normal", "One", "Zero"]

# MindSpore's names: nn.SequentialCell, and the optimizers and their TFT wrapper under nn
SequentialCell = Sequential
from ..optim import SGD, Adam, AdamWeightDecay, Momentum  # noqa: E402
from ..ft.wrapper import OptTFTWrapper  # noqa: E402
