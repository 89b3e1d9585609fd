"""A dataset as a training loop consumes it: this data-parallel rank's batches, from any position."""
from __future__ import annotations

from .sampler import DistributedSampler


class DataLoader:
    """Batches of `source` for one dp rank; epochs may be cut to `steps_per_epoch`.

    `set_init_step(n)` starts the next iteration at global step n (MindSpore's dataset.set_init_step),
    which is how a resumed run continues mid-epoch on exactly the batch that comes next.
    """

    def __init__(self, source, sampler: DistributedSampler, steps_per_epoch=None):
        self.source = source
        self.sampler = sampler
        full = sampler.steps_per_epoch
        self.steps_per_epoch = full if steps_per_epoch is None else min(steps_per_epoch, full)
        self.init_step = 0

    def get_dataset_size(self) -> int:
        """Steps per epoch (MindSpore's name)."""
        return self.steps_per_epoch

    def set_init_step(self, global_step: int) -> None:
        self.init_step = global_step

    def position(self, global_step: int):
        """(epoch, step in epoch), both 0-based, of a global step."""
        return divmod(global_step, self.steps_per_epoch)

    def batches(self, end_epoch: int):
        """Yield (epoch, step, images, labels) from init_step through the end of epoch end_epoch - 1."""
        epoch, step = self.position(self.init_step)
        while epoch < end_epoch:
            idx = self.sampler.batch_indices(epoch, step)
            images, labels = self.source.get(idx)
            yield epoch, step, images, labels
            step += 1
            if step == self.steps_per_epoch:
                epoch, step = epoch + 1, 0
