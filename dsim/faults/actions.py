"""What each kind of fault does to the rank it strikes: one dispatch, `strike`, over the kinds, for the configured
fault (dsim.faults.injector) and a fault plan's entries (dsim.faults.plan) alike.

The primitives (kill, freeze, stall, wait_for_nothing, slow_down, flip_bit, corrupt) are also what a second failure
inside the last gasp or a repair does (dsim.faults.injector).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import numpy as np

from ..log import say
from ..parallel import progress
from ..runtime import PROCESS


class InjectedFault(Exception):
    """The simulated failure ("Some errors happen.")."""


class UCEError(RuntimeError):
    """An uncorrectable memory error (UCE) reported by the device: this rank's training state is garbage."""

    def __init__(self, rank: int, where: str, damaged: list):
        self.rank, self.damaged = rank, damaged
        super().__init__(f"UCE: uncorrectable memory error on rank {rank} {where} "
                         f"({len(damaged)} buffers of parameters and optimizer state damaged)")


def corrupt(optimizer, seed: int) -> list:
    """Turn half of the owned parameter and optimizer-state buffers into garbage; returns their names."""
    rng = np.random.default_rng(seed)
    arrays = [(p.name, p.data) for p in optimizer.params] + [(n, a) for n, _, a in optimizer.state_items()]
    hit = arrays[::2]
    for _, arr in hit:
        garble(arr, rng)
    names = [name for name, _ in hit]
    if hasattr(optimizer, "invalidate"):
        optimizer.invalidate(names)
    return names


GARBAGE_BLOCK = 1 << 16  # bytes of random garbage, repeated over a damaged buffer


def garble(arr: np.ndarray, rng) -> None:
    """Overwrite every byte of arr with random garbage, a 64 KiB random block repeated (as fast as a copy:
    the fault is the hardware's, its simulation must not add seconds to the time a repair is charged with)."""
    if not arr.flags.c_contiguous:
        arr.view(np.uint8)[...] = rng.integers(0, 256, size=arr.nbytes, dtype=np.uint8).reshape(arr.view(np.uint8).shape)
        return
    flat = arr.reshape(-1).view(np.uint8)
    block = rng.integers(0, 256, size=min(flat.size, GARBAGE_BLOCK), dtype=np.uint8)
    whole = flat.size // block.size * block.size
    flat[:whole].reshape(-1, block.size)[...] = block
    flat[whole:] = block[:flat.size - whole]


def kill(message: str) -> None:
    """Say why and SIGKILL this process (no clean-up, as a real crash)."""
    say(message)
    os.kill(os.getpid(), signal.SIGKILL)


def slow_down(rank: int, slowdown: float, where: str) -> None:
    """This process computes `slowdown` times slower for the rest of its life (dsim.parallel.progress.pace): a
    straggler, found by tft.straggler_factor's watch."""
    say(f"dsim: fault: rank {rank} computes {slowdown:g}x slower from now on {where}")
    progress.slowdown = slowdown


def flip_bit(optimizer, seed: int) -> str:
    """Flip one bit of one parameter of this rank (drawn from seed), as a memory cell that fails silently would;
    returns what it hit ("layer2.param, element 1234, bit 30")."""
    rng = np.random.default_rng([seed, 31])
    p = optimizer.params[int(rng.integers(len(optimizer.params)))]
    flat = p.data.reshape(-1)
    i, bit = int(rng.integers(flat.size)), int(rng.integers(flat.dtype.itemsize * 8))
    word = flat[i:i + 1].view(np.uint32 if flat.dtype.itemsize == 4 else np.uint64)
    word ^= word.dtype.type(1) << word.dtype.type(bit)
    return f"{p.name}, element {i}, bit {bit}"


def freeze(message: str) -> None:
    """Say why and SIGSTOP this process: every thread stops, nothing fails; a hang, until something kills it
    (tft.hang_timeout: dsim.ft.hang)."""
    say(message)
    os.kill(os.getpid(), signal.SIGSTOP)


def stall(message: str) -> None:
    """Say why and never return: the main thread waits for ever while every other thread of the process runs (a
    deadlock, a read from a dead file system), until something kills the process (tft.hang_timeout: dsim.ft.hang)."""
    say(message)
    while True:
        time.sleep(3600)


def wait_for_nothing(rank: int, where: str, world=None) -> None:
    """Say so and wait, as in a collective, for a message that never comes: on MPI_COMM_SELF, where no failure or
    revoke elsewhere ends it; or, given the job's `world`, a receive no rank matches there (a revoke of the world
    ends it). The others wait for this rank in their next collective, and nobody computes (a deadlock, which
    tft.hang_timeout's watch breaks: dsim.ft.hang)."""
    from mpi4py import MPI
    comm, source, on = (MPI.COMM_SELF, 0, "") if world is None else (world, MPI.ANY_SOURCE, ", on the job's world,")
    say(f"dsim: fault: rank {rank} waits for a message no rank sends{on} {where}")
    PROCESS.collective(comm.Recv, np.empty(1, np.uint8), source=source, tag=0xDEAD)


@dataclass
class Strike:
    """One fault striking this rank: its kind, the rank, where (the words its lines end with), the point it strikes
    at (a UCE repaired in place is told it), the seed of the bit an sdc flips, how many times slower a slow rank
    computes, and the training it acts on: `target`, with .optimizer, .in_place (None: no repair in place) and
    .model (its groups' world, for unmatched)."""
    kind: str
    rank: int
    where: str
    point: str
    seed: int
    slowdown: float
    target: object


def _exception(s: Strike) -> None:
    raise InjectedFault(f"Some errors happen. (injected on rank {s.rank} {s.where})")


def _kill(s: Strike) -> None:
    kill(f"dsim: fault: killing rank {s.rank} (SIGKILL) {s.where}")


def _corrupt(s: Strike) -> None:  # the campaign damages the rank's newest file on disk; the rank dies here
    kill(f"dsim: fault: killing rank {s.rank} (SIGKILL) {s.where} (its newest shard on disk is damaged too)")


def _hang(s: Strike) -> None:
    freeze(f"dsim: fault: rank {s.rank} stops (SIGSTOP) {s.where}")  # continued (SIGCONT): the step goes on


def _stuck(s: Strike) -> None:
    stall(f"dsim: fault: rank {s.rank} is stuck (its training stops, its process runs) {s.where}")


def _deadlock(s: Strike) -> None:
    wait_for_nothing(s.rank, s.where)


def _unmatched(s: Strike) -> None:
    wait_for_nothing(s.rank, s.where, s.target.model.groups.world)


def _slow(s: Strike) -> None:
    slow_down(s.rank, s.slowdown, s.where)


def _sdc(s: Strike) -> None:  # nothing reports it: training goes on
    say(f"dsim: fault: rank {s.rank}: a bit of {flip_bit(s.target.optimizer, s.seed)} flips, silently, {s.where}")


def _uce(s: Strike) -> None:
    error = UCEError(s.rank, s.where, corrupt(s.target.optimizer, s.rank))
    say(f"dsim: fault: {error}")
    if s.target.in_place is not None and s.target.in_place.repair(error, s.point):
        return  # repaired from a replica: the step goes on (dsim.ft.in_place)
    raise error


# kind -> what it does; a node failure is the victim's kill (its plan has SIGKILLed its node-mates first)
ACTIONS = {"exception": _exception, "kill": _kill, "corrupt": _corrupt, "node": _kill, "hang": _hang, "stuck": _stuck,
           "deadlock": _deadlock, "unmatched": _unmatched, "slow": _slow, "sdc": _sdc, "uce": _uce}


def strike(s: Strike) -> None:
    """Do what a fault of kind s.kind does to this rank: return when training goes on (hang once continued, slow,
    sdc, a UCE repaired in place), raise (exception, uce), or never return (kill, stuck; deadlock and unmatched
    end in the hang watch's kill or revoke)."""
    ACTIONS[s.kind](s)
