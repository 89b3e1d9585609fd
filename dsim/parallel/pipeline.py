"""Pipeline parallel: a step's micro-batches through the stages, 1F1B or GPipe.

The layout (dsim.parallel.layout) cuts the world into p stages of dp x mp ranks; the network
(Cell.pipeline_units, unit_stages) says which units each stage runs. A step splits every rank's part of
the global batch into m micro-batches. A stage receives a micro-batch's activations from the rank with its
dp and mp indices in the stage before, runs its units, and sends the result to that rank of the stage after;
gradients travel back the same way. The last stage takes the loss of each micro-batch as its share of the
global-batch mean, so the gradients, summed over micro-batches here and over dp afterwards (in the gradient
buckets, once per step), are those of the whole batch.

Schedules (`parallel.pipeline_schedule`), the order of a stage's forwards (F) and backwards (B):
- "1f1b" (MindSpore's, PipeDream-Flush): p - 1 - stage forwards to fill the pipe, then one forward and one
  backward in turn, then the remaining backwards; at most p micro-batches in flight per stage;
- "gpipe": all m forwards, then all m backwards.
Both give the same sums. Sends are non-blocking and receives blocking, in schedule order, which cannot
deadlock; every message is tagged with its micro-batch and direction. A unit keeps a micro-batch's
activations in its layers; when another micro-batch's forward runs before its backward they are set aside
(references, no copies) and put back for the backward.
"""
from __future__ import annotations

import numpy as np

from ..runtime import PROCESS

SCHEDULES = ("1f1b", "gpipe")


def schedule(name: str, stages: int, stage: int, micro: int) -> list:
    """The ordered ("F" | "B", micro-batch) operations of one stage."""
    if name == "gpipe":
        return [("F", j) for j in range(micro)] + [("B", j) for j in range(micro)]
    if name != "1f1b":
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    warm = min(stages - stage - 1, micro)
    ops = [("F", j) for j in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", j) for j in range(micro - warm, micro)]


def bubble_fraction(stages: int, micro: int) -> float:
    """The ideal idle fraction of a synchronous pipeline: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro + stages - 1)


def micro_batches(batch, micro: int) -> list:
    """The batch (an array or a tuple of arrays, samples on axis 0) as `micro` consecutive views."""
    if isinstance(batch, tuple):
        return list(zip(*(micro_batches(b, micro) for b in batch)))
    n = batch.shape[0] // micro
    return [batch[j * n:(j + 1) * n] for j in range(micro)]


def _state(layers) -> list:
    """What the layers keep for backward (their private attributes), as references."""
    return [(layer, {k: v for k, v in vars(layer).items() if k.startswith("_") and k not in ("_grad", "_bound")})
            for layer in layers]


def _restore(state) -> None:
    for layer, saved in state:
        vars(layer).update(saved)


class Pipeline:
    """One rank's part of pipelined steps: its stage's units, the schedule, the gradient accumulator."""

    def __init__(self, network, layout, rank: int, micro: int, schedule_name: str = "1f1b", runtime=PROCESS):
        from ..nn.cell import _reachable
        self.runtime = runtime  # the process's (dsim.runtime): its waits marked, its first dp sum watched
        c = layout.coords(rank)
        units = network.pipeline_units()
        stages = network.unit_stages(layout.pipeline_stage) if layout.pipeline_stage > 1 else [0] * len(units)
        self.network, self.micro, self.schedule_name = network, micro, schedule_name
        self.stages, self.stage = layout.pipeline_stage, c.stage
        self.units = [u for u, s in zip(units, stages) if s == c.stage]
        self.first, self.last = c.stage == 0, c.stage == layout.pipeline_stage - 1
        self.previous = layout.neighbour(rank, -1) if not self.first else None
        self.next = layout.neighbour(rank, +1) if not self.last else None
        self.ops = schedule(schedule_name, layout.pipeline_stage, c.stage, micro)
        self.stateful = _reachable([layer for u in self.units for layer in u.layers])
        self._accumulated = None   # the sum of the micro-batches' gradients so far (one buffer, reused)
        self._loss = np.zeros(1)

    def run(self, world, mp_comm, dp_comm, inputs, labels, grads: np.ndarray, global_batch_size: int,
            halfway=None) -> float:
        """The forwards and backwards of one step's micro-batches on this stage; `grads` (the gradient
        buffer the layers write into) holds their sum afterwards. Returns this rank's share of the loss
        (the last stage's; 0 elsewhere). `halfway` is called after the first forward (a fault point)."""
        xs, ys = micro_batches(inputs, self.micro), micro_batches(labels, self.micro)
        denominator = None
        if self.last:
            with self.runtime.before_forward():
                denominator = self.network.loss_denominator(inputs, labels, global_batch_size, dp_comm)
        kept, douts, requests, loss, done = {}, {}, [], 0.0, 0
        for op, j in self.ops:
            if op == "F":
                x = self.network.prepare(xs[j]) if self.first else self._receive(world, self.previous, 2 * j)
                for unit in self.units:
                    x = unit.forward(x, xs[j], mp_comm)
                if self.last:
                    part, douts[j] = self.network.micro_loss(x, xs[j], ys[j], denominator)
                    loss += float(part)
                else:
                    requests.append(world.isend(x, dest=self.next, tag=2 * j))
                kept[j] = _state(self.stateful)
                if halfway is not None and j == 0:
                    halfway()
            else:
                dy = douts.pop(j) if self.last else self._receive(world, self.next, 2 * j + 1)
                _restore(kept.pop(j))
                for i in range(len(self.units) - 1, -1, -1):
                    dy = self.units[i].backward(dy, mp_comm, need_dx=not (self.first and i == 0))
                if not self.first:
                    requests.append(world.isend(dy, dest=self.previous, tag=2 * j + 1))
                self._accumulate(grads, done)
                done += 1
        self.runtime.collective(_wait_all, requests)
        return loss

    def _receive(self, world, source: int, tag: int):
        """The activation or gradient the neighbouring stage sends (waiting for it is waiting in a collective)."""
        return self.runtime.collective(world.recv, source=source, tag=tag)

    def _accumulate(self, grads: np.ndarray, done: int) -> None:
        """Add the micro-batch just done (in grads) to the sum; after the last, grads holds the sum."""
        if self.micro == 1:
            return
        if self._accumulated is None or self._accumulated.shape != grads.shape or self._accumulated.dtype != grads.dtype:
            self._accumulated = np.empty_like(grads)
        if done == 0:
            np.copyto(self._accumulated, grads)
        elif done < self.micro - 1:
            self._accumulated += grads
        else:
            grads += self._accumulated

    def share_loss(self, world, loss: float) -> float:
        """The step's loss (known on the last stage after the dp reduction) on every rank."""
        if self.stages == 1:
            return loss
        from mpi4py import MPI
        self._loss[0] = loss
        root = (self.stages - 1) * (world.size // self.stages)
        self.runtime.collective(world.Bcast, [self._loss, MPI.DOUBLE], root=root)
        return float(self._loss[0])


def _wait_all(requests) -> None:
    """Wait for each of the sends of a step's activations and gradients, in turn."""
    for r in requests:
        r.wait()
