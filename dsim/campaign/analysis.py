"""A combination's figures, read from what its jobs left: metrics.jsonl (written by the jobs themselves),
the fault plan's markers (which failures fired) and the checkpoints.

Per failure (a `fault` event of the plan, written by the victim as it strikes inside step N; a `node`
failure's names every rank of the node, `ranks`):
- how it was met: `heal` / `uce_repair` naming the rank, or the `recovered` event of the next finished
  step (in the job; when rank 0 itself is replaced, the repair's own event does not reach metrics.jsonl), or
  a restart (the `train_begin` of the next job); a failure is *seen* when one of them, or a
  `last_gasp_saved` / `last_gasp_lost` naming the rank, follows it;
- a `slow` failure (a straggler) is a death once the straggler watch kills it (a `straggler` event naming the
  rank, `evicted`; reported only, it is seen but goes on, slow, until a restart ends its process): from then on
  it is met as a kill, and its steps lost and promise count from that kill; its recovery from its onset;
- resumed from: the step the repair or the restart went on from (the event's global step);
- steps lost: the steps finished before it (N - 1) less the step it resumed from, at least 0; beside it
  what the scheme promises: 0 in the job, else back to the newest checkpoint of a step before it that was
  committed by the time the restart met it (a `checkpoint_committed` event: an async save the failure cut short
  never commits, while one whose shards were all written commits even when rank 0 logs it just after the
  failure struck; not one whose file a `corrupt` failure damaged where no replica can repair it), or a last gasp
  since, or the survivors' rescue files of a lost host when the resume found them whole (`rescue_completed`);
- recovery: from the failure to the next finished step (the resumed-from step + 1: its `step` event, a
  later step's, or a last gasp of it or a later step, as when rank 0 dies inside the update of a step its
  replicas finished: then that step has no `step` event);
  *recovered* when that step finished before the campaign stopped the job: at the end of the budget, or,
  when a failure struck within it was still being recovered then, once it was (at most runner.TAIL later).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

IN_JOB = ("heal", "uce_repair", "sdc_rollback")


def read_events(path) -> list[dict]:
    """metrics.jsonl as a list of dicts in file order (unparsable lines skipped)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and "event" in e and "time" in e:
            out.append(e)
    return out


def percentile(values, q: float):
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    v = sorted(values)
    if not v:
        return None
    x = (len(v) - 1) * q / 100
    lo, hi = math.floor(x), math.ceil(x)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


def failures(events: list, end: float, restarts=(), broken=None, until=None) -> list[dict]:
    """One record per fault of the plan before `end` (see the module docstring), met and recovered by `until`
    (default `end`: the campaign lets the job go on after its budget until the failures in it are recovered);
    `restarts`: when each job after the first was started (a newcomer that takes a dead rank's place in the
    job also logs a `train_begin`, so only those after a restart count as one); `broken`: {plan index:
    checkpoint name} for each `corrupt` failure that damaged a file no replica can repair: from it on, that
    checkpoint is not promised."""
    faults = [e for e in events if e["event"] == "fault" and e.get("plan_index") is not None and e["time"] <= end]
    until = end if until is None else max(end, until)
    struck = {f["plan_index"]: f["time"] for f in faults}
    out = []
    for f in faults:
        gone = {name for i, name in (broken or {}).items() if struck.get(i, math.inf) <= f["time"]}
        restart = min((t for t in restarts if t >= f["time"]), default=math.inf)
        after = [e for e in events if e["time"] >= f["time"] and e["time"] <= until]
        # a slow rank dies only once the straggler watch kills it: from then on it is met as a dead one
        evicted = next((e for e in after if f["kind"] == "slow" and e["event"] == "straggler" and e.get("evicted")
                        and e.get("rank") == f["rank"] and e["time"] < restart), None)
        meet, noticed = None, False
        for e in after:
            if (e["event"] in IN_JOB and e["time"] < restart
                    and f["rank"] in (e.get("failed") or []) + (e.get("damaged") or [])):
                meet = ("in the job", e["global_step"], e)
                break
            if (e["event"] == "recovered" and e["time"] < restart and f["kind"] != "sdc"  # the repair's own event
                    and (f["kind"] != "slow" or evicted is not None and e["time"] > evicted["time"])):
                # may be missing; a flipped bit is met by its rollback or a restart, never by another's repair, and
                # a slow rank by nothing before the watch kills it
                meet = ("in the job", e["global_step"] - 1, e)  # (see below): the step after it finished
                break
            if e["event"] == "train_begin" and e["time"] >= restart:
                meet = ("restart", e["global_step"], e)
                break
            if e["event"] in ("last_gasp_saved", "last_gasp_lost") and f["rank"] in e.get("failed", []):
                noticed = True  # the survivors saw it; the restart that follows says where training went on
            if e["event"] == "straggler" and e.get("rank") == f["rank"] and f["kind"] == "slow":
                noticed = True  # reported (and, with tft.straggler_evict, killed: met as a dead rank after)
        before = f["global_step"] - 1  # the fault strikes inside step N: N - 1 steps were finished
        if f["kind"] == "slow":  # nothing is lost before it is killed, only time (the straggler's last heartbeat
            # names the step it was in); not killed, the restart that ends it is another failure's, whose steps those are
            before = evicted["global_step"] - 1 if evicted else meet[1] if meet else before
        if f["kind"] == "sdc":  # silent: training goes on on the damage until a check finds it, all of it lost
            # (unless the job restarts first, from a checkpoint compared before it was saved: the damage is gone)
            found = next((e for e in after if e["event"] == "sdc" and e["time"] < restart), None)
            before = found["global_step"] if found else before
        rec = {"index": f["plan_index"], "time": f["time"], "rank": f["rank"], "ranks": f.get("ranks", [f["rank"]]),
               "kind": f["kind"], "at": f.get("at"),
               "step": f["global_step"], "seen": meet is not None or noticed, "how": meet[0] if meet else None,
               "resumed_from": meet[1] if meet else None, "steps_lost": None, "predicted_lost": None,
               "recovery_s": None, "recovered": False,
               # a flipped bit is found by comparing replicas: in a layout without data parallelism (an elastic
               # shrink down to dp=1) no check can find it, and no repair follows
               "findable": f["kind"] != "sdc" or (layout_at(events, f["time"]) or {}).get("data_parallel") != 1}
        if meet is not None:
            rec["steps_lost"] = max(0, before - meet[1])
            # what the scheme that met it promises: nothing lost in the job; after a restart, back to the newest
            # checkpoint of a step before it committed by the time it was met (an async save the failure cut short
            # never commits; one whose every shard was written does, even when rank 0 writes the record a moment
            # after the failure struck: the resume takes it), or a last gasp saved since, or the rescue files the
            # survivors of a job Open MPI ended at once (a host lost) wrote from their peer copies, when the resume
            # found them whole and committed them (dsim.ft.rescue)
            saved = [e["global_step"] for e in events if e.get("checkpoint") not in gone and (
                     e["event"] == "checkpoint_committed" and e["time"] < meet[2]["time"] and e["global_step"] <= before
                     or e["event"] in ("last_gasp_saved", "rescue_completed") and e["time"] < meet[2]["time"]
                     and e["global_step"] <= (before + 1 if f["kind"] == "slow" else f["global_step"]))]
            newest = max([0, *saved])
            rolled = meet[2]["event"] == "sdc_rollback"  # in the job, but back to a checkpoint
            rec["predicted_lost"] = (0 if meet[0] == "in the job" and not rolled or f["kind"] == "slow" and not evicted
                                     else max(0, before - newest))
            # the next step finished: its step event or a later step's, or a last gasp of it or later (rank 0,
            # which logs steps, may die inside the update of a step its replicas finished: the gasp saves that
            # step, or an elastic shrink goes on after it and the new rank 0 logs the steps that follow)
            done = next((e.get("noticed_at", e["time"]) for e in events if e["time"] > meet[2]["time"] - 1e-9
                         and e.get("noticed_at", e["time"]) <= until
                         and e["event"] in ("step", "last_gasp_saved") and e["global_step"] > meet[1]), None)
            if done is not None:
                rec["recovered"], rec["recovery_s"] = True, round(done - f["time"], 3)
        out.append(rec)
    return out


def layout_at(events: list, t: float):
    """The layout training ran in at time t: the last `train_begin`'s or elastic shrink's before it (None: none)."""
    last = None
    for e in events:
        if e["time"] > t:
            break
        if e["event"] in ("train_begin", "elastic") and e.get("layout"):
            last = e["layout"]
    return last


def _runs_of_steps(events: list, end: float) -> list[tuple]:
    """(global_step, seconds, time) of every step that directly followed the previous one in the same run."""
    out, prev = [], None
    for e in events:
        if e["time"] > end:
            break
        if e["event"] == "step":
            if prev is not None and e["global_step"] == prev["global_step"] + 1:
                out.append((e["global_step"], e["time"] - prev["time"], e["time"]))
            prev = e
        elif e["event"] != "checkpoint_committed":  # a save inside the step is part of its time
            prev = None  # a fault, a repair or a new run in between: not an ordinary step
    return out


def step_times(events: list, end: float) -> list[tuple]:
    """(global_step, seconds) of every step that directly followed the previous one in the same run."""
    return [(g, s) for g, s, _ in _runs_of_steps(events, end)]


def checkpoint_cost(events: list, end: float, save_every: int) -> dict:
    """Ordinary step time, and what a save costs (median over saves), from the step events.

    A save costs the steps it runs beside what they took beyond an ordinary step: the step that saves, and,
    when the save is async, every later step up to the one in which it was committed (the background write
    slows them). An ordinary step is one no save ran beside."""
    runs = _runs_of_steps(events, end)
    commits = [(e["global_step"], e["time"]) for e in events if e["event"] == "checkpoint_committed"
               and e["time"] <= end]
    windows, i = [], 0  # for each saving step: the indices into `runs` of the steps the save ran beside
    while i < len(runs):
        g, seconds, t = runs[i]
        if g % save_every:
            i += 1
            continue
        # its commit: the first of its step after the step began (a sync save commits inside it; none: killed)
        done = next((c for s, c in commits if s == g and c > t - seconds), None)
        j = i
        while (done is not None and done > runs[j][2] and j + 1 < len(runs) and runs[j + 1][0] == runs[j][0] + 1
               and runs[j + 1][0] % save_every):
            j += 1
        windows.append(range(i, j + 1))
        i = j + 1
    beside = {k for w in windows for k in w}
    plain = [s for k, (g, s, _) in enumerate(runs) if k not in beside]
    step = statistics.median(plain) if plain else None
    save = None
    if windows and step is not None:
        save = max(0.0, statistics.median(sum(runs[k][1] - step for k in w) for w in windows))
    rate = len(plain) / sum(plain) if plain else None  # steps per second of the steps no save ran beside
    return {"step_s": step, "save_s": save, "saves": len(windows), "rate": rate}


def progress(events: list, end: float, over=()) -> int:
    """The global step training had reached when the budget ran out (the last step event before `end`); `over`: when
    jobs started over from scratch (on a cluster, every checkpoint lost with a crashed host's disk), the steps before
    the last such start lost with them."""
    since = max((t for t in over if t <= end), default=None)
    steps = [e["global_step"] for e in events if e["event"] == "step" and e["time"] <= end
             and (since is None or e["time"] >= since)]
    return steps[-1] if steps else 0


def losses_equal(events: list, end: float, reference: dict) -> dict:
    """Every loss logged before `end` against the fault-free run's at the same global step, bit for bit; but a
    loss of a step trained on silently corrupted state and then trained again: `discarded`. Such a step was
    logged before a check found the corruption (an `sdc` event) and the rollback, or after a bit flipped (an
    `sdc` fault) and before any check found it, the job restarting before one did."""
    found = [e["time"] for e in events if e["event"] == "sdc"]
    flips = [e["time"] for e in events if e["event"] == "fault" and e.get("kind") == "sdc"]

    def on_damage(t):  # after a flip that no check had found yet
        return any(f < t and not any(f < x < t for x in found) for f in flips)

    steps = [e for e in events if e["event"] == "step" and e["time"] <= end]
    again, discarded = {}, set()  # global step -> time it was next logged (walking backwards)
    for i in range(len(steps) - 1, -1, -1):
        e = steps[i]
        nxt = again.get(e["global_step"])
        if nxt is not None and (any(e["time"] < t < nxt for t in found) or on_damage(e["time"])):
            discarded.add(i)
        again[e["global_step"]] = e["time"]
    compared = differ = beyond = 0
    first = None
    for i, e in enumerate(steps):
        if i in discarded:
            continue
        ref = reference.get(e["global_step"])
        if ref is None:
            beyond += 1
        elif ref == e["loss"]:
            compared += 1
        else:
            compared += 1
            differ += 1
            first = first if first is not None else e["global_step"]
    return {"compared": compared, "differ": differ, "first_difference": first, "beyond_reference": beyond,
            "discarded": len(discarded)}


def evictions(recs: list, events: list, end: float) -> tuple[int, int]:
    """(ranks the straggler watch killed, how many of them no `slow` failure had struck): a healthy rank past
    tft.straggler_factor on a busy machine is a false alarm, and its kill a failure the scheme pays for like any
    other. A healthy rank counts if killed within the budget; a slow one struck within it (`recs`) also when killed
    after it, while the campaign waited for its recovery: that kill is how it is recovered."""
    slow = sorted((r["time"], r["rank"]) for r in recs if r["kind"] == "slow")
    used, kills, healthy = set(), 0, 0
    for e in events:
        if e["event"] != "straggler" or not e.get("evicted"):
            continue
        i = next((i for i, (t, rank) in enumerate(slow) if i not in used and rank == e.get("rank") and t <= e["time"]),
                 None)
        if i is not None:
            used.add(i)
            kills += 1
        elif e["time"] <= end:
            kills += 1
            healthy += 1
    return kills, healthy


def summarize(recs: list, events: list, start: float, end: float, save_every: int, fault_free_rate, over=()) -> dict:
    """The combination's row: goodput, failures, losses, recovery times, checkpoint overhead (over: progress's)."""
    cost = checkpoint_cost(events, end, save_every)
    steps = progress(events, end, over)
    seconds = end - start
    seen = [r for r in recs if r["seen"]]
    lost = [r["steps_lost"] for r in seen if r["steps_lost"] is not None]
    rec_s = [r["recovery_s"] for r in recs if r["recovered"]]
    saves = sum(1 for e in events if e["event"] == "step" and e["time"] <= end and e["global_step"] % save_every == 0)
    evicted, healthy = evictions(recs, events, end)
    return {
        "steps": steps, "seconds": round(seconds, 3),
        "goodput": round(steps / seconds, 3),
        "goodput_fraction": round(steps / seconds / fault_free_rate, 4) if fault_free_rate else None,
        "failures_injected": len(recs), "failures_seen": len(seen),
        "survived": sum(r["recovered"] for r in recs), "unrecovered": len(recs) - sum(r["recovered"] for r in recs),
        "steps_lost": lost, "steps_lost_per_failure": round(statistics.mean(lost), 2) if lost else None,
        "steps_lost_predicted": [r["predicted_lost"] for r in seen if r["predicted_lost"] is not None],
        "recovery_median_s": percentile(rec_s, 50), "recovery_p90_s": percentile(rec_s, 90),
        "step_s": cost["step_s"], "save_s": cost["save_s"],
        "checkpoint_overhead": (round(saves * cost["save_s"] / seconds, 4)
                                if cost["save_s"] is not None else None),
        "restarts": sum(r["how"] == "restart" for r in recs),
        "stragglers_evicted": evicted, "healthy_evicted": healthy,
    }
