"""A UCE repaired in place (dsim.ft.in_place), on 8 real ranks: the damaged rank asks its replica for the buffers
the error hit while every other rank only answers at its checks (as at every layer of a fault-tolerant step)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from conftest import small_config
from dsim.build import build_run
from dsim.faults import UCEError, corrupt
from dsim.ft.in_place import InPlace
from dsim.parallel import groups
from test_parallel_equivalence import agree

pytestmark = pytest.mark.mpi(min_size=8)
DAMAGED = 3  # on dp2 x mp4 its replica is rank 7


def trained(comm, dp=2, mp=4, k=1):
    cfg = small_config(parallel__data_parallel=dp, parallel__model_parallel=mp, parallel__optimizer_shard=k,
                       optimizer__name="adam", train__steps_per_epoch=2, tft__uce="true")
    run = build_run(cfg, comm)
    run.model.train(1, run.loader)
    return run


def owned(run) -> dict:
    return {name: arr.copy() for name, arr in run.optimizer.owned_arrays()}


def attempt(comm, run, point="forward"):
    """Rank DAMAGED loses half its buffers and repairs in place; the others answer until it is done."""
    said = []
    in_place = InPlace(run, said.append)
    repaired = None
    if comm.rank == DAMAGED:
        error = UCEError(DAMAGED, "in a test", corrupt(run.optimizer, DAMAGED))
        repaired = in_place.repair(error, point)
        done = comm.Ibarrier()
    else:
        done = comm.Ibarrier()
        while not done.Test():
            in_place.serve()
    done.Wait()
    return repaired, said, in_place.declined


def test_the_damaged_rank_gets_the_buffers_hit_from_its_replica_bit_for_bit():
    comm = MPI.COMM_WORLD.Dup()
    run = trained(comm)
    before, step = owned(run), run.optimizer.global_step
    repaired, said, _ = attempt(comm, run)
    after = owned(run)
    same = all(np.array_equal(before[n], after[n]) for n in before)
    ok = same and run.optimizer.global_step == step and not run.optimizer.damaged and run.optimizer.states()
    if comm.rank == DAMAGED:
        ok = ok and repaired is True and len(said) == 1
    agree(comm, ok, f"repaired={repaired} same={same}")
    comm.Free()


def test_a_replica_hit_too_says_it_cannot_and_the_damaged_rank_is_left_to_the_job_wide_repair():
    comm = MPI.COMM_WORLD.Dup()
    run = trained(comm)
    if comm.rank == 7:
        run.optimizer.invalidate()  # its memory failed too: it holds nothing to give
    repaired, _, declined = attempt(comm, run)
    # the damaged rank knows at once (no wait for a timeout) and still offers nothing
    ok = (repaired is False and declined == "the replica cannot" and run.optimizer.damaged
          and not run.optimizer.states()) if comm.rank == DAMAGED else True
    agree(comm, ok, f"repaired={repaired} {declined}")
    comm.Free()


def test_outside_a_forward_pass_it_is_not_tried():
    comm = MPI.COMM_WORLD.Dup()
    run = trained(comm)
    repaired, _, declined = attempt(comm, run, point="update")
    ok = repaired is False and declined == "not here" if comm.rank == DAMAGED else True
    agree(comm, ok, f"repaired={repaired}")
    comm.Free()


def test_a_replica_waiting_in_the_gradient_sum_answers_though_a_sum_came_before_the_forward():
    """A pipeline's last stage sums over dp before its first forward (the Transformer counts the batch's tokens):
    the step's gradient sum, after the forward, must still wait checking, or a replica already waiting there
    would answer the damaged rank only after it gave up (ANSWER_TIMEOUT) and left it to the job-wide repair."""
    comm = MPI.COMM_WORLD.Dup()
    run = trained(comm)
    dp, in_place = run.groups.dp, InPlace(run, lambda t: None)
    run.runtime.watch(run.groups.world, in_place.serve, dp)  # as at the start of every fault-tolerant step
    try:
        with run.runtime.before_forward():                # as dsim.parallel.pipeline does around that sum
            tokens = groups.allreduce_sum(dp, np.ones(1))
        repaired = None
        if comm.rank == DAMAGED:                          # its replica, rank 7, goes on into the gradient sum
            repaired = in_place.repair(UCEError(DAMAGED, "in a test", corrupt(run.optimizer, DAMAGED)), "forward")
        grads = groups.allreduce_sum(dp, np.full(5, float(comm.rank)))
    finally:
        run.runtime.watch(None)
    expected = sum(dp.allgather(comm.rank))
    ok = tokens[0] == 2 and grads[0] == expected
    if comm.rank == DAMAGED:
        ok = ok and repaired is True and not run.optimizer.damaged
    agree(comm, ok, f"repaired={repaired} declined={in_place.declined}")
    comm.Free()


def test_with_optimizer_shard_the_whole_parameters_come_from_a_replica_once_it_has_synced():
    """dp4 x mp2 with optimizer shard 2: rank 3 owns half of each weight's rows and their state, rank 7 the same
    half (group info [3, 7]), and both use whole weights. Rank 7 holds them half new, half stale, between its
    update and its sync: it must answer only after the sync, with the whole weights."""
    comm = MPI.COMM_WORLD.Dup()
    run = trained(comm, dp=4, mp=2, k=2)
    opt = run.optimizer
    whole, step = {n: a.copy() for n, a in opt.owned_arrays(whole=True)}, opt.global_step
    if comm.rank == 7:   # between its update and its sync: the rows it does not own are not yet the step's
        opt.__dict__["partial"] = True
        for p in opt.params:
            if p.opt_sharded:
                p.data[...] = -1.0
                p.owned_data[...] = whole[p.name][p.owned_index]
    in_place = InPlace(run, lambda t: None)
    repaired = None
    if comm.rank == DAMAGED:
        repaired = in_place.repair(UCEError(DAMAGED, "in a test", corrupt(opt, DAMAGED)), "forward")
        done = comm.Ibarrier()
    else:
        t0 = time.monotonic()
        done = comm.Ibarrier()
        while not done.Test():
            if comm.rank == 7 and opt.partial and time.monotonic() - t0 > 0.3:
                for p in opt.params:   # its sync
                    p.data[...] = whole[p.name]
                opt.__dict__["partial"] = False
            in_place.serve()
    done.Wait()
    same = all(np.array_equal(whole[n], a) for n, a in opt.owned_arrays(whole=True))
    ok = same and opt.global_step == step and not opt.damaged
    if comm.rank == DAMAGED:
        ok = ok and repaired is True
    agree(comm, ok, f"repaired={repaired} declined={in_place.declined} same={same}")
    comm.Free()
