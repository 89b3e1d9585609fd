"""The `tft:` section: fault tolerance (MindSpore's MS_ENABLE_TFT='{TTP:1,UCE:1,ARF:1}' sets the same switches)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..section import ConfigError, key


def _seconds(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


@dataclass
class TFTConfig:
    """Fault tolerance (MindSpore's MS_ENABLE_TFT='{TTP:1,UCE:1,ARF:1}' sets the same switches)."""
    ttp: bool = key(False, "when a rank dies, the survivors save a last-gasp checkpoint of the newest step")
    uce: bool = key(False, "repair a rank's memory error (UCE) in the job from a replica (implies ttp)")
    uce_in_place: bool = key(True, "with uce, a UCE found in a forward pass is repaired by that rank alone while the "
                                   "others go on")
    arf: bool = key(False, "replace a dead process in the job by a spawned one (implies ttp)")
    spares: int = key(0, "warm spare processes started with the job, beyond the layout's ranks (implies arf)",
                      ">= 0")
    elastic: bool = key(False, "no replacement for a dead rank: go on with fewer ranks, lower dp (implies ttp)")
    hang_timeout: Optional[float] = key(None, "seconds a frozen or stuck rank is waited for before it is killed",
                                        "> 0 or null (off)")
    deadlock_timeout: Optional[float] = key(None, "seconds every rank may wait, none progressing, before the "
                                                  "deadlock is broken; null: 10 x hang_timeout",
                                            "> 0 or null; needs hang_timeout")
    straggler_factor: Optional[float] = key(None, "a rank computing its steps this many times slower than its "
                                                  "stage's median is a straggler", "> 1 or null (off)")
    straggler_evict: bool = key(False, "kill a straggler, then as a dead rank (a spare takes its place)",
                                "needs straggler_factor")
    sdc_check_every: Optional[int] = key(None, "steps between two comparisons of the replicas (and before every "
                                               "save): silent data corruption", ">= 1 or null (off)")
    sdc_rollback: bool = key(True, "corruption found: roll back in the job to the newest checkpoint (false: stop)")
    ckpt_save_path: Optional[str] = key(None, "where last-gasp checkpoints go; null: <checkpoint dir>/ttp_checkpoints",
                                        "a writable directory or null")
    peer_copy_every: Optional[int] = key(None, "steps between two copies of each rank's state into the memory of a "
                                               "rank on another host, which the last gasp saves for a rank without "
                                               "a living replica", ">= 1 or null (off); needs ttp; not with uce, arf, "
                                                                   "spares or elastic")

    def validate(self) -> None:
        if self.spares < 0:
            raise ConfigError(f"config: tft.spares must be >= 0, got {self.spares}")
        n = self.sdc_check_every
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"config: tft.sdc_check_every must be a number of steps >= 1 (or null: off), got {n!r}")
        h = self.hang_timeout
        if h is not None and not (_seconds(h) and h > 0):
            raise ConfigError(f"config: tft.hang_timeout must be a number of seconds > 0 (or null: off), got {h!r}")
        d = self.deadlock_timeout
        if d is not None and not (_seconds(d) and d > 0):
            raise ConfigError(f"config: tft.deadlock_timeout must be a number of seconds > 0 (or null: 10 x "
                              f"tft.hang_timeout), got {d!r}")
        if d is not None and h is None:
            raise ConfigError("config: tft.deadlock_timeout needs tft.hang_timeout (the hang watch finds a deadlock)")
        c = self.peer_copy_every
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ConfigError(f"config: tft.peer_copy_every must be a number of steps >= 1 (or null: off), got {c!r}")
        if c is not None and not self.ttp:
            raise ConfigError("config: tft.peer_copy_every needs tft.ttp (the last gasp is what saves the peer copies)")
        if c is not None and (self.uce or self.arf or self.spares or self.elastic):
            raise ConfigError("config: tft.peer_copy_every does not go with a repair in the job (tft.uce, tft.arf, "
                              "tft.spares, tft.elastic): only the last gasp reads the peer copies")
        x = self.straggler_factor
        if x is not None and not (_seconds(x) and x > 1):
            raise ConfigError(f"config: tft.straggler_factor must be a number > 1 (or null: off), got {x!r}")
        if self.straggler_evict and x is None:
            raise ConfigError("config: tft.straggler_evict needs tft.straggler_factor (how much slower is a "
                              "straggler)")


def apply_tft_env(tft: TFTConfig, value) -> None:
    """Switches from MindSpore's MS_ENABLE_TFT, e.g. '{TTP:1}' or '{UCE:1 TTP:1}' (UCE and ARF imply TTP)."""
    if value:
        pairs = re.findall(r"([A-Za-z]+)\s*:\s*([01])", value)
        known = {"TTP", "UCE", "ARF"}
        if not pairs or any(k.upper() not in known for k, _ in pairs):
            raise ConfigError(f"MS_ENABLE_TFT={value!r}: expected e.g. '{{TTP:1,UCE:1,ARF:1}}'")
        for k, v in pairs:
            setattr(tft, k.lower(), v == "1")
    if isinstance(tft.spares, int) and tft.spares > 0:
        tft.arf = True  # a spare is only ever used to replace a dead rank
    if tft.uce or tft.arf or tft.elastic:  # (a straggler killed, as a rank the hang watch kills, is a death like
        tft.ttp = True                      # any other: what follows it is what this config does for one)
