"""Sharded save and load on every rank: dsim vs raw bytes vs torch.distributed.checkpoint, in one job.

    $ mpirun -n 8 python -m bench.save_load_ranks --total-bytes 2147483648 --repeats 3 --dir /tmp/b --out r.json

Every rank builds a real dsim run (the seeds' Network, widened until the state of all ranks reaches
--total-bytes), trains one step so the optimizer state is not zeros, and takes its owned slices as
`state_tensors` gives them to the saver. Then, per repeat, in a rotating order:
  save  raw   each rank: ndarray.tofile of every tensor into one file, fsync          (the disk's limit)
        dsim  ModelCheckpoint.save: HDF5 per rank, CRC-32, fsync, rename, commit record (the real saver)
        dcp   torch.distributed.checkpoint.save of the same tensors (gloo on 127.0.0.1, one key per
              rank and tensor, so nothing is deduplicated), its own fsyncs
  evict every file from the page cache (fsync + posix_fadvise DONTNEED), check with mincore
  load  raw   readinto the live arrays; dsim: latest_committed + restore (read, CRC check, layout check,
              copy into the model); dcp: torch.distributed.checkpoint.load in place
after each load the state's CRCs must equal those saved. The clock runs from a barrier to a barrier.
Inside dsim's save and load, the time spent in format.write_file / format.read_file (slowest rank) and
commit.write_commit (rank 0) is recorded too, to tell the HDF5 files from the commit protocol.
Rank 0 writes the timings as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

from bench.page_cache import evict, resident_fraction
from dsim.checkpoint import CheckpointConfig, ModelCheckpoint
from dsim.checkpoint import commit as commit_module
from dsim.checkpoint import loader as loader_module
from dsim.checkpoint import save as save_module
from dsim.checkpoint.loader import file_for, latest_committed, restore
from dsim.checkpoint.plan import save_plan
from dsim.checkpoint.saver import state_tensors
from dsim.config import load_config
from dsim.build import build_run
from dsim.engine.callbacks import RunContext
from dsim.nn import create_network
from dsim.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]
HIDDEN_LAYERS = 9  # 784 -> W x 9 -> 10: eight W x W weights carry the bytes, each a few MiB per rank


def state_bytes(width: int, layout: ParallelLayout, slots=1, itemsize=4) -> int:
    """Bytes of parameters and optimizer state over all ranks for hidden width `width` (from the save plan)."""
    plan = save_plan(layout, create_network("network", [width] * HIDDEN_LAYERS).specs, ("s",) * slots)
    per_set = {}
    for s in plan.slices:
        for h in s.holders:
            per_set[h] = per_set.get(h, 0) + s.size
    return sum(per_set[i] * len(ranks) for i, ranks in enumerate(plan.replica_sets)) * itemsize


def width_for(total: int, layout: ParallelLayout) -> int:
    """The smallest hidden width (a multiple of 64 x mp) whose state reaches total bytes."""
    step = 64 * layout.model_parallel
    width = step
    while state_bytes(width, layout) < total:
        width += step
    return width


class Phases:
    """Seconds spent inside some functions of dsim (wrapped in place; the call itself is unchanged)."""

    def __init__(self):
        self.seconds = {}

    def wrap(self, module, attr: str, key: str):
        fn = getattr(module, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
        setattr(module, attr, timed)

    def take(self, comm) -> dict:
        """Slowest rank's seconds per key since the last take."""
        mine, self.seconds = self.seconds, {}
        keys = sorted(set().union(*comm.allgather(set(mine))))
        return {k: comm.allreduce(mine.get(k, 0.0), op=MPI.MAX) for k in keys}


PHASES = Phases()
PHASES.wrap(save_module, "write_file", "write_file")      # the save path calls format.write_file by this name
PHASES.wrap(commit_module, "write_commit", "write_commit")
PHASES.wrap(loader_module, "read_file", "read_file")        # load_checkpoint calls format.read_file by this name


# -- the three methods --------------------------------------------------------------------------------
class Raw:
    """ndarray.tofile into one file per rank, fsync; readinto the live arrays."""

    name = "raw"

    def __init__(self, comm, tensors):
        self.rank, self.tensors = comm.rank, tensors

    def save(self, d: Path):
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"rank_{self.rank}.bin", "wb") as fh:
            for t in self.tensors:
                t.data.tofile(fh)
            fh.flush()
            os.fsync(fh.fileno())

    def load(self, d: Path):
        with open(d / f"rank_{self.rank}.bin", "rb", buffering=0) as fh:
            for t in self.tensors:
                view = memoryview(t.data).cast("B")
                got = 0
                while got < view.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise EOFError(f"{d}: short file")
                    got += n


class Dsim:
    """The real saver (ModelCheckpoint.save, commit record included) and the real restore."""

    name = "dsim"

    def __init__(self, run, cb):
        self.run, self.cb = run, cb

    def save(self, d: Path):
        self.prepared.save(self.cb)

    def prepare(self, d: Path):
        """ModelCheckpoint.begin (once per training: prefix, group info, graph meta), outside the clock."""
        self.prepared = ModelCheckpoint("bench", d, CheckpointConfig(save_checkpoint_steps=1,
                                                                     append_info=["epoch_num", "step_num"]))
        self.prepared.begin(RunContext(self.cb))

    def load(self, d: Path):
        record = latest_committed(d)
        restore(self.run, file_for(d, record, self.run.groups.rank))


class DCP:
    """torch.distributed.checkpoint on a gloo process group over 127.0.0.1."""

    name = "dcp"

    def __init__(self, comm, tensors):
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        self.dcp = dcp
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        port = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                                world_size=comm.size)
        # one key per rank and tensor: the same per-rank shards, nothing deduplicated as "replicated"
        self.state = {f"rank{comm.rank}/{t.name}": torch.from_numpy(t.data) for t in tensors}

    def save(self, d: Path):
        self.dcp.save(self.state, storage_writer=self.dcp.FileSystemWriter(str(d)))

    def load(self, d: Path):
        self.dcp.load(self.state, storage_reader=self.dcp.FileSystemReader(str(d)))


def reshard_time(d: Path, layout: ParallelLayout) -> tuple:
    """(seconds, ranks): python -m dsim.reshard (in this process) rewriting d's checkpoint for 3/4 of the ranks
    (8 -> 6: dp 3, mp halved)."""
    from dsim.reshard import reshard
    target = ParallelLayout(3 * layout.world_size // 8 or 1, max(1, layout.model_parallel // 2))
    t0 = time.perf_counter()
    reshard(d, target, d.parent / "resharded", log=lambda _: None)
    return time.perf_counter() - t0, target.world_size


def timed(comm, fn, *args) -> float:
    """Seconds from a barrier before fn to a barrier after it on every rank."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn(*args)
    comm.Barrier()
    return time.perf_counter() - t0


def checksums(tensors) -> list:
    return [zlib.crc32(memoryview(np.ascontiguousarray(t.data)).cast("B")) for t in tensors]


def disk_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.save_load_ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--total-bytes", type=int, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-parallel", type=int, default=4)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-dcp", action="store_true", help="leave torch out (the DCP column says so)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, base = comm.rank, Path(args.dir)
    t_start = time.perf_counter()

    def phase(what):
        comm.Barrier()
        if rank == 0:
            print(f"[{time.perf_counter() - t_start:7.1f} s] {what}", flush=True)

    layout = ParallelLayout(comm.size // args.model_parallel, args.model_parallel)
    width = width_for(args.total_bytes, layout)
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        f"model.hidden={[width] * HIDDEN_LAYERS}", "parallel.data_parallel=null",
        f"parallel.model_parallel={args.model_parallel}", "train.epochs=1", "train.steps_per_epoch=1",
        "output.progress_bar=false", f"output.dir={base / 'run'}", "checkpoint.enabled=false"])
    run = build_run(cfg, comm)
    cb = run.model.train(1, run.loader, [])  # one real step: optimizer state is not zeros
    phase("built and trained one step")
    tensors = list(state_tensors(run.network, run.optimizer))
    assert all(t.data.flags.c_contiguous for t in tensors)
    expected = checksums(tensors)
    total = comm.allreduce(sum(t.data.nbytes for t in tensors))

    methods = [Raw(comm, tensors), Dsim(run, cb)]
    dcp_note = "skipped (--no-dcp)" if args.no_dcp else None
    if not args.no_dcp:
        try:
            methods.append(DCP(comm, tensors))
        except ImportError as e:
            dcp_note = f"torch not installed ({e.name}); pip install -e '.[bench]'"
    dcp_note = comm.bcast(dcp_note, root=0)
    phase("methods ready")

    repeats = []
    for rep in range(args.repeats):
        order = methods[rep % len(methods):] + methods[:rep % len(methods)]
        rep_dir = base / f"repeat_{rep}"
        out = {"order": [m.name for m in order], "save_s": {}, "load_s": {}, "resident_before_load": {},
               "disk_bytes": {}, "verified": {}, "dsim_phases_s": {}}
        for m in order:
            d = rep_dir / m.name
            if rank == 0:
                d.mkdir(parents=True)
            comm.Barrier()
            if isinstance(m, Dsim):
                m.prepare(d)
            PHASES.take(comm)
            out["save_s"][m.name] = timed(comm, m.save, d)
            if isinstance(m, Dsim):
                out["dsim_phases_s"].update(PHASES.take(comm))
        phase("saved")
        if rank == 0:  # one node: one page cache, so rank 0 can evict everything every rank wrote
            evict(rep_dir)
            for m in order:
                out["resident_before_load"][m.name] = resident_fraction(rep_dir / m.name)
                out["disk_bytes"][m.name] = disk_bytes(rep_dir / m.name)
        phase("evicted")
        for m in order:
            for t in tensors:
                t.data[...] = 0
            PHASES.take(comm)
            out["load_s"][m.name] = timed(comm, m.load, rep_dir / m.name)
            if isinstance(m, Dsim):
                out["dsim_phases_s"].update(PHASES.take(comm))
            ok = comm.allreduce(int(checksums(tensors) == expected), op=MPI.MIN)
            out["verified"][m.name] = bool(ok)
            if not ok:
                raise SystemExit(f"bench: error: {m.name} load did not restore the saved state")
        phase("loaded and verified")
        if rank == 0:  # offline reshard of dsim's checkpoint to 6 ranks (mp halved, dp 3), page cache evicted
            evict(rep_dir)
            out["reshard_s"], out["reshard_ranks"] = reshard_time(rep_dir / "dsim", layout)
        comm.Barrier()
        phase("resharded")
        if rank == 0:
            shutil.rmtree(rep_dir)
            print(f"repeat {rep + 1}/{args.repeats}: save " + ", ".join(f"{k} {v:.2f} s" for k, v in out["save_s"].items())
                  + "; load " + ", ".join(f"{k} {v:.2f} s" for k, v in out["load_s"].items()), flush=True)
        repeats.append(out)
        phase("removed")

    if rank == 0:
        result = {"ranks": comm.size, "layout": layout.to_dict(), "hidden": [width] * HIDDEN_LAYERS,
                  "state_bytes": total, "tensors_per_rank": len(tensors), "repeats": repeats,
                  "dcp": dcp_note or "torch.distributed.checkpoint, gloo over 127.0.0.1, FileSystemWriter(sync_files=True)",
                  "mpi_library": MPI.Get_library_version().splitlines()[0].strip()}
        if not dcp_note:
            import torch
            result["torch"] = torch.__version__
        Path(args.out).write_text(json.dumps(result, indent=1))
    comm.Barrier()
    if any(isinstance(m, DCP) for m in methods):
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
