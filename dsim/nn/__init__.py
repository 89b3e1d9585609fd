"""Networks, layers and parameters (numpy, hand-written backward)."""
from .layers import Dense, ReLU, softmax_cross_entropy
from .network import ARCHITECTURES, Network, create_network
from .parameter import Parameter

__all__ = ["Dense", "ReLU", "softmax_cross_entropy", "ARCHITECTURES", "Network", "create_network", "Parameter"]
