"""The recovery schemes a campaign compares, and what each job is started with.

Every scheme restarts the job through the launch scripts when it ends before the budget is spent (the
recover script resumes from the newest usable committed checkpoint, periodic or last gasp); they differ in
what the job does itself when a rank fails. A scheme is a row of STRATEGIES: its config settings, whether
it heals in the job, and whether it must end bit for bit where a fault-free run does (`peer` too: the last gasp
from the copies saves the state of the copy's step, from which the resume goes on bit for bit). A scheme whose
settings this dsim does not know is refused up front with one line naming what is missing; it runs as soon as
its setting exists.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..config import ConfigError, load_config


PEER_COPY_EVERY = 1  # the peer scheme's default: a copy every step, as Gemini's per-iteration copies (at most 1 step
                     # lost to a death its copies cover); --peer-copy-every K trades steps at risk for the copies' time


@dataclass(frozen=True)
class Strategy:
    name: str
    summary: str
    settings: tuple = ()      # --set items of every job of this scheme
    spares: bool = False      # start warm spares (tft.spares) for the dead ranks it will meet
    exact: bool = True        # must end bit for bit where a fault-free run does
    needs: str = ""           # what the settings stand for, named when they are missing


STRATEGIES = {
    "periodic": Strategy("periodic", "restart from the last periodic checkpoint"),
    "ttp": Strategy("ttp", "last-gasp checkpoint of the newest step (tft.ttp), then a restart",
                    ("tft.ttp=true",), needs="tft.ttp (the last-gasp checkpoint)"),
    "arf": Strategy("arf", "repair in the job: a warm spare or a spawned process takes a dead rank's place "
                    "(tft.arf), a UCE is repaired from the replica (tft.uce)",
                    ("tft.arf=true", "tft.uce=true"), spares=True, needs="tft.arf and tft.uce (in-job repair)"),
    "elastic": Strategy("elastic", "go on in the job with fewer ranks (tft.elastic)", ("tft.elastic=true",),
                        exact=False, needs="tft.elastic (in-job elastic recovery)"),
    "peer": Strategy("peer", "last gasp (tft.ttp) with each rank's state copied into another host's memory every "
                     f"{PEER_COPY_EVERY} step(s) (tft.peer_copy_every), then a restart",
                     ("tft.ttp=true", f"tft.peer_copy_every={PEER_COPY_EVERY}"),
                     needs="tft.peer_copy_every (peer copies in memory)"),
}


def with_peer_copy_every(strategy: Strategy, k: int) -> Strategy:
    """The `peer` scheme copying every k steps (--peer-copy-every); any other scheme as it is."""
    if strategy.name != "peer":
        return strategy
    return replace(strategy, summary=strategy.summary.replace(f"every {PEER_COPY_EVERY} step(s)", f"every {k} step(s)"),
                   settings=("tft.ttp=true", f"tft.peer_copy_every={k}"))


def unavailable(strategy: Strategy, config: Optional[str], overrides=()) -> Optional[str]:
    """None when this dsim can run the scheme; otherwise one sentence naming what is missing."""
    try:
        load_config(config, [*overrides, *strategy.settings])
    except ConfigError as e:
        if "unknown key" in str(e):
            return (f"strategy {strategy.name} needs {strategy.needs}, which this dsim does not have "
                    f"({str(e).split(' (known')[0]})")
        raise
    return None


def parse(names: str) -> list[Strategy]:
    """`periodic,ttp` -> the strategies, in that order; ValueError naming an unknown one."""
    out = []
    for name in (n.strip() for n in names.split(",")):
        if name not in STRATEGIES:
            raise ValueError(f"--strategy: unknown strategy {name!r} (known: {', '.join(STRATEGIES)})")
        if STRATEGIES[name] not in out:
            out.append(STRATEGIES[name])
    return out
