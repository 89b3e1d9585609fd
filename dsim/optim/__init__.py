"""Optimizers and learning-rate schedules."""
from .optimizers import SGD, Adam, Momentum, Optimizer, create_optimizer
from .schedule import LRSchedule

__all__ = ["SGD", "Adam", "Momentum", "Optimizer", "create_optimizer", "LRSchedule"]
