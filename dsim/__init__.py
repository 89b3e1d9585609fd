"""dsim: distributed deep-learning training on real MPI ranks, and its recovery from faults.

Data flow: config -> parallel layout -> model/optimizer -> data -> training loop.
"""
__version__ = "0.1.0"
