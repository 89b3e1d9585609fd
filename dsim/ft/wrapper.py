"""OptTFTWrapper (MindSpore's name): an optimizer that knows how far its current update has got.

Every rank records whether the current step's update has not started, is in progress, or is done, and
keeps a copy of its owned slices (parameters and optimizer state) from before the update. So after a
failure each rank can always offer the state of the last step it finished and of the step before it:
enough for the survivors to find one step that every slice still has (a rank interrupted inside an
update offers only the copy).
"""
from __future__ import annotations

import numpy as np

from .. import aligned

NOT_STARTED, IN_PROGRESS, DONE = "not started", "in progress", "done"


class OptTFTWrapper:
    """Wraps an optimizer (SGD, Momentum, Adam); reads and the step counter pass through to it."""

    def __init__(self, optimizer):
        self.__dict__["optimizer"] = optimizer
        self.__dict__["phase"] = NOT_STARTED
        self.__dict__["previous"] = None        # name -> array: owned state after step previous_step (made once)
        self.__dict__["previous_step"] = None   # None: the copy holds nothing to offer
        self.__dict__["damaged"] = False        # a memory error (UCE) made every copy untrustworthy
        self.__dict__["hit"] = None             # the names of the buffers it damaged (None: unknown, all)
        self.__dict__["partial"] = False        # between an update and its sync: with optimizer shard k > 1,
        # the parameters are then new only in their owned part (sync all-gathers the rest)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.optimizer, name, value)  # e.g. global_step when a checkpoint is loaded

    def owned_arrays(self, whole: bool = False):
        """(name, array) of every owned slice: parameters, then optimizer state. whole: each parameter's whole
        model-parallel slice instead of its owned part (with optimizer shard k > 1, the rest of the slice too)."""
        for p in self.optimizer.params:
            yield p.name, p.data if whole else p.owned_data
        for state_name, _, arr in self.optimizer.state_items():
            yield state_name, arr

    def apply(self, halfway=None) -> None:
        """Keep the current owned state, then update (see Optimizer.apply)."""
        prev = self.previous
        if prev is None:
            prev = {name: np.empty_like(arr) for name, arr in self.owned_arrays()}
        for name, arr in self.owned_arrays():
            np.copyto(prev[name], arr)
        self.__dict__.update(previous=prev, previous_step=self.optimizer.global_step, phase=IN_PROGRESS, partial=True)
        self.optimizer.apply(halfway)
        self.__dict__["phase"] = DONE

    def step(self, shard_comm) -> None:
        self.apply()
        self.sync(shard_comm)

    def sync(self, shard_comm) -> None:
        """The whole parameters from the owned parts (see Optimizer.sync); then they are whole again."""
        self.optimizer.sync(shard_comm)
        self.__dict__["partial"] = False

    def states(self) -> dict:
        """step -> {name: array} of the consistent owned states this rank can offer now (none after a UCE)."""
        out = {}
        if self.damaged:
            return out
        if self.previous_step is not None:
            out[self.previous_step] = self.previous
        if self.phase != IN_PROGRESS:
            out[self.optimizer.global_step] = dict(self.owned_arrays())
        return out

    def invalidate(self, hit=None) -> None:
        """After an uncorrectable memory error: nothing this rank holds may be offered or saved.

        hit: the names of the owned buffers the error damaged (as the hardware reports the failing
        addresses); None when unknown, i.e. every buffer.
        """
        self._discard_copy()
        self.__dict__.update(damaged=True, hit=None if hit is None else set(hit))

    def _discard_copy(self) -> None:
        """Forget the copy from before the update; its buffers hold the next copy (no fresh pages)."""
        self.__dict__["previous_step"] = None

    def intact(self, step: int) -> set:
        """Names of the owned buffers that still hold `step`'s state after a memory error: those it did not
        hit, when the error struck outside an update and the counter is at `step` (else none)."""
        if self.hit is None or self.phase == IN_PROGRESS or self.optimizer.global_step != step:
            return set()
        return {name for name, _ in self.owned_arrays()} - self.hit

    def reallocate(self, keep=()) -> None:
        """"Clean" a damaged rank: throw its parameter and optimizer-state buffers away for new ones, but
        those named in keep (intact: they hold the state being restored)."""
        for p in self.optimizer.params:
            if p.name not in keep:
                p.data = aligned.empty(p.data.shape, p.data.dtype)
        for slot, arrays in self.optimizer.state.items():
            for name, arr in arrays.items():
                if f"{slot}.{name}" not in keep:  # named as state_items names them
                    arrays[name] = aligned.empty(arr.shape, arr.dtype)
        self._discard_copy()
        self.__dict__.update(damaged=True, phase=NOT_STARTED)  # empty until received

    def received(self, step: int) -> None:
        """The whole parameters and the owned state now hold `step`'s, sent by a replica."""
        self.optimizer.global_step = step
        self._discard_copy()
        self.__dict__.update(damaged=False, hit=None, phase=NOT_STARTED, partial=False)

    def restore(self, step: int) -> None:
        """Make the owned slices those of `step` (one of states()); the update of step + 1 is not started."""
        source = self.states()[step]
        for name, arr in self.owned_arrays():
            if source[name] is not arr:
                np.copyto(arr, source[name])
        self.optimizer.global_step = step
        self.__dict__.update(phase=NOT_STARTED)
