"""Which sample indices each data-parallel replica reads at each (epoch, step).

The global batch of a step does not depend on the number of replicas: replicas take contiguous,
rank-ordered slices of it. So a run with dp replicas sees exactly the samples of a single-process run
with the same global batch, and a resumed run picks up at any (epoch, step) without replaying. When the
replicas do not divide the batch (e.g. 32 over 3 after an elastic resize) the first ones take one sample
more: losses and gradients are sums over the global batch divided by its size, so nothing else changes.
"""
from __future__ import annotations

import numpy as np

from .errors import DatasetError


class DistributedSampler:
    """Per-epoch permutations cut into global batches, each split across `num_replicas` ranks."""

    def __init__(self, num_samples: int, global_batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0):
        n, B, R = int(num_samples), int(global_batch_size), int(num_replicas)
        if R < 1:
            raise DatasetError(f"num_replicas must be >= 1, got {R}")
        if not 0 <= int(rank) < R:
            raise DatasetError(f"rank {rank} out of range for {R} replicas")
        if B < R:
            raise DatasetError(f"global batch size {B} is smaller than the {R} replicas")
        if n < B:
            raise DatasetError(f"num_samples {n} is smaller than the global batch size {B}")
        if int(seed) < 0:
            raise DatasetError(f"sampler seed must be >= 0, got {seed}")
        self.num_samples, self.global_batch_size = n, B
        self.num_replicas, self.rank = R, int(rank)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        base, extra = divmod(B, R)
        self.local_batch_size = base + (1 if self.rank < extra else 0)
        self._start = self.rank * base + min(self.rank, extra)   # this replica's first sample in a batch
        self._cached_epoch, self._cached_perm = None, None

    def __repr__(self) -> str:
        return (f"DistributedSampler(num_samples={self.num_samples}, global_batch_size="
                f"{self.global_batch_size}, num_replicas={self.num_replicas}, rank={self.rank}, "
                f"shuffle={self.shuffle}, seed={self.seed})")

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch; the last partial batch is dropped."""
        return self.num_samples // self.global_batch_size

    def permutation(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the samples (identity without shuffle)."""
        if epoch < 0:
            raise DatasetError(f"epoch must be >= 0, got {epoch}")
        # every step of an epoch needs the same permutation: keep the last one
        if self._cached_epoch != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            self._cached_epoch, self._cached_perm = epoch, perm.astype(np.int64)
        return self._cached_perm

    def global_batch(self, epoch: int, step: int) -> np.ndarray:
        """All sample indices of global batch (epoch, step), both 0-based."""
        if not 0 <= step < self.steps_per_epoch:
            raise DatasetError(f"step {step} out of range [0, {self.steps_per_epoch})")
        B = self.global_batch_size
        return self.permutation(epoch)[step * B:(step + 1) * B].copy()

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """This replica's contiguous slice of global batch (epoch, step)."""
        return self.global_batch(epoch, step)[self._start:self._start + self.local_batch_size]

    def iterate(self, start_epoch: int = 0, start_step: int = 0, end_epoch: int | None = None):
        """Yield (epoch, step, indices) from (start_epoch, start_step) through epoch end_epoch - 1.

        end_epoch=None never stops. Resuming mid-epoch gives exactly the tail of a full iteration.
        """
        if not 0 <= start_step < self.steps_per_epoch:
            raise DatasetError(f"start_step {start_step} out of range [0, {self.steps_per_epoch})")
        if start_epoch < 0:
            raise DatasetError(f"start_epoch must be >= 0, got {start_epoch}")
        # checked above rather than in the generator, so a bad resume point fails at the call
        return self._iterate(int(start_epoch), int(start_step), end_epoch)

    def _iterate(self, epoch: int, step: int, end_epoch: int | None):
        while end_epoch is None or epoch < end_epoch:
            for s in range(step, self.steps_per_epoch):
                yield epoch, s, self.batch_indices(epoch, s)
            epoch, step = epoch + 1, 0
