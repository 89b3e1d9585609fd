"""Paths checked up front: the run's output, checkpoint, last-gasp and group-info directories must be (or be
creatable as) writable directories, not files. Checked on rank 0 before step 1 and agreed by every rank:
one line naming the key, the path and the errno text, the same on all ranks (ConfigError, exit 2)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .config import Config, ConfigError


def places(cfg: Config) -> list[tuple[str, Path]]:
    """(config key, directory) of every place the run writes in."""
    out = Path(cfg.output.dir)
    found = [("output.dir", out)]
    c = cfg.checkpoint
    ckpt = Path(c.directory) if c.directory else out / "checkpoints"
    if c.enabled:
        found.append(("checkpoint.directory", ckpt))
        info = c.group_info_file or os.environ.get("GROUP_INFO_FILE")
        if info:
            key = "checkpoint.group_info_file" if c.group_info_file else "GROUP_INFO_FILE"
            found.append((key, Path(info.replace("{rank}", "0")).parent))
    if cfg.tft.ttp:
        found.append(("tft.ckpt_save_path", Path(cfg.tft.ckpt_save_path) if cfg.tft.ckpt_save_path else
                      ckpt / "ttp_checkpoints"))
    return found


def problem(key: str, path: Path):
    """None when path is a writable directory or can be made as one, else one line naming key, path and
    errno text. Leaves nothing behind: directories made to try are removed again (a rejected run makes none)."""
    made = []
    try:
        missing = [p for p in [path, *path.parents] if not p.exists()]
        for p in [path, *path.parents]:
            if p.exists() and not p.is_dir():
                raise NotADirectoryError(20, os.strerror(20))
        for p in reversed(missing):
            p.mkdir()
            made.append(p)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        hint = ("; save elsewhere (checkpoint.directory), and to resume from its checkpoints, --resume-from "
                f"{path}") if key == "checkpoint.directory" else ""
        return f"config: {key} {str(path)!r} is not a writable directory: {e.strerror or e}{hint}"
    finally:
        for p in reversed(made):
            try:
                p.rmdir()
            except OSError:
                pass
    return None


def linked_rank_dir(key: str, directory: Path):
    """One line when a rank directory of a checkpoint directory is a symlink: never written through."""
    if key == "checkpoint.directory" and directory.is_dir():
        for p in sorted(directory.glob("rank_*")):
            if p.is_symlink():
                return (f"config: {key} {str(directory)!r}: {p.name} is a symlink (to {os.readlink(p)}); "
                        "dsim never writes through one")
    return None


def check_places(cfg: Config, comm=None) -> None:
    """Raise ConfigError on every rank when rank 0 finds a place the run cannot write in (collective)."""
    error = None
    if comm is None or comm.rank == 0:
        error = next((p for p in (problem(k, d) or linked_rank_dir(k, d) for k, d in places(cfg)) if p), None)
    if comm is not None:
        error = comm.bcast(error, root=0)
    if error:
        raise ConfigError(error)
