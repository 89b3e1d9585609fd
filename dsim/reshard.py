"""Reshard a committed checkpoint offline: write it for another layout or world size (MindSpore's
transform_checkpoints between strategies, here from the commit record's slice table).

    python -m dsim.reshard SRC --layout dp=3,mp=2,k=1 [--world N] -o DST [--integrated]

SRC is a checkpoint directory (its newest committed checkpoint), a `<name>.commit` file, or DIR/NAME.
DST receives the same checkpoint (same name, prefix, step and scalar state) laid out for the target:
`rank_<r>/<name>.h5` per rank of the target layout, or with --integrated one `<name>.h5` of whole tensors;
then its group info files, the prefix's graph meta, and last its commit record. Files are written tensor
by tensor: each is read from SRC (only the bytes that overlap it, dsim.checkpoint.reshard) when the writer
reaches it. SRC is only read (a read-only SRC works). `--world N` may leave dp out of --layout
(`--layout mp=2 --world 6` is dp=3). The pipeline stage count stays the source's (pp= may be left out):
which layers each stage holds is the model's to say, so changing it is done at load (`--resume auto` on the
new layout).
Bad input is one line and exit 2; DST never loses or overwrites a checkpoint it already has.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .checkpoint import commit as cm
from .checkpoint.errors import CheckpointError
from .checkpoint.format import Deferred, Tensor, write_file
from .checkpoint.group_info import group_info_attr, write_group_info
from .checkpoint.plan import commit_record, graph_meta, save_plan
from .checkpoint.reshard import Source, layout_of, specs_of
from .checkpoint.survivability import parse_layout
from .parallel.layout import LayoutError, ParallelLayout, ParamSpec, Slice, check_spec


class UsageError(Exception):
    """Bad input: one line, exit 2."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsim.reshard", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("src", metavar="SRC", help="checkpoint directory, <name>.commit, or DIR/NAME")
    ap.add_argument("--layout", required=True, help="target layout, e.g. dp=3,mp=2,k=1 (also pp=)")
    ap.add_argument("--world", type=int, help="target world size (lets --layout leave out dp)")
    ap.add_argument("-o", "--output", required=True, type=Path, metavar="DST", help="directory to write into")
    ap.add_argument("--integrated", action="store_true", help="one file of whole tensors instead of shards")
    return ap.parse_args(argv)


def target_layout(text: str, world, source: ParallelLayout) -> ParallelLayout:
    try:
        given = parse_layout(text)
    except (ValueError, LayoutError) as e:
        raise UsageError(str(e)) from None
    keys = {k.strip().split("=")[0].strip() for k in text.split(",") if k.strip()}
    dp = given.data_parallel
    # pp left out: the source's (a pp=2 checkpoint resharded to dp=1,mp=2 is 4 ranks, 2 a stage)
    pp = given.pipeline_stage if keys & {"pp", "pipeline_stage"} else source.pipeline_stage
    if world is not None and not keys & {"dp", "data_parallel"}:
        per = given.model_parallel * pp
        if world < 1 or world % per:
            raise UsageError(f"--world {world} is not a multiple of model_parallel x pipeline_stage = {per}")
        dp = world // per
    try:
        layout = ParallelLayout(dp, given.model_parallel, given.optimizer_shard, pp)
        if world is not None:
            layout.check_world_size(world)
    except LayoutError as e:
        raise UsageError(str(e)) from None
    if layout.pipeline_stage != source.pipeline_stage:
        raise UsageError(f"the source has pipeline_stage={source.pipeline_stage}: which layers a stage holds is the "
                         "model's to say, so change the stage count at load (--resume auto on the new layout)")
    return layout


def specs_for(source: Source, layout: ParallelLayout) -> list:
    """The checkpoint's parameters as specs (mp split as saved in the files, stage from the holders)."""
    specs = []
    for name, shape, stage in specs_of(source.record):
        split = source.split_of(f"params/{name}")
        spec = ParamSpec(name, shape, None if split == "replicated" else int(split[4:]), stage=stage)
        try:
            check_spec(spec, layout)
        except LayoutError as e:
            raise UsageError(f"the target layout cannot slice the model: {e}") from None
        specs.append(spec)
    return specs


def slots_of(record: dict) -> list:
    return sorted({e["tensor"].split("/", 1)[1].split(".", 1)[0] for e in record["slices"]
                   if e["tensor"].startswith("optimizer/")})


def reshard(src, layout: ParallelLayout, dst: Path, integrated: bool = False, log=print) -> dict:
    """Write SRC's newest (or named) committed checkpoint into dst for `layout`; returns its commit record."""
    from .inspect import UsageError as InspectUsage, resolve_checkpoint
    try:
        c = resolve_checkpoint(str(src))
    except InspectUsage as e:
        raise UsageError(str(e)) from None
    record = c.record
    if record.get("integrated_save"):
        raise UsageError(f"{c.name} is an integrated checkpoint (whole tensors): it loads into any layout as is")
    if not c.committed:
        raise UsageError(f"{c.name} is not committed")
    dst = Path(dst)
    if cm.commit_path(dst, c.name).exists() or cm.integrated_path(dst, c.name).exists() or any(
            dst.glob(f"rank_*/{c.name}.h5")):
        raise UsageError(f"{dst} already holds a checkpoint named {c.name}: nothing is overwritten")
    t0 = time.perf_counter()
    with Source(c.directory, record) as source:
        specs = specs_for(source, layout)
        slots = slots_of(record)
        plan = save_plan(layout, specs, slots)
        meta0 = source.meta()
        append = meta0.pop("append_info")
        written = {}
        ranks = [0] if integrated else list(range(layout.world_size))
        for r in ranks:
            if integrated:
                seen, tensors = set(), []
                for p in plan.slices:
                    if (p.kind, p.name) in seen:
                        continue
                    seen.add((p.kind, p.name))
                    full = Slice((0,) * len(p.global_shape), p.global_shape)
                    tensors.append(_tensor(source, p.kind, p.name, p.global_shape, full, p.split, False))
                path = cm.integrated_path(dst, c.name)
            else:
                tensors = [_tensor(source, p.kind, p.name, p.global_shape, p.where, p.split, p.opt_sharded)
                           for p in plan.for_rank(r)]
                path = cm.shard_path(dst, r, c.name)
            meta = {**meta0, "rank": r, "world_size": layout.world_size, "layout": layout.to_dict(),
                    "integrated_save": integrated, "group_info": group_info_attr(layout, r)}
            written[r] = write_file(path, meta, tensors, append)
        bytes_read = source.bytes_read
    prefix = record.get("prefix") or c.name.rsplit("-", 1)[0]
    if not integrated:
        for r in range(layout.world_size):
            write_group_info(cm.rank_dir(dst, r) / "group_info.json", layout, r)
    meta_path = dst / f"{prefix}-graph.meta"
    if not meta_path.exists():
        cm.write_json_atomic(meta_path, graph_meta(prefix, layout, specs, slots))
    out = commit_record(c.name, prefix, plan, record["epoch"], record["step_in_epoch"], record["global_step"],
                        max([x["sequence"] for x in cm.committed(dst)], default=0) + 1, integrated, time.time())
    cm.write_commit(dst, out, {r: (w.size, w.digest) for r, w in written.items()})
    total = sum(w.size for w in written.values())
    log(f"resharded {c.directory / c.name} ({layout_of(record).describe()}, {record['world_size']} ranks) into "
        f"{dst / c.name} ({'integrated' if integrated else layout.describe()}, {len(written)} file(s), "
        f"{total / 2**20:.1f} MiB; read {bytes_read / 2**20:.1f} MiB) in {time.perf_counter() - t0:.2f} s")
    return out


def _tensor(source, kind, name, global_shape, where, split, opt_sharded) -> Tensor:
    dtype = source.dtype_of(f"{kind}/{name}")
    return Tensor(kind, name, tuple(global_shape), where,
                  Deferred(tuple(where.extents), dtype, lambda out: source.read(f"{kind}/{name}", where, out)),
                  split, opt_sharded)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .inspect import UsageError as InspectUsage, resolve_checkpoint
    try:
        try:
            c = resolve_checkpoint(str(args.src))
        except InspectUsage as e:
            raise UsageError(str(e)) from None
        layout = target_layout(args.layout, args.world, layout_of(c.record))
        reshard(args.src, layout, args.output, args.integrated)
    except (UsageError, CheckpointError) as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dsim: error: {e.strerror or e}: {e.filename}" if e.filename else f"dsim: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
