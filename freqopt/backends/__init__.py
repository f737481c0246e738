"""Backends: where measurements come from. ``sim`` (the default) is the simulated GPU."""

from __future__ import annotations

from freqopt.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.errors import UnknownNameError
from freqopt.gpus import GPUSpec

__all__ = ["Backend", "ClockSetting", "DEFAULT_SETTING", "Measurement", "MeasurementProtocol", "BACKENDS",
           "get_backend"]

BACKENDS = ("sim",)


def get_backend(name: str, spec: GPUSpec, *, seed: int = 0) -> Backend:
    """A backend by name.

    Raises:
        UnknownNameError: unknown backend name.
    """
    if name == "sim":
        from freqopt.backends.simulated import SimulatedGPU

        return SimulatedGPU(spec, seed=seed)
    raise UnknownNameError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
