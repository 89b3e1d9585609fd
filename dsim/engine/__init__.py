"""The training loop: Model and its callbacks, and the Run a rank trains (made by dsim.build or a script)."""
from .callbacks import Callback, EvalMonitor, LossMonitor, MetricsLog, ProgressBar, RunContext, TimeMonitor
from .model import Model
from .run import Factory, Run

__all__ = ["Factory", "Run", "Callback", "EvalMonitor", "LossMonitor", "MetricsLog", "ProgressBar",
           "RunContext", "TimeMonitor", "Model"]
