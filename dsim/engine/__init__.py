"""The training loop: Model, callbacks, and the builder that wires a run together."""
from .builder import Run, build_run, resolve_layout
from .callbacks import Callback, EvalMonitor, LossMonitor, MetricsLog, ProgressBar, RunContext, TimeMonitor, event
from .model import Model

__all__ = ["Run", "build_run", "resolve_layout", "Callback", "EvalMonitor", "LossMonitor", "MetricsLog", "ProgressBar",
           "RunContext", "TimeMonitor", "Model", "event"]
