"""fastrl benchmarks: the CLI (``python -m bench``), every command's points on one harness (``session_run``).

Modules: ``workloads`` (W1-W3, C1, C1-loss, sweeps, FLOP and byte counts), ``providers`` (fastrl and the tools people
use instead), ``measure`` (CPU and CUDA timing and memory, accuracy against float64), ``session_run`` (the
harness: measuring processes, rows as they finish, watchdog), ``session_points`` (what one process measures),
``lmhead`` (the points of run / c1 / gpu, with progress), ``report`` (JSON, CSV, plots, the summary table), ``w4``
(W4: a GRPOTrainer step per completion length, stock TRL vs fastrl). Importing this package imports nothing heavy.
"""
