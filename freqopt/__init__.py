"""freqopt: find GPU clock settings that cut the energy of large-model training within a slowdown budget.

The layers, each looking only down: gpus and backends (the GPU, simulated or real) -> models and trace (the
workload's kernels) -> search (Optuna studies, budget allocation, validation) -> tables -> cli.
"""

__version__ = "0.1.0"
