"""The campaign's report: a table on stdout, report.json, and the timeline picture (timeline.png)."""
from __future__ import annotations

import json
import math
from pathlib import Path

COLOURS = {"fault-free": "grey", "periodic": "tab:blue", "ttp": "tab:orange", "arf": "tab:green", "peer": "tab:brown",
           "elastic": "tab:purple"}
STYLES = ["-", "--", ":", "-."]


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def table(rows: list) -> list[str]:
    """The comparison, one line per combination (the fault-free run first)."""
    head = ["strategy", "every", "steps", "steps/s", "of fault-free", "failures inj/seen", "survived",
            "unrecov.", "lost/failure (pred.)", "recovery med/p90 s", "ckpt overhead", "exact"]
    lines = [head]
    for r in rows:
        if r["strategy"] == "fault-free":
            lines.append([r["strategy"], str(r["save_every"]), str(r["steps"]), _f(r["goodput"], "{:.1f}"),
                          _f(r["goodput_fraction"]), "-", "-", "-", "-", "-", _f(r.get("checkpoint_overhead"), "{:.1%}"),
                          "reference"])
            continue
        pred = r["steps_lost_predicted"]
        lost = (f"{_f(r['steps_lost_per_failure'], '{:.1f}')} ({_f(sum(pred) / len(pred) if pred else None, '{:.1f}')})")
        lines.append([r["strategy"], str(r["save_every"]), str(r["steps"]), _f(r["goodput"], "{:.1f}"),
                      _f(r["goodput_fraction"]), f"{r['failures_injected']}/{r['failures_seen']}", str(r["survived"]),
                      str(r["unrecovered"]), lost,
                      f"{_f(r['recovery_median_s'], '{:.1f}')}/{_f(r['recovery_p90_s'], '{:.1f}')}",
                      _f(r["checkpoint_overhead"], "{:.1%}"), exact_text(r)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in lines]


def exact_text(r: dict) -> str:
    """yes / NO / n/a, and what was compared: every loss, and the final checkpoint's tensors."""
    losses, state = r.get("losses") or {}, r.get("final_state") or {}
    if not r.get("exact_required"):
        return "not required"
    if "why" in losses:
        return "not checked"
    if losses.get("differ") or state.get("equal") is False:
        return "NO"
    return "yes" if state.get("equal") else "losses only"


def young_daly(rows: list, mtbf: float, ref: dict) -> list[str]:
    """Per strategy: the measured best interval beside Young/Daly's sqrt(2 C M)."""
    out = []
    for name in dict.fromkeys(r["strategy"] for r in rows if r["strategy"] != "fault-free"):
        mine = [r for r in rows if r["strategy"] == name]
        best = max(mine, key=lambda r: r["goodput"])
        yd = r_pred = None
        saves = [r["save_s"] for r in mine if r.get("save_s") is not None]
        if saves and ref.get("step_s"):
            c = sorted(saves)[len(saves) // 2]
            yd = math.sqrt(2 * c * mtbf)
            r_pred = max(1.0, yd / ref["step_s"])  # a save that costs nothing (async): every step
            out.append(f"  {name}: measured best every {best['save_every']} steps ({best['goodput']:.1f} steps/s); "
                       f"Young/Daly sqrt(2 x {c:.3f} s x {mtbf:.0f} s) = {yd:.1f} s = every {r_pred:.0f} steps "
                       f"at {1 / ref['step_s']:.1f} steps/s")
        else:
            out.append(f"  {name}: measured best every {best['save_every']} steps; no save cost measured")
        best["young_daly"] = {"interval_s": yd, "interval_steps": r_pred}
    return out


def scale_lines(rows: list, rank_mtbf_text: str) -> list[str]:
    names = list(rows[0]["strategies"]) if rows else []
    nodes = bool(rows) and "node_fatal" in rows[0]  # with a per-node MTBF: whether losing a node loses a replica set
    out = [f"  {'ranks':>7}  {'job MTBF':>9}  {'holders':>7}  " + (f"{'a node':>10}  " if nodes else "")
           + "  ".join(f"{n:>22}" for n in names)]
    for r in rows:
        cells = []
        for n in names:
            x = r["strategies"][n]
            cells.append(f"{'-':>22}" if x is None else
                         f"{x['goodput_fraction']:>7.1%} every {_interval(x['interval_s']):>7}")
        node = (f"{'fatal' if r['node_fatal'] else 'survivable':>10}  " if nodes else "")
        out.append(f"  {r['ranks']:>7,}  {_seconds(r['job_mtbf_s']):>9}  {r['holders_per_slice']:>7}  {node}"
                   + "  ".join(cells))
    return out


def _interval(s: float) -> str:
    return "never" if s > 1e8 else _seconds(s)


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def write_json(out: Path, report: dict) -> Path:
    """report.json, replaced atomically (a campaign stopped half-way keeps the last complete one)."""
    path = out / "report.json"
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    return path


def timeline(out: Path, rows: list, events_of: dict) -> Path | None:
    """Global step against wall time, one line per combination, failures (x) and recoveries (o) marked.
    None when matplotlib is missing (the `plot` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 5.5))
    intervals = sorted({r["save_every"] for r in rows})
    for r in rows:
        events = events_of.get(r["dir"], [])
        t0 = r["start"]
        pts = [(e["time"] - t0, e["global_step"]) for e in events if e["event"] == "step" and e["time"] <= r["end"]]
        if not pts:
            continue
        colour = COLOURS.get(r["strategy"], "black")
        style = STYLES[intervals.index(r["save_every"]) % len(STYLES)]
        ax.plot(*zip(*pts), style, color=colour, lw=1.2, label=f"{r['strategy']}, every {r['save_every']}")
        # after the budget, while the campaign waited for the failures in it to be recovered: faint
        tail = [(e["time"] - t0, e["global_step"]) for e in events if e["event"] == "step"
                and r["end"] < e["time"] <= r.get("settled", r["end"])]
        if tail:
            ax.plot(*zip(*[pts[-1], *tail]), style, color=colour, lw=1.0, alpha=0.35)
        for f in r.get("failures", []):
            ax.plot(f["time"] - t0, f["step"] - 1, "x", color="crimson", ms=7, mew=2)
            if f["recovered"]:
                ax.plot(f["time"] - t0 + f["recovery_s"], f["resumed_from"] + 1, "o", color=colour, ms=5, mfc="none")
    budget = max((r["end"] - r["start"] for r in rows), default=None)
    if budget and any(r.get("settled", r["end"]) > r["end"] + 0.5 for r in rows):
        ax.axvline(budget, color="grey", ls=":", lw=1, label="end of the budget (faint: waiting for a recovery)")
    ax.plot([], [], "x", color="crimson", mew=2, label="failure")
    ax.plot([], [], "o", color="black", mfc="none", label="next step finished")
    ax.set_xlabel("wall time since the start of the combination (s)")
    ax.set_ylabel("global step")
    ax.set_title("fault campaign: progress under the same failures")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
