"""The serving runtime: a serving loop's prefill and decode steps, each at its own GPU setting.

    with ServingRuntime(backend, prefill=row.prefill.setting, decode=row.decode.setting) as runtime:
        runtime.attach(model)              # a Hugging Face model: its forward calls mark the phases
        model.generate(input_ids, max_new_tokens=64)

or, in an engine's own loop (vLLM's model runner, say), around each step:

    with runtime.phase("prefill"):
        run_prefill(batch)
    with runtime.phase("decode"):
        run_decode_step(batch)

A phase's setting is requested when the phase is entered, and only where it differs from the one last requested;
the set calls run on the runtime's own thread (freqopt.apply.runtime.ClockWorker, DVFSRuntime's: the serving thread
never waits for NVML), after the GPU has reached the phase's start (a CUDA event recorded at entry, where PyTorch has
CUDA). A Hugging Face model's forward calls are told apart by their cache position: a call that starts at position 0
(``cache_position[0] == 0``, or, without it, one that feeds more than one token per sequence) is a prefill, every
later one a decode step. On exit, exception, SIGINT and SIGTERM the backend restores what it found
(freqopt.gpu.nvml.GPUStateGuard); where $FREQOPT_DAEMON names freqoptd, the set calls go through it.

A switch takes the GPU file's ``clock_switch_ms`` (26 ms on the H100), longer than a decode step: per-phase settings
pay only where prefills and runs of decode steps each outlast it (freqopt.search.serving: ServingRow.
per_phase_realizable). For an engine that prefills inside its decode steps, give one setting (``ServingRuntime(
backend, setting=row.one_setting.setting)``).
"""

from __future__ import annotations

import threading

import torch

from freqopt.apply.runtime import ClockWorker, stop_clock_worker
from freqopt.errors import InvalidSettingError
from freqopt.gpu.backends.base import DEFAULT_SETTING, Backend, ClockSetting

__all__ = ["ServingRuntime", "PHASES"]

PHASES = ("prefill", "decode")


class _Phase:
    def __init__(self, runtime: ServingRuntime, name: str):
        self.runtime, self.name = runtime, name

    def __enter__(self):
        self.runtime.enter(self.name)
        return self

    def __exit__(self, *exc) -> None:
        return None


class ServingRuntime:
    """Apply per-phase settings (prefill, decode) to a serving loop (module docstring).

    Args:
        backend: the GPU (NVMLBackend or AMDSMIBackend; a SimulatedGPU records what it is given).
        prefill, decode: each phase's setting (ClockSetting; None: the GPU's default settings).
        setting: one setting for both phases, in place of prefill and decode (a unified batch's).

    Attributes:
        requested: the phases entered whose setting differed from the last one asked for, in order (phase name,
            setting); switches: how many.

    Raises:
        InvalidSettingError: ``setting`` with ``prefill`` or ``decode``; a setting the GPU does not support; an
            unknown phase (``phase``, ``enter``).
    """

    def __init__(self, backend: Backend, *, prefill: ClockSetting | None = None, decode: ClockSetting | None = None,
                 setting: ClockSetting | None = None):  # fmt: skip
        if setting is not None and (prefill is not None or decode is not None):
            raise InvalidSettingError("setting holds both phases; give it, or prefill and decode, not both",
                                      argument="setting")  # fmt: skip
        if setting is not None:
            prefill = decode = setting
        self.settings = {"prefill": prefill or DEFAULT_SETTING, "decode": decode or DEFAULT_SETTING}
        for value in self.settings.values():
            value.check_supported(backend.spec)
        self.backend = backend
        self._worker = ClockWorker(backend)
        self._thread = threading.Thread(target=self._worker.run, name="freqopt-serving-dvfs", daemon=True)
        self._current: ClockSetting | None = None
        self._handles: list = []
        self.requested: list[tuple[str, ClockSetting]] = []

    @property
    def switches(self) -> int:
        return len(self.requested)

    def phase(self, name: str) -> _Phase:
        """A context manager: the block is phase ``name`` ("prefill" or "decode")."""
        self._check(name)
        return _Phase(self, name)

    def _check(self, name: str) -> None:
        if name not in PHASES:
            raise InvalidSettingError(f"phase must be prefill or decode, not {name!r}", argument="phase")

    def enter(self, name: str) -> None:
        """Phase ``name`` begins: request its setting if it differs from the one last requested. Never waits for
        the GPU; raises the first error a set call raised (on the runtime's thread) since the last call."""
        self._check(name)
        if self._worker.error is not None:
            raise self._worker.error
        setting = self.settings[name]
        if setting == self._current:
            return
        event = None
        if torch.cuda.is_available() and not self.backend.simulated:
            event = torch.cuda.Event()
            event.record()
        self._worker.requests.put((event, setting))
        self._current = setting
        self.requested.append((name, setting))

    def attach(self, model: torch.nn.Module):
        """Mark the phases on a Hugging Face model's forward calls (a forward pre-hook with its keyword arguments:
        ``generate`` calls it once per step). Removed on exit; returns the hook's handle."""

        def hook(module, args, kwargs):
            position = kwargs.get("cache_position")
            if position is not None and position.numel():
                prefill = int(position.reshape(-1)[0]) == 0
            else:
                ids = kwargs.get("input_ids", args[0] if args else None)
                prefill = ids is not None and ids.dim() == 2 and ids.shape[1] > 1
            self.enter("prefill" if prefill else "decode")

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        self._handles.append(handle)
        return handle

    def __enter__(self) -> ServingRuntime:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        stop_clock_worker(self._worker, self._thread)
        self.backend.close()
        if exc[0] is None and self._worker.error is not None:
            raise self._worker.error
