"""What a job does when a rank dies or its memory fails (MindSpore's TFT), for the CLI and for scripts alike.

The CLI turns it on with `tft:` in the config or MS_ENABLE_TFT; a script as the seed pages do, with
`nn.OptTFTWrapper(optimizer)` and one of these callbacks in `model.train(..., callbacks=[...])`:

- TFTRegister(ctrl_rank_id, ctrl_ip, ctrl_port, ckpt_save_path): the last-gasp checkpoint (TTP). When a rank
  dies the survivors save the newest step every slice still has under ckpt_save_path
  (`tft_saved_checkpoints-step_{n}/rank_{r}/ttp_rank_{r}-{epoch}_{step}.h5`) and the job ends (exit 1).
  dsim has no controller process (the survivors agree among themselves), so the controller's rank, address
  and port are accepted and unused, and killing rank 0 saves too.
- TrainFaultTolerance(ckpt_save_path): besides, a rank whose memory fails (UCE) is repaired from its replica
  in the job and training goes on; the last gasp stays the fallback.
MS_ENABLE_TFT='{TTP:1,UCE:1}' adds its switches to the callback's. Replacing a dead process (ARF, warm
spares) and going on with fewer ranks (elastic) rebuild the run from a config, so they are the CLI's only.
"""
from __future__ import annotations

import os
import time
import traceback

from ..engine.callbacks import Callback
from ..log import event, leave, tell


def handle_process_failure(run, error) -> int:
    """An MPI call failed, a UCE was raised or could not be repaired: last gasp (when on), report; exit status."""
    from . import ulfm
    from .inprocess import CannotRepair
    why = ulfm.unavailable_reason()
    if why:  # without fault tolerance this rank crashes, and MPI ends the job
        tell(f"dsim: error: rank {run.groups.world.rank}: {error} (no fault tolerance: {why})")
        leave(1)
    if isinstance(error, CannotRepair) and error.lead:
        no_repair(str(error))
    return on_process_failure(run, time.time(), error)


def is_failure(exc) -> bool:
    """A failure of the job's processes, which the last gasp handles: an MPI error (a dead rank, a revoke), a UCE, a
    repair in the job that could not be made, or a pickled collective a death cut short (ulfm.cut_short)."""
    from mpi4py import MPI

    from ..faults import UCEError
    from . import ulfm
    from .inprocess import CannotRepair
    return isinstance(exc, (MPI.Exception, UCEError, CannotRepair)) or ulfm.cut_short(exc)


def no_repair(reason: str, **fields) -> None:
    """Said by one rank: the repair in the job is not made (why), and the last gasp follows; a no_repair event."""
    tell(f"dsim: warning: no repair in the job: {reason}; falling back to the last-gasp checkpoint")
    event("no_repair", any_rank=True, reason=reason, **fields)


def on_process_failure(run, noticed_at: float, error) -> int:
    """An MPI call failed under ULFM: if a rank died (or the hang watch broke a deadlock: dsim.ft.hang), save the
    last-gasp checkpoint when it is on; report; exit 1."""
    from ..faults import UCEError
    from . import last_gasp, rescue, ulfm
    from .inprocess import RepairInterrupted
    note = run.saver.abandon("a rank failed: the last gasp saves the newest step instead" if run.cfg.tft.ttp
                             else "a rank failed") if run.saver is not None else None
    damaged = isinstance(error, UCEError) or getattr(run.optimizer, "damaged", False)
    rescue.write(run)  # before any call of MPI's fault tolerance: a host's crash may take MPI's runtime (rescue.py)
    try:
        out = (last_gasp.save(run, noticed_at) if run.cfg.tft.ttp
               else last_gasp.without_checkpoint(run, damaged, noticed_at))
    except Exception as e:  # a failure of the failure handling: one line from every rank that sees it
        tell(f"dsim: error: rank {run.groups.world.rank}: the last gasp failed: {e}")
        return 1
    if out.step is not None:  # a last gasp committed: what the rescue files hold is saved
        rescue.handled(run)
    if out.other_error:  # every rank alive and whole, no deadlock broken: an MPI error of another kind
        if ulfm.cut_short(error):  # or garbage that no death explains: a bug, its traceback
            traceback.print_exception(error)
        tell(f"dsim: error: rank {run.groups.world.rank}: {error}")
    elif out.lead:
        if isinstance(error, RepairInterrupted):
            new = sorted(set(out.failed) - set(error.failed))
            during = f"rank(s) {', '.join(map(str, new))} died during the repair" if new else \
                "another rank failed during the repair"
            no_repair(f"{error.what}; {during}", died_during=new)
        if note:
            tell(note)
        tell(f"dsim: error: {out.message()}")
    if run.runtime.cut_at is not None:  # the other side of a network cut lives on, unreachable: MPI_Finalize would
        leave(1)                          # wait for it
    return 1  # MPI_Finalize does not wait for the dead: launch/ft.sh sets OMPI_MCA_async_mpi_finalize


class TFTRegister(Callback):
    """MindSpore's TFTRegister: the last-gasp checkpoint for a script's Model.train (see the module doc)."""

    switches = {"ttp": True}

    def __init__(self, ctrl_rank_id: int = 0, ctrl_ip: str = "127.0.0.1", ctrl_port: int = 30051,
                 ckpt_save_path: str = "./ttp_checkpoints/"):
        self.ctrl_rank_id, self.ctrl_ip, self.ctrl_port = ctrl_rank_id, ctrl_ip, ctrl_port
        self.ckpt_save_path = ckpt_save_path

    def run_of(self, model, callbacks):
        """The Run the last gasp and the in-job repair work on, from the script's model and callbacks."""
        from ..checkpoint import ModelCheckpoint
        from ..config import Config, ConfigError, apply_tft_env
        from ..context import get_context
        from ..engine.run import Run
        if not hasattr(model.optimizer, "states"):
            raise ConfigError(f"{type(self).__name__} needs the optimizer wrapped: nn.OptTFTWrapper(optimizer), "
                              "as on the page")
        cfg = Config()
        for key, value in self.switches.items():
            setattr(cfg.tft, key, value)
        apply_tft_env(cfg.tft, os.environ.get("MS_ENABLE_TFT"))
        if cfg.tft.arf or cfg.tft.spares or getattr(cfg.tft, "elastic", False):
            raise ConfigError("replacing a dead process (ARF, warm spares) or going on with fewer ranks (elastic) "
                              "rebuilds the run from a config: it is for python -m dsim.train, not a script")
        cfg.tft.ckpt_save_path = str(self.ckpt_save_path)
        saver = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
        if saver is not None:  # the last gasp's files carry the same append_info as the periodic ones
            cfg.checkpoint.append_info = list(saver.config.append_info)
            cfg.checkpoint.directory = str(saver.directory)
        cfg.output.dir, cfg.seed = get_context().output_dir, model.seed
        return Run(cfg, model.groups, model.network, model.optimizer, model, model.loader, saver=saver)

    def guard_training(self, model, body, callbacks):
        """Run Model.train's loop (body) with the faults handled as MindSpore's TFT does; exit 1 after a last gasp."""
        from .inprocess import InProcessRecovery
        run = self.run_of(model, callbacks)
        if run.cfg.tft.uce and model.recovery is None:
            model.recovery = InProcessRecovery(run)
        try:
            return body()
        except Exception as e:
            if not is_failure(e):
                raise
            raise SystemExit(handle_process_failure(run, e)) from None


class TrainFaultTolerance(TFTRegister):
    """MindSpore's TrainFaultTolerance: a UCE repaired from a replica in the job, the last gasp as fallback."""

    switches = {"ttp": True, "uce": True}

    def __init__(self, ckpt_save_path: str = "./ttp_checkpoints/"):
        super().__init__(ckpt_save_path=ckpt_save_path)
