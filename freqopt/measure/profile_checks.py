"""The checks of a profile's arguments that need no model built (nor PyTorch imported, for a model name):
freqopt.measure.profile.profile runs them first, and the command line runs them before it imports the modules that
load PyTorch, so that a wrong argument is refused at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import Backend, ClockSetting
from freqopt.gpu.specs import GPUSpec

__all__ = ["ProfileArguments", "check_profile_arguments"]


@dataclass(frozen=True)
class ProfileArguments:
    """A profile's arguments, checked (check_profile_arguments).

    Attributes:
        spec: the GPU type asked for, or None (h100-sxm simulated, the real GPU's on nvml).
        backend: the backend's name, checked, or the Backend given.
        real: whether the backend is a real GPU (it is only read).
        setting: the one setting the simulated step runs at (None fields: the GPU's defaults).
    """

    spec: GPUSpec | None
    backend: Backend | str
    real: bool
    setting: ClockSetting


def check_profile_arguments(workload, backend: Backend | str = "sim", *, gpu=None, device: str | None = None,
                            steps: int = 10, warmup_steps: int = 3, micro_batch_size: int | None = None,
                            seq_len: int | None = None, n_heads: int | None = None,
                            vocab_multiple: int | None = None, layout=None, sm_clock_mhz: int | None = None,
                            mem_clock_mhz: int | None = None,
                            power_limit_w: float | None = None, host=None) -> ProfileArguments:  # fmt: skip
    """Check the arguments of freqopt.measure.profile.profile (see there) that need no model built, in the order it
    always had: the model's name and overrides (freqopt.resolve.check_workload_arguments; a Trace with none and on
    the simulated GPU only), no pipeline layout, the GPU type, the backend, steps and warmup_steps; on nvml no
    setting asked for and one rank only, on the simulated GPU no device and, where the backend is named, clocks and
    a power limit the GPU type supports. What needs the model or PyTorch (heads, the device on nvml, the step's
    memory) is checked when profile resolves it.

    Raises:
        UnknownNameError: unknown model, GPU type, host or backend.
        InvalidSettingError: as profile, for the arguments above.
    """
    from freqopt.errors import check_positive_int
    from freqopt.gpu.specs import DEFAULT_GPU, get_gpu
    from freqopt.resolve import check_workload_arguments, resolve_backend, resolve_gpu, resolve_trace_or_workload

    sizes = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
             "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    if isinstance(workload, str):
        workload_layout = check_workload_arguments(workload, **sizes)
    else:  # a Workload or Trace: built already, and PyTorch with it
        traced, resolved = resolve_trace_or_workload(workload, **sizes)
        if traced is not None and (backend.name if isinstance(backend, Backend) else backend) != "sim":
            raise InvalidSettingError("backend must be 'sim' for a trace, profiled on the simulated GPU only: on a "
                                      "real GPU profile a model name or Workload, which freqopt can build and train",
                                      argument="backend")  # fmt: skip
        workload_layout = resolved.layout
    workload_layout.refuse_pipeline("the profile")
    spec = resolve_gpu(gpu, host=host)
    backend = resolve_backend(backend)
    check_positive_int("steps", steps)
    if warmup_steps < 0:
        raise InvalidSettingError(f"warmup_steps must not be negative, not {warmup_steps}")
    real = not backend.simulated if isinstance(backend, Backend) else backend == "nvml"
    setting = ClockSetting(sm_clock_mhz, mem_clock_mhz, power_limit_w)
    if real:
        for name, value in dataclasses.asdict(setting).items():
            if value is not None:
                raise InvalidSettingError(f"{name} applies to the simulated GPU; on nvml profile only reads the GPU "
                                          "at its current settings and never sets one", argument=name)  # fmt: skip
        if workload_layout.world_size > 1:
            raise InvalidSettingError(f"profile on a real GPU trains one GPU; pass a single-GPU layout, not "
                                      f"{workload_layout} (the simulated GPU profiles one rank of any "
                                      "layout)")  # fmt: skip
    elif device is not None:
        raise InvalidSettingError("device applies to backend nvml; the simulated GPU trains nothing", argument="device")
    if not real and isinstance(backend, str):  # the simulated GPU of a known type: before tracing, which takes a while
        setting.check_supported(spec or get_gpu(DEFAULT_GPU))
    return ProfileArguments(spec, backend, real, setting)
