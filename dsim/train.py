"""Train a model on MPI ranks.

    $ mpirun -n 8 python -m dsim.train --config configs/default.yaml
    $ mpirun -n 8 python -m dsim.train --set parallel.model_parallel=2 --set optimizer.name=adam
"""
from __future__ import annotations

import argparse
import os
import sys

from . import guard
from .checkpoint import CheckpointError
from .config import ConfigError, check_fault_ranks, check_fault_steps, load_config
from .data import DatasetError
from .faults import InjectedFault
from .parallel.layout import LayoutError
from .writable import check_places

USER_ERRORS = (ConfigError, LayoutError, DatasetError, CheckpointError)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dsim.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (default: the built-in defaults, as configs/default.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set optimizer.name=adam (repeatable); a mapping "
                             "merges into its section: --set 'model.transformer={vocab_size: 256}'")
    parser.add_argument("--resume", metavar="auto|NAME",
                        help="continue from the newest usable committed checkpoint (auto) or a named one, "
                             "e.g. network-6_10; a lost or damaged shard is taken from a replica rank")
    parser.add_argument("--repair", action="store_true",
                        help="with --resume: also write shards taken from replicas back into the checkpoint "
                             "directory (a damaged file is kept as <name>.h5.damaged)")
    parser.add_argument("--resume-from", metavar="DIR",
                        help="resume from the checkpoints in DIR (--resume auto unless --resume names one), which "
                             "is only read, never written: e.g. a read-only snapshot; saves go to checkpoint.directory")
    args = parser.parse_args(argv)
    if args.resume_from and not args.resume:
        args.resume = "auto"
    return args


def describe(run) -> str:
    """One header line: ranks (on how many hosts, when more than one), layout, model, optimizer, schedule of the run."""
    cfg, layout, p = run.cfg, run.groups.layout, run.cfg.parallel
    return (f"dsim: {run.groups.hosts.describe()}, data_parallel={layout.data_parallel} "
            f"model_parallel={layout.model_parallel} optimizer_shard={layout.optimizer_shard}"
            + (f" pipeline_stage={layout.pipeline_stage}" if layout.pipeline_stage > 1 else "")
            + (f" micro_batch_num={p.micro_batch_num} ({p.pipeline_schedule})" if run.model.pipeline else "")
            + f"; {cfg.model.name} {run.network.describe()} {cfg.dtype}; {cfg.optimizer.name} lr={cfg.optimizer.learning_rate}; "
            f"{cfg.train.epochs} epoch(s) x {run.loader.get_dataset_size()} steps of global batch {cfg.data.batch_size}"
            + (f"; {cfg.tft.spares} warm spare(s)" if cfg.tft.spares else "")
            + (f"; sums in shared memory: {', '.join(on)}" if (on := run.groups.shared_sums()) else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    guard.start_mpi()  # with a deadline: a process of the job that failed to start leaves the others in MPI_Init
    from mpi4py import MPI  # after argument parsing so --help works without MPI

    from .checkpoint import lease
    from .checkpoint.recovery import resume
    from .checkpoint.saver import check_writable
    from .checkpoint.survivability import host_warning
    from .build import FACTORY
    from .ft import spares, ulfm
    from .ft.inprocess import join_spawned, take_place
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:  # a replacement spawned by the survivors of a dead rank (tft.arf)
        return join(join_spawned, parent, FACTORY)
    comm, pool = MPI.COMM_WORLD, None
    try:
        if args.repair and not args.resume:
            raise ConfigError("--repair needs --resume")
        if args.repair and args.resume_from:
            raise ConfigError(f"--repair writes into the checkpoint directory, and --resume-from {args.resume_from} "
                              "is only read: resume without --repair (shards are still taken from replicas)")
        cfg = load_config(args.config, args.overrides)
        check_places(cfg, comm)
        guard.set_run_dir(cfg.output.dir)
        world, pool = spares.split(comm, cfg, FACTORY.fit)  # with tft.spares, the last processes of the job are spares
        if world is None:
            from .ft.hang import standby_heartbeat
            standby_heartbeat(cfg.output.dir, pool.comm.size - len(pool.spares), cfg.tft.hang_timeout, "spare")
            if cfg.checkpoint.save_on_signal:  # the notice mpirun passes on to every process must not end it
                from .ft.preemption import hold_signals
                hold_signals()
            if cfg.fault.spare_hang:
                from .faults import freeze
                freeze(f"dsim: fault: a warm spare (pid {os.getpid()}) freezes (SIGSTOP) as it begins to wait")
            code, place = spares.wait(pool)  # until released at the end, or given a dead rank's place
            if place is None:
                return spares.finish(code)   # released: no collective left for it
            return join(take_place, place.world, place.pool, place.joining, FACTORY)
        check_fault_ranks(cfg.fault, world.size)
        run = FACTORY.build(cfg, world)
        run.spares = pool
        check_fault_steps(cfg, run.loader.get_dataset_size())
        if world.rank == 0:
            print(describe(run), flush=True)
            lost = host_warning(run.groups.layout, run.network.specs, run.groups.hosts.names)
            if lost:
                print(lost, file=sys.stderr, flush=True)
            why = ulfm.unavailable_reason()
            if cfg.tft.ttp and why:
                print(f"dsim: warning: the last-gasp checkpoint (TTP) is unavailable: {why}; "
                      "periodic checkpoints and --resume still work", file=sys.stderr, flush=True)
        if cfg.checkpoint.enabled:  # a directory it cannot save into, or one another job writes: one line, first
            error = None
            if world.rank == 0:
                try:
                    check_writable(run.checkpoint_dir)
                    run.lease = lease.take(run.checkpoint_dir, "python -m dsim.train " + " ".join(sys.argv[1:]))
                except CheckpointError as e:
                    error = str(e)
            error = world.bcast(error, root=0)
            if error:
                raise CheckpointError(error)
        if args.resume == "auto" and not args.resume_from:  # what survivors wrote before a crash ended the job
            from .ft.rescue import complete
            complete(run)
        initial_epoch = resume(run, args.resume, args.repair, args.resume_from) if args.resume else 0
    except USER_ERRORS as e:
        if comm.rank == 0:
            print(f"dsim: error: {e}", file=sys.stderr)
        if pool is not None:
            pool.release(2)
        return 2
    if args.resume and finished(run):
        if pool is not None:
            pool.release(0)
        return 0
    return train(run, initial_epoch * run.loader.get_dataset_size())


def finished(run) -> bool:
    """Whether the checkpoint resumed from is at (or past) the last step of the run's train.epochs: then rank 0
    says so in one line and nothing is trained or written (a resumed finished run saves no checkpoint of a step
    it did not train). With more epochs asked for, training goes on."""
    step, per_epoch, epochs = run.loader.init_step, run.loader.get_dataset_size(), run.cfg.train.epochs
    if step < epochs * per_epoch:
        return False
    if run.groups.world.rank == 0:
        print(f"dsim: nothing to train: the run already finished (global step {step}, and train.epochs={epochs} "
              f"x {per_epoch} steps end at step {epochs * per_epoch}); set train.epochs higher to train on",
              flush=True)
    return True


def join(how, *args) -> int:
    """A newcomer (a spare, or spawned) takes a dead rank's place and trains; exit status 1 when the repair it
    joined failed (another rank died during it: the survivors save the last gasp and the job ends)."""
    from mpi4py import MPI

    from .ft.inprocess import RepairInterrupted
    from .ft.spares import finish
    from .ft.hang import end_standby
    try:
        run, step, joining = how(*args)
    except (RepairInterrupted, MPI.Exception):
        end_standby()
        return finish(1)
    return train(run, step, joining)


def train(run, step: int, joining=None) -> int:
    """Train from global `step` on; returns the exit status, and releases the job's idle spares with it.

    joining: given to a process that takes a dead rank's place in the running job.
    """
    from .ft.elastic import Idle, wait_idle
    try:
        code = _train(run, step, joining)
    except Idle as idle:  # left over by an elastic shrink: out of training until the job ends
        from .ft import hang
        hang.leave(run.runtime)
        wait_idle(idle.comm)
        return 0
    if run.spares is not None:
        run.spares.release(code)
        timeout = run.cfg.tft.hang_timeout
        if timeout and run.spares.spares and run.groups.world.rank == 0:  # one that never leaves: killed
            from .ft.hang import stop_frozen_spares
            stop_frozen_spares(run.cfg.output.dir, run.groups.world.size, timeout)
    if run.model.recovery is not None:
        run.model.recovery.release_idle()
    from .ft.spares import finish
    return finish(code, run.groups.world if code == 0 else None, run.runtime)  # a job that spawned: no MPI_Finalize


def _train(run, step: int, joining) -> int:
    from .checkpoint.saver import SaveError
    from .ft.sdc import SilentCorruption
    from .ft import cut
    from .ft.rescue import arm
    from .ft.tft import handle_process_failure, is_failure, leave
    cfg = run.cfg
    arm(run)  # a job over several hosts with the last gasp: its state to disk even when a crash takes MPI's runtime
    if joining is None:  # (collective: a process joining a repaired world trains in it alone)
        cut.arm(run)  # a job over several hosts: its sides found without MPI after a network cut
    try:
        run.train(initial_epoch=step // run.loader.get_dataset_size(), joining=joining)
    except SilentCorruption as e:  # every rank found it together: rank 0 says it once; no last gasp
        if run.groups.world.rank == 0:
            print(f"dsim: error: {e}", file=sys.stderr, flush=True)
        return 1
    except (InjectedFault, CheckpointError) as e:
        rank = run.groups.world.rank
        if isinstance(e, SaveError):  # gathered from every rank: rank 0 says it once
            if rank == 0:
                print(f"dsim: error: {e}", file=sys.stderr, flush=True)
            return 1
        if rank == 0 or cfg.fault.rank is not None:  # an all-rank fault is reported once
            print(f"dsim: error: rank {rank}: {e}", file=sys.stderr, flush=True)
        if isinstance(e, InjectedFault) and cfg.fault.rank is not None:
            leave(1)  # this rank alone crashed: the others must see it die, not wait for it in MPI_Finalize
        return 1
    except Exception as e:
        if not is_failure(e):  # a bug: guard.run says it (one line, and the traceback in the run's log)
            raise
        return handle_process_failure(run, e)
    stop = run.stop_on_signal
    return 128 + stop.stopped if stop is not None and stop.stopped else 0  # stopped on a notice: as ended by it


if __name__ == "__main__":
    from .config import Config
    guard.run(main, run_dir=Config().output.dir)  # a crash of this rank (a bug): one line, MPI sees it die
