"""Look into checkpoint directories: list, verify, survivability, merge into whole tensors.

    $ python -m dsim.inspect runs/default                     # every checkpoint directory under it
    $ python -m dsim.inspect runs/default --verify            # checksums and coverage; exit 0 only when clean
    $ python -m dsim.inspect runs/default --json              # the same, for scripts
    $ python -m dsim.inspect --survivability runs/default     # which rank (and host) failures leave a full copy
    $ python -m dsim.inspect --survivability --layout dp=2,mp=4,k=1
    $ python -m dsim.inspect --survivability --layout pp=2,dp=2,mp=2 --ranks-per-node 4   # a lost node
    $ python -m dsim.inspect --merge runs/default/checkpoints/network-6_10 -o full.h5

DIR is a checkpoint directory (commit records `<name>.commit` beside `rank_<r>/` shard directories) or
any directory whose subdirectories, two levels down, are (runs/x/checkpoints,
runs/x/ttp_checkpoints/tft_saved_checkpoints-step_12). CKPT names one checkpoint: `<dir>/<name>`, its
commit record `<dir>/<name>.commit`, any of its files (`<dir>/rank_0/<name>.h5`), or a checkpoint
directory (its newest committed checkpoint). Bad input is one `dsim: error:` line and exit 2;
--verify exits 1 when it finds a problem.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .checkpoint.catalog import (CheckpointDir, ShardIndex, find_checkpoint_dirs, group_sets, is_checkpoint_dir,
                                 record_holder_sets, scan, tensor_holder_sets)
from .checkpoint.errors import CheckpointError
from .checkpoint.group_info import group_info_list
from .checkpoint.merge import merge
from .checkpoint.record import hosts_of
from .checkpoint.survivability import parse_layout, ranks_by_host, ranks_text, survivability
from .checkpoint.verify import indexes_of, verify
from .parallel.layout import LayoutError, ParallelLayout


class UsageError(Exception):
    """Bad paths or arguments: one line, exit 2."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dsim.inspect", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("dir", nargs="?", metavar="DIR", help="a checkpoint directory, or a directory above some")
    parser.add_argument("--verify", action="store_true",
                        help="check every checksum and that the slices of every tensor tile it (no gap, no overlap)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument("--shards", action="store_true", help="list every rank's file of every checkpoint")
    parser.add_argument("--survivability", action="store_true",
                        help="which simultaneous rank failures leave a complete copy of the state")
    parser.add_argument("--layout", metavar="dp=D,mp=M,k=K", help="with --survivability: a layout instead of DIR")
    parser.add_argument("--ranks-per-node", type=int, metavar="N",
                        help="with --survivability: whether losing a whole node of N consecutive ranks leaves a "
                             "complete copy (ranks 0..N-1 the first node)")
    parser.add_argument("--merge", metavar="CKPT", help="write whole tensors of CKPT as HDF5 virtual datasets")
    parser.add_argument("-o", "--output", metavar="FILE", help="with --merge: the merged file to write")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.merge:
            if args.dir or not args.output:
                raise UsageError("--merge CKPT takes -o FILE and no DIR")
            return do_merge(args)
        if args.output or (args.layout or args.ranks_per_node) and not args.survivability:
            raise UsageError("-o goes with --merge, --layout and --ranks-per-node with --survivability")
        if args.ranks_per_node is not None and args.ranks_per_node < 1:
            raise UsageError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
        if args.survivability:
            return do_survivability(args)
        if not args.dir:
            raise UsageError("give a checkpoint directory (python -m dsim.inspect DIR), or see --help")
        return do_list(args)
    except (UsageError, CheckpointError, LayoutError, ValueError) as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dsim: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


# -- finding what to look at --------------------------------------------------------------------------
def checkpoint_dirs(path: str) -> list[CheckpointDir]:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"no such directory: {path}")
    if not p.is_dir():
        raise UsageError(f"not a directory: {path} (give the directory holding the checkpoints)")
    found = find_checkpoint_dirs(p)
    if not found:
        raise UsageError(f"no checkpoint directory (*.commit records or rank_*/ shards) in {path}")
    return [scan(d) for d in found]


def resolve_checkpoint(spec: str):
    """The catalog.Checkpoint a CKPT argument names (see the module docstring)."""
    p = Path(spec)
    if p.is_dir() and is_checkpoint_dir(p):
        d, name = p, None
    elif p.suffix == ".commit":
        d, name = p.parent, p.stem
    elif p.suffix in (".h5", ".ckpt"):
        d = p.parent.parent if p.parent.name.startswith("rank_") else p.parent
        name = p.stem
    else:
        d, name = p.parent, p.name
    if not d.is_dir():
        raise UsageError(f"no such checkpoint directory: {d}")
    catalog = scan(d)
    committed = catalog.committed
    if name is None:
        if not committed:
            raise UsageError(f"no committed checkpoint in {d}")
        return committed[-1]
    for c in reversed(committed):
        if c.name == name:
            return c
    known = ", ".join(c.name for c in committed[-5:]) or "none"
    raise UsageError(f"no committed checkpoint named {name} in {d} (newest: {known})")


# -- listing and verifying ------------------------------------------------------------------------------
def describe_dir(catalog: CheckpointDir, verify_it: bool) -> dict:
    """Everything the listing shows about a directory, as plain data (the --json document's part)."""
    entries, sets = [], []
    for c in catalog.checkpoints:
        indexes = indexes_of(c)
        first = next((ix for ix in indexes.values() if isinstance(ix, ShardIndex)), None)
        meta = first.meta if first else {}
        rec = {**meta, **c.record}
        entry = {"name": c.name, "prefix": rec.get("prefix"), "epoch": rec.get("epoch"),
                 "step_in_epoch": rec.get("step_in_epoch"), "global_step": rec.get("global_step"),
                 "committed": c.committed, "size": c.size, "files": len(c.shards), "present": c.present,
                 "layout": rec.get("layout"), "world_size": rec.get("world_size"),
                 "integrated_save": bool(rec.get("integrated_save")),
                 "shards": [{"rank": s.rank, "file": s.relpath, "size": s.size,
                             "group_info": _group_info(indexes[s.rank].meta.get("group_info"))
                             if isinstance(indexes[s.rank], ShardIndex) else None,
                             "error": None if isinstance(indexes[s.rank], ShardIndex) else indexes[s.rank]}
                            for s in c.shards],
                 "replica_sets": group_sets(indexes, c) if c.committed else [],
                 "stages": _stages(rec)}
        host_of = hosts_of(c.record)
        entry["hosts"] = ranks_by_host(host_of) if host_of else None
        for shard in entry["shards"]:
            shard["stage"] = _stage_of(rec.get("layout"), shard["rank"])
            shard["host"] = host_of[shard["rank"]] if host_of and shard["rank"] < len(host_of) else None
        if verify_it and c.committed:
            entry["verify"] = verify(c).to_dict()
        if c.committed:
            sets = entry["replica_sets"]
        entries.append(entry)
    problems = list(catalog.problems) + [f"{e['name']}: {p}" for e in entries for p in e.get("verify", {}).get("problems", [])]
    return {"path": str(catalog.path), "checkpoints": entries, "replica_sets": sets, "notes": catalog.notes,
            "clean": not problems if verify_it else None, "problems": problems if verify_it else list(catalog.problems)}


def _stage_of(layout, rank: int):
    """The pipeline stage of a rank in a stored layout (None without stages)."""
    if not isinstance(layout, dict) or layout.get("pipeline_stage", 1) == 1:
        return None
    try:
        return rank // (int(layout["data_parallel"]) * int(layout["model_parallel"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _layer_of(parameter: str) -> str:
    """The layer (or transformer block) a parameter belongs to: layer2.bias -> layer2,
    encoder.blocks.0.attention.dense1.weight -> encoder.blocks.0."""
    parts = parameter.split(".")
    if "blocks" in parts[:-2]:
        return ".".join(parts[:parts.index("blocks") + 2])
    return parts[0]


def _stages(record: dict) -> list:
    """[(stage, first rank, last rank, [parameter names])] of a pipelined checkpoint's record, else []."""
    layout = record.get("layout")
    if _stage_of(layout, 0) is None:
        return []
    from .checkpoint import progression
    p = int(layout["pipeline_stage"])
    size = int(layout["data_parallel"]) * int(layout["model_parallel"])
    names = {s: [] for s in range(p)}
    for entry in record.get("slices") or []:
        tensor = str(entry.get("tensor", ""))
        try:
            first = min(r.start for r in progression.set_from_json(entry.get("holders")))
        except Exception:  # noqa: BLE001 - a damaged record is reported by --verify, not here
            continue
        if tensor.startswith("params/") and tensor[7:] not in names.get(first // size, [tensor[7:]]):
            names[first // size].append(tensor[7:])
    return [(s, s * size, (s + 1) * size - 1, names[s]) for s in range(p)]


def _group_info(stored):
    """A file's group info as its list of ranks (stored as a progression, or as a list before); else as found."""
    try:
        return None if stored is None else group_info_list(stored)
    except CheckpointError:
        return stored


def do_list(args) -> int:
    dirs = [describe_dir(c, args.verify) for c in checkpoint_dirs(args.dir)]
    clean = all(d["clean"] for d in dirs) if args.verify else None
    if args.json:
        print(json.dumps({"directories": dirs, "clean": clean}, indent=1))
    else:
        for i, d in enumerate(dirs):
            if i:
                print()
            print_dir(d, args.shards, args.verify)
    return 0 if clean in (None, True) else 1


def _size(n) -> str:
    if n is None:
        return "missing"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _layout(layout) -> str:
    if not isinstance(layout, dict):
        return "?"
    try:
        return ParallelLayout(**layout).describe()
    except (TypeError, ValueError):  # a damaged record: show what it says
        return " ".join(f"{k}={v}" for k, v in layout.items())


def _sets(sets, show=8) -> str:
    text = " ".join("{" + ",".join(map(str, s)) + "}" for s in sets[:show])
    return text + (f" … ({len(sets)} sets)" if len(sets) > show else "")


def print_dir(d: dict, all_shards: bool, verified: bool) -> None:
    entries = d["checkpoints"]
    committed = [e for e in entries if e["committed"]]
    head = f"{d['path']}: {len(committed)} committed checkpoint(s)"
    if len(entries) > len(committed):
        head += f", {len(entries) - len(committed)} never committed"
    print(head)
    rows = [("checkpoint", "epoch", "step", "global_step", "committed", "shards", "size", "layout", "world")]
    for e in entries:
        rows.append((e["name"], _str(e["epoch"]), _str(e["step_in_epoch"]), _str(e["global_step"]),
                     "yes" if e["committed"] else "no", f"{e['present']}/{e['files']}" + (" (integrated)"
                     if e["integrated_save"] else ""), _size(e["size"]), _layout(e["layout"]), _str(e["world_size"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 2, 3, 8}
    for r in rows:
        print("  " + "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    for note in d["notes"]:
        print(f"  note: {note}")
    if d["replica_sets"]:
        print(f"  replica sets (group info): {_sets(d['replica_sets'])}")
    newest = committed[-1] if committed else None
    if newest and newest["hosts"] and len(newest["hosts"]) > 1:
        print(f"  hosts: {_hosts_text(newest['hosts'])}")
        if d["replica_sets"]:
            print(f"  replica sets by host: {_sets_on_hosts(d['replica_sets'], newest['hosts'])}")
    for stage, first, last, names in (newest or {}).get("stages", []):
        layers = list(dict.fromkeys(_layer_of(n) for n in names))
        shown = ", ".join(layers[:6]) + (f", … ({len(layers)} layers)" if len(layers) > 6 else "")
        print(f"  pipeline stage {stage}: ranks {first}-{last}: {shown or 'no parameters'} ({len(names)} parameters)")
    shown = entries if all_shards else [e for e in entries if e["committed"]][-1:] + [
        e for e in entries if e["present"] < e["files"] and e["committed"]]
    for e in {id(e): e for e in shown}.values():
        print(f"  shards of {e['name']}:")
        w = max(len(s["file"]) for s in e["shards"])
        for s in e["shards"]:
            extra = f"group info {s['group_info']}" if s["group_info"] is not None else (s["error"] or "")
            extra = (f"stage {s['stage']}  " if s.get("stage") is not None else "") + extra
            extra += f"  host {s['host']}" if s.get("host") and len(e["hosts"] or ()) > 1 else ""
            print(f"    rank {s['rank']:<3} {s['file']:<{w}}  {_size(s['size']):>10}  {extra}".rstrip())
    if verified:
        for e in entries:
            if not e["committed"]:
                print(f"  verify {e['name']}: skipped (never committed: a leftover of an interrupted save)")
                continue
            v = e["verify"]
            if v["clean"]:
                print(f"  verify {e['name']}: ok ({v['files']} files, {v['tensors']} tensors, {v['checksums']} "
                      f"checksums, every slice covered once)")
            else:
                print(f"  verify {e['name']}: {len(v['problems'])} problem(s)")
                for p in v["problems"]:
                    print(f"    {p}")
            for note in v["notes"]:
                print(f"    not checked: {note}")
        bad = [e for e in committed if not e["verify"]["clean"]]
        extra = [p for p in d["problems"] if not any(p.startswith(e["name"] + ": ") for e in entries)]
        for p in extra:
            print(f"  problem: {p}")
        print(f"{d['path']}: " + ("clean" if d["clean"] else
                                  f"{len(bad)} of {len(committed)} committed checkpoint(s) with problems"
                                  + (f", {len(extra)} other problem(s)" if extra else "")))


def _str(x) -> str:
    return "?" if x is None else str(x)


def _hosts_text(hosts: dict, show: int = 8) -> str:
    """node1 (ranks 0-3), node2 (ranks 4-7)"""
    text = ", ".join(f"{h} (ranks {ranks_text(r)})" for h, r in list(hosts.items())[:show])
    return text + (f", … ({len(hosts)} hosts)" if len(hosts) > show else "")


def _sets_on_hosts(sets, hosts: dict, show: int = 8) -> str:
    """{0,4}: node1, node2; {1,5}: node1, node2 (the host of each rank of each replica set, in rank order)"""
    host_of = {r: h for h, ranks in hosts.items() for r in ranks}
    text = "; ".join("{" + ",".join(map(str, s)) + "}: " + ", ".join(host_of.get(r, "?") for r in s)
                     for s in sets[:show])
    return text + (f"; … ({len(sets)} sets)" if len(sets) > show else "")


# -- survivability ----------------------------------------------------------------------------------------
def do_survivability(args) -> int:
    if bool(args.dir) == bool(args.layout):
        raise UsageError("--survivability takes a checkpoint DIR or --layout dp=D,mp=M,k=K (one of them)")
    reports = []
    if args.layout:
        layout = parse_layout(args.layout)
        from .checkpoint.group_info import replica_sets
        reports.append((f"layout {_layout(layout.to_dict())}", replica_sets(layout), layout.world_size, {}, None))
    else:
        for catalog in checkpoint_dirs(args.dir):
            if not catalog.committed:
                continue
            c = catalog.committed[-1]
            indexes = indexes_of(c)
            sets = group_sets(indexes, c)
            if sets:
                reports.append((f"{c.directory / c.name}", sets, int(c.record.get("world_size") or 0) or None,
                                record_holder_sets(c.record) or tensor_holder_sets(indexes), hosts_of(c.record)))
        if not reports:
            raise UsageError(f"no committed checkpoint with group info in {args.dir}")
    out = []
    for title, sets, n, tensors, host_of in reports:
        host_of = host_of if host_of and len(set(host_of)) > 1 else None   # one host: nothing to say of hosts
        # a piece of state is lost when every rank holding it fails: the replica sets, and each tensor's holders
        s = survivability(list(sets) + [h for holders in tensors.values() for h in holders], world_size=n)
        out.append({"source": title, "replica_sets": sets, **s.to_dict(), "description": s.lines(),
                    "tensor_holders": tensors})
        if args.ranks_per_node:
            out[-1].update(ranks_per_node=args.ranks_per_node, nodes=s.nodes(args.ranks_per_node))
        if host_of:
            out[-1].update(hosts=ranks_by_host(host_of), host_loss=s.hosts(host_of))
        if not args.json:
            print(f"{title}: {s.world_size} ranks, replica sets (group info) {_sets(sets)}")
            print("  simultaneous failures that leave a complete copy of the state:")
            for line in s.lines():
                print(f"    {line}")
            print(f"  largest failure count always survivable: {s.always} (at best {s.at_best}: "
                  f"when one rank of every replica set is spared)")
            if args.ranks_per_node:
                print(f"  a lost node ({args.ranks_per_node} consecutive ranks, every one failing at once):")
                for line in s.node_lines(args.ranks_per_node):
                    print(f"    {line}")
            if host_of:
                hosts = ranks_by_host(host_of)
                print(f"  hosts (the commit record's): {_hosts_text(hosts)}")
                print(f"  replica sets by host: {_sets_on_hosts(sets, hosts)}")
                print("  a lost host (every rank on it failing at once):")
                for line in s.host_lines(host_of, tensors):
                    print(f"    {line}")
            if tensors:
                print("  holders per tensor (a slice is lost only when every rank holding it fails):")
                for line in holder_lines(tensors):
                    print(f"    {line}")
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=1))
    return 0


def holder_lines(tensors: dict) -> list[str]:
    """Tensors grouped by how many ranks hold each of their slices: the failures each group survives."""
    by_size = {}
    for name, holders in tensors.items():
        by_size.setdefault(min(len(h) for h in holders), []).append((name, holders))
    out = []
    for size, group in sorted(by_size.items(), reverse=True):
        names = [name for name, _ in group if not name.startswith(("moment", "moments."))] or [group[0][0]]
        sets = sorted({tuple(h) for _, holders in group for h in holders})
        survive = "any single failure" if size == 2 else f"any {size - 1} failures" if size > 1 else "no failure"
        out.append(f"{len(group)} tensor(s) with {size} holder(s) per slice ({_sets([list(x) for x in sets])}), "
                   f"e.g. {', '.join(names[:2])}: survive {survive}")
    return out


# -- merge ------------------------------------------------------------------------------------------------
def do_merge(args) -> int:
    c = resolve_checkpoint(args.merge)
    shapes = merge(c, args.output)
    ranks = c.present
    print(f"merged {c.name} ({len(shapes)} tensors, global step {c.global_step}) into {args.output}: "
          f"virtual datasets over {ranks} file(s) of {c.directory}, nothing copied")
    return 0


if __name__ == "__main__":
    from . import guard
    guard.run(main)
