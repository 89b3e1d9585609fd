"""Optimizers and learning-rate schedules."""
from .optimizers import OPTIMIZERS, SGD, Adam, AdamWeightDecay, Momentum, Optimizer, create_optimizer
from .schedule import LRSchedule

__all__ = ["OPTIMIZERS", "SGD", "Adam", "AdamWeightDecay", "Momentum", "Optimizer", "create_optimizer", "LRSchedule"]
