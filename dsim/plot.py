"""Draw a run's loss curve from its metrics.jsonl, with the job's events (fault, resume, repair, ...) marked.

    $ python -m dsim.plot runs/default -o loss.png

metrics.jsonl accumulates over runs and resumes: each `train_begin` starts a new segment, drawn in its
own colour. Every event other than step/train_begin/train_end/eval that carries a global step is marked on
the curve with its name (and rank, when it names one), whatever its kind. The held-out accuracy of `eval`
events (data.eval_samples, dsim.EvalMonitor) is drawn against a second axis on the right. Needs matplotlib
(`pip install dsim[plot]`); without it: one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

LABEL_ROWS = 6
QUIET = {"step", "train_begin", "train_end", "eval", "checkpoint_committed"}
EVENT_STYLES = [("crimson", "X"), ("darkviolet", "o"), ("saddlebrown", "s"), ("teal", "D"), ("black", "^"),
                ("darkorange", "P")]  # (colour, marker) per kind of event, in order of first appearance


@dataclass
class Segment:
    """One run (from a train_begin): its steps and where it started."""

    begin: dict
    steps: list = field(default_factory=list)   # (global_step, loss)


@dataclass
class Metrics:
    segments: list
    events: list      # the marked events: dicts with "event" and "global_step"
    skipped: int = 0  # lines that were not JSON objects
    accuracy: list = field(default_factory=list)  # (global_step, held-out accuracy) of the eval events


def read_metrics(path) -> Metrics:
    """Split metrics.jsonl into segments (one per train_begin) and the events to mark."""
    segments, events, skipped, accuracy = [], [], 0, []
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
                kind = rec["event"]
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            if kind == "train_begin" or (kind == "step" and not segments):
                segments.append(Segment(rec))
            if kind == "step" and isinstance(rec.get("loss"), (int, float)):
                segments[-1].steps.append((rec["global_step"], rec["loss"]))
            elif kind == "eval" and isinstance(rec.get("accuracy"), (int, float)):
                accuracy.append((rec.get("global_step"), rec["accuracy"]))
            elif kind not in QUIET and isinstance(rec.get("global_step"), int):
                events.append(rec)
    return Metrics([s for s in segments if s.steps], events, skipped, accuracy)


def label(ev: dict) -> str:
    """`fault (rank 3) @ 60`, `resume @ 60`, `repair (rank 0 from 4) @ 60`: the event and whom it concerns."""
    text, rank = ev["event"], ev.get("rank")
    if rank == "all":
        text += " (all ranks)"
    elif rank is not None and (rank != 0 or ev["event"] in ("fault", "repair")):
        text += f" (rank {rank}" + (f" from {ev['donor']}" if "donor" in ev else "") + ")"
    return f"{text} @ {ev['global_step']}"


def loss_at(metrics: Metrics, step: int):
    """The loss logged at a global step (the latest segment's, if several), else the nearest before it."""
    best = None
    for seg in metrics.segments:
        for s, loss in seg.steps:
            if s <= step and (best is None or s >= best[0]):
                best = (s, loss)
    return best[1] if best else (metrics.segments[0].steps[0][1] if metrics.segments else 0.0)


def draw(metrics: Metrics, out, title: str) -> None:
    """Loss vs global step, a line per segment, each event a marker with its label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for i, seg in enumerate(metrics.segments):
        xs, ys = zip(*seg.steps)
        start = seg.begin.get("global_step", xs[0] - 1)
        name = "run 1" if i == 0 else f"run {i + 1} (from step {start})"
        ax.plot(xs, ys, lw=1.4, label=f"{name}: steps {xs[0]}-{xs[-1]}")
    styles = {}
    right = max(s for seg in metrics.segments for s, _ in seg.steps)
    rows = min(len(metrics.events), LABEL_ROWS)
    for i, ev in enumerate(metrics.events):
        step = ev["global_step"]
        color, marker = styles.setdefault(ev["event"], EVENT_STYLES[len(styles) % len(EVENT_STYLES)])
        ax.axvline(step, color=color, lw=0.8, ls="--", alpha=0.7)
        ax.plot([step], [loss_at(metrics, step)], ls="none", marker=marker, ms=9, mfc="none", mew=1.8,
                color=color, zorder=5)
        n = i % LABEL_ROWS  # a row of its own for each label, in a band above the curve
        flip = step > 0.7 * right
        ax.annotate(label(ev), (step, 0.97 - 0.07 * n), xycoords=("data", "axes fraction"), xytext=(-5 if flip else 5, 0),
                    textcoords="offset points", ha="right" if flip else "left", va="top", fontsize=9, color=color,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "lw": 0.6, "alpha": 0.9})
    if rows:
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, lo + (hi - lo) / (1 - 0.07 * rows - 0.03))
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if metrics.accuracy:
        acc = ax.twinx()
        xs, ys = zip(*sorted(metrics.accuracy))
        handles += acc.plot(xs, ys, color="seagreen", ls=":", marker="o", ms=5, lw=1.2, label="held-out accuracy")
        labels.append("held-out accuracy")
        acc.set_ylabel("held-out accuracy")
        acc.set_ylim(0, 1.05)
    ax.legend(handles, labels, loc="lower left", fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsim.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run", metavar="RUN_DIR", help="a run's output directory (holding metrics.jsonl), or the file")
    parser.add_argument("-o", "--output", metavar="PNG", help="image to write (default: RUN_DIR/loss.png)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    path = run / "metrics.jsonl" if run.is_dir() else run
    try:
        if not path.is_file():
            raise ValueError(f"no metrics.jsonl in {run}" if run.is_dir() else f"no such run directory or file: {run}")
        metrics = read_metrics(path)
        if not metrics.segments:
            raise ValueError(f"{path} holds no step with a loss (not a dsim metrics file?)")
    except (ValueError, OSError, UnicodeDecodeError) as e:
        print(f"dsim: error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("dsim: error: plotting needs matplotlib: pip install dsim[plot] (or pip install matplotlib)",
              file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else (run if run.is_dir() else run.parent) / "loss.png"
    draw(metrics, out, f"{path.parent.name}: loss per global step")
    n = sum(len(s.steps) for s in metrics.segments)
    marks = ", ".join(f"{e['event']}@{e['global_step']}" for e in metrics.events) or "none"
    evals = f", {len(metrics.accuracy)} evaluation(s)" if metrics.accuracy else ""
    print(f"wrote {out}: {len(metrics.segments)} segment(s), {n} steps{evals}, events: {marks}")
    return 0


if __name__ == "__main__":
    from . import guard
    guard.run(main)
