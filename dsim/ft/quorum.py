"""No split brain: after a failure, only the side of the job holding a quorum of its hosts commits or goes on.

A network cut kills nobody: each side of it finds the other's ranks silent (dsim.ft.cut) or sees them fail (ULFM's
failure detector, `mpi_ft_detector`, when on: docs/design/node-faults.md) and goes on with its own ranks. Left alone,
both sides would then save a last gasp and go on training (a repair in the job, an elastic continuation): two
histories of one job. So, after every shrink (or side agreed: dsim.ft.cut) that follows a failure, the living ranks
(one side) ask `decide` whether they hold the quorum:

- the hosts counted are the job's hosts before the failure, as MPI found them (dsim.parallel.hosts: Groups.hosts),
  never guessed from rank numbers; a host is reachable when at least one of its ranks is among the living;
- a side holding a **strict majority** of the hosts holds the quorum; two disjoint sides cannot both have one;
- on an **even split** (exactly half) the side holding **rank 0's host** holds it. Exactly one of two halves
  holds that host, so the rule still names one side. Why that host: rank 0 writes every periodic commit record,
  on its host's disk when checkpoints are node-local (docs/cluster.md), and the launch scripts map it to the
  hostfile's first host, where mpirun runs: the side a resume starts from anyway;
- hosts count, not ranks: a cut separates hosts, and a host of 6 ranks cut from two hosts of 1 rank is the
  minority (ranks would let one big host outvote the rest).

A side without the quorum stops at once (`stop`): one line from its lowest rank, exit 1 without MPI_Finalize,
before anything is written (the rescue files it wrote when it noticed the failure deleted: dsim.ft.rescue), so
nothing of it can be taken for committed when the link comes back. A host crash
looks the same to the others as a cut (nothing tells a dead host from an unreachable one), so a crash of half the
hosts, rank 0's among them, also stops the rest: no last gasp then, a restart from the last periodic checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """Whether one side of the job (its living ranks) holds the quorum, and why."""

    hosts: tuple       # the job's hosts before the failure, in the order of their first rank
    reachable: tuple   # those holding a living rank of this side
    first: str         # rank 0's host (it breaks an even split)

    @property
    def even(self) -> bool:
        return 2 * len(self.reachable) == len(self.hosts)

    @property
    def holds(self) -> bool:
        n, k = len(self.hosts), len(self.reachable)
        return 2 * k > n or (2 * k == n and self.first in self.reachable)

    def line(self) -> str:
        """The line a side without the quorum stops with."""
        k, n = len(self.reachable), len(self.hosts)
        why = (f"an even split, and rank 0's host {self.first} is on the other side" if self.even else
               "no strict majority")
        return (f"dsim: error: cut off from the majority of hosts ({k} of {n} reachable: {', '.join(self.reachable)}; "
                f"{why}): stopping without a checkpoint; the other side goes on or saves (docs/fault-tolerance.md: a "
                f"network cut)")


def decide(names, living) -> Verdict:
    """The verdict for the side whose living ranks are `living` (ranks of the world before the failure), names[r]
    being rank r's host (Groups.hosts.names)."""
    names = tuple(names)
    hosts = tuple(dict.fromkeys(names))
    alive = {names[r] for r in living}
    return Verdict(hosts, tuple(h for h in hosts if h in alive), names[0])


def check(groups, comm, world=None) -> Verdict | None:
    """After a shrink (comm: the living of `world`, by default groups.world): the verdict for this side, or, when it
    lacks the quorum, this process stops here (stop). None when the hosts are not known for that world (a world
    rebuilt since they were found): nothing to judge. Needs no collective: every living rank of a side computes
    the same verdict from the same shrink."""
    from . import ulfm
    world = groups.world if world is None else world
    hosts = getattr(groups, "hosts", None)
    if hosts is None or len(hosts.names) != world.size:
        return None
    verdict = decide(hosts.names, ulfm.world_ranks(comm, world))
    if not verdict.holds:
        stop(verdict, lead=comm.rank == 0)
    return verdict


def stop(verdict: Verdict, lead: bool) -> None:
    """End this process of a side without the quorum: its lowest rank says why (a line and a `cut_off` event), every
    one exits 1 at once, without MPI_Finalize (its peers on the other side are unreachable) and without writing."""
    from ..log import event, leave, tell
    from ..runtime import PROCESS
    if PROCESS.rescue is not None:  # its rescue files (dsim.ft.rescue): nothing of this side is ever resumed from
        PROCESS.rescue.discard()
    if lead:
        tell(verdict.line())
        event("cut_off", any_rank=True, hosts=list(verdict.hosts), reachable=list(verdict.reachable),
              even=verdict.even)
    leave(1)
