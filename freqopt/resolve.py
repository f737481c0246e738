"""What a caller names, made into objects and checked: a model (with size overrides and a layout), a GPU type, a
backend. The API functions (freqopt.search, freqopt.profile) take names or objects alike through these helpers.
"""

from __future__ import annotations

from freqopt.gpu.backends import Backend, check_backend, get_backend
from freqopt.errors import InvalidSettingError
from freqopt.gpu.specs import DEFAULT_GPU, GPUSpec, get_gpu
from freqopt.workload.layout import Layout, parse_layout

__all__ = ["resolve_workload", "check_workload_arguments", "resolve_trace_or_workload", "resolve_gpu",
           "resolve_backend", "open_backend"]


def resolve_workload(model, *, micro_batch_size: int | None = None, seq_len: int | None = None,
                     n_heads: int | None = None, vocab_multiple: int | None = None,
                     layout: Layout | str | None = None):  # fmt: skip
    """A Workload from a model name and overrides (freqopt.workload.models.get_workload), or ``model`` itself if it is one.

    Args:
        model: a model name (freqopt.workload.models.list_models) or a Workload.
        micro_batch_size, seq_len, n_heads, vocab_multiple: see get_workload; only with a model name.
        layout: a Layout or its text ("dp=2,tp=4"); None: one GPU.

    Raises:
        UnknownNameError: unknown model.
        InvalidSettingError: a bad override or layout, or overrides given with a Workload (which is already sized).
    """
    from freqopt.workload.models import Workload, get_workload

    overrides = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
                 "vocab_multiple": vocab_multiple}  # fmt: skip
    layout = check_workload_arguments(model, **overrides, layout=layout)
    if isinstance(model, Workload):
        return model
    return get_workload(model, **overrides, layout=layout)


def check_workload_arguments(model, *, micro_batch_size: int | None = None, seq_len: int | None = None,
                             n_heads: int | None = None, vocab_multiple: int | None = None,
                             layout: Layout | str | None = None) -> Layout:  # fmt: skip
    """The checks of resolve_workload's arguments that need no model built (nor PyTorch imported), in its order:
    overrides given with a Workload, a model that is neither a name nor a Workload, the layout's text, the model's
    name (freqopt.workload.model_names.check_model_name; an ``hf:PATH`` passes, its config is read later) and the
    overrides that must be positive integers (for ``hf:PATH`` the micro-batch and sequence length). resolve_workload
    runs them first; a caller that refuses a wrong argument before importing PyTorch runs them alone, and
    the checks that need the model's configuration (heads dividing d_model and tp) come when it is resolved.

    Returns:
        The layout the workload takes: a Workload's own, else ``layout`` parsed (one GPU where None).

    Raises:
        UnknownNameError, InvalidSettingError: as resolve_workload.
    """
    from freqopt.errors import check_positive_int
    from freqopt.workload.layout import SINGLE_GPU
    from freqopt.workload.model_names import HF_PREFIX, check_model_name

    overrides = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "n_heads": n_heads,
                 "vocab_multiple": vocab_multiple, "layout": layout}  # fmt: skip
    if not isinstance(model, str):
        from freqopt.workload.models import Workload  # a Workload is built already, and PyTorch with it

        if not isinstance(model, Workload):
            raise InvalidSettingError(f"model must be a model name or a Workload, not {type(model).__name__}")
        given = [name for name, value in overrides.items() if value is not None]
        if given:
            raise InvalidSettingError(f"{', '.join(given)} apply to a model name, not to a Workload (already sized); "
                                      "pass them to freqopt.get_workload instead")  # fmt: skip
        return model.layout
    if layout is not None and not isinstance(layout, Layout):
        layout = parse_layout(layout)
    # get_workload's own checks, in its order (for hf:PATH, _hf_workload's that need no config read).
    sizes = ("micro_batch_size", "seq_len") if model.startswith(HF_PREFIX) else \
        ("micro_batch_size", "seq_len", "n_heads", "vocab_multiple")  # fmt: skip
    if not model.startswith(HF_PREFIX):
        check_model_name(model)
    for name in sizes:
        check_positive_int(name, overrides[name], optional=True)
    return layout or SINGLE_GPU


def resolve_trace_or_workload(model_or_trace, **sizes):
    """(trace, workload) from a Trace, which is used as traced (trace None otherwise), or from a model name or
    Workload and its size overrides (resolve_workload).

    Raises:
        InvalidSettingError: size overrides given with a Trace (already traced); see resolve_workload.
    """
    from freqopt.workload.kernels import Trace

    if not isinstance(model_or_trace, Trace):
        return None, resolve_workload(model_or_trace, **sizes)
    given = [name for name, value in sizes.items() if value is not None]
    if given:
        raise InvalidSettingError(f"{', '.join(given)} apply to a model name, not to a Trace (already traced); "
                                  "pass the model's name instead")  # fmt: skip
    return model_or_trace, model_or_trace.workload


def resolve_gpu(gpu: GPUSpec | str | None, *, host=None) -> GPUSpec | None:
    """The GPU type named ``gpu`` (freqopt.gpu.specs.get_gpu), ``gpu`` itself if it is a GPUSpec, or None; with
    ``host`` (a freqopt.gpu.host.HostSpec, or a host's name or TOML path), that GPU type (default h100-sxm) issued by
    that host (GPUSpec.with_host).

    Raises:
        UnknownNameError: unknown GPU type or host.
        InvalidSettingError: a host file freqopt cannot read.
    """
    if gpu is not None and not isinstance(gpu, (GPUSpec, str)):
        raise InvalidSettingError(f"gpu must be a GPU type's name or a GPUSpec, not {type(gpu).__name__}")
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if host is None:
        return spec
    from freqopt.gpu.host import HostSpec

    if not isinstance(host, (HostSpec, str)):
        raise InvalidSettingError(f"host must be a host's name, a host TOML path or a HostSpec, not {type(host).__name__}",
                                  argument="host")  # fmt: skip
    return (spec or get_gpu(DEFAULT_GPU)).with_host(host)


def resolve_backend(backend: Backend | str) -> Backend | str:
    """``backend`` checked: a Backend as is, or a known backend name (freqopt.gpu.backends.BACKENDS).

    Raises:
        UnknownNameError: unknown backend name.
    """
    if isinstance(backend, Backend):
        return backend
    if not isinstance(backend, str):
        raise InvalidSettingError(f"backend must be a backend name (sim, nvml, amdsmi) or a Backend, not "
                                  f"{type(backend).__name__}")  # fmt: skip
    return check_backend(backend)


def open_backend(backend: Backend | str, gpu: GPUSpec | None, *, seed: int = 0,
                 read_only: bool = False) -> tuple[Backend, bool]:  # fmt: skip
    """The backend to measure on, and whether the caller opened it here (and so must close it).

    A name opens one (freqopt.gpu.backends.get_backend): "sim" simulates ``gpu`` (default h100-sxm); "nvml" opens the
    first visible real GPU ("amdsmi": the first AMD GPU), which must be of type ``gpu`` when one is given. A Backend is used as given, and must
    be of type ``gpu`` when one is given.

    Raises:
        InvalidSettingError: the backend's GPU is not of type ``gpu``.
        NVMLError, GPUPermissionError: see freqopt.gpu.nvml.
    """
    if isinstance(backend, Backend):
        if gpu is not None and backend.spec.name != gpu.name:
            raise InvalidSettingError(f"gpu {gpu.name} was asked for, but the backend given measures a "
                                      f"{backend.spec.name}; pass no gpu, or a backend of that type")  # fmt: skip
        return backend, False
    spec = gpu if backend in ("nvml", "amdsmi") else gpu or get_gpu(DEFAULT_GPU)
    return get_backend(backend, spec, seed=seed, read_only=read_only), True
