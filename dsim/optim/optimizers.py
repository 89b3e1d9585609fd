"""SGD, Momentum and Adam with MindSpore's update rules, on the slices a rank owns.

With optimizer parallelism each rank updates only its owned 1/k of a parameter (and keeps only that
much optimizer state); the updated weight is then all-gathered over the optimizer-shard group so the
next forward pass sees the whole model-parallel slice.
"""
from __future__ import annotations

import numpy as np

from ..parallel.groups import allgather_axis0
from .schedule import LRSchedule


class Optimizer:
    """Base: owns per-parameter state slots (named like MindSpore's, e.g. `moment1.layer2.weight`)."""

    slots: tuple = ()

    def __init__(self, params, learning_rate: LRSchedule, weight_decay: float = 0.0):
        self.params = list(params)
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.global_step = 0
        self.state = {slot: {p.name: np.zeros(p.owned.extents, dtype=p.data.dtype) for p in self.params}
                      for slot in self.slots}

    def current_lr(self) -> float:
        return self.learning_rate(self.global_step)

    def step(self, shard_comm) -> None:
        """Apply the gradients in p.grad (already averaged over dp) to the owned slices, then share them."""
        self.apply()
        self.sync(shard_comm)

    def apply(self, halfway=None) -> None:
        """Update the owned slices and their state (local: no communication); counts the step.

        `halfway`, if given, is called after half the parameters are updated (a fault point).
        """
        lr = self.current_lr()
        for i, p in enumerate(self.params):
            if halfway is not None and i == len(self.params) // 2:
                halfway()
            w = p.owned_data
            g = p.grad[p.owned_index]
            if self.weight_decay:
                g = g + w.dtype.type(self.weight_decay) * w
            self.update(p.name, w, g, lr)
        self.global_step += 1

    def sync(self, shard_comm) -> None:
        """All-gather updated owned slices over the optimizer-shard group into the whole mp slices."""
        for p in self.params:
            if p.opt_sharded:
                p.data[...] = allgather_axis0(shard_comm, np.ascontiguousarray(p.owned_data))

    def update(self, name, w, g, lr) -> None:
        raise NotImplementedError

    def state_items(self):
        """(state name, parameter name, array) for every state slice this rank owns."""
        for slot in self.slots:
            for name, arr in self.state[slot].items():
                yield f"{slot}.{name}", name, arr

    def hyperparams(self) -> dict:
        return {"weight_decay": self.weight_decay}


class SGD(Optimizer):
    """p -= lr * g."""

    name = "sgd"

    def update(self, name, w, g, lr):
        w -= w.dtype.type(lr) * g


class Momentum(Optimizer):
    """MindSpore's ApplyMomentum: v = momentum * v + g; p -= lr * v."""

    name = "momentum"
    slots = ("moments",)

    def __init__(self, params, learning_rate, momentum=0.9, weight_decay=0.0):
        self.momentum = momentum
        super().__init__(params, learning_rate, weight_decay)

    def update(self, name, w, g, lr):
        v = self.state["moments"][name]
        v *= v.dtype.type(self.momentum)
        v += g
        w -= w.dtype.type(lr) * v

    def hyperparams(self):
        return {**super().hyperparams(), "momentum": self.momentum}


class Adam(Optimizer):
    """Adam as MindSpore's nn.Adam: bias correction folded into the step size."""

    name = "adam"
    slots = ("moment1", "moment2")

    def __init__(self, params, learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        super().__init__(params, learning_rate, weight_decay)

    def moments(self, name, g, dt):
        """Update and return the first and second moments of a parameter in place."""
        m, v = self.state["moment1"][name], self.state["moment2"][name]
        m *= dt(self.beta1)
        m += dt(1 - self.beta1) * g
        v *= dt(self.beta2)
        v += dt(1 - self.beta2) * g * g
        return m, v

    def update(self, name, w, g, lr):
        t = self.global_step + 1
        dt = w.dtype.type
        m, v = self.moments(name, g, dt)
        lr_t = lr * (1 - self.beta2 ** t) ** 0.5 / (1 - self.beta1 ** t)
        w -= dt(lr_t) * m / (np.sqrt(v) + dt(self.eps))

    def hyperparams(self):
        return {**super().hyperparams(), "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}


def decays(name: str) -> bool:
    """MindSpore's decay-group rule (the distributed page's set_weight_decay): not LayerNorm, not biases."""
    return "layernorm" not in name.lower() and "bias" not in name.lower()


class AdamWeightDecay(Adam):
    """MindSpore's nn.AdamWeightDecay: Adam without bias correction, decoupled weight decay.

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  u = m / (sqrt(v) + eps) + wd * p (decay group only);
    p -= lr * u. The decay group follows the sample's rule (`decays`): every parameter but LayerNorm's
    and the biases.
    """

    name = "adamweightdecay"

    def __init__(self, params, learning_rate, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0):
        self.decay = weight_decay
        super().__init__(params, learning_rate, beta1, beta2, eps, 0.0)  # decoupled: not added to the gradient
        self.decay_group = {p.name for p in self.params if decays(p.name)}

    def update(self, name, w, g, lr):
        dt = w.dtype.type
        m, v = self.moments(name, g, dt)
        update = m / (np.sqrt(v) + dt(self.eps))
        if self.decay and name in self.decay_group:
            update += dt(self.decay) * w
        w -= dt(lr) * update

    def hyperparams(self):
        return {"weight_decay": self.decay, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "adamweightdecay": AdamWeightDecay}


def create_optimizer(name: str, params, schedule: LRSchedule, **kwargs) -> Optimizer:
    """An optimizer by config name ('sgd', 'momentum', 'adam', 'adamweightdecay')."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer.name {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, schedule, **kwargs)
