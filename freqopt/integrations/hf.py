"""Apply a clock table while a Hugging Face ``transformers.Trainer`` trains: ``FreqoptCallback``.

    from freqopt.integrations.hf import FreqoptCallback

    callback = FreqoptCallback("tables/gpt3-small-h100-sxm-1pct-pass.json", trace)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with callback:  # exits the runtime (and restores the GPU) also when training raises
        trainer.train()

On ``on_train_begin`` the callback enters a ``freqopt.apply.runtime.DVFSRuntime`` on the Trainer's model, which must be
the module the trace was recorded from (the runtime checks it, freqopt.workload.fingerprint); ``on_pre_optimizer_step``
marks the optimizer phase (Trainer calls it after gradient clipping, just before ``optimizer.step()``, so the
clipping kernels run at the last backward phase's clocks); ``on_train_end`` exits the runtime, restoring the GPU.

Trainer calls no callback when training raises, so an exception would leave the runtime entered: its hooks on the
model and, on a real GPU, the table's clocks. Three things restore it: the ``with callback:`` block above (or
``callback.close()`` in a ``finally``); on a real GPU, the NVML backend's ``GPUStateGuard``, which restores the GPU
when the process exits (atexit) or receives SIGINT or SIGTERM; and, after a SIGKILL, ``freqopt reset``.

transformers is optional: ``import freqopt`` never imports it, and importing this module without it raises
``MissingDependencyError`` saying how to install it (freqopt.errors.install_hint("hf"): ``pip install
'transformers>=4.47' 'accelerate>=1.1'``, or ``pip install -e '.[hf]'`` in the freqopt checkout).
"""

from __future__ import annotations

import os

import torch

from freqopt.gpu.backends.base import Backend, Measurement
from freqopt.errors import InvalidSettingError, MissingDependencyError, UnknownNameError, install_hint
from freqopt.workload.models.gpt3 import GPTConfig, GPTModel
from freqopt.apply.runtime import DVFSRuntime
from freqopt.tables import ClockTable, load_table
from freqopt.workload.trace import Trace

try:
    from transformers import TrainerCallback
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "transformers":
        raise
    raise MissingDependencyError(
        f"freqopt.integrations.hf needs Hugging Face transformers: {install_hint('hf')}"
    ) from e

__all__ = ["FreqoptCallback", "TrainerGPT", "BACKEND_CHOICES"]

BACKEND_CHOICES = ("auto", "sim", "nvml")


class TrainerGPT(GPTModel):
    """freqopt's GPT (freqopt.workload.models.GPTModel) as ``transformers.Trainer`` calls a model: ``forward(input_ids,
    labels)`` returns ``{"loss": ...}``, the mean cross-entropy of the logits at each position against ``labels``
    (B, T) at the same position, so labels are the next tokens, as in GPTModel.forward.

    It adds no module or parameter, so the trace of the GPT workload (trace_iteration) is its trace. Its GPTConfig
    is ``gpt_config``; ``config`` is None, since Trainer writes ``model.config.use_cache`` on models with a config
    and a GPTConfig is frozen.
    """

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.gpt_config, self.config = config, None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if labels is None:
            return {"logits": super().forward(input_ids)}  # (B, T, V)
        return {"loss": super().forward(input_ids, labels)}


class FreqoptCallback(TrainerCallback):
    """A Trainer callback that runs the training under a DVFS runtime applying ``table`` (module docstring).

    Args:
        table: the clock table (a ClockTable, or the path of its JSON file), or None for default settings (the
            runtime still follows the phases).
        trace: the trace of the model the Trainer trains (freqopt.workload.trace.trace_iteration of its workload).
        backend: where the settings go. "auto" (the default): the NVML backend of the model's GPU when the model is
            on a CUDA device when training begins, else "sim". "sim": the simulated GPU of the table's type
            (nothing real changes; each step's simulated time and energy are kept in ``step_measurements``).
            "nvml": the GPU ``model`` is on (needs root or CAP_SYS_ADMIN). Or a Backend instance, which the
            callback closes when training ends.
        check_trace: refuse a model the trace was not recorded from (DVFSRuntime).

    Attributes:
        runtime: the DVFSRuntime while training runs, else None.
        step_measurements: on the simulated backend, each optimizer step's simulated iteration with the settings
            the runtime requested (DVFSRuntime.step_measurement), in order.

    Raises:
        ClockTableError: ``table`` is a path that is not a readable clock table, or (when training begins) is
            for another GPU type than the backend's.
        UnknownNameError: an unknown backend name.
    """

    def __init__(self, table: ClockTable | str | os.PathLike | None, trace: Trace, *,
                 backend: Backend | str = "auto", check_trace: bool = True):  # fmt: skip
        self._source = str(table) if isinstance(table, (str, os.PathLike)) else "clock table"
        self.table = load_table(table) if isinstance(table, (str, os.PathLike)) else table
        if isinstance(backend, str) and backend not in BACKEND_CHOICES:
            raise UnknownNameError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_CHOICES)} or "
                                   "pass a freqopt Backend")  # fmt: skip
        self.trace, self.backend, self.check_trace = trace, backend, check_trace
        self.runtime: DVFSRuntime | None = None
        self.step_measurements: list[Measurement] = []

    # -- the backend -----------------------------------------------------------------------------------------
    def _open_backend(self, model: torch.nn.Module) -> Backend:
        if not isinstance(self.backend, str):
            return self.backend
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        name = self.backend if self.backend != "auto" else ("nvml" if device.type == "cuda" else "sim")
        if name == "sim":
            from freqopt.gpu.backends import get_backend
            from freqopt.gpu.specs import get_gpu

            return get_backend("sim", get_gpu(self.table.gpu) if self.table is not None else None)
        from freqopt.gpu.backends.nvml import NVMLBackend
        from freqopt.gpu.nvml import NVMLError, open_devices

        if device.type != "cuda":
            raise InvalidSettingError(
                f"backend 'nvml' needs the model on a CUDA device, not {device}; use backend 'sim'"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        devices = open_devices()
        if index >= len(devices):
            raise NVMLError(
                f"NVML sees {len(devices)} GPU(s) but the model is on cuda:{index}; check CUDA_VISIBLE_DEVICES"
            )
        return NVMLBackend(devices[index], torch_device=f"cuda:{index}")

    # -- Trainer events --------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.runtime is not None:
            raise InvalidSettingError("FreqoptCallback is already running a training; call close() before reusing it")
        if model is None:
            raise InvalidSettingError("FreqoptCallback got no model from the Trainer; pass model= to Trainer")
        backend = self._open_backend(model)
        try:
            if self.table is not None:
                self.table.check_gpu(backend.spec, source=self._source)
            runtime = DVFSRuntime(model, None, table=self.table, backend=backend, trace=self.trace,
                                  check_trace=self.check_trace)  # fmt: skip
        except BaseException:
            backend.close()
            raise
        self.step_measurements.clear()
        self.runtime = runtime.__enter__()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.runtime is not None:
            self.runtime.mark_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self.runtime is not None and self.runtime.simulated:
            self.step_measurements.append(self.runtime.step_measurement())

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    # -- cleanup ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Exit the runtime (hooks removed, controller stopped, GPU restored); does nothing when none runs."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.__exit__(None, None, None)

    def __enter__(self) -> FreqoptCallback:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
