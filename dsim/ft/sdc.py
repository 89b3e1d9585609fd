"""Silent data corruption of the training state, found by comparing replicas (`tft.sdc_check_every: N`).

A UCE is a memory error the device reports (`fault.kind: uce`); a *silent* one is not: a bit of a parameter
or of the optimizer state flips (`fault.kind: sdc`) and training goes on with it, and so does every
checkpoint after it. Data-parallel replicas hold the same bits by construction (every reduction is
deterministic and identical on every rank of a group: dsim.parallel.groups), so a replica that differs
is damaged. Every N steps, and before every checkpoint is saved (none is committed with a damaged replica),
each rank computes the CRC-32 of every parameter and optimizer-state slice it holds; its data-parallel
group gathers them and compares the holders of each slice (a parameter: every rank of the group; a slice of
the optimizer state: the ranks of the group with the same shard index). With three holders or more the odd
one out is the damaged one; with two, either may be. One all-reduce tells every rank whether any group
found one; then every rank stops (SilentCorruption), the job writes no last gasp (its newest state is the
damaged one) and exits 1 with one line naming the ranks and tensors: the resume goes back to the newest
committed checkpoint, which was checked before it was saved. With optimizer shard k = dp no slice of the
optimizer state has a second holder: only the parameters are compared.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np

from ..engine.callbacks import Callback
from ..log import event, say
from ..parallel import progress

class SilentCorruption(RuntimeError):
    """Replicas that must be bit-identical differ: raised on every rank, after they all agreed."""

    RESUME = ("no last gasp (the newest state is the damaged one): resume (--resume auto) from the newest committed "
              "checkpoint, checked before it was saved")

    def __init__(self, step: int, found: list, then: str = RESUME):
        self.step, self.found = step, found
        super().__init__(f"silent data corruption found at step {step}: {describe(found)}; {then}")


class SdcCheck(Callback):
    """Compare the replicas every `every` steps (None: only before saves) and before every save."""

    def __init__(self, every: Optional[int]):
        self.every = every
        self.checked = None  # the step last checked

    def recovered(self, run_context):
        self.checked = None  # a step trained again (after a rollback) is checked again

    def step_end(self, run_context):
        cb = run_context.original_args()
        if self.every and cb.cur_step_num % self.every == 0:
            self.check(cb)

    def check(self, cb) -> None:
        """Collective over the world: raise SilentCorruption on every rank when replicas differ anywhere. Its
        progress is watched as a step's is (tft.hang_timeout: dsim.parallel.progress)."""
        if self.checked == cb.cur_step_num:
            return
        self.checked = cb.cur_step_num
        with cb.model.groups.runtime.progress.watched("comparison"):
            self._check(cb)

    def _check(self, cb) -> None:
        groups = cb.model.groups
        collective = groups.runtime.collective
        from mpi4py import MPI
        mine = (groups.rank, groups.coords.shard, digests(cb.optimizer))
        found = differing(collective(groups.dp.allgather, mine))
        anywhere = np.array([len(found)], dtype=np.int64)
        collective(groups.world.Allreduce, MPI.IN_PLACE, anywhere)  # (a buffer reduction: a revoke reaches it)
        if not anywhere[0]:
            return
        everything = [f for part in collective(groups.world.allgather, found if groups.dp.rank == 0 else [])
                      for f in part]
        event("sdc", global_step=cb.cur_step_num, found=everything)
        raise SilentCorruption(cb.cur_step_num, everything)


ROLLBACKS = 3  # in one job; at the next the job stops (memory that keeps failing: restart without that node)


class Rollback:
    """The repair in the job (`tft.sdc_rollback`): every rank loads the newest committed checkpoint, compared
    before it was saved, into its live arrays, and training goes on from its step, without a restart; bit for
    bit as a resume from it would (the steps trained on the damage are all redone)."""

    def __init__(self, run):
        self.run, self.done = run, 0

    def handles(self, error) -> bool:
        return isinstance(error, SilentCorruption) and self.done < ROLLBACKS

    def recover(self, error: SilentCorruption) -> int:
        """Collective: load, and return the global step training goes on after."""
        import time

        from ..checkpoint.errors import CheckpointError
        from ..checkpoint.recovery import recover
        t0 = time.time()
        if self.run.saver is not None:
            self.run.saver.abandon("silent data corruption: the state being saved in the background is not kept")
        try:
            record, _ = recover(self.run, "auto")  # the same on every rank
        except CheckpointError as e:  # none usable (none committed yet): the job stops on the corruption's line
            raise SilentCorruption(error.step, error.found, f"nothing to roll back to ({e}) and no last gasp (the "
                                   "newest state is the damaged one): start the job again") from None
        optimizer = self.run.optimizer
        if hasattr(optimizer, "received"):  # OptTFTWrapper: its copy from before an update is of the damage
            optimizer.received(record["global_step"])
        self.done += 1
        step = self.run.loader.init_step
        ms = round(1000 * (time.time() - t0), 1)
        event("sdc_rollback", global_step=step, checkpoint=record["name"], found_at=error.step, ms=ms,
              damaged=sorted({r for f in error.found for r in f["ranks"]}))
        if self.run.groups.world.rank == 0:
            say(f"dsim: sdc: {describe(error.found)} at step {error.step}; rolled back in the job to {record['name']} "
                f"(global step {step}, compared before it was saved) in {ms:.0f} ms; training goes on after step {step}")
        return step


def digests(optimizer) -> dict:
    """CRC-32 of every parameter and optimizer-state slice this rank holds: {("params" | "state", name): crc}."""
    from ..checkpoint.format import crc32
    out = {}
    for p in optimizer.params:
        progress.tick()  # each slice read is progress (dsim.parallel.progress)
        out["params", p.name] = crc32(p.data)
    for name, _, a in optimizer.state_items():
        progress.tick()
        out["state", name] = crc32(a)
    return out


def differing(gathered: list) -> list[dict]:
    """From a data-parallel group's [(rank, shard index, digests)]: each slice whose holders disagree,
    {"tensor", "ranks" (the damaged: the odd ones out, or every holder when no value has a majority), "holders"}."""
    slices = {}
    for rank, shard, digest in gathered:
        for (kind, name), crc in digest.items():
            key = (kind, name, None if kind == "params" else shard)
            slices.setdefault(key, []).append((rank, crc))
    found = (_compared(tensor(kind, name), held)
             for (kind, name, _), held in sorted(slices.items(), key=lambda x: (x[0][0], x[0][1], x[0][2] or 0)))
    return [f for f in found if f is not None]


def tensor(kind: str, name: str) -> str:
    """How a slice is named in what is found: params/<name> or optimizer/<state name>."""
    return f"{'params' if kind == 'params' else 'optimizer'}/{name}"


def state_digests(optimizer, arrays: dict) -> dict:
    """CRC-32 of each array of a state this rank holds ({name: array}, as OptTFTWrapper.states() offers one),
    by tensor(...): what differing_in_sets compares."""
    from ..checkpoint.format import crc32
    params = {p.name for p in optimizer.params}
    return {tensor("params" if name in params else "state", name): crc32(a) for name, a in arrays.items()}


def differing_in_sets(held: dict, sets) -> list[dict]:
    """The last gasp's check (dsim.ft.last_gasp): held = surviving rank -> {name: crc} of the state it would
    save; the holders of each replica set must agree on every slice. Entries as differing's."""
    out = []
    for g in sets:
        holders = [r for r in g if r in held]
        for name in sorted(held[holders[0]]) if holders else ():
            f = _compared(name, [(r, held[r].get(name)) for r in holders])
            if f is not None:
                out.append(f)
    return out


def _compared(name: str, held: list) -> Optional[dict]:
    """[(rank, crc)] of one slice's holders: None when they agree, else who differs."""
    counts = Counter(crc for _, crc in held)
    if len(counts) == 1:
        return None
    crc, n = counts.most_common(1)[0]
    majority = n * 2 > len(held)
    return {"tensor": name, "ranks": sorted(r for r, c in held if not majority or c != crc),
            "holders": sorted(r for r, _ in held), "majority": majority}


def describe(found: list) -> str:
    parts = []
    for f in found[:3]:
        if f["majority"]:
            parts.append(f"rank(s) {', '.join(map(str, f['ranks']))} hold(s) a {f['tensor']} that differs from the "
                         f"other replicas' (holders {f['holders']})")
        else:
            parts.append(f"the replicas of {f['tensor']} on ranks {f['holders']} differ (either may be damaged)")
    more = f"; and {len(found) - 3} more slice(s)" if len(found) > 3 else ""
    return "; ".join(parts) + more


def not_compared(sets: list) -> str:
    """The clause a repair or a last gasp adds when it restored or saved slices from a lone holder since the last
    check (sets: their replica sets): a bit flipped there goes on unfound, every holder now the same."""
    alone = "; ".join(f"ranks {g}" for g in sets)
    return f"not compared since the last check (one surviving holder): the slices of {alone}" if sets else ""
