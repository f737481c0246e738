"""Backends: where measurements come from. ``sim`` (the default) is the simulated GPU."""

from __future__ import annotations

from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting, Measurement, MeasurementProtocol
from freqopt.errors import UnknownNameError
from freqopt.gpu.specs import GPUSpec

__all__ = ["Backend", "ClockSetting", "DEFAULT_SETTING", "Measurement", "MeasurementProtocol", "BACKENDS",
           "get_backend", "check_backend", "local_device"]

BACKENDS = ("sim", "nvml", "amdsmi")


def check_backend(name: str) -> str:
    """Raise UnknownNameError unless ``name`` is a backend."""
    if name not in BACKENDS:
        raise UnknownNameError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return name


def local_device(device: int | None = None) -> int:
    """The GPU this process measures on, as an index among the visible ones (CUDA_VISIBLE_DEVICES order):
    ``device`` where given, else the LOCAL_RANK a launcher sets (torchrun, DeepSpeed's launcher; under Slurm,
    ``LOCAL_RANK=$SLURM_LOCALID``), else 0.

    Raises:
        InvalidSettingError: ``device`` or LOCAL_RANK not an integer >= 0.
    """
    import os

    from freqopt.errors import InvalidSettingError

    if device is None:
        local = os.environ.get("LOCAL_RANK", "0")
        if not local.isdigit():
            raise InvalidSettingError(f"LOCAL_RANK must be an integer >= 0, not {local!r}; pass device to choose the GPU")
        return int(local)
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise InvalidSettingError(f"device must be a GPU index >= 0 among the visible ones, not {device!r}",
                                  argument="device")  # fmt: skip
    return device


def get_backend(name: str, spec: GPUSpec | None, *, seed: int = 0, read_only: bool = False,
                device: int | None = None) -> Backend:  # fmt: skip
    """A backend by name: "sim" (a simulated GPU of type ``spec``, this process's own), "nvml" (the real NVIDIA GPU
    ``local_device(device)`` among the visible ones, whose type must be ``spec``'s when one is given) or "amdsmi"
    (the same, an AMD GPU through AMD SMI: freqopt.gpu.amdsmi).

    Raises:
        UnknownNameError: unknown backend name.
        InvalidSettingError: read_only with the simulated GPU, a GPU type other than the real GPU's, or a bad
            device (local_device).
        NVMLError: no such visible GPU (AMDSMIError, its subclass, for "amdsmi"); GPUPermissionError: see
            freqopt.gpu.nvml.
    """
    from freqopt.errors import InvalidSettingError

    index = local_device(device)
    if name == "sim":
        if read_only:
            raise InvalidSettingError("read_only applies to backend nvml; the simulated GPU changes nothing real")
        from freqopt.gpu.backends.simulated import SimulatedGPU
        from freqopt.gpu.specs import DEFAULT_GPU, get_gpu

        return SimulatedGPU(spec or get_gpu(DEFAULT_GPU), seed=seed)
    if name in ("nvml", "amdsmi"):
        from freqopt.gpu.backends.nvml import NVMLBackend
        from freqopt.gpu.nvml import NVMLError, open_devices

        if name == "amdsmi":
            from freqopt.gpu.amdsmi import open_amd_devices
            from freqopt.gpu.backends.amdsmi import AMDSMIBackend

            devices, backend_class = open_amd_devices(read_only=read_only), AMDSMIBackend
        else:
            devices, backend_class = open_devices(read_only=read_only), NVMLBackend
        if not devices:
            raise NVMLError("no GPU is visible (CUDA_VISIBLE_DEVICES); use backend sim (the simulated GPU)")
        if index >= len(devices):
            raise NVMLError(f"device {index} is not visible: {len(devices)} GPU(s) are (CUDA_VISIBLE_DEVICES); give "
                            "a device below that, or start as many processes per machine as it has GPUs")  # fmt: skip
        import torch

        # Kernels are replayed on that CUDA device; without CUDA (tests with a stand-in NVML) on the CPU.
        backend = backend_class(devices[index], torch_device=f"cuda:{index}" if torch.cuda.is_available() else "cpu")
        if spec is not None and backend.spec.name != spec.name:
            backend.close()
            raise InvalidSettingError(f"gpu {spec.name} was asked for, but GPU {index} is a {backend.spec.name}; "
                                      f"give no gpu with backend {name}")  # fmt: skip
        return backend
    raise UnknownNameError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
