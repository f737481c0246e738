"""Phases: where a running job can switch clocks, and what a clock table becomes once switching has a cost.

A DVFS runtime cannot switch clocks between any two kernels: it sees the job only at module hooks and the
optimizer step (design.md section 6), and a switch takes milliseconds to land (``GPUSpec.clock_switch_s``: about
6 ms on Hopper, over 100 ms on consumer parts; Velicka et al. 2025, Spaan et al. 2026). So:

* ``PhaseHooks`` marks a boundary at the start of the forward and of the backward of every phase module (each
  child of a transformer block, the embeddings, the final norm and the output layer) and at the optimizer step.
  The tracer records the same marks, so a phase is the span of traced kernels between two marks, and the
  runtime, counting marks, always knows which phase the GPU is entering.
* ``realizable_settings`` turns a per-kernel schedule into what a runtime can apply: each phase takes the setting
  its kernels spend most time in, and a switch is made only into a run of consecutive phases wanting the same
  setting that lasts at least the switch cost (shorter runs keep the clocks already set). The simulated GPU then applies each switch one switch latency
  late (``SimulatedGPU.run(..., switch_latency_s=...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch.nn as nn

if TYPE_CHECKING:  # freqopt.backends imports the tracer, which imports this module
    from freqopt.backends.base import ClockSetting

__all__ = ["STEP_MARK", "phase_modules", "PhaseHooks", "phase_spans", "realizable_settings", "Realizer"]

STEP_MARK = "step"

# Embeddings take token ids, which need no gradient; their backward pre-hook still fires, as intended.
_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to"


@contextlib.contextmanager
def quiet_backward_hooks():
    """A context in which PyTorch's warning about full backward hooks on modules without gradient inputs (the
    embeddings) is silenced; wrap ``loss.backward()`` in it when using ``PhaseHooks`` directly (DVFSRuntime
    silences it itself while entered)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HOOK_WARNING)
        yield


def phase_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules whose forward and backward starts are phase boundaries: the children of every block in the
    model's ModuleList of blocks, and the model's other direct children (embeddings, final norm, output layer).
    A child that holds the ModuleList further down (a Hugging Face model's ``model`` or ``transformer``, or a
    wrapper around one) is searched in turn, so ``LlamaForCausalLM`` gives ``model.embed_tokens``,
    ``model.layers.0.self_attn``, ..., ``model.norm``, ``lm_head``. Works on a DeepSpeed engine's ``module`` too.
    Blocks' children come in registration order; the hooks mark them in the order they run."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            for i, block in enumerate(child):
                out.extend((f"{name}.{i}.{sub}", m) for sub, m in block.named_children())
        elif any(isinstance(m, nn.ModuleList) for m in child.modules()):
            out.extend((f"{name}.{sub}", m) for sub, m in phase_modules(child))
        else:
            out.append((name, child))
    return out


class PhaseHooks:
    """Calls ``on_mark(label)`` at every phase boundary of ``model``: ``fwd:NAME`` before a phase module's forward,
    ``bwd:NAME`` when its backward starts (a full backward pre-hook), and ``step`` from ``mark_step()``.

    Use as a context manager; the hooks are removed on exit.
    """

    def __init__(self, model: nn.Module, on_mark: Callable[[str], None]):
        self.model, self.on_mark = model, on_mark
        self.handles: list = []

    def __enter__(self) -> PhaseHooks:
        for name, module in phase_modules(self.model):
            self.handles.append(module.register_forward_pre_hook(lambda m, args, _n=name: self.on_mark(f"fwd:{_n}")))
            if any(p.requires_grad for p in module.parameters()):
                self.handles.append(module.register_full_backward_pre_hook(
                    lambda m, grad, _n=name: self.on_mark(f"bwd:{_n}")))  # fmt: skip
        return self

    def mark_step(self) -> None:
        self.on_mark(STEP_MARK)

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def phase_spans(marks: Sequence[tuple[str, int]], n_kernels: int) -> list[tuple[str, int, int]]:
    """(label, first kernel, end kernel) of every phase, from a trace's marks (label, kernel index); kernels before
    the first mark form a phase labelled "start". Empty phases are dropped."""
    spans = []
    points = [("start", 0)] + list(marks) + [("end", n_kernels)]
    for (label, first), (_, end) in zip(points, points[1:]):
        if end > first:
            spans.append((label, first, end))
    return spans


def realizable_settings(
    marks: Sequence[tuple[str, int]], settings: Sequence[ClockSetting], kernel_time_s: np.ndarray,
    switch_s: float,
) -> list[ClockSetting]:  # fmt: skip
    """The per-kernel settings a phase-switching runtime realizes for the per-kernel ``settings``.

    Args:
        marks: the trace's phase marks (Trace.meta["marks"]).
        settings: the wanted setting of every kernel, shape (K,).
        kernel_time_s: every kernel's time (at the default setting), shape (K,), s.
        switch_s: the GPU type's clock-switch latency, s.

    Returns:
        One setting per kernel, constant within each phase; a uniform schedule stays uniform.
    """
    from freqopt.backends.base import DEFAULT_SETTING

    spans = phase_spans(marks, len(settings))

    wanted = []  # per phase: the setting its kernels spend most time in, and the phase's duration
    for _, first, end in spans:
        weights: dict[ClockSetting, float] = {}
        for i in range(first, end):
            weights[settings[i]] = weights.get(settings[i], 0.0) + float(kernel_time_s[i])
        wanted.append((max(weights, key=weights.get), float(np.sum(kernel_time_s[first:end]))))
    runs: list[list] = []  # consecutive phases wanting the same setting: [setting, duration, phases]
    for setting, duration in wanted:
        if runs and runs[-1][0] == setting:
            runs[-1][1] += duration
            runs[-1][2] += 1
        else:
            runs.append([setting, duration, 1])

    if len(runs) == 1:  # one setting throughout: set once before the loop, never switched
        return [runs[0][0]] * len(settings)
    if runs[0][0] == runs[-1][0]:  # iterations run back to back: the last run continues into the first
        runs[0][1] = runs[-1][1] = runs[0][1] + runs[-1][1]

    def one_pass(current: ClockSetting) -> list[ClockSetting]:
        out: list[ClockSetting] = []
        phase = 0
        for setting, duration, n_phases in runs:
            if setting != current and duration >= switch_s:  # a switch pays only for a run as long as the switch
                current = setting
            for _, first, end in spans[phase : phase + n_phases]:
                out.extend([current] * (end - first))
            phase += n_phases
        return out

    # Iterations run back to back: the first phase starts with the clocks the previous iteration ended with.
    first = one_pass(DEFAULT_SETTING)
    return one_pass(first[-1]) if first else first


class Realizer:
    """Maps a per-kernel schedule of one trace to what a phase-switching runtime realizes on a GPU type
    (realizable_settings), with kernel times predicted by that type's simulated physics at default settings."""

    def __init__(self, trace, spec):
        from freqopt.backends.base import DEFAULT_SETTING
        from freqopt.backends.simulated import SimulatedGPU

        self.marks = trace.meta.get("marks", ())
        self.switch_s = spec.clock_switch_s
        time_s, _, _ = SimulatedGPU(spec, noise=False).run(trace.kernels, [DEFAULT_SETTING] * len(trace), loop=True)
        self.kernel_time_s = time_s
        self._cache: dict[tuple, tuple] = {}

    def __call__(self, schedule: tuple) -> tuple:
        if schedule not in self._cache:
            self._cache[schedule] = tuple(realizable_settings(self.marks, schedule, self.kernel_time_s, self.switch_s))
        return self._cache[schedule]
