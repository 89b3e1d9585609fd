"""What a run tells: `say` prints a line for the person watching, `event` records one in the job's metrics.jsonl.

The bottom layer: every package may import it, and it imports nothing of dsim. Events go through Python's logging,
to the logger `dsim.events`: the running training's MetricsLog (dsim.engine.callbacks) attaches the handler that
writes metrics.jsonl at its begin and detaches it at its end, so no state of dsim's is kept here; outside training
(no handler attached) an event is dropped.
"""
from __future__ import annotations

import logging
import sys

EVENTS = logging.getLogger("dsim.events")
EVENTS.propagate = False  # events are records for metrics.jsonl, not lines for the terminal
EVENTS.setLevel(logging.INFO)


def say(message: str) -> None:
    """Print a log line without tearing a progress bar (one can show only once ProgressBar imported tqdm)."""
    bars = sys.modules.get("tqdm")
    if bars is not None:
        bars.tqdm.write(message, file=sys.stdout)
    else:
        print(message, file=sys.stdout)
    sys.stdout.flush()


def event(name: str, any_rank: bool = False, **fields) -> None:
    """Record an event (fault, resume, repair, last_gasp_saved, ...) in the running job's metrics.jsonl.

    Rank 0 writes; with any_rank=True the calling rank writes too (e.g. a survivor when rank 0 is dead).
    Outside training (no MetricsLog running) this does nothing.
    """
    if EVENTS.handlers:
        EVENTS.info(name, extra={"dsim_fields": fields, "dsim_any_rank": any_rank})


def recording() -> bool:
    """Whether a running training records events (a MetricsLog is attached)."""
    return bool(EVENTS.handlers)
