"""A memory error (UCE) repaired in place: the damaged rank takes what the error hit from a replica while the
job goes on (tft.uce, with tft.uce_in_place: true, the default).

MindSpore's UCE fast recovery stops every rank, repairs the damaged one from a replica and redoes the step;
dsim's repair of the whole job (dsim.ft.inprocess) does the same. An error found in a forward pass needs less:
nothing has changed the parameters and optimizer state since the last update, and nothing can change them
before the next one, which waits for the damaged rank's gradients in the data-parallel all-reduce. So:
1. the damaged rank throws the buffers the error hit away for new ones (as the job-wide repair does) and asks
   one replica (the next rank of its group info) for them, naming the step it holds;
2. the replica answers at its next layer or while it waits in a collective (dsim.parallel.groups.watch: every
   rank of a fault-tolerant step checks there), if it holds that step whole, and sends the buffers;
3. the forward goes on from the layer it stopped at.
Nothing is redone and nobody else stops: the damaged rank's model-parallel group waits in its next sum, as for
a slow rank, and the losses are those of a run without the error.

It applies to an error in a forward pass where every owned slice has a replica (dp / optimizer shard > 1), when
no async save of this rank is still copying its state. The replicas are the ranks of its group info: they own
the same slices. Each also holds the same whole parameters (with optimizer shard k > 1, the rows its shard
group all-gathers too), which are what is sent; a replica between its update and that all-gather answers at
its first check after it. With pipeline stages too: a replica is the rank of the same stage in another
data-parallel copy of the pipeline, whose micro-batches never wait for the damaged rank's, so it goes on to
its next layer, or at the latest to that all-reduce, and answers there. Otherwise, or when the replica says
it cannot (its memory failed too), does not answer within ANSWER_TIMEOUT seconds, or an MPI call fails
(another fault, which the job-wide repair then handles with this one), the UCEError goes on to the job-wide
repair as before.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..checkpoint.group_info import group_info
from ..log import event, say
from .sdc import not_compared
from .wrapper import IN_PROGRESS

REQUEST, ANSWER, DATA = 0x1C00, 0x1C01, 0x1C10  # tags on the world; buffer i goes with tag DATA + i
ANSWER_TIMEOUT = 5.0                       # seconds: a replica answers within a layer's time
PROBE_EVERY = 0.01                         # seconds at least between two looks for a request (each one, an
# MPI_Iprobe, lets Open MPI yield the processor when nothing came: on a shared core, at every layer, a few % of a step)


class InPlace:
    """Both sides of the repair for one process: repair() on a damaged rank, serve() on every other."""

    def __init__(self, run, say_done):
        self.run = run
        self.say_done = say_done  # (time of the fault) -> None: the "step N finished X ms after" line, on this rank
        self.declined = None      # why the last repair() returned False
        self.probed = 0.0         # when serve() last looked for a request

    def armed(self) -> bool:
        """Whether a rank of this layout may repair in place (so every rank must be ready to answer): where
        each owned slice has a replica (dp / optimizer shard > 1)."""
        layout = self.run.groups.layout
        return layout.data_parallel > layout.optimizer_shard

    def applies(self, point: str) -> bool:
        saver = self.run.saver
        return point == "forward" and self.armed() and not (saver is not None and saver.copying())

    def repair(self, error, point: str) -> bool:
        """On the damaged rank: True when repaired from a replica (training goes on), False to repair the job."""
        if not self.applies(point):
            self.declined = "not here"
            return False
        return self.run.runtime.collective(self._repair, point)  # waiting for the replica (not stuck: the hang watch)

    def _repair(self, point: str) -> bool:
        t0 = time.time()
        world, opt, layout = self.run.groups.world, self.run.optimizer, self.run.groups.layout
        me, step = world.rank, opt.global_step
        replicas = group_info(layout, me)
        donor = replicas[(replicas.index(me) + 1) % len(replicas)]
        keep = opt.intact(step)
        opt.reallocate(keep)  # the buffers hit are thrown away: new pages (the old ones failed)
        needed = [(i, arr) for i, (name, arr) in enumerate(opt.owned_arrays(whole=True)) if name not in keep]
        answer = np.zeros(1, dtype=np.int64)
        reqs = [world.Irecv(answer, source=donor, tag=ANSWER)]
        reqs += [world.Irecv(arr, source=donor, tag=DATA + i) for i, arr in needed]
        world.send((step, [i for i, _ in needed]), dest=donor, tag=REQUEST)  # small: sent at once
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while not reqs[0].Test():
            self.serve()  # a replica of this rank asking this rank (hit too) hears it cannot
            if time.monotonic() > deadline or world.Is_revoked():
                break
        answered = reqs[0].Test()  # a completed request is null already: Test says True again
        if not answered or answer[0] != 1:  # no answer in time, or "cannot": the job-wide repair
            self.declined = "the replica cannot" if answered else "no answer"
            for r in reqs:
                if r != MPI.REQUEST_NULL:  # the completed ones are null already
                    r.Cancel()
            MPI.Request.Waitall(reqs)
            return False
        MPI.Request.Waitall(reqs[1:])
        opt.received(step)
        ms = 1000 * (time.time() - t0)
        # with tft.sdc_check_every and no other holder than the donor, nothing compared what it sent
        alone = [replicas] if self.run.cfg.tft.sdc_check_every and len(replicas) == 2 else []
        say(f"dsim: uce: rank(s) {me} had an uncorrectable memory error (UCE); repaired in place: rank {me} from "
            f"rank {donor} (group info {replicas}) while the other ranks went on; the {point} of step {step + 1} goes "
            f"on (repair took {ms:.0f} ms)" + (f"; {not_compared(alone)}" if alone else ""))
        event("uce_repair", any_rank=True, failed=[], damaged=[me], global_step=step, donors={str(me): donor},
              world_size=world.size, repair_ms=round(ms, 1), in_place=True, **({"unverified": alone} if alone else {}))
        self.say_done(t0)
        return True

    def serve(self) -> None:
        """On any rank: answer a damaged replica's request, if one has come. Sends the buffers it asks for when
        this rank holds the step it names whole (not inside an update, not hit itself); else says it cannot.
        Between an update and its sync (optimizer shard k > 1) it answers at its next check, once the
        parameters are whole again."""
        now = time.monotonic()
        opt = self.run.optimizer
        if now - self.probed < PROBE_EVERY or (opt.partial and not opt.damaged):
            return
        self.probed = now
        world = self.run.groups.world
        status = MPI.Status()
        if not world.Iprobe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status):
            return
        asking = status.Get_source()
        step, wanted = world.recv(source=asking, tag=REQUEST)
        able = not opt.damaged and opt.phase != IN_PROGRESS and opt.global_step == step
        world.Send(np.array([int(able)], dtype=np.int64), dest=asking, tag=ANSWER)
        if able:
            owned = [arr for _, arr in opt.owned_arrays(whole=True)]
            for i in wanted:
                world.Send(np.ascontiguousarray(owned[i]), dest=asking, tag=DATA + i)
