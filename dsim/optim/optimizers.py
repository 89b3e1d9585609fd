"""SGD, Momentum and Adam with MindSpore's update rules, on the slices a rank owns.

With optimizer parallelism each rank updates only its owned 1/k of a parameter (and keeps only that
much optimizer state); the updated weight is then all-gathered over the optimizer-shard group so the
next forward pass sees the whole model-parallel slice.
"""
from __future__ import annotations

import time

import numpy as np

from .. import aligned
from ..parallel import progress
from ..parallel.groups import allgather_axis0_inplace
from .schedule import LRSchedule


CHUNK = 1 << 16  # elements per block of an update: a block's temporaries stay in cache, none is parameter-sized


class Optimizer:
    """Base: owns per-parameter state slots (named like MindSpore's, e.g. `moment1.layer2.weight`).

    An update is elementwise, so apply() runs it block by block (CHUNK elements) over flat views of the
    weight, its gradient and its state: the temporaries of a block are two small reused buffers, the
    results are the same bits as a whole-array update, and nothing parameter-sized is allocated.
    """

    slots: tuple = ()

    def __init__(self, params, learning_rate, weight_decay: float = 0.0):
        self.learning_rate = learning_rate if isinstance(learning_rate, LRSchedule) else LRSchedule(float(learning_rate))
        self.weight_decay = weight_decay
        self.global_step = 0
        self._scratch = {}  # dtype -> two CHUNK-sized temporaries
        self._holds = []    # events to wait for before the next update changes the arrays (hold_until)
        self.held = []      # seconds each held update waited (an async save's staging not done yet)
        self.bind(params)

    def bind(self, params) -> None:
        """Update these parameters (this rank's slices), with zero state for each.

        A script builds its optimizer as MindSpore's do, from `net.trainable_params()`, which is empty until
        the model is built (the layout decides the slices); Model.build then binds the built ones.
        """
        self.params = list(params)
        self.state = {slot: {p.name: aligned.zeros(p.owned.extents, p.data.dtype) for p in self.params}
                      for slot in self.slots}

    def hold_until(self, event) -> None:
        """The next update waits until event is set: something reads the owned arrays meanwhile (an async
        save copying them into its snapshot while the next step's forward and backward run)."""
        self._holds.append(event)

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
        if self._holds:  # a reader of the arrays not done yet (an async save's snapshot copy)
            t0 = time.perf_counter()
            while self._holds:  # not a wait for another rank: the writer's progress (a tensor staged) is ours
                self._holds.pop().wait()
            self.held.append(time.perf_counter() - t0)
        lr = self.current_lr()
        for i, p in enumerate(self.params):
            if halfway is not None and i == len(self.params) // 2:
                halfway()
            progress.pace()
            progress.tick()  # a parameter's update is progress (tft.hang_timeout tells it from a stuck rank)
            w = p.owned_data.reshape(-1)             # owned parts are whole rows: contiguous views
            g = p.grad[p.owned_index].reshape(-1)
            state = [self.state[slot][p.name].reshape(-1) for slot in self.slots]
            tmp = self._scratch.get(w.dtype)
            if tmp is None:
                tmp = self._scratch[w.dtype] = (np.empty(CHUNK, w.dtype), np.empty(CHUNK, w.dtype))
            for a in range(0, w.size, CHUNK):
                b = min(w.size, a + CHUNK)
                t1, t2 = tmp[0][:b - a], tmp[1][:b - a]
                gb = g[a:b]
                if self.weight_decay:  # g + wd * w, in the second temporary (updates use it last)
                    gb = np.add(gb, np.multiply(w[a:b], w.dtype.type(self.weight_decay), out=t2), out=t2)
                self.update(p.name, w[a:b], gb, lr, [s[a:b] for s in state], t1, t2)
        self.global_step += 1

    def sync(self, shard_comm) -> None:
        """All-gather updated owned slices over the optimizer-shard group into the whole mp slices, in place."""
        for p in self.params:
            if p.opt_sharded:
                allgather_axis0_inplace(shard_comm, p.data)

    def update(self, name, w, g, lr, state, t1, t2) -> None:
        """Update w (a block of a weight) in place from g; state: the same block of each slot; t1, t2:
        temporaries of that size (t2 may be g itself: read it before writing t2)."""
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

    def update(self, name, w, g, lr, state, t1, t2):
        w -= np.multiply(g, w.dtype.type(lr), out=t1)


class Momentum(Optimizer):
    """MindSpore's ApplyMomentum: v = momentum * v + g; p -= lr * v."""

    name = "momentum"
    slots = ("moments",)

    def __init__(self, params, learning_rate, momentum=0.9, weight_decay=0.0):
        self.momentum = momentum
        super().__init__(params, learning_rate, weight_decay)

    def update(self, name, w, g, lr, state, t1, t2):
        (v,) = state
        v *= v.dtype.type(self.momentum)
        v += g
        w -= np.multiply(v, w.dtype.type(lr), out=t1)

    def hyperparams(self):
        return {**super().hyperparams(), "momentum": self.momentum}


class Adam(Optimizer):
    """Adam as MindSpore's nn.Adam: bias correction folded into the step size."""

    name = "adam"
    slots = ("moment1", "moment2")

    def __init__(self, params, learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        super().__init__(params, learning_rate, weight_decay)

    def moments(self, state, g, dt, t):
        """Update and return the first and second moments in place (t: a temporary, not g)."""
        m, v = state
        m *= dt(self.beta1)
        m += np.multiply(g, dt(1 - self.beta1), out=t)
        v *= dt(self.beta2)
        np.multiply(g, dt(1 - self.beta2), out=t)
        t *= g
        v += t
        return m, v

    def update(self, name, w, g, lr, state, t1, t2):
        step = self.global_step + 1
        dt = w.dtype.type
        m, v = self.moments(state, g, dt, t1)
        lr_t = lr * (1 - self.beta2 ** step) ** 0.5 / (1 - self.beta1 ** step)
        np.multiply(m, dt(lr_t), out=t1)         # lr_t * m / (sqrt(v) + eps)
        np.sqrt(v, out=t2)
        t2 += dt(self.eps)
        t1 /= t2
        w -= t1

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

    def update(self, name, w, g, lr, state, t1, t2):
        dt = w.dtype.type
        m, v = self.moments(state, g, dt, t1)
        np.sqrt(v, out=t1)                       # u = m / (sqrt(v) + eps) [+ decay * w]
        t1 += dt(self.eps)
        np.divide(m, t1, out=t1)
        if self.decay and name in self.decay_group:
            t1 += np.multiply(w, dt(self.decay), out=t2)
        t1 *= dt(lr)
        w -= t1

    def hyperparams(self):
        return {"weight_decay": self.decay, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}


OPTIMIZERS = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "adamweightdecay": AdamWeightDecay}


def create_optimizer(name: str, params, schedule: LRSchedule, **kwargs) -> Optimizer:
    """An optimizer by config name ('sgd', 'momentum', 'adam', 'adamweightdecay')."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer.name {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, schedule, **kwargs)
