"""Fault injection: raise like the seed's myCallback, or SIGKILL a rank's own process.

Three modules: `plan` (what strikes, where and when: the points, a fault plan's entries and the registry of
the campaign's processes), `injector` (FaultInjector, the callback that arms a configured fault on the loop's
points, and the hooks the save, the last gasp and the repair call) and `actions` (what each kind of fault does
to the rank it strikes: one dispatch, `strike`, for the configured fault and a plan's alike); `config` holds
the `fault:` section of a run's config.

`fault: {kind: exception | kill | uce | hang | stuck | deadlock | unmatched | slow | sdc, rank: R, step: N, epoch: E,
at: POINT}`
- kind sdc: one bit of one of rank R's parameters flips, and nothing reports it (silent data corruption;
  tft.sdc_check_every finds it by comparing replicas: dsim.ft.sdc);
- kind hang: rank R stops (SIGSTOP): it neither dies nor goes on, and the others wait for it in their next
  collective (until tft.hang_timeout's watch kills it: dsim.ft.hang);
- kind slow: from that point on, rank R computes fault.slowdown (4) times slower (after each layer and each
  parameter's update it sleeps as long again, times slowdown - 1): a throttled device or a degraded node, a
  straggler the others wait for in every collective (tft.straggler_factor finds it: dsim.ft.straggler);
  at forward, allreduce or update only;
- kind stuck: rank R's training stops while its process runs (its main thread sleeps for ever, its threads
  go on: a deadlock, a read that never returns); at forward, allreduce, update, save, step_end or epoch_end
  only (found by the same watch; at save, a write to a dead file system: with async_save, its background
  writer stops; at step_end or epoch_end, a callback that never returns);
- kind deadlock: rank R waits for a message that never comes, on a communicator outside the job's (MPI_COMM_SELF),
  at the same points as stuck: every rank then waits, none frozen or stuck, and after tft.deadlock_timeout the
  hang watch breaks the deadlock: it revokes the job's communicators, and kills rank R, which nothing else frees
  (dsim.ft.hang); kind unmatched: rank R waits, on the job's world, for a message no rank sends (a receive with
  no matching send, as collectives that do not match leave a rank): the revoke frees every rank, none dies;
- kind uce: an uncorrectable memory error (UCE): half of rank R's parameter and optimizer-state buffers
  become garbage and UCEError is raised on that rank, as the hardware would report it;
- at step_end (with step) / epoch_end (with epoch): after that step or epoch finished (and was saved,
  when a checkpoint is due: ModelCheckpoint runs first);
- at forward / allreduce / update: in the middle of step N's forward pass (half the layers done), of its
  gradient all-reduce over data parallel (between the reduce-scatter and the all-gather), or of its
  optimizer update (half the parameters updated): the other ranks are inside that phase's collectives;
- at save: rank R dies half-way through writing its file of the checkpoint due at step N (with async_save,
  its training waits for that write: it dies before starting step N+1, the others inside that step);
- at commit: rank R dies after every file of that checkpoint is written, before the commit record.
rank null means every rank (for exceptions); a list such as [0, 4] names several (they all fire), and with
a list of steps as long as it, each rank fires at its own step (rank: [0, 5], step: [6, 13]).
`last_gasp_kill: R` also kills rank R half-way through writing its last-gasp files: a second failure
while the survivors save; `last_gasp_stuck: R` makes that write never return instead (a dead file system:
tft.hang_timeout's watch kills it, and the others save without it).
`repair_kill: R` kills rank R during a repair in the job (tft.arf, tft.spares, tft.uce), and `repair_hang: R`
freezes it there (tft.hang_timeout's watch kills it): at `repair_at: refill` (the default) the survivors have
agreed on the step and the dead rank's place is not filled yet, at `exchange` the new world is formed and the
state has not moved. Either way the repair is given up on every living rank alike and the last gasp follows.
`repair_stuck: R` makes rank R's repair stop there while its process runs (tft.hang_timeout's watch finds it stuck:
the repair is work watched, its collectives waits).
Naming a dead rank, with `repair_at: exchange`, they strike the newcomer that takes its place (a warm spare or
a spawned process) before the state moves. `spare_hang: true` freezes the warm spares (tft.spares) as they begin to wait (dsim.train): a hot spare node
that hung, found by tft.hang_timeout's watch when a repair waits for it, or at the end of training.
kind plan: the failures of a fault plan, the JSON file named by $DSIM_FAULT_PLAN (python -m dsim.campaign
writes it): each entry {time, rank, kind: kill | uce | corrupt | node | host | hang | stuck | deadlock | unmatched | sdc |
slow, at: forward | allreduce | update | save | commit} fires
once, on that rank (modulo the ranks training, which an elastic shrink lowers), at the first such point reached
at or after `time` (Unix seconds; 0 if left out), or, for kill, corrupt, hang and stuck, at a point of a repair in
the job its survivor reaches first (refill or exchange: see repair_at), and, with `step: N`, in global step N or later (a plan
written by hand: {"faults": [{"rank": 1, "kind": "sdc", "at": "forward", "step": 9}, ...]}); `corrupt` kills here (the campaign damages the rank's file on disk); `node`
(with `node_size: n`) is a lost server: every rank of the victim's node (on more than one host, the ranks on the
victim's host, as MPI found them: dsim.parallel.hosts; else n consecutive ranks of those training, ranks 0..n-1 the
first node) dies at that moment, the victim SIGKILLing the others, then itself; `host` is a host's crash on real
hosts: the same ranks die, and Open MPI's daemon there (prted, the victim's parent) first; `slow` (with
`slowdown: s`, default 4) makes the rank compute s times slower for the rest of its process's life. For that, each
process records its pid as its rank's in <plan>.ranks/ when it loads the plan. A fired entry is marked by a
file created exclusively in <plan>.fired/, so a restarted job, a warm spare or a spawned replacement that takes
the rank never fires it again.
"""
from __future__ import annotations

from .actions import (GARBAGE_BLOCK, InjectedFault, Strike, UCEError, corrupt, flip_bit, freeze, garble, kill,
                      slow_down, stall, strike, wait_for_nothing)
from .injector import (FaultInjector, armed, at_point, during_last_gasp, during_repair, newcomer_in_repair,
                       strikes)
from .plan import (DEATH_KINDS, PLAN_AT, PLAN_ENV, PLAN_KINDS, PLAN_POINTS, POINTS, REPAIR_KINDS, REPAIR_POINTS,
                   STUCK_POINTS, FaultPlan, claim_entry, fired_marker, kill_registered, node_of, on_hosts,
                   plan_error, register, registry, same_process, started)

__all__ = ["GARBAGE_BLOCK", "InjectedFault", "Strike", "UCEError", "corrupt", "flip_bit", "freeze", "garble", "kill",
           "slow_down", "stall", "strike", "wait_for_nothing",
           "FaultInjector", "armed", "at_point", "during_last_gasp", "during_repair", "newcomer_in_repair", "strikes",
           "DEATH_KINDS", "PLAN_AT", "PLAN_ENV", "PLAN_KINDS", "PLAN_POINTS", "POINTS", "REPAIR_KINDS", "REPAIR_POINTS",
           "STUCK_POINTS", "FaultPlan", "claim_entry", "fired_marker", "kill_registered", "node_of", "on_hosts",
           "plan_error", "register", "registry", "same_process", "started"]
