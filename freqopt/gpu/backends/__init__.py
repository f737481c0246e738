"""Backends: where measurements come from. ``sim`` (the default) is the simulated GPU."""

from __future__ import annotations

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.errors import UnknownNameError
from freqopt.gpu.specs import GPUSpec

__all__ = ["Backend", "ClockSetting", "DEFAULT_SETTING", "Measurement", "MeasurementProtocol", "BACKENDS",
           "get_backend", "check_backend"]

BACKENDS = ("sim", "nvml")


def check_backend(name: str) -> str:
    """Raise UnknownNameError unless ``name`` is a backend."""
    if name not in BACKENDS:
        raise UnknownNameError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return name


def get_backend(name: str, spec: GPUSpec | None, *, seed: int = 0, read_only: bool = False) -> Backend:
    """A backend by name: "sim" (the simulated GPU of type ``spec``) or "nvml" (the first visible real GPU, whose
    type must be ``spec``'s when one is given).

    Raises:
        UnknownNameError: unknown backend name.
        InvalidSettingError: read_only with the simulated GPU, or a GPU type other than the real GPU's.
        NVMLError, GPUPermissionError: see freqopt.gpu.nvml.
    """
    from freqopt.errors import InvalidSettingError

    if name == "sim":
        if read_only:
            raise InvalidSettingError("read_only applies to backend nvml; the simulated GPU changes nothing real")
        from freqopt.gpu.backends.simulated import SimulatedGPU
        from freqopt.gpu.specs import DEFAULT_GPU, get_gpu

        return SimulatedGPU(spec or get_gpu(DEFAULT_GPU), seed=seed)
    if name == "nvml":
        from freqopt.gpu.backends.nvml import NVMLBackend
        from freqopt.gpu.nvml import NVMLError, open_devices

        devices = open_devices(read_only=read_only)
        if not devices:
            raise NVMLError("no GPU is visible (CUDA_VISIBLE_DEVICES); use backend sim (the simulated GPU)")
        import torch

        # Kernels are replayed on the first visible CUDA device; without CUDA (tests with a stand-in NVML) on the CPU.
        backend = NVMLBackend(devices[0], torch_device="cuda:0" if torch.cuda.is_available() else "cpu")
        if spec is not None and backend.spec.name != spec.name:
            backend.close()
            raise InvalidSettingError(f"gpu {spec.name} was asked for, but GPU 0 is a {backend.spec.name}; give no gpu with backend nvml")
        return backend
    raise UnknownNameError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
