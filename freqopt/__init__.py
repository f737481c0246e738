"""freqopt: find GPU clock settings that cut the energy of large-model training within a slowdown budget.

    >>> import freqopt
    >>> result = freqopt.search("gpt3-small", max_slowdown="1%", granularity="pass")  # doctest: +SKIP
    >>> result.summary()                                                              # doctest: +SKIP

The package is grouped into wings by layer, each importing only the ones before it (tests/test_layers.py): the
foundations (errors, files, budget) -> workload/ (layouts, models, the traced kernels) -> gpu/ (GPU types, NVML,
the simulated and the real GPU, calibration) -> the clock-table format and names resolved (tables, resolve) ->
search/ (Optuna studies, budget allocation, validation) -> pipeline/ (the pipeline's DAG, planner, simulation,
search and clock table) -> api, output, worker -> apply/ (transfer, the runtime, train, statement) ->
integrations/ and measure/ (profile, benchmark, power capping) -> cli/.

The names below are imported lazily, on first use (PEP 562 module ``__getattr__``, as SciPy and Optuna do), so
``import freqopt`` loads neither torch nor optuna.

One of them shares its name with a module: ``freqopt.search`` is the function freqopt.api.search (the
subpackage is still imported as ``from freqopt.search import run_search`` or ``from freqopt.search.runner import
...``); ``freqopt.profile`` is the function freqopt.measure.profile.profile. Importing a submodule makes Python bind it
as an attribute of its package (``setattr(freqopt, "search", <module>)``), which would replace the function; the
package's module class refuses that one binding (``_Package.__setattr__``), so the function stays whatever was
imported first. The cost: the subpackage cannot be reached as an attribute (``freqopt.search.runner``,
``import freqopt.search.runner as runner``); ``from ... import`` and importlib.import_module reach it.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "search": "freqopt.api",
    "search_pipeline": "freqopt.api",
    "SearchStart": "freqopt.api",
    "profile": "freqopt.measure.profile",
    "trace_step": "freqopt.workload.step_trace",
    "DVFSRuntime": "freqopt.apply.runtime",
    "get_workload": "freqopt.workload.models",
    "list_models": "freqopt.workload.models",
    "trace_training_iteration": "freqopt.workload.trace",
    "load_table": "freqopt.tables",
    "ClockTable": "freqopt.tables",
    "SearchConfig": "freqopt.search",
    "SearchResult": "freqopt.search",
    "parse_slowdown": "freqopt.budget",
    "get_gpu": "freqopt.gpu.specs",
    "get_backend": "freqopt.gpu.backends",
    "list_gpus": "freqopt.gpu.specs",
    "FreqoptError": "freqopt.errors",
    "UnknownNameError": "freqopt.errors",
    "InvalidSettingError": "freqopt.errors",
    "ClockTableError": "freqopt.errors",
    "TableWorkloadError": "freqopt.errors",
    "OutputError": "freqopt.errors",
    "StorageError": "freqopt.errors",
    "GPUPermissionError": "freqopt.errors",
    "TraceMismatchError": "freqopt.errors",
    "NVMLError": "freqopt.gpu.nvml",
    "plan_pipeline": "freqopt.pipeline.planner",
    "PipelinePlanner": "freqopt.pipeline.planner",
    "load_stage_profile": "freqopt.pipeline.profile",
    "EnergyMonitor": "freqopt.measure.monitor",
    "WindowMeasurement": "freqopt.measure.monitor",
    "measure_command": "freqopt.measure.monitor",
    "measure_stage_profile": "freqopt.measure.stage_profile",
    "serve_search": "freqopt.search.serving",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'freqopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # next time a plain attribute: no __getattr__ call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """freqopt's module class: the import system's binding of a submodule whose name is also a top-level function
    (freqopt.search) is ignored, so that name stays the function (module docstring)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return  # every lazy name is a function or class, never a module
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
