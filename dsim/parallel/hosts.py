"""Which host each rank runs on, as MPI sees it: the ranks that share a node's memory are one host.

Each rank splits the world with MPI_Comm_split_type(COMM_TYPE_SHARED) (one communicator per node), the node's
first rank names it (its hostname), and the world gathers the names: never guessed from rank numbers, so any
mapping of ranks to hosts (`mpirun --map-by slot`, `--map-by node`, a rankfile, Slurm's) is seen as it is.
A world of one rank needs no MPI. The run's header, the model-parallel group's shared-memory sums, the commit
record's `hosts` and the warning for a slice held on one host only (dsim.checkpoint.survivability) read it.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosts:
    """The host of every rank of a world (names[r]: rank r's), hosts in the order of their first rank."""

    names: tuple

    @property
    def distinct(self) -> list[str]:
        """The hosts, in the order of their first rank."""
        return list(dict.fromkeys(self.names))

    def ranks(self, host: str) -> list[int]:
        """The ranks on a host, ascending."""
        return [r for r, h in enumerate(self.names) if h == host]

    def together(self, ranks) -> bool:
        """Whether the ranks all run on one host (the same node's shared memory)."""
        return len({self.names[r] for r in ranks}) == 1

    def describe(self) -> str:
        """'8 ranks' on one host; '8 ranks on 2 hosts (4 + 4)' on several (the ranks on each host)."""
        n, hosts = len(self.names), self.distinct
        if len(hosts) == 1:
            return f"{n} ranks"
        counts = [self.names.count(h) for h in hosts]
        each = (" + ".join(map(str, counts)) if len(hosts) <= 8 else
                f"{counts[0]} each" if len(set(counts)) == 1 else f"{min(counts)} to {max(counts)} each")
        return f"{n} ranks on {len(hosts)} hosts ({each})"


def discover(comm) -> Hosts:
    """The host of every rank of comm (collective over comm), from the nodes MPI finds: see the module docstring."""
    if comm.size == 1:
        return Hosts((socket.gethostname(),))
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        first, name = node.bcast((comm.rank, socket.gethostname()), root=0)
    finally:
        node.Free()
    return Hosts(named(comm.allgather((first, name))))


def named(nodes) -> tuple:
    """Each rank's host name from (first rank of its node, that rank's hostname) per rank: two nodes that report one
    hostname (containers with a default name) are told apart by their first rank ('box@4')."""
    names = {}
    for first, name in nodes:
        names.setdefault(name, set()).add(first)
    return tuple(name if len(names[name]) == 1 else f"{name}@{first}" for first, name in nodes)
